#include "platform/output_pool.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>

#include "base/common.h"

namespace hvdmx {

OutputPool& OutputPool::Get() {
  // Never destroyed: see Note [Output pool].
  static OutputPool* pool = [] {
    auto* p = new OutputPool();
    p->stats_.limit = kDefaultLimitBytes;  // until hvd.init() sets it
    return p;
  }();
  return *pool;
}

int64_t OutputPool::ClassBytes(int64_t bytes) {
  bytes = std::max<int64_t>(bytes, kPageBytes);
  // Eight classes per power of two: the step is an eighth of the largest
  // power of two not above `bytes`, and never less than a page.
  int64_t top = kPageBytes;
  while (top * 2 <= bytes) top *= 2;
  const int64_t step = std::max(top / 8, kPageBytes);
  return (bytes + step - 1) / step * step;
}

void* OutputPool::Take(int64_t bytes) {
  const int64_t size = ClassBytes(bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stats_.limit == 0) return nullptr;
    // The most recently given back block of the class (kept_ is in the
    // order blocks came back): its pages are the likeliest to be in cache.
    const bool forked = Forked();
    auto best = std::find_if(kept_.rbegin(), kept_.rend(), [&](const Block& b) {
      int64_t offset = 0;
      return b.bytes == size && !(forked && InArena(b.data, b.bytes, &offset));
    });
    if (best != kept_.rend()) {
      void* data = best->data;
      kept_.erase(std::next(best).base());
      stats_.kept_bytes -= size;
      stats_.out_bytes += size;
      stats_.reused += 1;
      return data;
    }
    if (void* data = CutLocked(size)) {
      AdviseHugePages(data, size);
      stats_.out_bytes += size;
      stats_.mapped += 1;
      return data;
    }
  }
  void* data = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) return nullptr;
  AdviseHugePages(data, size);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.out_bytes += size;
  stats_.mapped += 1;
  return data;
}

void OutputPool::Give(void* block, int64_t bytes) {
  const int64_t size = ClassBytes(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.out_bytes -= size;
  int64_t offset = 0;
  // A forked child dropping its copy of the parent's array: the block's
  // pages are the parent's, which may still use them. Not ours to reuse.
  if (Forked() && InArena(block, size, &offset)) return;
  kept_.push_back({block, size});
  stats_.kept_bytes += size;
  TrimLocked();
}

void OutputPool::SetLimit(int64_t limit) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.limit = std::max<int64_t>(limit, 0);
  TrimLocked();
}

void OutputPool::TrimLocked() {
  while (stats_.kept_bytes > stats_.limit) {  // the longest-kept first
    const Block block = kept_.front();
    int64_t offset = 0;
    if (InArena(block.data, block.bytes, &offset)) {
      // The pages go back to the kernel; the place waits for its class. A
      // forked child leaves the parent's pages alone (see Give).
      if (!Forked()) {
        fallocate(arena_fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, block.bytes);
        holes_.push_back(block);
      }
    } else {
      munmap(block.data, static_cast<size_t>(block.bytes));
    }
    stats_.kept_bytes -= block.bytes;
    kept_.erase(kept_.begin());
  }
}

void* OutputPool::CutLocked(int64_t size) {
  char* base = arena_.load(std::memory_order_relaxed);
  if (base == nullptr || Forked()) return nullptr;  // a child cuts none: see Give
  auto hole = std::find_if(holes_.begin(), holes_.end(),
                           [size](const Block& b) { return b.bytes == size; });
  if (hole != holes_.end()) {
    void* data = hole->data;
    holes_.erase(hole);
    return data;
  }
  // Blocks of 2 MiB and up start on a 2 MiB boundary, where a huge page can.
  const int64_t align = size >= kHugeBytes ? kHugeBytes : kPageBytes;
  const int64_t at = (stats_.arena_used + align - 1) / align * align;
  if (at + size > kArenaBytes) return nullptr;
  stats_.arena_used = at + size;
  return base + at;
}

int OutputPool::ShareFromNow(std::string* why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (arena_fd_ >= 0) return arena_fd_;
  const int fd = memfd_create("hvdmx-outputs", MFD_CLOEXEC);
  if (fd < 0) {
    *why = std::string("memfd_create: ") + std::strerror(errno);
    return -1;
  }
  void* base = MAP_FAILED;
  if (ftruncate(fd, kArenaBytes) == 0) {
    base = mmap(nullptr, static_cast<size_t>(kArenaBytes), PROT_READ | PROT_WRITE,
                MAP_SHARED | MAP_NORESERVE, fd, 0);
  }
  if (base == MAP_FAILED) {
    *why = std::string("mapping a shared file of ") + std::to_string(kArenaBytes) +
           " bytes: " + std::strerror(errno);
    close(fd);
    return -1;
  }
  arena_pid_ = getpid();
  *static_cast<int64_t*>(base) = arena_pid_;  // what peers check they mapped
  stats_.arena_used = kPageBytes;
  arena_fd_ = fd;
  arena_.store(static_cast<char*>(base), std::memory_order_release);
  return fd;
}

bool OutputPool::Forked() const { return arena_pid_ >= 0 && getpid() != arena_pid_; }

bool OutputPool::InArena(const void* data, int64_t bytes, int64_t* offset) const {
  const char* base = arena();
  const char* p = static_cast<const char*>(data);
  if (base == nullptr || p < base || bytes > kArenaBytes || p - base > kArenaBytes - bytes) {
    return false;
  }
  *offset = p - base;
  return true;
}

OutputPool::Stats OutputPool::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  Stats stats = stats_;
  stats.kept_blocks = static_cast<int64_t>(kept_.size());
  return stats;
}

}  // namespace hvdmx
