"""hvdmx: fast, easy data-parallel training for Apache MXNet.

A drop-in replacement for ``horovod.mxnet``: ``import hvdmx as hvd``.

The public names load on first use (PEP 562), so that ``hvdmxrun`` and
``python -m hvdmx.timeline`` start without loading MXNet or MPI; the first
``hvd.init`` (or any other name) imports them.
"""
import importlib

__version__ = "0.1.0"

# Public name -> the submodule that defines it.
_EXPORTS = {
    'ccl_built': 'basics',
    'cross_rank': 'basics',
    'cross_size': 'basics',
    'cuda_built': 'basics',
    'ddl_built': 'basics',
    'gloo_built': 'basics',
    'gloo_enabled': 'basics',
    'init': 'basics',
    'is_initialized': 'basics',
    'local_rank': 'basics',
    'local_size': 'basics',
    'mpi_built': 'basics',
    'mpi_enabled': 'basics',
    'mpi_threads_supported': 'basics',
    'nccl_built': 'basics',
    'rank': 'basics',
    'rocm_built': 'basics',
    'shutdown': 'basics',
    'size': 'basics',
    'start_timeline': 'basics',
    'stop_timeline': 'basics',
    'Compression': 'compression',
    'KVStore': 'kvstore',
    'load_checkpoint': 'checkpoint',
    'save_checkpoint': 'checkpoint',
    'allgather_object': 'functions',
    'broadcast_object': 'functions',
    'Adasum': 'ops',
    'Average': 'ops',
    'Max': 'ops',
    'Min': 'ops',
    'Product': 'ops',
    'Sum': 'ops',
    'allgather': 'ops',
    'allreduce': 'ops',
    'allreduce_': 'ops',
    'alltoall': 'ops',
    'barrier': 'ops',
    'broadcast': 'ops',
    'broadcast_': 'ops',
    'grouped_allgather': 'ops',
    'grouped_allreduce': 'ops',
    'grouped_allreduce_': 'ops',
    'grouped_reducescatter': 'ops',
    'join': 'ops',
    'reducescatter': 'ops',
    'DistributedOptimizer': 'optimizer',
    'DistributedTrainer': 'optimizer',
    'broadcast_parameters': 'optimizer',
    'ProcessSet': 'process_sets',
    'add_process_set': 'process_sets',
    'global_process_set': 'process_sets',
    'remove_process_set': 'process_sets',
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name == "_core":
        # The extension binds to the libmpi that mpi4py loads (by soname), so
        # mpi4py must come first. Only that: submodules import _core at their
        # top, and any more here would import them back half-initialized.
        importlib.import_module("mpi4py.MPI")
        return importlib.import_module("hvdmx._core")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hvdmx' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hvdmx.{module}"), name)
    # Registers the kvstore plugin with MXNet (mx.kv.create("dist_sync_hvdmx"),
    # kvstore="dist_sync_hvdmx") as soon as any of hvdmx is used; init()
    # registers it too, for code that imports a submodule directly.
    importlib.import_module("hvdmx.kvstore")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
