"""Bad input: local misuse raises at the call; a cross-rank mismatch raises
MXNetError at read on every rank, and the next collective still works."""
import time

import mxnet as mx
import numpy as np
import pytest

import hvdmx as hvd
from conftest import restart
from helpers import restarted


def still_works():
    out = hvd.allreduce(mx.nd.ones((4,)), op=hvd.Sum)
    assert out.asnumpy().tolist() == [hvd.size()] * 4


@pytest.mark.parametrize("fn", [hvd.allreduce, hvd.allreduce_,
                                lambda t, **kw: hvd.broadcast(t, 0, **kw)])
def test_not_an_ndarray(fn):
    with pytest.raises(TypeError, match="'tensor' must be an mxnet.nd.NDArray, got list"):
        fn([1.0, 2.0])
    with pytest.raises(TypeError, match="ndarray"):
        fn(np.ones(3))


def test_sparse_ndarray():
    sparse = mx.nd.zeros((4, 2)).tostype("row_sparse")
    with pytest.raises(ValueError, match="sparse.*row_sparse.*tostype\\('default'\\)"):
        hvd.allreduce(sparse)
    with pytest.raises(ValueError, match="sparse"):
        hvd.broadcast(sparse, root_rank=0)


def test_unsupported_dtype():
    with pytest.raises(TypeError, match="dtype bool.*float32"):
        hvd.allreduce(mx.nd.zeros((3,), dtype="bool"))
    with pytest.raises(TypeError, match="dtype bool.*float32"):
        hvd.broadcast(mx.nd.zeros((3,), dtype="bool"), root_rank=0)


def test_root_rank_out_of_range():
    n = hvd.size()
    for bad in (-1, n, n + 5):
        with pytest.raises(ValueError, match=f"'root_rank'={bad} is out of range"):
            hvd.broadcast(mx.nd.ones((2,)), root_rank=bad)
    with pytest.raises(TypeError, match="'root_rank' must be an int"):
        hvd.broadcast(mx.nd.ones((2,)), root_rank=0.5)


def test_unknown_op():
    with pytest.raises(ValueError, match="'op'=42 is not a reduction op"):
        hvd.allreduce(mx.nd.ones((2,)), op=42)


def test_average_and_op_both_given():
    with pytest.raises(ValueError, match="'average' and 'op' were both given"):
        hvd.allreduce(mx.nd.ones((2,)), average=True, op=hvd.Sum)


def test_bad_name_priority_and_scale():
    with pytest.raises(TypeError, match="'name' must be a str"):
        hvd.allreduce(mx.nd.ones((2,)), name=3)
    with pytest.raises(TypeError, match="'priority' must be an int"):
        hvd.allreduce(mx.nd.ones((2,)), priority="high")
    with pytest.raises(TypeError, match="'prescale_factor' must be a real number"):
        hvd.allreduce(mx.nd.ones((2,)), prescale_factor="2")
    with pytest.raises(ValueError, match="'postscale_factor'=nan must be finite"):
        hvd.allreduce(mx.nd.ones((2,)), postscale_factor=float("nan"))


@pytest.mark.parametrize("name", [None, "in.place"])
def test_allreduce_in_place_refuses_like_allreduce(name):
    # A named allreduce_ lets the core check the tensor as it pushes (the
    # trainer's and kvstore's path); the errors are the same as unnamed.
    sparse = mx.nd.zeros((4, 2)).tostype("row_sparse")
    with pytest.raises(ValueError, match="argument 'tensor' is a sparse NDArray"):
        hvd.allreduce_(sparse, name=name)
    with pytest.raises(TypeError, match="argument 'tensor' has dtype bool"):
        hvd.allreduce_(mx.nd.zeros((3,), dtype="bool"), name=name)
    with pytest.raises(ValueError, match="'op'=42 is not a reduction op"):
        hvd.allreduce_(mx.nd.ones((2,)), op=42, name=name)
    with pytest.raises(TypeError, match="'priority' must be an int"):
        hvd.allreduce_(mx.nd.ones((2,)), priority="high", name=name)
    with pytest.raises(ValueError, match="'postscale_factor'=nan must be finite"):
        hvd.allreduce_(mx.nd.ones((2,)), postscale_factor=float("nan"), name=name)
    # Nothing was pushed or left pending: the same name works now.
    x = mx.nd.ones((3,))
    assert hvd.allreduce_(x, op=hvd.Sum, name=name) is x
    assert x.asnumpy().tolist() == [hvd.size()] * 3
    still_works()


