// An abstract communicator: what the negotiation and the collectives need
// from a transport, and nothing more. MpiComm (mpi_comm.h) is the real one;
// LocalComm (local_comm.h) runs one rank per thread inside one process so
// the ring and the negotiation round can be tested at any size without MPI.
//
// Threading: a Comm object is used by one thread at a time (the runtime's
// background thread). Every collective-style call must be made by all ranks
// of the communicator in the same order.
#ifndef HVDMX_COMM_H_
#define HVDMX_COMM_H_

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "base/common.h"

namespace hvdmx {

// Thrown by a Gather or BcastString that its comm's idle function gave up on
// (Comm::set_idle).
class CommAbandoned : public std::runtime_error {
 public:
  CommAbandoned() : std::runtime_error("a negotiation exchange was abandoned") {}
};

class Comm {
 public:
  using Request = int64_t;

  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Nonblocking point-to-point of at most kMaxMessageBytes. Every request
  // must be passed to Wait exactly once.
  static constexpr int64_t kMaxMessageBytes = int64_t{1} << 30;
  virtual Request ISend(const void* buf, int64_t bytes, int peer) = 0;
  virtual Request IRecv(void* buf, int64_t bytes, int peer) = 0;
  virtual void Wait(Request request) = 0;

  // Blocking broadcast of any number of bytes from `root`.
  virtual void Bcast(void* buf, int64_t bytes, int root) = 0;
  // Root receives every rank's string (index = rank); others get {}.
  virtual std::vector<std::string> Gather(const std::string& mine, int root) = 0;
  // Root's *data replaces everyone else's.
  virtual void BcastString(std::string* data, int root) = 0;
  // How Gather and BcastString wait for the other ranks, where the comm can
  // wait without blocking (MpiComm): idle(i) is called between polls, with
  // the number of calls before it in this wait, and when it returns false
  // the call throws CommAbandoned, leaving the comm unusable for them. A
  // peer that stopped in the middle of a negotiation round (a stall
  // shutdown) thus cannot hold this rank forever. Unset: wait as long as
  // it takes.
  virtual void set_idle(std::function<bool(int64_t)> idle) { idle_ = std::move(idle); }

  // A bitwise AND over `n` words, split in two so that the caller can wait
  // without spinning: StartBitAnd, then TestBitAnd until it returns true; the
  // result is then in `words`. One may be outstanding at a time.
  virtual void StartBitAnd(uint64_t* words, int n) = 0;
  virtual bool TestBitAnd() = 0;

  // Optional: bytes that travel with a bit-and, so that a negotiation round
  // that gathers to rank 0 after its bit-and needs no exchange of its own.
  // BitAndPayloadCapacity() is the most a payload may hold; 0 (the
  // default): this comm carries none. After TestBitAnd has returned true,
  // rank 0 may read rank j's payload with BitAndPayload(j) until its next
  // StartBitAnd.
  virtual int64_t BitAndPayloadCapacity() const { return 0; }
  virtual void StartBitAndWithPayload(uint64_t* words, int n, const std::string& payload) {
    HVDMX_CHECK(payload.empty(), "this communicator carries no bit-and payload");
    StartBitAnd(words, n);
  }
  virtual std::string BitAndPayload(int rank) const {
    HVDMX_CHECK(false, "this communicator carries no bit-and payload (rank " +
                           std::to_string(rank) + ")");
    return std::string();
  }

  // The transport's own allreduce, in place. Returns false (touching
  // nothing) when it has none for this dtype/op, e.g. float16 in MPI.
  virtual bool NativeAllreduce(void* buf, int64_t count, DataType dtype, ReduceOp op) = 0;

 protected:
  std::function<bool(int64_t)> idle_;
};

}  // namespace hvdmx

#endif  // HVDMX_COMM_H_
