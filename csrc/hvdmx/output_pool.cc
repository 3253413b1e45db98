#include "output_pool.h"

#include <sys/mman.h>

#include <algorithm>

#include "common.h"

namespace hvdmx {

OutputPool& OutputPool::Get() {
  // Never destroyed: see Note [Output pool].
  static OutputPool* pool = [] {
    auto* p = new OutputPool();
    p->stats_.limit = int64_t{256} << 20;
    return p;
  }();
  return *pool;
}

int64_t OutputPool::ClassBytes(int64_t bytes) {
  constexpr int64_t kPage = 4096;
  bytes = std::max<int64_t>(bytes, kPage);
  // Eight classes per power of two: the step is an eighth of the largest
  // power of two not above `bytes`, and never less than a page.
  int64_t top = kPage;
  while (top * 2 <= bytes) top *= 2;
  const int64_t step = std::max(top / 8, kPage);
  return (bytes + step - 1) / step * step;
}

void* OutputPool::Take(int64_t bytes) {
  const int64_t size = ClassBytes(bytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stats_.limit == 0) return nullptr;
    // The most recently given back block of the class: its pages are the
    // likeliest to be in cache.
    auto best = kept_.end();
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->bytes == size && (best == kept_.end() || it->stamp > best->stamp)) best = it;
    }
    if (best != kept_.end()) {
      void* data = best->data;
      kept_.erase(best);
      stats_.kept_bytes -= size;
      stats_.out_bytes += size;
      stats_.reused += 1;
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
  kept_.push_back({block, size, ++clock_});
  stats_.kept_bytes += size;
  TrimLocked();
}

void OutputPool::SetLimit(int64_t limit) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.limit = std::max<int64_t>(limit, 0);
  TrimLocked();
}

void OutputPool::TrimLocked() {
  while (stats_.kept_bytes > stats_.limit) {
    auto oldest = std::min_element(kept_.begin(), kept_.end(), [](const Block& a, const Block& b) {
      return a.stamp < b.stamp;
    });
    munmap(oldest->data, static_cast<size_t>(oldest->bytes));
    stats_.kept_bytes -= oldest->bytes;
    kept_.erase(oldest);
  }
}

OutputPool::Stats OutputPool::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  Stats stats = stats_;
  stats.kept_blocks = static_cast<int64_t>(kept_.size());
  return stats;
}

}  // namespace hvdmx
