// See plain_regions.h.
#include "shm/plain_regions.h"

#include <cstdint>

#include "shm/shm_region.h"

namespace hvdmx {

PlainShmRegions::PlainShmRegions(int ranks, int64_t chunk_bytes) {
  // The regions start where the shared mapping of a real job would: on a
  // page. (ShmRegion checks that each is aligned for its control block.)
  constexpr uintptr_t kMappingAlign = 4096;
  const int64_t region = ShmRegion::RegionBytes(chunk_bytes);
  memory = std::make_shared<std::vector<char>>(region * ranks + kMappingAlign, 0);
  const uintptr_t at = reinterpret_cast<uintptr_t>(memory->data());
  char* base = memory->data() + (kMappingAlign - at % kMappingAlign) % kMappingAlign;
  for (int r = 0; r < ranks; ++r) regions.push_back(base + r * region);
}

}  // namespace hvdmx
