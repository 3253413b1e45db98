"""Multi-rank tests: every rank runs this pytest session under mpiexec, or
under hvdmxrun --no-mpi (tests/test_run_nompi.py runs the suite so).

A test that fails on one rank aborts the whole job at once (MPI_Abort; in a
job without MPI the rank exits and hvdmxrun stops the others), so the other
ranks never wait for a collective that will not come.

The tests' own exchanges between ranks outside hvdmx (barriers, comparing
results) go through ``world_allgather`` and the helpers below: MPI, or in a
job without MPI a group of the launcher's rendezvous.
"""
import hashlib
import os
import pickle
import socket
import sys
import time
import traceback

import pytest

# MPICH's ranks poll without pause while they wait (in the tests' barriers and
# comparisons over mpi4py below, and in every MPI transfer): with more ranks
# than cores (four here on two) a waiting rank takes the core from the rank it
# waits for. Its progress throttle makes a poll that found nothing 64 times in
# a row sleep for a moment instead (a fifth off the 3- and 4-rank runs here;
# none off the runs across test hosts, whose MPI goes over TCP; no result
# changes). Set before MPI starts (mpi4py.MPI's import); a job's own settings
# win.
os.environ.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE", "1")
os.environ.setdefault("MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT", "64")

import hvdmx as hvd  # noqa: E402
import progress  # noqa: E402
from hvdmx import _core, _job  # noqa: E402 (before mpi4py.MPI: see hvdmx/basics.py)
from mpi4py import MPI  # noqa: E402

# The tests' module, _hvdmx_testing (setup.py build_ext builds it), is in tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_config = None
# The CPUs the launcher let this rank run on, before hvd.init() could bind it
# (test_cpu_binding.py).
launch_cpus = sorted(os.sched_getaffinity(0))


# Whether this job runs on MPI (mpiexec) or without (hvdmxrun --no-mpi).
MPI_JOB = hvd.mpi_enabled()
needs_mpi = pytest.mark.skipif(not MPI_JOB, reason="tests what hvdmx does with MPI "
                               "communicators; this job was started without MPI")
_oob = None  # without MPI: the tests' own group at the rendezvous
_progress = None  # what this rank has run, for tests/run_parallel.py (progress.py)


def pytest_configure(config):
    global _config, _oob, _progress
    _config = config
    hvd.init()
    if not MPI_JOB:
        _oob = _job.group.split(0, hvd.rank())
    _progress = progress.register(config, world_rank())


def world_rank() -> int:
    """This process's rank in the job, also while hvdmx is shut down."""
    return MPI.COMM_WORLD.Get_rank() if MPI_JOB else _oob.rank


def world_allgather(obj) -> list:
    """Every rank's ``obj``, in rank order, outside hvdmx."""
    if MPI_JOB:
        return MPI.COMM_WORLD.allgather(obj)
    return [pickle.loads(b) for b in _oob.allgather(pickle.dumps(obj))]


def world_barrier() -> None:
    world_allgather(None)


def world_bcast(obj, root=0):
    return world_allgather(obj if world_rank() == root else None)[root]


def host_names() -> list:
    """Every rank's host name, in rank order (MPI's processor name is the same)."""
    return world_allgather(socket.gethostname())


def host_allgather(obj) -> list:
    """The ``obj`` of every rank of this host, in rank order (the host as
    hvdmx sees it: MPI_COMM_TYPE_SHARED, or the host name without MPI)."""
    everyone = world_allgather(obj)
    mine = next(ranks for ranks in _core.hosts() if hvd.rank() in ranks)
    return [everyone[r] for r in mine]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        _abort(f"{item.nodeid} FAILED ({report.when}):\n{report.longreprtext}")


def _abort(why):
    rank = world_rank()
    if _progress is not None:
        # "NODEID (call)": the test running now, which the job ends with.
        _progress.failing(os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0])
    # Inside a test pytest captures stderr, and MPI_Abort would lose it.
    capture = _config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    sys.stderr.write(f"\n[rank {rank}] {why}\n[rank {rank}] aborting the job\n")
    sys.stderr.flush()
    # mpiexec stops forwarding a rank's output once the abort kills it.
    time.sleep(0.5)
    if MPI_JOB:
        MPI.COMM_WORLD.Abort(1)
    os._exit(1)  # hvdmxrun --no-mpi stops the other ranks


@pytest.fixture
def world():
    """(rank, size) of the job."""
    return hvd.rank(), hvd.size()


def restart(env):
    """Shuts hvdmx down and starts it again under extra environment variables.

    Every rank first waits for the others to get here: a rank's shutdown
    stops every rank's runtime at the next negotiation round, and a slower
    rank may still be running the previous test's last asynchronous call.
    Called from a `finally` that a failure is passing through, it aborts the
    job instead: the other ranks may be waiting in a collective this rank
    will not make, and would meet the barrier only at the test's timeout.
    """
    failure = sys.exc_info()[1]
    if failure is not None and not isinstance(failure, pytest.skip.Exception):
        _abort("failed before restart():\n" + "".join(traceback.format_exception(failure)))
    world_barrier()
    _retired["exchanges"] += shm_exchanges()
    hvd.shutdown()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        hvd.init()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def shutdown_together():
    """hvd.shutdown() once every rank has got here. One rank's shutdown stops
    every rank's runtime at its next negotiation round, so without the
    barrier a slower rank still in the previous test (an hvd.rank(), a call
    not yet submitted) would find hvdmx stopped under it."""
    world_barrier()
    hvd.shutdown()


def all_equal_across_ranks(array) -> bool:
    """True when every rank holds the same bytes (compared by a 256-bit
    BLAKE2b digest, so that a large result does not travel to every rank)."""
    digest = hashlib.blake2b(array.tobytes(), digest_size=32).digest()
    return all(d == digest for d in world_allgather(digest))


def shm_exchanges() -> int:
    """Broadcasts, allgathers and alltoalls that shared memory has carried
    in the running runtime (0 when hvdmx is not running)."""
    if not _core.is_initialized():
        return 0
    info = _core.stats()["shm"]
    return 0 if info is None else info["exchanges"]


# What the runtimes that restart() shut down had carried, so that a count
# taken before a test that restarts hvdmx still compares with one after it.
_retired = {"exchanges": 0}


def all_shm_exchanges() -> int:
    return _retired["exchanges"] + shm_exchanges()


@pytest.fixture(scope="module", params=["shm", "mpi"])
def transport(request):
    """Runs a module's tests once per way their bytes travel on one host:
    shared memory (HVDMX_ALLREDUCE_ALGO=shm: broadcast, allgather and
    alltoall too) and MPI (HVDMX_ALLREDUCE_ALGO=mpi). Checks that shared
    memory really carried the first run."""
    restart({"HVDMX_ALLREDUCE_ALGO": request.param})
    if request.param == "mpi":
        assert _core.stats()["shm"] is None
    before = all_shm_exchanges()
    yield request.param
    # Across hosts (tests/test_many_hosts.py) these calls take MPI.
    if request.param == "shm" and 1 < hvd.size() == hvd.local_size():
        assert all_shm_exchanges() > before, "shared memory carried none of the calls"
    restart({})
