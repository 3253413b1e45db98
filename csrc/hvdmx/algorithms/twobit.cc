#include "algorithms/twobit.h"

#include <algorithm>
#include <cstring>

namespace hvdmx {

void TwoBitPack(const float* gradient, float* residual, int64_t n, float threshold,
                uint32_t* packed) {
  std::memcpy(&packed[0], &threshold, sizeof(threshold));
  uint32_t* codes = packed + 1;
  std::fill(codes, codes + (n + 15) / 16, 0u);
  for (int64_t i = 0; i < n; ++i) {
    residual[i] += gradient[i];
    uint32_t code = 0;
    if (residual[i] >= threshold) {
      code = 1;
      residual[i] -= threshold;
    } else if (residual[i] <= -threshold) {
      code = 2;
      residual[i] += threshold;
    }
    codes[i / 16] |= code << (2 * (i % 16));
  }
}

void TwoBitUnpackSum(const uint32_t* packed, int ranks, int64_t n, float* out) {
  std::fill(out, out + n, 0.0f);
  for (int r = 0; r < ranks; ++r) {
    const uint32_t* mine = packed + r * TwoBitPackedWords(n);
    float threshold;
    std::memcpy(&threshold, &mine[0], sizeof(threshold));
    const float level[3] = {0.0f, threshold, -threshold};
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t code = (mine[1 + i / 16] >> (2 * (i % 16))) & 3u;
      out[i] += level[code < 3 ? code : 0];
    }
  }
}

}  // namespace hvdmx
