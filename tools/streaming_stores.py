"""Times a model's gradient set (as `python -m hvdmx.bench model` does) under each
value of HVDMX_SHM_STREAMING_STORES, interleaved: every round restarts hvdmx once
per value, in this one job, so all values see the same phase of the machine. The
memory floor (every rank reads and writes its gradients once) is timed at the
start and end of each round: on the project's VM it tells the phases apart.

    OMP_NUM_THREADS=1 MXNET_CPU_WORKER_NTHREADS=1 \\
      .venv/bin/mpiexec -n 2 .venv/bin/python tools/streaming_stores.py --rounds 8

Prints one row per round, ms per iteration (mean over --iters, slowest rank).
"""
import argparse
import os
import sys

import numpy as np


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50_v1", help="a gluon model-zoo name")
    parser.add_argument("--rounds", type=int, default=4, help="rounds (default 4)")
    parser.add_argument("--iters", type=int, default=20,
                        help="timed iterations per value and round (default 20)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed iterations after each start (default 3)")
    parser.add_argument("--values", default="0,1,auto",
                        help="HVDMX_SHM_STREAMING_STORES values, comma-separated "
                             "(default 0,1,auto)")
    args = parser.parse_args(argv)
    values = args.values.split(",")
    for name, value in [("--rounds", args.rounds), ("--iters", args.iters)]:
        if value < 1:
            parser.error(f"{name} must be >= 1 (got {value})")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0 (got {args.warmup})")
    bad = [v for v in values if v not in ("0", "1", "auto")]
    if bad:
        parser.error(f"--values: {bad[0]!r} is not one of 0, 1, auto")

    import mxnet as mx
    from mpi4py import MPI
    import hvdmx as hvd
    from hvdmx.bench import model_gradients, timed
    from hvdmx.ops import _allreduce_each_

    comm = MPI.COMM_WORLD
    shapes = model_gradients(args.model)
    grads = [mx.nd.ones(s, dtype=d) for s, d in shapes]
    arrays = [np.ones(s, dtype=d) for s, d in shapes]
    names = [f"model.{i}" for i in range(len(grads))]
    priorities = [-i for i in range(len(grads))]

    def floor():
        for a in arrays:
            np.multiply(a, 1, out=a)

    def step():
        _allreduce_each_(grads, names, priorities, hvd.Average, 1.0, 1.0,
                         hvd.global_process_set)
        mx.nd.waitall()

    if comm.rank == 0:
        total = sum(int(np.prod(s)) * d.itemsize for s, d in shapes)
        print(f"# {args.model} gradients: {len(shapes)} tensors, {total / 1e6:.1f} MB, "
              f"{comm.size} ranks; ms per iteration by HVDMX_SHM_STREAMING_STORES")
        print(f"{'round':>5} {'floor':>6} " + " ".join(f"{v:>6}" for v in values)
              + f" {'floor':>6}")
    for r in range(args.rounds):
        row = [timed(floor, 0, 5, comm) * 1e3]
        for value in values:
            os.environ["HVDMX_SHM_STREAMING_STORES"] = value
            hvd.init()
            row.append(timed(step, args.warmup, args.iters, comm) * 1e3)
            hvd.shutdown()
        row.append(timed(floor, 0, 5, comm) * 1e3)
        if comm.rank == 0:
            print(f"{r + 1:>5} " + " ".join(f"{t:>6.1f}" for t in row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
