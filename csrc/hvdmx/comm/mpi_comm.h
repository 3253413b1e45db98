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

// A communicator over the ranks of `comm`: MPI's (a duplicate), or, when
// config.transport is kTcp, a TcpComm whose addresses travel by one MPI
// allgather over `comm`; `ranks_outnumber_cpus` sets its spin
// (TcpOptionsFor). A comm that only negotiates (`for_negotiation`) links
// only with the ranks P2PComm::NegotiationPeers names. Collective over
// `comm`.
std::unique_ptr<Comm> CommOver(MPI_Comm comm, const Config& config, bool ranks_outnumber_cpus,
                               bool for_negotiation = false);

// Makes sure every rank of `comm` holds a secret key for the job's TCP
// connections (Config::secret_key): if no rank has one, rank 0 makes one
// from the operating system's random source and sends it over `comm`, whose
// channel the launcher already trusts. If every rank has one, each keeps
// its own (ranks with different keys then refuse each other's
// connections); if only some do, an error on every rank says so.
// Collective over `comm`.
Status AgreeOnSecretKey(MPI_Comm comm, std::string* key);

// Every rank's string (index = rank): an allgather over `comm`, collective.
// How a TcpComm's ranks learn each other's addresses.
std::vector<std::string> MpiAllgatherStrings(MPI_Comm comm, const std::string& mine);

// How many ranks of `comm` share this host (MPI's idea of a host).
// Collective over `comm`.
int HostRankCount(MPI_Comm comm);

// Whether this host's ranks of `comm` outnumber the CPUs this process may
// run on (MPI's idea of a host). Collective over `comm`.
bool HostRanksOutnumberCpus(MPI_Comm comm);

// Initializes MPI with MPI_THREAD_MULTIPLE unless it already is (mpi4py
// normally does it first). Returns the thread level provided.
int EnsureMpiInitialized();

}  // namespace hvdmx

#endif  // HVDMX_MPI_COMM_H_
