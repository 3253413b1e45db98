#include "shm/shm_allreduce.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "algorithms/reduce_kernels.h"
#include "platform/cpu_binding.h"
#include "shm/shm_internal.h"

namespace hvdmx {

using shm_internal::kBlockBytes;
using shm_internal::kControlBlockBytes;
using shm_internal::kControlBytes;
using shm_internal::kPageBytes;
using shm_internal::kSliceAlignBytes;
using shm_internal::kSpinMicros;
using shm_internal::kWideBlockElems;
using shm_internal::WaitFor;

// Note [Where a chunk sits in its stage]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A stage is a page longer than a chunk, and a chunk is placed in it at the
// offset that puts it half a page away from where it sits in the rank's
// buffer: (stage address - buffer address) mod 4096 == 2048. Copies between
// two addresses a few bytes apart modulo a page run at a fraction of memory
// speed on this project's AMD EPYC (glibc's memcpy: 1.6-2 GB/s at a distance
// of 16 bytes, 18 GB/s at 0 and 33-37 GB/s at 2048 for 128 KiB; load/store
// 4K aliasing), and the buffers' offsets in their pages are whatever the
// allocator gave. The offset is chosen per chunk and published with it
// (Control::shift), since peers read the stage.

// One Allreduce call's geometry.
struct ShmAllreduce::Call {
  const Span* spans;
  size_t nspans;
  const int64_t* starts;  // spans' first elements in the concatenation, then count
  int64_t count;
  DataType dtype;
  ReduceOp op;
  double postscale;     // applied to each reduced block
  double prescale;      // a half dtype's, applied to each operand
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

int64_t ShmSliceStart(int64_t len, int n, int j, int64_t unit) {
  const int64_t units = (len + unit - 1) / unit;
  const int64_t per_slice = (units + n - 1) / n;
  return std::min(len, static_cast<int64_t>(j) * per_slice * unit);
}

int64_t ShmAllreduce::RoundChunkBytes(int64_t chunk_bytes) {
  return std::max<int64_t>(kSliceAlignBytes, chunk_bytes / kSliceAlignBytes * kSliceAlignBytes);
}

int64_t ShmAllreduce::RegionBytes(int64_t chunk_bytes) {
  return kControlBytes + kStages * (RoundChunkBytes(chunk_bytes) + kPageBytes);
}

ShmAllreduce::ShmAllreduce(int rank, int size, std::vector<char*> regions, int64_t chunk_bytes,
                           std::shared_ptr<void> owner, CrossAllreduce cross,
                           int64_t direct_min_bytes, StageStores stores, bool huge_pages)
    : rank_(rank),
      size_(size),
      regions_(std::move(regions)),
      chunk_bytes_(RoundChunkBytes(chunk_bytes)),
      owner_(std::move(owner)),
      cross_(std::move(cross)),
      operands_(size),
      slices_(size),
      spin_micros_(size <= UsableCpuCount() ? kSpinMicros : 0),
      huge_pages_(huge_pages),
      direct_min_bytes_(direct_min_bytes),
      stores_(stores),
      move_stores_{{StageStoreChooser(stores), StageStoreChooser(stores),
                     StageStoreChooser(stores), StageStoreChooser(stores)}},
      push_stores_{{StageStoreChooser(stores, kPushStreamMinBytes),
                     StageStoreChooser(stores, kPushStreamMinBytes),
                     StageStoreChooser(stores, kPushStreamMinBytes),
                     StageStoreChooser(stores, kPushStreamMinBytes)}},
      scratch_(kBlockBytes),
      wide_(std::max(kWideBlockElems, cross_ ? chunk_bytes_ / 2 : 0)),
      next_pid_check_(size) {
  static_assert(sizeof(Control) <= kControlBlockBytes, "control block too large");
  // Regions are consecutive in one mapping, so a page-aligned start keeps every
  // one of them aligned for its Control block: RegionBytes is a multiple of it
  // for every chunk size (chunks are whole multiples of kSliceAlignBytes).
  static_assert(kControlBytes % alignof(Control) == 0 &&
                    (kStages * kSliceAlignBytes) % alignof(Control) == 0 &&
                    (kStages * kPageBytes) % alignof(Control) == 0,
                "a region's size must keep the next region's Control aligned");
  HVDMX_CHECK(static_cast<int>(regions_.size()) == size_ && rank_ >= 0 && rank_ < size_,
              "one region per rank");
  for (char* region : regions_) {
    HVDMX_CHECK(reinterpret_cast<uintptr_t>(region) % alignof(Control) == 0,
                "a shared-memory region is not aligned for its control block");
  }
  control(rank_).pid.store(getpid(), std::memory_order_relaxed);
}

namespace {

std::string PeerGoneMessage(const std::string& why) {
  return "hvdmx: " + why +
         ", while this rank waited for it in shared memory; hvdmx has stopped on this rank "
         "too. Look at that rank's output for why (see docs/errors.md, \"A rank that stops\")";
}

}  // namespace

ShmAllreduce::~ShmAllreduce() { MarkStopped(); }

ShmAllreduce::Control& ShmAllreduce::control(int j) const {
  return *reinterpret_cast<Control*>(regions_[j]);
}

void ShmAllreduce::MarkStopped() { control(rank_).stopped.store(1, std::memory_order_release); }

std::string ShmAllreduce::PeerGoneReason(int j) {
  const Control& peer = control(j);
  const int64_t pid = peer.pid.load(std::memory_order_relaxed);
  const std::string who = "rank " + std::to_string(j) + " of this host (pid " +
                          std::to_string(pid) + ")";
  if (peer.stopped.load(std::memory_order_acquire) != 0) {
    return who + " has stopped hvdmx (a stall shutdown, a failure, or hvd.shutdown() there)";
  }
  const auto now = shm_internal::Clock::now();
  if (now < next_pid_check_[j]) return std::string();
  next_pid_check_[j] = now + std::chrono::microseconds(kPidCheckMicros);
  if (pid > 0 && kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
    return who + " has exited";
  }
  return std::string();
}

void ShmAllreduce::ThrowIfGone(int j, const std::atomic<uint64_t>& counter, uint64_t target) {
  const std::string why = PeerGoneReason(j);
  // The peer's writes before its stop are visible once the stop is: a last
  // look at the counter tells whether it wrote what the wait needs.
  if (!why.empty() && counter.load(std::memory_order_acquire) < target) {
    throw ShmPeerGone(j, PeerGoneMessage(why));
  }
}

void ShmAllreduce::Await(int j, const std::atomic<uint64_t>& counter, uint64_t target) {
  WaitFor(counter, target, spin_micros_, [&] { ThrowIfGone(j, counter, target); });
}

char* ShmAllreduce::Mailbox(int j, int i) const {
  return regions_[j] + kControlBlockBytes + i * kMaxPayloadBytes;
}

char* ShmAllreduce::Stage(int j, uint64_t seq) const {
  const int stage = static_cast<int>(seq % kStages);
  return regions_[j] + kControlBytes + stage * (chunk_bytes_ + kPageBytes) +
         control(j).shift[stage].load(std::memory_order_relaxed);
}

void ShmAllreduce::Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op,
                             double postscale, double prescale) {
  one_span_.assign(1, Span{buf, count});
  Allreduce(one_span_, dtype, op, postscale, prescale);
}

void ShmAllreduce::Allreduce(const std::vector<Span>& spans, DataType dtype, ReduceOp op,
                             double postscale, double prescale) {
  const bool wide = HalfReducesWide(dtype);
  HVDMX_CHECK(wide || prescale == 1.0, "a shared-memory prescale for " + DataTypeName(dtype));
  calls_.fetch_add(1, std::memory_order_relaxed);
  span_starts_.resize(spans.size() + 1);
  span_starts_[0] = 0;
  for (size_t i = 0; i < spans.size(); ++i) span_starts_[i + 1] = span_starts_[i] + spans[i].count;
  const int64_t count = span_starts_.back();
  if ((size_ == 1 && !cross_) || count == 0) {
    for (const Span& span : spans) {
      for (int64_t b = 0; wide && b < span.count; b += kWideBlockElems) {
        const int64_t m = std::min(kWideBlockElems, span.count - b);
        const char* in = static_cast<const char*>(span.in != nullptr ? span.in : span.data);
        WidenScaled(wide_.data(), in + 2 * b, m, dtype, prescale);
        NarrowScaled(static_cast<char*>(span.data) + 2 * b, wide_.data(), m, dtype, postscale);
      }
      if (wide) continue;
      if (span.in != nullptr && span.count > 0) {
        std::memcpy(span.data, span.in, span.count * static_cast<int64_t>(DataTypeSize(dtype)));
      }
      ScaleBuffer(span.data, span.count, dtype, postscale);
    }
    return;
  }
  Call call;
  call.postscale = postscale;
  call.prescale = prescale;
  call.spans = spans.data();
  call.nspans = spans.size();
  call.starts = span_starts_.data();
  call.count = count;
  call.dtype = dtype;
  call.op = op;
  call.elem = static_cast<int64_t>(DataTypeSize(dtype));
  call.chunk_elems = chunk_bytes_ / call.elem;  // chunk_bytes_ is a multiple of 64
  call.unit = std::max<int64_t>(1, kSliceAlignBytes / call.elem);
  call.first_seq = seq_;
  const int64_t chunks = (count + call.chunk_elems - 1) / call.chunk_elems;
  WithStores(stores_, count * call.elem, !cross_, [&] {
    CopyIn(call, 0);
    for (int64_t k = 0; k < chunks; ++k) {
      Reduce(call, k);
      if (k + 1 < chunks) CopyIn(call, k + 1);
      CopyOut(call, k);
    }
  });
  seq_ += static_cast<uint64_t>(chunks);
}

void ShmAllreduce::PublishOwn(std::atomic<uint64_t>& counter, uint64_t value) const {
  if (streaming_) StreamingStoresFence();
  counter.store(value, std::memory_order_release);
}

void ShmAllreduce::StageCopy(char* dst, const char* src, int64_t bytes) const {
  if (streaming_) {
    StreamingCopy(dst, src, bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
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

char* ShmAllreduce::ClaimStage(uint64_t seq, const char* src) {
  if (seq >= kStages) {
    // The stage held chunk seq - kStages: wait until every rank is done with it.
    for (int j = 0; j < size_; ++j) {
      if (j != rank_) Await(j, control(j).done.value, seq - kStages + 1);
    }
  }
  // See Note [Where a chunk sits in its stage].
  const int64_t shift = static_cast<int64_t>((reinterpret_cast<uintptr_t>(src) + kPageBytes / 2) %
                                             kPageBytes);
  control(rank_).shift[seq % kStages].store(shift, std::memory_order_relaxed);
  return Stage(rank_, seq);
}

void ShmAllreduce::CopyIn(const Call& call, int64_t k) {
  const uint64_t seq = call.seq(k);
  const int64_t begin = call.chunk_begin(k);
  const char* src = nullptr;
  ForPieces(call, begin, begin + 1, [&](char*, const char* in, int64_t, int64_t) { src = in; });
  char* stage = ClaimStage(seq, src);
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    const int64_t lo = call.slice_begin(k, size_, j);
    const int64_t hi = call.slice_begin(k, size_, j + 1);
    char* to = stage + lo * call.elem;
    ForPieces(call, begin + lo, begin + hi,
              [&](char*, const char* in, int64_t at, int64_t bytes) {
                StageCopy(to + at, in, bytes);
              });
  }
  PublishOwn(control(rank_).copied.value, seq + 1);
}

void ShmAllreduce::Reduce(const Call& call, int64_t k) {
  const uint64_t seq = call.seq(k);
  const bool wide = HalfReducesWide(call.dtype);
  for (int j = 0; j < size_; ++j) {
    if (j != rank_) Await(j, control(j).copied.value, seq + 1);
  }
  const int64_t begin = call.chunk_begin(k);
  const int64_t lo = call.slice_begin(k, size_, rank_);
  const int64_t hi = call.slice_begin(k, size_, rank_ + 1);
  // Slice `rank_` of every rank's stage (this rank's: where the result goes).
  for (int j = 0; j < size_; ++j) slices_[j] = Stage(j, seq) + lo * call.elem;
  char* out = slices_[rank_];
  ForPieces(call, begin + lo, begin + hi, [&](char* mine, const char* in, int64_t at0,
                                              int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += kBlockBytes) {
      const int64_t block = std::min(kBlockBytes, bytes - b);  // a multiple of elem
      const int64_t n = block / call.elem;
      const int64_t at = at0 + b;
      for (int j = 0; j < size_; ++j) operands_[j] = j == rank_ ? in + b : slices_[j] + at;
      // Rank order, the same on every rank: out = ((x0 OP x1) OP x2) ...,
      // scaled and copied while the block is in cache, unless other hosts
      // come first (then the scale is applied after them). Streaming
      // (never hierarchical): reduced into the scratch block, which is then
      // read twice from the first-level cache.
      // A half dtype's host sums stay float32 for the hosts' ring.
      if (streaming_) {
        ReduceOperands(scratch_.data(), n, call.dtype, call.op, call.postscale, call.prescale);
        std::memcpy(mine + b, scratch_.data(), block);
        StreamingCopy(out + at, scratch_.data(), block);
      } else if (cross_ && wide) {
        ReduceOperandsWide(wide_.data() + at / call.elem, 0, n, call.dtype, call.op,
                           call.prescale);
      } else {
        ReduceOperands(out + at, n, call.dtype, call.op, cross_ ? 1.0 : call.postscale,
                       call.prescale);
        if (!cross_) std::memcpy(mine + b, out + at, block);
      }
    }
  });
  if (cross_) {
    // Called for empty slices too: the same calls on every host.
    if (wide) {
      cross_(out, wide_.data(), hi - lo, call.dtype, call.op, call.postscale);
    } else {
      cross_(out, nullptr, hi - lo, call.dtype, call.op, 1.0);
      ScaleBuffer(out, hi - lo, call.dtype, call.postscale);
    }
    ForPieces(call, begin + lo, begin + hi, [&](char* mine, const char*, int64_t at,
                                                int64_t bytes) {
      std::memcpy(mine, out + at, bytes);
    });
  }
  PublishOwn(control(rank_).reduced.value, seq + 1);
}

void ShmAllreduce::ReduceOperandsWide(float* acc, int64_t first, int64_t n, DataType dtype,
                                      ReduceOp op, double prescale) const {
  const int64_t at = first * static_cast<int64_t>(DataTypeSize(dtype));
  WidenScaled(acc, operands_[0] + at, n, dtype, prescale);
  for (int j = 1; j < size_; ++j) ReduceWidenedInto(acc, operands_[j] + at, n, dtype, op, prescale);
}

void ShmAllreduce::ReduceOperands(char* out, int64_t n, DataType dtype, ReduceOp op,
                                  double scale, double prescale) {
  if (HalfReducesWide(dtype)) {
    // Note [Half precision summed in float32]: a block of partials at a time.
    for (int64_t b = 0; b < n; b += kWideBlockElems) {
      const int64_t m = std::min(kWideBlockElems, n - b);
      ReduceOperandsWide(wide_.data(), b, m, dtype, op, prescale);
      NarrowScaled(out + b * static_cast<int64_t>(DataTypeSize(dtype)), wide_.data(), m, dtype,
                   scale);
    }
    return;
  }
  HVDMX_CHECK(prescale == 1.0, "a prescale inside the reduction for " + DataTypeName(dtype));
  if (size_ == 1) {
    std::memcpy(out, operands_[0], n * static_cast<int64_t>(DataTypeSize(dtype)));
    ScaleBuffer(out, n, dtype, scale);
  } else if (size_ == 2) {
    Reduce3Scaled(out, operands_[0], operands_[1], n, dtype, op, scale);
  } else {
    Reduce3(out, operands_[0], operands_[1], n, dtype, op);
    for (int j = 2; j < size_; ++j) ReduceInto(out, operands_[j], n, dtype, op);
    ScaleBuffer(out, n, dtype, scale);
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
    Await(j, control(j).reduced.value, seq + 1);
    const char* from = Stage(j, seq) + lo * call.elem;
    ForPieces(call, begin + lo, begin + hi, [&](char* dst, const char*, int64_t at,
                                                int64_t bytes) {
      std::memcpy(dst, from + at, bytes);
    });
  }
  control(rank_).done.value.store(seq + 1, std::memory_order_release);
}

// Note [Bit-and through shared memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Two sets of words per rank are enough: a rank starts bit-and seq + 2 (and
// overwrites the words of seq) only after its Test of seq + 1 succeeded,
// which needs every peer to have started seq + 1, which each does only
// after its own Test of seq, the last read of those words.
void ShmAllreduce::StartBitAnd(uint64_t* words, int n, const std::string& payload) {
  HVDMX_CHECK(n >= 0 && n <= kMaxBitAndWords, "too many words for the shared-memory bit-and");
  HVDMX_CHECK(static_cast<int64_t>(payload.size()) <= kMaxPayloadBytes,
              "a bit-and payload longer than its mailbox");
  HVDMX_CHECK(bit_and_words_ == nullptr, "a bit-and is already outstanding");
  const uint64_t seq = ++bit_and_seq_;
  Control& mine = control(rank_);
  std::memcpy(mine.words[seq % 2], words, n * sizeof(uint64_t));
  if (!payload.empty()) std::memcpy(Mailbox(rank_, seq % 2), payload.data(), payload.size());
  mine.payload_bytes[seq % 2].store(static_cast<int64_t>(payload.size()),
                                    std::memory_order_relaxed);
  mine.anded.value.store(seq, std::memory_order_release);
  bit_and_words_ = words;
  bit_and_count_ = n;
}

bool ShmAllreduce::TestBitAnd() {
  HVDMX_CHECK(bit_and_words_ != nullptr, "no bit-and outstanding");
  const uint64_t seq = bit_and_seq_;
  for (int j = 0; j < size_; ++j) {
    if (control(j).anded.value.load(std::memory_order_acquire) >= seq) continue;
    ThrowIfGone(j, control(j).anded.value, seq);  // see Note [A peer that stops]
    return false;
  }
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    const uint64_t* theirs = control(j).words[seq % 2];
    for (int i = 0; i < bit_and_count_; ++i) bit_and_words_[i] &= theirs[i];
  }
  bit_and_words_ = nullptr;
  bit_ands_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

std::string ShmAllreduce::BitAndPayload(int j) const {
  HVDMX_CHECK(j >= 0 && j < size_ && bit_and_seq_ > 0 && bit_and_words_ == nullptr,
              "a bit-and payload read before its bit-and completed");
  const uint64_t seq = bit_and_seq_;
  const int64_t bytes = control(j).payload_bytes[seq % 2].load(std::memory_order_relaxed);
  return std::string(Mailbox(j, static_cast<int>(seq % 2)), static_cast<size_t>(bytes));
}

// Note [Negotiation through shared memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A payload is read after Test (which acquired `anded`) and before the
// reader's next Start; rank j overwrites its mailbox seq % 2 only at Start
// of seq + 2, which waits, as the words do, for every rank to have started
// seq + 1 (Note [Bit-and through shared memory]).
// A broadcast string needs no bit-and around it: its root writes mailbox
// 2 + c % 2 for call c only once every rank has released `taken` with
// c - 2, the last call that used it.
bool ShmAllreduce::BcastString(std::string* data, int root) {
  HVDMX_CHECK(root >= 0 && root < size_, "shared-memory string broadcast: root in the host");
  const uint64_t c = ++bcast_calls_;
  const int box = 2 + static_cast<int>(c % 2);
  int64_t bytes = 0;
  if (rank_ == root) {
    for (int j = 0; j < size_; ++j) {
      if (j != rank_ && c > 2) Await(j, control(j).taken.value, c - 2);
    }
    const bool fits = static_cast<int64_t>(data->size()) <= kMaxPayloadBytes;
    bytes = fits ? static_cast<int64_t>(data->size()) : -1;
    if (bytes > 0) std::memcpy(Mailbox(rank_, box), data->data(), data->size());
    control(rank_).posted_bytes[c % 2].store(bytes, std::memory_order_relaxed);
    control(rank_).posted.value.store(c, std::memory_order_release);
  } else {
    Await(root, control(root).posted.value, c);
    bytes = control(root).posted_bytes[c % 2].load(std::memory_order_relaxed);
    if (bytes >= 0) data->assign(Mailbox(root, box), static_cast<size_t>(bytes));
  }
  control(rank_).taken.value.store(c, std::memory_order_release);
  if (bytes >= 0) strings_broadcast_.fetch_add(1, std::memory_order_relaxed);
  return bytes >= 0;
}

}  // namespace hvdmx
