"""hvdmx: fast, easy data-parallel training for Apache MXNet.

A drop-in replacement for ``horovod.mxnet``: ``import hvdmx as hvd``.

The public names load on first use (PEP 562), so that ``hvdmxrun`` and
``python -m hvdmx.timeline`` start without loading MXNet or MPI; the first
``hvd.init`` (or any other name) imports them.

Layers, bottom up. A module imports only modules listed above it (at its top
or inside a function), so there is no import cycle and ``import hvdmx.<module>``
works first in any interpreter; tests/test_layers.py checks both against this
list, a module of a subpackage by its dotted name. This package (``hvdmx``,
this file) is the facade: at import it loads nothing of hvdmx, and its names
load their modules when first used; the programs below it use hvdmx through
it, as a user's script does.

The package has rooms (hvdmx/README.md): the rendezvous (hvdmx/rendezvous/,
standard library only) that both sides share, the launcher (hvdmx/runner/),
which never loads MXNet or the rank API, and the rank API, every module
from ``errors`` up to this facade, which never imports the runner (the
facade's lazy ``run_function`` aside: Horovod's ``horovod.run`` is a
launcher a script calls).

The version, which both sides read:
    _version        the version, in one place (__version__)
The rendezvous, shared:
    rendezvous      its package (what each of its modules holds)
    rendezvous.wire  the rendezvous's variables, handshake and frames
    rendezvous.server  the rendezvous server of hvdmxrun --no-mpi
    rendezvous.client  a rank's side: the client group (StoreGroup)
    rendezvous.elastic_wire  what the elastic service and its workers both know
    rendezvous.srun  srun's tasks meet without MPI: task 0 serves, the meeting file
MPI's identity, which both sides read:
    _mpi            which MPI is which; loads the extension, and MPI for a job that uses it
    _core           the C++ extension (csrc/hvdmx; no MPI in it), loaded by _mpi
The launcher:
    runner          its package (what each of its modules holds)
    runner.flags    hvdmxrun's tuning flags and the variables they set
    runner.hosts    hvdmxrun's hosts: -H, the hostfile, the checks of each host
    runner.slurm    a Slurm allocation's nodes and tasks (SLURM_JOB_NODELIST, ...)
    runner.allocation  the hosts a scheduler gave the job: Slurm's, or an MPI hostfile's
    runner.srun_shell  --no-mpi's remote shell inside a Slurm allocation: srun steps
    runner.mpi      hvdmxrun's MPI launcher: which, its command and environment
    runner.bootstrap  what each rank of hvdmxrun --no-mpi runs first, on its host
    runner.nompi    hvdmxrun --no-mpi: starts the ranks itself, serves the rendezvous
    runner.elastic  the launcher's side of elastic, its package
    runner.elastic.hosts  an elastic job's hosts: discovery, blacklist, numbering of ranks
    runner.elastic.slurm_discovery  an elastic job's hosts in a Slurm allocation (sinfo)
    runner.elastic.membership  who is in an elastic job, generation by generation
    runner.elastic.loop  hvdmxrun's elastic loop: workers started, watched, hosts failed
    runner.elastic.service  the elastic rendezvous: a worker's place in each generation
    runner.elastic.job  hvdmxrun's elastic job: the service, the workers, the loop
    runner.function_job  run_function (Horovod's horovod.run): a function on every rank
    runner.launch   hvdmxrun, the launcher's command line
    spark._runner   what hvdmx.spark takes of the launcher's modules, in one place
    spark.data      a rank's share of a DataFrame: written by its task, read by the rank
    spark.task      a Spark barrier task: places and starts its rank, forwards its output
    spark.driver    hvdmx.spark.run: the barrier job, the servers, the ranks' outcomes
    spark           hvdmx.spark.run (horovod.spark.run): ranks in Spark's barrier tasks
The rank API:
    errors          exception classes (MXNetError and ValueError/TypeError)
    timeline        reads and plots the timeline's Chrome trace
    _job            whether hvdmx runs, its topology and communicator
    process_sets    ProcessSet, add/remove, names of unnamed calls
    elastic.worker  an elastic worker's side of the elastic rendezvous: join, newcomers
    basics          init, shutdown, rank, size, ... and the *_built calls
    ops             allreduce, broadcast, barrier, join, the reduce ops, the checks
    gather_scatter  allgather, alltoall, reducescatter
    compression     Compression.none, fp16, onebit
    objects         the collectives on Python objects
    functions       horovod.mxnet.functions's names (the objects' collectives)
    optimizer       DistributedOptimizer, broadcast_parameters, gradient reduction
    trainer         DistributedTrainer
    kvstore         KVStore, registered with MXNet as 'dist_sync_hvdmx' at import
    trainer_state   a Gluon trainer's (and a Module's) state: MXNet's private fields, read here only
    checkpoint_residuals  each rank's compression residuals in a checkpoint
    checkpoint      save_checkpoint, load_checkpoint
    elastic.arrays  hvd.elastic's snapshots of arrays, optimizer states' layouts
    elastic.driver  the seam of hvd.elastic to the launch: reset, hosts_updated
    elastic.state   hvd.elastic's State and ObjectState, the arrays a training state keeps
    elastic.gluon   hvd.elastic.GluonState
    elastic.module  hvd.elastic.ModuleState
    elastic.recovery  hvd.elastic.run, the reset limit
    elastic         hvd.elastic, its names loaded on first use
    hvdmx           this facade
The programs on top:
    build_report    hvdmxrun --check-build's checklist (python -m hvdmx.build_report)
    run             python -m hvdmx.run, the old path of hvdmxrun
    bench.timing    the benchmark's timing, sizes and MPI
    bench.collectives  the benchmark's collectives
    bench.tables    the benchmark's tables
    bench.model     the benchmark's model gradients
    bench.scale     the benchmark's scaling runs
    bench           python -m hvdmx.bench, the benchmark
    bench.cli       the benchmark's command line
    bench.__main__  python -m hvdmx.bench
    as_horovod      runs programs written for horovod.mxnet
"""
import importlib
from typing import TYPE_CHECKING

