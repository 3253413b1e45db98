"""The job hvdmx runs in, as the layers above basics see it: whether
collectives can run, the topology, and the mpi4py communicator that
``hvd.init`` ran on (set by basics.init). Below process_sets and basics, so
that both read it without importing each other (see the layers in
hvdmx/__init__.py)."""
from __future__ import annotations

# _core before mpi4py.MPI: see basics.py.
from hvdmx import _core
from hvdmx.errors import NotRunningError
from mpi4py import MPI

comm = None  # the mpi4py communicator hvdmx runs on; None before the first init


def job_comm():
    """The mpi4py communicator of the whole job (what init ran on)."""
    return comm if comm is not None else MPI.COMM_WORLD


def not_running() -> NotRunningError:
    """The error for a call made while hvdmx is not running: why it stopped,
    when it stopped on its own or by another rank's shutdown."""
    return NotRunningError(_core.stop_reason() or "hvdmx has not been initialized, or has been "
                           "shut down; call hvd.init() first")


def check_running() -> None:
    """Raises unless collectives can run: before init, after this rank's
    shutdown, and after a peer's shutdown or a stall stopped hvdmx here."""
    if not _core.is_initialized():
        raise not_running()


def topology() -> tuple:
    """(rank, size, local_rank, local_size, cross_rank, cross_size, MPI thread
    multiple). Answers from this rank's init until its own shutdown, also
    after a peer's shutdown stopped the collectives (as Horovod does)."""
    return _core.topology()
