"""The timeline: a valid Chrome trace with the expected phases, written by
rank 0 from HVDMX_TIMELINE or start_timeline, valid even after a kill; and
the summary and plot commands."""
import subprocess
import sys

import pytest

from hvdmx import timeline
from test_process_exit import run_job

JOB = """
for i in range(3):
    a = hvd.allreduce(mx.nd.ones((1000,)), name="single")
    fused = [hvd.allreduce(mx.nd.ones((10,)) * k, name=f"fused.{k}") for k in range(3)]
    b = hvd.broadcast(mx.nd.ones((5, 2)), root_rank=0, name="bcast")
    g = hvd.allgather(mx.nd.ones((rank + 1, 2)), name="gather")
    mx.nd.waitall()
"""


def phases_by_tensor(path):
    rows, events = timeline.load(path)
    out = {}
    for e in events:
        out.setdefault(rows[e["pid"]], set()).add(e["name"])
    return out, events


def test_timeline_from_the_environment(tmp_path):
    path = tmp_path / "t.json"
    result = run_job(2, JOB, HVDMX_TIMELINE=str(path), HVDMX_TIMELINE_MARK_CYCLES="1")
    assert result.returncode == 0, result.stderr
    phases, events = phases_by_tensor(path)
    assert {"NEGOTIATE_ALLREDUCE", "ALLREDUCE", "QUEUE"} <= phases["single"]
    assert {"MPI_ALLREDUCE", "RING_ALLREDUCE", "SHM_ALLREDUCE"} & phases["single"]
    # both ranks share this host: auto reduces through shared memory, which
    # reads and writes a fused group's tensors where they are (no fusion buffer)
    assert "SHM_ALLREDUCE" in phases["fused.1"]
    assert not {"MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"} & phases["fused.1"]
    # both ranks share this host: auto broadcasts through shared memory
    assert "SHM_BCAST" in phases["bcast"]
    # and gathers a small allgather through shared memory too
    assert "SHM_ALLGATHER" in phases["gather"]
    assert {"NEGOTIATE_ALLGATHER", "ALLGATHER"} <= phases["gather#sizes"]
    assert "CYCLE_START" in phases["negotiation rounds"]
    # rank 0 saw each rank's request arrive (the first, uncached, round)
    assert {"rank 0 ready", "rank 1 ready"} <= phases["single"]
    negotiate = [e for e in events if e["name"] == "NEGOTIATE_ALLREDUCE" and e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in negotiate)
    assert any(e.get("args", {}).get("shape") == "(1000,)" for e in negotiate)
    assert any(e.get("args", {}).get("dtype") == "float32" for e in negotiate)


EVERY_COLLECTIVE = """
for i in range(2):
    hvd.allreduce(mx.nd.ones((1000,)), name="ar").wait_to_read()
    hvd.broadcast(mx.nd.ones((5, 2)), root_rank=size - 1, name="bc").wait_to_read()
    hvd.allgather(mx.nd.ones((rank + 1, 2)), name="ag").wait_to_read()
    hvd.alltoall(mx.nd.ones((2 * size, 3)), name="a2a").wait_to_read()
    hvd.reducescatter(mx.nd.ones((size + 1, 2)), name="rs").wait_to_read()
    hvd.barrier()
try:
    hvd.allreduce(mx.nd.ones((2 + rank,)), name="mismatch").wait_to_read()
except mx.base.MXNetError:
    pass
hvd.join()
hvd.allreduce(mx.nd.ones((1,)), name="last").wait_to_read()
"""

# Each collective's row: Horovod's negotiation and operation names, and a
# step of its own inside the operation.
HOROVOD_NAMES = {"ar": ("NEGOTIATE_ALLREDUCE", "ALLREDUCE"),
                 "bc": ("NEGOTIATE_BROADCAST", "BROADCAST"),
                 "ag": ("NEGOTIATE_ALLGATHER", "ALLGATHER"),
                 "ag#sizes": ("NEGOTIATE_ALLGATHER", "ALLGATHER"),
                 "a2a": ("NEGOTIATE_ALLTOALL", "ALLTOALL"),
                 "a2a#sizes": ("NEGOTIATE_ALLTOALL", "ALLTOALL"),
                 "rs": ("NEGOTIATE_REDUCESCATTER", "REDUCESCATTER"),
                 "barrier.noname.0": ("NEGOTIATE_BARRIER", "BARRIER"),
                 "mismatch": ("NEGOTIATE_ALLREDUCE", "ERROR"),
                 "hvdmx.join": ("NEGOTIATE_JOIN", "JOIN")}


