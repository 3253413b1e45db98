// The negotiation's control channel through shared memory: a bitwise AND of
// words over the host's ranks with a payload from each (mailboxes), and a
// string broadcast, through the ranks' control blocks (shm_internal.h).
// Independent of the collectives on the same region: it has its own
// counters and words in each control block, so its calls interleave with
// theirs in any order. ShmControlComm (shm_control_comm.h) puts it behind
// the Comm interface.
//
// Threading: a ShmControl belongs to one rank and is used by one thread at
// a time. All ranks make the same calls in the same order.
#ifndef HVDMX_SHM_CONTROL_H_
#define HVDMX_SHM_CONTROL_H_

#include <cstdint>
#include <string>

#include "shm/shm_region.h"

namespace hvdmx {

class ShmControl {
 public:
  static constexpr int kMaxBitAndWords = ShmRegion::kMaxBitAndWords;
  static constexpr int64_t kMaxPayloadBytes = ShmRegion::kMaxPayloadBytes;

  // `region` outlives this object.
  explicit ShmControl(ShmRegion* region) : region_(region) {}
  ShmControl(const ShmControl&) = delete;
  ShmControl& operator=(const ShmControl&) = delete;

  // A bitwise AND of `n` words over the host's ranks, split like
  // Comm::StartBitAnd / TestBitAnd (the negotiation's one collective per
  // round): Start publishes this rank's words, Test returns true once every
  // rank has published, with the AND in `words`. One may be outstanding at
  // a time; n <= kMaxBitAndWords.
  // `payload` (at most kMaxPayloadBytes) travels with the words: once Test
  // has returned true, BitAndPayload(j) is what rank j started this bit-and
  // with, until this rank's next Start (see Note [Negotiation through
  // shared memory]).
  void StartBitAnd(uint64_t* words, int n, const std::string& payload = std::string());
  bool TestBitAnd();
  std::string BitAndPayload(int j) const;
  // Comm::BcastString of at most kMaxPayloadBytes, through the root's
  // control block: every rank calls it, in the same order, and gets true
  // once *data holds the root's string, or false, having changed nothing,
  // when the root's is longer (then every rank must broadcast it another
  // way).
  bool BcastString(std::string* data, int root);

 private:
  ShmRegion* const region_;
  uint64_t bit_and_seq_ = 0;  // bit-ands this rank has started
  uint64_t* bit_and_words_ = nullptr;
  int bit_and_count_ = 0;
  uint64_t bcast_calls_ = 0;  // BcastStrings this rank has made
};

}  // namespace hvdmx

#endif  // HVDMX_SHM_CONTROL_H_
