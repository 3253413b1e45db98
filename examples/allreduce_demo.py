"""A 2-process (or n-process) hvdmx demo: allreduce and broadcast through
MXNet's engine, checked on every rank.

    mpiexec -n 2 python examples/allreduce_demo.py
"""
import time

import mxnet as mx
import numpy as np

import hvdmx as hvd


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    print(f"rank {rank}/{size}: local_rank {hvd.local_rank()}, MPI threads "
          f"{'multiple' if hvd.mpi_threads_supported() else 'limited'}", flush=True)

    # Sum of a rank-dependent tensor: every rank must get the same exact result.
    x = mx.nd.arange(8) + 10 * rank
    total = hvd.allreduce(x, op=hvd.Sum, name="demo.sum")
    expected = size * np.arange(8) + 10 * size * (size - 1) / 2
    assert np.array_equal(total.asnumpy(), expected), total.asnumpy()

    # Broadcast rank 0's parameters to everyone.
    params = mx.nd.random.uniform(shape=(3,)) if rank == 0 else mx.nd.zeros((3,))
    hvd.broadcast_(params, root_rank=0, name="demo.params")

    # A burst of gradient-sized tensors, fused by the core.
    grads = [mx.nd.ones((1000 * (i + 1),)) * (rank + 1) for i in range(16)]
    start = time.perf_counter()
    outs = [hvd.allreduce(g, name=f"demo.grad.{i}") for i, g in enumerate(grads)]
    mx.nd.waitall()
    elapsed = (time.perf_counter() - start) * 1e3
    for out in outs:
        assert np.all(out.asnumpy() == (size + 1) / 2)

    print(f"rank {rank}: sum {total.asnumpy().astype(int).tolist()}, params "
          f"{np.round(params.asnumpy(), 4).tolist()}, 16 averaged gradients in "
          f"{elapsed:.1f} ms: OK", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
