"""allgather, grouped_allgather, alltoall, reducescatter and
grouped_reducescatter: exact results for every dtype, ragged first
dimensions (0 rows on some ranks included) and every size."""
import mxnet as mx
import numpy as np
import pytest

import hvdmx as hvd
from hvdmx import _core
from conftest import all_equal_across_ranks, restart
from helpers import (DTYPES, expected, half_expected, half_input, hashed_half_expected,
                     hashed_half_input, mixed, my_rows, rank_input)

# Each test runs over shared memory and over MPI (conftest.transport).
pytestmark = pytest.mark.usefixtures("transport")

TRAILING = [(), (3,), (2, 2)]


def rows_of(rank, k):
    """Rows rank `rank` contributes in variant k: 0 on some ranks."""
    return (rank * 2 + k) % 3


def block(rank, rows, trailing, dtype):
    count = rows * int(np.prod(trailing, dtype=np.int64))
    return rank_input(rank, count, dtype, hvd.Sum).reshape((rows,) + trailing)


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_ragged_rows(world, dtype):
    rank, size = world
    for trailing in TRAILING:
        for k in range(3):
            x = mx.nd.array(block(rank, rows_of(rank, k), trailing, dtype), dtype=dtype)
            out = hvd.allgather(x, name=f"ag.{dtype}.{trailing}.{k}")
            want = np.concatenate([block(r, rows_of(r, k), trailing, dtype) for r in range(size)])
            got = out.asnumpy()
            assert got.dtype == want.dtype and got.shape == want.shape
            assert np.array_equal(got, want)
            assert all_equal_across_ranks(got)


def test_allgather_large_and_unnamed(world):
    rank, size = world
    rows = 70_001 + rank
    x = mx.nd.array(block(rank, rows, (3,), "float32"))
    got = hvd.allgather(x).asnumpy()
    want = np.concatenate([block(r, 70_001 + r, (3,), "float32") for r in range(size)])
    assert np.array_equal(got, want)


def test_allgather_repeats_hit_the_cache_and_stay_right(world):
    # The same name again and again, its sizes changing every other call.
    rank, size = world
    for step in range(6):
        rows = rank + step % 2
        x = mx.nd.array(block(rank + step, rows, (2,), "int32"), dtype="int32")
        got = hvd.allgather(x, name="ag.repeat").asnumpy()
        want = np.concatenate([block(r + step, r + step % 2, (2,), "int32")
                               for r in range(size)])
        assert np.array_equal(got, want)


def test_grouped_allgather_mixed(world):
    rank, size = world
    xs = [mx.nd.array(block(rank, rows_of(rank, 1), (2,), "float32")),
          mx.nd.array(block(rank + 1, rank + 1, (), "int64"), dtype="int64"),
          mx.nd.array(block(rank + 2, rows_of(rank, 2), (2, 2), "float16"), dtype="float16")]
    outs = hvd.grouped_allgather(xs, name="gag")
    wants = [np.concatenate([block(r, rows_of(r, 1), (2,), "float32") for r in range(size)]),
             np.concatenate([block(r + 1, r + 1, (), "int64") for r in range(size)]),
             np.concatenate([block(r + 2, rows_of(r, 2), (2, 2), "float16")
                             for r in range(size)])]
    for out, want in zip(outs, wants):
        assert np.array_equal(out.asnumpy(), want) and out.dtype == want.dtype
    assert hvd.grouped_allgather([]) == []


def test_grouped_allgather_above_the_fusion_threshold_skips_the_buffer(world, transport):
    # Groups above the threshold travel a tensor at a time, straight into
    # their outputs: the fusion buffer is never grown to the group's size.
    rank, size = world
    restart({"HVDMX_ALLREDUCE_ALGO": transport, "HVDMX_FUSION_THRESHOLD": "256"})
    try:
        def group(rows, step):
            return [block(rank + step, rows + rank % 2, (), "float32"),
                    block(rank + step + 1, rank % 3, (2,), "int32")]

        def wants(rows, step):
            return [np.concatenate([block(r + step, rows + r % 2, (), "float32")
                                    for r in range(size)]),
                    np.concatenate([block(r + step + 1, r % 3, (2,), "int32")
                                    for r in range(size)])]

        for step, rows in enumerate([100, 1000, 70]):
            xs = [mx.nd.array(x, dtype=x.dtype) for x in group(rows, step)]
            outs = hvd.grouped_allgather(xs, name=f"gag.big.{rows}")
            for out, want in zip(outs, wants(rows, step)):
                assert np.array_equal(out.asnumpy(), want) and out.dtype == want.dtype
        assert _core.stats()["fusion_buffer_bytes"] == 0
        # A group of at most 256 bytes still goes through the buffer (one page).
        xs = [mx.nd.array(x, dtype=x.dtype) for x in group(1, 9)]
        outs = hvd.grouped_allgather(xs, name="gag.small")
        for out, want in zip(outs, wants(1, 9)):
            assert np.array_equal(out.asnumpy(), want)
        assert _core.stats()["fusion_buffer_bytes"] == 4096
    finally:
        restart({"HVDMX_ALLREDUCE_ALGO": transport})


