"""What hvdmx hands to MPI goes onto huge pages first when a peer shares the
host (Note [Huge pages under what peers read] in csrc/hvdmx/platform/huge_pages.h):
each whole 2 MiB page of the buffer is asked about once, results are
unchanged, and HVDMX_HUGE_PAGES=0 asks about none. Every rank of these runs
is on this host, so a peer shares it whenever there are two ranks or more.
HVDMX_ALLREDUCE_ALGO=ring or mpi keeps every call off shared memory."""
import mxnet as mx
import numpy as np
import pytest

import hvdmx as hvd
from hvdmx import _core
from conftest import all_equal_across_ranks, restart
from helpers import expected, mxnet_address, my_rows, rank_input, restarted

HUGE = 2 << 20
ROWS = 3 << 20  # float32 elements: 12 MiB, five or six whole huge pages


def whole_huge_pages(array):
    """The 2 MiB pages that lie wholly inside `array`'s memory."""
    array.wait_to_read()
    start = mxnet_address(array)
    end = start + array.size * array.dtype(0).itemsize
    return max(0, end // HUGE - (start + HUGE - 1) // HUGE)


def asked():
    """Huge pages collapsed or refused so far for MPI's buffers."""
    info = _core.stats()["mpi_huge_pages"]
    return info["collapsed"] + info["refused"]


def rows(rank, count):
    return (np.arange(count, dtype=np.float32) % 97 + rank * 100).astype(np.float32)


@pytest.fixture(params=["ring", "mpi"])
def mpi_paths(request, world):
    """hvdmx restarted with allreduces on `ring` or `mpi`: broadcasts then go
    by MPI_Bcast, allgathers by the ring and alltoalls point to point."""
    with restarted({"HVDMX_ALLREDUCE_ALGO": request.param}):
        yield request.param


def test_each_whole_page_is_asked_about_once(mpi_paths):
    rank, size = hvd.rank(), hvd.size()
    assert _core.stats()["mpi_huge_pages"]["enabled"] == (size > 1)
    peers = 1 if size > 1 else 0
    x = mx.nd.array(rank_input(rank, ROWS, "float32", hvd.Sum))
    b = mx.nd.array(rows(rank, ROWS))
    a = mx.nd.array(rows(rank, ROWS // size * size))
    pages = [whole_huge_pages(t) for t in (x, b, a)]
    assert min(pages) >= 5
    for step in range(2):  # the second time, every page has been asked about
        before = asked()
        got = hvd.allreduce_(x, op=hvd.Sum, name="x").asnumpy()
        want = expected(size, ROWS, "float32", hvd.Sum) * size ** step
        assert np.array_equal(got, want.astype(np.float32)) and all_equal_across_ranks(got)
        assert asked() == before + (pages[0] * peers if step == 0 else 0)
    before = asked()
    got = hvd.broadcast_(b, root_rank=size - 1, name="b").asnumpy()
    assert np.array_equal(got, rows(size - 1, ROWS))
    assert asked() == before + pages[1] * peers
    before = asked()
    got = hvd.alltoall(a, name="a").asnumpy()
    share = ROWS // size
    assert np.array_equal(got, np.concatenate(
        [rows(s, share * size)[rank * share:(rank + 1) * share] for s in range(size)]))
    assert asked() == before + pages[2] * peers
    before = asked()
    out = hvd.allgather(mx.nd.array(rows(rank, ROWS // 2)), name="g")
    got = out.asnumpy()
    assert np.array_equal(got, np.concatenate([rows(r, ROWS // 2) for r in range(size)]))
    assert asked() == before + whole_huge_pages(out) * peers


def test_reducescatter_pieces_on_the_ring(world):
    # Its pieces go through the fusion buffer, whose pages hold whole huge
    # pages once a piece is larger than one.
    rank, size = world
    with restarted({"HVDMX_ALLREDUCE_ALGO": "ring", "HVDMX_FUSION_PIECE_BYTES": str(8 << 20)}):
        x = mx.nd.array(rank_input(rank, ROWS, "float32", hvd.Sum))
        before = asked()
        got = hvd.reducescatter(x, op=hvd.Sum).asnumpy()
        start, end = my_rows(ROWS, size, rank)
        want = expected(size, ROWS, "float32", hvd.Sum)[start:end]
        assert np.array_equal(got, want)
        assert (asked() > before) == (size > 1)


def test_off_with_huge_pages_0(world):
    # Neither what MPI moves nor what shared memory's direct exchanges read.
    rank, size = world
    # (Direct reads only where the alltoall does not write into the peers' outputs.)
    for env in [{"HVDMX_ALLREDUCE_ALGO": "ring"},
                {"HVDMX_SHM_DIRECT_MIN_BYTES": "0", "HVDMX_SHM_PUSH": "0"}]:
        restart({"HVDMX_HUGE_PAGES": "0", **env})
        try:
            assert not _core.stats()["mpi_huge_pages"]["enabled"]
            x = mx.nd.array(rank_input(rank, ROWS, "float32", hvd.Sum))
            got = hvd.allreduce_(x, op=hvd.Sum).asnumpy()
            assert np.array_equal(got, expected(size, ROWS, "float32", hvd.Sum))
            share = ROWS // size
            got = hvd.alltoall(mx.nd.array(rows(rank, share * size))).asnumpy()
            assert np.array_equal(got, np.concatenate(
                [rows(s, share * size)[rank * share:(rank + 1) * share] for s in range(size)]))
            assert asked() == 0
            shm = _core.stats()["shm"]
            if shm is not None:
                assert shm["collapsed_huge_pages"] + shm["refused_huge_pages"] == 0
                assert shm["direct_exchanges"] == ("HVDMX_SHM_DIRECT_MIN_BYTES" in env)
        finally:
            restart({})
