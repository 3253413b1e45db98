"""The shared-memory allreduce through the whole stack, forced with
HVDMX_ALLREDUCE_ALGO=shm, and the choice that auto makes (all ranks of these
runs share one host)."""
import mxnet as mx
import numpy as np
import pytest

import hvdmx as hvd
from hvdmx import _core
from conftest import all_equal_across_ranks, host_names, restart, shm_exchanges, \
    world_allgather
from helpers import DTYPES, OPS, check_my_share, counts_for, expected, rank_input, restarted


def check(out, want):
    got = out.asnumpy()
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got, want), f"got {got[:8]} want {want[:8]}"
    assert all_equal_across_ranks(got)


def shm_forced(env):
    """hvdmx restarted with the shared-memory allreduce forced on."""
    with restarted({"HVDMX_ALLREDUCE_ALGO": "shm", **env}):
        yield


@pytest.fixture(params=[{}, {"HVDMX_SHM_CHUNK_BYTES": "4160"}], ids=["default", "chunk4160"])
def shm(request, world):
    yield from shm_forced(request.param)


@pytest.fixture(params=[{}, {"HVDMX_SHM_CHUNK_BYTES": "4160"},
                        {"HVDMX_SHM_DIRECT_MIN_BYTES": "0", "HVDMX_SHM_PUSH": "0"},
                        {"HVDMX_SHM_PUSH": "0"}],
                ids=["default", "chunk4160", "direct", "no-push"])
def shm_moves(request, world):
    """As shm, and with every byte-moving call reading peers' buffers, or
    none writing into peers' outputs."""
    yield from shm_forced(request.param)


def shm_calls():
    """Calls made by the shared-memory allreduce; -1 when it is off."""
    info = _core.stats()["shm"]
    return -1 if info is None else info["calls"]


def test_shm_is_on_when_ranks_share_a_host(world, shm):
    rank, size = world
    if size == 1:
        assert _core.stats()["shm"] is None  # nothing to share
        return
    info = _core.stats()["shm"]
    assert info["local_size"] == size and not info["hierarchical"]
    before = shm_calls()
    rounds = info["bit_ands"]
    check(hvd.allreduce(mx.nd.array(rank_input(rank, 10, "float32", hvd.Sum)), op=hvd.Sum),
          expected(size, 10, "float32", hvd.Sum))
    assert shm_calls() == before + 1
    # Negotiation's bit-and of every round goes through shared memory too.
    assert _core.stats()["shm"]["bit_ands"] > rounds


def test_calls_without_names_negotiate_through_shared_memory(world):
    # A name never seen before misses the response cache, so its round goes
    # to rank 0. On one host the ranks send their requests with the bit-and
    # and rank 0 broadcasts the responses through shared memory; no MPI
    # gather. Without shared memory (one rank) the round gathers.
    rank, size = world
    before = _core.stats()["negotiation"]
    for i in range(30):
        n = 1 + (rank + i) % 3  # allgather rows differ per rank
        x = mx.nd.array(rank_input(rank, 6, "float32", hvd.Sum))
        check(hvd.allreduce(x, op=hvd.Sum), expected(size, 6, "float32", hvd.Sum))
        rows = mx.nd.full((n, 2), rank, dtype="int32")
        want = np.concatenate([np.full((1 + (r + i) % 3, 2), r, np.int32) for r in range(size)])
        check(hvd.allgather(rows), want)
    after = _core.stats()["negotiation"]
    sent = after["sent_with_bit_and"] - before["sent_with_bit_and"]
    gathered = after["gathered"] - before["gathered"]
    if _core.stats()["shm"] is None:
        assert sent == 0 and gathered >= 90 and after["strings_broadcast"] == -1
        return
    # Each call's rounds (an allgather has two) sent their requests with
    # the bit-and; rank 0's answers went through shared memory.
    assert sent >= 90 and gathered == 0, (before, after)
    assert after["strings_broadcast"] - before["strings_broadcast"] == sent


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_op_and_count(world, shm, dtype):
    rank, size = world
    big = (3 << 20) // np.dtype(dtype).itemsize + 2 * size + 1  # a few MiB, odd
    for op in OPS:
        for count in counts_for(size) + [17, 257, big]:
            x = mx.nd.array(rank_input(rank, count, dtype, op), dtype=dtype)
            check_my_share(hvd.allreduce(x, op=op, name=f"shm.{dtype}.{op}.{count}"), rank, size,
                           count, dtype, op)


