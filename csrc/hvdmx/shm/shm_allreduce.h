// The allreduce (and the reduce-scatter) of ranks that share one host,
// through the stages of a ShmRegion (shm_region.h, which fixes the
// vocabulary: region, stage, chunk, seq, the counters copied, reduced and
// done; a stage is a page longer than a chunk: see Note [Where a chunk sits
// in its stage] in shm_region.cc). No MPI call is made here. The message
// of `count` elements is one buffer, or the concatenation of a fused call's
// Spans ("the buffer" below).
// A chunk is cut into `size` slices (ShmSliceStart); rank j reduces slice j.
//
// One chunk, on rank r, in three phases:
// - copy in: r copies every slice of its chunk except slice r into its own
//   stage, then publishes copied = seq + 1;
// - reduce: once every peer has copied, r reduces slice r over all ranks in
//   rank order 0, 1, ..., size-1 (its own operand straight from its buffer)
//   into slice r of its own stage, scales it by the call's postscale and
//   copies it into its buffer (block by block, while the block is in
//   cache); publishes reduced;
// - copy out: for each peer j, once j has reduced, r copies slice j of j's
//   stage into its buffer; publishes done.
// A stage is written again (chunk seq + kStages) only after every rank has
// published done for seq. Ranks run reduce(k), copy in(k+1), copy out(k), so
// each wait has a phase of slack: peers copy chunk k+1 in while r reduces k.
//
// Bytes. Per rank and message of S bytes: (n-1)/n S copied in, S/n reduced
// from n operands, S/n copied to the buffer from cache, (n-1)/n S copied out.
// The stages are small (n * kStages * chunk_bytes in all), so the shared
// bytes stay in the caches and memory sees about one read and one write of
// the buffer.
//
// Stores. A call may write its stages with streaming stores: the
// allreduce's copy in and its reduced slice (reduced into a scratch block,
// then copied to the buffer and streamed to the stage), and the
// reduce-scatter's copy in (as ShmExchange's calls may theirs). Under
// StageStores::kAuto only calls of at least StageStoreChooser::kMinBytes
// may, the allreduce and the reduce-scatter choosing apart; see Note
// [Streaming stores into the stages] in stage_stores.h. A hierarchical
// allreduce always uses cached stores.
//
// Bitwise identical results: every element is reduced once, by one rank, in
// one fixed order (rank 0 first), with the kernels of reduce_kernels.h, and
// then copied; every rank ends with the same bits.
//
// float16 and bfloat16 are reduced in float32 (Note [Half precision summed
// in float32] in reduce_kernels.cc): the reducing rank widens every rank's
// operand (times the prescale, rounded to the dtype), combines them in
// float32 a block at a time
// and rounds once, after the postscale. Nothing else changes: the stages
// carry the dtype's bytes.
//
// Across hosts (hierarchical allreduce): given a `cross` allreduce that
// joins this rank with the ranks of the same local rank on the other hosts
// (every host with the same number of ranks), the reduce phase runs it on
// the slice it has just reduced for its host, before publishing it. A half
// dtype's host sums go to it in float32, and it rounds the result. Each
// rank of a host thus works on its own shard across hosts, and the copy-out
// spreads the job-wide result inside the host. The results stay bitwise
// identical if `cross` gives identical bits on all its ranks (the ring does).
//
// Threading: an ShmAllreduce belongs to one rank and is used by one thread
// at a time. All ranks must call Allreduce in the same order with the same
// count, dtype and op.
#ifndef HVDMX_SHM_ALLREDUCE_H_
#define HVDMX_SHM_ALLREDUCE_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "base/common.h"
#include "platform/stage_stores.h"
#include "shm/shm_region.h"

namespace hvdmx {

class ShmAllreduce {
 public:
  // An in-place allreduce of `count` elements among the ranks of one local
  // rank on every host (the same calls on all of them). For a half dtype,
  // `wide` holds this rank's operands in float32 and the result, multiplied
  // by `postscale` and rounded once, lands in `buf` (`wide` is clobbered);
  // otherwise `wide` is null, `postscale` is 1 and the result is in `buf`.
  using CrossAllreduce = std::function<void(void* buf, float* wide, int64_t count, DataType dtype,
                                            ReduceOp op, double postscale)>;

