#include "output_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <iterator>

#include "common.h"
#include "env_config.h"

namespace hvdmx {

OutputPool& OutputPool::Get() {
  // Never destroyed: see Note [Output pool].
  static OutputPool* pool = [] {
    auto* p = new OutputPool();
    p->stats_.limit = Config().output_pool_bytes;  // until hvd.init() sets it
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
    // The most recently given back block of the class (kept_ is in the
    // order blocks came back): its pages are the likeliest to be in cache.
    auto best = std::find_if(kept_.rbegin(), kept_.rend(),
                             [size](const Block& b) { return b.bytes == size; });
    if (best != kept_.rend()) {
      void* data = best->data;
      kept_.erase(std::next(best).base());
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
    munmap(kept_.front().data, static_cast<size_t>(kept_.front().bytes));
    stats_.kept_bytes -= kept_.front().bytes;
    kept_.erase(kept_.begin());
  }
}

OutputPool::Stats OutputPool::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  Stats stats = stats_;
  stats.kept_blocks = static_cast<int64_t>(kept_.size());
  return stats;
}

}  // namespace hvdmx
