import gc

import mxnet as mx
import numpy as np
import pytest

import hvdmx as hvd
from hvdmx import _core
from conftest import all_equal_across_ranks, restart
from helpers import (DTYPES, OPS, check_my_share, counts_for, expected, half_expected, half_input,
                     hashed_half_expected, hashed_half_input, mxnet_memory, rank_input, reduced,
                     restarted)


def check(out, want):
    got = out.asnumpy()
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert np.array_equal(got, want), f"got {got[:8]} want {want[:8]}"
    assert all_equal_across_ranks(got)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_allreduce_every_dtype_op_and_count(world, dtype, op):
    rank, size = world
    for count in counts_for(size):
        x = mx.nd.array(rank_input(rank, count, dtype, op), dtype=dtype)
        out = hvd.allreduce(x, op=op, name=f"ar.{dtype}.{op}.{count}")
        check_my_share(out, rank, size, count, dtype, op)


@pytest.mark.parametrize("algo", ["ring", "mpi", "auto"])
def test_every_algorithm_with_a_tiny_segment(world, algo):
    rank, size = world
    with restarted({"HVDMX_ALLREDUCE_ALGO": algo, "HVDMX_RING_SEGMENT_BYTES": "64",
             "HVDMX_RING_MIN_BYTES": "256"}):
        # Every dtype with every op at the small counts; the large count (tens of
        # thousands of segments) once a dtype, every op among them. Each pair's
        # ring at any segment size is test_ring_local.py's hypothesis test
        # (test_ring_matches_reference; products in test_ring_product_small_values);
        # the twelve large calls took half a minute an algorithm over TCP at 3 ranks.
        *small, large = counts_for(size)
        for d, dtype in enumerate(["float32", "float16", "int64", "int8"]):
            for o, op in enumerate([hvd.Sum, hvd.Max, hvd.Product]):
                for count in small + [17, 257] + ([large] if o == d % 3 else []):
                    x = mx.nd.array(rank_input(rank, count, dtype, op), dtype=dtype)
                    check(hvd.allreduce(x, op=op), expected(size, count, dtype, op))


# Every allreduce algorithm, each with settings that make it cut the data
# small: shared memory (tiny chunks), the ring (tiny segments and pieces, so
# fused groups go through the fusion buffer in many pieces), MPI, and
# hierarchical on pretend hosts of two ranks (at -n 4; elsewhere the ring or
# one host's shared memory).
HALF_ALGORITHMS = {
    "shm": {"HVDMX_ALLREDUCE_ALGO": "shm", "HVDMX_SHM_CHUNK_BYTES": "4160"},
    "ring": {"HVDMX_ALLREDUCE_ALGO": "ring", "HVDMX_RING_SEGMENT_BYTES": "64",
             "HVDMX_FUSION_PIECE_BYTES": "300"},
    "mpi": {"HVDMX_ALLREDUCE_ALGO": "mpi", "HVDMX_FUSION_PIECE_BYTES": "300"},
    "hierarchical": {"HVDMX_ALLREDUCE_ALGO": "shm", "HVDMX_HIERARCHICAL_ALLREDUCE": "1",
                     "HVDMX_TESTING_RANKS_PER_HOST": "2", "HVDMX_SHM_CHUNK_BYTES": "4160"},
}