  // `region` outlives this object. `cross`, empty on a single host, makes
  // the allreduce hierarchical (see above). `stores`: how the calls write
  // their stages (may differ between ranks).
  ShmAllreduce(ShmRegion* region, CrossAllreduce cross = nullptr,
               StageStores stores = StageStores::kAuto);
  ShmAllreduce(const ShmAllreduce&) = delete;
  ShmAllreduce& operator=(const ShmAllreduce&) = delete;

  bool hierarchical() const { return static_cast<bool>(cross_); }
  StageStores stage_stores() const { return stores_.stores(); }

  // Allreduces `buf` (count elements of dtype) in place with `op` (kAverage
  // reduces as kSum), then multiplies the result by `scale.post`: each block
  // as soon as it is reduced, while it is in cache, with the bits that
  // ScaleBuffer on the result would give. For a half dtype, the operands are
  // multiplied by `scale.pre` in the dtype (WidenScaled), then summed and
  // postscaled in float32 and rounded once; other dtypes take scale.pre 1
  // (the caller scales them).
  void Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op, Scale scale = {});
  // `count` elements at `data`: one tensor of a fused allreduce. Out of
  // place, `in` is where its input is (read, never written) and the result
  // lands in `data`; nullptr: in place.
  struct Span {
    void* data;
    int64_t count;
    const void* in = nullptr;
  };
  // Allreduces the concatenation of `spans` in place, as if they were one
  // buffer: a fused allreduce with no fusion buffer. The chunks and slices
  // are cut from the concatenation, so a chunk may take pieces of several
  // tensors, and the bits are those of one Allreduce on the concatenated
  // buffer. Every rank passes spans of the same counts.
  void Allreduce(const std::vector<Span>& spans, DataType dtype, ReduceOp op, Scale scale = {});

  // Reduce-scatter: elements [starts[j], starts[j+1]) of every rank's `in`,
  // reduced with `op` in rank order (kAverage as kSum) and multiplied by
  // `postscale`, land in `out` on rank j (starts: size + 1 element offsets,
  // the same on every rank). Chunk k carries a slot of the same number of
  // elements from every rank's block j, and rank j reduces its slot straight
  // from its input and its peers' stages into `out`: per rank, the other
  // ranks' blocks are copied in once and nothing is copied out. Needs
  // ReduceScatterFits(dtype): a chunk holds at least one element per rank.
  bool ReduceScatterFits(DataType dtype) const;
  void ReduceScatter(const void* in, void* out, const std::vector<int64_t>& starts, DataType dtype,
                     ReduceOp op, double postscale);

 private:
  struct Call;

  // Calls f(data, in, at, bytes) for each piece of elements [lo, hi) of the
  // call's concatenated spans, in order: `data` is where the piece's result
  // goes, `in` where its input is (`data` in place), `at` its distance in
  // bytes from element lo.
  template <typename F>
  void ForPieces(const Call& call, int64_t lo, int64_t hi, F&& f) const;
  void CopyIn(const Call& call, int64_t k);
  void Reduce(const Call& call, int64_t k);
  void CopyOut(const Call& call, int64_t k);
  // operands_[0..size) reduced in rank order into `out` (n elements),
  // multiplied by `scale.post`; a half dtype's in float32, each operand
  // times `scale.pre` in the dtype (WidenScaled), the result rounded once.
  void ReduceOperands(char* out, int64_t n, DataType dtype, ReduceOp op, Scale scale);
  // A half dtype's operands_, from element `first`, each times `prescale`
  // in the dtype (WidenScaled), reduced in rank order in float32 into acc
  // (n elements).
  void ReduceOperandsWide(float* acc, int64_t first, int64_t n, DataType dtype, ReduceOp op,
                          double prescale) const;
  ShmRegion* const region_;
  const int rank_;
  const int size_;
  const int64_t chunk_bytes_;
  const CrossAllreduce cross_;
  std::vector<const char*> operands_;  // Reduce's, one per rank
  std::vector<char*> slices_;          // Reduce's, one per rank
  std::vector<Span> one_span_;         // the one-buffer Allreduce's spans
  std::vector<int64_t> span_starts_;   // first element of each span, then the total
  StageStoreChooser stores_;           // the allreduce's
  StageStoreChooser scatter_stores_;   // the reduce-scatter's
  std::vector<char> scratch_;          // Reduce's block when streaming
  // A half dtype's float32 partials: ReduceOperands' (kWideBlockElems), or
  // when hierarchical a slice's host sums (a chunk's elements).
  std::vector<float> wide_;
};

}  // namespace hvdmx

#endif  // HVDMX_SHM_ALLREDUCE_H_
