// The typed element-wise kernels behind reduce_kernels.h: Sum, Min, Max and
// Product for every DataType, and ScaleBuffer.
//
// Each kernel is a plain loop over an element operation, written once and
// compiled twice: for the baseline target (SSE2 on x86-64) and, through a
// target attribute, for AVX2, which is chosen at run time where the CPU has
// it. On that path float16 Sum, Product and scaling convert with F16C
// instructions instead of integer code. Build with -O3 and nothing more:
// GCC leaves these loops scalar at -O2 (about 5x slower).
//
// Note [Bitwise identical reductions]
// Ranks of one job may run on different CPUs and so take different paths
// through this file (AVX2 or not, x86 or aarch64, vector body or scalar
// tail). Replicas must never drift, so every path computes each element the
// same way:
// - one IEEE operation (an add or a multiply) in the type the header states,
//   rounded to nearest-even. Where a multiply feeds an add (the widened
//   kernels), -ffp-contract=off keeps them apart (Note [Half precision summed
//   in float32]); -ffast-math, which would allow reassociation, is refused
//   below.
// - float16 and bfloat16 widen to float32 exactly and narrow with
//   round-to-nearest-even: in integer code on the portable path, with
//   VCVTPS2PH and an explicit rounding mode on the F16C path.
// - NaN payloads are what IEEE leaves to the hardware (x86 and Arm make
//   different default NaNs, and a compiler may swap an add's operands), so
//   every NaN result becomes the type's canonical NaN.
// - Min and Max pick one operand by an integer order on its bits (see
//   FloatMinMax), so no min/max instruction's rule for -0 or NaN leaks in.
// Outside this file's control is the thread's floating-point mode: with
// flush-to-zero or denormals-are-zero set (hvdmx sets neither), float32,
// float64 and bfloat16 subnormals give other results. float16 is immune:
// its values, sums and products are all float32 normals.
// ReduceIntoOn(KernelPath::kPortable, ...) runs the portable path, so tests
// can compare it, one element at a time, with the path this CPU takes.
//
// Note [Half precision summed in float32]
// A float16 or bfloat16 allreduce (and reducescatter) is computed as if the
// tensors were float32, rounded to the dtype once at the end:
//   out = dtype(float32(postscale) * (w_0 OP w_1 OP ... OP w_{n-1})),
//   w_j = float32(x_j) * float32(prescale),
// every operation in float32, the OP chain in the algorithm's fixed order.
// Reducing in the dtype instead rounds after every pairwise step (and after
// each scaling): a float16 sum of n values then carries up to n - 1
// roundings, and its error grows with the job. The kernels below are what
// the collectives build this from: WidenScaled makes w_j, ReduceWidenedInto
// folds an operand into a float32 partial, and NarrowScaled applies the
// postscale and rounds. Partials travel between ranks as float32 (the
// collectives say how). Two operations in a row (a multiply, then an add)
// could be fused into an FMA where the target has one (aarch64 always):
// setup.py builds with -ffp-contract=off so that no compiler does.
#include "algorithms/reduce_kernels.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "base/float_formats.h"

