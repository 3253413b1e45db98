// MPI, and nothing else: a Comm over an MPI communicator that this object
// duplicates and owns, so our traffic never matches the user's own MPI
// calls; a Group over one (which asks MPI which ranks share a host); MPI's
// initialization. What runs over MPI and what over TCP is the job's choice
// (job/comm_wiring.h). Every MPI call goes through the plugin
// (comm/mpi_library.h, Note [MPI as a plugin] in mpi/mpi_plugin.h),
// which must be loaded before any of these is made; handles are its
// hvdmx_mpi_handle.
#ifndef HVDMX_MPI_COMM_H_
#define HVDMX_MPI_COMM_H_

#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "comm/group.h"
#include "comm/mpi_library.h"

namespace hvdmx {

class MpiComm : public Comm {
 public:
  // Duplicates `comm` (collective over it).
  explicit MpiComm(hvdmx_mpi_handle comm);
  ~MpiComm() override;  // frees the duplicate (collective)
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  hvdmx_mpi_handle handle() const { return comm_; }

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
  const hvdmx_mpi_api& mpi_;
  hvdmx_mpi_handle comm_;
  int rank_ = 0;
  int size_ = 1;
  // Requests live in slots; a Request is a slot index. Freed slots are reused.
  // Stores `req` in a free slot and returns the slot as the Request.
  Request Keep(hvdmx_mpi_handle req);
  // Completes a nonblocking call of the negotiation, polled with idle_ when
  // one is set (see Comm::set_idle).
  void Complete(hvdmx_mpi_handle* req, const char* what);

  std::vector<hvdmx_mpi_handle> requests_;
  std::vector<int64_t> free_slots_;
  hvdmx_mpi_handle bit_and_request_;
};

// A Group over an MPI communicator that it duplicates and owns (or over
// one Split made, which it owns too). Host: MPI's idea of one
// (MPI_COMM_TYPE_SHARED).
class MpiGroup : public Group {
 public:
  // Duplicates `comm` (collective over it).
  explicit MpiGroup(hvdmx_mpi_handle comm);
  ~MpiGroup() override;  // frees the communicator, unless MPI is finalized
  MpiGroup(const MpiGroup&) = delete;
  MpiGroup& operator=(const MpiGroup&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  hvdmx_mpi_handle handle() const { return comm_; }
  std::vector<std::string> Allgather(const std::string& mine) override;
  std::unique_ptr<Group> Split(int color, int key) override;
  std::unique_ptr<Group> SplitByHost() override;
  bool private_channel() const override { return true; }

 private:
  struct Adopt {};
  MpiGroup(hvdmx_mpi_handle comm, Adopt);  // takes `comm` as it is
  const hvdmx_mpi_api& mpi_;
  hvdmx_mpi_handle comm_;
  int rank_ = 0;
  int size_ = 1;
};

// Every rank's string (index = rank): an allgather over `comm`, collective.
std::vector<std::string> MpiAllgatherStrings(hvdmx_mpi_handle comm, const std::string& mine);

// Initializes MPI with MPI_THREAD_MULTIPLE unless it already is (mpi4py
// normally does it first). Returns the thread level provided, and sets
// *multiple to whether it is MPI_THREAD_MULTIPLE.
int EnsureMpiInitialized(bool* multiple);

}  // namespace hvdmx

#endif  // HVDMX_MPI_COMM_H_
