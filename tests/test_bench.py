"""The benchmark tool runs every subcommand, checks its results (#wrong) and
prints what it promises. Times are printed, never asserted."""
import json
import math
import os
import statistics
import subprocess
import sys

import pytest

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ENV = dict(os.environ, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1")
# The jobs below run every command of a rank count in turn.
pytestmark = pytest.mark.timeout(600)

# The model tests check the subcommand's code path (the gradient set as
# DistributedTrainer reduces it, each column timed, the table), not a figure:
# squeezenet1.1's 52 gradients (4.9 MB) take it as resnet18_v1's 62 (46.8 MB)
# would, at a tenth of the bytes (and of the Adasum run's time).
MODEL, MODEL_TENSORS, MODEL_BYTES = "squeezenet1.1", 52, 4_941_984
KINDS = ["allreduce", "allgather", "broadcast", "alltoall", "reducescatter"]
MXNET_MEMORY = [("allreduce", []), ("allgather", []), ("allgather", ["--tensors", "2"]),
                ("broadcast", []), ("alltoall", []), ("reducescatter", [])]
UNNAMED = ["allreduce", "allgather", "alltoall"]


def commands_on_two_ranks(plot):
    """{name: the arguments of python -m hvdmx.bench} of the tests' runs on 2 ranks."""
    return {
        **{f"json {kind}": [kind, "--min-bytes", "4", "--max-bytes", "256K", "--factor", "256",
                            "--iters", "3", "--json"] for kind in KINDS},
        "grouped allgather table": ["allgather", "--tensors", "3", "--min-bytes", "1K",
                                    "--max-bytes", "1K", "--iters", "3"],
        "alltoall splits table": ["alltoall", "--splits", "--min-bytes", "1K", "--max-bytes",
                                  "1K", "--iters", "3"],
        "plot": ["allgather", "--min-bytes", "1K", "--max-bytes", "64K", "--factor", "8",
                 "--iters", "3", "--plot", plot],
        "no vs mpi": ["allreduce", "--min-bytes", "4", "--max-bytes", "4", "--iters", "3",
                      "--no-vs-mpi"],
        "model json": ["model", "--model", MODEL, "--iters", "2", "--warmup", "1", "--json"],
        "model table": ["model", "--model", MODEL, "--iters", "1", "--warmup", "0",
                        "--no-vs-mpi"],
        "model adasum": ["model", "--model", MODEL, "--iters", "1", "--warmup", "0",
                         "--no-vs-mpi", "--adasum"],
        "rounds json": ["allreduce", "--min-bytes", "1K", "--max-bytes", "1K", "--iters", "2",
                        "--rounds", "3", "--json"],
        "rounds table": ["alltoall", "--min-bytes", "1K", "--max-bytes", "1K", "--iters", "2",
                         "--rounds", "2"],
        "rounds model": ["model", "--model", MODEL, "--iters", "1", "--warmup", "0", "--rounds",
                         "2", "--json"],
        "mxnet memory table": ["alltoall", "--min-bytes", "1K", "--max-bytes", "1K", "--iters",
                               "3", "--mpi-memory", "mxnet"],
        "unnamed table": ["allgather", "--unnamed", "--min-bytes", "12", "--max-bytes", "12",
                          "--iters", "3"],
    }


def commands_on_three_ranks():
    """The same on 3 ranks (uneven splits, MPI's buffers on MXNet's memory, unnamed calls)."""
    return {
        "grouped allgather json": ["allgather", "--tensors", "4", "--min-bytes", "12",
                                   "--max-bytes", "3M", "--factor", "256", "--iters", "3",
                                   "--json"],
        "alltoall splits json": ["alltoall", "--splits", "--min-bytes", "12", "--max-bytes",
                                 "3K", "--factor", "256", "--iters", "3", "--json"],
        **{f"mxnet memory {kind} {extra}": [kind, *extra, "--min-bytes", "2K", "--max-bytes",
                                            "8M", "--factor", "64", "--iters", "3", "--json",
                                            "--mpi-memory", "mxnet"]
           for kind, extra in MXNET_MEMORY},
        **{f"unnamed {kind}": [kind, "--unnamed", "--min-bytes", "12", "--max-bytes", "12K",
                               "--factor", "1024", "--iters", "20", "--json"]
           for kind in UNNAMED},
    }


# One job runs each command in turn as `python -m hvdmx.bench ARGS` runs it
# (hvdmx.bench.cli.main, which starts hvdmx and shuts it down again), instead
# of a job a command: a job's ranks take seconds each to start (importing
# MXNet), more than most commands here take to run (issue 50). Rank 0 prints
# every command's exit code (the worst of the ranks), stdout and stderr; an
# exception on a rank aborts the job, as it would have ended that command's.
JOB = """
import contextlib, io, json, sys, traceback
from mpi4py import MPI
from hvdmx.bench.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        except BaseException:
            traceback.print_exc()
            sys.__stderr__.write(f"hvdmx.bench {argv}:\\n{err.getvalue()}")
            MPI.COMM_WORLD.Abort(1)
    results.append((code or 0, out.getvalue(), err.getvalue()))
ranks = MPI.COMM_WORLD.gather(results, root=0)
if ranks:
    merged = [(max(r[i][0] for r in ranks), "".join(r[i][1] for r in ranks),
               "".join(r[i][2] for r in ranks)) for i in range(len(results))]
    print("RESULTS " + json.dumps(merged), flush=True)
"""


def run_job(n, commands):
    """{name: (exit code, stdout, stderr)} of each command, run in one job on n ranks."""
    result = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, "-c", JOB,
                             json.dumps(list(commands.values()))],
                            env=ENV, capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, result.stderr[-6000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    assert len(lines) == 1, result.stdout[-3000:] + result.stderr[-3000:]
    return dict(zip(commands, json.loads(lines[0][len("RESULTS "):])))


@pytest.fixture(scope="module")
def plot(tmp_path_factory):
    return tmp_path_factory.mktemp("bench") / "ag.png"


@pytest.fixture(scope="module")
def two_ranks(plot):
    return run_job(2, commands_on_two_ranks(str(plot)))


@pytest.fixture(scope="module")
def three_ranks():
    return run_job(3, commands_on_three_ranks())


def bench(ran, name):
    """The stdout of the command `name` in the job `ran`, which must have exited 0."""
    code, out, err = ran[name]
    assert code == 0, err
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_collectives_json(kind, two_ranks):
    rows = json.loads(bench(two_ranks, f"json {kind}"))
    assert [r["op"] for r in rows] == [kind] * 3
    for r in rows:
        assert r["hvdmx_wrong"] == 0 and r["mpi_wrong"] == 0
        assert r["oop_wrong"] == 0 and r["ip_wrong"] == 0
        assert r["hvdmx_us"] > 0 and r["mpi_us"] > 0 and r["oop_us"] > 0
        assert r["bytes"] == r["count"] * 4
        if kind in ("allreduce", "broadcast"):  # in place exists and is what MPI is beside
            assert r["ip_us"] > 0 and r["hvdmx_us"] == r["ip_us"]
        else:
            assert math.isnan(r["ip_us"]) and r["hvdmx_us"] == r["oop_us"]


def test_grouped_allgather(two_ranks, three_ranks):
    # 4 tensors, some empty at 12 bytes; above 256 KiB of output each moves alone.
    rows = json.loads(bench(three_ranks, "grouped allgather json"))
    assert [r["bytes"] for r in rows] == [12, 3072, 786432]
    for r in rows:
        assert r["tensors"] == 4 and r["hvdmx_wrong"] == 0 and r["mpi_wrong"] == 0
    out = bench(two_ranks, "grouped allgather table")
    assert "grouped_allgather of 3 tensors vs 3 x MPI_Allgather" in out


def test_alltoall_with_splits(two_ranks, three_ranks):
    # The received splits are checked too (#wrong); n=3 splits unevenly sized rows.
    rows = json.loads(bench(three_ranks, "alltoall splits json"))
    assert [r["bytes"] for r in rows] == [12, 3072]
    for r in rows:
        assert r["splits"] and r["hvdmx_wrong"] == 0 and r["mpi_wrong"] == 0
    out = bench(two_ranks, "alltoall splits table")
    assert "alltoall with splits (and received splits back) vs MPI_Alltoall" in out


def test_table_and_plot(two_ranks, plot):
    out = bench(two_ranks, "plot")
    assert "MPI_Allgather" in out and "busbw" in out
    assert plot.read_bytes()[:4] == b"\x89PNG"
    out = bench(two_ranks, "no vs mpi")
    head, row = out.splitlines()[2], out.splitlines()[3]
    assert head.count("time(us)") == 3 and "hvdmx out-of-place" in out and "in-place" in out
    assert row.split("|")[3].split() == ["n/a"]  # no MPI figures


def test_model(two_ranks):
    row = json.loads(bench(two_ranks, "model json"))
    assert row["tensors"] == MODEL_TENSORS and row["bytes"] == MODEL_BYTES
    assert row["warmup"] == 1
    assert row["hvdmx_ms"] > 0 and row["mpi_per_tensor_ms"] > 0 and row["mpi_fused_ms"] > 0
    assert row["floor_ms"] > 0 and row["mpi_fused_copies_ms"] > 0


def test_model_table(two_ranks):
    out = bench(two_ranks, "model table")
    lines = out.splitlines()
    assert f"{MODEL} gradients: {MODEL_TENSORS} tensors, 4.9 MB" in lines[0]
    assert "memory floor:" in lines[0]
    assert lines[1].split() == ["hvdmx", "memory", "floor", "MPI", "per", "tensor", "MPI",
                                "fused", "MPI", "fused", "+", "copies"]
    hvdmx_ms, floor_ms, per_tensor, fused, copies = lines[2].split()
    assert float(hvdmx_ms) > 0 and float(floor_ms) > 0
    assert per_tensor == fused == copies == "nan"


def test_model_table_with_adasum(two_ranks):
    out = bench(two_ranks, "model adasum")
    lines = out.splitlines()
    assert lines[1].split()[:5] == ["hvdmx", "hvdmx", "Adasum", "Adasum/hvdmx", "memory"]
    average, adasum, ratio = (float(x) for x in lines[2].split()[:3])
    assert average > 0 and adasum > 0
    # The ratio (2 decimals) of the unrounded times, which the table gives to 0.1 ms.
    assert (adasum - 0.05) / (average + 0.05) - 0.005 <= ratio \
        <= (adasum + 0.05) / max(average - 0.05, 1e-9) + 0.005


def test_rounds_give_each_column_its_median(two_ranks):
    rows = json.loads(bench(two_ranks, "rounds json"))
    r = rows[0]
    assert r["rounds"] == 3 and r["hvdmx_wrong"] == 0 and r["mpi_wrong"] == 0
    for prefix in ("oop", "ip", "mpi"):
        assert len(r[f"{prefix}_rounds_us"]) == 3
        assert r[f"{prefix}_us"] == pytest.approx(statistics.median(r[f"{prefix}_rounds_us"]))
    out = bench(two_ranks, "rounds table")
    assert "median of 2 rounds taken in turn" in out.splitlines()[0]
    row = json.loads(bench(two_ranks, "rounds model"))
    for name in ("hvdmx", "floor", "mpi_per_tensor", "mpi_fused", "mpi_fused_copies"):
        assert len(row[f"{name}_rounds_ms"]) == 2
        assert row[f"{name}_ms"] == pytest.approx(statistics.median(row[f"{name}_rounds_ms"]))


def test_bad_rounds_is_refused():
    result = subprocess.run([sys.executable, "-m", "hvdmx.bench", "allgather", "--rounds", "0"],
                            env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "argument --rounds: invalid value '0': expected an integer >= 1 (rounds)" \
        in result.stderr


@pytest.mark.parametrize("kind,extra", MXNET_MEMORY)
def test_mpi_on_mxnet_memory(kind, extra, three_ranks):
    # MPI's buffers on memory MXNet allocated: its results are still checked.
    rows = json.loads(bench(three_ranks, f"mxnet memory {kind} {extra}"))
    assert len(rows) == 3 and rows[-1]["bytes"] > 4 << 20  # numpy would advise huge pages
    for r in rows:
        assert r["mpi_memory"] == "mxnet" and r["mpi_wrong"] == 0 and r["hvdmx_wrong"] == 0


def test_mpi_on_mxnet_memory_table_says_so(two_ranks):
    # The table's first line, written alike for every kind (tables.print_collective);
    # each kind's results on MXNet's memory are checked above.
    assert "(mpi4py on MXNet's memory buffers)" in bench(two_ranks, "mxnet memory table")


def test_mxnet_memory_is_shared_with_the_mxnet_array():
    import mxnet as mx
    import numpy as np
    from hvdmx.bench.collectives import _on_mxnet_memory
    keep = []
    view = _on_mxnet_memory(np.arange(12, dtype=np.float32).reshape(3, 4), keep)
    assert view.shape == (3, 4) and view.dtype == np.float32
    assert len(keep) == 1 and isinstance(keep[0], mx.nd.NDArray)
    view[1, 2] = 99
    assert keep[0].asnumpy()[6] == 99 and view.sum() == np.arange(12).sum() - 6 + 99
    assert _on_mxnet_memory(np.zeros(0), keep).size == 0 and len(keep) == 1


@pytest.mark.parametrize("kind", UNNAMED)
def test_unnamed_calls(kind, three_ranks):
    # Every call a new name: results still checked, and the table says so.
    rows = json.loads(bench(three_ranks, f"unnamed {kind}"))
    assert len(rows) == 2
    for r in rows:
        assert r["unnamed"] and r["hvdmx_wrong"] == 0 and r["mpi_wrong"] == 0


def test_unnamed_calls_table_says_so(two_ranks):
    # Written alike for every kind (tables.print_collective); each kind's unnamed
    # results are checked above.
    out = bench(two_ranks, "unnamed table")
    assert "hvdmx calls unnamed (each a new name)" in out
