"""Times collectives under each value of one environment variable in turn,
beside the matching MPI call on numpy arrays, interleaved: every round
restarts hvdmx once per value, in this one job, so all values see the same
phase of the machine. For example, what huge pages under MPI's buffers do
on the ring and MPI paths:

    OMP_NUM_THREADS=1 MXNET_CPU_WORKER_NTHREADS=1 \\
      .venv/bin/mpiexec -n 2 .venv/bin/python tools/interleave.py \\
      HVDMX_HUGE_PAGES=0,1 --set HVDMX_ALLREDUCE_ALGO=ring --rounds 3

Prints one row per round, collective and size: microseconds per call (mean
over --iters, slowest rank), one column per value, then MPI. hvdmx's arrays
are --dtype (float32 by default; float16 for half-precision paths, e.g.
HVDMX_HALF_PARTIALS=half,float32), MPI's always float32. Sizes as in
`python -m hvdmx.bench`: the buffer for allreduce (in place, Sum) and
broadcast (in place, root 0), the output for allgather, what each rank
sends for alltoall.
"""
import argparse
import os
import sys

import numpy as np

from hvdmx.bench import parse_size, timed

KINDS = ("allreduce", "broadcast", "allgather", "alltoall")


def _assignment(text):
    """NAME=VALUE[,VALUE...] -> (NAME, [VALUE, ...])."""
    name, sep, values = text.partition("=")
    if not sep or not name or not values or "" in values.split(","):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=VALUE[,VALUE...], e.g. HVDMX_HUGE_PAGES=0,1")
    return name, values.split(",")


def main(argv=None, *, variable=None, labels=None, kinds=KINDS, description=__doc__):
    """The tool; with `variable` ((name, values), as the positional argument
    would give), it is fixed and the columns are headed by `labels`."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if variable is None:
        parser.add_argument("variable", type=_assignment, metavar="NAME=VALUE[,VALUE...]",
                            help="the variable to vary and its values, in the order timed")
        parser.add_argument("--set", type=_assignment, action="append", default=[],
                            metavar="NAME=VALUE",
                            help="also set this variable for every value (repeatable)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--iters", type=int, default=20,
                        help="timed calls per value, size and round (default 20)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed calls after each start (default 5)")
    parser.add_argument("--sizes", default="4M,16M,64M",
                        help="sizes in bytes, comma-separated, K/M/G allowed (default 4M,16M,64M)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"],
                        help="hvdmx's arrays (default float32; MPI's stay float32)")
    parser.add_argument("--kinds", default=",".join(kinds),
                        help=f"collectives, comma-separated (default {','.join(kinds)})")
    args = parser.parse_args(argv)
    name, values = variable if variable is not None else args.variable
    fixed = {} if variable is not None else dict(args.set)
    for option, value in [("--rounds", args.rounds), ("--iters", args.iters)]:
        if value < 1:
            parser.error(f"{option} must be >= 1 (got {value})")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0 (got {args.warmup})")
    for var, value in fixed.items():
        if len(value) != 1:
            parser.error(f"--set {var}: give one value, got {','.join(value)}")
    chosen = args.kinds.split(",")
    bad = [k for k in chosen if k not in kinds]
    if bad:
        parser.error(f"--kinds: {bad[0]!r} is not one of {', '.join(kinds)}")
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes: {args.sizes!r} is not a list of byte counts such as 4M,16M")
    if any(s < 4 for s in sizes):
        parser.error(f"--sizes: every size must be at least 4 bytes (got {args.sizes})")

    import mxnet as mx
    from mpi4py import MPI
    import hvdmx as hvd

    comm = MPI.COMM_WORLD
    n = comm.size
    for var, (value,) in fixed.items():
        os.environ[var] = value

    def hvdmx_call(kind, count):
        if kind == "alltoall":
            x = mx.nd.ones((count // n * n,), dtype=args.dtype)
            return lambda: hvd.alltoall(x, name="interleave").wait_to_read()
        if kind == "allgather":
            x = mx.nd.ones((count // n,), dtype=args.dtype)
            return lambda: hvd.allgather(x, name="interleave").wait_to_read()
        x = mx.nd.zeros((count,), dtype=args.dtype)
        if kind == "allreduce":
            return lambda: hvd.allreduce_(x, op=hvd.Sum, name="interleave").wait_to_read()
        return lambda: hvd.broadcast_(x, root_rank=0, name="interleave").wait_to_read()

    def mpi_call(kind, count):
        # Written buffers, as in bench: calloc'd pages that nothing wrote
        # all map the kernel's shared zero page, and MPI's single-copy moves
        # from them were 1.45x slower (MPI_Bcast of 64 MiB here).
        a = np.ones(count // n * n, np.float32)
        b = np.ones(count // n * n, np.float32)
        if kind == "alltoall":
            return lambda: comm.Alltoall(a, b)
        if kind == "allgather":
            return lambda: comm.Allgather(a[:count // n], b)
        if kind == "allreduce":
            return lambda: comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
        return lambda: comm.Bcast(a, root=0)

    heads = labels or values
    if comm.rank == 0:
        also = "".join(f" {var}={value}" for var, (value,) in fixed.items())
        also += f" --dtype {args.dtype}" if args.dtype != "float32" else ""
        print(f"# {n} ranks; us per call: {name}=" + ", =".join(
            v if h == v else f"{v} ({h})" for v, h in zip(values, heads))
            + ", and the MPI call on numpy arrays" + (f"; with{also}" if also else ""))
        print(f"{'round':>5} {'collective':>10} {'size(B)':>11} "
              + " ".join(f"{h:>9}" for h in heads) + f" {'MPI':>9}")
    for r in range(args.rounds):
        for kind in chosen:
            for size in sizes:
                count = size // 4
                row = []
                for value in values:
                    os.environ[name] = value
                    hvd.init()
                    call = hvdmx_call(kind, size // np.dtype(args.dtype).itemsize)
                    row.append(timed(call, args.warmup, args.iters, comm))
                    hvd.shutdown()
                row.append(timed(mpi_call(kind, count), args.warmup, args.iters, comm))
                if comm.rank == 0:
                    print(f"{r + 1:>5} {kind:>10} {size:>11} "
                          + " ".join(f"{t * 1e6:>9.1f}" for t in row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
