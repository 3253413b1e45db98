// Plain memory laid out as one host's shared-memory segment, for ranks that
// are threads of one process: the tests' hosts and the scale harness's
// (bench/scale_harness.h) are made of it.
#ifndef HVDMX_PLAIN_REGIONS_H_
#define HVDMX_PLAIN_REGIONS_H_

#include <cstdint>
#include <memory>
#include <vector>

namespace hvdmx {

// `ranks` zeroed regions of ShmRegion::RegionBytes(chunk_bytes), the first
// on a page as a real mapping's is.
struct PlainShmRegions {
  PlainShmRegions(int ranks, int64_t chunk_bytes);
  std::shared_ptr<std::vector<char>> memory;  // owns the regions
  std::vector<char*> regions;
};

}  // namespace hvdmx

#endif  // HVDMX_PLAIN_REGIONS_H_