@pytest.mark.parametrize("algo", sorted(HALF_ALGORITHMS))
def test_half_is_summed_in_float32_and_rounded_once(world, algo):
    # Against the float32 reference: with three or more ranks, rounding
    # after every pairwise step (and after each scaling) gives other bits.
    rank, size = world
    with restarted(HALF_ALGORITHMS[algo]):
        if algo == "hierarchical" and size == 4:
            assert _core.stats()["shm"]["hierarchical"]
        counts = [1, size + 1, 1001, 20_011]
        for op in [hvd.Sum, hvd.Average]:
            for pre, post in [(1.0, 1.0), (0.5, 3.0), (2.0, 0.25)]:
                tag = f"half.{algo}.{op}.{pre}.{post}"
                for count in counts:
                    x = mx.nd.array(half_input(rank, count), dtype="float16")
                    out = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post,
                                        name=f"{tag}.{count}")
                    check(out, half_expected(size, count, op, pre, post))
                # Fused: a grouped call's tensors share chunks or pieces.
                xs = [mx.nd.array(half_input(rank, c, offset=k), dtype="float16")
                      for k, c in enumerate(counts)]
                outs = hvd.grouped_allreduce(xs, op=op, prescale_factor=pre,
                                             postscale_factor=post, name=f"{tag}.grouped")
                for k, (out, c) in enumerate(zip(outs, counts)):
                    check(out, half_expected(size, c, op, pre, post, offset=k))
                # In place, prescaled: the input is the output.
                y = mx.nd.array(half_input(rank, 1001), dtype="float16")
                hvd.allreduce_(y, op=op, prescale_factor=pre, postscale_factor=post,
                               name=f"{tag}.inplace")
                check(y, half_expected(size, 1001, op, pre, post))
        # Random data, whose float32 sum depends on the order of additions:
        # still the same bits on every rank (MPI: when MPI's float32 results
        # are, since every rank rounds them alike).
        rng = np.random.default_rng(1000 + rank)
        for count in [1001, 300_007]:
            data = (rng.standard_normal(count) * 100).astype(np.float16)
            for op, pre, post in [(hvd.Sum, 1.0, 1.0), (hvd.Average, 0.5, 3.0)]:
                out = hvd.allreduce(mx.nd.array(data, dtype="float16"), op=op,
                                    prescale_factor=pre, postscale_factor=post).asnumpy()
                assert all_equal_across_ranks(out)


# Prescale factors that are not powers of two, with postscales, and counts
# from empty to one that every algorithm cuts into many chunks or pieces.
HALF_SCALES = [(1 / 3, 1.0), (0.7, 3.0), (1.3, 0.1)]


def half_counts(size):
    return [0, 1, size + 1, 1001, 20_011]


@pytest.mark.parametrize("algo", sorted(HALF_ALGORITHMS))
def test_half_prescale_rounds_each_input_to_the_dtype_first(world, algo):
    # Horovod scales each rank's input in its own dtype before the sum
    # (issue 46): float16(float32(f) * float32(x)), then the sum in float32,
    # rounded once. A prescaled input kept in float32 differs by an ulp in
    # some elements. Against the reference, with equality.
    rank, size = world
    with restarted(HALF_ALGORITHMS[algo]):
        counts = half_counts(size)
        for op in [hvd.Sum, hvd.Average]:
            for pre, post in HALF_SCALES:
                tag = f"prescaled.{algo}.{op}.{pre}.{post}"
                for count in counts:
                    x = mx.nd.array(hashed_half_input(rank, count), dtype="float16")
                    out = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post,
                                        name=f"{tag}.{count}")
                    check(out, hashed_half_expected(size, count, op, pre, post))
                xs = [mx.nd.array(hashed_half_input(rank, c, offset=k), dtype="float16")
                      for k, c in enumerate(counts)]
                outs = hvd.grouped_allreduce(xs, op=op, prescale_factor=pre,
                                             postscale_factor=post, name=f"{tag}.grouped")
                for k, (out, c) in enumerate(zip(outs, counts)):
                    check(out, hashed_half_expected(size, c, op, pre, post, offset=k))
                # In place, one push per tensor (the trainer's path), and grouped in place.
                ys = [mx.nd.array(hashed_half_input(rank, c, offset=k), dtype="float16")
                      for k, c in enumerate(counts)]
                hvd.allreduce_(ys[-1], op=op, prescale_factor=pre, postscale_factor=post,
                               name=f"{tag}.inplace")
                hvd.grouped_allreduce_(ys[:-1], op=op, prescale_factor=pre,
                                       postscale_factor=post, name=f"{tag}.grouped_inplace")
                for k, (y, c) in enumerate(zip(ys, counts)):
                    check(y, hashed_half_expected(size, c, op, pre, post, offset=k))


