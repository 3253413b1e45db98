"""hvd.elastic.run: the decorator that restores, resets and calls the
training function again when the job loses a peer or its hosts change."""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional, Tuple, TypeVar

import mxnet as mx
from mxnet.base import MXNetError

from hvdmx import _job, process_sets as _process_sets
from hvdmx.elastic import driver as _elastic_driver
from hvdmx.rendezvous.elastic_wire import RESET_LIMIT_VARIABLE
from hvdmx.errors import (HorovodInternalError, HostsUpdatedInterrupt, PeerProtocolError,
                          ResetLimitError)
from hvdmx.ops import Max, allreduce
from hvdmx.elastic.state import _NAME, State, _forget_host_votes

# The resets one run() may do (hvdmxrun --reset-limit sets it for the
# workers; Horovod's horovodrun --reset-limit); unset: no limit. The
# HOROVOD_ twin is read when the hvdmx name is not set (docs/env.md).
_RESET_LIMIT_TWIN = "HOROVOD_ELASTIC_RESET_LIMIT"



def reset_limit(environ=os.environ) -> Optional[int]:
    """The job's reset limit: HVDMX_ELASTIC_RESET_LIMIT (or
    HOROVOD_ELASTIC_RESET_LIMIT), an int >= 0; None when neither is set."""
    for variable in (RESET_LIMIT_VARIABLE, _RESET_LIMIT_TWIN):
        text = environ.get(variable, "").strip()
        if not text:
            continue
        if not text.isdigit():
            raise ValueError(f"hvdmx.elastic: {variable}={environ[variable]!r} must be an "
                             "int >= 0 (the resets a job may do; hvdmxrun --reset-limit sets "
                             "it), or unset for no limit")
        return int(text)
    return None



def _lost_peers(error: BaseException) -> bool:
    """Whether ``error`` means the job lost a peer: HorovodInternalError, or
    an MXNetError or RuntimeError (a collective's, raised at its read or its
    call) while hvdmx has stopped because the peers it waited for are gone
    (decided by the core's status code, never by the message)."""
    if isinstance(error, HorovodInternalError):
        return True
    # MXNetError at a read, or RuntimeError from a call submitted just as the
    # runtime stopped ("not initialized, or shut down"): the code decides.
    return isinstance(error, (MXNetError, RuntimeError)) and \
        _job.recoverable(_job.stop_status()[0])


def _drain_engine() -> None:
    """Waits for MXNet's engine and takes out the errors of the operations
    that failed with the lost step (each waitall raises one and clears all),
    so that the restore's copies and later reads do not raise them."""
    while True:
        try:
            mx.nd.waitall()
            return
        except MXNetError:
            continue


def _agreed_start(resets: int, skip_sync: bool) -> Tuple[int, bool]:
    """(the most resets any rank has seen, whether any rank needs the sync):
    a worker that joins later has seen fewer resets, and every rank then
    counts alike against the limit; and the ranks sync together or not at
    all. A rank that lost its peers in a collective restores and needs the
    sync, while one that read the same commit's host votes before the loss
    reached it was interrupted with skip_sync: without the agreement the
    one would wait in the sync's broadcasts while the other trained on
    (issue 60)."""
    mine = mx.nd.array([resets, int(not skip_sync)], dtype="int64")
    agreed = allreduce(mine, op=Max, name=_NAME + "resets").asnumpy()
    return int(agreed[0]), bool(agreed[1])


F = TypeVar("F", bound=Callable[..., Any])


def run(func: F) -> F:
    """Decorator: ``func(state, ...)`` runs under elastic training.

    The wrapper syncs ``state`` (every rank takes rank 0's) and calls
    ``func``. When a collective fails because the job lost a peer
    (HorovodInternalError, or an MXNetError while hvdmx has stopped with its
    peers gone) it restores the last commit, resets hvdmx over the job's new
    membership, calls ``state.on_reset()`` and starts again (sync, call).
    On HostsUpdatedInterrupt it resets without restoring, and skips the
    sync when the interrupt says so on every rank (the ranks agree on it
    with the count of resets). Any other exception propagates: it is
    the user's error and is not retried. Past the job's reset limit
    (HVDMX_ELASTIC_RESET_LIMIT, from hvdmxrun --reset-limit) it raises
    ResetLimitError from the failure. Do not make collectives before the
    call that other ranks would not make: a worker that joins later starts
    its script from the top.
    """
    if not callable(func):
        raise TypeError(f"hvdmx.elastic.run: argument 'func'={func!r:.80} must be a function "
                        "whose first argument is an hvd.elastic.State")

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if not isinstance(state, State):
            raise TypeError(f"hvdmx.elastic.run: the first argument of "
                            f"{getattr(func, '__name__', func)!r} must be an hvd.elastic.State "
                            f"(ObjectState, GluonState or a subclass), got "
                            f"{type(state).__name__} ({state!r:.80})")
        limit = reset_limit()
        resets, skip_sync = 0, False
        while True:
            try:
                resets, needs_sync = _agreed_start(resets, skip_sync)
                if needs_sync:
                    state.sync()
                if resets:
                    _elastic_driver.resumed()
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as interrupt:
                skip_sync, cause = interrupt.skip_sync, interrupt
            except Exception as error:  # noqa: BLE001 - re-raised unless a lost peer
                if not _lost_peers(error):
                    # A peer broke the protocol: the job fails naming it,
                    # as PeerProtocolError whatever MXNet raised.
                    broke = _job.protocol_error()
                    if broke is not None and not isinstance(error, PeerProtocolError):
                        raise broke from error
                    raise
                _drain_engine()
                state.restore()
                skip_sync, cause = False, error
            if limit is not None and resets >= limit:
                raise ResetLimitError(
                    f"hvdmx.elastic.run: the job was to reset after {type(cause).__name__}: "
                    f"{cause}; it has reset {resets} time(s), its limit (hvdmxrun "
                    f"--reset-limit, {RESET_LIMIT_VARIABLE}={limit}), so it ends here "
                    "(as Horovod's: the number of resets during the elastic job exceeded "
                    "the limit)") from cause
            resets += 1
            _forget_host_votes()
            _elastic_driver.reset()
            _process_sets._restart_names()
            state.on_reset()

    return wrapper  # type: ignore[return-value]
