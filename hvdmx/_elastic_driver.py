"""The seam between ``hvd.elastic`` (hvdmx/elastic.py) and whatever forms the
job's membership. hvd.elastic calls exactly these three functions and nothing
else of the launch:

    hosts_updated() -> (updated, skip_sync)
        Asked on every rank at every ``State.commit()`` (and
        ``check_host_updates()``). ``updated``: the job's hosts changed since
        the last ``reset()`` (workers wait to join, or some were removed);
        ``skip_sync``: the change only removed workers, so the survivors'
        state need not be broadcast after the reset. It may answer from one
        rank only (the others answering (False, False)): hvd.elastic combines
        the answers over all ranks (updated if any rank says so; skip_sync
        only if no updated rank asks for a sync), so every rank raises
        HostsUpdatedInterrupt in the same step. It must keep answering
        ``updated`` for a change until the ``reset()`` that takes it in, and
        must be cheap: it runs at every commit.

    reset()
        Called on every rank, together, after a failure or a host update:
        tears hvdmx down and brings it up again over the job's current
        membership (the rank and size may change). On return, collectives
        run and ``hvd.rank()``/``hvd.size()`` answer for the new job.
        Pending collectives of the old job have failed or completed.

    resumed()
        Called on every rank after the state has been synced (or the sync
        skipped) following a reset, before the training function runs
        again: the job has recovered. For the launcher's log line of the
        time a change took; nothing under mpiexec.

Today (a job under mpiexec) the membership is MPI's world, which cannot
change: ``reset()`` is ``hvd.shutdown(); hvd.init()`` over the same world,
and ``hosts_updated()`` answers (False, False) unless a test announced an
update with ``_announce_hosts_update``. The launch without MPI replaces the
bodies of these functions (rejoining the launcher's rendezvous, asking
it whether workers wait); their contract above stays.
"""
from __future__ import annotations

from typing import Optional, Tuple

from mxnet.base import MXNetError

from hvdmx import basics

# skip_sync of a host update announced by _announce_hosts_update; None: none.
_announced: Optional[bool] = None


def hosts_updated() -> Tuple[bool, bool]:
    """(updated, skip_sync): see the module doc."""
    if _announced is None:
        return False, False
    return True, _announced


def reset() -> None:
    """hvdmx down and up again over the job's membership: see the module doc."""
    global _announced
    try:
        basics.shutdown()
    except MXNetError as error:
        # shutdown() stopped hvdmx and then reported collectives that had
        # failed unread (error.unread): the steps lost with the failure,
        # which the restored state replaces. Any other error is a real one.
        if not hasattr(error, "unread"):
            raise
    _announced = None
    basics.init()


def resumed() -> None:
    """The job has recovered from a reset: see the module doc."""


def _announce_hosts_update(skip_sync: bool) -> None:
    """Test hook: from now until the next reset(), this rank's
    hosts_updated() reports an update with ``skip_sync``."""
    global _announced
    _announced = bool(skip_sync)


__all__ = ["hosts_updated", "reset", "resumed"]
