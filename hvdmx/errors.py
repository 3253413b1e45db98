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
"""
from mxnet.base import MXNetError

__all__ = ["InvalidArgumentError", "InvalidTypeError", "MismatchError", "NotRunningError"]


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