def test_fused_groups_and_scale_factors(world, shm):
    rank, size = world
    counts = [3, size + 1, 0, 1000, 70_001]
    for dtype in ["float32", "float16", "int32"]:
        xs = [mx.nd.array(rank_input(rank, c, dtype, hvd.Sum), dtype=dtype) for c in counts]
        before = shm_calls()
        outs = hvd.grouped_allreduce(xs, op=hvd.Sum, name=f"shm.grouped.{dtype}")
        for out, c in zip(outs, counts):
            check(out, expected(size, c, dtype, hvd.Sum))
        if size > 1:
            # The small tensors fused into one call on the tensors themselves
            # (no fusion buffer); the big one alone where it is above
            # HVDMX_FUSION_MAX_TENSOR_BYTES (256 KiB).
            big_alone = np.dtype(dtype).itemsize * counts[-1] > 256 * 1024
            assert shm_calls() - before == 1 + big_alone
        hvd.grouped_allreduce_(xs, op=hvd.Sum, name=f"shm.grouped_.{dtype}")
        for x, c in zip(xs, counts):
            check(x, expected(size, c, dtype, hvd.Sum))
        xs = [mx.nd.array(rank_input(rank, c, dtype, hvd.Sum), dtype=dtype) for c in counts]
        outs = hvd.grouped_allreduce(xs, op=hvd.Average, prescale_factor=2.0,
                                     postscale_factor=0.5)
        for out, c in zip(outs, counts):
            check(out, expected(size, c, dtype, hvd.Average, prescale=2.0, postscale=0.5))


def test_float_sums_are_bitwise_identical_across_ranks(world, shm):
    rank, size = world
    rng = np.random.default_rng(1000 + rank)
    for count in [1, 4097, 300_001]:
        data = (rng.standard_normal(count) * 10 ** rng.uniform(-4, 4, count)).astype(np.float32)
        out = hvd.allreduce(mx.nd.array(data), op=hvd.Sum).asnumpy()
        assert all_equal_across_ranks(out)
        # every rank's result is ((x0 + x1) + x2) + ... in float32
        inputs = world_allgather(data)
        want = inputs[0].copy()
        for x in inputs[1:]:
            want = want + x
        assert out.tobytes() == want.tobytes()


def test_many_calls_in_a_row(world, shm):
    # Stage reuse over calls of changing sizes, in place and out of place.
    rank, size = world
    x = mx.nd.array(rank_input(rank, 5000, "float32", hvd.Max))
    for i in range(50):
        count = (i * 997) % 5000
        part = x[:count] if count else mx.nd.array(np.zeros(0, dtype=np.float32))
        out = hvd.allreduce(part, op=hvd.Max, name=f"row.{i}")
        check(out, expected(size, count, "float32", hvd.Max))
    hvd.allreduce_(x, op=hvd.Max)
    check(x, expected(size, 5000, "float32", hvd.Max))


def rows(rank, n, salt=0):
    """n rows of 3 exact values that say which rank and row they came from."""
    i = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    return i + 1000 * rank + 7 * salt


def check_allgather(rank, size, share, salt=0):
    """An allgather of `share` rows per rank, checked; returns the result."""
    got = hvd.allgather(mx.nd.array(rows(rank, share, salt))).asnumpy()
    assert np.array_equal(got, np.concatenate([rows(r, share, salt) for r in range(size)]))
    return got


