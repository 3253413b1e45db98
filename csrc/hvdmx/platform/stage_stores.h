// How a rank writes its shared-memory stages: with ordinary (cached) stores
// or with streaming (non-temporal) stores, and the choice between them.
//
// Note [Streaming stores into the stages]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A rank's peers read what it writes into its stages. Written with ordinary
// stores, a chunk sits dirty in the writer's caches, and each peer's read
// is a transfer from that core's caches: fast when the two cores share a
// cache, slow when they sit in different core complexes (chiplets, sockets)
// and every line crosses between them one miss at a time. Written with
// streaming stores, the chunk goes to memory and the peer streams it back
// with the prefetchers' help: slower than a shared cache, faster than the
// crossing. On this project's 2-core VM both happen in one job: the
// hypervisor moves the two cores, and a large allreduce was faster
// streaming in one phase and faster cached in the other, switching within
// minutes (docs/benchmark-notes.md, "Streaming stores: faster in the slow
// phase").
//
// So under HVDMX_SHM_STREAMING_STORES=auto each rank measures. Calls are
// sorted by size into classes (factors of 2 from the least size that may
// stream, kMinBytes unless the owner gives another); in each class
// the rank keeps the seconds per byte of the last kSamples calls made with
// each kind of store, and compares the fastest of each. Noise here only ever
// slows a call down (a late peer, a preemption, a page fault), and comes in
// bursts: two slow calls in five are common, which moved a median and sent
// a rank to the slower kind for a whole round. The first call of a class
// warms up (cached, not timed: its pages may be fresh), the next kTrials are
// cached, the kTrials after them stream, and from then on the faster kind is
// used, except that the last kTrials calls of every kExploreEvery take the
// kind that was slower when they began, so that a change of phase is seen:
// the kind in use sees it itself once kSamples calls have been slow. Calls
// are counted per class and every rank makes the same calls, so the ranks
// explore in the same calls and time the same mix. The choice changes only
// how bytes are stored, never which bytes: the ranks need not agree, and
// results stay bitwise identical.
//
// Calls below kMinBytes stay cached: their time is mostly the hand-offs
// between ranks, and the stores made no difference to it
// (docs/benchmark-notes.md, "Figures the code cites"). Writes into peers'
// outputs take a higher least size (ShmExchange::kPushStreamMinBytes).
//
// Threading: one thread at a time (the shared-memory calls').
#ifndef HVDMX_STAGE_STORES_H_
#define HVDMX_STAGE_STORES_H_

#include <array>
#include <cstdint>
#include <string>

namespace hvdmx {

// HVDMX_SHM_STREAMING_STORES: auto (measure, see above), 0 (cached), 1
// (streaming).
enum class StageStores : int { kAuto = 0, kCached, kStreaming };
std::string StageStoresName(StageStores stores);

class StageStoreChooser {
 public:
  static constexpr int64_t kMinBytes = int64_t{64} << 10;
  static constexpr int kClasses = 12;  // [64, 128) KiB, ... [64, 128) MiB, more
  static constexpr int kSamples = 5;
  static constexpr int kTrials = 3;
  static constexpr int64_t kExploreEvery = 64;

  explicit StageStoreChooser(StageStores stores, int64_t min_bytes = kMinBytes)
      : stores_(stores), min_bytes_(min_bytes) {}

  StageStores stores() const { return stores_; }
  // Whether the next call, of `bytes`, streams its stage writes. Call Took
  // with its time before asking again.
  bool Streams(int64_t bytes);
  // The call Streams was last asked about took `seconds`.
  void Took(int64_t bytes, bool streamed, double seconds);

 private:
  // -1 below min_bytes_.
  int SizeClass(int64_t bytes) const;
  // The last kSamples seconds per byte of one kind of store, in a ring.
  struct Samples {
    std::array<double, kSamples> seconds_per_byte{};
    int count = 0;        // taken so far
    double Best() const;  // the fewest seconds per byte (count > 0)
  };
  struct Class {
    std::array<Samples, 2> kinds;  // [cached, streaming]
    int64_t calls = 0;
    bool explore_streaming = false;  // the kind the current exploration takes
  };
  const StageStores stores_;
  const int64_t min_bytes_;  // smaller calls stay cached under kAuto
  std::array<Class, kClasses> classes_;
};

// Copies `bytes` from src to dst with streaming stores where the CPU has
// them (x86-64; elsewhere: memcpy). The stores are weakly ordered: call
// StreamingStoresFence before publishing what they wrote.
void StreamingCopy(void* dst, const void* src, int64_t bytes);
void StreamingStoresFence();

}  // namespace hvdmx

#endif  // HVDMX_STAGE_STORES_H_