@pytest.mark.parametrize("algo", ["ring", "mpi"])
def test_half_partials_half_keeps_the_dtype_on_the_wire(world, algo):
    # HVDMX_HALF_PARTIALS=half: the ring reduces in float16 (rounding at every
    # step); MPI, which has no float16 sum, hands halves to the ring. The bits
    # are still the same on every rank, and exact sums stay exact.
    rank, size = world
    with restarted({**HALF_ALGORITHMS[algo], "HVDMX_HALF_PARTIALS": "half"}):
        count = 20_011
        x = mx.nd.array(half_input(rank, count), dtype="float16")
        out = hvd.allreduce(x, op=hvd.Sum, name="half.wire").asnumpy()
        assert all_equal_across_ranks(out)
        want = half_expected(size, count, hvd.Sum)
        if size <= 2:
            assert np.array_equal(out, want)  # one addition: rounded once anyway
        else:
            assert not np.array_equal(out, want)
            assert np.all(np.abs(out.astype(np.float32) - want.astype(np.float32)) <= 8 * size)
        small = mx.nd.array(rank_input(rank, 101, "float16", hvd.Sum), dtype="float16")
        check(hvd.allreduce(small, op=hvd.Sum), expected(size, 101, "float16", hvd.Sum))


def test_scale_factors(world):
    rank, size = world
    for dtype in DTYPES:
        for op in [hvd.Sum, hvd.Average]:
            count = size + 5
            x = mx.nd.array(rank_input(rank, count, dtype, op), dtype=dtype)
            out = hvd.allreduce(x, op=op, prescale_factor=2.0, postscale_factor=0.5)
            check(out, expected(size, count, dtype, op, prescale=2.0, postscale=0.5))


def test_average_is_the_default_and_average_flag_is_honoured(world):
    rank, size = world
    x = mx.nd.array([size * 2.0 * (rank + 1)] * 3)
    inputs = [np.full(3, size * 2.0 * (r + 1)) for r in range(size)]
    # The sum times 1/size in float32: inexact at 7 ranks (56.000004 for 56).
    want = reduced(inputs, "float32", hvd.Average)
    assert np.array_equal(hvd.allreduce(x).asnumpy(), want)
    with pytest.warns(DeprecationWarning):
        summed = hvd.allreduce(x, average=False)
    assert np.array_equal(summed.asnumpy(), reduced(inputs, "float32", hvd.Sum))
    with pytest.warns(DeprecationWarning):
        averaged = hvd.allreduce(x, average=True)
    assert np.array_equal(averaged.asnumpy(), want)


def test_in_place(world):
    rank, size = world
    x = mx.nd.array(rank_input(rank, 1001, "float32", hvd.Sum))
    same = hvd.allreduce_(x, op=hvd.Sum, name="inplace")
    assert same is x
    check(x, expected(size, 1001, "float32", hvd.Sum))


def test_input_is_not_modified_by_out_of_place(world):
    rank, _ = world
    data = rank_input(rank, 50, "float32", hvd.Sum)
    x = mx.nd.array(data)
    hvd.allreduce(x, op=hvd.Sum, prescale_factor=3.0).wait_to_read()
    assert np.array_equal(x.asnumpy(), data)


def test_grouped(world):
    rank, size = world
    dtypes = ["float32", "int32", "float16", "float32"]
    counts = [3, size + 1, 0, 1000]
    xs = [mx.nd.array(rank_input(rank, c, d, hvd.Sum), dtype=d) for c, d in zip(counts, dtypes)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum, name="grouped")
    assert len(outs) == len(xs)
    for out, c, d in zip(outs, counts, dtypes):
        check(out, expected(size, c, d, hvd.Sum))
    same = hvd.grouped_allreduce_(xs, op=hvd.Max)
    assert same == xs
    for x, c, d in zip(xs, counts, dtypes):
        check(x, expected(size, c, d, hvd.Max))
    assert hvd.grouped_allreduce([]) == []


