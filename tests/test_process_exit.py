"""Whole jobs under mpiexec: a clean exit without an explicit shutdown, a
failing or killed rank ending the job instead of hanging it, and the warnings
about a stalled collective and a long wait in hvd.shutdown()."""
import os
import re
import subprocess
import sys
import textwrap

import pytest


MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ENV = dict(os.environ, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1")


def run_job(n, body, timeout=120, **env):
    script = textwrap.dedent("""
        import os, signal, sys
        import mxnet as mx
        import hvdmx as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    """) + textwrap.dedent(body)
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, "-c", script],
                          env=dict(ENV, **env),
                          capture_output=True, text=True, timeout=timeout)


def test_exit_without_shutdown_is_clean():
    result = run_job(2, """
        out = hvd.allreduce(mx.nd.ones((3,)) * (rank + 1), op=hvd.Sum)
        # One write: the ranks share stdout.
        sys.stdout.write(f"result {rank} {out.asnumpy().tolist()}\\n")
        sys.stdout.flush()
        pending = hvd.allreduce(mx.nd.ones((3,)), name="left-for-atexit")
    """)
    assert result.returncode == 0, result.stderr
    assert "result 0 [3.0, 3.0, 3.0]" in result.stdout
    assert "result 1 [3.0, 3.0, 3.0]" in result.stdout


def test_no_collective_error_is_left_for_exit():
    # allgather's mismatch raises at the call, on both ranks, and nothing of it
    # is left for exit; the error of an allreduce whose output nobody reads
    # can only come out at exit: hvdmx's exit hook says so on stderr, instead
    # of MXNet's "Exception ignored in atexit callback" and a traceback.
    result = run_job(2, """
        dropped = hvd.allreduce(mx.nd.ones((2 + rank,)), name="never.read")
        try:
            hvd.allgather(mx.nd.ones((1, 1 + rank)), name="sizes.differ")
        except hvd.errors.MismatchError as e:
            sys.stderr.write(f"rank {rank} raised at the call: {e}\\n")
    """)
    assert result.returncode == 0, result.stderr
    at_exit = [line for line in result.stderr.splitlines() if "at exit" in line]
    for r in range(2):
        assert (f"rank {r} raised at the call: hvdmx: allgather of tensor 'sizes.differ' was "
                "called with different shape after the first dimension") in result.stderr
        assert any(line.startswith(f"[hvdmx ERROR rank {r}] at exit: an operation failed and its "
                                   "result was never read") and
                   "allreduce of tensor 'never.read' was called with different shape" in line
                   for line in at_exit), result.stderr
    assert len(at_exit) == 2 and not any("sizes.differ" in line for line in at_exit)
    assert "Exception ignored" not in result.stderr


def test_shutdown_raises_an_unread_failure():
    # With nothing pending, hvd.shutdown() raises what no read has raised, so
    # it does not wait for the exit; an output pending at the shutdown keeps
    # its "shut down" error for its read (tests/parallel/test_basics.py).
    result = run_job(2, """
        dropped = hvd.allreduce(mx.nd.ones((2 + rank,)), name="never.read")
        hvd.allreduce(mx.nd.ones((1,)), name="read").wait_to_read()
        try:
            hvd.shutdown()
        except mx.base.MXNetError as e:
            sys.stderr.write(f"rank {rank} shutdown raised: {e}\\n")
        sys.stderr.write(f"rank {rank} initialized after: {hvd.is_initialized()}\\n")
    """)
    assert result.returncode == 0, result.stderr
    for r in range(2):
        assert (f"rank {r} shutdown raised: hvdmx.shutdown: 1 operation(s) had failed and their "
                "results were never read") in result.stderr, result.stderr
        assert f"rank {r} initialized after: False" in result.stderr
    assert result.stderr.count("allreduce of tensor 'never.read' was called with different "
                               "shape") == 2
    assert "at exit" not in result.stderr and "Exception ignored" not in result.stderr