def check_alltoall(rank, size, share, salt=0):
    """An alltoall of `share` rows to every rank, checked."""
    out = hvd.alltoall(mx.nd.array(rows(rank, share * size, salt))).asnumpy()
    assert np.array_equal(out, np.concatenate(
        [rows(s, share * size, salt)[rank * share:(rank + 1) * share] for s in range(size)]))


def test_broadcast_allgather_alltoall_through_shm(world, shm_moves):
    # Interleaved with allreduces; ragged rows, 0 rows on rank 1, a grouped
    # allgather (packed in the fusion buffer), every root.
    rank, size = world
    before = shm_exchanges()
    info = _core.stats()["shm"]
    direct_before = info["direct_exchanges"] if info else 0
    pushed_before = info["push_exchanges"] if info else 0
    moves = nonempty = pushes = 0
    for step in range(3):
        ns = [(r * 40_001 + step * 7) % 90_001 if r != 1 else 0 for r in range(size)]
        got = hvd.allgather(mx.nd.array(rows(rank, ns[rank], step))).asnumpy()
        want = np.concatenate([rows(r, ns[r], step) for r in range(size)])
        assert np.array_equal(got, want)
        a, b = hvd.grouped_allgather([mx.nd.array(rows(rank, rank + 1, step)),
                                      mx.nd.array(rows(rank, 2, step + 1)[:, :2])])
        assert np.array_equal(a.asnumpy(), np.concatenate([rows(r, r + 1, step)
                                                           for r in range(size)]))
        assert np.array_equal(b.asnumpy(), np.concatenate([rows(r, 2, step + 1)[:, :2]
                                                           for r in range(size)]))
        root = step % size
        x = mx.nd.array(rows(rank, 50_000, step))
        hvd.broadcast_(x, root_rank=root)
        assert np.array_equal(x.asnumpy(), rows(root, 50_000, step))
        splits = [(rank + d + step) * 1000 for d in range(size)]
        send = np.concatenate([rows(rank * size + d, splits[d], step) for d in range(size)])
        out, received = hvd.alltoall(mx.nd.array(send), splits=splits)
        want = np.concatenate([rows(s * size + rank, (s + rank + step) * 1000, step)
                               for s in range(size)])
        assert np.array_equal(out.asnumpy(), want)
        assert received.asnumpy().tolist() == [(s + rank + step) * 1000 for s in range(size)]
        check(hvd.allreduce(mx.nd.array(rank_input(rank, 3001, "float32", hvd.Sum)), op=hvd.Sum),
              expected(size, 3001, "float32", hvd.Sum))
        moves += 4
        nonempty += 3 + (max(ns) > 0)
        # Outputs of 64 KiB and more on every rank come from the shared file
        # (12-byte rows); the grouped allgather's are packed, and small.
        receives = [sum((s + r + step) * 1000 for s in range(size)) for r in range(size)]
        pushes += (sum(ns) * 12 >= 65536) + (min(receives) * 12 >= 65536)
    assert shm_exchanges() == (before + moves if size > 1 else 0)
    if info and info["direct_min_bytes"] == 0:
        # Every call with a non-empty block read its peers' buffers.
        assert _core.stats()["shm"]["direct_exchanges"] == direct_before + nonempty
    if info:
        pushed = _core.stats()["shm"]["push_exchanges"] - pushed_before
        assert pushed == (pushes if info["writes_into_peers"] else 0)


def shm_with(name, value):
    """Every collective through shared memory, and `name` set to `value`
    (None: left unset)."""
    return {"HVDMX_ALLREDUCE_ALGO": "shm", **({} if value is None else {name: value})}