def test_grouped_needs_a_list_of_distinct_arrays():
    with pytest.raises(TypeError, match="'tensors' must be a list"):
        hvd.grouped_allreduce(mx.nd.ones((2,)))
    with pytest.raises(TypeError, match="'tensors\\[1\\]' must be an mxnet.nd.NDArray"):
        hvd.grouped_allreduce([mx.nd.ones((2,)), 5])
    a = mx.nd.ones((2,))
    with pytest.raises(ValueError, match="appears twice"):
        hvd.grouped_allreduce_([a, a])


def test_same_name_calls_take_turns(world):
    # Note [Same-name calls in flight]: calls of one name that are in flight
    # together run one after the other, in the order they were called, on
    # every rank, whatever order the engine runs them in. Rank 0 is early
    # (its first call waits for the others meanwhile).
    rank, size = world
    if rank != 0:
        time.sleep(0.3)
    first = hvd.allreduce(mx.nd.ones((1,)) * (rank + 1), name="pending.name", op=hvd.Sum)
    second = hvd.allreduce(mx.nd.ones((1,)) * 10 * (rank + 1), name="pending.name", op=hvd.Sum)
    total = size * (size + 1) // 2
    assert second.asnumpy().tolist() == [10 * total]
    assert first.asnumpy().tolist() == [total]
    # Logging code: a broadcast and an allgather of one name every step,
    # read only at the end.
    steps = [(hvd.broadcast(mx.nd.full((2,), 100 * step + rank), root_rank=size - 1,
                            name="log.b"),
              hvd.allgather(mx.nd.full((rank + 1, 2), step * 10 + rank), name="log.g"))
             for step in range(4)]
    for step, (b, g) in enumerate(steps):
        assert b.asnumpy().tolist() == [100 * step + size - 1] * 2
        expect = [[step * 10 + r] * 2 for r in range(size) for _ in range(r + 1)]
        assert g.asnumpy().tolist() == expect
    # reusing the name for an op ordered after the first one is fine
    x = mx.nd.ones((3,))
    for _ in range(3):
        hvd.allreduce_(x, name="reused.name", op=hvd.Sum)
    assert x.asnumpy().tolist() == [size ** 3] * 3


def test_join_waits_for_same_name_calls_still_waiting_their_turn(world):
    # Calls waiting for their turn count as not yet submitted: join() must
    # not overtake them, or they would complete without this rank's data.
    rank, size = world
    outs = [hvd.allreduce(mx.nd.ones((2,)) * (rank + 1) * (k + 1), name="turns.join",
                          op=hvd.Sum) for k in range(3)]
    assert hvd.join() in range(size)
    total = size * (size + 1) // 2
    for k, out in enumerate(outs):
        assert out.asnumpy().tolist() == [total * (k + 1)] * 2


def test_same_name_calls_keep_call_order_when_the_engine_does_not(world):
    # The first call's input comes from a slow op, the second's is ready: the
    # engine runs the second first. Each result still belongs to its call.
    rank, size = world
    a = mx.nd.ones((300, 300))
    slow = mx.nd.dot(mx.nd.dot(mx.nd.dot(a, a), a), a)  # every entry 300**3
    first_in = slow[0, :4] / 300 ** 3 * (rank + 1)
    second_in = mx.nd.ones((4,)) * 1000 * (rank + 1)
    first = hvd.allreduce(first_in, name="order.name", op=hvd.Sum)
    second = hvd.allreduce(second_in, name="order.name", op=hvd.Sum)
    total = size * (size + 1) // 2
    assert second.asnumpy().tolist() == [1000 * total] * 4
    assert first.asnumpy().tolist() == [total] * 4


def test_gpu_context_without_cuda(monkeypatch):
    # A CPU build of MXNet cannot create a GPU array, so pretend one is: the
    # ops read an array's device, and the core's verdict on it, through
    # _core.describe.
    arr = mx.nd.ones((2,))
    describe = hvd.ops._core.describe

    def on_gpu(handle):
        dtype, stype, _, _, shape, _ = describe(handle)
        return dtype, stype, 2, 0, shape, hvd.ops._core.ARRAY_NEEDS_CUDA

    monkeypatch.setattr(hvd.ops._core, "describe", on_gpu)
    with pytest.raises(ValueError, match="gpu\\(0\\).*without CUDA"):
        hvd.allreduce(arr)


def mismatch(make, pattern):
    with pytest.raises(mx.base.MXNetError, match=pattern):
        make().wait_to_read()
    still_works()


def test_mismatched_shape(world):
    rank, size = world
    if size == 1:
        pytest.skip("a mismatch needs two ranks")
    mismatch(lambda: hvd.allreduce(mx.nd.ones((2 + rank,)), name="mm.shape"),
             "'mm.shape' was called with different shape.*rank 0 has \\(2,\\), rank 1 has \\(3,\\)")


