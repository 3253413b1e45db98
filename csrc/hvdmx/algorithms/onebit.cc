#include "algorithms/onebit.h"

#include <algorithm>
#include <cstring>

namespace hvdmx {
namespace {

int64_t Chunks(int64_t n) { return (n + kOneBitChunk - 1) / kOneBitChunk; }

float LoadFloat(const uint32_t* word) {
  float value;
  std::memcpy(&value, word, sizeof(value));
  return value;
}

void StoreFloat(uint32_t* word, float value) { std::memcpy(word, &value, sizeof(value)); }

bool SignBit(const uint32_t* signs, int64_t i) { return (signs[i / 32] >> (i % 32)) & 1u; }

}  // namespace

void OneBitPack(const float* gradient, float* residual, int64_t n, uint32_t* packed) {
  uint32_t* signs = packed + 2 * Chunks(n);
  std::fill(signs, signs + (n + 31) / 32, 0u);
  for (int64_t c = 0; c < Chunks(n); ++c) {
    const int64_t begin = c * kOneBitChunk;
    const int64_t end = std::min(n, begin + kOneBitChunk);
    double sum[2] = {0.0, 0.0};  // negative, positive
    int64_t count[2] = {0, 0};
    for (int64_t i = begin; i < end; ++i) {
      residual[i] += gradient[i];
      const int positive = residual[i] >= 0.0f;
      sum[positive] += residual[i];
      ++count[positive];
      signs[i / 32] |= static_cast<uint32_t>(positive) << (i % 32);
    }
    float level[2];
    for (int s = 0; s < 2; ++s) {
      level[s] = count[s] > 0 ? static_cast<float>(sum[s] / static_cast<double>(count[s])) : 0.0f;
    }
    StoreFloat(&packed[2 * c], level[1]);
    StoreFloat(&packed[2 * c + 1], level[0]);
    for (int64_t i = begin; i < end; ++i) residual[i] -= level[SignBit(signs, i)];
  }
}

void OneBitUnpackSum(const uint32_t* packed, int ranks, int64_t n, float* out) {
  std::fill(out, out + n, 0.0f);
  for (int r = 0; r < ranks; ++r) {
    const uint32_t* mine = packed + r * OneBitPackedWords(n);
    const uint32_t* signs = mine + 2 * Chunks(n);
    for (int64_t c = 0; c < Chunks(n); ++c) {
      const float level[2] = {LoadFloat(&mine[2 * c + 1]), LoadFloat(&mine[2 * c])};
      const int64_t end = std::min(n, (c + 1) * kOneBitChunk);
      for (int64_t i = c * kOneBitChunk; i < end; ++i) out[i] += level[SignBit(signs, i)];
    }
  }
}

}  // namespace hvdmx
