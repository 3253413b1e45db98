// ShmExchange's direct reads of the peers' buffers: see Note [Reading
// peers' buffers directly] below.
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "shm/shm_exchange.h"
#include "shm/shm_internal.h"

namespace hvdmx {

using shm_internal::Control;
using shm_internal::kSliceAlignBytes;

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
  HVDMX_CHECK(err == 0,
              std::string(write ? "writing into" : "reading") + " local rank " + std::to_string(j) +
                  (write ? "'s output with process_vm_writev" : "'s buffer with process_vm_readv") +
                  " failed (" + std::strerror(err) +
                  "); HVDMX_SHM_DIRECT_MIN_BYTES=-1 moves bytes through the "
                  "shared-memory stages instead");
}

}  // namespace

int64_t ShmExchange::RootWrittenBytes(int64_t read_bytes) const {
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
// CreateShmHost checks once, on every rank, before turning it on.
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
// in, which every rank waits for anyway. The two halves move at once,
// faster than one whole read (docs/benchmark-notes.md, "Broadcasts read
// directly, the root writing half"). Out of place, the root
// copies the whole message into its own output, as much as each peer
// reads, so it writes nothing for them (root_writes = 0 in its control
// block).
// Staged and direct calls can follow each other in any order: both keep
// copied and done at the count of chunks (a stage is reused only once
// every rank is done with the chunk it last held, as before), and which one
// a call takes depends only on lengths_, the same on every rank.
void ShmExchange::ExchangeDirect(Move move, const Stream& stream) {
  ShmRegion::Count(region_->counters().direct_exchanges);
  // Peers read the stream faster from huge pages: see Note [Huge pages
  // under what peers read] in huge_pages.h. Its hole is this rank's too.
  if (lengths_[rank_] > 0) huge_pages_.Collapse(stream.data, lengths_[rank_] + stream.hole_bytes);
  const uint64_t seq = region_->seq();
  region_->Advance(1);
  Control& mine = region_->control(rank_);
  mine.stream_data.store(reinterpret_cast<uintptr_t>(stream.data), std::memory_order_relaxed);
  mine.stream_hole_at.store(stream.hole_at, std::memory_order_relaxed);
  mine.stream_hole_bytes.store(stream.hole_bytes, std::memory_order_relaxed);
  // A broadcast: the root (the one rank with a stream) writes the end of
  // every other rank's read. A broadcast's read is the root's whole stream.
  const bool broadcast = move == kBroadcast;
  const int root_rank =
      static_cast<int>(std::max_element(lengths_.begin(), lengths_.end()) - lengths_.begin());
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
    const Control& peer = region_->control(j);
    if (root) {
      if (!root_writes) continue;
      region_->Await(j, peer.copied.value, seq + 1);
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
    region_->Await(j, peer.copied.value, seq + 1);
    // The read is one of the peer's blocks, wholly before its hole or
    // wholly after it (alltoall's hole is the peer's block for itself).
    const int64_t hole_at = peer.stream_hole_at.load(std::memory_order_relaxed);
    const int64_t at = read.offset < hole_at
                           ? read.offset
                           : read.offset + peer.stream_hole_bytes.load(std::memory_order_relaxed);
    const uintptr_t from = peer.stream_data.load(std::memory_order_relaxed) + at;
    const bool helped = broadcast && peer.root_writes.load(std::memory_order_relaxed) != 0;
    const int64_t bytes = read.bytes - (helped ? RootWrittenBytes(read.bytes) : 0);
    CopyWithPeer(false, j, peer.pid.load(std::memory_order_relaxed), from, read.dst, bytes);
  }
  if (wrote) ShmRegion::Count(region_->counters().root_writes);
  mine.done.value.store(seq + 1, std::memory_order_release);
  for (int j = 0; j < size_; ++j) {
    if (j != rank_) region_->Await(j, region_->control(j).done.value, seq + 1);
  }
}

bool ShmExchange::CrossMemoryAttachWorks(int64_t pid, const void* address, const void* expected,
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
