// See shm_allreduce.h.
#include "shm/shm_allreduce.h"

#include <algorithm>
#include <cstring>

#include "algorithms/reduce_kernels.h"
#include "shm/shm_internal.h"

namespace hvdmx {

using shm_internal::kBlockBytes;
using shm_internal::kSliceAlignBytes;
using shm_internal::kWideBlockElems;

// One Allreduce call's geometry.
struct ShmAllreduce::Call {
  const Span* spans;
  size_t nspans;
  const int64_t* starts;  // spans' first elements in the concatenation, then count
  int64_t count;
  DataType dtype;
  ReduceOp op;
  Scale scale;          // pre: a half dtype's, on each operand; post: on each reduced block
  int64_t elem;         // bytes per element
  int64_t chunk_elems;  // elements per chunk (the last may be shorter)
  int64_t unit;         // slice granularity, elements
  uint64_t first_seq;   // seq of chunk 0

  uint64_t seq(int64_t k) const { return first_seq + static_cast<uint64_t>(k); }
  int64_t chunk_begin(int64_t k) const { return k * chunk_elems; }
  int64_t chunk_len(int64_t k) const { return std::min(chunk_elems, count - k * chunk_elems); }
  int64_t slice_begin(int64_t k, int n, int j) const {
    return ShmSliceStart(chunk_len(k), n, j, unit);
  }
};

ShmAllreduce::ShmAllreduce(ShmRegion* region, CrossAllreduce cross, StageStores stores)
    : region_(region),
      rank_(region->rank()),
      size_(region->size()),
      chunk_bytes_(region->chunk_bytes()),
      cross_(std::move(cross)),
      operands_(size_),
      slices_(size_),
      stores_(stores),
      scatter_stores_(stores),
      scratch_(kBlockBytes),
      wide_(std::max(kWideBlockElems, cross_ ? chunk_bytes_ / 2 : 0)) {}

void ShmAllreduce::Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op, Scale scale) {
  one_span_.assign(1, Span{buf, count});
  Allreduce(one_span_, dtype, op, scale);
}

void ShmAllreduce::Allreduce(const std::vector<Span>& spans, DataType dtype, ReduceOp op,
                             Scale scale) {
  const bool wide = HalfReducesWide(dtype);
  HVDMX_CHECK(wide || scale.pre == 1.0, "a shared-memory prescale for " + DataTypeName(dtype));
  ShmRegion::Count(region_->counters().calls);
  span_starts_.resize(spans.size() + 1);
  span_starts_[0] = 0;
  for (size_t i = 0; i < spans.size(); ++i) span_starts_[i + 1] = span_starts_[i] + spans[i].count;
  const int64_t count = span_starts_.back();
  if ((size_ == 1 && !cross_) || count == 0) {
    for (const Span& span : spans) {
      for (int64_t b = 0; wide && b < span.count; b += kWideBlockElems) {
        const int64_t m = std::min(kWideBlockElems, span.count - b);
        const char* in = static_cast<const char*>(span.in != nullptr ? span.in : span.data);
        WidenScaled(wide_.data(), in + 2 * b, m, dtype, scale.pre);
        NarrowScaled(static_cast<char*>(span.data) + 2 * b, wide_.data(), m, dtype, scale.post);
      }
      if (wide) continue;
      if (span.in != nullptr && span.count > 0) {
        std::memcpy(span.data, span.in, span.count * static_cast<int64_t>(DataTypeSize(dtype)));
      }
      ScaleBuffer(span.data, span.count, dtype, scale.post);
    }
    return;
  }
  Call call;
  call.scale = scale;
  call.spans = spans.data();
  call.nspans = spans.size();
  call.starts = span_starts_.data();
  call.count = count;
  call.dtype = dtype;
  call.op = op;
  call.elem = static_cast<int64_t>(DataTypeSize(dtype));
  call.chunk_elems = chunk_bytes_ / call.elem;  // chunk_bytes_ is a multiple of 64
  call.unit = std::max<int64_t>(1, kSliceAlignBytes / call.elem);
  call.first_seq = region_->seq();
  const int64_t chunks = (count + call.chunk_elems - 1) / call.chunk_elems;
  region_->WithStores(stores_, count * call.elem, !cross_, [&] {
    CopyIn(call, 0);
    for (int64_t k = 0; k < chunks; ++k) {
      Reduce(call, k);
      if (k + 1 < chunks) CopyIn(call, k + 1);
      CopyOut(call, k);
    }
  });
  region_->Advance(static_cast<uint64_t>(chunks));
}

