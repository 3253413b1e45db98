import mxnet as mx
import numpy as np
import pytest

import hvdmx as hvd
from conftest import all_equal_across_ranks
from helpers import DTYPES, counts_for, rank_input

# Each test runs over shared memory and over MPI (conftest.transport).
pytestmark = pytest.mark.usefixtures("transport")


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_every_root_dtype_and_count(world, dtype):
    rank, size = world
    for root in range(size):
        for count in counts_for(size):
            x = mx.nd.array(rank_input(rank, count, dtype, hvd.Sum), dtype=dtype)
            out = hvd.broadcast(x, root_rank=root, name=f"b.{dtype}.{root}.{count}")
            want = rank_input(root, count, dtype, hvd.Sum)
            got = out.asnumpy()
            assert got.dtype == want.dtype and np.array_equal(got, want)
            assert all_equal_across_ranks(got)
            # out of place: the input is untouched
            assert np.array_equal(x.asnumpy(), rank_input(rank, count, dtype, hvd.Sum))


def test_broadcast_in_place_every_root(world):
    rank, size = world
    for root in range(size):
        x = mx.nd.array(rank_input(rank, 3 * size + 1, "float32", hvd.Sum).reshape(-1, 1))
        same = hvd.broadcast_(x, root_rank=root)
        assert same is x
        want = rank_input(root, 3 * size + 1, "float32", hvd.Sum).reshape(-1, 1)
        assert np.array_equal(x.asnumpy(), want)


def test_broadcast_0d(world):
    rank, size = world
    x = mx.nd.array(np.array(rank + 7, dtype=np.int32).reshape(()), dtype="int32")
    out = hvd.broadcast(x, root_rank=size - 1)
    assert out.shape == () and out.asscalar() == size - 1 + 7
