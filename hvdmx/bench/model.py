"""``python -m hvdmx.bench model``: a model-zoo network's gradient set,
allreduced as DistributedTrainer does, beside MPI and the memory floor."""
from __future__ import annotations

import statistics

import numpy as np

from hvdmx.bench.timing import load_mpi, rounds


def model_gradients(name: str) -> list:
    """The gradient shapes and dtypes of a model-zoo network, in the order
    DistributedTrainer reduces them (parameters sorted by name)."""
    import mxnet as mx
    net = mx.gluon.model_zoo.vision.get_model(name, pretrained=False)
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, 3, 224, 224)))  # resolves deferred shapes
    params = sorted(net.collect_params().items())
    return [(tuple(p.shape), np.dtype(p.dtype)) for _, p in params if p.grad_req != "null"]


def run_model(args) -> dict:
    """ms per iteration to allreduce a model's gradient set: hvdmx the way
    DistributedTrainer does (an allreduce_ per gradient, priority -i, all
    pushed in one call, then wait), MPI_Allreduce once per tensor,
    MPI_Allreduce once on one buffer holding them all (the call alone), and
    the same with the gradients copied into that buffer and the sums copied
    back, as a program whose gradients are separate arrays must; beside them the
    memory floor: every rank reads and writes each of its gradients once
    (numpy, in place), all ranks at once, which is the memory traffic an
    in-place allreduce cannot avoid on one host."""
    import mxnet as mx
    import hvdmx as hvd
    from hvdmx.ops import _allreduce_each_
    MPI = load_mpi()
    comm = MPI.COMM_WORLD
    hvd.init()
    shapes = model_gradients(args.model)
    grads = [mx.nd.ones(s, dtype=d) for s, d in shapes]
    total = sum(int(np.prod(s)) * d.itemsize for s, d in shapes)

    names = [f"model.{i}" for i in range(len(grads))]
    priorities = [-i for i in range(len(grads))]

    def hvdmx_step():
        # What DistributedTrainer does: allreduce_ of each gradient, pushed in one call.
        _allreduce_each_(grads, names, priorities, hvd.Average, 1.0, 1.0, hvd.global_process_set)
        mx.nd.waitall()

    mpi_bufs = [np.ones(s, dtype=d) for s, d in shapes]
    fused = np.ones(sum(int(np.prod(s)) for s, _ in shapes), dtype=np.float32)

    adasum_names = [f"model.adasum.{i}" for i in range(len(grads))]

    def adasum_step():
        # The same with op=hvd.Adasum (DistributedTrainer(..., op=hvd.Adasum)).
        _allreduce_each_(grads, adasum_names, priorities, hvd.Adasum, 1.0, 1.0,
                         hvd.global_process_set)
        mx.nd.waitall()

    def mpi_per_tensor():
        for b in mpi_bufs:
            comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM)

    def mpi_fused():
        comm.Allreduce(MPI.IN_PLACE, fused, op=MPI.SUM)

    ends = np.cumsum([0] + [b.size for b in mpi_bufs])
    views = [fused[ends[i]:ends[i + 1]].reshape(b.shape) for i, b in enumerate(mpi_bufs)]

    def mpi_fused_copies():
        for b, v in zip(mpi_bufs, views):
            np.copyto(v, b)
        comm.Allreduce(MPI.IN_PLACE, fused, op=MPI.SUM)
        for b, v in zip(mpi_bufs, views):
            np.copyto(b, v)

    def memory_floor():
        for b in mpi_bufs:
            np.multiply(b, 1, out=b)

    warmup = args.warmup if args.warmup is not None else max(2, args.iters // 10)
    steps = {"hvdmx": hvdmx_step, "floor": memory_floor}
    if args.adasum:
        steps["adasum"] = adasum_step
    if args.vs_mpi:
        steps.update({"mpi_per_tensor": mpi_per_tensor, "mpi_fused": mpi_fused,
                      "mpi_fused_copies": mpi_fused_copies})
    times = rounds(steps, args.rounds, warmup, args.iters, comm)
    row = {"model": args.model, "tensors": len(shapes), "bytes": total, "ranks": hvd.size(),
           "iters": args.iters, "warmup": warmup, "rounds": args.rounds}
    for name, seconds in times.items():
        row[f"{name}_ms"] = statistics.median(seconds) * 1e3
        row[f"{name}_rounds_ms"] = [x * 1e3 for x in seconds]
    hvd.shutdown()
    return row
