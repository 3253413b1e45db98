// ShmExchange's calls through the stages: see shm_exchange.h. Direct
// reads are in shm_exchange_direct.cc, writes into the peers' outputs in
// shm_exchange_push.cc.
#include "shm/shm_exchange.h"

#include <algorithm>
#include <cstring>

#include "shm/shm_internal.h"

namespace hvdmx {

ShmExchange::ShmExchange(ShmRegion* region, bool single_host, int64_t direct_min_bytes,
                         StageStores stores, bool huge_pages)
    : region_(region),
      rank_(region->rank()),
      size_(region->size()),
      chunk_bytes_(region->chunk_bytes()),
      single_host_(single_host),
      huge_pages_(huge_pages),
      direct_min_bytes_(direct_min_bytes),
      move_stores_{
          {StageStoreChooser(stores), StageStoreChooser(stores), StageStoreChooser(stores)}},
      push_stores_{{StageStoreChooser(stores, kPushStreamMinBytes),
                    StageStoreChooser(stores, kPushStreamMinBytes),
                    StageStoreChooser(stores, kPushStreamMinBytes)}} {}

void ShmExchange::Broadcast(const void* in, void* out, int64_t bytes, int root) {
  HVDMX_CHECK(single_host_ && root >= 0 && root < size_,
              "shared-memory broadcast: one host, root in it");
  reads_.assign(size_, Read());
  if (rank_ != root || in != out) reads_[root] = {0, bytes, static_cast<char*>(out)};
  lengths_.assign(size_, 0);
  lengths_[root] = bytes;
  out_ = Output();  // a broadcast's output may be the caller's own array
  Exchange(kBroadcast, {static_cast<const char*>(rank_ == root ? in : out), 0, 0});
}

void ShmExchange::Allgather(const void* in, void* out, const std::vector<int64_t>& starts) {
  HVDMX_CHECK(single_host_ && static_cast<int>(starts.size()) == size_ + 1,
              "shared-memory allgather: one host, size + 1 offsets");
  reads_.assign(size_, Read());
  lengths_.assign(size_, 0);
  char* dst = static_cast<char*>(out);
  for (int j = 0; j < size_; ++j) {
    lengths_[j] = starts[j + 1] - starts[j];
    // A block that is already in place is not copied onto itself.
    if (j != rank_ || in != dst + starts[j]) reads_[j] = {0, lengths_[j], dst + starts[j]};
  }
  const int64_t mine = starts[rank_ + 1] - starts[rank_];
  sends_.assign(size_, {static_cast<const char*>(in), mine, starts[rank_]});
  if (in == dst + starts[rank_]) sends_[rank_].bytes = 0;
  out_ = {dst, starts[size_], starts[size_]};
  Exchange(kAllgather, {static_cast<const char*>(in), 0, 0});
}

void ShmExchange::Alltoall(const void* in, void* out, const std::vector<int64_t>& bytes) {
  HVDMX_CHECK(single_host_ && static_cast<int64_t>(bytes.size()) == int64_t{size_} * size_,
              "shared-memory alltoall: one host, size * size byte counts");
  reads_.assign(size_, Read());
  lengths_.assign(size_, 0);
  sends_.assign(size_, Send());
  out_ = {static_cast<char*>(out), 0, 0};
  const char* src = static_cast<const char*>(in);
  for (int j = 0; j < size_; ++j) {
    // Rank j's output: what every rank sends it, in rank order.
    int64_t received = 0;
    for (int i = 0; i < size_; ++i) {
      if (i == rank_) sends_[j] = {src, bytes[rank_ * size_ + j], received};
      received += bytes[i * size_ + j];
    }
    src += bytes[rank_ * size_ + j];
    if (j == rank_) out_.bytes = received;
    out_.min_bytes = j == 0 ? received : std::min(out_.min_bytes, received);
  }
  char* dst = static_cast<char*>(out);
  Stream mine{static_cast<const char*>(in), 0, bytes[rank_ * size_ + rank_]};
  for (int j = 0; j < size_; ++j) {
    // Rank j's stream: what it sends to ranks 0, 1, ... but not to itself.
    int64_t before_me = 0;
    for (int l = 0; l < size_; ++l) {
      if (l < rank_ && l != j) before_me += bytes[j * size_ + l];
      if (l != j) lengths_[j] += bytes[j * size_ + l];
    }
    if (j == rank_) mine.hole_at = before_me;
    reads_[j] = {before_me, bytes[j * size_ + rank_], dst};
    dst += bytes[j * size_ + rank_];
  }
  Exchange(kAlltoall, mine);
}

// Chunk k of every stream travels in chunk seq first_seq + k; every rank
// runs the same number of chunks (the longest stream's), publishing empty
// ones too, so that seq stays the same everywhere. This rank's own read
// comes from its stream's bytes, hole included, a chunk's worth per chunk
// and the rest at the end.
void ShmExchange::Exchange(Move move, const Stream& stream) {
  ShmRegion::Count(region_->counters().exchanges);
  // Every rank knows every rank's output size, so all try a push or none.
  if (size_ > 1 && writes_into_peers() && out_.data != nullptr &&
      out_.min_bytes >= push_min_output_bytes_ && ExchangePush(move)) {
    return;
  }
  const int64_t longest = *std::max_element(lengths_.begin(), lengths_.end());
  const int64_t direct = DirectMinBytes(move);
  if (size_ > 1 && direct >= 0 && longest >= direct && longest > 0) {
    ExchangeDirect(move, stream);
    return;
  }
  const int64_t chunks = size_ == 1 ? 0 : (longest + chunk_bytes_ - 1) / chunk_bytes_;
  const uint64_t first_seq = region_->seq();
  int64_t total = 0;  // the chooser's size: every byte that crosses the stages
  for (int64_t length : lengths_) total += length;
  region_->WithStores(move_stores_[move], total, chunks > 0, [&] {
    if (chunks > 0) Publish(stream, lengths_[rank_], first_seq, 0);
    for (int64_t k = 0; k < chunks; ++k) {
      if (k + 1 < chunks) Publish(stream, lengths_[rank_], first_seq + k + 1, k + 1);
      Collect(stream, first_seq + k, k);
    }
  });
  region_->Advance(static_cast<uint64_t>(chunks));
  const Read& self = reads_[rank_];
  const int64_t done = std::min(self.bytes, chunks * chunk_bytes_);
  if (self.bytes > done) {
    std::memmove(self.dst + done, stream.data + self.offset + done, self.bytes - done);
  }
}

int64_t ShmExchange::DirectMinBytes(Move move) const {
  if (direct_min_bytes_ != kDirectAuto) return direct_min_bytes_;
  return move == kAlltoall || move == kBroadcast ? kAutoDirectMinBytes : -1;
}

void ShmExchange::Publish(const Stream& stream, int64_t length, uint64_t seq, int64_t k) {
  const int64_t lo = k * chunk_bytes_;
  const int64_t n = std::max<int64_t>(0, std::min(chunk_bytes_, length - lo));
  // [lo, lo + n) of the stream: before the hole, then after it.
  const int64_t before = std::max<int64_t>(0, std::min(n, stream.hole_at - lo));
  const char* first = stream.data + lo + (before > 0 ? 0 : stream.hole_bytes);
  char* stage = region_->ClaimStage(seq, n > 0 ? first : stream.data);
  if (before > 0) region_->StageCopy(stage, stream.data + lo, before);
  if (n > before) {
    region_->StageCopy(stage + before, stream.data + lo + before + stream.hole_bytes, n - before);
  }
  region_->PublishOwn(region_->control(rank_).copied.value, seq + 1);
}

void ShmExchange::Collect(const Stream& stream, uint64_t seq, int64_t k) {
  const int64_t lo = k * chunk_bytes_;
  const int64_t hi = lo + chunk_bytes_;
  // This rank's own read first (a chunk's worth), then the peers from the
  // next rank on, as CopyOut does.
  const Read& self = reads_[rank_];
  if (lo < self.bytes) {
    std::memmove(self.dst + lo, stream.data + self.offset + lo, std::min(hi, self.bytes) - lo);
  }
  for (int i = 1; i < size_; ++i) {
    const int j = (rank_ + i) % size_;
    const Read& read = reads_[j];
    const int64_t a = std::max(lo, read.offset);
    const int64_t b = std::min(hi, read.offset + read.bytes);
    if (b <= a) continue;
    region_->Await(j, region_->control(j).copied.value, seq + 1);
    std::memcpy(read.dst + (a - read.offset), region_->Stage(j, seq) + (a - lo), b - a);
  }
  region_->control(rank_).done.value.store(seq + 1, std::memory_order_release);
}

}  // namespace hvdmx
