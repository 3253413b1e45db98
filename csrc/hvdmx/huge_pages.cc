#include "huge_pages.h"

#include <sys/mman.h>

#include <cerrno>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1
#endif

namespace hvdmx {

void HugePageCollapser::Collapse(const void* data, int64_t bytes) {
  if (unsupported_ || bytes < kHugePageBytes) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = (begin + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  const uintptr_t end = (begin + static_cast<uintptr_t>(bytes)) / kHugePageBytes * kHugePageBytes;
  for (uintptr_t page = first; page < end; page += kHugePageBytes) {
    if (!seen_.insert(page).second) continue;
    if (seen_.size() > kMaxPages) seen_.clear();
    if (madvise(reinterpret_cast<void*>(page), kHugePageBytes, MADV_COLLAPSE) == 0) {
      ++collapsed_;
      continue;
    }
    ++refused_;
    // EINVAL: no such advice here (or huge pages off); nothing will work.
    if (errno == EINVAL) unsupported_ = true;
    if (unsupported_) return;
  }
}

}  // namespace hvdmx