def test_zero_size_and_0d(world):
    rank, size = world
    empty = mx.nd.array(np.zeros((0, 4), dtype=np.float32))
    assert hvd.allreduce(empty).shape == (0, 4)
    scalar = mx.nd.array(np.array(rank + 1.0, dtype=np.float32).reshape(()))
    assert scalar.shape == ()
    out = hvd.allreduce(scalar, op=hvd.Sum)
    assert out.shape == ()
    assert out.asscalar() == size * (size + 1) / 2


def test_multidimensional_shape_is_kept(world):
    rank, size = world
    x = mx.nd.array(rank_input(rank, 60, "float32", hvd.Sum).reshape(3, 4, 5))
    out = hvd.allreduce(x, op=hvd.Sum)
    check(out, expected(size, 60, "float32", hvd.Sum).reshape(3, 4, 5))


def test_returns_before_peers_submit_different_orders(world):
    # If a call blocked the Python thread, ranks submitting in opposite
    # orders would deadlock; negotiation must match them by name.
    rank, size = world
    names = [f"order.{i}" for i in range(6)]
    if rank % 2:
        names.reverse()
    outs = {n: hvd.allreduce(mx.nd.ones((5,)) * int(n[-1]), op=hvd.Sum, name=n) for n in names}
    for n, out in outs.items():
        assert out.asnumpy().tolist() == [int(n[-1]) * size] * 5


def test_temporary_input_stays_alive(world):
    rank, size = world
    outs = [hvd.allreduce(mx.nd.ones((10000,)) * (i + 1), op=hvd.Sum) for i in range(20)]
    gc.collect()
    for i, out in enumerate(outs):
        assert np.array_equal(out.asnumpy(), np.full(10000, (i + 1) * size, np.float32))


def test_engine_orders_reads_and_writes(world):
    # A write to the input pushed after the allreduce must wait for it, and a
    # read of the output must wait for the allreduce.
    rank, size = world
    x = mx.nd.ones((100000,)) * (rank + 1)
    out = hvd.allreduce(x, op=hvd.Sum)
    x[:] = -1
    y = out * 2
    assert np.array_equal(y.asnumpy(), np.full(100000, size * (size + 1), np.float32))
    assert np.array_equal(x.asnumpy(), np.full(100000, -1, np.float32))


def test_chained_collectives_depend_on_each_other(world):
    rank, size = world
    x = mx.nd.ones((7,)) * (rank + 1)
    for _ in range(3):
        x = hvd.allreduce(x, op=hvd.Sum)
    total = size * (size + 1) // 2
    assert x.asnumpy().tolist() == [total * size * size] * 7


def test_repeated_names_use_the_cache_and_stay_correct(world):
    rank, size = world
    for step in range(50):
        xs = [mx.nd.ones((i + 1,)) * (rank + step) for i in range(4)]
        outs = [hvd.allreduce(x, op=hvd.Sum, name=f"step.{i}") for i, x in enumerate(xs)]
        want = sum(r + step for r in range(size))
        for i, out in enumerate(outs):
            assert out.asnumpy().tolist() == [want] * (i + 1)


def test_fusion_disabled_and_tiny_threshold(world):
    rank, size = world
    for threshold in ["0", "40"]:
        with restarted({"HVDMX_FUSION_THRESHOLD": threshold}):
            xs = [mx.nd.array(rank_input(rank, c, "float32", hvd.Sum)) for c in [1, 9, 10, 3]]
            outs = [hvd.allreduce(x, op=hvd.Sum) for x in xs]
            for out, c in zip(outs, [1, 9, 10, 3]):
                check(out, expected(size, c, "float32", hvd.Sum))


