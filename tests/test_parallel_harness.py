"""The multi-rank test harness itself (tests/parallel/conftest.py): a rank
that fails ends the whole job at once, even when the failure passes through
a `finally` that restarts hvdmx while the other ranks wait in a collective;
tests/run_parallel.py's restart after the test a job stopped at, so that a
failure or a hang hides no other test; and run_all.sh's check of the rank
counts it is given, and its count of a run that collects no test as a
failure."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ENV = dict(os.environ, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1",
           PYTHONPATH=os.pathsep.join([os.path.abspath(ROOT)]
                                      + os.environ.get("PYTHONPATH", "").split(os.pathsep)))

# The files of tests/ that a copy of tests/parallel's harness needs.
HARNESS = ("parallel/conftest.py", "parallel/helpers.py", "parallel/progress.py", "rank_data.py")

FAILS_MID_LOOP = '''
import mxnet as mx
import hvdmx as hvd
from conftest import restart


def test_rank_1_fails_while_rank_0_waits():
    restart({})
    try:
        for step in range(3):
            assert not (hvd.rank() == 1 and step == 1), "rank 1 gives up at step 1"
            # At step 1 rank 0 waits here for rank 1's allreduce.
            hvd.allreduce(mx.nd.ones((4,)), name=f"step{step}").wait_to_read()
    finally:
        restart({})
'''


# The same test through helpers.restarted, the context manager for that prologue.
FAILS_MID_LOOP_WITH = '''
import mxnet as mx
import hvdmx as hvd
from helpers import restarted


def test_rank_1_fails_while_rank_0_waits():
    with restarted({}):
        for step in range(3):
            assert not (hvd.rank() == 1 and step == 1), "rank 1 gives up at step 1"
            hvd.allreduce(mx.nd.ones((4,)), name=f"step{step}").wait_to_read()
'''


@pytest.mark.parametrize("test", [FAILS_MID_LOOP, FAILS_MID_LOOP_WITH], ids=["finally", "with"])
def test_a_failure_in_a_restarting_finally_aborts_the_job(tmp_path, test):
    for name in HARNESS:
        shutil.copy(os.path.join(ROOT, "tests", name), tmp_path)
    (tmp_path / "test_fails.py").write_text(test)
    # Without the abort, rank 1 would wait in restart()'s barrier and rank 0
    # in its allreduce until pytest's 100 s timeout, past this run's limit.
    result = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "pytest", "-q",
                             "-p", "no:cacheprovider", "--timeout=100",
                             "--timeout-method=thread", str(tmp_path / "test_fails.py")],
                            env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    output = result.stdout + result.stderr  # mpiexec may forward it to either
    assert "[rank 1] failed before restart()" in output, output
    assert "rank 1 gives up at step 1" in output
    assert "[rank 1] aborting the job" in output


# Five tests: the second fails on rank 1 (which aborts the job), the fourth
# hangs on rank 0 until the test timeout ends that rank (while rank 1 goes on
# into the fifth, which the next job must run again).
STOPS_TWICE = '''
import time

import hvdmx as hvd


def test_1():
    pass


def test_2():
    assert hvd.rank() != 1, "rank 1 fails test_2"


def test_3():
    pass


def test_4():
    if hvd.rank() == 0:
        time.sleep(60)


def test_5():
    pass
'''


def test_run_parallel_runs_every_test_after_a_failure_and_a_hang(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    for name in HARNESS:
        shutil.copy(os.path.join(ROOT, "tests", name), tests)
    (tests / "test_stops.py").write_text(STOPS_TWICE)
    logs = tmp_path / "logs"
    logs.mkdir()
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "run_parallel.py"),
                             "--label", "n2", "--ranks", "2", "--logs", str(logs),
                             "--tests", str(tests), "--test-timeout", "4",
                             "--run-timeout", "100", "--", MPIEXEC, "-n", "2"],
                            env=ENV, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0, result.stdout
    results = json.loads((logs / "n2.results.json").read_text())
    test = "test_stops.py::test_"
    assert {k: results[k] for k in ("passed", "failed", "skipped", "unfinished", "not_run",
                                    "collected")} == \
        {"passed": 3, "failed": 2, "skipped": 0, "unfinished": 0, "not_run": 0,
         "collected": 5}, results
    assert [t.rsplit("/", 1)[-1] for t in results["failed_tests"]] == [test + "2", test + "4"]
    assert [re.sub(r"\(.*\)", "", stop) for stop in results["stops"]] == \
        ["stopped at test 2 of 5 ", "stopped at test 4 of 5 "], results["stops"]
    assert "the job starts again with the 3 after it" in result.stdout
    assert "the job starts again with the 1 after it" in result.stdout


def test_run_all_rejects_bad_rank_counts():
    # Checked before any test runs: a run_all.sh that went on would spend
    # minutes on the single-process tests, past this call's limit.
    for value in ["2 x", "0", " ", "-1"]:
        result = subprocess.run(["bash", os.path.join(ROOT, "tests", "run_all.sh")],
                                env=dict(ENV, HVDMX_TEST_RANKS=value), capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 2, (value, result.stdout, result.stderr)
        assert f"HVDMX_TEST_RANKS='{value}' must list rank counts" in result.stderr
    for value in ["x", "0", "2 3"]:
        result = subprocess.run(["bash", os.path.join(ROOT, "tests", "run_all.sh")],
                                env=dict(ENV, HVDMX_TEST_NOMPI_RANKS=value), capture_output=True,
                                text=True, timeout=30)
        assert result.returncode == 2, (value, result.stdout, result.stderr)
        assert f"HVDMX_TEST_NOMPI_RANKS='{value}' must be a rank count" in result.stderr


def test_run_all_counts_a_run_that_collects_nothing_as_failed(tmp_path):
    # pytest exits 5 when it collects no test (a renamed file, a bad path):
    # the suite must fail then, not pass having tested nothing. A stand-in
    # interpreter exits 5 for every pytest run and is Python otherwise (the
    # summary); shard b (the run that ignores tests/parallel) first takes 3 s,
    # so that the run on one rank starts beside it. A stand-in mpiexec runs its
    # command once, and so does a stand-in hvdmxrun beside the interpreter (the
    # run without MPI).
    python = tmp_path / "python"
    python.write_text('#!/bin/sh\n'
                      'case "$*" in *--ignore=tests/parallel*) sleep 3; exit 5 ;; esac\n'
                      f'[ "$1" = "-m" ] && exit 5\nexec {sys.executable} "$@"\n')
    mpiexec = tmp_path / "mpiexec"
    mpiexec.write_text('#!/bin/sh\nshift 2\nexec "$@"\n')  # drops "-n N"
    hvdmxrun = tmp_path / "hvdmxrun"
    # drops "--no-mpi -np N"
    hvdmxrun.write_text('#!/bin/sh\nshift 3\nexport HVDMX_RANK=0\nexec "$@"\n')
    for program in (python, mpiexec, hvdmxrun):
        program.chmod(0o755)
    # TMPDIR: the logs a failed run keeps stay in this test's directory.
    result = subprocess.run(["bash", os.path.join(ROOT, "tests", "run_all.sh")],
                            env=dict(ENV, PYTHON=str(python), MPIEXEC=str(mpiexec),
                                     HVDMX_TEST_RANKS="1 2", HVDMX_TEST_NOMPI_RANKS="2",
                                     TMPDIR=str(tmp_path)),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, (result.stdout, result.stderr)
    # Every run is counted, in the order they ended: n1 ran while shard b
    # still did, and shard b's own time (3 s or more) is on its line.
    lines = result.stdout.splitlines()
    runs = [line for line in lines if re.match(r" *[a-z0-9-]+: \d+ passed", line)]
    assert [run.split(":")[0].strip() for run in runs] == \
        ["serial-a", "n1", "serial-b", "n2", "nompi2"], result.stdout
    for run in runs:
        assert re.fullmatch(r" *[a-z0-9-]+: 0 passed, 1 failed, 0 skipped; exit 5 "
                            r"\(no tests collected\); \d+s", run), run
    assert int(runs[2].rsplit(" ", 1)[1][:-1]) >= 3, runs[2]
    # Each run's line ends with its time, and the suite's time comes before the total.
    assert lines[-3] == runs[-1], lines[-3:]
    assert re.fullmatch(r" +all: \d+s \(serial-a and serial-b side by side, n1 beside "
                        r"serial-b once serial-a has ended, then each other run\)", lines[-2]), \
        lines[-2:]
    assert lines[-1] == "0 passed, 5 failed"
