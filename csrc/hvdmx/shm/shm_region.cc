// See shm_region.h.
#include "shm/shm_region.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "platform/cpu_binding.h"
#include "shm/shm_internal.h"

namespace hvdmx {

using shm_internal::Control;
using shm_internal::kControlBlockBytes;
using shm_internal::kControlBytes;
using shm_internal::kPageBytes;
using shm_internal::kSliceAlignBytes;
using shm_internal::kSpinMicros;
using shm_internal::WaitFor;

// Note [Where a chunk sits in its stage]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A stage is a page longer than a chunk, and a chunk is placed in it at the
// offset that puts it half a page away from where it sits in the rank's
// buffer: (stage address - buffer address) mod 4096 == 2048. Copies between
// two addresses a few bytes apart modulo a page run at a fraction of memory
// speed (load/store 4K aliasing; docs/benchmark-notes.md, "Figures the
// code cites"), and the buffers' offsets in their pages are whatever the
// allocator gave. The offset is chosen per chunk and published with it
// (Control::shift), since peers read the stage.

int64_t ShmSliceStart(int64_t len, int n, int j, int64_t unit) {
  const int64_t units = (len + unit - 1) / unit;
  const int64_t per_slice = (units + n - 1) / n;
  return std::min(len, static_cast<int64_t>(j) * per_slice * unit);
}

int64_t ShmRegion::RoundChunkBytes(int64_t chunk_bytes) {
  return std::max<int64_t>(kSliceAlignBytes, chunk_bytes / kSliceAlignBytes * kSliceAlignBytes);
}

int64_t ShmRegion::RegionBytes(int64_t chunk_bytes) {
  return kControlBytes + kStages * (RoundChunkBytes(chunk_bytes) + kPageBytes);
}

ShmRegion::ShmRegion(int rank, int size, std::vector<char*> regions, int64_t chunk_bytes,
                     std::shared_ptr<void> owner)
    : rank_(rank),
      size_(size),
      regions_(std::move(regions)),
      chunk_bytes_(RoundChunkBytes(chunk_bytes)),
      owner_(std::move(owner)),
      spin_micros_(size <= UsableCpuCount() ? kSpinMicros : 0),
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

ShmRegion::~ShmRegion() { MarkStopped(); }

Control& ShmRegion::control(int j) const { return *reinterpret_cast<Control*>(regions_[j]); }

void ShmRegion::MarkStopped() { control(rank_).stopped.store(1, std::memory_order_release); }

std::string ShmRegion::PeerGoneReason(int j) {
  const Control& peer = control(j);
  const int64_t pid = peer.pid.load(std::memory_order_relaxed);
  const std::string who =
      "rank " + std::to_string(j) + " of this host (pid " + std::to_string(pid) + ")";
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

void ShmRegion::ThrowIfGone(int j, const std::atomic<uint64_t>& counter, uint64_t target) {
  const std::string why = PeerGoneReason(j);
  // The peer's writes before its stop are visible once the stop is: a last
  // look at the counter tells whether it wrote what the wait needs.
  if (!why.empty() && counter.load(std::memory_order_acquire) < target) {
    throw ShmPeerGone(j, PeerGoneMessage(why));
  }
}

void ShmRegion::Await(int j, const std::atomic<uint64_t>& counter, uint64_t target) {
  WaitFor(counter, target, spin_micros_, [&] { ThrowIfGone(j, counter, target); });
}

char* ShmRegion::Mailbox(int j, int i) const {
  return regions_[j] + kControlBlockBytes + i * kMaxPayloadBytes;
}

char* ShmRegion::Stage(int j, uint64_t seq) const {
  const int stage = static_cast<int>(seq % kStages);
  return regions_[j] + kControlBytes + stage * (chunk_bytes_ + kPageBytes) +
         control(j).shift[stage].load(std::memory_order_relaxed);
}

char* ShmRegion::ClaimStage(uint64_t seq, const char* src) {
  if (seq >= kStages) {
    // The stage held chunk seq - kStages: wait until every rank is done with it.
    for (int j = 0; j < size_; ++j) {
      if (j != rank_) Await(j, control(j).done.value, seq - kStages + 1);
    }
  }
  // See Note [Where a chunk sits in its stage].
  const int64_t shift =
      static_cast<int64_t>((reinterpret_cast<uintptr_t>(src) + kPageBytes / 2) % kPageBytes);
  control(rank_).shift[seq % kStages].store(shift, std::memory_order_relaxed);
  return Stage(rank_, seq);
}

void ShmRegion::PublishOwn(std::atomic<uint64_t>& counter, uint64_t value) const {
  if (streaming_) StreamingStoresFence();
  counter.store(value, std::memory_order_release);
}

void ShmRegion::StageCopy(char* dst, const char* src, int64_t bytes) const {
  if (streaming_) {
    StreamingCopy(dst, src, bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
}

ShmStats ShmRegion::stats() const {
  auto get = [](const std::atomic<int64_t>& c) { return c.load(std::memory_order_relaxed); };
  ShmStats s;
  s.calls = get(counters_.calls);
  s.streamed_calls = get(counters_.streamed_calls);
  s.exchanges = get(counters_.exchanges);
  s.direct_exchanges = get(counters_.direct_exchanges);
  s.root_writes = get(counters_.root_writes);
  s.push_exchanges = get(counters_.push_exchanges);
  s.bit_ands = get(counters_.bit_ands);
  s.strings_broadcast = get(counters_.strings_broadcast);
  return s;
}

}  // namespace hvdmx
