// See shm_control.h.
#include "shm/shm_control.h"

#include <cstring>

#include "shm/shm_internal.h"

namespace hvdmx {

using shm_internal::Control;

// Note [Bit-and through shared memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Two sets of words per rank are enough: a rank starts bit-and seq + 2 (and
// overwrites the words of seq) only after its Test of seq + 1 succeeded,
// which needs every peer to have started seq + 1, which each does only
// after its own Test of seq, the last read of those words.
void ShmControl::StartBitAnd(uint64_t* words, int n, const std::string& payload) {
  HVDMX_CHECK(n >= 0 && n <= kMaxBitAndWords, "too many words for the shared-memory bit-and");
  HVDMX_CHECK(static_cast<int64_t>(payload.size()) <= kMaxPayloadBytes,
              "a bit-and payload longer than its mailbox");
  HVDMX_CHECK(bit_and_words_ == nullptr, "a bit-and is already outstanding");
  const uint64_t seq = ++bit_and_seq_;
  const int rank = region_->rank();
  Control& mine = region_->control(rank);
  std::memcpy(mine.words[seq % 2], words, n * sizeof(uint64_t));
  if (!payload.empty())
    std::memcpy(region_->Mailbox(rank, seq % 2), payload.data(), payload.size());
  mine.payload_bytes[seq % 2].store(static_cast<int64_t>(payload.size()),
                                    std::memory_order_relaxed);
  mine.anded.value.store(seq, std::memory_order_release);
  bit_and_words_ = words;
  bit_and_count_ = n;
}

bool ShmControl::TestBitAnd() {
  HVDMX_CHECK(bit_and_words_ != nullptr, "no bit-and outstanding");
  const uint64_t seq = bit_and_seq_;
  const int size = region_->size();
  for (int j = 0; j < size; ++j) {
    const Control& peer = region_->control(j);
    if (peer.anded.value.load(std::memory_order_acquire) >= seq) continue;
    region_->ThrowIfGone(j, peer.anded.value, seq);  // see Note [A peer that stops]
    return false;
  }
  for (int j = 0; j < size; ++j) {
    if (j == region_->rank()) continue;
    const uint64_t* theirs = region_->control(j).words[seq % 2];
    for (int i = 0; i < bit_and_count_; ++i) bit_and_words_[i] &= theirs[i];
  }
  bit_and_words_ = nullptr;
  ShmRegion::Count(region_->counters().bit_ands);
  return true;
}

std::string ShmControl::BitAndPayload(int j) const {
  HVDMX_CHECK(j >= 0 && j < region_->size() && bit_and_seq_ > 0 && bit_and_words_ == nullptr,
              "a bit-and payload read before its bit-and completed");
  const uint64_t seq = bit_and_seq_;
  const int64_t bytes = region_->control(j).payload_bytes[seq % 2].load(std::memory_order_relaxed);
  return std::string(region_->Mailbox(j, static_cast<int>(seq % 2)), static_cast<size_t>(bytes));
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
bool ShmControl::BcastString(std::string* data, int root) {
  const int rank = region_->rank();
  const int size = region_->size();
  HVDMX_CHECK(root >= 0 && root < size, "shared-memory string broadcast: root in the host");
  const uint64_t c = ++bcast_calls_;
  const int box = 2 + static_cast<int>(c % 2);
  int64_t bytes = 0;
  if (rank == root) {
    for (int j = 0; j < size; ++j) {
      if (j != rank && c > 2) region_->Await(j, region_->control(j).taken.value, c - 2);
    }
    const bool fits = static_cast<int64_t>(data->size()) <= kMaxPayloadBytes;
    bytes = fits ? static_cast<int64_t>(data->size()) : -1;
    if (bytes > 0) std::memcpy(region_->Mailbox(rank, box), data->data(), data->size());
    Control& mine = region_->control(rank);
    mine.posted_bytes[c % 2].store(bytes, std::memory_order_relaxed);
    mine.posted.value.store(c, std::memory_order_release);
  } else {
    const Control& theirs = region_->control(root);
    region_->Await(root, theirs.posted.value, c);
    bytes = theirs.posted_bytes[c % 2].load(std::memory_order_relaxed);
    if (bytes >= 0) data->assign(region_->Mailbox(root, box), static_cast<size_t>(bytes));
  }
  region_->control(rank).taken.value.store(c, std::memory_order_release);
  if (bytes >= 0) ShmRegion::Count(region_->counters().strings_broadcast);
  return bytes >= 0;
}

}  // namespace hvdmx
