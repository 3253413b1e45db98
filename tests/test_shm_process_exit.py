"""A rank killed in the middle of shared-memory allreduces ends the job: its
peers, waiting on its counters, do not hang (the launcher ends them)."""
import os
import subprocess
import sys
import textwrap

from test_process_exit import assert_killed_rank_ended_the_job

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def test_a_rank_killed_during_shm_allreduces_ends_the_job():
    script = textwrap.dedent("""
        import os, signal, sys, threading
        import mxnet as mx
        import hvdmx as hvd
        hvd.init()
        x = mx.nd.ones((4 << 20,))  # 16 MiB: most of the time is spent in the collective
        hvd.allreduce_(x, op=hvd.Max, name="big").wait_to_read()
        rank = hvd.rank()
        sys.stderr.write(f"rank {rank} pid {os.getpid()} started\\n")
        sys.stderr.flush()
        if rank == 1:
            threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        try:
            while True:  # ends only by an error, or by the launcher
                hvd.allreduce_(x, op=hvd.Max, name="big").wait_to_read()
        except mx.base.MXNetError as e:
            sys.stderr.write(f"rank {rank} failed: {str(e).splitlines()[0]}\\n")
        sys.stderr.write(f"rank {rank} at the end\\n")
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1",
               HVDMX_ALLREDUCE_ALGO="shm")
    result = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", script], env=env,
                            capture_output=True, text=True, timeout=120)
    assert_killed_rank_ended_the_job(result, 2)
