#include "runtime/fusion_buffer.h"

#include <cstdlib>
#include <cstring>

#include "base/common.h"

namespace hvdmx {

void FusionBuffer::Free::operator()(char* p) const { std::free(p); }

char* FusionBuffer::Get(int64_t bytes) {
  if (bytes <= capacity_) return data_.get();
  const int64_t rounded = (bytes + 4095) / 4096 * 4096;
  char* p = static_cast<char*>(std::aligned_alloc(64, rounded));
  HVDMX_CHECK(p != nullptr, "out of memory for a fusion buffer of " + std::to_string(rounded) +
                                " bytes; lower HVDMX_FUSION_THRESHOLD");
  std::memset(p, 0, rounded);  // touch now, not on the first collective
  data_.reset(p);
  capacity_ = rounded;
  return p;
}

}  // namespace hvdmx
