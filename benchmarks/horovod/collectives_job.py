"""One job of benchmarks/many_hosts.py, written against horovod.mxnet so that the same
program times Horovod (run by the Python of tools/horovod/build.sh's environment) and
hvdmx (run as `python -m hvdmx.as_horovod benchmarks/horovod/collectives_job.py`):

- in-place allreduce_ of float32 tensors of each --sizes (Sum), waited for after
  each call, beside MPI_Allreduce (mpi4py, numpy buffers) on the same bytes;
- MXNet's engine round trip, the floor under any call through the stack: an
  in-place op on a 1-element NDArray, pushed and waited for;
- with --model, the gradient set of a model-zoo network as DistributedTrainer
  sends it (an allreduce_ per gradient, named and prioritized by position, all
  pushed, then one wait), beside MPI_Allreduce per tensor and MPI_Iallreduce of
  every tensor followed by one MPI_Waitall.

Each figure is the slowest rank's mean over --iters after --warmup calls. Rank 0
prints one JSON object: {"sizes": {bytes: {"hvd_us", "mpi_us"}}, "engine_us",
"model": {...}}.
"""
import argparse
import json
import os
import sys

import numpy as np
from mpi4py import MPI  # first: Horovod joins the MPI that mpi4py started
import mxnet as mx
import horovod.mxnet as hvd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
# The slowest rank's mean, and the gradient shapes; neither loads hvdmx's core.
from hvdmx.bench import model_gradients, parse_size, timed  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,256K,64M", help="bytes, comma-separated")
    parser.add_argument("--model", default="", help="a model-zoo network, e.g. resnet50_v1")
    parser.add_argument("--iters", type=int, default=0,
                        help="timed calls (default: by size, 1000 for 4 B down to 5 for 64 MiB)")
    parser.add_argument("--model-iters", type=int, default=10)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    hvd.init()
    out = {"ranks": hvd.size(), "sizes": {}, "model": {}}
    one = mx.nd.ones((1,))

    def engine_call():
        one.__iadd__(1)  # one in-place op (`one += 1` would rebind the name here)
        one.wait_to_read()

    out["engine_us"] = timed(engine_call, 100, 1000, comm) * 1e6
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        count = max(1, size // 4)
        iters = args.iters or max(5, min(1000, (64 << 20) * 5 // max(size, 1)))
        x = mx.nd.ones((count,))
        y = np.ones(count, dtype=np.float32)
        name = f"size.{size}"

        def hvd_call(x=x, name=name):
            hvd.allreduce_(x, op=hvd.Sum, name=name)
            x.wait_to_read()

        def mpi_call(y=y):
            comm.Allreduce(MPI.IN_PLACE, y, op=MPI.SUM)

        warmup = max(2, iters // 10)
        out["sizes"][size] = {"hvd_us": timed(hvd_call, warmup, iters, comm) * 1e6,
                              "mpi_us": timed(mpi_call, warmup, iters, comm) * 1e6}
    if args.model:
        shapes = [s for s, _ in model_gradients(args.model)]
        grads = [mx.nd.ones(s) for s in shapes]
        bufs = [np.ones(s, dtype=np.float32) for s in shapes]

        def hvd_step():
            for i, g in enumerate(grads):
                hvd.allreduce_(g, op=hvd.Average, name=f"model.{i}", priority=-i)
            mx.nd.waitall()

        def mpi_per_tensor():
            for b in bufs:
                comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM)

        def mpi_iallreduce():
            MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, b, op=MPI.SUM) for b in bufs])

        n = args.model_iters
        out["model"] = {"name": args.model, "tensors": len(shapes),
                        "bytes": int(sum(b.nbytes for b in bufs)),
                        "hvd_ms": timed(hvd_step, 2, n, comm) * 1e3,
                        "mpi_per_tensor_ms": timed(mpi_per_tensor, 2, n, comm) * 1e3,
                        "mpi_iallreduce_ms": timed(mpi_iallreduce, 2, n, comm) * 1e3}
    if hvd.rank() == 0:
        print(json.dumps(out), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
