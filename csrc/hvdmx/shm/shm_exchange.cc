// ShmAllreduce's byte-moving calls and its reduce-scatter: see "Moving
// bytes" in shm_allreduce.h. The allreduce and the bit-and are in
// shm_allreduce.cc; what both files share is in shm_internal.h.
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "algorithms/reduce_kernels.h"
#include "shm/shm_allreduce.h"
#include "shm/shm_internal.h"

namespace hvdmx {

using shm_internal::kBlockBytes;
using shm_internal::kSliceAlignBytes;

void ShmAllreduce::Broadcast(const void* in, void* out, int64_t bytes, int root) {
  HVDMX_CHECK(!cross_ && root >= 0 && root < size_, "shared-memory broadcast: one host, root in it");
  reads_.assign(size_, Read());
  if (rank_ != root || in != out) reads_[root] = {0, bytes, static_cast<char*>(out)};
  lengths_.assign(size_, 0);
  lengths_[root] = bytes;
  out_ = Output();  // a broadcast's output may be the caller's own array
  Exchange(kBroadcast, {static_cast<const char*>(rank_ == root ? in : out), 0, 0});
}

void ShmAllreduce::Allgather(const void* in, void* out, const std::vector<int64_t>& starts) {
  HVDMX_CHECK(!cross_ && static_cast<int>(starts.size()) == size_ + 1,
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

void ShmAllreduce::Alltoall(const void* in, void* out, const std::vector<int64_t>& bytes) {
  HVDMX_CHECK(!cross_ && static_cast<int64_t>(bytes.size()) == int64_t{size_} * size_,
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
  HVDMX_CHECK(!cross_ && static_cast<int>(starts.size()) == size_ + 1 &&
                  ReduceScatterFits(dtype),
              "shared-memory reduce-scatter: one host, size + 1 offsets, a chunk that fits");
  calls_.fetch_add(1, std::memory_order_relaxed);
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
  const uint64_t first_seq = seq_;
  auto copy_in = [&](int64_t k) {
    const uint64_t seq = first_seq + static_cast<uint64_t>(k);
    int64_t lo = 0;
    piece(rank_, k, &lo);
    char* stage = ClaimStage(seq, src + (starts[rank_] + lo) * elem);
    for (int j = 0; j < size_; ++j) {
      const int64_t n = j == rank_ ? 0 : piece(j, k, &lo);
      if (n > 0) StageCopy(stage + j * slot * elem, src + (starts[j] + lo) * elem, n * elem);
    }
    PublishOwn(control(rank_).copied.value, seq + 1);
  };
  auto reduce = [&](int64_t k) {
    const uint64_t seq = first_seq + static_cast<uint64_t>(k);
    for (int j = 0; j < size_; ++j) {
      if (j != rank_) Await(j, control(j).copied.value, seq + 1);
    }
    int64_t lo = 0;
    const int64_t n = piece(rank_, k, &lo);
    for (int j = 0; j < size_; ++j) slices_[j] = Stage(j, seq) + rank_ * slot * elem;
    const char* mine = src + (starts[rank_] + lo) * elem;
    const int64_t block = std::max<int64_t>(1, kBlockBytes / elem);
    for (int64_t b = 0; b < n; b += block) {
      for (int j = 0; j < size_; ++j) operands_[j] = (j == rank_ ? mine : slices_[j]) + b * elem;
      ReduceOperands(dst + (lo + b) * elem, std::min(block, n - b), dtype, op, postscale);
    }
    control(rank_).reduced.value.store(seq + 1, std::memory_order_release);
    control(rank_).done.value.store(seq + 1, std::memory_order_release);
  };
  if (size_ == 1) {
    operands_[0] = src + starts[0] * elem;
    ReduceOperands(dst, starts[1] - starts[0], dtype, op, postscale);
    return;
  }
  const int64_t chunks = (longest + slot - 1) / slot;
  const int64_t total = (starts[size_] - starts[0]) * elem;  // a rank's input
  WithStores(move_stores_[kReduceScatter], total, chunks > 0, [&] {
    if (chunks > 0) copy_in(0);
    for (int64_t k = 0; k < chunks; ++k) {
      if (k + 1 < chunks) copy_in(k + 1);
      reduce(k);
    }
  });
  seq_ += static_cast<uint64_t>(chunks);
}

// Chunk k of every stream travels in chunk seq first_seq + k; every rank
// runs the same number of chunks (the longest stream's), publishing empty
// ones too, so that seq stays the same everywhere. This rank's own read
// comes from its stream's bytes, hole included, a chunk's worth per chunk
// and the rest at the end.
void ShmAllreduce::Exchange(Move move, const Stream& stream) {
  exchanges_.fetch_add(1, std::memory_order_relaxed);
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
  const uint64_t first_seq = seq_;
  int64_t total = 0;  // the chooser's size: every byte that crosses the stages
  for (int64_t length : lengths_) total += length;
  WithStores(move_stores_[move], total, chunks > 0, [&] {
    if (chunks > 0) Publish(stream, lengths_[rank_], first_seq, 0);
    for (int64_t k = 0; k < chunks; ++k) {
      if (k + 1 < chunks) Publish(stream, lengths_[rank_], first_seq + k + 1, k + 1);
      Collect(stream, first_seq + k, k);
    }
  });
  seq_ += static_cast<uint64_t>(chunks);
  const Read& self = reads_[rank_];
  const int64_t done = std::min(self.bytes, chunks * chunk_bytes_);
  if (self.bytes > done) {
    std::memmove(self.dst + done, stream.data + self.offset + done, self.bytes - done);
  }
}

int64_t ShmAllreduce::DirectMinBytes(Move move) const {
  if (direct_min_bytes_ != kDirectAuto) return direct_min_bytes_;
  return move == kAlltoall || move == kBroadcast ? kAutoDirectMinBytes : -1;
}

void ShmAllreduce::Publish(const Stream& stream, int64_t length, uint64_t seq, int64_t k) {
  const int64_t lo = k * chunk_bytes_;
  const int64_t n = std::max<int64_t>(0, std::min(chunk_bytes_, length - lo));
  // [lo, lo + n) of the stream: before the hole, then after it.
  const int64_t before = std::max<int64_t>(0, std::min(n, stream.hole_at - lo));
  const char* first = stream.data + lo + (before > 0 ? 0 : stream.hole_bytes);
  char* stage = ClaimStage(seq, n > 0 ? first : stream.data);
  if (before > 0) StageCopy(stage, stream.data + lo, before);
  if (n > before) {
    StageCopy(stage + before, stream.data + lo + before + stream.hole_bytes, n - before);
  }
  PublishOwn(control(rank_).copied.value, seq + 1);
}

void ShmAllreduce::Collect(const Stream& stream, uint64_t seq, int64_t k) {
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
    Await(j, control(j).copied.value, seq + 1);
    std::memcpy(read.dst + (a - read.offset), Stage(j, seq) + (a - lo), b - a);
  }
  control(rank_).done.value.store(seq + 1, std::memory_order_release);
}

namespace {

// Copies `bytes` between `local` in this process and `remote` in process
// `pid` with cross-memory attach (process_vm_readv, or process_vm_writev
// when `write`), in as many calls as the kernel needs (it may stop early).
// Returns 0, or the errno of the call that failed (EIO if one moved nothing).
int CopyPeerMemory(bool write, int64_t pid, uintptr_t remote, char* local, int64_t bytes) {
  for (int64_t done = 0; done < bytes;) {
    iovec here{local + done, static_cast<size_t>(bytes - done)};
    iovec there{reinterpret_cast<void*>(remote + done), here.iov_len};
    const pid_t p = static_cast<pid_t>(pid);
    const ssize_t got = write ? process_vm_writev(p, &here, 1, &there, 1, 0)
                              : process_vm_readv(p, &here, 1, &there, 1, 0);
    if (got <= 0) return got < 0 ? errno : EIO;
    done += got;
  }
  return 0;
}

// CopyPeerMemory with local rank `j` during an exchange, where failing is a
// bug (hvd.init() checked that both directions work).
void CopyWithPeer(bool write, int j, int64_t pid, uintptr_t remote, char* local, int64_t bytes) {
  const int err = CopyPeerMemory(write, pid, remote, local, bytes);
  HVDMX_CHECK(err == 0, std::string(write ? "writing into" : "reading") + " local rank " +
                            std::to_string(j) +
                            (write ? "'s output with process_vm_writev" :
                                     "'s buffer with process_vm_readv") +
                            " failed (" + std::strerror(err) +
                            "); HVDMX_SHM_DIRECT_MIN_BYTES=-1 moves bytes through the "
                            "shared-memory stages instead");
}

}  // namespace

int64_t ShmAllreduce::RootWrittenBytes(int64_t read_bytes) const {
  return read_bytes / size_ / kSliceAlignBytes * kSliceAlignBytes;
}

// Note [Reading peers' buffers directly]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Through the stages, every byte that moves is copied twice: into the
// sender's stage, then out of it by each reader. Linux's cross-memory
// attach (process_vm_readv) copies from another process's memory in one
// go, so a reader can take what it needs straight from the sender's own
// buffer: one copy, made by the reader, while the sender is free. MPICH
// moves its large messages on one host this way too. It needs permission
// to ptrace the peer (the same user, and no stricter Yama policy), which
// CreateNodeShmAllreduce checks once, on every rank, before turning it on.
//
// One call takes one chunk seq, s, on every rank, and no stage:
// - each rank writes where its stream is (address, hole) into its control
//   block and publishes copied = s + 1;
// - it copies its own read, then, for each peer (from the next rank on),
//   waits for the peer's copied, reads the descriptor and copies its range
//   with process_vm_readv; then it publishes done = s + 1;
// - it returns only once every peer has published done: until then a peer
//   may still be reading its buffer, which the caller owns and may reuse.
// In place, a broadcast's root reads nothing and would sit idle while every
// peer copies the whole message, so it copies part of it itself: each peer
// publishes where its read lands (read_dst, read_bytes) with copied and
// reads all but the last RootWrittenBytes of it; the root writes that end
// into each peer's output, with a plain copy where the output lies in the
// peer's shared output file (out_offset, as in Note [Writing into peers'
// outputs]), else with process_vm_writev (the same permission as reading),
// then publishes done. A peer's output is whole once the root's done is
// in, which every rank waits for anyway. At np=2 the two halves move at
// once: 16 MiB in 555-590 us against 745-800 for one whole read, 64 MiB in
// 2.8-3.1 ms against 3.2-3.9 (docs/benchmark-notes.md, "Broadcasts read
// directly, the root writing half"). Out of place, the root
// copies the whole message into its own output, as much as each peer
// reads, so it writes nothing for them (root_writes = 0 in its control
// block).
// Staged and direct calls can follow each other in any order: both keep
// copied and done at the count of chunks (a stage is reused only once
// every rank is done with the chunk it last held, as before), and which one
// a call takes depends only on lengths_, the same on every rank.
void ShmAllreduce::ExchangeDirect(Move move, const Stream& stream) {
  direct_exchanges_.fetch_add(1, std::memory_order_relaxed);
  // Peers read the stream faster from huge pages: see Note [Huge pages
  // under what peers read] in huge_pages.h. Its hole is this rank's too.
  if (lengths_[rank_] > 0) huge_pages_.Collapse(stream.data, lengths_[rank_] + stream.hole_bytes);
  const uint64_t seq = seq_++;
  Control& mine = control(rank_);
  mine.stream_data.store(reinterpret_cast<uintptr_t>(stream.data), std::memory_order_relaxed);
  mine.stream_hole_at.store(stream.hole_at, std::memory_order_relaxed);
  mine.stream_hole_bytes.store(stream.hole_bytes, std::memory_order_relaxed);
  // A broadcast: the root (the one rank with a stream) writes the end of
  // every other rank's read. A broadcast's read is the root's whole stream.
  const bool broadcast = move == kBroadcast;
  const int root_rank = static_cast<int>(
      std::max_element(lengths_.begin(), lengths_.end()) - lengths_.begin());
  const bool root = broadcast && root_rank == rank_;
  // Out of place, the root copies the message into its own output: as much
  // as a peer reads, so it has no time to write for them.
  const bool root_writes = root && reads_[rank_].bytes == 0;
  if (root) mine.root_writes.store(root_writes ? 1 : 0, std::memory_order_relaxed);
  if (broadcast && !root) {
    const int64_t bytes = reads_[root_rank].bytes;
    char* dst = reads_[root_rank].dst;
    const int64_t written = RootWrittenBytes(bytes);
    const int64_t offset = OffsetInFile(dst, bytes);
    // Outside the shared file, the root's writes pin these pages as peers'
    // reads pin the stream's.
    if (written > 0 && offset < 0) huge_pages_.Collapse(dst + bytes - written, written);
    mine.read_dst.store(reinterpret_cast<uintptr_t>(dst), std::memory_order_relaxed);
    mine.read_bytes.store(bytes, std::memory_order_relaxed);
    mine.out_offset.store(offset, std::memory_order_relaxed);
  }
  mine.copied.value.store(seq + 1, std::memory_order_release);
  const Read& self = reads_[rank_];
  if (self.bytes > 0) std::memmove(self.dst, stream.data + self.offset, self.bytes);
  bool wrote = false;
  for (int i = 1; i < size_; ++i) {
    const int j = (rank_ + i) % size_;
    const Control& peer = control(j);
    if (root) {
      if (!root_writes) continue;
      Await(j, peer.copied.value, seq + 1);
      const int64_t pid = peer.pid.load(std::memory_order_relaxed);
      const int64_t bytes = peer.read_bytes.load(std::memory_order_relaxed);
      const int64_t written = RootWrittenBytes(bytes);
      if (written == 0) continue;
      const int64_t at = bytes - written;
      const int64_t offset = peer.out_offset.load(std::memory_order_relaxed);
      wrote = true;
      if (offset >= 0) {  // the peer's output is in its shared file, mapped here
        std::memcpy(arenas_[j] + offset + at, stream.data + at, written);
        continue;
      }
      CopyWithPeer(true, j, pid, peer.read_dst.load(std::memory_order_relaxed) + at,
                   const_cast<char*>(stream.data) + at, written);
      continue;
    }
    const Read& read = reads_[j];
    if (read.bytes == 0) continue;
    Await(j, peer.copied.value, seq + 1);
    // The read is one of the peer's blocks, wholly before its hole or
    // wholly after it (alltoall's hole is the peer's block for itself).
    const int64_t hole_at = peer.stream_hole_at.load(std::memory_order_relaxed);
    const int64_t at =
        read.offset < hole_at ? read.offset
                              : read.offset + peer.stream_hole_bytes.load(std::memory_order_relaxed);
    const uintptr_t from = peer.stream_data.load(std::memory_order_relaxed) + at;
    const bool helped = broadcast && peer.root_writes.load(std::memory_order_relaxed) != 0;
    const int64_t bytes = read.bytes - (helped ? RootWrittenBytes(read.bytes) : 0);
    CopyWithPeer(false, j, peer.pid.load(std::memory_order_relaxed), from, read.dst, bytes);
  }
  if (wrote) root_writes_.fetch_add(1, std::memory_order_relaxed);
  mine.done.value.store(seq + 1, std::memory_order_release);
  for (int j = 0; j < size_; ++j) {
    if (j != rank_) Await(j, control(j).done.value, seq + 1);
  }
}

void ShmAllreduce::WriteIntoPeers(std::vector<char*> arenas, int64_t arena_bytes,
                                  int64_t min_output_bytes) {
  HVDMX_CHECK(!cross_ && static_cast<int>(arenas.size()) == size_ && arena_bytes > 0 &&
                  min_output_bytes > 0,
              "writing into peers' outputs: one host, one output file per rank, outputs of "
              "a byte or more");
  arenas_ = std::move(arenas);
  arena_bytes_ = arena_bytes;
  push_min_output_bytes_ = min_output_bytes;
}

int64_t ShmAllreduce::OffsetInFile(const char* data, int64_t bytes) const {
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
// twice. At np=2 that made alltoalls of 1-4 MiB 1.2-2.5x and allgathers of
// 1-2 MiB 1.04-1.17x faster than the stages in one run (mixed in another),
// and level from 16 MiB (docs/benchmark-notes.md, "Writing into peers'
// outputs").
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
bool ShmAllreduce::ExchangePush(Move move) {
  const uint64_t seq = seq_++;
  Control& mine = control(rank_);
  const int64_t offset = OffsetInFile(out_.data, out_.bytes);
  mine.out_offset.store(offset, std::memory_order_relaxed);
  mine.copied.value.store(seq + 1, std::memory_order_release);
  bool all = offset >= 0;
  for (int j = 0; j < size_; ++j) {
    if (j == rank_) continue;
    Await(j, control(j).copied.value, seq + 1);
    all = all && control(j).out_offset.load(std::memory_order_relaxed) >= 0;
  }
  if (all) {
    int64_t total = 0;  // the chooser's size: every byte this rank writes
    for (const Send& send : sends_) total += send.bytes;
    WithStores(push_stores_[move], total, true, [&] {
      for (int i = 0; i < size_; ++i) {
        const int j = (rank_ + i) % size_;
        const Send& send = sends_[j];
        if (send.bytes == 0) continue;
        char* out = j == rank_ ? out_.data
                               : arenas_[j] + control(j).out_offset.load(std::memory_order_relaxed);
        // The output is new, so no send overlaps it: an own block already
        // in place (a fused allgather's) has no bytes to send.
        StageCopy(out + send.at, send.src, send.bytes);
      }
      if (streaming_) StreamingStoresFence();  // before `done` tells the peers
    });
  }
  mine.done.value.store(seq + 1, std::memory_order_release);
  for (int j = 0; j < size_; ++j) {
    if (j != rank_) Await(j, control(j).done.value, seq + 1);
  }
  if (all) push_exchanges_.fetch_add(1, std::memory_order_relaxed);
  return all;
}

bool ShmAllreduce::CrossMemoryAttachWorks(int64_t pid, const void* address, const void* expected,
                                          void* writable, int64_t bytes, std::string* why) {
  std::string got(static_cast<size_t>(bytes), '\0');
  int err = CopyPeerMemory(false, pid, reinterpret_cast<uintptr_t>(address), got.data(), bytes);
  if (err != 0) {
    *why = std::string("process_vm_readv: ") + std::strerror(err);
    return false;
  }
  if (std::memcmp(got.data(), expected, got.size()) != 0) {
    *why = "process_vm_readv read other bytes than the peer holds";
    return false;
  }
  err = CopyPeerMemory(true, pid, reinterpret_cast<uintptr_t>(writable), got.data(), bytes);
  if (err != 0) {
    *why = std::string("process_vm_writev: ") + std::strerror(err);
    return false;
  }
  return true;
}

}  // namespace hvdmx
