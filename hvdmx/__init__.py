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
)
from hvdmx.checkpoint import load_checkpoint, save_checkpoint
from hvdmx.compression import Compression
from hvdmx.kvstore import KVStore
from hvdmx.ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allreduce,
    allreduce_,
    broadcast,
    broadcast_,
    grouped_allreduce,
    grouped_allreduce_,
)
from hvdmx.optimizer import DistributedOptimizer, DistributedTrainer, broadcast_parameters

__version__ = "0.1.0"
