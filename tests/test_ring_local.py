"""The ring allreduce on the in-process communicator: any size, no MPI."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hvdmx import _core

CODES = {"float32": 0, "float64": 1, "float16": 2, "uint8": 3, "int32": 4, "int8": 5,
         "int64": 6}
SUM, MIN, MAX, PRODUCT = 1, 3, 4, 5


def inputs(size, count, dtype):
    i = np.arange(count)
    return [((i * 5 + r * 3) % 11).astype(dtype) for r in range(size)]


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
    _core._testing_ring_allreduce(arrays, CODES[dtype], op, segment)
    for a in arrays:
        assert np.array_equal(a, want)


@pytest.mark.parametrize("size", [2, 3, 4, 5])
def test_ring_product_small_values(size):
    i = np.arange(1000)
    arrays = [(1 + (i + r) % 2).astype(np.int32) for r in range(size)]
    want = reference(arrays, PRODUCT)
    _core._testing_ring_allreduce(arrays, CODES["int32"], PRODUCT, 24)
    for a in arrays:
        assert np.array_equal(a, want)


@pytest.mark.parametrize("size", [2, 3, 4, 6])
def test_ring_float_results_bitwise_identical_on_every_rank(size):
    # Non-integer floats: the sum depends on the order of additions, but every
    # rank must hold the same bits because each chunk is reduced once.
    rng = np.random.default_rng(size)
    arrays = [rng.standard_normal(10_001).astype(np.float32) for _ in range(size)]
    approx = np.sum([a.astype(np.float64) for a in arrays], axis=0)
    _core._testing_ring_allreduce(arrays, CODES["float32"], SUM, 256)
    for a in arrays[1:]:
        assert a.tobytes() == arrays[0].tobytes()
    np.testing.assert_allclose(arrays[0], approx, rtol=1e-4, atol=1e-5)
