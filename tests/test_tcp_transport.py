"""hvdmx's own TCP transport (csrc/hvdmx/comm/tcp_comm.h) on one host: chosen by
HVDMX_TRANSPORT, every collective correct and identical on every rank over it, and
its bad input. Across real hosts (where `auto` picks it) it runs in
tests/test_many_hosts.py."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
MPIEXEC = os.path.join(os.path.dirname(PYTHON), "mpiexec")
ENV = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1",
           MXNET_ENGINE_TYPE="ThreadedEnginePerDevice")
pytestmark = pytest.mark.timeout(400)


def run(argv, env=None, timeout=300):
    result = subprocess.run(argv, cwd=REPO, env=dict(ENV, **(env or {})), capture_output=True,
                            text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return result.returncode, result.stdout, result.stderr


# Each setting in turn in one job (hvdmx reads HVDMX_TRANSPORT at each
# init; its ranks take seconds each to start): every rank's transport, the
# job's and a process set's.
SETTINGS = [(None, "mpi"), ("auto", "mpi"), ("tcp", "tcp"), ("mpi", "mpi")]
REPORT = """
import os, sys
from mpi4py import MPI
import hvdmx as hvd
for setting in sys.argv[1:]:
    if setting == "None":
        os.environ.pop("HVDMX_TRANSPORT", None)
    else:
        os.environ["HVDMX_TRANSPORT"] = setting
    hvd.init()
    import hvdmx._core as core  # loaded by init, after MPI
    s = hvd.add_process_set([0, 1])
    row = [setting, hvd.rank(), core.transport(),
           core.transport(s.process_set_id) if s.included() else "-"]
    rows = MPI.COMM_WORLD.gather(row, root=0)
    if hvd.rank() == 0:
        for r in rows:
            print("rank", *r, flush=True)
    MPI.COMM_WORLD.Barrier()
    hvd.shutdown()
