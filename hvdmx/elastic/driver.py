"""The seam between ``hvd.elastic`` (hvdmx/elastic/) and whatever forms the
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
        again: the job has recovered. Rank 0 of an elastic job tells the
        launcher, which logs the time the change took; nothing under mpiexec.

Under mpiexec the membership is MPI's world, which cannot change:
``reset()`` is ``hvd.shutdown(); hvd.init()`` over the same world, and
``hosts_updated()`` answers (False, False) unless a test announced an update
with ``_announce_hosts_update``. In an elastic job started by hvdmxrun
(hvdmx/elastic/worker.py), ``reset()`` leaves the generation's group and
joins the next one at the launcher's elastic rendezvous, and rank 0's
``hosts_updated()`` asks the rendezvous whether workers wait to join.
"""
from __future__ import annotations

import sys
from typing import Optional, Tuple

from mxnet.base import MXNetError

from hvdmx import basics
from hvdmx.elastic import worker as elastic_worker

# skip_sync of a host update announced by _announce_hosts_update; None: none.
_announced: Optional[bool] = None


# How often a reset tries to join and start again when a worker of the new
# generation is lost while it starts (the rendezvous or a peer then fails
# hvd.init); the launcher has meanwhile failed that worker's host.
_RESET_ATTEMPTS = 5


def hosts_updated() -> Tuple[bool, bool]:
    """(updated, skip_sync): see the module doc."""
    if _announced is not None:
        return True, _announced
    if elastic_worker.elastic() and basics.rank() == 0 and elastic_worker.newcomers():
        return True, False  # the newcomers need the state
    return False, False


def _shutdown() -> None:
    try:
        basics.shutdown()
    except MXNetError as error:
        # shutdown() stopped hvdmx and then reported collectives that had
        # failed unread (error.unread): the steps lost with the failure,
        # which the restored state replaces. Any other error is a real one.
        if not hasattr(error, "unread"):
            raise


def reset() -> None:
    """hvdmx down and up again over the job's membership: see the module doc."""
    global _announced
    _shutdown()
    _announced = None
    if not elastic_worker.elastic():
        basics.init()
        return
    for attempt in range(1, _RESET_ATTEMPTS + 1):
        basics._leave_group()
        try:
            basics.init()
            return
        except (RuntimeError, ConnectionError, OSError) as error:
            # A member of the new generation was lost while it started:
            # join the next one (the launcher has failed its host).
            if attempt == _RESET_ATTEMPTS:
                raise
            print(f"hvdmx.elastic: the job's new membership failed while it started "
                  f"({type(error).__name__}: {error}); joining the next one", file=sys.stderr,
                  flush=True)
            _shutdown()


def resumed() -> None:
    """See the module doc."""
    if elastic_worker.elastic() and basics.rank() == 0:
        elastic_worker.report_resumed()


def _announce_hosts_update(skip_sync: bool) -> None:
    """Test hook: from now until the next reset(), this rank's
    hosts_updated() reports an update with ``skip_sync``."""
    global _announced
    _announced = bool(skip_sync)


__all__ = ["hosts_updated", "reset", "resumed"]
