"""hvdmx: fast, easy data-parallel training for Apache MXNet.

A drop-in replacement for ``horovod.mxnet``: ``import hvdmx as hvd``.
"""
from hvdmx.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    gloo_built,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from hvdmx.compression import Compression
from hvdmx.functions import allgather_object, broadcast_object
from hvdmx.ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    join,
    reducescatter,
)
from hvdmx.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from hvdmx.optimizer import DistributedOptimizer, DistributedTrainer, broadcast_parameters

__version__ = "0.1.0"
