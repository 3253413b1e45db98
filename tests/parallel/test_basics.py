import os

import mxnet as mx
import pytest
from mpi4py import MPI

import hvdmx as hvd
from conftest import MPI_JOB, host_names, needs_mpi, shutdown_together, world_barrier, \
    world_rank


@needs_mpi
def test_rank_and_size_match_mpi():
    assert hvd.is_initialized()
    assert hvd.size() == MPI.COMM_WORLD.Get_size()
    assert hvd.rank() == MPI.COMM_WORLD.Get_rank()


def expected_topology():
    """(local_rank, local_size, cross_rank, cross_size) of this rank, worked
    out from each rank's host name: on one host every rank is local and there
    is one "cross" group; across hosts (tests/test_many_hosts.py runs this
    file on test hosts) the local ranks count within each host and the cross
    ranks among the ranks of the same local rank."""
    hosts = host_names()
    rank = world_rank()
    local = [r for r, host in enumerate(hosts) if host == hosts[rank]]
    local_rank = local.index(rank)
    local_ranks = [[r for r, host in enumerate(hosts) if host == h].index(r)
                   for r, h in enumerate(hosts)]
    cross = [r for r, lr in enumerate(local_ranks) if lr == local_rank]
    return local_rank, len(local), cross.index(rank), len(cross)


@pytest.mark.skipif(MPI_JOB, reason="tests a job that hvdmxrun started without MPI")
def test_without_mpi_the_launcher_places_the_ranks_and_comm_is_refused():
    assert (hvd.rank(), hvd.size()) == (int(os.environ["HVDMX_RANK"]),
                                        int(os.environ["HVDMX_SIZE"]))
    shutdown_together()
    try:
        with pytest.raises(ValueError, match="argument 'comm' needs MPI, but hvdmxrun started "
                                             "this job without MPI"):
            hvd.init(comm=[0])
        with pytest.raises(ValueError, match="needs MPI"):
            hvd.init(comm=MPI.COMM_WORLD)
    finally:
        hvd.init()
    assert (hvd.rank(), hvd.size()) == (int(os.environ["HVDMX_RANK"]),
                                        int(os.environ["HVDMX_SIZE"]))


def test_topology_matches_the_hosts():
    assert (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
            hvd.cross_size()) == expected_topology()


def test_second_init_is_a_noop():
    before = (hvd.rank(), hvd.size())
    hvd.init()
    assert (hvd.rank(), hvd.size()) == before


def test_build_flags():
    assert hvd.mpi_built() is True
    # hvdmxrun --no-mpi tells its ranks where the rendezvous is.
    assert hvd.mpi_enabled() is ("HVDMX_RENDEZVOUS" not in os.environ)
    assert hvd.nccl_built() == 0
    assert hvd.cuda_built() is False
    assert hvd.gloo_built() is False
    assert hvd.ccl_built() is False
    if hvd.mpi_enabled():
        assert hvd.mpi_threads_supported() is True
    else:
        with pytest.raises(ValueError, match="started without MPI"):
            hvd.mpi_threads_supported()


def test_init_after_shutdown_works():
    shutdown_together()
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.rank()
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.allreduce(mx.nd.ones((2,)))
    hvd.init()
    out = hvd.allreduce(mx.nd.ones((3,)) * (hvd.rank() + 1), op=hvd.Sum)
    n = hvd.size()
    assert out.asnumpy().tolist() == [n * (n + 1) / 2] * 3


@needs_mpi
def test_init_with_mpi4py_communicator():
    shutdown_together()
    hvd.init(comm=MPI.COMM_WORLD)
    assert hvd.size() == MPI.COMM_WORLD.Get_size()
    out = hvd.allreduce(mx.nd.ones((2,)), op=hvd.Sum)
    assert out.asnumpy().tolist() == [hvd.size()] * 2


@needs_mpi
def test_init_with_split_communicator():
    # Even and odd world ranks each form a job of their own.
    world = MPI.COMM_WORLD
    sub = world.Split(world.Get_rank() % 2, world.Get_rank())
    shutdown_together()
    hvd.init(comm=sub)
    try:
        assert hvd.size() == sub.Get_size()
        assert hvd.rank() == sub.Get_rank()
        out = hvd.allreduce(mx.nd.ones((2,)) * world.Get_rank(), op=hvd.Sum)
        expected = sum(r for r in range(world.Get_size()) if r % 2 == world.Get_rank() % 2)
        assert out.asnumpy().tolist() == [expected] * 2
    finally:
        hvd.shutdown()
        sub.Free()
        hvd.init()


@needs_mpi
def test_init_rejects_bad_comm():
    shutdown_together()
    try:
        with pytest.raises(TypeError, match="'comm'"):
            hvd.init(comm="world")
        with pytest.raises(ValueError, match="'comm'"):
            hvd.init(comm=[MPI.COMM_WORLD.Get_size()])
    finally:
        hvd.init()


def runtime_threads():
    """How many hvdmx background threads this process has."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended while we looked
            pass
    return names.count("hvdmx-runtime")


def test_shutdown_fails_pending_ops_and_joins_the_thread(world):
    rank, size = world
    assert runtime_threads() == 1
    # With two or more ranks, a name no other rank submits stays pending.
    lonely = hvd.allreduce(mx.nd.ones((2,)), name=f"lonely.{rank}") if size > 1 else None
    shutdown_together()
    assert runtime_threads() == 0
    if lonely is not None:
        with pytest.raises(mx.base.MXNetError, match="has been shut down"):
            lonely.wait_to_read()
    hvd.init()
    assert runtime_threads() == 1
    still = hvd.allreduce(mx.nd.ones((2,)), name="lonely.all", op=hvd.Sum)
    assert still.asnumpy().tolist() == [size] * 2


def test_shutdown_on_one_rank_stops_every_rank(world):
    rank, size = world
    if size == 1:
        pytest.skip("needs a second rank")
    topology = expected_topology()  # collective: before rank 0 goes its own way
    # Rank 0 shuts down once the others have submitted a call it never makes.
    if rank == 0:
        shutdown_together()
        with pytest.raises(ValueError, match="has not been initialized, or has been shut down"):
            hvd.rank()
    else:
        out = hvd.allreduce(mx.nd.ones((1,)), name="after-peer-shutdown")
        world_barrier()
        with pytest.raises(mx.base.MXNetError, match="has been shut down by another rank"):
            out.wait_to_read()
        assert not hvd.is_initialized()
        # Later calls say who stopped hvdmx, not that this rank never started it.
        with pytest.raises(ValueError, match="shut down by another rank.*hvd.init\\(\\) again"):
            hvd.allgather(mx.nd.ones((1,)))
        with pytest.raises(ValueError, match="shut down by another rank"):
            hvd.add_process_set([0, rank])
        with pytest.raises(ValueError, match="shut down by another rank"):
            hvd.start_timeline("never-written.json")
        # Where this rank is in the job still answers until its own shutdown,
        # as in Horovod: a handler of the error above can log it.
        assert (hvd.rank(), hvd.size()) == (rank, size)
        assert (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(),
                hvd.cross_size()) == topology
        if hvd.mpi_enabled():
            assert hvd.mpi_threads_supported() is True
        else:
            with pytest.raises(ValueError, match="started without MPI"):
                hvd.mpi_threads_supported()
    hvd.init()
    out = hvd.allreduce(mx.nd.ones((1,)), name="after-restart", op=hvd.Sum)
    assert out.asnumpy().tolist() == [size]
