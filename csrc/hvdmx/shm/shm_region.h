// The shared memory of one host's ranks as this rank sees it: one region
// per rank, each a control block (counters, the negotiation's words and
// mailboxes: shm_internal.h) and kStages stages of `chunk_bytes`, mapped by
// every rank (shm_segment.h maps it over MPI; tests use plain memory and
// one thread per rank). It owns what the collectives on it share: the
// regions and their layout, the count of chunks (seq) that every rank
// advances alike, the waits for a peer's counter (and noticing a peer that
// is gone), how the current call writes its stages, and the counters of
// what was done (ShmStats). The collectives are in ShmAllreduce
// (shm_allreduce.h), ShmExchange (shm_exchange.h) and ShmControl
// (shm_control.h); ShmHost (shm_host.h) holds the four together.
//
// Vocabulary. A message (one buffer, or the concatenation of a fused
// call's spans) is cut into chunks of at most chunk_bytes (the same cut on
// every rank); chunk k of a call travels through stage (seq % kStages) of
// a region, where seq numbers chunks over all calls since creation. Each
// rank's control block holds three counters: copied (its chunk is in its
// stage), reduced (its slice of the chunk is reduced) and done (it has
// finished reading chunk seq). A stage is written again (chunk seq +
// kStages) only after every rank has published done for seq (ClaimStage).
//
// Waiting: see Note [Waiting in shared memory] in shm_internal.h.
//
// Threading: a ShmRegion belongs to one rank and is used by one thread at a
// time; stats() may be read from any thread.
#ifndef HVDMX_SHM_REGION_H_
#define HVDMX_SHM_REGION_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/common.h"
#include "comm/comm.h"
#include "platform/stage_stores.h"

namespace hvdmx {

// First element of slice j when a chunk of `len` elements is cut into n
// slices of whole `unit`s (the last may be shorter); slices past the end are
// empty. ShmSliceStart(len, n, 0, u) == 0 and ShmSliceStart(len, n, n, u) == len.
int64_t ShmSliceStart(int64_t len, int n, int j, int64_t unit);

// Note [A peer that stops]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A rank whose runtime stops (a stall shutdown, a peer's failure, its own
// hvd.shutdown()) sets `stopped` in its control block, and a rank whose
// process ends without that is seen through its pid (kill(pid, 0) fails with
// ESRCH; asked at most every kPidCheckMicros per peer). Every wait in shared
// memory, and the bit-and's Test, ask about the peer they wait for once they
// sleep; a peer that is gone and has not written what the wait needs makes
// the call throw ShmPeerGone. The runtime then fails what it was running and
// what is pending, and stops in turn (runtime.h), so hvd.shutdown() and the
// process's exit never wait for a peer that will not come. A clean shutdown
// stops every rank after the same round, whose writes every peer has made
// before it marks itself stopped, so no wait of that round throws.
// peer() is the peer's rank among the host's ranks.
class ShmPeerGone : public PeerGone {
 public:
  using PeerGone::PeerGone;
};

// What the collectives on one region have done so far (a snapshot).
struct ShmStats {
  int64_t calls = 0;                 // allreduces and reduce-scatters
  int64_t streamed_calls = 0;        // calls of every kind that streamed their stores
  int64_t exchanges = 0;             // broadcasts, allgathers and alltoalls
  int64_t direct_exchanges = 0;      // those that read the peers' buffers directly
  int64_t root_writes = 0;           // direct broadcasts whose root wrote into peers
  int64_t push_exchanges = 0;        // exchanges that wrote into the peers' outputs
  int64_t collapsed_huge_pages = 0;  // under streams the peers read directly
  int64_t refused_huge_pages = 0;
  int64_t bit_ands = 0;           // completed
  int64_t strings_broadcast = 0;  // through the mailboxes
};

namespace shm_internal {
struct Control;
}  // namespace shm_internal

class ShmRegion {
 public:
  static constexpr int kStages = 4;
  // The negotiation's words and payloads in each control block (ShmControl).
  static constexpr int kMaxBitAndWords = 192;
  static constexpr int64_t kMaxPayloadBytes = 32 * 1024;

  // Bytes of one rank's region for a chunk size (rounded as the constructor
  // rounds it).
  static int64_t RegionBytes(int64_t chunk_bytes);
  // chunk_bytes rounded down to a multiple of 64, at least 64.
  static int64_t RoundChunkBytes(int64_t chunk_bytes);