def test_mismatched_dtype(world):
    rank, size = world
    if size == 1:
        pytest.skip("a mismatch needs two ranks")
    dtype = "float32" if rank == 0 else "float64"
    mismatch(lambda: hvd.allreduce(mx.nd.ones((2,), dtype=dtype), name="mm.dtype"),
             "different dtype.*rank 0 has float32, rank 1 has float64")


def test_mismatched_op(world):
    rank, size = world
    if size == 1:
        pytest.skip("a mismatch needs two ranks")
    op = hvd.Sum if rank == 0 else hvd.Max
    mismatch(lambda: hvd.allreduce(mx.nd.ones((2,)), op=op, name="mm.op"),
             "different op.*rank 0 has Sum, rank 1 has Max")


def test_mismatched_root(world):
    rank, size = world
    if size == 1:
        pytest.skip("a mismatch needs two ranks")
    root = 0 if rank == 0 else 1
    mismatch(lambda: hvd.broadcast(mx.nd.ones((2,)), root_rank=root, name="mm.root"),
             "different root_rank.*rank 0 has 0, rank 1 has 1")


def test_mismatched_scale_factors(world):
    rank, size = world
    if size == 1:
        pytest.skip("a mismatch needs two ranks")
    mismatch(lambda: hvd.allreduce(mx.nd.ones((2,)), prescale_factor=1.0 + rank, name="mm.pre"),
             "different prescale_factor.*rank 0 has 1, rank 1 has 2")
    mismatch(lambda: hvd.allreduce(mx.nd.ones((2,)), postscale_factor=1.0 + rank,
                                   name="mm.post"),
             "different postscale_factor")


def test_mismatched_collective(world):
    rank, size = world
    if size == 1:
        pytest.skip("a mismatch needs two ranks")
    x = mx.nd.ones((2,))
    mismatch(lambda: hvd.allreduce(x, name="mm.kind") if rank == 0
             else hvd.broadcast(x, root_rank=0, name="mm.kind"),
             "different collective.*rank 0 has allreduce, rank 1 has broadcast")


def test_mismatch_after_cached_success(world):
    # The same name succeeded (and was cached); a later call with another
    # shape on one rank must still be caught, on every rank.
    rank, size = world
    if size == 1:
        pytest.skip("a mismatch needs two ranks")
    for _ in range(3):
        hvd.allreduce(mx.nd.ones((3,)), name="mm.cached").wait_to_read()
    shape = (3,) if rank != size - 1 else (4,)
    mismatch(lambda: hvd.allreduce(mx.nd.ones(shape), name="mm.cached"), "different shape")
    hvd.allreduce(mx.nd.ones((3,)), name="mm.cached").wait_to_read()


@pytest.mark.parametrize("var, value_of_rank", [
    ("HVDMX_FUSION_MAX_TENSOR_BYTES", lambda r: str(1024 * (r + 1))),
    ("HOROVOD_FUSION_PIECE_BYTES", lambda r: str(65536 * (r + 1))),
    ("HOROVOD_FUSION_THRESHOLD", lambda r: "0" if r else "1048576"),
    ("HVDMX_ALLREDUCE_ALGO", lambda r: "ring" if r else "mpi"),
    ("HVDMX_CACHE_CAPACITY", lambda r: str(r)),
    ("HVDMX_SHM_PUSH", lambda r: "0" if r else "1"),
    ("HVDMX_HALF_PARTIALS", lambda r: "half" if r else "float32"),
    ("HVDMX_ADASUM_HIERARCHICAL", lambda r: "1" if r else "0"),
])
def test_settings_that_differ_between_ranks_are_refused_at_init(world, var, value_of_rank):
    rank, size = world
    if size == 1:
        pytest.skip("one rank cannot disagree with itself")
    twin = "HVDMX_" + var.split("_", 1)[1]
    with pytest.raises(ValueError) as info:
        restart({var: value_of_rank(rank)})
    # Every rank refuses, naming the variable and the values of rank 0 and
    # the first rank that differs (rank 1 here).
    assert str(info.value) == (
        f"hvdmx.init: {twin} differs between ranks (rank 0: {value_of_rank(0)}, rank 1: "
        f"{value_of_rank(1)}); "
        "every rank must run with the same value. Set it (or its HOROVOD_ twin) the same way "
        "for all ranks, e.g. with mpiexec -genv or an hvdmxrun flag, or not at all")
    assert not hvd.is_initialized()
    restart({})
    still_works()


def test_settings_that_may_differ_between_ranks(world):
    rank, size = world
    with restarted({"HVDMX_CYCLE_TIME": str(rank),
                    "HVDMX_STALL_CHECK_TIME_SECONDS": str(30 + rank)}):
        still_works()
