// The typed element-wise kernels behind reduce_kernels.h: Sum, Min, Max and
// Product for every DataType, and ScaleBuffer. This file picks a kernel by
// dtype, op and CPU; the kernels themselves are in reduce_loops.h.
//
// Each kernel is a plain loop over an element operation, written once and
// compiled twice: for the baseline target (SSE2 on x86-64) and, through a
// target attribute, for AVX2, which is chosen at run time where the CPU has
// it. On that path float16 Sum, Product and scaling convert with F16C
// instructions instead of integer code. Build with -O3 and nothing more:
// GCC leaves these loops scalar at -O2, several times slower
// (docs/benchmark-notes.md, "Figures the code cites").
//
// Note [Bitwise identical reductions]
// Ranks of one job may run on different CPUs and so take different paths
// through this file (AVX2 or not, x86 or aarch64, vector body or scalar
// tail). Replicas must never drift, so every path computes each element the
// same way:
// - one IEEE operation (an add or a multiply) in the type the header states,
//   rounded to nearest-even. Should a multiply feed an add, -ffp-contract=off
//   keeps them apart (Note [Half precision summed in float32]); -ffast-math, which would allow
//   reassociation, is refused below.
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
//   w_j = float32(dtype(float32(x_j) * float32(prescale))),
// every operation in float32, the OP chain in the algorithm's fixed order.
// The prescaled operand w_j is rounded to the dtype before it joins the
// chain (exactly what ScaleBuffer leaves in a half buffer, widened), as
// Horovod scales each rank's input in the tensor's own dtype before the sum
// (issue 46): kept in float32, a prescale such as 1/3 gave results an ulp
// away from Horovod's in some elements. With prescale 1, w_j is x_j.
// Reducing in the dtype instead rounds after every pairwise step as well: a
// float16 sum of n values then carries up to n - 1 more roundings, and its
// error grows with the job. The kernels below are what the collectives build
// this from: WidenScaled makes w_j, ReduceWidenedInto folds an operand into
// a float32 partial, and NarrowScaled applies the postscale and rounds.
// Partials travel between ranks as float32 (the collectives say how). A
// multiply that fed an add straight away could be fused into an FMA where
// the target has one (aarch64 always); the rounding of w_j stands between
// them here, and setup.py builds with -ffp-contract=off so that no compiler
// fuses any.
#include "algorithms/reduce_kernels.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "algorithms/reduce_loops.h"
#include "base/float_formats.h"

namespace hvdmx {
namespace {

using fp::BFloat16;
using fp::Float16;
using fp::Float32;
using fp::Float64;

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
using FloatOps =
    OpSet<FloatSum<F>, FloatProduct<F>, FloatMinMax<F, false>, FloatMinMax<F, true>, FloatScale<F>>;
template <typename T>
using IntOps =
    OpSet<IntSum<T>, IntProduct<T>, IntMinMax<T, false>, IntMinMax<T, true>, IntScale<T>>;

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

void ReduceInto(void* dst, const void* src, int64_t count, DataType dtype, ReduceOp op) {
  ReduceIntoOn(KernelPath::kNative, dst, src, count, dtype, op);
}

void ReduceIntoOn(KernelPath path, void* dst, const void* src, int64_t count, DataType dtype,
                  ReduceOp op) {
  const bool avx2 = path == KernelPath::kNative && CpuHasAvx2();
  SelectKernel(dtype, op, avx2).in_place(dst, src, count);
}

void Reduce3(void* out, const void* a, const void* b, int64_t count, DataType dtype, ReduceOp op) {
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
  constexpr bool kArithmetic =
      std::is_same_v<Op, FloatSum<Float32>> || std::is_same_v<Op, FloatProduct<Float32>>;
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

void ReduceWidenedIntoOn(KernelPath path, float* acc, const void* in, int64_t count, DataType dtype,
                         ReduceOp op, double factor) {
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
