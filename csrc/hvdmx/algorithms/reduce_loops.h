// The reduction kernels' element operations and the loops over them, for
// the baseline target and for AVX2 (with F16C for float16), and CpuHasAvx2:
// what reduce_kernels.cc, the only file that includes this one, dispatches
// to. Every path gives the same bits: see Note [Bitwise identical
// reductions] and Note [Half precision summed in float32] in
// reduce_kernels.cc.
#ifndef HVDMX_REDUCE_LOOPS_H_
#define HVDMX_REDUCE_LOOPS_H_

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "base/common.h"
#include "base/float_formats.h"

#if defined(__FAST_MATH__)
#error "no -ffast-math for the reduction kernels: see Note [Bitwise identical reductions]"
#endif

#if defined(__x86_64__)
#include <immintrin.h>
// No "fma" here: see Note [Bitwise identical reductions].
#define HVDMX_AVX2 __attribute__((target("avx2,f16c")))
#else
#define HVDMX_AVX2
#endif

#define HVDMX_ALWAYS_INLINE inline __attribute__((always_inline))

namespace hvdmx {
namespace {

using fp::BFloat16;
using fp::BitCast;
using fp::Float16;
using fp::Float32;
using fp::Float64;

// The element operations: a type T and a static Apply the loops inline.
template <typename F>
struct FloatSum {
  using T = typename F::Storage;
  static T Apply(T a, T b) { return F::Store(F::Load(a) + F::Load(b)); }
};

template <typename F>
struct FloatProduct {
  using T = typename F::Storage;
  static T Apply(T a, T b) { return F::Store(F::Load(a) * F::Load(b)); }
};

// Min and Max work on the raw bits: Key maps sign-and-magnitude to a two's
// complement integer with the same order as the values, -0 just below +0.
// The result is one of the operands, or the canonical NaN if either is NaN.
// Widening float16 or bfloat16 to float32 first would not change it.
template <typename F, bool kMax>
struct FloatMinMax {
  using T = typename F::Bits;
  using Signed = std::make_signed_t<T>;
  static constexpr T kMagnitude = std::numeric_limits<T>::max() >> 1;
  static bool IsNaN(T x) { return (x & kMagnitude) > F::kInfBits; }
  static Signed Key(T x) { return static_cast<Signed>(x > kMagnitude ? x ^ kMagnitude : x); }
  static T Apply(T a, T b) {
    const bool take_b = kMax ? Key(a) < Key(b) : Key(b) < Key(a);
    return (IsNaN(a) | IsNaN(b)) ? F::kNaNBits : (take_b ? b : a);
  }
};

// Integer Sum and Product wrap: they run in an unsigned type at least as wide
// as int, where overflow is defined.
template <typename T>
using WrapType = decltype(std::make_unsigned_t<T>() + 0u);

template <typename Int>
struct IntSum {
  using T = Int;
  static T Apply(T a, T b) {
    return static_cast<T>(static_cast<WrapType<T>>(a) + static_cast<WrapType<T>>(b));
  }
};

template <typename Int>
struct IntProduct {
  using T = Int;
  static T Apply(T a, T b) {
    return static_cast<T>(static_cast<WrapType<T>>(a) * static_cast<WrapType<T>>(b));
  }
};

template <typename Int, bool kMax>
struct IntMinMax {
  using T = Int;
  static T Apply(T a, T b) { return kMax ? std::max(a, b) : std::min(a, b); }
};

template <typename F>
struct FloatScale {
  using T = typename F::Storage;
  static T Apply(T x, double factor) {
    return F::Store(F::Load(x) * static_cast<typename F::Compute>(factor));
  }
};

// static_cast<T>(v) where that is defined (truncation toward zero); beyond
// T's range the nearest bound, and 0 for NaN.
template <typename Int>
struct IntScale {
  using T = Int;
  static T Apply(T x, double factor) {
    constexpr T kMin = std::numeric_limits<T>::min();
    constexpr T kMax = std::numeric_limits<T>::max();
    constexpr double kAboveMax = static_cast<double>(kMax / 2 + 1) * 2.0;  // exact: 2^k
    const double v = static_cast<double>(x) * factor;
    if (v != v) return 0;
    if (v <= static_cast<double>(kMin)) return kMin;
    if (v >= kAboveMax) return kMax;
    return static_cast<T>(v);
  }
};

// The loops, type-erased. The pointer parameters are restrict (and so is
// every pointer derived from them) so the compiler vectorizes without
// run-time overlap checks; Reduce3 routes aliased calls to InPlace. The
// *Avx2 twins compile the same source for AVX2.
template <typename Op>
HVDMX_ALWAYS_INLINE void InPlace(void* __restrict dst_bytes, const void* __restrict src_bytes,
                                 int64_t n) {
  auto* dst = static_cast<typename Op::T*>(dst_bytes);
  const auto* src = static_cast<const typename Op::T*>(src_bytes);
  for (int64_t i = 0; i < n; ++i) dst[i] = Op::Apply(dst[i], src[i]);
}

template <typename Op>
HVDMX_ALWAYS_INLINE void Binary(void* __restrict out_bytes, const void* __restrict a_bytes,
                                const void* __restrict b_bytes, int64_t n) {
  auto* out = static_cast<typename Op::T*>(out_bytes);
  const auto* a = static_cast<const typename Op::T*>(a_bytes);
  const auto* b = static_cast<const typename Op::T*>(b_bytes);
  for (int64_t i = 0; i < n; ++i) out[i] = Op::Apply(a[i], b[i]);
}

template <typename Op>
HVDMX_ALWAYS_INLINE void Scale(void* __restrict buf, int64_t n, double factor) {
  auto* x = static_cast<typename Op::T*>(buf);
  for (int64_t i = 0; i < n; ++i) x[i] = Op::Apply(x[i], factor);
}

// out = (a OP b) * factor, element by element: Op's result stored (rounded,
// NaN made canonical) before Scaling takes it, so the bits are those of
// Binary followed by Scale, in one pass over the data.
template <typename Op, typename Scaling>
HVDMX_ALWAYS_INLINE void BinaryScaled(void* __restrict out_bytes, const void* __restrict a_bytes,
                                      const void* __restrict b_bytes, int64_t n, double factor) {
  auto* out = static_cast<typename Op::T*>(out_bytes);
  const auto* a = static_cast<const typename Op::T*>(a_bytes);
  const auto* b = static_cast<const typename Op::T*>(b_bytes);
  for (int64_t i = 0; i < n; ++i) out[i] = Scaling::Apply(Op::Apply(a[i], b[i]), factor);
}

template <typename Op, typename Scaling>
HVDMX_AVX2 void BinaryScaledAvx2(void* out, const void* a, const void* b, int64_t n,
                                 double factor) {
  BinaryScaled<Op, Scaling>(out, a, b, n, factor);
}

template <typename Op>
HVDMX_AVX2 void InPlaceAvx2(void* dst, const void* src, int64_t n) {
  InPlace<Op>(dst, src, n);
}

template <typename Op>
HVDMX_AVX2 void BinaryAvx2(void* out, const void* a, const void* b, int64_t n) {
  Binary<Op>(out, a, b, n);
}

template <typename Op>
HVDMX_AVX2 void ScaleAvx2(void* buf, int64_t n, double factor) {
  Scale<Op>(buf, n, factor);
}

// The widened loops (Note [Half precision summed in float32]): F is Float16
// or BFloat16, Op a float32 element operation; kScaled scales each operand
// by f in the dtype first, as ScaleBuffer does (FloatScale<F>), and widens
// the rounded product.
template <typename F, bool kScaled>
HVDMX_ALWAYS_INLINE float WidenOperand(uint16_t x, float f) {
  return F::Load(kScaled ? FloatScale<F>::Apply(x, f) : x);
}

template <typename Op>
HVDMX_ALWAYS_INLINE float ApplyFloat(float a, float b) {
  if constexpr (std::is_same_v<typename Op::T, float>) {
    return Op::Apply(a, b);
  } else {  // Min and Max order the bits
    return BitCast<float>(Op::Apply(BitCast<uint32_t>(a), BitCast<uint32_t>(b)));
  }
}

template <typename F, bool kScaled>
HVDMX_ALWAYS_INLINE void Widen(float* __restrict out, const void* __restrict in_bytes, int64_t n,
                               float f) {
  const auto* in = static_cast<const uint16_t*>(in_bytes);
  for (int64_t i = 0; i < n; ++i) out[i] = WidenOperand<F, kScaled>(in[i], f);
}

template <typename F, typename Op, bool kScaled>
HVDMX_ALWAYS_INLINE void ReduceWide(float* __restrict acc, const void* __restrict in_bytes,
                                    int64_t n, float f) {
  const auto* in = static_cast<const uint16_t*>(in_bytes);
  for (int64_t i = 0; i < n; ++i)
    acc[i] = ApplyFloat<Op>(acc[i], WidenOperand<F, kScaled>(in[i], f));
}

template <typename F, bool kScaled>
HVDMX_ALWAYS_INLINE void Narrow(void* __restrict out_bytes, const float* __restrict acc, int64_t n,
                                float f) {
  auto* out = static_cast<uint16_t*>(out_bytes);
  for (int64_t i = 0; i < n; ++i) out[i] = F::Store(kScaled ? acc[i] * f : acc[i]);
}

template <typename F, bool kScaled>
HVDMX_AVX2 void WidenAvx2(float* out, const void* in, int64_t n, float f) {
  Widen<F, kScaled>(out, in, n, f);
}

template <typename F, typename Op, bool kScaled>
HVDMX_AVX2 void ReduceWideAvx2(float* acc, const void* in, int64_t n, float f) {
  ReduceWide<F, Op, kScaled>(acc, in, n, f);
}

template <typename F, bool kScaled>
HVDMX_AVX2 void NarrowAvx2(void* out, const float* acc, int64_t n, float f) {
  Narrow<F, kScaled>(out, acc, n, f);
}

// One (type, op) pair: dst OP= src, and out = a OP b with no aliasing.
struct Kernel {
  void (*in_place)(void* dst, const void* src, int64_t n);
  void (*binary)(void* out, const void* a, const void* b, int64_t n);
};

// Specialized below for float16 Sum and Product on x86.
template <typename Op>
Kernel Avx2Kernel() {
  return {&InPlaceAvx2<Op>, &BinaryAvx2<Op>};
}

#if defined(__x86_64__)

inline bool CpuHasAvx2() {
  static const bool kHas = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  return kHas;
}

// float16 Sum, Product and scaling with F16C, eight elements at a time; the
// last n % 8 take the portable path, which gives the same bits.
HVDMX_AVX2 inline __m256 LoadHalf8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Canonical NaN first: VCVTPS2PH would keep part of the payload.
HVDMX_AVX2 inline __m128i NarrowHalf8(__m256 x) {
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(Float32::kNaNBits)));
  x = _mm256_blendv_ps(x, nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
}

HVDMX_AVX2 inline void StoreHalf8(uint16_t* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), NarrowHalf8(x));
}

