// Vocabulary shared by every part of the core: data types, reduction ops,
// collective types, and Status.
//
// Nothing here knows MXNet or MPI. DataType values are MXNet's dtype codes
// (mshadow::TypeFlag) so the engine glue can pass them through unchanged.
#ifndef HVDMX_COMMON_H_
#define HVDMX_COMMON_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace hvdmx {

enum class DataType : int32_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kUInt8 = 3,
  kInt32 = 4,
  kInt8 = 5,
  kInt64 = 6,
  kBFloat16 = 12,
};

// Bytes per element, or 0 for a code we do not support.
size_t DataTypeSize(DataType dtype);
// True for the codes above; false for bool, int16, ... which MXNet has but we
// do not reduce.
bool IsSupportedDataType(int32_t code);
std::string DataTypeName(DataType dtype);

enum class ReduceOp : int32_t {
  kAverage = 0,  // a Sum followed by a postscale of 1/size
  kSum = 1,
  kAdasum = 2,  // allreduce only: algorithms/adasum.h (hierarchical with
                // HVDMX_ADASUM_HIERARCHICAL=1)
  kMin = 3,
  kMax = 4,
  kProduct = 5,
};
std::string ReduceOpName(ReduceOp op);

// The two factors of a reduction, always in this order: each rank's operand
// is multiplied by `pre` before it is reduced, the result by `post` after
// (an Average's 1/size is folded into `post` by whoever runs the call).
struct Scale {
  double pre = 1.0;
  double post = 1.0;

  bool operator==(const Scale& o) const { return pre == o.pre && post == o.post; }
  bool operator!=(const Scale& o) const { return !(*this == o); }
};

enum class CollectiveType : int32_t {
  kAllreduce = 0,
  kBroadcast = 1,
  kAllgather = 2,      // concatenation on dim 0, which may differ per rank
  kAlltoall = 3,       // rank i sends splits[i][j] rows to rank j
  kReducescatter = 4,  // Sum/Average; rank r keeps row block r of the result
  kBarrier = 5,        // no data: done once every rank has called it
  kJoin = 6,           // this rank has no more data (see Note [Join] in controller.h)
};
std::string CollectiveTypeName(CollectiveType type);

// Outcome of an operation. The message is for the user: it says what went
// wrong and what to do about it. The code is for the program: it says why,
// and callers decide by it, never by the message's text (the Python layer
// maps each code to an exception class and to how the process exits:
// hvdmx/_job.py). A runtime that stops records why as one of these
// (Runtime::stop_status).
class Status {
 public:
  enum class Code : int32_t {
    kOk = 0,
    kInvalidArgument,  // the user's call is wrong (a bad value, a set this rank is not in)
    kMismatch,         // the ranks' calls of one collective do not match
    kShutdown,         // hvd.shutdown() on this rank, or not initialized
    kInternal,         // a failure of MXNet's C API or of hvdmx itself
    kPeerShutdown,     // another rank shut hvdmx down (its hvd.shutdown() or its exit)
    kStalled,          // the other ranks stopped taking part in negotiation (stall shutdown)
    kPeerGone,         // a peer stopped, died or cannot be reached (PeerGone, comm/comm.h)
    kPeerProtocol,     // a peer sent what the protocol does not allow (PeerProtocolError)
  };

  Status() = default;
  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) {
    return Status(Code::kInvalidArgument, std::move(msg));
  }
  static Status Mismatch(std::string msg) { return Status(Code::kMismatch, std::move(msg)); }
  static Status Shutdown(std::string msg) { return Status(Code::kShutdown, std::move(msg)); }
  static Status Internal(std::string msg) { return Status(Code::kInternal, std::move(msg)); }
  static Status PeerShutdown(std::string msg) {
    return Status(Code::kPeerShutdown, std::move(msg));
  }
  static Status Stalled(std::string msg) { return Status(Code::kStalled, std::move(msg)); }
  static Status PeerGone(std::string msg) { return Status(Code::kPeerGone, std::move(msg)); }
  static Status PeerProtocol(std::string msg) {
    return Status(Code::kPeerProtocol, std::move(msg));
  }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Status(Code code, std::string msg) : code_(code), message_(std::move(msg)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

std::string ShapeString(const std::vector<int64_t>& shape);

// Asks the kernel to back the whole 2 MiB pages inside [data, data + bytes)
// with transparent huge pages, for buffers of 4 MiB and more; a hint that
// costs one system call and is ignored where THP is off. Memory not touched
// yet gets huge pages when first touched; touched memory is merged later by
// khugepaged. numpy does the same for its large arrays, and MPI copies
// between huge-page buffers up to twice as fast as between 4 KiB pages here.
void AdviseHugePages(void* data, int64_t bytes);

}  // namespace hvdmx

// Invariant checks: for our own bugs, never for the user's input.
#define HVDMX_CHECK(cond, msg)                                                     \
  do {                                                                             \
    if (!(cond)) ::hvdmx::internal::CheckFailed(__FILE__, __LINE__, #cond, (msg)); \
  } while (0)

namespace hvdmx {
namespace internal {
[[noreturn]] void CheckFailed(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace internal
}  // namespace hvdmx

#endif  // HVDMX_COMMON_H_
