"""Horovod's side of `python -m hvdmx.bench model`: ms per iteration to
allreduce a model-zoo network's gradient set, the same tensors
(hvdmx.bench.model_gradients) timed the same way (hvdmx.bench.timed), with
what Horovod's DistributedTrainer sends: an in-place allreduce per gradient,
named and prioritized by position, pushed back to back, then a wait. Run it
with the Python of an environment that has Horovod (benchmarks/horovod/build.sh):

    DIR/venv/bin/mpiexec -n 2 DIR/venv/bin/python benchmarks/horovod/model_allreduce.py

hvdmx's own Python files are read from this checkout; its core is not loaded.
"""
import argparse
import os
import sys

import numpy as np
from mpi4py import MPI  # first, as hvdmx.bench does: Horovod joins the MPI it started
import mxnet as mx
import horovod.mxnet as hvd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from hvdmx.bench import model_gradients, timed  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50_v1", help="mx.gluon.model_zoo.vision name")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed iterations first (default: iters / 10, at least 2)")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    hvd.init()
    shapes = model_gradients(args.model)
    grads = [mx.nd.ones(s, dtype=d) for s, d in shapes]

    def step():
        for i, g in enumerate(grads):
            hvd.allreduce_(g, op=hvd.Average, name=f"model.{i}", priority=-i)
        mx.nd.waitall()

    warmup = args.warmup if args.warmup is not None else max(2, args.iters // 10)
    ms = timed(step, warmup, args.iters, comm) * 1e3
    if hvd.rank() == 0:
        total = sum(int(np.prod(s)) * d.itemsize for s, d in shapes)
        print(f"# {args.model} gradients: {len(shapes)} tensors, {total / 1e6:.1f} MB, "
              f"{hvd.size()} ranks; ms per iteration (mean of {args.iters})")
        print(f"horovod {ms:.1f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
