"""join, barrier, broadcast_object and allgather_object."""
import threading

import mxnet as mx
import numpy as np
import pytest


import hvdmx as hvd
from conftest import world_allgather
from helpers import scaled


def test_join_with_uneven_batches(world):
    rank, size = world
    outs = []
    for step in range(rank + 1):  # rank r has r + 1 batches
        x = mx.nd.array(np.full((5,), step + 1, dtype=np.float32))
        outs.append(hvd.allreduce(x, op=hvd.Sum, name=f"join.{step}"))
    if outs:
        # Rank r's last allreduce can finish only once the ranks with fewer
        # batches have joined, so waiting for it orders the joins by rank.
        outs[-1].wait_to_read()
    last = hvd.join()
    assert last == size - 1
    for step, out in enumerate(outs):
        ranks_with_data = sum(1 for r in range(size) if r + 1 > step)
        assert out.asnumpy().tolist() == [ranks_with_data * (step + 1)] * 5
    # After every rank has joined, collectives are normal again.
    out = hvd.allreduce(mx.nd.ones((2,)), op=hvd.Average, name="join.after")
    assert out.asnumpy().tolist() == [1.0, 1.0]


def test_join_average_divides_by_size(world):
    rank, size = world
    out = None
    if rank != 0:
        out = hvd.allreduce(mx.nd.full((3,), size, dtype="float32"), name="join.avg")
    hvd.join()
    if out is not None:
        # (size - 1) ranks' size each, times 1/size in float32: inexact at 7.
        assert np.array_equal(out.asnumpy(), scaled(np.full(3, size * (size - 1.0)), "float32",
                                                    1 / size))


def test_join_waits_for_collectives_still_in_the_engine(world):
    # The last rank's allreduce waits inside MXNet's engine for a slow input
    # while that rank calls join(); the allreduce must still count its data.
    rank, size = world
    x = mx.nd.full((3,), rank + 1, dtype="float32")
    if rank == size - 1:
        big = mx.nd.ones((1200, 1200))
        for _ in range(3):
            big = mx.nd.dot(big, big) / 1200
        x = x + (big.sum() * 0).reshape((1,))  # same value, ready only after the dots
    out = hvd.allreduce(x, op=hvd.Sum, name="join.slow_input")
    assert hvd.join() >= 0
    assert out.asnumpy().tolist() == [size * (size + 1) / 2] * 3


def test_other_collectives_fail_while_a_rank_has_joined(world):
    rank, size = world
    if size == 1:
        pytest.skip("needs a rank that joins and one that does not")
    if rank == 0:
        assert hvd.join() != 0
    else:
        out = hvd.broadcast(mx.nd.ones((2,)), root_rank=1, name="join.bcast")
        with pytest.raises(mx.base.MXNetError, match="rank\\(s\\) 0 have called join"):
            out.wait_to_read()
        hvd.join()
    assert hvd.allreduce(mx.nd.ones((1,)), op=hvd.Sum).asscalar() == size


def test_join_repeatedly(world):
    rank, size = world
    for epoch in range(3):
        for step in range((rank + epoch) % size + 1):
            hvd.allreduce(mx.nd.ones((1,)), name=f"join.rep.{step}").wait_to_read()
        last = hvd.join()
        assert 0 <= last < size
        assert world_allgather(last) == [last] * size  # every rank hears the same


def test_barrier(world):
    rank, size = world
    for _ in range(5):
        assert hvd.barrier() is None
    pending = hvd.allreduce(mx.nd.ones((1,)), op=hvd.Sum)
    hvd.barrier()
    assert pending.asscalar() == size


OBJECTS = [{"a": 1, "b": [1, 2, {"c": "d"}]}, np.arange(12).reshape(3, 4), [[1, [2, [3]]], ()],
           "text", None]


def test_broadcast_object_every_root(world):
    rank, size = world
    for root in range(size):
        for i, obj in enumerate(OBJECTS):
            mine = (obj, rank) if rank == root else ("not", rank)
            got = hvd.broadcast_object(mine, root_rank=root, name=f"bo.{root}.{i}")
            assert got[1] == root
            if isinstance(obj, np.ndarray):
                assert np.array_equal(got[0], obj)
            else:
                assert got[0] == obj


def test_allgather_object(world):
    rank, size = world
    got = hvd.allgather_object({"rank": rank, "data": list(range(rank))})
    assert got == [{"rank": r, "data": list(range(r))} for r in range(size)]
    arrays = hvd.allgather_object(np.full((rank + 1,), rank))
    assert all(np.array_equal(a, np.full((r + 1,), r)) for r, a in enumerate(arrays))


def test_functions_travel_by_value(world):
    # cloudpickle, as in Horovod: a lambda, a closure over this rank's
    # values and a class defined here, none of which plain pickle takes.
    rank, size = world

    class Point:
        def __init__(self, x):
            self.x = x

    offset = 10 * rank
    for root in range(size):
        got = hvd.broadcast_object((lambda v: v + offset, Point(rank)), root_rank=root,
                                   name=f"fn.{root}")
        assert got[0](1) == 10 * root + 1
        assert got[1].x == root and type(got[1]).__name__ == "Point"
    scales = hvd.allgather_object(lambda v: v * (rank + 1))
    assert [f(2) for f in scales] == [2 * (r + 1) for r in range(size)]


def test_object_bad_input():
    with pytest.raises(ValueError, match="'root_rank'=-1 is out of range"):
        hvd.broadcast_object(1, root_rank=-1)
    with pytest.raises(TypeError, match="'name' must be a str"):
        hvd.allgather_object(1, name=3)


def test_an_object_that_cannot_be_pickled_fails_every_rank(world):
    # A lock cannot be pickled. The rank holding it raises TypeError; its
    # peers, instead of waiting for bytes that never come, raise ValueError
    # naming it. The job goes on.
    rank, size = world
    lock = threading.Lock()
    for root in range(size):
        if rank == root:
            with pytest.raises(TypeError, match="argument 'obj' cannot be pickled.*_thread.lock"):
                hvd.broadcast_object(lock, root_rank=root, name=f"unpicklable.{root}")
        else:
            with pytest.raises(ValueError, match=f"the root, rank {root}, could not pickle"):
                hvd.broadcast_object(lock, root_rank=root, name=f"unpicklable.{root}")
    for bad in range(size):
        if rank == bad:
            with pytest.raises(TypeError, match="argument 'obj' cannot be pickled"):
                hvd.allgather_object(lock)
        else:
            with pytest.raises(ValueError, match=rf"rank\(s\) \[{bad}\] could not pickle"):
                hvd.allgather_object({"rank": rank})
    assert hvd.allgather_object(rank) == list(range(size))
    assert hvd.broadcast_object(("after", rank), root_rank=size - 1) == ("after", size - 1)
