"""Elastic training with Horovod's names (``hvd.elastic``; docs/elastic.md).

    state = hvd.elastic.GluonState(net.collect_params(), trainer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches):
                ...                                   # a step: trainer.step(...)
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0

    train(state)

The model: a ``State`` holds what training needs to go on (parameters,
optimizer states, counters). ``commit()`` saves a copy in this process's
memory and asks whether the job's hosts changed; ``restore()`` puts the last
commit back; ``sync()`` gives every rank rank 0's state. ``run`` calls the
function and, when a collective fails because the job lost a peer
(``HorovodInternalError``, or an MXNetError while hvdmx has stopped with its
peers gone), restores the last commit, resets hvdmx over the job's new
membership, runs the reset callbacks and calls the function again, after a
sync. When hosts changed (``HostsUpdatedInterrupt`` from ``commit()``) it
resets without restoring. Any other exception is the user's and ends the
job. How hvdmx is reset, and how the hosts' changes are learned, is the
driver's (hvdmx/elastic/driver.py); everything here is the same for any
launch.

The rank's side of elastic training, one module a part:

    state      State, ObjectState: commit, restore, sync, the host votes; the arrays
               a training state keeps (GluonState's and ModuleState's)
    arrays     snapshots of arrays, optimizer states' layouts
    gluon      GluonState
    module     ModuleState
    recovery   run (the decorator), reset_limit
    driver     the seam to the launch: reset, hosts_updated, resumed
    worker     an elastic worker's side of the elastic rendezvous

The launcher's side (membership, service, the loop that starts and watches
the workers) is hvdmx/runner/elastic/. The names below load their modules on
first use (PEP 562), as the package's do: ``import hvdmx.elastic`` loads
neither MXNet nor MPI.
"""
import importlib
from typing import TYPE_CHECKING

# Public name -> the module of this package (or hvdmx.errors) that defines it.
_EXPORTS = {
    "GluonState": "hvdmx.elastic.gluon",
    "HorovodInternalError": "hvdmx.errors",
    "HostsUpdatedInterrupt": "hvdmx.errors",
    "ModuleState": "hvdmx.elastic.module",
    "ObjectState": "hvdmx.elastic.state",
    "ResetLimitError": "hvdmx.errors",
    "State": "hvdmx.elastic.state",
    "reset_limit": "hvdmx.elastic.recovery",
    "run": "hvdmx.elastic.recovery",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from hvdmx.elastic.gluon import GluonState as GluonState
    from hvdmx.elastic.module import ModuleState as ModuleState
    from hvdmx.elastic.recovery import reset_limit as reset_limit, run as run
    from hvdmx.elastic.state import ObjectState as ObjectState, State as State
    from hvdmx.errors import (HorovodInternalError as HorovodInternalError,
        HostsUpdatedInterrupt as HostsUpdatedInterrupt, ResetLimitError as ResetLimitError)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hvdmx.elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
