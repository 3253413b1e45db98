"""The job hvdmx runs in, as the layers above basics see it: whether
collectives can run, the topology, and the mpi4py communicator that
``hvd.init`` ran on (set by basics.init). Below process_sets and basics, so
that both read it without importing each other (see the layers in
hvdmx/__init__.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from hvdmx import _core
from hvdmx._mpi import load_mpi as _load_mpi, started_without_mpi as _started_without_mpi
from hvdmx.errors import InvalidArgumentError, MismatchError, NotRunningError, PeerProtocolError
from mxnet.base import MXNetError

# The mpi4py communicator hvdmx runs on (an mpi4py.MPI.Comm: mpi4py is
# imported only by a job that uses MPI); None before the first init, and in
# a job started without MPI.
comm: Optional[Any] = None
if TYPE_CHECKING:
    from hvdmx.rendezvous.client import StoreGroup
# In a job started without MPI: the job's group at the launcher's rendezvous
# (hvdmx.rendezvous.client.StoreGroup), from the first init on.
group: Optional["StoreGroup"] = None


def job_comm():
    """The mpi4py communicator of the whole job (what init ran on); None in
    a job started without MPI (hvdmxrun --no-mpi)."""
    if comm is None and _started_without_mpi():
        return None
    return comm if comm is not None else _load_mpi().COMM_WORLD


# What each status code of the core (Status::Code in csrc/hvdmx/base/common.h)
# means to the Python layer, decided by the code and never by the message's
# text: the exception class of a call that failed with it ...
_ERROR_CLASSES = {
    _core.STATUS_INVALID_ARGUMENT: InvalidArgumentError,
    _core.STATUS_MISMATCH: MismatchError,
    _core.STATUS_SHUTDOWN: MXNetError,
    _core.STATUS_INTERNAL: MXNetError,
    _core.STATUS_PEER_SHUTDOWN: MXNetError,
    _core.STATUS_STALLED: MXNetError,
    _core.STATUS_PEER_GONE: MXNetError,
    _core.STATUS_PEER_PROTOCOL: PeerProtocolError,
}
# ... and, for the reason the runtime stopped (stop_status), whether the peers
# this rank waited for may be gone: the stall shutdown gave up on them while
# this rank waited for collectives, or a transport or shared memory found one
# stopped, dead or unreachable. Not a stall while this rank waited in
# hvd.shutdown() (STATUS_SHUTDOWN): the others may only be busy elsewhere,
# and MPI_Finalize waits for them as it should. Not another rank's shutdown
# either: that rank finalizes MPI too. A peer that broke the protocol (or
# stopped on a peer that did) takes part in nothing more either.
# basics._exit_if_peers_are_gone acts on it.
_PEERS_GONE = frozenset({_core.STATUS_STALLED, _core.STATUS_PEER_GONE,
                         _core.STATUS_PEER_PROTOCOL})
# ... and whether hvd.elastic.run may reset and go on after it: after a lost
# peer, yes; after a peer that broke the protocol, no (the job fails naming it).
_RECOVERABLE = frozenset({_core.STATUS_STALLED, _core.STATUS_PEER_GONE})


def error_for(code: int, message: str) -> MXNetError:
    """The exception for a call of this rank that failed with the core's
    status ``(code, message)``."""
    return _ERROR_CLASSES[code](message)


def peers_gone(code: int) -> bool:
    """Whether a runtime that stopped with status ``code`` stopped because the
    peers it waited for stopped taking part (see _PEERS_GONE)."""
    return code in _PEERS_GONE


def recoverable(code: int) -> bool:
    """Whether hvd.elastic.run resets and goes on after a runtime stopped with
    status ``code`` (see _RECOVERABLE)."""
    return code in _RECOVERABLE


def protocol_error() -> Optional[PeerProtocolError]:
    """The PeerProtocolError that stopped hvdmx on this rank, if one did: what
    a call that fails after the stop raises, whatever MXNet raised for it."""
    code, message = stop_status()
    return PeerProtocolError(message) if code == _core.STATUS_PEER_PROTOCOL else None


def stop_status() -> tuple:
    """(code, message): why hvdmx stopped on its own or by another rank's
    shutdown; (STATUS_OK, "") while it runs, and after this rank's shutdown."""
    return _core.stop_status()


def not_running() -> MXNetError:
    """The error for a call made while hvdmx is not running: why it stopped,
    when it stopped on its own or by another rank's shutdown; the
    PeerProtocolError itself when a peer broke the protocol."""
    broke = protocol_error()
    if broke is not None:
        return broke
    return NotRunningError(stop_status()[1] or "hvdmx has not been initialized, or has been "
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