@pytest.mark.parametrize("algo", ["ring", "mpi"])
def test_fused_group_goes_through_the_buffer_in_pieces(world, algo):
    rank, size = world
    # 300-byte pieces (above 4 ranks x 64-byte segments): 75 float32, 37
    # float64 (296 bytes), 150 float16, 300 int8 elements. The tensors start
    # and end inside pieces, span several, hold nothing, or are one element.
    with restarted({"HVDMX_ALLREDUCE_ALGO": algo, "HVDMX_FUSION_PIECE_BYTES": "300",
             "HVDMX_RING_SEGMENT_BYTES": "64"}):
        counts = [1, 9, 0, 33, 10, 3, 100, 7, 2000]
        for dtype in DTYPES:
            for op in OPS:
                xs = [mx.nd.array(rank_input(rank, c, dtype, op), dtype=dtype) for c in counts]
                outs = hvd.grouped_allreduce(xs, op=op, prescale_factor=2.0,
                                             postscale_factor=0.5, name=f"pieces.{dtype}.{op}")
                for out, c in zip(outs, counts):
                    check(out, expected(size, c, dtype, op, prescale=2.0, postscale=0.5))
        # The buffer holds one piece, not the group (16.9 KB of float64).
        assert _core.stats()["fusion_buffer_bytes"] == 4096
        # A group of empty tensors has no piece at all.
        empty = hvd.grouped_allreduce([mx.nd.array(np.zeros(0)), mx.nd.array(np.zeros((0, 3)))],
                                      op=hvd.Sum)
        assert [e.asnumpy().shape for e in empty] == [(0,), (0, 3)]


def test_a_piece_holds_a_ring_segment_per_rank(world):
    rank, size = world
    # Pieces never make the ring's per-step messages smaller than a segment:
    # with 64 KiB pieces and segments, a piece is size x 64 KiB.
    restart({"HVDMX_ALLREDUCE_ALGO": "ring", "HVDMX_FUSION_PIECE_BYTES": "65536",
             "HVDMX_RING_SEGMENT_BYTES": "65536"})
    try:
        xs = [mx.nd.full((65536,), rank + i, dtype="float32") for i in range(4)]  # 1 MiB
        outs = hvd.grouped_allreduce(xs, op=hvd.Sum, name="segment.pieces")
        for i, out in enumerate(outs):
            check(out, np.full(65536, sum(r + i for r in range(size)), dtype="float32"))
        assert _core.stats()["fusion_buffer_bytes"] == size * 65536
    finally:
        restart({})


def test_cache_disabled_and_tiny_cache(world):
    rank, size = world
    for capacity in ["0", "2"]:
        with restarted({"HVDMX_CACHE_CAPACITY": capacity}):
            for step in range(5):
                outs = [hvd.allreduce(mx.nd.ones((2,)) * (rank + i), op=hvd.Sum, name=f"c{i}")
                        for i in range(5)]
                for i, out in enumerate(outs):
                    assert out.asnumpy().tolist() == [sum(r + i for r in range(size))] * 2


def test_mkldnn_layout_weight(world):
    # After a hybridized forward in inference mode, MXNet keeps conv weights in
    # oneDNN's internal layout. A collective on such an array fails cleanly at
    # read, the same on every rank (no crash, no hang); a plain copy reduces,
    # and broadcast_parameters converts parameters first.
    rank, size = world
    mx.random.seed(1234)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Conv2D(8, 3, in_channels=4), mx.gluon.nn.Conv2D(8, 3, in_channels=8))
    net.initialize()
    net.hybridize(static_alloc=True, static_shape=True)
    for _ in range(2):
        net(mx.nd.ones((2, 4, 12, 12))).wait_to_read()
    weight = net[1].weight.data()
    with pytest.raises(mx.base.MXNetError, match="oneDNN's internal layout.*x.copy\\(\\)"):
        hvd.allreduce(weight, op=hvd.Max, name="mkldnn.weight").wait_to_read()
    out = hvd.allreduce(weight.copy(), op=hvd.Max, name="mkldnn.copy")
    assert np.array_equal(out.asnumpy(), weight.asnumpy())
    hvd.broadcast_parameters(net.collect_params(), root_rank=0, prefix="mkldnn.")
    assert all_equal_across_ranks(net[1].weight.data().asnumpy())
    # Only the last rank holds such an array: the others do not wait for it,
    # they get its error too, naming it; and the name can be used again.
    weight = net[1].weight.data()
    net(mx.nd.ones((2, 4, 12, 12))).wait_to_read()
    mine = weight if rank == size - 1 else weight.copy()
    with pytest.raises(mx.base.MXNetError,
                       match=f"failed on rank {size - 1}, so it has failed on every rank: "
                             "hvdmx: tensor 'mkldnn.one' is held in oneDNN's internal layout"):
        hvd.allreduce(mine, op=hvd.Max, name="mkldnn.one").wait_to_read()
    out = hvd.allreduce(weight.copy(), op=hvd.Max, name="mkldnn.one")
    assert np.array_equal(out.asnumpy(), weight.asnumpy())