def test_grouped_allgather_moves_large_tensors_alone(world, transport):
    # Tensors of more than HVDMX_FUSION_MAX_TENSOR_BYTES of output skip the
    # fusion buffer; the small ones of the same group are still packed.
    rank, size = world
    restart({"HVDMX_ALLREDUCE_ALGO": transport, "HVDMX_FUSION_MAX_TENSOR_BYTES": "1024"})
    try:
        def parts(r):
            return [block(r, 1 + r % 2, (), "float32"),            # packed
                    block(r + 1, 2000 + r, (), "float32"),         # 8 KB a rank: alone
                    block(r + 2, r % 3, (2,), "int32"),            # packed (0 rows on rank 0)
                    block(r + 3, 300 - r, (), "float64")]          # 2.4 KB a rank: alone
        for step in range(2):
            xs = [mx.nd.array(x, dtype=x.dtype) for x in parts(rank)]
            outs = hvd.grouped_allgather(xs, name=f"gag.mixed.{step}")
            wants = [np.concatenate(p) for p in zip(*[parts(r) for r in range(size)])]
            for out, want in zip(outs, wants):
                assert np.array_equal(out.asnumpy(), want) and out.dtype == want.dtype
                assert all_equal_across_ranks(out.asnumpy())
        # Only the two small tensors (a few bytes a rank) used the buffer: one page.
        assert _core.stats()["fusion_buffer_bytes"] == 4096
    finally:
        restart({"HVDMX_ALLREDUCE_ALGO": transport})


def alltoall_splits(size, src):
    """Rows rank `src` sends to each rank (0 for some pairs)."""
    return [(src + 2 * dst) % 3 for dst in range(size)]


def alltoall_rows(src, dst, rows, trailing, dtype):
    count = rows * int(np.prod(trailing, dtype=np.int64))
    values = mixed(src, count, salt=dst, modulus=13)
    return values.astype(dtype).reshape((rows,) + trailing)


@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall_with_splits(world, dtype):
    rank, size = world
    for trailing in [(), (3,)]:
        splits = alltoall_splits(size, rank)
        x = np.concatenate([alltoall_rows(rank, d, splits[d], trailing, dtype)
                            for d in range(size)])
        out, received = hvd.alltoall(mx.nd.array(x, dtype=dtype), splits=splits,
                                     name=f"a2a.{dtype}.{trailing}")
        want = np.concatenate([alltoall_rows(s, rank, alltoall_splits(size, s)[rank], trailing,
                                             dtype) for s in range(size)])
        assert np.array_equal(out.asnumpy(), want) and out.dtype == want.dtype
        assert received.dtype == np.int32
        assert received.asnumpy().tolist() == [alltoall_splits(size, s)[rank]
                                               for s in range(size)]


def test_alltoall_received_splits_is_a_plain_cpu_array(world):
    # Written by hvdmx's core at the call, not by an MXNet op: it must still
    # behave as any NDArray (read, computed on, overwritten, empty).
    rank, size = world
    splits = alltoall_splits(size, rank)
    x = np.concatenate([alltoall_rows(rank, d, splits[d], (), "float32") for d in range(size)])
    _, received = hvd.alltoall(mx.nd.array(x), splits=splits, name="a2a.received")
    want = [alltoall_splits(size, s)[rank] for s in range(size)]
    assert isinstance(received, mx.nd.NDArray) and received.context == mx.cpu()
    assert received.shape == (size,)
    assert (received * 2).asnumpy().tolist() == [2 * w for w in want]
    received[:] = 7
    assert received.asnumpy().tolist() == [7] * size
    empty = mx.nd.NDArray(mx.base.NDArrayHandle(_core.new_int32_array([])))
    assert empty.shape == (0,) and empty.dtype == np.int32
    with pytest.raises(ValueError, match="2147483648 does not fit an int32"):
        _core.new_int32_array([1, 2 ** 31])