def test_a_rank_that_raises_does_not_hang_the_others():
    # Rank 1 dies with an exception before submitting; its exit shuts hvdmx
    # down, so rank 0's pending allreduce fails instead of waiting forever,
    # and rank 0 goes on to the end of its script.
    result = run_job(2, """
        if rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
        try:
            hvd.allreduce(mx.nd.ones((3,)), name="never-matched").wait_to_read()
        except mx.base.MXNetError as e:
            sys.stderr.write(f"rank {rank} failed: {str(e).splitlines()[0]}\\n")
        from hvdmx import _core, _job
        code = _core.stop_status()[0]
        sys.stderr.write(f"rank {rank} stopped by a peer's shutdown: "
                         f"{code == _core.STATUS_PEER_SHUTDOWN}, gone: {_job.peers_gone(code)}\\n")
        sys.stderr.write(f"rank {rank} at the end\\n")
    """)
    assert result.returncode != 0
    assert "rank 0 stopped by a peer's shutdown: True, gone: False" in result.stderr
    assert "RuntimeError: rank 1 fails on purpose" in result.stderr
    assert ("rank 0 failed: MXNetError: hvdmx has been shut down by another rank (it called "
            "hvd.shutdown(), or its process ended, which calls it)") in result.stderr, \
        result.stderr
    assert "rank 0 at the end" in result.stderr
    assert "rank 1 at the end" not in result.stderr


def assert_killed_rank_ended_the_job(result, n):
    """The job of a script whose ranks print "rank R pid P started" and whose
    rank 1 is then killed (SIGKILL) while the others wait for it in a
    collective that never ends otherwise: every rank started, the launcher
    reports a rank killed and ends the job, and no other rank got to its end
    without its collective failing first. Hydra's report names one rank that
    ended by signal 9: rank 1, or (seen on a loaded machine) a rank that
    Hydra itself had killed in ending the job."""
    output = result.stdout + result.stderr  # the launcher's report goes to stdout
    pids = dict(re.findall(r"^rank (\d+) pid (\d+) started$", result.stderr, re.M))
    assert sorted(pids) == [str(r) for r in range(n)], result.stderr
    named = re.search(r"PID (\d+) RUNNING AT .*\n=\s+EXIT CODE: 9", output)
    assert named and named.group(1) in pids.values(), output
    assert result.returncode != 0
    for r in range(n):
        if f"rank {r} at the end" in result.stderr:
            assert f"rank {r} failed" in result.stderr, result.stderr
    assert "rank 1 at the end" not in result.stderr and "rank 1 failed" not in result.stderr


def test_a_killed_rank_ends_the_job():
    result = run_job(2, """
        sys.stderr.write(f"rank {rank} pid {os.getpid()} started\\n")
        sys.stderr.flush()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            hvd.allreduce(mx.nd.ones((3,)), name="never-matched").wait_to_read()
        except mx.base.MXNetError as e:
            sys.stderr.write(f"rank {rank} failed: {str(e).splitlines()[0]}\\n")
        sys.stderr.write(f"rank {rank} at the end\\n")
    """)
    assert_killed_rank_ended_the_job(result, 2)


def test_stall_warning_names_the_waiting_tensor():
    result = run_job(2, """
        import time
        if rank == 1:
            time.sleep(3)  # rank 1 is late: rank 0 waits on 'late.tensor'
        out = hvd.allreduce(mx.nd.ones((2,)), name="late.tensor", op=hvd.Sum)
        assert out.asnumpy().tolist() == [2.0, 2.0]
    """, HVDMX_STALL_CHECK_TIME_SECONDS="1")
    assert result.returncode == 0, result.stderr
    assert "hvdmx WARNING rank 0" in result.stderr
    assert "have not run, because other ranks have not submitted them: late.tensor" in (
        result.stderr)