"""


@pytest.fixture(scope="module")
def transports():
    """{setting: the rows of rank, its transport and its set's} of one job
    at 3 ranks; the setting None is HVDMX_TRANSPORT unset."""
    code, out, err = run([MPIEXEC, "-n", "3", PYTHON, "-c", REPORT,
                          *[str(setting) for setting, _ in SETTINGS]])
    assert code == 0, err
    rows = {}
    for line in out.splitlines():
        if line.startswith("rank "):
            _, setting, *row = line.split()
            rows.setdefault(setting, []).append(["rank", *row])
    return rows


@pytest.mark.parametrize("setting, expected", SETTINGS)
def test_the_transport_follows_the_setting(setting, expected, transports):
    # On one host `auto` is MPI; process sets take the job's setting.
    assert sorted(transports[str(setting)]) == [
        ["rank", "0", expected, expected], ["rank", "1", expected, expected],
        ["rank", "2", expected, "-"]]


# Every allreduce through the transport (HVDMX_ALLREDUCE_ALGO=mpi keeps shared
# memory out: small ones exchanged, large ones on the ring), broadcasts and
# negotiation of every kind, process sets, join, barrier and objects.
FILES = ["test_allreduce.py", "test_basics.py", "test_join_barrier_objects.py",
         "test_process_sets.py", "test_errors.py", "test_training.py"]


# Three ranks only: two hosts of one rank each run the same files over TCP in
# tests/test_many_hosts.py (where test hosts can be made), and three ranks
# have a rank that is neither the ring's first nor its last.
@pytest.mark.parametrize("nranks", [3])
def test_parallel_tests_over_tcp(nranks, tmp_path):
    argv = [MPIEXEC, "-n", str(nranks), PYTHON, "-m", "pytest", "-q", "-x", "-p",
            "no:cacheprovider", "--timeout=120", "--timeout-method=thread",
            "--hypothesis-seed=0", *[f"tests/parallel/{f}" for f in FILES]]
    code, out, err = run(argv, {"HVDMX_TRANSPORT": "tcp", "HVDMX_ALLREDUCE_ALGO": "mpi"},
                         timeout=380)
    assert code == 0, f"{out[-5000:]}\n{err[-3000:]}"
    assert " passed" in out and " failed" not in out, out[-2000:]


def test_six_ranks_negotiate_by_recursive_doubling(tmp_path):
    # Beyond 4 ranks the bit-and is recursive doubling (6: two ranks folded in), new
    # names are gathered up the tree, and each rank links only with its partners:
    # the files that use the slow path most (mismatches, join, process sets).
    files = ["test_basics.py", "test_join_barrier_objects.py", "test_errors.py",
             "test_process_sets.py"]
    argv = [MPIEXEC, "-n", "6", PYTHON, "-m", "pytest", "-q", "-x", "-p",
            "no:cacheprovider", "--timeout=120", "--timeout-method=thread",
            "--hypothesis-seed=0", *[f"tests/parallel/{f}" for f in files]]
    code, out, err = run(argv, {"HVDMX_TRANSPORT": "tcp", "HVDMX_ALLREDUCE_ALGO": "mpi"},
                         timeout=380)
    assert code == 0, f"{out[-5000:]}\n{err[-3000:]}"
    assert out.count(" passed") == 6 and " failed" not in out, out[-2000:]


def test_an_interface_without_an_address_fails_init_naming_it():
    code, out, err = run([MPIEXEC, "-n", "2", PYTHON, "-c", "import hvdmx; hvdmx.init()"],
                         {"HVDMX_TRANSPORT": "tcp", "HVDMX_TCP_IFACE": "nosuch0"}, timeout=120)
    assert code != 0
    assert ("HVDMX_TCP_IFACE=nosuch0 is not an interface with an IPv4 address on this host "
            "(lo (127.0.0.1)") in err, err


def test_a_transport_that_differs_between_ranks_is_refused():
    # Each rank writes its error in one write, so that the two cannot interleave.
    script = ("import sys, hvdmx\ntry:\n    hvdmx.init()\nexcept ValueError as e:\n"
              "    sys.stdout.write(str(e) + '\\n'); sys.stdout.flush()\n")
    code, out, err = run([MPIEXEC, "-n", "1", "-env", "HVDMX_TRANSPORT", "tcp", PYTHON, "-c",
                          script, ":", "-n", "1", "-env", "HVDMX_TRANSPORT", "mpi", PYTHON,
                          "-c", script], timeout=120)
    assert code == 0, err
    assert out.count("HVDMX_TRANSPORT differs between ranks (rank 0: tcp, rank 1: mpi)") == 2, out


KILLED = """
import os, signal, sys, time
import mxnet as mx
import hvdmx as hvd
hvd.init()
for step in range(100000):
    if step == 20 and hvd.rank() == hvd.size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        hvd.allreduce(mx.nd.ones((1000,)), name=f"step.{step % 4}").wait_to_read()
    except mx.base.MXNetError as e:
        sys.stdout.write(f"rank {hvd.rank()}: {e}\\n")  # one write: lines cannot interleave
        sys.stdout.flush()
        break
time.sleep(1)
"""


def test_a_killed_peer_fails_the_others_naming_it():
    # The kernel closes the dead rank's connections; the survivors' waits see
    # it at once (no stall shutdown time is set) and name the rank.
    code, out, err = run([MPIEXEC, "-disable-auto-cleanup", "-n", "3", PYTHON, "-c", KILLED],
                         {"HVDMX_TRANSPORT": "tcp", "HVDMX_ALLREDUCE_ALGO": "mpi"},
                         timeout=120)
    assert code != 0
    lines = [line for line in out.splitlines() if line.startswith("rank")]
    assert sorted(line.split(":")[0] for line in lines) == ["rank 0", "rank 1"], out + err
    for line in lines:
        assert "was closed by that rank" in line or "has been shut down by another rank" in line \
            or "rank 2 (host" in line, line
    assert any("the connection to rank 2 (host" in line for line in lines), out


INIT_REPORT = ("import sys, hvdmx\ntry:\n    hvdmx.init()\n    sys.stdout.write('joined\\n')\n"
               "except Exception as e:\n"
               "    sys.stdout.write(type(e).__name__ + ': ' + str(e) + '\\n')\n"
               "sys.stdout.flush()\n")
KEY_A, KEY_B = "a1" * 32, "b2" * 32


def test_ranks_with_different_keys_refuse_each_other_on_every_rank():
    code, out, err = run([MPIEXEC, "-n", "1", "-env", "HVDMX_SECRET_KEY", KEY_A, PYTHON, "-c",
                          INIT_REPORT, ":", "-n", "1", "-env", "HVDMX_SECRET_KEY", KEY_B, PYTHON,
                          "-c", INIT_REPORT], {"HVDMX_TRANSPORT": "tcp"}, timeout=120)
    lines = out.splitlines()
    assert len(lines) == 2 and "joined" not in out, out + err
    for line in lines:
        assert "do not hold the same secret key" in line, line
    assert any("rank 1 (host" in line for line in lines) and \
        any("rank 0 (host" in line for line in lines), out
    assert KEY_A not in out + err and KEY_B not in out + err


def test_a_key_set_for_some_ranks_only_is_refused_at_init():
    code, out, err = run([MPIEXEC, "-n", "1", PYTHON, "-c", INIT_REPORT, ":", "-n", "2", "-env",
                          "HVDMX_SECRET_KEY", KEY_A, PYTHON, "-c", INIT_REPORT],
                         {"HVDMX_TRANSPORT": "tcp"}, timeout=120)
    assert code == 0, err
    assert out.count("ValueError: hvdmx.init: HVDMX_SECRET_KEY is set for rank 1 but not for "
                     "rank 0") == 3, out


def test_ranks_that_share_a_key_of_their_own_run():
    code, out, err = run([MPIEXEC, "-n", "2", PYTHON, "-c", INIT_REPORT],
                         {"HVDMX_TRANSPORT": "tcp", "HVDMX_SECRET_KEY": KEY_A}, timeout=120)
    assert code == 0 and out.split() == ["joined", "joined"], out + err
