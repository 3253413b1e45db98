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
import argparse
import os
import sys

import numpy as np

KINDS = ("broadcast", "allgather", "alltoall")


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--iters", type=int, default=20,
                        help="timed calls per value, size and round (default 20)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed calls after each start (default 5)")
    parser.add_argument("--sizes", default="4M,16M,64M",
                        help="sizes in bytes, comma-separated, K/M/G allowed (default 4M,16M,64M)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"collectives, comma-separated (default {','.join(KINDS)})")
    args = parser.parse_args(argv)
    for name, value in [("--rounds", args.rounds), ("--iters", args.iters)]:
        if value < 1:
            parser.error(f"{name} must be >= 1 (got {value})")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0 (got {args.warmup})")
    kinds = args.kinds.split(",")
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        parser.error(f"--kinds: {bad[0]!r} is not one of {', '.join(KINDS)}")
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes: {args.sizes!r} is not a list of byte counts such as 4M,16M")
    if any(s < 4 for s in sizes):
        parser.error(f"--sizes: every size must be at least 4 bytes (got {args.sizes})")

    import mxnet as mx
    from mpi4py import MPI
    import hvdmx as hvd
    from hvdmx.bench import _timed

    comm = MPI.COMM_WORLD
    n = comm.size

    def hvdmx_call(kind, count):
        if kind == "alltoall":
            x = mx.nd.ones((count // n * n,))
            return lambda: hvd.alltoall(x, name="direct_reads").wait_to_read()
        if kind == "allgather":
            x = mx.nd.ones((count // n,))
            return lambda: hvd.allgather(x, name="direct_reads").wait_to_read()
        x = mx.nd.ones((count,))
        return lambda: hvd.broadcast_(x, root_rank=0, name="direct_reads").wait_to_read()

    def mpi_call(kind, count):
        a = np.ones(count // n * n, np.float32)
        b = np.zeros(count // n * n, np.float32)
        if kind == "alltoall":
            return lambda: comm.Alltoall(a, b)
        if kind == "allgather":
            return lambda: comm.Allgather(a[:count // n], b)
        return lambda: comm.Bcast(a, root=0)

    if comm.rank == 0:
        print(f"# {n} ranks; us per call: HVDMX_SHM_DIRECT_MIN_BYTES=-1 (off), "
              f"=0 (direct reads), and the MPI call on numpy arrays")
        print(f"{'round':>5} {'collective':>10} {'size(B)':>11} {'off':>9} {'direct':>9} "
              f"{'MPI':>9}")
    for r in range(args.rounds):
        for kind in kinds:
            for size in sizes:
                count = size // 4
                row = []
                for value in ("-1", "0"):
                    os.environ["HVDMX_SHM_DIRECT_MIN_BYTES"] = value
                    hvd.init()
                    row.append(_timed(hvdmx_call(kind, count), args.warmup, args.iters, comm))
                    hvd.shutdown()
                row.append(_timed(mpi_call(kind, count), args.warmup, args.iters, comm))
                if comm.rank == 0:
                    print(f"{r + 1:>5} {kind:>10} {size:>11} "
                          + " ".join(f"{t * 1e6:>9.1f}" for t in row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
