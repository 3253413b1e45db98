// The floating formats the reduction kernels compute on (reduce_kernels.cc):
// float16 and bfloat16 conversions, exact and round-to-nearest-even in plain
// integer code, and for each format its stored type, its compute type and
// the bits of its infinity and canonical NaN. See Note [Bitwise identical
// reductions] in reduce_kernels.cc for why every detail here is fixed.
#ifndef HVDMX_FLOAT_FORMATS_H_
#define HVDMX_FLOAT_FORMATS_H_

#include <cstdint>
#include <cstring>

namespace hvdmx {
namespace fp {

template <typename To, typename From>
inline To BitCast(From from) {
  static_assert(sizeof(To) == sizeof(From), "BitCast needs types of one size");
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}

// Exact: every float16, subnormals included, is a float32 normal or zero.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return BitCast<float>(sign | 0x7F800000u | (mantissa << 13));
  if (exponent != 0) return BitCast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24, which float32 holds exactly.
  return BitCast<float>(sign | BitCast<uint32_t>(static_cast<float>(mantissa) * 0x1p-24f));
}

// Round to nearest-even, bit for bit what VCVTPS2PH does with rounding mode 0,
// except that every NaN becomes the canonical 0x7E00.
inline uint16_t FloatToHalf(float f) {
  const uint32_t bits = BitCast<uint32_t>(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return 0x7E00u;
  uint32_t h = 0;
  if (magnitude >= 0x47800000u) {  // >= 2^16: infinite
    h = 0x7C00u;
  } else if (magnitude >= 0x38800000u) {  // >= 2^-14: normal, or rounds up to infinity
    // Rebias the exponent and drop 13 mantissa bits, rounding to nearest-even;
    // a carry into the exponent gives the right answer, up to infinity.
    h = (magnitude - 0x38000000u + 0xFFFu + ((magnitude >> 13) & 1u)) >> 13;
  } else if (magnitude > 0x33000000u) {  // > 2^-25: subnormal (or the smallest normal)
    // The value in units of 2^-24 is mantissa >> shift, rounded.
    const uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126 - (magnitude >> 23);  // 14 to 24
    const uint32_t halfway = 1u << (shift - 1);
    const uint32_t rest = mantissa & ((halfway << 1) - 1);
    h = mantissa >> shift;
    h += (rest > halfway || (rest == halfway && (h & 1u))) ? 1u : 0u;
  }
  return static_cast<uint16_t>(sign | h);
}

// A floating type as stored and as computed, and the raw bits that Min and
// Max order. Load is exact; Store rounds to the stored type and makes every
// NaN canonical (positive, only the top mantissa bit set).
struct Float32 {
  using Storage = float;
  using Compute = float;
  using Bits = uint32_t;
  static constexpr Bits kInfBits = 0x7F800000u;
  static constexpr Bits kNaNBits = 0x7FC00000u;
  static float Load(float x) { return x; }
  static float Store(float x) { return x != x ? BitCast<float>(kNaNBits) : x; }
};

struct Float64 {
  using Storage = double;
  using Compute = double;
  using Bits = uint64_t;
  static constexpr Bits kInfBits = 0x7FF0000000000000u;
  static constexpr Bits kNaNBits = 0x7FF8000000000000u;
  static double Load(double x) { return x; }
  static double Store(double x) { return x != x ? BitCast<double>(kNaNBits) : x; }
};

struct Float16 {
  using Storage = uint16_t;
  using Compute = float;
  using Bits = uint16_t;
  static constexpr Bits kInfBits = 0x7C00u;
  static constexpr Bits kNaNBits = 0x7E00u;
  static float Load(uint16_t x) { return HalfToFloat(x); }
  static uint16_t Store(float x) { return FloatToHalf(x); }
};

// bfloat16 is the top half of a float32.
struct BFloat16 {
  using Storage = uint16_t;
  using Compute = float;
  using Bits = uint16_t;
  static constexpr Bits kInfBits = 0x7F80u;
  static constexpr Bits kNaNBits = 0x7FC0u;
  static float Load(uint16_t x) { return BitCast<float>(static_cast<uint32_t>(x) << 16); }
  static uint16_t Store(float x) {
    const uint32_t bits = BitCast<uint32_t>(x);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return kNaNBits;
    // Round to nearest-even; a carry into the exponent is the right answer,
    // up to infinity.
    return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
};

}  // namespace fp
}  // namespace hvdmx

#endif  // HVDMX_FLOAT_FORMATS_H_