template <typename F>
void ShmAllreduce::ForPieces(const Call& call, int64_t lo, int64_t hi, F&& f) const {
  if (lo >= hi) return;
  // The span holding element lo: the last one starting at or before it
  // (empty spans start where the next one does, so they are passed over).
  const int64_t* first = std::upper_bound(call.starts, call.starts + call.nspans, lo) - 1;
  const int64_t from = lo;
  for (size_t i = static_cast<size_t>(first - call.starts); lo < hi; ++i) {
    const int64_t end = std::min(hi, call.starts[i + 1]);
    if (end > lo) {
      const Span& span = call.spans[i];
      const int64_t offset = (lo - call.starts[i]) * call.elem;
      char* data = static_cast<char*>(span.data) + offset;
      const char* in = span.in == nullptr ? data : static_cast<const char*>(span.in) + offset;
      f(data, in, (lo - from) * call.elem, (end - lo) * call.elem);
      lo = end;
    }
  }
}

void ShmAllreduce::CopyIn(const Call& call, int64_t k) {
  const uint64_t seq = call.seq(k);
  const int64_t begin = call.chunk_begin(k);
  const char* src = nullptr;
  ForPieces(call, begin, begin + 1, [&](char*, const char* in, int64_t, int64_t) { src = in; });
  char* stage = region_->ClaimStage(seq, src);
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    const int64_t lo = call.slice_begin(k, size_, j);
    const int64_t hi = call.slice_begin(k, size_, j + 1);
    char* to = stage + lo * call.elem;
    ForPieces(call, begin + lo, begin + hi, [&](char*, const char* in, int64_t at, int64_t bytes) {
      region_->StageCopy(to + at, in, bytes);
    });
  }
  region_->PublishOwn(region_->control(rank_).copied.value, seq + 1);
}

void ShmAllreduce::Reduce(const Call& call, int64_t k) {
  const uint64_t seq = call.seq(k);
  const bool wide = HalfReducesWide(call.dtype);
  for (int j = 0; j < size_; ++j) {
    if (j != rank_) region_->Await(j, region_->control(j).copied.value, seq + 1);
  }
  const int64_t begin = call.chunk_begin(k);
  const int64_t lo = call.slice_begin(k, size_, rank_);
  const int64_t hi = call.slice_begin(k, size_, rank_ + 1);
  // Slice `rank_` of every rank's stage (this rank's: where the result goes).
  for (int j = 0; j < size_; ++j) slices_[j] = region_->Stage(j, seq) + lo * call.elem;
  char* out = slices_[rank_];
  ForPieces(call, begin + lo, begin + hi,
            [&](char* mine, const char* in, int64_t at0, int64_t bytes) {
              for (int64_t b = 0; b < bytes; b += kBlockBytes) {
                const int64_t block = std::min(kBlockBytes, bytes - b);  // a multiple of elem
                const int64_t n = block / call.elem;
                const int64_t at = at0 + b;
                for (int j = 0; j < size_; ++j)
                  operands_[j] = j == rank_ ? in + b : slices_[j] + at;
                // Rank order, the same on every rank: out = ((x0 OP x1) OP x2) ...,
                // scaled and copied while the block is in cache, unless other hosts
                // come first (then the scale is applied after them). Streaming
                // (never hierarchical): reduced into the scratch block, which is then
                // read twice from the first-level cache.
                // A half dtype's host sums stay float32 for the hosts' ring.
                if (region_->streaming()) {
                  ReduceOperands(scratch_.data(), n, call.dtype, call.op, call.scale);
                  std::memcpy(mine + b, scratch_.data(), block);
                  StreamingCopy(out + at, scratch_.data(), block);
                } else if (cross_ && wide) {
                  ReduceOperandsWide(wide_.data() + at / call.elem, 0, n, call.dtype, call.op,
                                     call.scale.pre);
                } else {
                  ReduceOperands(out + at, n, call.dtype, call.op,
                                 cross_ ? Scale{call.scale.pre, 1.0} : call.scale);
                  if (!cross_) std::memcpy(mine + b, out + at, block);
                }
              }
            });
  if (cross_) {
    // Called for empty slices too: the same calls on every host.
    if (wide) {
      cross_(out, wide_.data(), hi - lo, call.dtype, call.op, call.scale.post);
    } else {
      cross_(out, nullptr, hi - lo, call.dtype, call.op, 1.0);
      ScaleBuffer(out, hi - lo, call.dtype, call.scale.post);
    }
    ForPieces(call, begin + lo, begin + hi,
              [&](char* mine, const char*, int64_t at, int64_t bytes) {
                std::memcpy(mine, out + at, bytes);
              });
  }
  region_->PublishOwn(region_->control(rank_).reduced.value, seq + 1);
}