  // `rank` and `size` are this rank's place among the ranks of its host.
  // `regions[j]` is local rank j's region as mapped in this process,
  // RegionBytes long, 64-byte aligned and zero before any rank's first call.
  // `owner` keeps the mapping alive as long as this object.
  ShmRegion(int rank, int size, std::vector<char*> regions, int64_t chunk_bytes,
            std::shared_ptr<void> owner);
  ShmRegion(const ShmRegion&) = delete;
  ShmRegion& operator=(const ShmRegion&) = delete;
  ~ShmRegion();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int64_t chunk_bytes() const { return chunk_bytes_; }

  shm_internal::Control& control(int j) const;
  // Rank j's mailbox i: 0 and 1 hold bit-and payloads, 2 and 3 broadcast
  // strings; kMaxPayloadBytes each, after its Control block.
  char* Mailbox(int j, int i) const;
  // Rank j's stage for chunk seq, where its chunk starts.
  char* Stage(int j, uint64_t seq) const;
  // This rank's stage for chunk seq, once every peer is done with the chunk
  // it held before, placed for a copy from `src`.
  char* ClaimStage(uint64_t seq, const char* src);

  // The next chunk's seq; every rank advances it alike.
  uint64_t seq() const { return seq_; }
  void Advance(uint64_t chunks) { seq_ += chunks; }

  // Waits until peer j's `counter` >= `target`; throws ShmPeerGone if j
  // stops or dies first (Note [A peer that stops]).
  void Await(int j, const std::atomic<uint64_t>& counter, uint64_t target);
  // Throws ShmPeerGone if peer j is gone and `counter` still falls short of
  // `target`.
  void ThrowIfGone(int j, const std::atomic<uint64_t>& counter, uint64_t target);
  // Tells the peers that this rank will make no more calls (Note [A peer
  // that stops]). Idempotent; the destructor calls it too.
  void MarkStopped();

  // The current call's stores: whether it streams (set by WithStores).
  bool streaming() const { return streaming_; }
  // A copy into shared memory, with the current call's stores.
  void StageCopy(char* dst, const char* src, int64_t bytes) const;
  // Releases `value` in one of this rank's counters, after the current
  // call's streaming stores (weakly ordered) if it streams.
  void PublishOwn(std::atomic<uint64_t>& counter, uint64_t value) const;
  // Runs body() (one call's chunks) with the stores `chooser` picks for a
  // call of `bytes`, and tells it how long that took; with !choose, with
  // cached stores and untimed.
  template <typename F>
  void WithStores(StageStoreChooser& chooser, int64_t bytes, bool choose, F&& body);

  // The counters behind stats(): the collectives add to them.
  struct Counters {
    std::atomic<int64_t> calls{0}, streamed_calls{0}, exchanges{0}, direct_exchanges{0},
        root_writes{0}, push_exchanges{0}, bit_ands{0}, strings_broadcast{0};
  };
  static void Count(std::atomic<int64_t>& counter) {
    counter.fetch_add(1, std::memory_order_relaxed);
  }
  Counters& counters() { return counters_; }
  // What was done so far (without the huge pages, which ShmExchange counts);
  // any thread may call it.
  ShmStats stats() const;

 private:
  static constexpr int64_t kPidCheckMicros = 100000;
  // Why peer j will write no more (it stopped, or its process is gone);
  // empty while it may.
  std::string PeerGoneReason(int j);

  const int rank_;
  const int size_;
  const std::vector<char*> regions_;
  const int64_t chunk_bytes_;
  std::shared_ptr<void> owner_;
  const int64_t spin_micros_;  // see Note [Waiting in shared memory]
  uint64_t seq_ = 0;           // chunks this rank has finished, over all calls
  bool streaming_ = false;     // the current call's stores
  Counters counters_;
  std::vector<std::chrono::steady_clock::time_point> next_pid_check_;  // per peer
};

template <typename F>
void ShmRegion::WithStores(StageStoreChooser& chooser, int64_t bytes, bool choose, F&& body) {
  streaming_ = choose && chooser.Streams(bytes);
  const auto start = std::chrono::steady_clock::now();
  body();
  if (choose) {
    chooser.Took(bytes, streaming_,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  if (streaming_) Count(counters_.streamed_calls);
  streaming_ = false;
}

}  // namespace hvdmx

#endif  // HVDMX_SHM_REGION_H_
