"""hvd.init over a group object (what a job started without MPI runs on:
the launcher's rendezvous, hvdmx/rendezvous/client.py): here a group whose
allgather and split go through mpi4py, so that the core's whole start-up
over a Python group (csrc/hvdmx/python/bindings.cc, PyGroup; comm/group.h)
runs at every rank count of the parallel suite, with hosts, shared memory,
process sets and TCP between the ranks, and its results are checked
against the MPI start's."""
import secrets

import mxnet as mx
import numpy as np
import pytest
from mpi4py import MPI

import hvdmx as hvd
from hvdmx import _core
from conftest import restart

pytestmark = pytest.mark.skipif(not hvd.mpi_enabled(), reason="compares with MPI's start")


class MpiBackedGroup:
    """The interface of hvdmx.rendezvous.client.StoreGroup, over an mpi4py
    communicator; counts its calls."""

    def __init__(self, comm, calls):
        self.comm, self.calls = comm, calls
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def allgather(self, data: bytes):
        assert isinstance(data, bytes)
        self.calls["allgather"] += 1
        return self.comm.allgather(data)

    def split(self, color: int, key: int):
        self.calls["split"] += 1
        sub = self.comm.Split(color if color >= 0 else MPI.UNDEFINED, key)
        return None if sub == MPI.COMM_NULL else MpiBackedGroup(sub, self.calls)


def data(rank, n=1000):
    # Not periodic in the index or the rank: a misplaced block changes sums.
    i = np.arange(n, dtype=np.int64)
    return ((i * 2654435761 + (rank + 1) * 40503) % 1000003).astype(np.float32)


@pytest.fixture
def job_key(monkeypatch):
    """One secret key for every rank, as hvdmxrun --no-mpi gives them: the
    group never carries one."""
    key = MPI.COMM_WORLD.bcast(secrets.token_hex(32) if hvd.rank() == 0 else None)
    monkeypatch.setenv("HVDMX_SECRET_KEY", key)
    return key


def start_over_group(calls):
    MPI.COMM_WORLD.Barrier()
    hvd.shutdown()
    _core.init_group(MpiBackedGroup(MPI.COMM_WORLD, calls))


def test_a_job_started_over_a_group_runs_as_the_mpi_start_does(job_key):
    mpi_shape = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(),
                 hvd.cross_rank(), hvd.cross_size())
    mpi_hosts = _core.hosts()
    calls = {"allgather": 0, "split": 0}
    try:
        start_over_group(calls)
        assert calls["allgather"] > 0 and calls["split"] > 0
        assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(),
                hvd.cross_rank(), hvd.cross_size()) == mpi_shape
        assert _core.hosts() == mpi_hosts
        assert sorted(r for host in _core.hosts() for r in host) == list(range(hvd.size()))
        # TCP between every rank: there is no MPI communicator beneath.
        assert _core.stats()["negotiation"]["scheme"] != "mpi"
        out = hvd.allreduce(mx.nd.array(data(hvd.rank())), op=hvd.Sum, name="group.sum")
        want = sum(data(r).astype(np.float64) for r in range(hvd.size()))
        np.testing.assert_array_equal(out.asnumpy(), want.astype(np.float32))
        gathered = MPI.COMM_WORLD.allgather(out.asnumpy().tobytes())
        assert all(g == gathered[0] for g in gathered), "results differ between ranks"
        # A process set is a split of the group.
        if hvd.size() > 1:
            evens = hvd.add_process_set(list(range(0, hvd.size(), 2)))
            if evens.included():
                got = hvd.allreduce(mx.nd.array([hvd.rank()]), op=hvd.Sum, name="group.evens",
                                    process_set=evens)
                assert got.asnumpy()[0] == sum(range(0, hvd.size(), 2))
            hvd.remove_process_set(evens)
    finally:
        restart({})
    assert _core.stats()["negotiation"]["scheme"] is not None


class BadGroup(MpiBackedGroup):
    def __init__(self, comm, calls, how):
        super().__init__(comm, calls)
        self.how = how
        if how == "rank":
            self.rank = self.size

    def allgather(self, data):
        if self.how == "raises":
            raise TimeoutError("the rendezvous did not hear from rank 7")
        if self.how == "short":
            return super().allgather(data)[:-1]
        return super().allgather(data)


@pytest.mark.parametrize("how, error, text", [
    ("no key", ValueError, r"HVDMX_SECRET_KEY is not set, and this job's ranks meet through a "
                           r"rendezvous on the network, which must not carry a key"),
    ("rank", ValueError, r"says rank \d+ of \d+; a rank is in \[0, size\)"),
    ("raises", TimeoutError, "did not hear from rank 7"),
    ("short", RuntimeError, r"answered an allgather with \d+ entries for a group of \d+"),
])
def test_a_group_that_misbehaves_fails_init_with_its_reason(how, error, text, job_key,
                                                          monkeypatch):
    if how == "no key":
        monkeypatch.delenv("HVDMX_SECRET_KEY")
    # Every rank gets the same answer, so no rank waits for another.
    MPI.COMM_WORLD.Barrier()
    hvd.shutdown()
    try:
        with pytest.raises(error, match=text):
            _core.init_group(BadGroup(MPI.COMM_WORLD, {"allgather": 0, "split": 0}, how))
        assert not hvd.is_initialized()
    finally:
        restart({})
