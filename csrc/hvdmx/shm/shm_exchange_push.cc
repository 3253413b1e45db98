// ShmExchange's writes into the peers' outputs: see Note [Writing into
// peers' outputs] below.
#include <cstring>

#include "shm/shm_exchange.h"
#include "shm/shm_internal.h"

namespace hvdmx {

using shm_internal::Control;

void ShmExchange::WriteIntoPeers(std::vector<char*> arenas, int64_t arena_bytes,
                                 int64_t min_output_bytes) {
  HVDMX_CHECK(single_host_ && static_cast<int>(arenas.size()) == size_ && arena_bytes > 0 &&
                  min_output_bytes > 0,
              "writing into peers' outputs: one host, one output file per rank, outputs of "
              "a byte or more");
  arenas_ = std::move(arenas);
  arena_bytes_ = arena_bytes;
  push_min_output_bytes_ = min_output_bytes;
}

int64_t ShmExchange::OffsetInFile(const char* data, int64_t bytes) const {
  if (arenas_.empty()) return -1;
  const uintptr_t at = reinterpret_cast<uintptr_t>(data);
  const uintptr_t file = reinterpret_cast<uintptr_t>(arenas_[rank_]);
  const int64_t offset = static_cast<int64_t>(at - file);
  return at < file || offset > arena_bytes_ - bytes ? -1 : offset;
}

// Note [Writing into peers' outputs]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// An allgather's or alltoall's output is a new array, and the output pool
// cuts new arrays from a shared-memory file that every rank of the host
// has mapped (Note [Outputs in shared memory] in output_pool.h). A rank can
// then write its rows for rank j straight into j's output: each byte is
// copied once, by its sender, with plain stores into memory mapped in both
// processes (no system call, no pages to pin), where the stages copy it
// twice. That made alltoalls and allgathers of a few MiB faster than the
// stages, and level for large ones (docs/benchmark-notes.md, "Writing into
// peers' outputs").
//
// One call takes one chunk seq, s, and no stage:
// - each rank writes its output's offset in its file (or -1 when the
//   output is not in it) into its control block and publishes copied = s+1;
// - it waits for every peer's copied and reads their offsets. If any is -1,
//   every rank sees it: each publishes done = s+1, waits for the others'
//   done (so that no one still reads its offset), and the call goes on
//   through the stages or direct reads from seq s+1;
// - otherwise it copies its own rows into its output, then its rows for
//   each peer (from the next rank on) into that peer's output, publishes
//   done = s+1, and returns once every peer has published done: until then
//   a peer may still be writing into its output. From kPushStreamMinBytes
//   written, the copies use the stores push_stores_ chooses (Note
//   [Streaming stores into the stages]), fenced before done.
// Staged, direct and pushed calls keep copied and done at the count of
// chunks, so they follow each other in any order, as in direct reads.
bool ShmExchange::ExchangePush(Move move) {
  const uint64_t seq = region_->seq();
  region_->Advance(1);
  Control& mine = region_->control(rank_);
  const int64_t offset = OffsetInFile(out_.data, out_.bytes);
  mine.out_offset.store(offset, std::memory_order_relaxed);
  mine.copied.value.store(seq + 1, std::memory_order_release);
  bool all = offset >= 0;
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    region_->Await(j, region_->control(j).copied.value, seq + 1);
    all = all && region_->control(j).out_offset.load(std::memory_order_relaxed) >= 0;
  }
  if (all) {
    int64_t total = 0;  // the chooser's size: every byte this rank writes
    for (const Send& send : sends_) total += send.bytes;
    region_->WithStores(push_stores_[move], total, true, [&] {
      for (int i = 0; i < size_; ++i) {
        const int j = (rank_ + i) % size_;
        const Send& send = sends_[j];
        if (send.bytes == 0) continue;
        char* out = j == rank_ ? out_.data
                               : arenas_[j] +
                                     region_->control(j).out_offset.load(std::memory_order_relaxed);
        // The output is new, so no send overlaps it: an own block already
        // in place (a fused allgather's) has no bytes to send.
        region_->StageCopy(out + send.at, send.src, send.bytes);
      }
      if (region_->streaming()) StreamingStoresFence();  // before `done` tells the peers
    });
  }
  mine.done.value.store(seq + 1, std::memory_order_release);
  for (int j = 0; j < size_; ++j) {
    if (j != rank_) region_->Await(j, region_->control(j).done.value, seq + 1);
  }
  if (all) ShmRegion::Count(region_->counters().push_exchanges);
  return all;
}

}  // namespace hvdmx
