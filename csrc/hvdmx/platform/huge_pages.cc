#include "platform/huge_pages.h"

#include <sys/mman.h>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1
#endif

namespace hvdmx {

void HugePageCollapser::Collapse(const void* data, int64_t bytes) {
  if (!enabled_ || bytes < kHugePageBytes) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = (begin + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  const uintptr_t end = (begin + static_cast<uintptr_t>(bytes)) / kHugePageBytes * kHugePageBytes;
  for (uintptr_t page = first; page < end; page += kHugePageBytes) {
    if (!seen_.insert(page).second) continue;
    if (seen_.size() > kMaxPages) seen_.clear();
    // A kernel without MADV_COLLAPSE refuses each page once (EINVAL), as it
    // does a page it cannot collapse now (ENOMEM, EAGAIN): one system call
    // per page, never repeated.
    if (madvise(reinterpret_cast<void*>(page), kHugePageBytes, MADV_COLLAPSE) == 0) {
      collapsed_.fetch_add(1, std::memory_order_relaxed);
    } else {
      refused_.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

}  // namespace hvdmx