void ShmAllreduce::ReduceOperandsWide(float* acc, int64_t first, int64_t n, DataType dtype,
                                      ReduceOp op, double prescale) const {
  const int64_t at = first * static_cast<int64_t>(DataTypeSize(dtype));
  WidenScaled(acc, operands_[0] + at, n, dtype, prescale);
  for (int j = 1; j < size_; ++j) ReduceWidenedInto(acc, operands_[j] + at, n, dtype, op, prescale);
}

void ShmAllreduce::ReduceOperands(char* out, int64_t n, DataType dtype, ReduceOp op, Scale scale) {
  if (HalfReducesWide(dtype)) {
    // Note [Half precision summed in float32]: a block of partials at a time.
    for (int64_t b = 0; b < n; b += kWideBlockElems) {
      const int64_t m = std::min(kWideBlockElems, n - b);
      ReduceOperandsWide(wide_.data(), b, m, dtype, op, scale.pre);
      NarrowScaled(out + b * static_cast<int64_t>(DataTypeSize(dtype)), wide_.data(), m, dtype,
                   scale.post);
    }
    return;
  }
  HVDMX_CHECK(scale.pre == 1.0, "a prescale inside the reduction for " + DataTypeName(dtype));
  if (size_ == 1) {
    std::memcpy(out, operands_[0], n * static_cast<int64_t>(DataTypeSize(dtype)));
    ScaleBuffer(out, n, dtype, scale.post);
  } else if (size_ == 2) {
    Reduce3Scaled(out, operands_[0], operands_[1], n, dtype, op, scale.post);
  } else {
    Reduce3(out, operands_[0], operands_[1], n, dtype, op);
    for (int j = 2; j < size_; ++j) ReduceInto(out, operands_[j], n, dtype, op);
    ScaleBuffer(out, n, dtype, scale.post);
  }
}

void ShmAllreduce::CopyOut(const Call& call, int64_t k) {
  const uint64_t seq = call.seq(k);
  const int64_t begin = call.chunk_begin(k);
  // Start with the next rank: peers then read different regions at once.
  for (int i = 1; i < size_; ++i) {
    const int j = (rank_ + i) % size_;
    const int64_t lo = call.slice_begin(k, size_, j);
    const int64_t hi = call.slice_begin(k, size_, j + 1);
    region_->Await(j, region_->control(j).reduced.value, seq + 1);
    const char* from = region_->Stage(j, seq) + lo * call.elem;
    ForPieces(call, begin + lo, begin + hi, [&](char* dst, const char*, int64_t at, int64_t bytes) {
      std::memcpy(dst, from + at, bytes);
    });
  }
  region_->control(rank_).done.value.store(seq + 1, std::memory_order_release);
}

bool ShmAllreduce::ReduceScatterFits(DataType dtype) const {
  return chunk_bytes_ / static_cast<int64_t>(DataTypeSize(dtype)) / size_ >= 1;
}

