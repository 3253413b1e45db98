"""hvdmx's exception classes: each is both the Python exception that hvdmx has
always raised and ``mxnet.base.MXNetError``.

Horovod reports most bad arguments from its core, where MXNet turns them into
``MXNetError`` (a ``RuntimeError``); hvdmx checks them in Python first, at the
call, and raised ``ValueError``/``TypeError``. Code written for Horovod catches
``(MXNetError, RuntimeError)`` or ``(MXNetError, ValueError)`` around its
collectives, so these classes derive from both sides, and either way of
catching works with the message unchanged. Plain ``TypeError`` is kept for
Python type mistakes that Horovod does not report from its core either
(an ``int`` for ``name``, a list where an NDArray is required).
docs/errors.md lists which call raises which.

The elastic API's exceptions (``hvd.elastic``, docs/elastic.md) carry
Horovod's names, as ``horovod.common.exceptions`` has them, and are plain
``RuntimeError`` subclasses as there: ``HorovodInternalError`` (the job lost
a peer; hvd.elastic.run restores the last commit and resets) and
``HostsUpdatedInterrupt`` (the job's hosts changed; hvd.elastic.run resets
without restoring).
"""
from mxnet.base import MXNetError

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "InvalidArgumentError",
           "InvalidTypeError", "MismatchError", "NotRunningError", "PeerProtocolError",
           "ResetLimitError"]


class InvalidArgumentError(MXNetError, ValueError):
    """A bad argument value of a collective, or of the training helpers that
    pass it on (splits that do not add up, a first dimension that does not
    divide, a root out of range, a process set this rank is not in)."""


class InvalidTypeError(MXNetError, TypeError):
    """An array of a dtype hvdmx does not take (an unsupported tensor dtype,
    a float ``splits`` array)."""


class MismatchError(MXNetError, ValueError):
    """The ranks' calls do not match, found while the call runs (allgather's
    and alltoall's sizes round, DistributedTrainer's first check of the
    parameters): raised on every rank of the call, with the same message."""


class NotRunningError(MXNetError, ValueError):
    """A collective called while hvdmx is not running: before ``hvd.init()``,
    after ``hvd.shutdown()``, or after another rank's shutdown stopped it."""


class PeerProtocolError(MXNetError):
    """A rank sent this one what hvdmx's protocol does not allow (a message
    that does not parse, a count or rank out of range: another version of
    hvdmx, a corrupted buffer, a bug), or a rank reports that one did to it;
    the message names the rank that sent it, what was wrong, and which rank
    reports it. hvdmx has stopped on this rank, and the job fails on every
    rank (``hvd.elastic.run`` does not reset after it). An ``MXNetError`` (a
    ``RuntimeError``), as the error of a collective whose peer is lost is, so
    code that catches that catches this too. Raised where hvdmx raises its
    own exceptions (``hvd.init()``, synchronous calls such as ``join`` and
    ``barrier``, calls after the stop, ``hvd.elastic.run``); an operation
    that MXNet's engine runs fails with a plain ``MXNetError`` carrying the
    same text (docs/errors.md says how to tell)."""


class HorovodInternalError(RuntimeError):
    """A collective failed because the job lost a peer (it died, or its host
    cannot be reached). Under ``hvd.elastic.run`` it is recoverable: the
    state goes back to its last commit, hvdmx is reset over the job's new
    membership, and the training function runs again. Horovod's name
    (``horovod.common.exceptions``)."""


class HostsUpdatedInterrupt(RuntimeError):
    """The job's hosts changed (workers wait to join, or some were removed),
    raised by ``State.commit()``/``check_host_updates()`` on every rank in
    the same step. Under ``hvd.elastic.run`` it resets hvdmx without
    restoring the state (nothing was lost), and ``skip_sync`` says whether
    the state need not be broadcast afterwards (True when hosts were only
    removed: every survivor already holds the same state). Horovod's name
    and argument (``horovod.common.exceptions``)."""

    def __init__(self, skip_sync: bool) -> None:
        super().__init__(f"the job's hosts changed (skip_sync={bool(skip_sync)})")
        self.skip_sync = bool(skip_sync)


class ResetLimitError(RuntimeError):
    """``hvd.elastic.run`` needed a reset beyond the job's reset limit
    (hvdmxrun --reset-limit, HVDMX_ELASTIC_RESET_LIMIT); the job ends with
    it. The failure that asked for the reset is its ``__cause__``."""
