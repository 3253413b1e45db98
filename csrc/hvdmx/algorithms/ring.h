// Our pipelined ring allreduce over a Comm's point-to-point calls.
//
// Vocabulary. The buffer of `count` elements is cut into `size` chunks,
// chunk c being elements [Start(c), Start(c+1)) with the remainder spread
// over the first chunks. Each chunk travels in segments of at most
// `segment_bytes`; a step moves one chunk from every rank to its right
// neighbour (rank + 1).
//
// Reduce-scatter, steps s = 0 .. size-2: rank r sends chunk (r - s) and
// receives chunk (r - s - 1), which it reduces into its own copy. After it,
// rank r holds the finished chunk (r + 1).
// Allgather, steps s = 0 .. size-2: rank r sends chunk (r + 1 - s) and
// receives chunk (r - s) straight into place.
//
// Bytes each rank sends: 2 (size-1)/size * count * elem — the bus-bandwidth
// optimum. Every chunk is reduced once, on one rank, in one fixed order, and
// then copied: results are bitwise identical on every rank.
//
// Pipelining: two segments of a step are in flight at once; while segment k
// is being reduced, segment k+1 is on the wire into the other scratch half.
#ifndef HVDMX_RING_H_
#define HVDMX_RING_H_

#include <cstdint>
#include <vector>

#include "base/common.h"
#include "comm/comm.h"

namespace hvdmx {

// Persistent receive space for the reduce-scatter: two segments, allocated
// and touched once, reused by every call (no allocation on the data path).
class RingScratch {
 public:
  // Grows to hold two segments of `segment_bytes`; no-op when big enough.
  void Reserve(int64_t segment_bytes);
  char* half(int i) { return buffer_.data() + i * half_bytes_; }
  // Chunk boundaries of the current call (kept to spare an allocation).
  std::vector<int64_t> starts;

 private:
  std::vector<char> buffer_;
  int64_t half_bytes_ = 0;
};

// Allreduces `buf` (count elements of dtype) in place over `comm` with `op`
// (kAverage reduces as kSum; scaling is the caller's).
void RingAllreduce(DataComm& comm, void* buf, int64_t count, DataType dtype, ReduceOp op,
                   int64_t segment_bytes, RingScratch* scratch);

// A float16 or bfloat16 allreduce of `buf` (count elements of the half
// `dtype`) with float32 partials (Note [Half precision summed in float32]
// in reduce_kernels.cc): the reduce-scatter passes float32 partials, each
// rank multiplies the chunk it finishes by `scale.post` and rounds it once
// into `buf`, and the allgather moves the rounded chunks. Bytes each rank
// sends: (n-1)/n * count * (4 + 2), 1.5x a half ring. `wide` is count
// floats: with operands_in_wide, this rank's operands in float32 (scaled
// already; `scale.pre` is not applied), else scratch, the operands being
// buf's elements times `scale.pre` in the dtype (WidenScaled), widened as the
// steps reach them. `wide`
// is clobbered; every chunk is still reduced once, on one rank.
void RingAllreduceWidened(DataComm& comm, void* buf, float* wide, bool operands_in_wide,
                          int64_t count, DataType dtype, ReduceOp op, Scale scale,
                          int64_t segment_bytes, RingScratch* scratch);

// The hosts' part of a hierarchical allreduce (ShmAllreduce::CrossAllreduce's
// contract): without `wide`, RingAllreduce of buf; with it (a half dtype's
// float32 host sums), RingAllreduceWidened, or with !wide_partials
// (HVDMX_HALF_PARTIALS=half) the sums rounded into buf, RingAllreduce in
// the dtype and the postscale applied, which halves the reduce-scatter's
// bytes and rounds at every step.
void RingCrossAllreduce(DataComm& comm, void* buf, float* wide, int64_t count, DataType dtype,
                        ReduceOp op, double postscale, bool wide_partials, int64_t segment_bytes,
                        RingScratch* scratch);

// The same two phases on their own, over chunks of any sizes: chunk c is
// elements [starts[c], starts[c+1]) of `buf`, starts having size + 1
// entries. After RingReduceScatter rank r holds the reduction of chunk r
// (the other chunks hold partial sums); RingAllgather starts from rank r
// holding chunk r and leaves every chunk everywhere.
void RingReduceScatter(DataComm& comm, void* buf, const std::vector<int64_t>& starts,
                       DataType dtype, ReduceOp op, int64_t segment_bytes, RingScratch* scratch);
void RingAllgather(DataComm& comm, void* buf, const std::vector<int64_t>& starts, DataType dtype,
                   RingScratch* scratch);

// First element of chunk c when count elements are cut into n chunks.
int64_t RingChunkStart(int64_t count, int n, int c);

}  // namespace hvdmx

#endif  // HVDMX_RING_H_
