// What the shared-memory collectives (shm_region.cc, shm_allreduce.cc,
// shm_exchange*.cc, shm_control.cc) share and nothing else includes: the
// waiting loop, the sizes stages and blocks are cut by, and the layout of a
// rank's control block. The vocabulary is shm_region.h's.
#ifndef HVDMX_SHM_INTERNAL_H_
#define HVDMX_SHM_INTERNAL_H_

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#include "shm/shm_region.h"

namespace hvdmx {
namespace shm_internal {

// Note [Waiting in shared memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A rank waits for a peer's counter in three stages: it polls with a CPU
// pause for about kSpinMicros (peers normally arrive within microseconds:
// every rank runs the same phases at once), then yields its core until
// kYieldMicros have passed (another process may need it), then sleeps
// kSleepMicros at a time. When the host's ranks outnumber the cores this
// process may run on (mpiexec -n 4 on two cores), the peer may be waiting
// for this very core: the spin is skipped. Once a wait sleeps it also asks
// whether the peer is still there (Note [A peer that stops]); if not, and
// the counter still falls short, it throws ShmPeerGone instead of waiting
// for a write that will never come.
constexpr int64_t kSpinMicros = 20;
constexpr int64_t kYieldMicros = 2000;
constexpr int64_t kSleepMicros = 50;

// Bytes reduced (and then copied to the rank's buffer) at a time, so that the
// copy reads the result from the first-level cache.
constexpr int64_t kBlockBytes = 16 * 1024;
// Elements of a half dtype reduced in float32 at a time (Note [Half
// precision summed in float32]): 4 KiB of partials, which stay in the
// first-level cache while every operand is folded in.
constexpr int64_t kWideBlockElems = 1024;
// Slices are cut at multiples of this many bytes (one cache line).
constexpr int64_t kSliceAlignBytes = 64;
// See Note [Where a chunk sits in its stage].
constexpr int64_t kPageBytes = 4096;
// The counters sit at the start of each region, one per 128 bytes (two
// cache lines: the adjacent-line prefetcher would otherwise couple them),
// in its Control block; the negotiation's four mailboxes follow it
// (ShmRegion::Mailbox).
constexpr int64_t kControlBlockBytes = 8192;
constexpr int64_t kMailboxes = 4;
constexpr int64_t kControlBytes = kControlBlockBytes + kMailboxes * ShmRegion::kMaxPayloadBytes;

#if defined(__x86_64__)
inline void CpuRelax() { __builtin_ia32_pause(); }
#elif defined(__aarch64__)
inline void CpuRelax() { asm volatile("yield" ::: "memory"); }
#else
inline void CpuRelax() {}
#endif

using Clock = std::chrono::steady_clock;

inline int64_t MicrosSince(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count();
}

// Returns once `counter` >= `target`. See Note [Waiting in shared memory].
// `check()` is called between sleeps, and throws when the peer that writes
// `counter` will not write it any more (ShmRegion::ThrowIfGone).
template <typename Check>
inline void WaitFor(const std::atomic<uint64_t>& counter, uint64_t target, int64_t spin_micros,
                    Check&& check) {
  if (counter.load(std::memory_order_acquire) >= target) return;
  const Clock::time_point start = Clock::now();
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      CpuRelax();
      if (counter.load(std::memory_order_acquire) >= target) return;
    }
    const int64_t waited = MicrosSince(start);
    if (waited < spin_micros) continue;
    if (waited < kYieldMicros) {
      sched_yield();
    } else {
      check();
      std::this_thread::sleep_for(std::chrono::microseconds(kSleepMicros));
    }
  }
}

struct alignas(128) PaddedCounter {
  std::atomic<uint64_t> value{0};
};
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "the counters must be lock-free to work across processes");

// Lives at the start of each rank's region; only its owner writes it.
struct Control {
  PaddedCounter copied;   // chunks whose copy-in this rank has finished
  PaddedCounter reduced;  // chunks whose slice this rank has reduced
  PaddedCounter done;     // chunks this rank has finished reading
  // Per stage: where its chunk starts in it. Written before `copied` is
  // released for the chunk, read after acquiring it.
  alignas(128) std::atomic<int64_t> shift[ShmRegion::kStages];
  // Bit-and seq (from 1) uses words[seq % 2], written before `anded` is
  // released with seq; see ShmControl::StartBitAnd.
  PaddedCounter anded;
  alignas(128) uint64_t words[2][ShmRegion::kMaxBitAndWords];
  // Bit-and seq's payload is payload_bytes[seq % 2] long, in mailbox
  // seq % 2; both written before `anded` is released with seq.
  alignas(128) std::atomic<int64_t> payload_bytes[2];
  // BcastString call c (from 1, counted alike on every rank) whose root
  // this rank is: its length in posted_bytes[c % 2] (-1: too long for the
  // mailbox), its bytes in mailbox 2 + c % 2, then `posted` released with
  // c. Every rank releases `taken` with c once it is done with call c.
  PaddedCounter posted;
  alignas(128) std::atomic<int64_t> posted_bytes[2];
  PaddedCounter taken;
  // A direct exchange's stream, in this rank's address space (see Note
  // [Reading peers' buffers directly]): written before `copied` is released
  // for the call, read after acquiring it. `pid` is set by the constructor.
  alignas(128) std::atomic<int64_t> pid;
  std::atomic<uint64_t> stream_data;
  std::atomic<int64_t> stream_hole_at;
  std::atomic<int64_t> stream_hole_bytes;
  // A direct broadcast's read on a rank other than the root: where it lands
  // in this rank's address space, and its length (0: none), for the root to
  // write its end. Written and read as the stream's fields are.
  std::atomic<uint64_t> read_dst;
  std::atomic<int64_t> read_bytes;
  // A direct broadcast's root: 1 if it writes the end of the others' reads
  // (in place, when it has nothing to copy for itself), else 0.
  std::atomic<int64_t> root_writes;
  // A push's output, or a direct broadcast's read on a rank other than the
  // root: its offset in this rank's shared output file, or -1 (Note
  // [Writing into peers' outputs]). Written before `copied` is released for
  // the call, read after acquiring it.
  std::atomic<int64_t> out_offset;
  // 1 once this rank has stopped using the region (Note [A peer that
  // stops]); released after its last write to the counters.
  alignas(128) std::atomic<int64_t> stopped;
};

}  // namespace shm_internal
}  // namespace hvdmx

#endif  // HVDMX_SHM_INTERNAL_H_
