"""Times collectives under each value of one environment variable in turn,
beside the matching MPI call on numpy arrays, interleaved: every round
restarts hvdmx once per value, in this one job, so all values see the same
phase of the machine. For example, what huge pages under MPI's buffers do
on the ring and MPI paths:

    OMP_NUM_THREADS=1 MXNET_CPU_WORKER_NTHREADS=1 \\
      .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/interleave.py \\
      HVDMX_HUGE_PAGES=0,1 --set HVDMX_ALLREDUCE_ALGO=ring --rounds 3

Prints one row per round, collective and size: microseconds per call (mean
over --iters, slowest rank), one column per value, then MPI. hvdmx's arrays
are --dtype (float32 by default; float16 for half-precision paths, e.g.
HVDMX_HALF_PARTIALS=half,float32), MPI's always float32. Sizes as in
`python -m hvdmx.bench`: the buffer for allreduce (in place, Sum) and
broadcast (in place, root 0), the output for allgather, what each rank
sends for alltoall.

The kind ``model`` times a model-zoo network's gradient set (--model), as
``python -m hvdmx.bench model`` does, in microseconds per iteration; its row
has the memory floor (every rank reads and writes its gradients once, all
at once) first and last instead of MPI: on a shared VM the two floors tell
the machine's phases apart. It is not mixed with the collectives.

Presets (--preset NAME) fix the variable, its values and the kinds:
  direct-reads      HVDMX_SHM_DIRECT_MIN_BYTES=-1 (off: through the
                    shared-memory stages, except allgathers of more than 32 MiB,
                    which then go by MPI point-to-point) and 0 (every call reads
                    the peers' buffers directly), for broadcast, allgather and
                    alltoall
  streaming-stores  HVDMX_SHM_STREAMING_STORES=0,1,auto for the kind model
"""
import argparse
import os
import sys

import numpy as np

from hvdmx.bench import model_gradients, parse_size, timed

KINDS = ("allreduce", "broadcast", "allgather", "alltoall", "model")
DEFAULT_KINDS = ("allreduce", "broadcast", "allgather", "alltoall")
# name -> (the variable and its values, the columns' labels, the kinds).
PRESETS = {
    "direct-reads": (("HVDMX_SHM_DIRECT_MIN_BYTES", ["-1", "0"]), ["off", "direct"],
                     ("broadcast", "allgather", "alltoall")),
    "streaming-stores": (("HVDMX_SHM_STREAMING_STORES", ["0", "1", "auto"]), None, ("model",)),
}


def _assignment(text):
    """NAME=VALUE[,VALUE...] -> (NAME, [VALUE, ...])."""
    name, sep, values = text.partition("=")
    if not sep or not name or not values or "" in values.split(","):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=VALUE[,VALUE...], e.g. HVDMX_HUGE_PAGES=0,1")
    return name, values.split(",")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variable", type=_assignment, metavar="NAME=VALUE[,VALUE...]",
                        nargs="?", help="the variable to vary and its values, in the order "
                                        "timed (not with --preset)")
    parser.add_argument("--preset", choices=sorted(PRESETS),
                        help="a variable, values and kinds given above")
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
    parser.add_argument("--kinds", help=f"collectives, comma-separated, from {', '.join(KINDS)} "
                                         f"(default {','.join(DEFAULT_KINDS)}, or the preset's)")
    parser.add_argument("--model", default="resnet50_v1",
                        help="the model-zoo network of the kind model (default resnet50_v1)")
    args = parser.parse_args(argv)
    labels, kinds = None, KINDS
    if args.preset is not None:
        if args.variable is not None:
            parser.error(f"give a variable ({args.variable[0]}=...) or --preset "
                         f"{args.preset}, not both")
        variable, labels, kinds = PRESETS[args.preset]
    elif args.variable is None:
        parser.error("give the variable to vary (NAME=VALUE[,VALUE...]) or --preset")
    else:
        variable = args.variable
    name, values = variable
    fixed = dict(args.set)
    for option, value in [("--rounds", args.rounds), ("--iters", args.iters)]:
        if value < 1:
            parser.error(f"{option} must be >= 1 (got {value})")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0 (got {args.warmup})")
    for var, value in fixed.items():
        if len(value) != 1:
            parser.error(f"--set {var}: give one value, got {','.join(value)}")
    chosen = args.kinds.split(",") if args.kinds else list(
        kinds if args.preset is not None else DEFAULT_KINDS)
    bad = [k for k in chosen if k not in kinds]
    if bad:
        parser.error(f"--kinds: {bad[0]!r} is not one of {', '.join(kinds)}")
    model = "model" in chosen
    if model and len(chosen) > 1:
        parser.error("--kinds: model is timed alone (its row ends with the memory floor, "
                     "not MPI); give it in a run of its own")
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes: {args.sizes!r} is not a list of byte counts such as 4M,16M")
    if any(s < 4 for s in sizes):
        parser.error(f"--sizes: every size must be at least 4 bytes (got {args.sizes})")

    import mxnet as mx
    from mpi4py import MPI
    import hvdmx as hvd
    from hvdmx.ops import _allreduce_each_

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

    if model:
        # The gradient set as DistributedTrainer reduces it, and numpy copies
        # of it for the memory floor.
        shapes = model_gradients(args.model)
        grads = [mx.nd.ones(s, dtype=d) for s, d in shapes]
        arrays = [np.ones(s, dtype=d) for s, d in shapes]
        grad_names = [f"model.{i}" for i in range(len(grads))]
        priorities = [-i for i in range(len(grads))]
        sizes = [sum(a.nbytes for a in arrays)]

        def floor():
            for a in arrays:
                np.multiply(a, 1, out=a)

        def model_step():
            _allreduce_each_(grads, grad_names, priorities, hvd.Average, 1.0, 1.0,
                             hvd.global_process_set)
            mx.nd.waitall()

    heads = labels or values
    if comm.rank == 0:
        also = "".join(f" {var}={value}" for var, (value,) in fixed.items())
        also += f" --dtype {args.dtype}" if args.dtype != "float32" and not model else ""
        what = (f"us per iteration of {args.model}'s {len(shapes)} gradients" if model
                else "us per call")
        last = ", with the memory floor first and last" if model else \
            ", and the MPI call on numpy arrays"
        print(f"# {n} ranks; {what}: {name}=" + ", =".join(
            v if h == v else f"{v} ({h})" for v, h in zip(values, heads))
            + last + (f"; with{also}" if also else ""))
        print(f"{'round':>5} {'collective':>10} {'size(B)':>11} "
              + (f"{'floor':>9} " if model else "")
              + " ".join(f"{h:>9}" for h in heads) + f" {'floor' if model else 'MPI':>9}")
    for r in range(args.rounds):
        if model:
            row = [timed(floor, 0, 5, comm)]
            for value in values:
                os.environ[name] = value
                hvd.init()
                row.append(timed(model_step, args.warmup, args.iters, comm))
                hvd.shutdown()
            row.append(timed(floor, 0, 5, comm))
            if comm.rank == 0:
                print(f"{r + 1:>5} {'model':>10} {sizes[0]:>11} "
                      + " ".join(f"{t * 1e6:>9.1f}" for t in row), flush=True)
            continue
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
