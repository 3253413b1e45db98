"""Times broadcast, allgather and alltoall with HVDMX_SHM_DIRECT_MIN_BYTES=-1
(off: through the shared-memory stages, except allgathers of more than 32 MiB,
which then go by MPI point-to-point) and 0 (every call reads the peers'
buffers directly), beside the matching MPI call on numpy arrays, interleaved:
every round restarts hvdmx once per value, in this one job, so both see the
same phase of the machine.

    OMP_NUM_THREADS=1 MXNET_CPU_WORKER_NTHREADS=1 \\
      .venv/bin/mpiexec -n 2 .venv/bin/python tools/direct_reads.py --rounds 3

Prints one row per round, collective and size: microseconds per call (mean
over --iters, slowest rank). Sizes as in `python -m hvdmx.bench`: the buffer
for broadcast, the output for allgather, what each rank sends for alltoall.
"""
import sys

from interleave import main as interleave

KINDS = ("broadcast", "allgather", "alltoall")


def main(argv=None):
    return interleave(argv, variable=("HVDMX_SHM_DIRECT_MIN_BYTES", ["-1", "0"]),
                      labels=["off", "direct"], kinds=KINDS, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
