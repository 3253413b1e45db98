"""A rank killed in the middle of shared-memory allreduces ends the job: its
peers, waiting on its counters, do not hang (the launcher ends them)."""
import os
import subprocess
import sys
import textwrap

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def test_a_rank_killed_during_shm_allreduces_ends_the_job():
    script = textwrap.dedent("""
        import os, signal, threading
        import mxnet as mx
        import hvdmx as hvd
        hvd.init()
        x = mx.nd.ones((4 << 20,))  # 16 MiB: most of the time is spent in the collective
        hvd.allreduce_(x, op=hvd.Max, name="big").wait_to_read()
        if hvd.rank() == 1:
            threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        while True:
            hvd.allreduce_(x, op=hvd.Max, name="big").wait_to_read()
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1",
               HVDMX_ALLREDUCE_ALGO="shm")
    result = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-c", script], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