// Chunk k, on rank r: copy in (once every peer is done with the stage's
// last chunk) puts elements [k * slot, (k + 1) * slot) of every block j but
// its own at slot j of its stage and publishes copied; reduce waits for
// every peer's copied and reduces its own block's elements of the chunk, its
// own operand from `in`, the others from slot r of each peer's stage, into
// `out`, then publishes reduced and done. Rank r copies chunk k + 1 in
// before it reduces chunk k, so its peers find it there when they get to it.
void ShmAllreduce::ReduceScatter(const void* in, void* out, const std::vector<int64_t>& starts,
                                 DataType dtype, ReduceOp op, double postscale) {
  HVDMX_CHECK(!cross_ && static_cast<int>(starts.size()) == size_ + 1 && ReduceScatterFits(dtype),
              "shared-memory reduce-scatter: one host, size + 1 offsets, a chunk that fits");
  ShmRegion::Count(region_->counters().calls);
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  // Elements per rank and chunk, whole cache lines where a chunk allows.
  const int64_t unit = std::max<int64_t>(1, kSliceAlignBytes / elem);
  const int64_t fits = chunk_bytes_ / elem / size_;
  const int64_t slot = fits >= unit ? fits / unit * unit : fits;
  int64_t longest = 0;
  for (int j = 0; j < size_; ++j) longest = std::max(longest, starts[j + 1] - starts[j]);
  // Block j's elements in chunk k: returns their count, *lo the first.
  auto piece = [&](int j, int64_t k, int64_t* lo) {
    const int64_t len = starts[j + 1] - starts[j];
    *lo = std::min(len, k * slot);
    return std::min(len, (k + 1) * slot) - *lo;
  };
  const uint64_t first_seq = region_->seq();
  auto copy_in = [&](int64_t k) {
    const uint64_t seq = first_seq + static_cast<uint64_t>(k);
    int64_t lo = 0;
    piece(rank_, k, &lo);
    char* stage = region_->ClaimStage(seq, src + (starts[rank_] + lo) * elem);
    for (int j = 0; j < size_; ++j) {
      const int64_t n = j == rank_ ? 0 : piece(j, k, &lo);
      if (n > 0)
        region_->StageCopy(stage + j * slot * elem, src + (starts[j] + lo) * elem, n * elem);
    }
    region_->PublishOwn(region_->control(rank_).copied.value, seq + 1);
  };
  auto reduce = [&](int64_t k) {
    const uint64_t seq = first_seq + static_cast<uint64_t>(k);
    for (int j = 0; j < size_; ++j) {
      if (j != rank_) region_->Await(j, region_->control(j).copied.value, seq + 1);
    }
    int64_t lo = 0;
    const int64_t n = piece(rank_, k, &lo);
    for (int j = 0; j < size_; ++j) slices_[j] = region_->Stage(j, seq) + rank_ * slot * elem;
    const char* mine = src + (starts[rank_] + lo) * elem;
    const int64_t block = std::max<int64_t>(1, kBlockBytes / elem);
    for (int64_t b = 0; b < n; b += block) {
      for (int j = 0; j < size_; ++j) operands_[j] = (j == rank_ ? mine : slices_[j]) + b * elem;
      ReduceOperands(dst + (lo + b) * elem, std::min(block, n - b), dtype, op,
                     Scale{1.0, postscale});
    }
    region_->control(rank_).reduced.value.store(seq + 1, std::memory_order_release);
    region_->control(rank_).done.value.store(seq + 1, std::memory_order_release);
  };
  if (size_ == 1) {
    operands_[0] = src + starts[0] * elem;
    ReduceOperands(dst, starts[1] - starts[0], dtype, op, Scale{1.0, postscale});
    return;
  }
  const int64_t chunks = (longest + slot - 1) / slot;
  const int64_t total = (starts[size_] - starts[0]) * elem;  // a rank's input
  region_->WithStores(scatter_stores_, total, chunks > 0, [&] {
    if (chunks > 0) copy_in(0);
    for (int64_t k = 0; k < chunks; ++k) {
      if (k + 1 < chunks) copy_in(k + 1);
      reduce(k);
    }
  });
  region_->Advance(static_cast<uint64_t>(chunks));
}

}  // namespace hvdmx
