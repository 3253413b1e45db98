"""The reduction kernels (csrc/hvdmx/algorithms/reduce_kernels.*) against numpy references.

Every comparison is bit for bit. The references follow the semantics in
reduce_kernels.h: float16 and bfloat16 are combined in float32 and rounded to
nearest-even, every NaN result is the type's canonical NaN, Min and Max order
-0 below +0, and integers wrap. The portable path (one element at a time) must
match the path this CPU takes, whatever the data: NaN payloads, infinities,
subnormals and signed zeros included.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _hvdmx_testing

# DataType and ReduceOp codes (csrc/hvdmx/base/common.h).
from core_codes import DTYPE_CODES, REDUCE_OPS
FLOAT32, FLOAT64, FLOAT16, UINT8, INT32, INT8, INT64, BFLOAT16 = (DTYPE_CODES[name] for name in (
    "float32", "float64", "float16", "uint8", "int32", "int8", "int64", "bfloat16"))
AVERAGE, SUM, MIN, MAX, PRODUCT = (REDUCE_OPS[name] for name in (
    "Average", "Sum", "Min", "Max", "Product"))

ALL_DTYPES = [FLOAT32, FLOAT64, FLOAT16, BFLOAT16, UINT8, INT8, INT32, INT64]
ALL_OPS = [AVERAGE, SUM, MIN, MAX, PRODUCT]
# Lengths around the vector widths (4 to 32 elements) so bodies and tails both run.
LENGTHS = [0, 1, 7, 31, 33, 1001, 4099]

# The numpy array type that holds each DataType; bfloat16 travels as its bits.
STORAGE = {
    FLOAT32: np.float32, FLOAT64: np.float64, FLOAT16: np.float16, BFLOAT16: np.uint16,
    UINT8: np.uint8, INT8: np.int8, INT32: np.int32, INT64: np.int64,
}
FLOATS = {FLOAT32, FLOAT64, FLOAT16, BFLOAT16}
BITS = {FLOAT32: np.uint32, FLOAT64: np.uint64, FLOAT16: np.uint16, BFLOAT16: np.uint16}
CANONICAL_NAN = {FLOAT32: 0x7FC00000, FLOAT64: 0x7FF8000000000000, FLOAT16: 0x7E00,
                 BFLOAT16: 0x7FC0}
# Bit patterns worth meeting often: zeros, ones, infinities, NaNs with payloads
# and either sign, the smallest and largest subnormals and normals.
SPECIAL_BITS = {
    FLOAT32: [0x0, 0x80000000, 0x3F800000, 0xBF800000, 0x7F800000, 0xFF800000, 0x7FC00000,
              0xFFC00001, 0x7F800001, 0x7FBFFFFF, 0x1, 0x807FFFFF, 0x00800000, 0x7F7FFFFF],
    FLOAT64: [0x0, 1 << 63, 0x3FF0000000000000, 0x7FF0000000000000, 0xFFF0000000000000,
              0x7FF8000000000000, 0xFFF8000000000123, 0x7FF0000000000001, 0x1,
              0x800FFFFFFFFFFFFF, 0x7FEFFFFFFFFFFFFF],
    FLOAT16: [0x0, 0x8000, 0x3C00, 0xBC00, 0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01, 0x7DFF,
              0x1, 0x83FF, 0x0400, 0x7BFF],
    BFLOAT16: [0x0, 0x8000, 0x3F80, 0xBF80, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x7FBF,
               0x1, 0x807F, 0x0080, 0x7F7F],
}


def reduce_into(dst, src, dtype, op, scalar=False):
    out = dst.copy()
    _hvdmx_testing.reduce_into(out, src, dtype, op, scalar)
    return out


def scale(buf, dtype, factor):
    out = buf.copy()
    _hvdmx_testing.scale(out, dtype, factor)
    return out


def bf16_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x):
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(CANONICAL_NAN[BFLOAT16]), rounded)


def widen(x, dtype):
    """Storage to the type the kernels compute in."""
    if dtype == BFLOAT16:
        return bf16_to_f32(x)
    return x.astype(np.float32) if dtype == FLOAT16 else x


def narrow(x, dtype):
    """Computed values back to storage, with every NaN canonical."""
    if dtype == BFLOAT16:
        return f32_to_bf16(x)
    out = x.astype(STORAGE[dtype])
    nan = np.array(CANONICAL_NAN[dtype], dtype=BITS[dtype]).view(STORAGE[dtype])
    return np.where(np.isnan(out), nan, out)


def float_min_max(a, b, op):
    """Min or Max with -0 below +0 and NaN winning."""
    pick = np.where(b < a, b, a) if op == MIN else np.where(b > a, b, a)
    both_zero = (a == 0) & (b == 0)
    either_negative = np.signbit(a) | np.signbit(b)
    zero_negative = either_negative if op == MIN else np.signbit(a) & np.signbit(b)
    signed_zero = np.where(zero_negative, -np.zeros_like(a), np.zeros_like(a))
    out = np.where(both_zero, signed_zero, pick)
    return np.where(np.isnan(a) | np.isnan(b), np.full_like(a, np.nan), out)


def reference(a, b, dtype, op):
    if dtype not in FLOATS:  # numpy's integer arrays wrap, as the kernels do
        return {AVERAGE: np.add, SUM: np.add, PRODUCT: np.multiply, MIN: np.minimum,
                MAX: np.maximum}[op](a, b)
    x, y = widen(a, dtype), widen(b, dtype)
    with np.errstate(all="ignore"):
        if op in (AVERAGE, SUM):
            return narrow(x + y, dtype)
        if op == PRODUCT:
            return narrow(x * y, dtype)
        return narrow(float_min_max(x, y, op), dtype)


def assert_same_bits(got, want):
    assert got.dtype == want.dtype
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}.get(got.itemsize, np.uint8)
    np.testing.assert_array_equal(got.view(bits), want.view(bits))


def random_array(rng, dtype, n):
    """Integers over their whole range; floats as random bits, one in four
    special and one in four a small integer so that sums mean something."""
    if dtype not in FLOATS:
        info = np.iinfo(STORAGE[dtype])
        return rng.integers(info.min, info.max, size=n, endpoint=True, dtype=STORAGE[dtype])
    bits_type = BITS[dtype]
    bits = rng.integers(0, np.iinfo(bits_type).max, size=n, endpoint=True, dtype=bits_type)
    special = np.array(SPECIAL_BITS[dtype], dtype=bits_type)
    compute_type = np.float64 if dtype == FLOAT64 else np.float32
    small = narrow(rng.integers(-8, 9, size=n).astype(compute_type), dtype)
    choice = rng.integers(0, 4, size=n)
    bits = np.where(choice == 0, rng.choice(special, size=n), bits)
    bits = np.where(choice == 1, small.view(bits_type), bits)
    return bits.view(STORAGE[dtype])


def check(a, b, dtype, op):
    want = reference(a, b, dtype, op)
    assert_same_bits(reduce_into(a, b, dtype, op), want)
    assert_same_bits(reduce_into(a, b, dtype, op, scalar=True), want)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_reduce_matches_reference_on_both_paths(dtype, op, n):
    rng = np.random.default_rng([dtype, op, n])
    check(random_array(rng, dtype, n), random_array(rng, dtype, n), dtype, op)


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(ALL_DTYPES), op=st.sampled_from(ALL_OPS),
       n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_reduce_random(dtype, op, n, seed):
    rng = np.random.default_rng(seed)
    check(random_array(rng, dtype, n), random_array(rng, dtype, n), dtype, op)


@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT64, FLOAT16, BFLOAT16])
def test_every_pair_of_special_values(dtype):
    special = np.array(SPECIAL_BITS[dtype], dtype=BITS[dtype])
    a, b = (x.ravel().view(STORAGE[dtype]) for x in np.meshgrid(special, special))
    for op in ALL_OPS:
        check(a, b, dtype, op)


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16])
def test_every_16_bit_value(dtype):
    """Each 16-bit pattern against a shuffled copy: all of them, one pass."""
    a = np.arange(1 << 16, dtype=np.uint16)
    b = np.random.default_rng(dtype).permutation(a)
    for op in ALL_OPS:
        check(a.view(STORAGE[dtype]), b.view(STORAGE[dtype]), dtype, op)


def test_float_semantics_spelled_out():
    f32 = np.float32
    nan_bits = np.array([CANONICAL_NAN[FLOAT32]], dtype=np.uint32)
    odd_nan = np.array([0xFFC00123], dtype=np.uint32).view(f32)
    assert_same_bits(reduce_into(odd_nan, np.array([1], f32), FLOAT32, SUM), nan_bits.view(f32))
    inf, ninf = np.array([np.inf], f32), np.array([-np.inf], f32)
    assert_same_bits(reduce_into(inf, ninf, FLOAT32, SUM), nan_bits.view(f32))
    pz, nz = np.array([0.0], f32), np.array([-0.0], f32)
    for a, b in ((pz, nz), (nz, pz)):
        assert_same_bits(reduce_into(a, b, FLOAT32, MIN), nz)
        assert_same_bits(reduce_into(a, b, FLOAT32, MAX), pz)
    assert_same_bits(reduce_into(odd_nan, pz, FLOAT32, MAX), nan_bits.view(f32))
    # float16: 1 + 2^-11 is halfway between 1 and its successor; ties go to even.
    one, half_ulp = np.array([1.0], np.float16), np.array([2.0 ** -11], np.float16)
    assert_same_bits(reduce_into(one, half_ulp, FLOAT16, SUM), one)
    assert_same_bits(reduce_into(np.array([65504], np.float16), np.array([16], np.float16),
                                 FLOAT16, SUM), np.array([np.inf], np.float16))


WRAP_CASES = [  # dtype, a, b, a + b, a * b
    (UINT8, [255, 200, 16], [1, 100, 16], [0, 44, 32], [255, 32, 0]),
    (INT8, [127, -128, 16], [1, -1, 16], [-128, 127, 32], [127, -128, 0]),
    (INT32, [2**31 - 1, -(2**31), 2**16], [1, -1, 2**16], [-(2**31), 2**31 - 1, 2**17],
     [2**31 - 1, -(2**31), 0]),
    (INT64, [2**63 - 1, -(2**63), 2**32], [1, -1, 2**32], [-(2**63), 2**63 - 1, 2**33],
     [2**63 - 1, -(2**63), 0]),
]


@pytest.mark.parametrize("dtype, a, b, total, product", WRAP_CASES)
def test_integer_sum_and_product_wrap(dtype, a, b, total, product):
    t = STORAGE[dtype]
    a, b = np.array(a, t), np.array(b, t)
    for scalar in (False, True):
        assert_same_bits(reduce_into(a, b, dtype, SUM, scalar), np.array(total, t))
        assert_same_bits(reduce_into(a, b, dtype, PRODUCT, scalar), np.array(product, t))


def test_reduce_op_codes_average_is_sum():
    rng = np.random.default_rng(0)
    a, b = random_array(rng, FLOAT32, 100), random_array(rng, FLOAT32, 100)
    assert_same_bits(reduce_into(a, b, FLOAT32, AVERAGE), reduce_into(a, b, FLOAT32, SUM))


FACTORS = [0.5, 1 / 3, -2.5, 1e-3, 3.0, 1e5, 0.0]


def scale_reference(x, dtype, factor):
    if dtype in FLOATS:
        f = np.float64(factor) if dtype == FLOAT64 else np.float32(factor)
        with np.errstate(all="ignore"):
            return narrow(widen(x, dtype) * f, dtype)
    info = np.iinfo(STORAGE[dtype])
    return np.clip(np.trunc(x.astype(np.float64) * factor), info.min, info.max).astype(x.dtype)


@pytest.mark.parametrize("n", [0, 1, 7, 33, 1001])
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_scale_matches_reference(dtype, factor, n):
    rng = np.random.default_rng([dtype, n])
    if dtype in FLOATS:
        x = random_array(rng, dtype, n)
    else:
        # Within the range where the product fits T, except that uint8 times a
        # negative factor saturates to 0. Saturation is tested on its own below.
        info = np.iinfo(STORAGE[dtype])
        limit = int(min(info.max, 2**50) / max(1.0, abs(factor)))
        x = rng.integers(info.min and -limit, limit, size=n, endpoint=True, dtype=STORAGE[dtype])
    assert_same_bits(scale(x, dtype, factor), scale_reference(x, dtype, factor))


def test_scale_every_float16():
    x = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    for factor in FACTORS + [1e-30, 1e30]:
        assert_same_bits(scale(x, FLOAT16, factor), scale_reference(x, FLOAT16, factor))


@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT64, FLOAT16, BFLOAT16, INT64])
def test_scale_by_one_leaves_memory_alone(dtype):
    # Values that a multiplication by 1.0 would change: NaNs with payloads
    # become canonical, and 2^53 + 1 does not survive a trip through double.
    if dtype == INT64:
        x = np.full(37, 2**53 + 1, dtype=np.int64)
    else:
        x = np.full(37 * np.dtype(STORAGE[dtype]).itemsize, 0xFF, np.uint8).view(STORAGE[dtype])
    assert_same_bits(scale(x, dtype, 1.0), x)


def test_integer_scale_truncates_and_saturates():
    cases = [  # dtype, values, factor, expected
        (INT32, [7, -7, 5], 0.5, [3, -3, 2]),
        (INT8, [100, -100, 3], 2.0, [127, -128, 6]),
        (UINT8, [200, 5, 0], 2.0, [255, 10, 0]),
        (UINT8, [200, 5], -1.0, [0, 0]),
        (INT32, [1, -1, 0], float("inf"), [2**31 - 1, -(2**31), 0]),
        (INT32, [1, -1], float("nan"), [0, 0]),
        (INT64, [2**62, -(2**62), 3], 4.0, [2**63 - 1, -(2**63), 12]),
    ]
    for dtype, values, factor, expected in cases:
        t = STORAGE[dtype]
        assert_same_bits(scale(np.array(values, t), dtype, factor), np.array(expected, t))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_reduce_then_scale_in_one_call(dtype, op, n):
    # Reduce3Scaled (one pass for float32 Sum and Average) must give the bits
    # of the reduction followed by the scale, special values included.
    rng = np.random.default_rng([dtype, op, n, 3])
    a, b = random_array(rng, dtype, n), random_array(rng, dtype, n)
    for factor in [1.0, 0.5, 1 / 3, -2.5e-3]:
        out = np.zeros_like(a)
        _hvdmx_testing.reduce3_scaled(out, a, b, dtype, op, factor)
        assert_same_bits(out, scale(reference(a, b, dtype, op), dtype, factor))


# The widened kernels (Note [Half precision summed in float32]): float16 and
# bfloat16 operands folded into float32 partials and rounded once.
HALVES = [FLOAT16, BFLOAT16]
WIDEN, REDUCE_WIDENED, NARROW = 0, 1, 2
WIDE_FACTORS = [1.0, 0.5, 3.0, 1 / 3, 0.7, 1.3, -2.5, 1e-3]


def widened_kernel(kernel, out, inp, dtype, op=SUM, factor=1.0, portable=False):
    out = out.copy()
    _hvdmx_testing.widened_kernel(kernel, out, inp, dtype, op, factor, portable)
    return out


def canonical32(x):
    """float32 with every NaN the canonical one, as bits."""
    x = np.asarray(x, dtype=np.float32)
    return np.where(np.isnan(x), np.uint32(CANONICAL_NAN[FLOAT32]), x.view(np.uint32))


def times(x, factor):
    """x * float32(factor) in float32, as NarrowScaled scales (none at 1)."""
    with np.errstate(all="ignore"):
        return x if factor == 1.0 else x * np.float32(factor)


def operand(x, dtype, factor):
    """A half operand as the widened kernels take it (issue 46): scaled in
    float32, rounded to the dtype as ScaleBuffer rounds it, widened exactly;
    only widened when factor == 1."""
    if factor == 1.0:
        return widen(x, dtype)
    return widen(narrow(times(widen(x, dtype), factor), dtype), dtype)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("factor", WIDE_FACTORS)
@pytest.mark.parametrize("dtype", HALVES)
def test_widen_scaled(dtype, factor, n, portable):
    rng = np.random.default_rng([dtype, n, int(abs(factor) * 1000)])
    x = random_array(rng, dtype, n)
    got = widened_kernel(WIDEN, np.zeros(n, np.float32), x, dtype, factor=factor,
                         portable=portable)
    want = operand(x, dtype, factor)
    if factor == 1.0:
        # A NaN's payload here is the hardware's; only the narrowed result fixes it.
        np.testing.assert_array_equal(canonical32(got), canonical32(want))
    else:  # rounded to the dtype, so every NaN is canonical
        assert_same_bits(got, want)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("factor", [1.0, 0.5, 1 / 3, 0.7, 1.3])
@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("dtype", HALVES)
def test_reduce_widened_into(dtype, op, factor, n, portable):
    rng = np.random.default_rng([dtype, op, n, int(abs(factor) * 1000)])
    acc = random_array(rng, FLOAT32, n)
    x = random_array(rng, dtype, n)
    want = reference(acc, narrow(operand(x, dtype, factor), FLOAT32), FLOAT32, op)
    got = widened_kernel(REDUCE_WIDENED, acc, x, dtype, op, factor, portable)
    assert_same_bits(got, want)


@pytest.mark.parametrize("factor", [0.5, 1 / 3, 0.7, 1.3, -2.5, 1e-3, 1e5, 1e-30])
@pytest.mark.parametrize("dtype", HALVES)
def test_scaled_operand_is_scale_buffers_element_on_both_paths(dtype, factor):
    # Every 16-bit pattern (NaN payloads, infinities, subnormals, signed
    # zeros) prescaled: WidenScaled gives ScaleBuffer's element, widened, and
    # ReduceWidenedInto folds in that operand, on the portable path and on
    # this CPU's (F16C for float16 Sum and Product) alike, bit for bit.
    x = np.arange(1 << 16, dtype=np.uint16).view(STORAGE[dtype])
    want = widen(scale(x, dtype, factor), dtype)
    acc = random_array(np.random.default_rng([dtype, 46]), FLOAT32, x.size)
    for portable in [False, True]:
        got = widened_kernel(WIDEN, np.zeros(x.size, np.float32), x, dtype, factor=factor,
                             portable=portable)
        assert_same_bits(got, want)
        for op in ALL_OPS:
            folded = widened_kernel(REDUCE_WIDENED, acc, x, dtype, op, factor, portable)
            assert_same_bits(folded, reference(acc, want, FLOAT32, op))


@pytest.mark.parametrize("dtype", HALVES)
def test_prescaled_operands_round_to_the_dtype_before_the_sum(dtype):
    # Horovod scales each input in its dtype, then sums (issue 46). Three
    # operands whose products with 1/3 are not exact in the dtype: the sum
    # of the rounded products, rounded once, differs from the sum of the
    # float32 products in the last bit.
    f = np.float32(1 / 3)
    values = {FLOAT16: [1024.0, 1026.0, 1030.0], BFLOAT16: [128.0, 129.0, 131.0]}[dtype]
    xs = [narrow(np.array([v], np.float32), dtype) for v in values]
    acc = widened_kernel(WIDEN, np.zeros(1, np.float32), xs[0], dtype, factor=1 / 3)
    for x in xs[1:]:
        acc = widened_kernel(REDUCE_WIDENED, acc, x, dtype, factor=1 / 3)
    got = widened_kernel(NARROW, np.zeros(1, STORAGE[dtype]), acc, dtype)
    rounded = sum(widen(narrow(widen(x, dtype) * f, dtype), dtype) for x in xs)
    assert_same_bits(got, narrow(rounded, dtype))
    unrounded = sum(widen(x, dtype) * f for x in xs)
    assert narrow(unrounded, dtype).view(np.uint16)[0] != got.view(np.uint16)[0]


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("factor", WIDE_FACTORS)
@pytest.mark.parametrize("dtype", HALVES)
def test_narrow_scaled(dtype, factor, n, portable):
    rng = np.random.default_rng([dtype, n, int(abs(factor) * 1000), 7])
    acc = random_array(rng, FLOAT32, n)
    got = widened_kernel(NARROW, np.zeros(n, STORAGE[dtype]), acc, dtype, factor=factor,
                         portable=portable)
    assert_same_bits(got, narrow(times(acc, factor), dtype))


@pytest.mark.parametrize("dtype", HALVES)
def test_narrow_every_float32_exponent_and_tie(dtype):
    # Values just below, at and above each halfway point between two
    # neighbours of the half dtype, over the whole exponent range.
    kept = 10 if dtype == FLOAT16 else 7  # mantissa bits the dtype keeps
    exponents = np.arange(0, 255, dtype=np.uint32) << 23
    mantissas = np.array([0, 1, 3], dtype=np.uint32) << (22 - kept)
    bits = (exponents[:, None] | mantissas[None, :]).ravel()
    bits = np.concatenate([bits, bits - 1, bits + 1, bits | 0x80000000]).astype(np.uint32)
    acc = bits.view(np.float32)
    for portable in [False, True]:
        got = widened_kernel(NARROW, np.zeros(acc.size, STORAGE[dtype]), acc, dtype,
                             portable=portable)
        assert_same_bits(got, narrow(acc, dtype))


@pytest.mark.parametrize("dtype", HALVES)
def test_widened_sum_rounds_once_where_pairwise_rounds_twice(dtype):
    # Three operands exact in the dtype whose running sum is not: widened,
    # the sum is rounded once; ReduceInto rounds it after each step.
    one = 1024.0 if dtype == FLOAT16 else 128.0  # the spacing there is 1
    # (one + 1) + one is a tie, rounded down to 2 one; plus one + 1 another.
    values = [narrow(np.array([v], np.float32), dtype) for v in [one + 1, one, one + 1]]
    acc = widened_kernel(WIDEN, np.zeros(1, np.float32), values[0], dtype)
    for v in values[1:]:
        acc = widened_kernel(REDUCE_WIDENED, acc, v, dtype)
    once = widened_kernel(NARROW, np.zeros(1, STORAGE[dtype]), acc, dtype)
    assert_same_bits(once, narrow(np.array([3 * one + 2], np.float32), dtype))
    pairwise = reduce_into(reduce_into(values[0], values[1], dtype, SUM), values[2], dtype, SUM)
    assert pairwise.view(np.uint16)[0] != once.view(np.uint16)[0]