@pytest.mark.parametrize("splits_type", ["list", "numpy", "ndarray"])
def test_alltoall_splits_types(world, splits_type):
    rank, size = world
    splits = alltoall_splits(size, rank)
    given = {"list": splits, "numpy": np.array(splits, dtype=np.int64),
             "ndarray": mx.nd.array(splits, dtype="int32")}[splits_type]
    x = np.concatenate([alltoall_rows(rank, d, splits[d], (2,), "float32") for d in range(size)])
    out, received = hvd.alltoall(mx.nd.array(x), splits=given)
    want = np.concatenate([alltoall_rows(s, rank, alltoall_splits(size, s)[rank], (2,),
                                         "float32") for s in range(size)])
    assert np.array_equal(out.asnumpy(), want)


def test_alltoall_equal_split(world):
    rank, size = world
    x = np.concatenate([alltoall_rows(rank, d, 3, (2,), "int32") for d in range(size)])
    out = hvd.alltoall(mx.nd.array(x, dtype="int32"))
    assert isinstance(out, mx.nd.NDArray)
    want = np.concatenate([alltoall_rows(s, rank, 3, (2,), "int32") for s in range(size)])
    assert np.array_equal(out.asnumpy(), want)


def test_alltoall_large(world):
    rank, size = world
    splits = [50_000 + d for d in range(size)]
    x = np.concatenate([alltoall_rows(rank, d, splits[d], (4,), "float32") for d in range(size)])
    out, _ = hvd.alltoall(mx.nd.array(x), splits=splits)
    want = np.concatenate([alltoall_rows(s, rank, 50_000 + rank, (4,), "float32")
                           for s in range(size)])
    assert np.array_equal(out.asnumpy(), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reducescatter_every_dtype_and_size(world, dtype):
    rank, size = world
    for op in (hvd.Sum, hvd.Average):
        for dim0 in sorted({1, max(size - 1, 1), size + 1, 2 * size + 3}):
            x = rank_input(rank, dim0 * 2, dtype, op).reshape(dim0, 2)
            out = hvd.reducescatter(mx.nd.array(x, dtype=dtype), op=op,
                                    name=f"rs.{dtype}.{op}.{dim0}")
            start, end = my_rows(dim0, size, rank)
            want = expected(size, dim0 * 2, dtype, op).reshape(dim0, 2)[start:end]
            got = out.asnumpy()
            assert got.dtype == want.dtype and got.shape == want.shape
            assert np.array_equal(got, want), (op, dim0)


def test_reducescatter_scale_factors_and_large(world):
    rank, size = world
    dim0 = 40_003
    x = rank_input(rank, dim0 * 3, "float64", hvd.Sum).reshape(dim0, 3)
    out = hvd.reducescatter(mx.nd.array(x, dtype="float64"), op=hvd.Sum, prescale_factor=2.0,
                            postscale_factor=0.5)
    start, end = my_rows(dim0, size, rank)
    want = expected(size, dim0 * 3, "float64", hvd.Sum, 2.0, 0.5).reshape(dim0, 3)[start:end]
    assert np.array_equal(out.asnumpy(), want)


def test_reducescatter_sums_half_in_float32_and_rounds_once(world, transport):
    # As allreduce does (test_allreduce.py): against the float32 reference.
    # Shared memory takes the unscaled calls under shm, the ring the rest (in
    # pieces of at least a 1 KiB segment per rank).
    rank, size = world
    restart({"HVDMX_ALLREDUCE_ALGO": transport, "HVDMX_FUSION_PIECE_BYTES": "4096",
             "HVDMX_RING_SEGMENT_BYTES": "1024"})
    try:
        shapes = [(size + 1, 3), (4001,), (2 * size + 1, 2, 5)]
        for op in (hvd.Sum, hvd.Average):
            for pre, post in [(1.0, 1.0), (1.0, 3.0), (0.5, 3.0)]:
                xs = [mx.nd.array(half_input(rank, int(np.prod(s)), offset=k).reshape(s),
                                  dtype="float16") for k, s in enumerate(shapes)]
                outs = hvd.grouped_reducescatter(xs, op=op, prescale_factor=pre,
                                                 postscale_factor=post)
                alone = hvd.reducescatter(xs[1], op=op, prescale_factor=pre,
                                          postscale_factor=post)
                for k, out in zip([0, 1, 2, 1], outs + [alone]):
                    s = shapes[k]
                    start, end = my_rows(s[0], size, rank)
                    want = half_expected(size, int(np.prod(s)), op, pre, post,
                                         offset=k).reshape(s)[start:end]
                    got = out.asnumpy()
                    assert got.dtype == want.dtype and got.shape == want.shape
                    assert np.array_equal(got, want), (op, pre, post, k)
    finally:
        restart({"HVDMX_ALLREDUCE_ALGO": transport})


def test_reducescatter_half_prescale_rounds_each_input_to_the_dtype_first(world, transport):
    # As allreduce (test_allreduce.py, issue 46): each rank's input scaled in
    # float16 first, then summed in float32 and rounded once.
    rank, size = world
    restart({"HVDMX_ALLREDUCE_ALGO": transport, "HVDMX_FUSION_PIECE_BYTES": "4096",
             "HVDMX_RING_SEGMENT_BYTES": "1024"})
    try:
        shapes = [(0,), (1,), (size + 1, 3), (20_011,), (2 * size + 1, 2, 5)]
        for op in (hvd.Sum, hvd.Average):
            for pre, post in [(1 / 3, 1.0), (0.7, 3.0), (1.3, 0.1)]:
                xs = [mx.nd.array(hashed_half_input(rank, int(np.prod(s)), offset=k).reshape(s),
                                  dtype="float16") for k, s in enumerate(shapes)]
                outs = hvd.grouped_reducescatter(xs, op=op, prescale_factor=pre,
                                                 postscale_factor=post)
                alone = [hvd.reducescatter(x, op=op, prescale_factor=pre, postscale_factor=post)
                         for x in xs]
                for k, out in enumerate(outs + alone):
                    k %= len(shapes)
                    s = shapes[k]
                    start, end = my_rows(s[0], size, rank)
                    want = hashed_half_expected(size, int(np.prod(s)), op, pre, post,
                                                offset=k).reshape(s)[start:end]
                    got = out.asnumpy()
                    assert got.dtype == want.dtype and got.shape == want.shape
                    np.testing.assert_array_equal(got, want, err_msg=str((op, pre, post, k)))
    finally:
        restart({"HVDMX_ALLREDUCE_ALGO": transport})


def test_grouped_reducescatter_mixed_dtypes(world):
    rank, size = world
    shapes = [(size + 1, 2), (3 * size,), (1, 3, 2)]
    dtypes = ["float32", "int32", "float32"]
    # Each tensor's values are offset by its index + 1, so one tensor's
    # result cannot pass for another's.
    xs = [mx.nd.array(rank_input(rank, int(np.prod(s)), d, hvd.Sum).reshape(s) + k + 1, dtype=d)
          for k, (s, d) in enumerate(zip(shapes, dtypes))]
    outs = hvd.grouped_reducescatter(xs, op=hvd.Sum, name="grs")
    for k, (out, s, d) in enumerate(zip(outs, shapes, dtypes)):
        start, end = my_rows(s[0], size, rank)
        want = expected(size, int(np.prod(s)), d, hvd.Sum).reshape(s)[start:end] + size * (k + 1)
        assert np.array_equal(out.asnumpy(), want.astype(d)), k


def test_reducescatter_on_the_ring_goes_a_piece_at_a_time(world, transport):
    # On the ring the input passes through the fusion buffer in pieces of
    # HVDMX_FUSION_PIECE_BYTES, each the same part of every rank's block: the
    # buffer stays one piece, and every element is reduced in the order of a
    # single pass, so the bits match a run with one piece. The ring carries
    # both calls under HVDMX_ALLREDUCE_ALGO=mpi, and the prescaled one under
    # shm (shared memory would have to write a prescale into the input).
    rank, size = world
    shapes = [(5003, 2), (7 * size + 1,), (1, 3, 2), (2001,)]
    dtypes = ["float32", "int32", "float32", "float64"]

    def inputs(r):
        rng = np.random.default_rng(100 + r)
        return [(rng.standard_normal(int(np.prod(s))).reshape(s) * (50 if d == "int32" else 1))
                .astype(d) for s, d in zip(shapes, dtypes)]

    results = {}
    for piece in ["4096", "67108864"]:
        # A piece is at least a ring segment per rank: small segments too.
        restart({"HVDMX_ALLREDUCE_ALGO": transport, "HVDMX_FUSION_PIECE_BYTES": piece,
                 "HVDMX_RING_SEGMENT_BYTES": "1024"})
        try:
            xs = inputs(rank)
            outs = hvd.grouped_reducescatter([mx.nd.array(x, dtype=x.dtype) for x in xs],
                                             op=hvd.Sum, name="rs.pieces")
            scaled = hvd.reducescatter(mx.nd.array(xs[3], dtype="float64"), op=hvd.Average,
                                       prescale_factor=3.0, postscale_factor=0.25)
            results[piece] = [o.asnumpy() for o in outs] + [scaled.asnumpy()]
            if piece == "4096":
                # One piece (plus an element a rank), in whole pages.
                assert _core.stats()["fusion_buffer_bytes"] <= 8192
        finally:
            restart({"HVDMX_ALLREDUCE_ALGO": transport})
    everyone = [inputs(r) for r in range(size)]
    for k, (s, d) in enumerate(zip(shapes, dtypes)):
        start, end = my_rows(s[0], size, rank)
        want = sum(x[k].astype("float64") for x in everyone)[start:end]
        got = results["4096"][k]
        assert got.shape == want.shape and got.dtype == np.dtype(d), k
        if d == "int32":
            assert np.array_equal(got, want.astype(d))
        else:
            assert np.allclose(got, want, rtol=1e-5, atol=1e-5), k
        assert np.array_equal(got, results["67108864"][k]), k
    start, end = my_rows(shapes[3][0], size, rank)
    want = sum(x[3] for x in everyone)[start:end] * 3.0 * 0.25 / size
    assert np.allclose(results["4096"][4], want)
    assert np.array_equal(results["4096"][4], results["67108864"][4])


def test_temporaries_are_kept_alive(world):
    import gc
    rank, size = world
    base = mx.nd.array(block(rank, 1000, (3,), "float32"))
    gathered = hvd.allgather(base * 2, priority=5)
    swapped = hvd.alltoall(mx.nd.concat(*[base[:size] * 3] * 1, dim=0), priority=-5)
    scattered = hvd.reducescatter(base * 4, op=hvd.Sum)
    gc.collect()
    want = np.concatenate([block(r, 1000, (3,), "float32") * 2 for r in range(size)])
    assert np.array_equal(gathered.asnumpy(), want)
    assert swapped.shape == (size, 3)
    start, end = my_rows(1000, size, rank)
    total = sum(block(r, 1000, (3,), "float32") for r in range(size)) * 4
    assert np.array_equal(scattered.asnumpy(), total[start:end])


def test_numpy_arrays_in_numpy_arrays_out(world):
    # mx.np arrays: every out-of-place collective returns an mx.np.ndarray of
    # the input's dtype, with the values the mx.nd form gives.
    rank, size = world
    x = mx.nd.array(block(rank, size, (2,), "int32"), dtype="int32")
    calls = {
        "allreduce": lambda t: hvd.allreduce(t, op=hvd.Sum, name=f"np.ar.{type(t).__name__}"),
        "broadcast": lambda t: hvd.broadcast(t, size - 1, name=f"np.bc.{type(t).__name__}"),
        "allgather": lambda t: hvd.allgather(t, name=f"np.ag.{type(t).__name__}"),
        "alltoall": lambda t: hvd.alltoall(t, name=f"np.a2a.{type(t).__name__}"),
        "reducescatter": lambda t: hvd.reducescatter(t, op=hvd.Sum,
                                                     name=f"np.rs.{type(t).__name__}"),
    }
    for label, call in calls.items():
        out = call(x.as_np_ndarray())
        assert isinstance(out, mx.np.ndarray), label
        assert out.dtype == np.int32, label
        want = call(x).asnumpy()
        assert out.shape == want.shape, label
        assert np.array_equal(out.asnumpy(), want), label