from ._version import __version__ as __version__

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
    'PeerProtocolError': 'errors',
    'save_checkpoint': 'checkpoint',
    'allgather_object': 'objects',
    'broadcast_object': 'objects',
    'Adasum': 'ops',
    'Average': 'ops',
    'Max': 'ops',
    'Min': 'ops',
    'Product': 'ops',
    'Sum': 'ops',
    'allgather': 'gather_scatter',
    'allreduce': 'ops',
    'allreduce_': 'ops',
    'alltoall': 'gather_scatter',
    'barrier': 'ops',
    'broadcast': 'ops',
    'broadcast_': 'ops',
    'grouped_allgather': 'gather_scatter',
    'grouped_allreduce': 'ops',
    'grouped_allreduce_': 'ops',
    'grouped_reducescatter': 'gather_scatter',
    'join': 'ops',
    'reducescatter': 'gather_scatter',
    'DistributedOptimizer': 'optimizer',
    'DistributedTrainer': 'trainer',
    'broadcast_parameters': 'optimizer',
    'ProcessSet': 'process_sets',
    'add_process_set': 'process_sets',
    'global_process_set': 'process_sets',
    'remove_process_set': 'process_sets',
    'run_function': 'runner.function_job',
}
__all__ = sorted(_EXPORTS)

# For type checkers, the same names as explicit imports (PEP 484's
# "import X as X" re-export), so that hvd.allreduce has allreduce's type, not
# Any; at run time they stay lazy (see above). tests/test_typing.py keeps this
# block and _EXPORTS the same.
if TYPE_CHECKING:
    from hvdmx import elastic as elastic, errors as errors
    from hvdmx.basics import (ccl_built as ccl_built, cross_rank as cross_rank,
        cross_size as cross_size, cuda_built as cuda_built, ddl_built as ddl_built,
        gloo_built as gloo_built, gloo_enabled as gloo_enabled, init as init,
        is_initialized as is_initialized, local_rank as local_rank, local_size as local_size,
        mpi_built as mpi_built, mpi_enabled as mpi_enabled,
        mpi_threads_supported as mpi_threads_supported, nccl_built as nccl_built, rank as rank,
        rocm_built as rocm_built, shutdown as shutdown, size as size,
        start_timeline as start_timeline, stop_timeline as stop_timeline)
    from hvdmx.checkpoint import (load_checkpoint as load_checkpoint,
        save_checkpoint as save_checkpoint)
    from hvdmx.compression import Compression as Compression
    from hvdmx.errors import PeerProtocolError as PeerProtocolError
    from hvdmx.gather_scatter import (allgather as allgather, alltoall as alltoall,
        grouped_allgather as grouped_allgather, grouped_reducescatter as grouped_reducescatter,
        reducescatter as reducescatter)
    from hvdmx.kvstore import KVStore as KVStore
    from hvdmx.objects import (allgather_object as allgather_object,
        broadcast_object as broadcast_object)
    from hvdmx.ops import (Adasum as Adasum, Average as Average, Max as Max, Min as Min,
        Product as Product, Sum as Sum, allreduce as allreduce, allreduce_ as allreduce_,
        barrier as barrier, broadcast as broadcast, broadcast_ as broadcast_,
        grouped_allreduce as grouped_allreduce, grouped_allreduce_ as grouped_allreduce_,
        join as join)
    from hvdmx.optimizer import (DistributedOptimizer as DistributedOptimizer,
        broadcast_parameters as broadcast_parameters)
    from hvdmx.process_sets import (ProcessSet as ProcessSet, add_process_set as add_process_set,
        global_process_set as global_process_set, remove_process_set as remove_process_set)
    from hvdmx.runner.function_job import run_function as run_function
    from hvdmx.trainer import DistributedTrainer as DistributedTrainer


def __getattr__(name):
    if name == "_core":
        return importlib.import_module("hvdmx._mpi").load_core()
    if name == "errors":  # the exception classes (hvdmx/errors.py)
        return importlib.import_module("hvdmx.errors")
    if name == "elastic":  # hvd.elastic (hvdmx/elastic/), as horovod.torch.elastic
        importlib.import_module("hvdmx.kvstore")  # as for any other name: see below
        return importlib.import_module("hvdmx.elastic")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hvdmx' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hvdmx.{module}"), name)
    # The kvstore module registers the plugin with MXNet when imported
    # (mx.kv.create("dist_sync_hvdmx"), kvstore="dist_sync_hvdmx"): imported
    # here as soon as any of hvdmx is used, except run_function, which runs in
    # the process that starts a job and is no rank of it: it loads neither
    # MXNet nor MPI (hvdmx/runner/function_job.py).
    if module != "runner.function_job":
        importlib.import_module("hvdmx.kvstore")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | {"elastic", "errors"})