def test_stall_shutdown_fails_a_skipped_tensor_on_every_rank():
    # Rank 1 skips 'A'. Both ranks then wait on different tensors; after the
    # stall shutdown time both get the stall report as an error, and exit.
    result = run_job(2, """
        try:
            if rank == 0:
                hvd.allreduce(mx.nd.ones((2,)), name="A").wait_to_read()
            hvd.allreduce(mx.nd.ones((2,)), name="B").wait_to_read()
        except mx.base.MXNetError as e:
            msg = str(e).splitlines()
            line = [l for l in msg if "HVDMX_STALL_SHUTDOWN_TIME_SECONDS" in l]
            sys.stderr.write(f"rank {rank} failed: {line[0] if line else msg}\\n")
            sys.exit(3)
    """, timeout=60, HVDMX_STALL_CHECK_TIME_SECONDS="1", HVDMX_STALL_SHUTDOWN_TIME_SECONDS="4")
    assert result.returncode != 0
    assert "rank 0 failed:" in result.stderr and "rank 1 failed:" in result.stderr
    assert "allreduce of tensor 'A' was submitted by rank(s) 0 but not by rank(s) 1" in (
        result.stderr)
    assert "allreduce of tensor 'B' was submitted by rank(s) 1 but not by rank(s) 0" in (
        result.stderr)
    # the warning came first, naming the missing rank
    assert "'A' (missing on ranks 1)" in result.stderr


def test_stall_shutdown_stops_waiting_for_a_rank_outside_hvdmx():
    # Rank 1 never comes back to hvdmx (stuck in a sleep): rank 0 gives up
    # the round after the shutdown time, with a report, instead of hanging.
    result = run_job(2, """
        import time
        if rank == 1:
            time.sleep(20)
            os._exit(0)
        try:
            hvd.allreduce(mx.nd.ones((2,)), name="lonely").wait_to_read()
        except mx.base.MXNetError as e:
            sys.stderr.write("rank 0 failed: " + str(e).splitlines()[0] + "\\n")
            later = hvd.is_initialized()
            sys.stderr.write(f"initialized after: {later}, rank {hvd.rank()} of {hvd.size()}\\n")
            from hvdmx import _core, _job
            code = _core.stop_status()[0]
            sys.stderr.write(f"stalled: {code == _core.STATUS_STALLED}, "
                             f"gone: {_job.peers_gone(code)}\\n")
            try:
                hvd.broadcast(mx.nd.ones((1,)), root_rank=0)
            except ValueError as again:
                sys.stderr.write("later call: " + str(again).splitlines()[0] + "\\n")
            os._exit(3)
    """, timeout=60, HVDMX_STALL_SHUTDOWN_TIME_SECONDS="2")
    assert result.returncode != 0
    assert "rank 0 failed:" in result.stderr
    assert "the other ranks have not taken part in negotiation for 2 s" in result.stderr
    assert "lonely" in result.stderr
    assert "initialized after: False, rank 0 of 2" in result.stderr
    assert "stalled: True, gone: True" in result.stderr
    assert "later call: hvdmx: the other ranks have not taken part in negotiation" in result.stderr


# hvdmx stops on every rank together, in a round that rank 1 joins only when it
# calls hvdmx again or exits: rank 0's shutdown waits for that.
SHUTDOWN_WHILE_RANK_1_IS_BUSY = """
    import time
    hvd.allreduce(mx.nd.ones((1,))).wait_to_read()
    if rank == 0:
        hvd.shutdown()
        sys.stderr.write("rank 0 shut down\\n")
    else:
        time.sleep(3)  # busy outside hvdmx; its exit ends rank 0's wait
"""


def test_shutdown_waiting_for_a_busy_rank_says_so():
    result = run_job(2, SHUTDOWN_WHILE_RANK_1_IS_BUSY, HVDMX_STALL_CHECK_TIME_SECONDS="1")
    assert result.returncode == 0, result.stderr
    assert "hvdmx WARNING rank 0" in result.stderr
    assert re.search(r"hvd.shutdown\(\) on this rank has waited \d+ s for the other ranks",
                     result.stderr), result.stderr
    assert "rank 0 shut down" in result.stderr
    assert "WARNING rank 1" not in result.stderr