@pytest.mark.skipif(hvd.size() > 2, reason="needs ~6 GiB per rank: runs at -n 1 and -n 2")
def test_over_two_gib(world):
    # 2**29 + 5 float32 elements: over 2**31 bytes (MXNet's wheel caps a tensor
    # at 2**31 elements, not bytes).
    # Checked in place (mxnet_memory): a copy of 2 GiB, and the temporaries of
    # `got != total`, took most of the test's time.
    rank, size = world
    count = 2**29 + 5
    x = mx.nd.full((count,), rank + 1, dtype="float32")
    x[count - 5:] = 100 + rank
    hvd.allreduce_(x, op=hvd.Sum, name="huge")
    got = mxnet_memory(x)
    total = size * (size + 1) // 2
    body = got[:count - 5]
    assert body.min() == total and body.max() == total
    assert np.all(got[count - 5:] == 100 * size + size * (size - 1) // 2)


def test_allreduce_each_pushes_an_allreduce_per_tensor(world):
    # DistributedTrainer's path: allreduce_ of each tensor, all pushed in one call.
    from hvdmx.ops import _allreduce_each_
    rank, size = world
    specs = [(7, "float32"), (1, "int32"), (300, "float64"), (0, "float32"), (33, "int8")]
    for step in range(2):
        xs = [mx.nd.array(rank_input(rank, count, dtype, hvd.Sum), dtype=dtype)
              for count, dtype in specs]
        out = _allreduce_each_(xs, [f"each.{k}" for k in range(len(xs))],
                               [-k for k in range(len(xs))], hvd.Sum, 2.0, 0.5,
                               hvd.global_process_set)
        assert out is xs
        for x, (count, dtype) in zip(xs, specs):
            check(x, expected(size, count, dtype, hvd.Sum, 2.0, 0.5))


def test_allreduce_each_refuses_before_pushing_anything(world):
    from hvdmx.ops import _allreduce_each_
    rank, size = world
    good = [mx.nd.ones((3,)) * (rank + 1), mx.nd.ones((2,), dtype="int32")]
    sparse = mx.nd.zeros((4, 2)).tostype("row_sparse")
    cases = [(sparse, ValueError, r"tensors\[2\].*sparse"),
             (np.ones(3), TypeError, r"tensors\[2\].*must be an mxnet.nd.NDArray"),
             (mx.nd.ones((2,), dtype="bool"), TypeError, r"tensors\[2\].*dtype bool")]
    for bad, error, match in cases:
        with pytest.raises(error, match=match):
            _allreduce_each_(good + [bad], ["e.0", "e.1", "e.2"], [0, 0, 0], hvd.Sum, 1.0, 1.0,
                             hvd.global_process_set)
    # Nothing was pushed: the good tensors hold what they held, and their
    # names are free for the next call.
    mx.nd.waitall()
    assert good[0].asnumpy().tolist() == [rank + 1] * 3
    with pytest.raises(ValueError, match="one name and one priority per tensor"):
        _allreduce_each_(good, ["e.0"], [0, 0], hvd.Sum, 1.0, 1.0, hvd.global_process_set)
    _allreduce_each_(good, ["e.0", "e.1"], [0, 0], hvd.Sum, 1.0, 1.0, hvd.global_process_set)
    assert good[0].asnumpy().tolist() == [size * (size + 1) / 2] * 3
