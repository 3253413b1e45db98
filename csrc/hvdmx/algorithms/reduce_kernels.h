// Element-wise reduction and scaling of typed buffers: the arithmetic the
// collectives apply to the bytes they move. Every DataType in common.h is
// covered, float16 and bfloat16 included; large float32 sums run at memory
// bandwidth.
//
// Semantics, the same for every code path (see Note [Bitwise identical
// reductions] in reduce_kernels.cc):
// - float16 and bfloat16 are widened to float32, combined in float32 and
//   rounded back to nearest-even. float32 and float64 use their own type.
// - Any NaN a floating kernel produces is the type's canonical quiet NaN
//   (positive, only the top mantissa bit set), whatever the inputs' payloads.
// - Min and Max on floats: a NaN operand gives NaN; otherwise -0 < +0, so
//   Min(-0, +0) is -0 and Max(-0, +0) is +0 in either order.
// - Integer Sum and Product wrap around (two's complement).
// - Every op is commutative, bit for bit.
//
// Threading: the functions are pure; call them from any thread. The first
// call picks the code path for this CPU (see reduce_kernels.cc). Buffers must
// not overlap except where stated.
#ifndef HVDMX_REDUCE_KERNELS_H_
#define HVDMX_REDUCE_KERNELS_H_

#include <cstdint>

#include "base/common.h"

namespace hvdmx {

// dst[i] = dst[i] OP src[i] for i < count. Average is reduced as Sum (the
// caller scales afterwards). dst and src must not overlap.
void ReduceInto(void* dst, const void* src, int64_t count, DataType dtype, ReduceOp op);

// out[i] = a[i] OP b[i] for i < count. out may be a or b itself (not both),
// and a and b may be one buffer; no other overlap is allowed.
void Reduce3(void* out, const void* a, const void* b, int64_t count, DataType dtype, ReduceOp op);

// Reduce3 then ScaleBuffer(out, count, dtype, factor), with their bits; one
// pass over the data for float32 Sum and Average (the scaled allreduce's
// common case), two otherwise.
void Reduce3Scaled(void* out, const void* a, const void* b, int64_t count, DataType dtype,
                   ReduceOp op, double factor);

// buf[i] = buf[i] * factor. float16, bfloat16 and float32 multiply in float32
// by factor rounded to float32; float64 in double. Integers compute
// static_cast<T>(double(buf[i]) * factor), truncating toward zero; a product
// outside T's range saturates and NaN gives 0 (where static_cast is
// undefined). factor == 1.0 returns at once without touching buf.
void ScaleBuffer(void* buf, int64_t count, DataType dtype, double factor);

// Half precision reduced in float32 (see Note [Half precision summed in
// float32] in reduce_kernels.cc): a collective that reduces float16 or
// bfloat16 scales every rank's operand by the prescale in the dtype (as
// Horovod does), widens it to float32, combines the operands and partial
// results in float32, and rounds to the dtype once, after the postscale. Each call below takes a
// half dtype (HalfReducesWide(dtype)) and computes every element as stated, with one rounding per
// float32 operation (never fused into an FMA) and every NaN canonical where the result is stored.
bool HalfReducesWide(DataType dtype);

// out[i] = float32(dtype(float32(in[i]) * float32(factor))): the element
// ScaleBuffer(in, count, dtype, factor) would leave, widened exactly; exact
// widening alone when factor == 1. in holds count elements of dtype.
void WidenScaled(float* out, const void* in, int64_t count, DataType dtype, double factor);

// acc[i] = acc[i] OP w[i], in float32, where w[i] is WidenScaled's out[i]
// (Average as Sum; Min and Max as for float32 above). in holds elements of
// dtype.
void ReduceWidenedInto(float* acc, const void* in, int64_t count, DataType dtype, ReduceOp op,
                       double factor);

// out[i] = dtype(acc[i] * float32(factor)): rounded to nearest-even once
// (no multiply when factor == 1). out holds elements of dtype.
void NarrowScaled(void* out, const float* acc, int64_t count, DataType dtype, double factor);

// The kernels on a chosen path. kNative is the path this CPU takes (what
// the functions above run); kPortable never uses AVX2 or F16C. Every path
// gives the same bits (Note [Bitwise identical reductions]), which the tests
// check by comparing them.
enum class KernelPath { kNative, kPortable };
void ReduceIntoOn(KernelPath path, void* dst, const void* src, int64_t count, DataType dtype,
                  ReduceOp op);
void WidenScaledOn(KernelPath path, float* out, const void* in, int64_t count, DataType dtype,
                   double factor);
void ReduceWidenedIntoOn(KernelPath path, float* acc, const void* in, int64_t count, DataType dtype,
                         ReduceOp op, double factor);
void NarrowScaledOn(KernelPath path, void* out, const float* acc, int64_t count, DataType dtype,
                    double factor);

}  // namespace hvdmx

#endif  // HVDMX_REDUCE_KERNELS_H_
