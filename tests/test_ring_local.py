"""The ring allreduce on the in-process communicator: any size, no MPI."""
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import _hvdmx_testing

from core_codes import DTYPE_CODES, REDUCE_OPS
from rank_data import mixed
CODES = {name: code for name, code in DTYPE_CODES.items() if name != "bfloat16"}
SUM, MIN, MAX, PRODUCT = (REDUCE_OPS[name] for name in ("Sum", "Min", "Max", "Product"))


def inputs(size, count, dtype):
    return [mixed(r, count).astype(dtype) for r in range(size)]


def reference(arrays, op):
    stacked = np.stack([a.astype(np.float64) for a in arrays])
    fn = {SUM: np.sum, MIN: np.min, MAX: np.max, PRODUCT: np.prod}[op]
    return fn(stacked, axis=0).astype(arrays[0].dtype)


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 7), count=st.integers(0, 300),
       segment=st.sampled_from([1, 2, 3, 8, 64, 1 << 20]),
       dtype=st.sampled_from(sorted(CODES)), op=st.sampled_from([SUM, MIN, MAX]))
def test_ring_matches_reference(size, count, segment, dtype, op):
    arrays = inputs(size, count, dtype)
    want = reference(arrays, op)
    _hvdmx_testing.ring_allreduce(arrays, CODES[dtype], op, segment)
    for a in arrays:
        assert np.array_equal(a, want)


@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_ring_product_small_values(size):
    arrays = [(1 + mixed(r, 1000, modulus=2)).astype(np.int32) for r in range(size)]
    want = reference(arrays, PRODUCT)
    _hvdmx_testing.ring_allreduce(arrays, CODES["int32"], PRODUCT, 24)
    for a in arrays:
        assert np.array_equal(a, want)


@pytest.mark.parametrize("size", [2, 3, 4, 6])
def test_ring_float_results_bitwise_identical_on_every_rank(size):
    # Non-integer floats: the sum depends on the order of additions, but every
    # rank must hold the same bits because each chunk is reduced once.
    rng = np.random.default_rng(size)
    arrays = [rng.standard_normal(10_001).astype(np.float32) for _ in range(size)]
    approx = np.sum([a.astype(np.float64) for a in arrays], axis=0)
    _hvdmx_testing.ring_allreduce(arrays, CODES["float32"], SUM, 256)
    for a in arrays[1:]:
        assert a.tobytes() == arrays[0].tobytes()
    np.testing.assert_allclose(arrays[0], approx, rtol=1e-4, atol=1e-5)


# float16 and bfloat16 with float32 partials (RingAllreduceWidened): the
# result is the float32 reduction rounded once. Inputs in [1024, 2048) for
# float16 and [128, 256) for bfloat16 are exact in the dtype, their sums are
# not, and their float32 sums are exact in any order.
HALF_CODES = {name: DTYPE_CODES[name] for name in ("float16", "bfloat16")}


def half_inputs(size, count, dtype, op):
    i = np.arange(count)
    if op == PRODUCT:
        values = [(1 + (i + r) % 2).astype(np.float32) for r in range(size)]
    else:
        top = 1024 if dtype == "float16" else 128
        values = [(top + (i * 37 + r * 101) % top).astype(np.float32) for r in range(size)]
    return values, [to_half(v, dtype) for v in values]


def to_half(x, dtype):
    """float32 to the dtype's storage, rounded to nearest-even (bfloat16 as bits)."""
    if dtype == "float16":
        return x.astype(np.float16)
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def prescaled(x, factor, dtype):
    """float32 x times the prescale as the core takes it (issue 46): scaled in
    float32, rounded to the dtype, widened back."""
    if factor == 1.0:
        return x
    half = to_half(x * np.float32(factor), dtype)
    if dtype == "float16":
        return half.astype(np.float32)
    return (half.astype(np.uint32) << 16).view(np.float32)


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 7), count=st.integers(0, 300),
       segment=st.sampled_from([4, 8, 12, 64, 1 << 20]),
       dtype=st.sampled_from(sorted(HALF_CODES)), op=st.sampled_from([SUM, MIN, MAX, PRODUCT]),
       scales=st.sampled_from([(1.0, 1.0), (0.5, 3.0), (2.0, 0.25), (1 / 3, 1.0), (0.7, 3.0),
                               (1.3, 0.1)]))
def test_widened_ring_rounds_once(size, count, segment, dtype, op, scales):
    pre, post = scales
    # A product of inexact operands depends on the ring's order: powers of two only.
    assume(op != PRODUCT or pre in (0.5, 1.0, 2.0))
    wide, arrays = half_inputs(size, count, dtype, op)
    scaled = [prescaled(w, pre, dtype) for w in wide]
    fn = {SUM: np.sum, MIN: np.min, MAX: np.max, PRODUCT: np.prod}[op]
    reduced = fn(np.stack(scaled), axis=0).astype(np.float32) if count else np.zeros(0, np.float32)
    want = to_half(reduced * np.float32(post), dtype)
    _hvdmx_testing.ring_allreduce_widened(arrays, HALF_CODES[dtype], op, segment, prescale=pre,
                                          postscale=post)
    for a in arrays:
        assert a.tobytes() == want.tobytes()


@pytest.mark.parametrize("size", [3, 4, 5])
def test_widened_ring_differs_from_the_half_ring(size):
    # The same inputs through the ring in float16 round at every step.
    _, arrays = half_inputs(size, 1001, "float16", SUM)
    pairwise = [a.copy() for a in arrays]
    _hvdmx_testing.ring_allreduce_widened(arrays, HALF_CODES["float16"], SUM, 64)
    _hvdmx_testing.ring_allreduce(pairwise, HALF_CODES["float16"], SUM, 64)
    assert not np.array_equal(arrays[0], pairwise[0])
    want = np.sum([a.astype(np.float32) for a in half_inputs(size, 1001, "float16", SUM)[1]],
                  axis=0).astype(np.float16)
    assert np.array_equal(arrays[0], want)