@pytest.mark.parametrize("algo", ["shm", "mpi"])
def test_every_collective_is_named_as_in_horovod(tmp_path, algo):
    path = tmp_path / "t.json"
    result = run_job(2, EVERY_COLLECTIVE, HVDMX_TIMELINE=str(path), HVDMX_ALLREDUCE_ALGO=algo)
    assert result.returncode == 0, result.stderr
    rows, events = timeline.load(path)
    by_row = {}
    for e in events:
        if e["ph"] == "X":
            by_row.setdefault(rows[e["pid"]], []).append(e)
    transports = {"ar": {"SHM_ALLREDUCE"} if algo == "shm" else {"MPI_ALLREDUCE"},
                  "bc": {"SHM_BCAST"} if algo == "shm" else {"MPI_BCAST"},
                  "a2a": {"SHM_ALLTOALL"} if algo == "shm" else {"MPI_ALLTOALL"}}
    for row, (negotiate, operation) in HOROVOD_NAMES.items():
        names = {e["name"] for e in by_row[row]}
        assert {negotiate, operation} <= names, (row, names)
        # no other negotiation or operation on the row (hvdmx's old NEGOTIATE included)
        assert {n for n in names if timeline.is_top_level(n)} == {negotiate, operation}, names
        # every step lies inside an operation of its row; the negotiation before it
        ops = [e for e in by_row[row] if e["name"] == operation]
        for step in by_row[row]:
            if step["name"] in (negotiate, operation):
                continue
            assert any(op["ts"] <= step["ts"] and
                       step["ts"] + step["dur"] <= op["ts"] + op["dur"] for op in ops), step
        for n in (e for e in by_row[row] if e["name"] == negotiate):
            assert any(n["ts"] + n["dur"] <= op["ts"] for op in ops), n
    for row, want in transports.items():
        assert want <= {e["name"] for e in by_row[row]}, (row, want)
    # the operation carries the tensor's dtype and shape, as Horovod's does
    ar = [e for e in by_row["ar"] if e["name"] == "ALLREDUCE"]
    assert ar and all(e["args"] == {"dtype": "float32", "shape": "(1000,)"} for e in ar)


def test_mpi_fuses_through_the_fusion_buffer(tmp_path):
    path = tmp_path / "t.json"
    result = run_job(2, JOB, HVDMX_TIMELINE=str(path), HVDMX_ALLREDUCE_ALGO="mpi")
    assert result.returncode == 0, result.stderr
    phases, _ = phases_by_tensor(path)
    # three small allreduces of one round are fused
    assert {"MEMCPY_IN_FUSION_BUFFER", "MPI_ALLREDUCE",
            "MEMCPY_OUT_FUSION_BUFFER", "ALLREDUCE", "NEGOTIATE_ALLREDUCE"} <= phases["fused.1"]


def test_start_and_stop_while_running(tmp_path):
    path = tmp_path / "t.json"
    result = run_job(2, f"""
        hvd.allreduce(mx.nd.ones((4,)), name="before").wait_to_read()
        hvd.start_timeline({str(path)!r})
        hvd.allreduce(mx.nd.ones((4,)), name="during").wait_to_read()
        hvd.stop_timeline()
        hvd.allreduce(mx.nd.ones((4,)), name="after").wait_to_read()
    """)
    assert result.returncode == 0, result.stderr
    phases, _ = phases_by_tensor(path)
    assert set(phases) == {"during"}


def test_bad_path_is_a_clear_error(tmp_path):
    result = run_job(1, f"""
        try:
            hvd.start_timeline({str(tmp_path / "no" / "such" / "dir.json")!r})
        except ValueError as e:
            print("error:", e)
    """)
    assert "cannot write the timeline to" in result.stdout and "writable directory" in (
        result.stdout)


def test_valid_json_after_a_kill(tmp_path):
    path = tmp_path / "t.json"
    result = run_job(2, """
        import time
        for i in range(200):
            hvd.allreduce(mx.nd.ones((100,)), name=f"t{i % 7}").wait_to_read()
        time.sleep(0.5)  # the writer flushes every 100 ms
        for i in range(200):
            hvd.allreduce(mx.nd.ones((100,)), name=f"u{i % 7}").wait_to_read()
            if i == 100 and rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
    """, HVDMX_TIMELINE=str(path))
    assert result.returncode != 0
    phases, events = phases_by_tensor(path)  # parses
    assert "t3" in phases and len(events) > 100


def test_summary_and_plot(tmp_path):
    path = tmp_path / "t.json"
    assert run_job(2, JOB, HVDMX_TIMELINE=str(path)).returncode == 0
    summary = subprocess.run([sys.executable, "-m", "hvdmx.timeline", "summary", str(path)],
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    assert "NEGOTIATE_ALLREDUCE" in summary.stdout and "fused.2" in summary.stdout
    png = tmp_path / "t.png"
    drawn = subprocess.run([sys.executable, "-m", "hvdmx.timeline", "plot", str(path), "-o",
                            str(png)], capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 0, drawn.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "hvdmx.timeline", "summary",
                          str(tmp_path / "missing.json")], capture_output=True, text=True)
    assert bad.returncode == 2 and "cannot read" in bad.stderr