#if defined(__FAST_MATH__)
#error "no -ffast-math for reduce_kernels.cc: see Note [Bitwise identical reductions]"
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
HVDMX_ALWAYS_INLINE void BinaryScaled(void* __restrict out_bytes,
                                      const void* __restrict a_bytes,
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
// or BFloat16, Op a float32 element operation; kScaled multiplies by f.
template <typename Op>
HVDMX_ALWAYS_INLINE float ApplyFloat(float a, float b) {
  if constexpr (std::is_same_v<typename Op::T, float>) {
    return Op::Apply(a, b);
  } else {  // Min and Max order the bits
    return BitCast<float>(Op::Apply(BitCast<uint32_t>(a), BitCast<uint32_t>(b)));
  }
}

template <typename F, bool kScaled>
HVDMX_ALWAYS_INLINE void Widen(float* __restrict out, const void* __restrict in_bytes,
                               int64_t n, float f) {
  const auto* in = static_cast<const uint16_t*>(in_bytes);
  for (int64_t i = 0; i < n; ++i) {
    const float x = F::Load(in[i]);
    out[i] = kScaled ? x * f : x;
  }
}

template <typename F, typename Op, bool kScaled>
HVDMX_ALWAYS_INLINE void ReduceWide(float* __restrict acc, const void* __restrict in_bytes,
                                    int64_t n, float f) {
  const auto* in = static_cast<const uint16_t*>(in_bytes);
  for (int64_t i = 0; i < n; ++i) {
    const float x = F::Load(in[i]);
    acc[i] = ApplyFloat<Op>(acc[i], kScaled ? x * f : x);
  }
}

template <typename F, bool kScaled>
HVDMX_ALWAYS_INLINE void Narrow(void* __restrict out_bytes, const float* __restrict acc,
                                int64_t n, float f) {
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

bool CpuHasAvx2() {
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
HVDMX_AVX2 inline void StoreHalf8(uint16_t* p, __m256 x) {
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(Float32::kNaNBits)));
  x = _mm256_blendv_ps(x, nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
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
    _mm256_storeu_ps(out + i, kScaled ? _mm256_mul_ps(x, factor) : x);
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
    if (kScaled) x = _mm256_mul_ps(x, factor);
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

bool CpuHasAvx2() { return false; }

// Never called: CpuHasAvx2() is false.
template <bool kScaled>
void WidenHalfF16c(float*, const void*, int64_t, float) {}
template <typename Op, bool kScaled>
void ReduceWideHalfF16c(float*, const void*, int64_t, float) {}
template <bool kScaled>
void NarrowHalfF16c(void*, const float*, int64_t, float) {}

#endif

template <typename Op>
Kernel MakeKernel(bool avx2) {
  if (avx2) return Avx2Kernel<Op>();
  return {&InPlace<Op>, &Binary<Op>};
}

using ScaleFn = void (*)(void* buf, int64_t n, double factor);

// The operations of one data type.
template <typename Sum, typename Product, typename Min, typename Max, typename Scaling>
struct OpSet {
  static Kernel KernelFor(ReduceOp op, bool avx2) {
    switch (op) {
      case ReduceOp::kAverage:
      case ReduceOp::kSum: return MakeKernel<Sum>(avx2);
      case ReduceOp::kProduct: return MakeKernel<Product>(avx2);
      case ReduceOp::kMin: return MakeKernel<Min>(avx2);
      case ReduceOp::kMax: return MakeKernel<Max>(avx2);
      case ReduceOp::kAdasum: break;
    }
    HVDMX_CHECK(false, "no reduction kernel for op " + ReduceOpName(op));
  }
  static ScaleFn ScaleFor(bool avx2) { return avx2 ? &ScaleAvx2<Scaling> : &Scale<Scaling>; }
};

template <typename F>
using FloatOps = OpSet<FloatSum<F>, FloatProduct<F>, FloatMinMax<F, false>,
                       FloatMinMax<F, true>, FloatScale<F>>;
template <typename T>
using IntOps = OpSet<IntSum<T>, IntProduct<T>, IntMinMax<T, false>, IntMinMax<T, true>,
                     IntScale<T>>;

// Returns fn(ops) for the OpSet of dtype.
template <typename Fn>
auto WithOps(DataType dtype, Fn fn) {
  switch (dtype) {
    case DataType::kFloat32: return fn(FloatOps<Float32>());
    case DataType::kFloat64: return fn(FloatOps<Float64>());
    case DataType::kFloat16: return fn(FloatOps<Float16>());
    case DataType::kBFloat16: return fn(FloatOps<BFloat16>());
    case DataType::kUInt8: return fn(IntOps<uint8_t>());
    case DataType::kInt8: return fn(IntOps<int8_t>());
    case DataType::kInt32: return fn(IntOps<int32_t>());
    case DataType::kInt64: return fn(IntOps<int64_t>());
  }
  HVDMX_CHECK(false, "no kernels for dtype " + DataTypeName(dtype));
}

Kernel SelectKernel(DataType dtype, ReduceOp op, bool avx2) {
  return WithOps(dtype, [&](auto ops) { return decltype(ops)::KernelFor(op, avx2); });
}

}  // namespace

bool ReduceOpSupported(DataType dtype, ReduceOp op) {
  const bool implemented = op == ReduceOp::kAverage || op == ReduceOp::kSum ||
                           op == ReduceOp::kMin || op == ReduceOp::kMax ||
                           op == ReduceOp::kProduct;
  return implemented && IsSupportedDataType(static_cast<int32_t>(dtype));
}

void ReduceInto(void* dst, const void* src, int64_t count, DataType dtype, ReduceOp op) {
  ReduceIntoOn(KernelPath::kNative, dst, src, count, dtype, op);
}

void ReduceIntoOn(KernelPath path, void* dst, const void* src, int64_t count, DataType dtype,
                  ReduceOp op) {
  const bool avx2 = path == KernelPath::kNative && CpuHasAvx2();
  SelectKernel(dtype, op, avx2).in_place(dst, src, count);
}

void Reduce3(void* out, const void* a, const void* b, int64_t count, DataType dtype,
             ReduceOp op) {
  const Kernel kernel = SelectKernel(dtype, op, CpuHasAvx2());
  if (out == a) {
    kernel.in_place(out, b, count);
  } else if (out == b) {
    kernel.in_place(out, a, count);  // every op is commutative, bit for bit
  } else {
    kernel.binary(out, a, b, count);
  }
}

void Reduce3Scaled(void* out, const void* a, const void* b, int64_t count, DataType dtype,
                   ReduceOp op, double factor) {
  const bool fused = factor != 1.0 && dtype == DataType::kFloat32 &&
                     (op == ReduceOp::kSum || op == ReduceOp::kAverage) && out != a && out != b;
  if (!fused) {
    Reduce3(out, a, b, count, dtype, op);
    ScaleBuffer(out, count, dtype, factor);
    return;
  }
  using Sum = FloatSum<Float32>;
  using Scaling = FloatScale<Float32>;
  if (CpuHasAvx2()) {
    BinaryScaledAvx2<Sum, Scaling>(out, a, b, count, factor);
  } else {
    BinaryScaled<Sum, Scaling>(out, a, b, count, factor);
  }
}

void ScaleBuffer(void* buf, int64_t count, DataType dtype, double factor) {
  if (factor == 1.0) return;
  const bool avx2 = CpuHasAvx2();
  WithOps(dtype, [&](auto ops) { return decltype(ops)::ScaleFor(avx2); })(buf, count, factor);
}

namespace {

// The widened kernels of one half format: each picks its loop by op, by
// whether the factor is 1, and by the CPU.
using WidenFn = void (*)(float* out, const void* in, int64_t n, float f);
using ReduceWideFn = void (*)(float* acc, const void* in, int64_t n, float f);
using NarrowFn = void (*)(void* out, const float* acc, int64_t n, float f);

template <typename F, bool kScaled>
WidenFn SelectWiden(bool avx2) {
  if (!avx2) return &Widen<F, kScaled>;
  if constexpr (std::is_same_v<F, Float16>) return &WidenHalfF16c<kScaled>;
  return &WidenAvx2<F, kScaled>;
}

template <typename F, typename Op, bool kScaled>
ReduceWideFn SelectReduceWide(bool avx2) {
  if (!avx2) return &ReduceWide<F, Op, kScaled>;
  constexpr bool kArithmetic = std::is_same_v<Op, FloatSum<Float32>> ||
                               std::is_same_v<Op, FloatProduct<Float32>>;
  if constexpr (std::is_same_v<F, Float16> && kArithmetic) {
    return &ReduceWideHalfF16c<Op, kScaled>;
  }
  return &ReduceWideAvx2<F, Op, kScaled>;
}

template <typename F, bool kScaled>
NarrowFn SelectNarrow(bool avx2) {
  if (!avx2) return &Narrow<F, kScaled>;
  if constexpr (std::is_same_v<F, Float16>) return &NarrowHalfF16c<kScaled>;
  return &NarrowAvx2<F, kScaled>;
}

template <typename F, bool kScaled>
ReduceWideFn SelectReduceWideOp(ReduceOp op, bool avx2) {
  switch (op) {
    case ReduceOp::kAverage:
    case ReduceOp::kSum: return SelectReduceWide<F, FloatSum<Float32>, kScaled>(avx2);
    case ReduceOp::kProduct: return SelectReduceWide<F, FloatProduct<Float32>, kScaled>(avx2);
    case ReduceOp::kMin: return SelectReduceWide<F, FloatMinMax<Float32, false>, kScaled>(avx2);
    case ReduceOp::kMax: return SelectReduceWide<F, FloatMinMax<Float32, true>, kScaled>(avx2);
    case ReduceOp::kAdasum: break;
  }
  HVDMX_CHECK(false, "no widened reduction for op " + ReduceOpName(op));
}

// Returns fn(format) for a half dtype.
template <typename Fn>
auto WithHalfFormat(DataType dtype, Fn fn) {
  if (dtype == DataType::kFloat16) return fn(Float16());
  HVDMX_CHECK(dtype == DataType::kBFloat16,
              "a widened kernel called for " + DataTypeName(dtype) + ", not a half dtype");
  return fn(BFloat16());
}

}  // namespace

bool HalfReducesWide(DataType dtype) {
  return dtype == DataType::kFloat16 || dtype == DataType::kBFloat16;
}

void WidenScaledOn(KernelPath path, float* out, const void* in, int64_t count, DataType dtype,
                   double factor) {
  const bool avx2 = path == KernelPath::kNative && CpuHasAvx2();
  const float f = static_cast<float>(factor);
  WithHalfFormat(dtype, [&](auto format) {
    using F = decltype(format);
    return factor == 1.0 ? SelectWiden<F, false>(avx2) : SelectWiden<F, true>(avx2);
  })(out, in, count, f);
}

void ReduceWidenedIntoOn(KernelPath path, float* acc, const void* in, int64_t count,
                         DataType dtype, ReduceOp op, double factor) {
  const bool avx2 = path == KernelPath::kNative && CpuHasAvx2();
  const float f = static_cast<float>(factor);
  WithHalfFormat(dtype, [&](auto format) {
    using F = decltype(format);
    return factor == 1.0 ? SelectReduceWideOp<F, false>(op, avx2)
                         : SelectReduceWideOp<F, true>(op, avx2);
  })(acc, in, count, f);
}

void NarrowScaledOn(KernelPath path, void* out, const float* acc, int64_t count, DataType dtype,
                    double factor) {
  const bool avx2 = path == KernelPath::kNative && CpuHasAvx2();
  const float f = static_cast<float>(factor);
  WithHalfFormat(dtype, [&](auto format) {
    using F = decltype(format);
    return factor == 1.0 ? SelectNarrow<F, false>(avx2) : SelectNarrow<F, true>(avx2);
  })(out, acc, count, f);
}

void WidenScaled(float* out, const void* in, int64_t count, DataType dtype, double factor) {
  WidenScaledOn(KernelPath::kNative, out, in, count, dtype, factor);
}

void ReduceWidenedInto(float* acc, const void* in, int64_t count, DataType dtype, ReduceOp op,
                       double factor) {
  ReduceWidenedIntoOn(KernelPath::kNative, acc, in, count, dtype, op, factor);
}

void NarrowScaled(void* out, const float* acc, int64_t count, DataType dtype, double factor) {
  NarrowScaledOn(KernelPath::kNative, out, acc, count, dtype, factor);
}

}  // namespace hvdmx