def test_stall_shutdown_bounds_the_wait_in_shutdown():
    result = run_job(2, SHUTDOWN_WHILE_RANK_1_IS_BUSY, HVDMX_STALL_SHUTDOWN_TIME_SECONDS="1")
    assert result.returncode == 0, result.stderr
    assert ("the other ranks have not taken part in negotiation for 1 s "
            "(HVDMX_STALL_SHUTDOWN_TIME_SECONDS) while this rank waited in hvd.shutdown() for "
            "them to stop with it") in result.stderr
    assert "rank 0 shut down" in result.stderr


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("algo", ["auto", "ring"])
def test_a_rank_stopped_by_the_stall_shutdown_lets_every_rank_exit(n, algo):
    # Rank 0 submits a tensor no other rank does, waits the stall shutdown
    # time and stops; the others reach the end of the script without a call.
    # Their shutdown at exit then meets rank 0's abandoned round and must not
    # wait for it: in shared memory (auto, one host) they see rank 0's stop at
    # once; over MPI (ring) they give up after the stall shutdown time too.
    result = run_job(n, """
        import time
        if rank == 0:
            try:
                hvd.allreduce(mx.nd.ones((4,)), name="only.on.rank.0").wait_to_read()
            except mx.base.MXNetError as e:
                sys.stderr.write("rank 0 failed: " + str(e).splitlines()[0][:60] + "\\n")
        else:
            time.sleep(4)
        sys.stderr.write(f"rank {rank} at the end\\n")
    """, timeout=90, HVDMX_STALL_SHUTDOWN_TIME_SECONDS="2", HVDMX_ALLREDUCE_ALGO=algo)
    # The job ended (run_job's timeout did not fire), and cleanly: rank 0,
    # whose peers stopped taking part, bounds its wait in MPI_Finalize
    # (docs/errors.md, "A rank that stops") by 5 s for the others to come to
    # their exit plus the 2 s that their shutdown waits, over MPI, for rank
    # 0's abandoned round. They come 2 s after rank 0 stopped (their sleep
    # ends) and finalize about 2 s later, so about 3 s remain for their
    # exit even on a loaded machine. Issue 60, item 6: the bound once left
    # out the 2 s, rank 0's timer then fired while the others were still in
    # their shutdown on a loaded machine, and Hydra killed them (status 9).
    assert "without finalizing MPI" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr + result.stdout
    assert "rank 0 failed: hvdmx: the other ranks have not taken part" in result.stderr
    for r in range(n):
        assert f"rank {r} at the end" in result.stderr
    if algo == "auto":
        assert "rank 0 of this host" in result.stderr and "has stopped hvdmx" in result.stderr
    else:
        assert "while this rank waited in hvd.shutdown() for them" in result.stderr


def test_every_collective_under_the_naive_engine():
    # docs/env.md says the NaiveEngine is supported: it runs each op in the
    # pushing thread, so hvdmx's op waits there for its collective (and
    # keeps its copies of the arrays until the engine deletes the op, Note
    # [Letting go before completing] in mxnet_engine.cc). Every collective,
    # with temporary inputs, pooled outputs (64 KiB and up) and in-place
    # calls, step after step, must give the right values and not hang.
    result = run_job(2, """
        import numpy as np
        n = 70_000  # 280 KB of float32: outputs from the output pool
        base = np.arange(n, dtype=np.float32)
        for step in range(20):
            a = mx.nd.array(base + rank + step)
            total = sum(base + r + step for r in range(size)) * 2
            assert np.array_equal(hvd.allreduce(a * 2, op=hvd.Sum).asnumpy(), total)
            b = a * 1
            hvd.allreduce_(b, op=hvd.Sum)
            assert np.array_equal(b.asnumpy(), total / 2)
            assert np.array_equal(hvd.broadcast(a * 3, root_rank=1).asnumpy(),
                                  (base + 1 + step) * 3)
            got = hvd.allgather(a[:1000] + 0).asnumpy()
            assert np.array_equal(got, np.concatenate([(base + r + step)[:1000]
                                                       for r in range(size)]))
            got = hvd.alltoall(a + 0).asnumpy()
            half = n // size
            assert np.array_equal(got, np.concatenate(
                [(base + r + step)[rank * half:(rank + 1) * half] for r in range(size)]))
            got = hvd.reducescatter(a + 0, op=hvd.Sum).asnumpy()
            assert np.array_equal(got, (total / 2)[rank * half:(rank + 1) * half])
        sys.stdout.write(f"naive ok {rank}\\n")
        sys.stdout.flush()
        hvd.shutdown()
    """, MXNET_ENGINE_TYPE="NaiveEngine")
    assert result.returncode == 0, result.stderr
    assert "naive ok 0" in result.stdout and "naive ok 1" in result.stdout, result.stdout