@pytest.mark.parametrize("value", ["0", "1", "auto", None])
def test_streaming_stores_as_asked(world, value):
    # 1 streams every allreduce, 0 none, auto (the default) times both kinds
    # on calls of 64 KiB and up: of ten 1 MiB calls, the warm-up and three
    # more are cached, three stream, and the last three take the faster kind;
    # the 4,000-byte call is cached. (Allgathers and alltoalls that write
    # into the peers' outputs use no stage: that is off here.)
    rank, size = world
    restart({**shm_with("HVDMX_SHM_STREAMING_STORES", value), "HVDMX_SHM_PUSH": "0"})
    try:
        info = _core.stats()["shm"]
        if size == 1:
            assert info is None
            return
        assert info["streaming_stores"] == (value or "auto")
        before = info["streamed_calls"]
        count = (1 << 20) // 4
        for step in range(10):
            x = mx.nd.array(rank_input(rank + step, count, "float32", hvd.Sum))
            want = sum(rank_input(r + step, count, "float32", hvd.Sum) for r in range(size))
            check(hvd.allreduce(x, op=hvd.Sum), want.astype(np.float32))
        small = hvd.allreduce(mx.nd.array(rank_input(rank, 1000, "float32", hvd.Sum)), op=hvd.Sum)
        check(small, expected(size, 1000, "float32", hvd.Sum))
        streamed = _core.stats()["shm"]["streamed_calls"] - before
        if value == "1":
            assert streamed == 11
        elif value == "0":
            assert streamed == 0
        else:
            assert 3 <= streamed <= 6, streamed
        # The byte-moving calls and the reduce-scatter choose too (each kind
        # apart): forced, they stream; under auto, a first call warms up.
        before = _core.stats()["shm"]["streamed_calls"]
        x = mx.nd.array(rows(rank, 30_000))  # 360,000 bytes
        hvd.broadcast_(x, root_rank=0)
        assert np.array_equal(x.asnumpy(), rows(0, 30_000))
        check_allgather(rank, size, 30_000)
        check_alltoall(rank, size, 30_000 // size)
        y = mx.nd.array(rank_input(rank, count, "float32", hvd.Sum))
        got = hvd.reducescatter(y, op=hvd.Sum).asnumpy()
        total = sum(rank_input(r, count, "float32", hvd.Sum) for r in range(size))
        cut = np.array_split(np.arange(count), size)[rank]
        assert np.array_equal(got, total[cut[0]:cut[-1] + 1].astype(np.float32))
        moves = _core.stats()["shm"]["streamed_calls"] - before
        assert moves == (4 if value == "1" else 0)
        hvd.barrier()
    finally:
        restart({})


@pytest.mark.parametrize("value", ["0", "1", "auto"])
def test_writes_into_peers_outputs_choose_their_stores(world, value):
    # Allgathers and alltoalls written straight into the peers' outputs
    # choose their stores too, apart from the stages': 1 streams each, 0
    # none. Under auto, a rank writing under 8 MiB never streams; from 8 MiB
    # the first call of a size warms up, the next three are cached and the
    # three after them stream. Every byte lands, whatever the stores.
    rank, size = world
    restart(shm_with("HVDMX_SHM_STREAMING_STORES", value))
    try:
        info = _core.stats()["shm"]
        if size == 1:
            assert info is None
            return
        before = info
        share = 10_001  # rows of 12 bytes: copies that start and end off 16-byte lines
        for step in range(2):
            check_allgather(rank, size, share, step)
            check_alltoall(rank, size, share, step)
        after = _core.stats()["shm"]
        assert after["push_exchanges"] - before["push_exchanges"] == 4
        streamed = after["streamed_calls"] - before["streamed_calls"]
        assert streamed == (4 if value == "1" else 0)
        big = (9 << 20) // 12 // size  # rows per rank: outputs of about 9 MiB
        x = mx.nd.array(rows(rank, big))
        want = np.concatenate([rows(r, big) for r in range(size)])
        for _ in range(7):
            assert np.array_equal(hvd.allgather(x).asnumpy(), want)
        streamed = _core.stats()["shm"]["streamed_calls"] - after["streamed_calls"]
        assert streamed == {"1": 7, "0": 0, "auto": 3}[value]
        hvd.barrier()
    finally:
        restart({})


@pytest.mark.parametrize("value", ["0", "65536", "-1", "auto", None])
def test_direct_reads_are_on_when_asked(world, value):
    # Asked for, the probe must find cross-memory attach working between the
    # ranks of this machine (the same user, no ptrace restriction); unset, it
    # is auto, which reads only large alltoalls directly.
    rank, size = world
    restart(shm_with("HVDMX_SHM_DIRECT_MIN_BYTES", value))
    try:
        info = _core.stats()["shm"]
        if size == 1:
            assert info is None
            return
        want = "auto" if value in ("auto", None) else int(value)
        assert info["direct_min_bytes"] == want
        before, wrote = info["direct_exchanges"], info["root_writes"]
        x = mx.nd.array(rows(rank, 30_000))  # 360,000 bytes
        hvd.broadcast_(x, root_rank=size - 1)
        assert np.array_equal(x.asnumpy(), rows(size - 1, 30_000))
        direct = want != "auto" and 0 <= want <= 360_000
        info = _core.stats()["shm"]
        assert info["direct_exchanges"] == before + direct
        # Read directly, the root writes the end of every peer's output.
        assert info["root_writes"] == wrote + (direct and rank == size - 1)
        # Out of place, from another root, which copies its own output instead.
        got = hvd.broadcast(mx.nd.array(rows(rank, 30_001)), root_rank=0).asnumpy()
        assert np.array_equal(got, rows(0, 30_001))
        assert _core.stats()["shm"]["root_writes"] == wrote + (direct and rank == size - 1)
        hvd.barrier()
    finally:
        restart({})


def test_auto_sends_large_moves_through_shm_when_read_directly(world):
    # Read from the peers' buffers, an allgather over 32 MiB stays in shared
    # memory, and the direct reads hold for it and for a large alltoall. The
    # blocks peers read (at least 8 MiB each) are put on huge pages (Note
    # [Huge pages under what peers read]): each rank asks the kernel, which
    # may refuse (no free huge page, or no MADV_COLLAPSE).
    rank, size = world
    with restarted({"HVDMX_SHM_DIRECT_MIN_BYTES": "1048576", "HVDMX_SHM_PUSH": "0"}):
        if size == 1:
            return
        info = _core.stats()["shm"]
        moves, direct = shm_exchanges(), info["direct_exchanges"]
        asked = info["collapsed_huge_pages"] + info["refused_huge_pages"]
        gathered = -(-(33 << 20) // (12 * size))
        got = hvd.allgather(mx.nd.array(rows(rank, gathered))).asnumpy()
        assert np.array_equal(got, np.concatenate([rows(r, gathered) for r in range(size)]))
        info = _core.stats()["shm"]
        assert info["collapsed_huge_pages"] + info["refused_huge_pages"] > asked
        share = -(-1_400_000 // size)
        big = share * size
        out = hvd.alltoall(mx.nd.array(rows(rank, big))).asnumpy()
        assert np.array_equal(out, np.concatenate(
            [rows(s, big)[rank * share:(rank + 1) * share] for s in range(size)]))
        assert shm_exchanges() == moves + 2
        assert _core.stats()["shm"]["direct_exchanges"] == direct + 2
        hvd.barrier()


def test_auto_reads_large_alltoalls_and_broadcasts_directly(world):
    # HVDMX_SHM_DIRECT_MIN_BYTES unset (auto), and no writing into peers'
    # outputs: an alltoall whose longest stream (what one rank sends to the
    # others) has 8 MiB or more reads the peers' buffers, and so does a
    # broadcast of 8 MiB or more, its root writing part of every output; a
    # smaller one, and allgathers of any size, go through the stages.
    rank, size = world
    with restarted({"HVDMX_SHM_PUSH": "0"}):
        if size == 1:
            return
        limit = 8 << 20  # ShmAllreduce::kAutoDirectMinBytes; rows are 12 bytes
        for share, direct in [((limit - 1) // (12 * (size - 1)), False),
                              (-(-limit // (12 * (size - 1))), True)]:
            before = _core.stats()["shm"]["direct_exchanges"]
            check_alltoall(rank, size, share)
            assert _core.stats()["shm"]["direct_exchanges"] == before + direct, share
        for count, direct in [((limit - 1) // 12, False), (limit // 12 + 1, True)]:
            info = _core.stats()["shm"]
            before, wrote = info["direct_exchanges"], info["root_writes"]
            x = mx.nd.array(rows(rank, count))
            hvd.broadcast_(x, root_rank=size - 1)
            assert np.array_equal(x.asnumpy(), rows(size - 1, count))
            info = _core.stats()["shm"]
            assert info["direct_exchanges"] == before + direct, count
            assert info["root_writes"] == wrote + (direct and rank == size - 1), count
        before = _core.stats()["shm"]["direct_exchanges"]
        big = limit // 12 + 1
        got = hvd.allgather(mx.nd.array(rows(rank, big // size))).asnumpy()
        assert np.array_equal(got, np.concatenate([rows(r, big // size) for r in range(size)]))
        assert _core.stats()["shm"]["direct_exchanges"] == before
        hvd.barrier()


def test_auto_picks_by_size_and_stays_correct(world):
    rank, size = world
    with restarted({"HVDMX_ALLREDUCE_ALGO": "auto", "HVDMX_SHM_MIN_BYTES": "4096",
             "HVDMX_SHM_DIRECT_MIN_BYTES": "-1"}):
        cases = [("float32", 10), ("float32", 1024), ("float32", 100_003),
                 ("float16", 10), ("int8", 4096), ("float64", 511)]
        for dtype, count in cases:
            before = shm_calls()
            x = mx.nd.array(rank_input(rank, count, dtype, hvd.Sum), dtype=dtype)
            check(hvd.allreduce(x, op=hvd.Sum), expected(size, count, dtype, hvd.Sum))
            if size == 1:
                assert shm_calls() == -1
                continue
            # MPI below the threshold, except for float16 which MPI cannot reduce;
            # in a job without MPI, shared memory takes every size
            by_shm = count * np.dtype(dtype).itemsize >= 4096 or dtype == "float16" \
                or not hvd.mpi_enabled()
            assert shm_calls() == before + by_shm, (dtype, count)
        # Broadcast by the same threshold; allgather takes shared memory up to
        # 32 MiB of output (at every size where the ranks write into each
        # other's outputs, the default), alltoall at every size
        for count in [10, 1024]:
            before = shm_exchanges()
            x = mx.nd.array(rank_input(rank, count, "float32", hvd.Sum))
            got = hvd.broadcast(x, root_rank=size - 1).asnumpy()
            assert np.array_equal(got, rank_input(size - 1, count, "float32", hvd.Sum))
            assert shm_exchanges() == before + (size > 1 and count * 4 >= 4096)
        before = shm_exchanges()
        got = hvd.allgather(mx.nd.array(rows(rank, 2000))).asnumpy()
        assert np.array_equal(got, np.concatenate([rows(r, 2000) for r in range(size)]))
        assert shm_exchanges() == before + (size > 1)
        gathered = -(-(33 << 20) // (12 * size))  # rows per rank: over 32 MiB in all
        got = hvd.allgather(mx.nd.array(rows(rank, gathered))).asnumpy()
        assert np.array_equal(got, np.concatenate([rows(r, gathered) for r in range(size)]))
        assert shm_exchanges() == before + 2 * (size > 1)
        before = shm_exchanges()
        out = hvd.alltoall(mx.nd.array(rows(rank, 2000 * size)))
        assert out.shape == (2000 * size, 3)
        out.wait_to_read()
        assert shm_exchanges() == before + (size > 1)
        share = -(-1_400_000 // size)  # rows of 12 bytes: 16.8 MB per rank
        big = share * size
        out = hvd.alltoall(mx.nd.array(rows(rank, big))).asnumpy()
        assert np.array_equal(out, np.concatenate(
            [rows(s, big)[rank * share:(rank + 1) * share] for s in range(size)]))
        assert shm_exchanges() == before + 2 * (size > 1)
        # Reducescatter: through shared memory, one call per tensor, unless it
        # has a prescale (then the ring).
        x = mx.nd.array(rows(rank, 2 * size + 1))
        start = (2 * size + 1) // size * rank + min(rank, (2 * size + 1) % size)
        for prescale, tensors in [(1.0, 1), (2.0, 1), (1.0, 2)]:
            before = shm_calls()
            outs = hvd.grouped_reducescatter([x] * tensors, op=hvd.Sum,
                                             prescale_factor=prescale)
            want = sum(rows(r, 2 * size + 1) for r in range(size)) * prescale
            for out in outs:
                assert np.array_equal(out.asnumpy(), want[start:start + out.shape[0]])
            if size > 1:
                assert shm_calls() == before + (tensors if prescale == 1.0 else 0), prescale
        # No rank shuts down (restart) while another still reads its counters:
        # a peer's shutdown stops this rank's runtime too.
        hvd.barrier()


@pytest.mark.parametrize("algo", ["ring", "mpi"])
def test_other_algorithms_leave_shm_off(world, algo):
    with restarted({"HVDMX_ALLREDUCE_ALGO": algo}):
        assert shm_calls() == -1


@pytest.mark.parametrize("per_host", [1, 2])
def test_hierarchical_on_pretend_hosts(world, per_host):
    # Runs of per_host consecutive ranks play hosts. Hierarchical needs equal
    # hosts of more than one rank; otherwise the ring runs (one host: shm).
    rank, size = world
    restart({"HVDMX_ALLREDUCE_ALGO": "shm", "HVDMX_HIERARCHICAL_ALLREDUCE": "1",
             "HVDMX_TESTING_RANKS_PER_HOST": str(per_host), "HVDMX_SHM_CHUNK_BYTES": "4160"})
    try:
        info = _core.stats()["shm"]
        if size == 1 or per_host == 1 or (size > per_host and size % per_host):
            assert info is None
        elif size <= per_host:  # one host
            assert info["local_size"] == size and not info["hierarchical"]
        else:
            assert info["local_size"] == per_host and info["hierarchical"]
        for dtype in ["float32", "float16", "int64", "uint8"]:
            for op in [hvd.Sum, hvd.Min, hvd.Product]:
                for count in counts_for(size) + [17, 70_001]:
                    x = mx.nd.array(rank_input(rank, count, dtype, op), dtype=dtype)
                    check(hvd.allreduce(x, op=op), expected(size, count, dtype, op))
        rng = np.random.default_rng(rank)
        data = rng.standard_normal(100_001).astype(np.float32)
        assert all_equal_across_ranks(hvd.allreduce(mx.nd.array(data), op=hvd.Sum).asnumpy())
        # Byte moves take shared memory only on a single host
        before = shm_exchanges()
        got = hvd.allgather(mx.nd.array(rows(rank, 30_001 + rank))).asnumpy()
        assert np.array_equal(got, np.concatenate([rows(r, 30_001 + r) for r in range(size)]))
        got = hvd.broadcast(mx.nd.array(rows(rank, 30_001)), root_rank=size - 1).asnumpy()
        assert np.array_equal(got, rows(size - 1, 30_001))
        one_host = info is not None and not info["hierarchical"]
        assert shm_exchanges() == before + (2 if one_host else 0)
    finally:
        restart({})


def test_hierarchical_on_the_hosts(world):
    # As above on the real hosts, by MPI's host names: on one host nothing
    # changes (shm), across hosts of equal rank counts above one the
    # allreduce is hierarchical, and otherwise the ring runs.
    # tests/test_many_hosts.py runs this across test hosts.
    rank, size = world
    hosts = host_names()
    per_host = [hosts.count(h) for h in sorted(set(hosts))]
    restart({"HVDMX_ALLREDUCE_ALGO": "shm", "HVDMX_HIERARCHICAL_ALLREDUCE": "1",
             "HVDMX_SHM_CHUNK_BYTES": "4160"})
    try:
        info = _core.stats()["shm"]
        if size == 1 or (len(per_host) > 1 and (len(set(per_host)) > 1 or per_host[0] == 1)):
            assert info is None
        elif len(per_host) == 1:
            assert info["local_size"] == size and not info["hierarchical"]
        else:
            assert info["local_size"] == per_host[0] and info["hierarchical"]
        calls = -1 if info is None else info["calls"]
        # Every dtype with every op at the small counts; the large count (hundreds
        # of chunks a rank, the bulk of the bytes between the hosts) once a dtype
        # and once an op. Each pair's reduction at any count, on pretend hosts of
        # every shape, is test_shm_local.py's hypothesis test
        # (test_hierarchical_matches_reference); at 5 hosts x 2 the nine large
        # calls took most of a minute.
        *small, large = counts_for(size)
        for d, dtype in enumerate(["float32", "float16", "int64"]):
            for o, op in enumerate([hvd.Sum, hvd.Max, hvd.Product]):
                for count in small + [17] + ([large] if d == o else []):
                    x = mx.nd.array(rank_input(rank, count, dtype, op), dtype=dtype)
                    check_my_share(hvd.allreduce(x, op=op), rank, size, count, dtype, op)
        if info is not None:
            assert _core.stats()["shm"]["calls"] > calls
    finally:
        restart({})


@pytest.mark.parametrize("env", [{}, {"HVDMX_SHM_PUSH": "0"}, {"HVDMX_OUTPUT_POOL_BYTES": "0"}],
                         ids=["default", "push-off", "pool-off"])
def test_allgathers_and_alltoalls_write_into_peers_outputs(world, env):
    # By default, every rank's output from 64 KiB up comes from its shared
    # output file, and the peers write their rows straight into it; a call
    # where some rank's output is smaller takes the stages. Off when asked,
    # and when the output pool is off (outputs are MXNet's own memory).
    rank, size = world
    restart(env)
    try:
        info = _core.stats()["shm"]
        if size == 1:
            assert info is None
            return
        on = not env
        assert info["writes_into_peers"] == on
        if on:
            assert _core.stats()["output_pool"]["arena_used"] > 0
        # (share rows per rank, whether every output reaches 64 KiB): 12-byte rows
        for share, whole in [(-(-65536 // (12 * size)), True), (65536 // (12 * size) - 1, False),
                             (300_001, True)]:
            before = _core.stats()["shm"]
            got = check_allgather(rank, size, share, 1)
            check_alltoall(rank, size, share, 2)
            assert all_equal_across_ranks(got)
            after = _core.stats()["shm"]
            assert after["exchanges"] == before["exchanges"] + 2
            pushed = after["push_exchanges"] - before["push_exchanges"]
            assert pushed == (2 if on and whole else 0), share
        # Over 32 MiB of output: written into the peers' outputs when on, by
        # the ring (MPI) when not.
        gathered = -(-(33 << 20) // (12 * size))
        before = _core.stats()["shm"]
        got = hvd.allgather(mx.nd.array(rows(rank, gathered))).asnumpy()
        assert np.array_equal(got, np.concatenate([rows(r, gathered) for r in range(size)]))
        after = _core.stats()["shm"]
        assert after["exchanges"] - before["exchanges"] == on
        assert after["push_exchanges"] - before["push_exchanges"] == on
        # Ragged: rank 0 receives nothing from an alltoall, so no rank writes.
        splits = [0] + [3000] * (size - 1)
        before = _core.stats()["shm"]["push_exchanges"]
        out, received = hvd.alltoall(mx.nd.array(rows(rank, 3000 * (size - 1), 3)),
                                     splits=splits)
        assert received.asnumpy().tolist() == ([0] * size if rank == 0 else [3000] * size)
        assert _core.stats()["shm"]["push_exchanges"] == before
        hvd.barrier()
    finally:
        restart({})
