"""A peer's hvd.shutdown() while this rank has many collectives in flight:
the runtime's thread fails every pending entry, and the engine's worker runs
the collectives whose inputs have just become ready (each fails at once, the
runtime having stopped) and deletes the failed outputs. MXNet keeps the
failed ops in one list that it changes without a lock; our failures, ended
on the runtime's thread while the worker passed earlier ones on, corrupted
it: "double free or corruption (!prev)", "malloc(): invalid next size", a
segfault in mx.nd.waitall() or a hang (Note [Failing ops on the engine's
worker] in csrc/hvdmx/mxnet/mxnet_engine.cc). Without the fix most such jobs
crashed or hung."""
import os
import subprocess
import sys
import textwrap

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
DELAY = 1.0  # seconds rank 1 pushes before rank 0 shuts down: enough for a backlog

SCRIPT = textwrap.dedent("""
    import sys, time
    import mxnet as mx
    import hvdmx as hvd
    from hvdmx.ops import _allreduce_each_

    hvd.init()
    rank = hvd.rank()
    xs = [mx.nd.ones((4,)) for _ in range(64)]
    hvd.allreduce(mx.nd.ones((1,)), name="start").wait_to_read()
    if rank == 0:
        # Long enough for rank 1's engine to fall behind its pushes.
        time.sleep(float(sys.argv[1]))
        hvd.shutdown()
        sys.exit(0)
    batches, failure = 0, None
    try:
        while True:
            # Collectives rank 0 never submits: they stay pending. Their
            # inputs come from engine ops, so the engine's worker runs them
            # (not this thread), also after the runtime has stopped.
            ys = [x + 0 for x in xs]
            # In one call, as DistributedTrainer pushes its gradients.
            _allreduce_each_(ys, [f"b{batches}.{i}" for i in range(len(ys))],
                             [0] * len(ys), hvd.Sum, 1.0, 1.0, hvd.global_process_set)
            batches += 1
    except (mx.base.MXNetError, RuntimeError) as e:
        # NotRunningError at the call, or (the runtime stopping during the
        # push) RuntimeError from the core; either says why.
        failure = str(e).splitlines()[0]
    failed_reads = 0
    while True:  # every pending collective ends, with the peer's shutdown
        try:
            mx.nd.waitall()
            break
        except mx.base.MXNetError:
            failed_reads += 1
    hvd.shutdown()
    sys.stdout.write(f"rank 1: {batches} batches, then {failure!r}; "
                     f"waitall raised {failed_reads}\\n")
    sys.stdout.flush()
""")


def test_collectives_in_flight_fail_cleanly_when_a_peer_shuts_down():
    env = dict(os.environ, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1",
               HVDMX_TRANSPORT="tcp")
    # Without the fix the job crashed, or hung on the corrupted engine.
    result = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", SCRIPT, str(DELAY)],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("rank 1: ")]
    assert len(lines) == 1, result.stdout + result.stderr
    # Rank 1 pushed until the runtime stopped; the stop was rank 0's
    # shutdown, and the failed collectives raised it at the waitall.
    assert "hvdmx has been shut down by another rank" in lines[0], lines[0]
    assert " 0 batches" not in lines[0] and "waitall raised 0" not in lines[0], lines[0]
