"""Benchmarks that print what the field prints (nccl-tests' columns).

Run under MPI, e.g.::

    mpiexec -n 2 python -m hvdmx.bench allreduce
    mpiexec -n 2 python -m hvdmx.bench allreduce --min-bytes 4 --max-bytes 4 --iters 2000
    mpiexec -n 2 python -m hvdmx.bench allgather --min-bytes 1M --max-bytes 64M --plot ag.png
    mpiexec -n 2 python -m hvdmx.bench model --model resnet50_v1
    mpiexec -n 2 python -m hvdmx.bench idle --seconds 10
    python -m hvdmx.bench scale --ranks 16,256 --per-host 16

``allreduce``, ``allgather``, ``broadcast``, ``alltoall`` and ``reducescatter``
time hvdmx through the whole stack (Python call, MXNet engine, negotiation,
collective, result read) and, in the same run, the matching MPI call through
mpi4py on the same bytes (MPI_Allreduce, MPI_Allgather, MPI_Bcast,
MPI_Alltoall, MPI_Reduce_scatter_block), and print both with their ratio.
allreduce and broadcast are timed twice, as nccl-tests does: out of place
(``allreduce(x)``: a new output per call) and in place (``allreduce_(x)``);
the other collectives have no in-place form. The ratio compares MPI with
the in-place figure where there is one (MPI runs in place there too).
Sizes are bytes of the largest buffer; GB = 1e9; busbw = algbw times
2(n-1)/n for allreduce, (n-1)/n for allgather, alltoall and reducescatter,
1 for broadcast (nccl-tests' factors). Every size first gets a correctness
pass (#wrong counts elements that differ from the exact result).
``allgather --tensors K`` cuts each rank's part into K tensors and times one
``grouped_allgather`` of them beside K MPI_Allgather calls.
``alltoall --splits`` passes the (equal) splits as a list, so each call
also returns the received splits, as Horovod scripts usually call it.
``model`` allreduces the gradient set of a model-zoo network the way
DistributedTrainer does and prints ms per iteration beside MPI_Allreduce per
tensor, on one fused buffer (the call alone), and on one fused buffer with the
copies a program with separate gradient arrays needs (each gradient copied in,
the sums copied back), and beside the memory floor: every rank reading and
writing its gradients once, all ranks at once. ``--plot`` draws busbw
against size. ``--mpi-memory mxnet`` gives MPI buffers that MXNet allocated,
the kind of memory hvdmx's inputs have, instead of numpy arrays: numpy asks
for huge pages for arrays of 4 MiB and up and MXNet does not, which changes
how fast large messages move between processes.
``scale`` needs no mpiexec: it runs N ranks of the core (no MXNet) as threads of
one process, hosts made of groups of ranks sharing memory and real TCP on the
loopback between them, and prints per cached negotiation round the messages
and bytes of the busiest rank, the network latencies on the critical path
and the time, beside the CPU all ranks used over the cores (on a small
machine, the round's floor), and a step of a model's gradient set
(docs/scaling.md).
``--rounds R`` times every column R times, one after another in turn (hvdmx
out of place, in place, MPI, then again), and prints each column's median:
a slow phase of a shared machine then falls on hvdmx and MPI alike.
``idle`` reports the CPU time an initialized process uses while it runs no
collective.
"""

# The helpers the benchmark programs (benchmarks/) share with this one.
from hvdmx.bench.timing import parse_size, rounds, timed  # noqa: E402
from hvdmx.bench.model import model_gradients  # noqa: E402

__all__ = ["model_gradients", "parse_size", "rounds", "timed"]
