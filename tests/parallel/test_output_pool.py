"""Outputs of 64 KiB and more come from hvdmx's output pool (Note [Output
pool] in csrc/hvdmx/platform/output_pool.h): memory is handed out again once the last
NDArray over it is gone, never while one is alive, and only up to
HVDMX_OUTPUT_POOL_BYTES is kept.
"""
import pickle
import time

import mxnet as mx
import numpy as np
import pytest

import hvdmx as hvd
import _hvdmx_testing
from hvdmx import _core
from conftest import all_equal_across_ranks, restart
from helpers import mxnet_address

ROWS = 64 * 1024  # float32 rows of 4 bytes per rank: 256 KiB, above the pool's minimum


def wait_for(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the dropped output never came back to the pool"
        time.sleep(0.001)


def pool():
    return _core.stats()["output_pool"]


def source(rank, rows, salt=0):
    return (np.arange(rows) * 3 + rank * 5 + salt) % 1009


def calls(rank, size):
    """(name, call, expected) for each out-of-place collective; `call(salt)`
    returns a new output of ROWS * size float32 (reducescatter: ROWS)."""
    n = ROWS * size

    def inp(salt, r=rank):
        return mx.nd.array(source(r, n, salt), dtype="float32")

    def reduced(salt):
        return sum(source(r, n, salt) for r in range(size)).astype(np.float32)

    def gathered(salt):
        return np.concatenate([source(r, n, salt)[:ROWS] for r in range(size)]).astype(np.float32)

    def exchanged(salt):
        return np.concatenate([source(r, n, salt)[rank * ROWS:(rank + 1) * ROWS]
                               for r in range(size)]).astype(np.float32)

    return [
        ("allreduce", lambda s: hvd.allreduce(inp(s), op=hvd.Sum, name=f"pool.ar.{s}"), reduced),
        ("broadcast", lambda s: hvd.broadcast(inp(s), root_rank=0, name=f"pool.bc.{s}"),
         lambda s: source(0, n, s).astype(np.float32)),
        ("allgather", lambda s: hvd.allgather(inp(s)[:ROWS], name=f"pool.ag.{s}"), gathered),
        ("alltoall", lambda s: hvd.alltoall(inp(s), name=f"pool.a2a.{s}"), exchanged),
        ("reducescatter",
         lambda s: hvd.reducescatter(mx.nd.array(np.tile(source(rank, ROWS, s), size),
                                                 dtype="float32"), op=hvd.Sum, name=f"pool.rs.{s}"),
         lambda s: sum(source(r, ROWS, s) for r in range(size)).astype(np.float32)),
    ]


@pytest.mark.parametrize("which", range(5))
def test_a_dropped_output_is_handed_out_again(world, which):
    rank, size = world
    name, call, want = calls(rank, size)[which]
    first = call(1)
    first.wait_to_read()
    where = mxnet_address(first)
    assert np.array_equal(first.asnumpy(), want(1)), name
    before = pool()
    del first  # back at once: see the next test
    assert pool()["kept_blocks"] > before["kept_blocks"]
    second = call(2)
    got = second.asnumpy()
    assert mxnet_address(second) == where, f"{name}: the dropped output's block was not reused"
    assert pool()["reused"] > before["reused"]
    assert np.array_equal(got, want(2)), name
    if name in ("allreduce", "broadcast", "allgather"):  # the same result everywhere
        assert all_equal_across_ranks(got)


@pytest.mark.parametrize("which", range(5))
def test_a_read_output_goes_back_as_soon_as_it_is_dropped(world, which):
    """hvdmx lets go of an output before the reader wakes (Note [Letting go
    before completing] in mxnet_engine.cc), so a loop that reads and drops
    its output finds the block back at once and never needs a second one.
    When the op's own copy went last, 298-300 of 300 allreduces found it
    still held at -n 2..4; 100 calls a run keep that far from zero."""
    rank, size = world
    name, call, want = calls(rank, size)[which]
    call(0).wait_to_read()
    mapped = pool()["mapped"]
    wants = [want(0), want(1)]
    held = 0
    calls_made = 100
    for salt in range(calls_made):
        out = call(salt % 2)
        assert np.array_equal(out.asnumpy(), wants[salt % 2]), f"{name}, call {salt}"
        kept = pool()["kept_blocks"]
        del out
        held += pool()["kept_blocks"] <= kept
    assert held == 0, f"{name}: {held} of {calls_made} dropped outputs were still held"
    assert pool()["mapped"] == mapped, f"{name}: the loop needed more than one block"


@pytest.mark.parametrize("which", range(5))
def test_a_live_output_is_never_handed_out(world, which):
    rank, size = world
    name, call, want = calls(rank, size)[which]
    alive = [call(salt) for salt in range(4)]
    pointers = {mxnet_address(a) for a in alive}
    assert len(pointers) == 4, f"{name}: two live outputs share memory"
    for salt, a in enumerate(alive):
        assert np.array_equal(a.asnumpy(), want(salt)), name


def test_views_and_pending_readers_keep_the_block(world):
    rank, size = world
    name, call, want = calls(rank, size)[2]  # allgather
    out = call(1)
    view = out[ROWS // 2:]  # shares out's memory
    doubled = out * 2       # an engine op that reads out, perhaps not run yet
    del out
    later = [call(salt) for salt in (2, 3)]
    assert np.array_equal(view.asnumpy(), want(1)[ROWS // 2:])
    assert np.array_equal(doubled.asnumpy(), want(1) * 2)
    for salt, a in zip((2, 3), later):
        assert np.array_equal(a.asnumpy(), want(salt))


def test_small_outputs_and_every_dtype(world):
    rank, size = world
    small = hvd.allgather(mx.nd.ones((4,)), name="pool.small")
    small.wait_to_read()
    before = pool()
    again = hvd.allgather(mx.nd.ones((4,)), name="pool.small")
    assert again.asnumpy().tolist() == [1.0] * 4 * size
    after = pool()
    assert (after["reused"], after["mapped"]) == (before["reused"], before["mapped"]), \
        "an output below the pool's minimum came from the pool"
    for dtype in ["float32", "float64", "float16", "uint8", "int8", "int32", "int64"]:
        rows = pool()["min_bytes"] // np.dtype(dtype).itemsize
        mine = (np.arange(rows) % 50 + rank).astype(dtype)
        got = hvd.allgather(mx.nd.array(mine, dtype=dtype), name=f"pool.{dtype}")
        assert got.dtype == np.dtype(dtype)
        want = np.concatenate([(np.arange(rows) % 50 + r).astype(dtype) for r in range(size)])
        assert np.array_equal(got.asnumpy(), want), dtype
    out = hvd.allgather(mx.np.array(np.ones(ROWS, dtype="float32")), name="pool.np")
    assert isinstance(out, mx.np.ndarray)
    assert out.asnumpy().sum() == ROWS * size


def test_the_limit_bounds_what_is_kept(world):
    rank, size = world
    block = _hvdmx_testing.output_pool_class(ROWS * 4 * size)
    restart({"HVDMX_OUTPUT_POOL_BYTES": str(2 * block)})
    try:
        assert pool()["limit"] == 2 * block
        outs = [hvd.allgather(mx.nd.ones((ROWS,)), name=f"pool.limit.{i}") for i in range(5)]
        mx.nd.waitall()
        del outs
        assert pool()["kept_bytes"] <= 2 * block
        restart({"HVDMX_OUTPUT_POOL_BYTES": "0"})
        assert pool()["kept_bytes"] == 0, "setting the limit to 0 kept blocks"
        before = pool()
        out = hvd.allgather(mx.nd.ones((ROWS,)), name="pool.off")
        assert out.asnumpy().sum() == ROWS * size
        assert pool()["mapped"] == before["mapped"] and pool()["reused"] == before["reused"], \
            "HVDMX_OUTPUT_POOL_BYTES=0 still served an output from the pool"
    finally:
        restart({})
    assert pool()["limit"] == 256 << 20


def test_size_classes():
    page = 4096
    for n in [1, page, page + 1, 65536, 65537, 100_000, 1 << 20, (1 << 20) + 1, 3 << 20,
              (64 << 20) - 1, 64 << 20, 1 << 30]:
        c = _hvdmx_testing.output_pool_class(n)
        assert c >= n and c % page == 0, n
        assert c - n <= max(page, n // 8), f"{n} bytes get a block of {c}"
    assert _hvdmx_testing.output_pool_class(64 << 20) == 64 << 20


def test_pooled_outputs_behave_as_mxnet_arrays(world, tmp_path):
    # A pooled output is an NDArray over memory MXNet did not allocate: it must
    # survive what MXNet does to arrays, oneDNN's weight reorder included, and
    # its memory must go back to the pool (not to MXNet's allocator) after.
    rank, size = world
    w = mx.nd.array(source(0, 64 * 32 * 9).reshape(64, 32, 3, 3) / 1009, dtype="float32")
    weight = hvd.broadcast(w, root_rank=0, name="pool.weight")  # 73,728 bytes: pooled
    x = mx.nd.array(source(rank, 2 * 32 * 64).reshape(2, 32, 8, 8) / 1009, dtype="float32")
    want = mx.nd.Convolution(x, w, no_bias=True, kernel=(3, 3), num_filter=64).asnumpy()
    with mx.autograd.predict_mode():
        for _ in range(2):
            got = mx.nd.Convolution(x, weight, no_bias=True, kernel=(3, 3), num_filter=64)
            assert np.array_equal(got.asnumpy(), want)
    out = hvd.allgather(mx.nd.ones((ROWS // 4, 4)), name="pool.misc")
    out += 1
    assert pickle.loads(pickle.dumps(out)).asnumpy().sum() == 2 * ROWS * size
    mx.nd.save(str(tmp_path / "out.nd"), [out])
    assert mx.nd.load(str(tmp_path / "out.nd"))[0].asnumpy().sum() == 2 * ROWS * size
    out.attach_grad()
    with mx.autograd.record():
        loss = (out * 3).sum()
    loss.backward()
    assert out.grad.asnumpy().min() == 3
    before = pool()["kept_blocks"]
    del weight, out, got
    mx.nd.waitall()
    wait_for(lambda: pool()["kept_blocks"] >= before + 2)


def test_a_forked_child_leaves_the_parents_outputs_alone(world):
    # With two or more ranks on a host, new outputs are cut from a shared
    # file (Note [Outputs in shared memory]), whose pages a forked child
    # shares instead of copying. A child that drops its copy of an output
    # and trims the pool must neither give those pages back to the kernel
    # nor keep the block for itself: the parent's bytes stay.
    rank, size = world
    shared, intact = _hvdmx_testing.output_pool_forked_child_drops(1 << 20)
    assert shared == (size > 1)
    assert intact
