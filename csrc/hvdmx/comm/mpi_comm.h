// Comm over an MPI communicator that this object duplicates and owns, so our
// traffic never matches the user's own MPI calls. Also the one place that
// asks MPI about the job's topology.
#ifndef HVDMX_MPI_COMM_H_
#define HVDMX_MPI_COMM_H_

#include <mpi.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "comm/group.h"
#include "config/env_config.h"

namespace hvdmx {

class MpiComm : public Comm {
 public:
  // Duplicates `comm` (collective over it).
  explicit MpiComm(MPI_Comm comm);
  ~MpiComm() override;  // frees the duplicate (collective)
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  MPI_Comm handle() const { return comm_; }

  Request ISend(const void* buf, int64_t bytes, int peer) override;
  Request IRecv(void* buf, int64_t bytes, int peer) override;
  void Wait(Request request) override;
  void Bcast(void* buf, int64_t bytes, int root) override;
  std::vector<std::string> Gather(const std::string& mine, int root) override;
  void BcastString(std::string* data, int root) override;
  void StartBitAnd(uint64_t* words, int n) override;
  bool TestBitAnd() override;
  bool NativeAllreduce(void* buf, int64_t count, DataType dtype, ReduceOp op) override;

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  // Requests live in slots; a Request is a slot index. Freed slots are reused.
  // Stores `req` in a free slot and returns the slot as the Request.
  Request Keep(MPI_Request req);
  // Completes a nonblocking call of the negotiation, polled with idle_ when
  // one is set (see Comm::set_idle).
  void Complete(MPI_Request* req, const char* what);

  std::vector<MPI_Request> requests_;
  std::vector<int64_t> free_slots_;
  MPI_Request bit_and_request_ = MPI_REQUEST_NULL;
};

// A Group over an MPI communicator that it duplicates and owns (or over
// one Split made, which it owns too). Host: MPI's idea of one
// (MPI_COMM_TYPE_SHARED).
class MpiGroup : public Group {
 public:
  // Duplicates `comm` (collective over it).
  explicit MpiGroup(MPI_Comm comm);
  ~MpiGroup() override;  // frees the communicator, unless MPI is finalized
  MpiGroup(const MpiGroup&) = delete;
  MpiGroup& operator=(const MpiGroup&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  MPI_Comm handle() const { return comm_; }
  std::vector<std::string> Allgather(const std::string& mine) override;
  std::unique_ptr<Group> Split(int color, int key) override;
  std::unique_ptr<Group> SplitByHost() override;
  bool private_channel() const override { return true; }

 private:
  struct Adopt {};
  MpiGroup(MPI_Comm comm, Adopt);  // takes `comm` as it is
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
};

// What a comm over a group carries, which decides the ranks its TCP links
// reach: the negotiation (P2PComm::NegotiationPeers) or the collectives'
// bytes (P2PComm::DataPeers; Note [The data comm's links] in p2p_comm.h).
enum class CommUse { kNegotiation, kData };

// A communicator over the ranks of `group`: MPI's (a duplicate of an
// MpiGroup's communicator), or, when config.transport is kTcp, a TcpComm
// whose addresses travel by one allgather over `group`;
// `ranks_outnumber_cpus` sets its spin (TcpOptionsFor). Its TCP links
// reach the ranks `use` names, and for kData those of `more_peers` too
// (which must be symmetric over the group). Collective over `group`; the transport is MPI
// only over an MpiGroup (Init sees to it).
std::unique_ptr<Comm> CommOver(Group& group, const Config& config, bool ranks_outnumber_cpus,
                               CommUse use, const std::vector<int>& more_peers = {});

// Makes sure every rank of `group` holds a secret key for the job's TCP
// connections (Config::secret_key): if no rank has one, rank 0 makes one
// from the operating system's random source and sends it over `group`,
// when its channel is private (an MPI communicator: the launcher's, which
// it already trusts); a group that is not (a rendezvous over the network)
// never carries one, and a job on it without a key is an error. If every
// rank has one, each keeps its own (ranks with different keys then refuse
// each other's connections); if only some do, an error on every rank says
// so. Collective over `group`.
Status AgreeOnSecretKey(Group& group, std::string* key);

// Every rank's string (index = rank): an allgather over `comm`, collective.
std::vector<std::string> MpiAllgatherStrings(MPI_Comm comm, const std::string& mine);

// Whether this host's ranks of `group` outnumber the CPUs this process may
// run on. Collective over `group`.
bool HostRanksOutnumberCpus(Group& group);

// Initializes MPI with MPI_THREAD_MULTIPLE unless it already is (mpi4py
// normally does it first). Returns the thread level provided.
int EnsureMpiInitialized();

}  // namespace hvdmx

#endif  // HVDMX_MPI_COMM_H_