// x * factor rounded to float16 and widened back: WidenOperand's scaling.
HVDMX_AVX2 inline __m256 ScaleInHalf8(__m256 x, __m256 factor) {
  return _mm256_cvtph_ps(NarrowHalf8(_mm256_mul_ps(x, factor)));
}

// out may be a: each block is loaded before it is stored.
template <typename Op>
HVDMX_AVX2 void HalfArithmeticF16c(void* out_bytes, const void* a_bytes, const void* b_bytes,
                                   int64_t n) {
  constexpr bool kProduct = std::is_same_v<Op, FloatProduct<Float16>>;
  auto* out = static_cast<uint16_t*>(out_bytes);
  const auto* a = static_cast<const uint16_t*>(a_bytes);
  const auto* b = static_cast<const uint16_t*>(b_bytes);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = LoadHalf8(a + i);
    const __m256 y = LoadHalf8(b + i);
    StoreHalf8(out + i, kProduct ? _mm256_mul_ps(x, y) : _mm256_add_ps(x, y));
  }
  for (; i < n; ++i) out[i] = Op::Apply(a[i], b[i]);
}

template <typename Op>
HVDMX_AVX2 void HalfInPlaceF16c(void* dst, const void* src, int64_t n) {
  HalfArithmeticF16c<Op>(dst, dst, src, n);
}

template <>
Kernel Avx2Kernel<FloatSum<Float16>>() {
  return {&HalfInPlaceF16c<FloatSum<Float16>>, &HalfArithmeticF16c<FloatSum<Float16>>};
}

template <>
Kernel Avx2Kernel<FloatProduct<Float16>>() {
  return {&HalfInPlaceF16c<FloatProduct<Float16>>, &HalfArithmeticF16c<FloatProduct<Float16>>};
}

template <>
HVDMX_AVX2 void ScaleAvx2<FloatScale<Float16>>(void* buf, int64_t n, double factor) {
  auto* x = static_cast<uint16_t*>(buf);
  const __m256 f = _mm256_set1_ps(static_cast<float>(factor));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) StoreHalf8(x + i, _mm256_mul_ps(LoadHalf8(x + i), f));
  for (; i < n; ++i) x[i] = FloatScale<Float16>::Apply(x[i], factor);
}

// The widened float16 kernels with F16C, eight elements at a time; the
// portable path finishes the tail with the same bits. A NaN left in a
// float32 partial is made canonical as the portable path makes it.
HVDMX_AVX2 inline __m256 CanonicalNaN8(__m256 x) {
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(Float32::kNaNBits)));
  return _mm256_blendv_ps(x, nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

template <bool kScaled>
HVDMX_AVX2 void WidenHalfF16c(float* out, const void* in_bytes, int64_t n, float f) {
  const auto* in = static_cast<const uint16_t*>(in_bytes);
  const __m256 factor = _mm256_set1_ps(f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = LoadHalf8(in + i);
    _mm256_storeu_ps(out + i, kScaled ? ScaleInHalf8(x, factor) : x);
  }
  Widen<Float16, kScaled>(out + i, in + i, n - i, f);
}

template <typename Op, bool kScaled>
HVDMX_AVX2 void ReduceWideHalfF16c(float* acc, const void* in_bytes, int64_t n, float f) {
  constexpr bool kProduct = std::is_same_v<Op, FloatProduct<Float32>>;
  const auto* in = static_cast<const uint16_t*>(in_bytes);
  const __m256 factor = _mm256_set1_ps(f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = LoadHalf8(in + i);
    if (kScaled) x = ScaleInHalf8(x, factor);
    const __m256 a = _mm256_loadu_ps(acc + i);
    _mm256_storeu_ps(acc + i, CanonicalNaN8(kProduct ? _mm256_mul_ps(a, x) : _mm256_add_ps(a, x)));
  }
  ReduceWide<Float16, Op, kScaled>(acc + i, in + i, n - i, f);
}

template <bool kScaled>
HVDMX_AVX2 void NarrowHalfF16c(void* out_bytes, const float* acc, int64_t n, float f) {
  auto* out = static_cast<uint16_t*>(out_bytes);
  const __m256 factor = _mm256_set1_ps(f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(acc + i);
    StoreHalf8(out + i, kScaled ? _mm256_mul_ps(x, factor) : x);
  }
  Narrow<Float16, kScaled>(out + i, acc + i, n - i, f);
}

#else

inline bool CpuHasAvx2() { return false; }

// Never called: CpuHasAvx2() is false.
template <bool kScaled>
void WidenHalfF16c(float*, const void*, int64_t, float) {}
template <typename Op, bool kScaled>
void ReduceWideHalfF16c(float*, const void*, int64_t, float) {}
template <bool kScaled>
void NarrowHalfF16c(void*, const float*, int64_t, float) {}

#endif

}  // namespace
}  // namespace hvdmx

#endif  // HVDMX_REDUCE_LOOPS_H_
