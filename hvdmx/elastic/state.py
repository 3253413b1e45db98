"""hvd.elastic's State and ObjectState: what training needs to go on after
a reset, committed, restored and synced (the package's docstring,
hvdmx/elastic/__init__.py, tells the model); and what GluonState and
ModuleState share, the arrays of training in snapshots."""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import mxnet as mx
import numpy as np

from hvdmx.basics import rank
from hvdmx.elastic import driver as _elastic_driver
from hvdmx.elastic.arrays import _arrays, _build, _count_arrays, _cpu_array, _from_numpy, \
    _inner, _layout, _optimizer_fields, _portable_fields, _Snapshot, _take_fields
from hvdmx.errors import HostsUpdatedInterrupt
from hvdmx.objects import broadcast_object
from hvdmx.ops import Max, allreduce, broadcast_
from hvdmx.trainer import DistributedTrainer
from hvdmx import trainer_state

# The names of the collectives hvd.elastic makes itself: the same on every
# rank, whatever unnamed calls a rank made before.
_NAME = "hvdmx.elastic."



def _check_callables(fn: str, argument: str, values: Iterable) -> List[Callable]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"hvdmx.elastic.{fn}: argument '{argument}' must be a list of "
                        f"functions, got {type(values).__name__} ({values!r:.80}); wrap a "
                        "single function in a list")
    values = list(values)
    for i, value in enumerate(values):
        if not callable(value):
            raise TypeError(f"hvdmx.elastic.{fn}: {argument}[{i}]={value!r:.80} is not "
                            f"callable ({type(value).__name__}); pass functions that take no "
                            "arguments")
    return values


class State:
    """What training needs to go on after a reset, kept by ``commit()`` and
    put back by ``restore()``; subclasses define ``save``, ``restore`` and
    ``sync`` (ObjectState and GluonState do).

    ``bcast_object(obj)`` returns rank 0's ``obj`` on every rank (default
    ``hvd.broadcast_object``) and ``get_rank()`` this rank (default
    ``hvd.rank``): Horovod's arguments, for states that sync through them.
    """

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None) -> None:
        for argument, value in (("bcast_object", bcast_object), ("get_rank", get_rank)):
            if value is not None and not callable(value):
                raise TypeError(f"hvdmx.elastic.{type(self).__name__}: argument "
                                f"'{argument}'={value!r:.80} must be a function or None (the "
                                f"default, hvdmx's)")
        self._bcast_object = bcast_object
        self._rank = get_rank if get_rank is not None else rank
        self._reset_callbacks: List[Callable[[], Any]] = []

    def _broadcast(self, obj: Any, name: str) -> Any:
        """Rank 0's ``obj`` on every rank, named alike on every rank."""
        if self._bcast_object is not None:
            return self._bcast_object(obj)
        return broadcast_object(obj, root_rank=0, name=_NAME + name)

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Adds functions (no arguments) that ``on_reset`` calls after every
        reset, in order: e.g. to scale the learning rate to the new size."""
        self._reset_callbacks.extend(_check_callables("register_reset_callbacks", "callbacks",
                                                      callbacks))

    def on_reset(self) -> None:
        """After a reset: ``reset()``, then the registered callbacks."""
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """``save()``, then the check for host updates: a copy of the state
        in this process's memory, then HostsUpdatedInterrupt on every rank
        if the job's hosts changed. Every rank must call it together.

        So that a commit never waits for the other ranks, the check is
        pipelined: each commit sends this rank's answer (one small
        allreduce, not waited for) and reads the combined answers sent at
        the previous commit, which have long arrived. Every rank reads the
        same answers at the same commit, so all raise together, one commit
        after the change was seen. A failure loses the steps since the last
        commit; docs/elastic.md has what a commit costs."""
        global _host_votes
        self.save()
        previous, _host_votes = _host_votes, None
        if previous is not None:
            _raise_if_updated(previous)
        _host_votes = _send_host_votes("commit")

    def check_host_updates(self) -> None:
        """Raises HostsUpdatedInterrupt on every rank, in this call, when the
        driver reports on any rank that the job's hosts changed;
        ``skip_sync`` is True when no rank asks for a sync (workers were
        only removed). Collective, and waits for every rank: one allreduce
        of two ints."""
        _raise_if_updated(_send_host_votes("check"))

    def save(self) -> None:
        """Saves the state in this process's memory."""
        raise NotImplementedError(f"{type(self).__name__}.save: a State subclass defines save, "
                                  "restore and sync")

    def restore(self) -> None:
        """Puts back the state of the last ``save()``/``commit()``."""
        raise NotImplementedError(f"{type(self).__name__}.restore: a State subclass defines "
                                  "save, restore and sync")

    def sync(self) -> None:
        """Gives every rank rank 0's state. Collective."""
        raise NotImplementedError(f"{type(self).__name__}.sync: a State subclass defines save, "
                                  "restore and sync")

    def reset(self) -> None:
        """What the state itself does after a reset, before the callbacks."""


# The host votes the last commit sent (of any State: the check is the job's),
# read by the next commit; None after a reset (they were the old job's).
_host_votes: Optional[mx.nd.NDArray] = None


def _forget_host_votes() -> None:
    """At a reset: the last commit's votes belonged to the old job, and are
    not read. A rank whose commit had sent votes that the others never
    joined (it committed once more before the failure reached it) would
    otherwise read their failure at its first commit in the new job, alone,
    and end or reset while the others trained on (issue 60)."""
    global _host_votes
    _host_votes = None


def _send_host_votes(kind: str) -> mx.nd.NDArray:
    """This rank's answer to whether the hosts changed, combined over the
    ranks by an allreduce (Max) that is returned, not waited for: [updated
    on some rank, some updated rank asks for a sync]."""
    updated, skip_sync = _elastic_driver.hosts_updated()
    votes = mx.nd.array([int(bool(updated)), int(bool(updated) and not skip_sync)],
                        dtype="int32")
    return allreduce(votes, op=Max, name=f"{_NAME}host_updates.{kind}")


def _raise_if_updated(votes: mx.nd.NDArray) -> None:
    any_updated, any_needs_sync = votes.asnumpy()
    if any_updated:
        raise HostsUpdatedInterrupt(skip_sync=not any_needs_sync)


def _check_attribute_names(cls: type, names: Iterable[str]) -> None:
    for name in names:
        if name.startswith("_"):
            raise ValueError(f"hvdmx.elastic.{cls.__name__}: attribute {name!r} starts with "
                             "'_', which the state keeps for itself; rename it")
        if hasattr(cls, name):
            raise ValueError(f"hvdmx.elastic.{cls.__name__}: attribute {name!r} would hide "
                             f"{cls.__name__}.{name}; rename it")


class ObjectState(State):
    """Python values kept as attributes: ``ObjectState(epoch=0, batch=0)``
    gives ``state.epoch`` and ``state.batch``. ``save`` keeps a deep copy of
    each, ``restore`` sets each back to (a deep copy of) it, ``sync`` gives
    every rank rank 0's values (pickled, by ``bcast_object``) and saves
    them. The values are saved once at construction."""

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any) -> None:
        _check_attribute_names(type(self), kwargs)
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)
        self._names = list(kwargs)
        self._saved_state: Dict[str, Any] = {}
        for name, value in kwargs.items():
            setattr(self, name, value)
        self.save()

    def _values(self) -> Dict[str, Any]:
        return {name: getattr(self, name) for name in self._names}

    def _set(self, values: Dict[str, Any]) -> None:
        for name, value in values.items():
            setattr(self, name, value)

    def save(self) -> None:
        self._saved_state = copy.deepcopy(self._values())

    def restore(self) -> None:
        self._set(copy.deepcopy(self._saved_state))

    def sync(self) -> None:
        if self._names:
            self._set(self._broadcast(self._values(), "ObjectState"))
        self.save()


class _TrainingState(ObjectState):
    """What GluonState and ModuleState share: the arrays of training (the
    parameters, the optimizer's states, Compression.onebit's residuals and
    DistributedTrainer's EASGD center) saved into two _Snapshots, put back
    and synced; the optimizer's fields and counters beside them. A subclass
    says where its arrays and its optimizer are (the methods that raise
    NotImplementedError here)."""

    def __init__(self, **kwargs: Any) -> None:
        # Two snapshots, the last commit's and the one the next save fills.
        self._snapshots = (_Snapshot(), _Snapshot())
        self._current = 1  # the last commit's; the first save fills the other
        self._saved_optimizer: Optional[Dict[str, Any]] = None
        self._saved_local_steps: Optional[int] = None
        super().__init__(**kwargs)

    # -- where the arrays are (the subclass's)

    def _param_copies(self) -> List[Optional[List[mx.nd.NDArray]]]:
        """Each parameter's arrays, one per context (None: not allocated yet)."""
        raise NotImplementedError

    def _optimizer_and_updaters(self) -> Tuple[Any, List[Any], List[mx.Context]]:
        """(the optimizer, its updaters, one per context, the contexts), or
        (None, [], []) without one; raises when the states are out of reach."""
        raise NotImplementedError

    def _residual_holders(self) -> Dict[str, dict]:
        """Compression.onebit's residual dicts, by holder."""
        raise NotImplementedError

    def _sync_params(self) -> None:
        """Rank 0's parameters into every rank's. Collective."""
        raise NotImplementedError

    def _params_changed(self) -> None:
        """Called after the parameters' arrays were written."""

    def _easgd(self) -> Optional[DistributedTrainer]:
        """The DistributedTrainer whose EASGD center and local steps the
        state keeps, or None."""
        return None

    # -- save and restore: this process's copies

    def save(self) -> None:
        copies = self._param_copies()
        present = [i for i, c in enumerate(copies) if c is not None]
        arrays = [copies[i][0] for i in present]  # type: ignore[index]
        optimizer, updaters, _ = self._optimizer_and_updaters()
        counts: List[List[tuple]] = []
        for updater in updaters:
            mine = []
            for index, state in trainer_state.states(updater).items():
                parts = _arrays(state)
                arrays.extend(parts)
                mine.append((index, len(parts)))
            counts.append(mine)
        # Each rank's own residuals, and the EASGD center (the same on every rank).
        holders = self._residual_holders()
        residuals = [(holder, index) for holder in sorted(holders) for index in holders[holder]]
        arrays.extend(holders[holder][index] for holder, index in residuals)
        trainer = self._easgd()
        center = trainer._center if trainer is not None else None
        arrays.extend(center or [])
        # Into the other snapshot: if the copy raises (the step before it
        # failed, its arrays hold the error), the last commit stays whole.
        target = self._snapshots[1 - self._current]
        planned = target.sources
        target.take(arrays)
        if target.sources is not planned or counts != target.counts:
            # New arrays or states: their layouts (the same arrays keep theirs).
            target.layouts = [[(index, _layout(trainer_state.states(updater)[index]))
                               for index, _ in mine]
                              for updater, mine in zip(updaters, counts)]
        target.present, target.counts = present, counts
        target.residuals, target.center = residuals, None if center is None else len(center)
        self._current = 1 - self._current
        if optimizer is not None:
            self._saved_optimizer = _optimizer_fields(optimizer)
        self._saved_local_steps = trainer._local_steps_done if trainer is not None else None
        super().save()

    def restore(self) -> None:
        snapshot = self._snapshots[self._current]
        copies = iter(range(len(snapshot.sources)))
        params = self._param_copies()
        for i in snapshot.present:
            value = snapshot.copy_of(next(copies))
            for data in params[i] or []:
                data[:] = value
        if snapshot.present:
            self._params_changed()
        optimizer, updaters, _ = self._optimizer_and_updaters()
        if optimizer is not None and self._saved_optimizer is not None:
            vars(_inner(optimizer)).update(copy.deepcopy(self._saved_optimizer))
            for updater, layouts in zip(updaters, snapshot.layouts):
                saved: Dict[Any, Tuple[tuple, List[np.ndarray]]] = {}
                for index, layout in layouts:
                    saved[index] = (layout, [snapshot.copy_of(next(copies))
                                             for _ in range(_count_arrays(layout))])
                self._put_states(updater, saved)
        self._put_residuals([(holder, index, snapshot.copy_of(next(copies)))
                             for holder, index in snapshot.residuals])
        trainer = self._easgd()
        if trainer is not None:
            center = None if snapshot.center is None else \
                [snapshot.copy_of(next(copies)) for _ in range(snapshot.center)]
            self._put_center(trainer, center)
            if self._saved_local_steps is not None:
                trainer._local_steps_done = self._saved_local_steps
        super().restore()

    @staticmethod
    def _put_states(updater, saved: Dict[Any, Tuple[tuple, List[np.ndarray]]]) -> None:
        """The updater's states become copies of ``saved`` ({index: (layout,
        arrays)}): in place where the layouts agree, new arrays (moved to the
        weight's context at the next update) elsewhere; states created since
        are dropped (the next update creates them anew, as it did after the
        commit)."""
        trainer_state.drop_states(updater, saved)
        for index, (layout, arrays) in saved.items():
            current = trainer_state.states(updater).get(index)
            if current is not None and _layout(current) == layout:
                for source, target in zip(arrays, _arrays(current)):
                    target[:] = source
            else:
                trainer_state.put_state(updater, index, _build(layout, _from_numpy(arrays)))

    def _put_residuals(self, saved: List[Tuple[str, Any, np.ndarray]]) -> None:
        """The residuals become copies of ``saved`` ((holder, index, value)):
        in place where they exist, new where not; residuals made since the
        commit are dropped (the next exchange starts them at zero, as they
        were then)."""
        by_holder: Dict[str, Dict[Any, np.ndarray]] = {}
        for holder, index, value in saved:
            by_holder.setdefault(holder, {})[index] = value
        for holder, residuals in self._residual_holders().items():
            mine = by_holder.get(holder, {})
            for index in [i for i in residuals if i not in mine]:
                del residuals[index]
            for index, value in mine.items():
                current = residuals.get(index)
                if current is not None and tuple(current.shape) == value.shape:
                    current[:] = value
                else:
                    residuals[index] = mx.nd.array(value, dtype=value.dtype)

    def _put_center(self, trainer: DistributedTrainer,
                    saved: Optional[List[np.ndarray]]) -> None:
        if saved is None:
            trainer._center = None
            return
        center = trainer._center
        if center is not None and [tuple(c.shape) for c in center] == [v.shape for v in saved]:
            for target, value in zip(center, saved):
                target[:] = value
        else:
            trainer._center = [mx.nd.array(value, ctx=p.list_data()[0].context, dtype=value.dtype)
                               for value, p in zip(saved, trainer_state.parameters(trainer))]

    # -- sync: rank 0's state on every rank

    def sync(self) -> None:
        self._sync_params()
        root = self._rank() == 0
        optimizer, updaters, contexts = self._optimizer_and_updaters()
        trainer = self._easgd()
        mine: Dict[str, Any] = {"values": self._values()}
        if optimizer is not None:
            held = trainer_state.states(updaters[0])
            mine["optimizer"] = _portable_fields(optimizer, contexts) if root else None
            mine["states"] = sorted((index, _layout(state)) for index, state in held.items())
        if trainer is not None:
            mine["local_steps"] = trainer._local_steps_done
            mine["center"] = trainer._center is not None
        theirs = broadcast_object(mine, root_rank=0, name=_NAME + type(self).__name__)
        if optimizer is not None:
            self._sync_states(updaters, theirs["states"])
            if not root:
                _take_fields(optimizer, contexts, theirs["optimizer"])
        if trainer is not None:
            trainer._local_steps_done = theirs["local_steps"]
            self._sync_center(trainer, theirs["center"])
        # Each rank keeps its own residuals (docs/elastic.md, "What a reset
        # keeps"): they are not synced.
        self._set(theirs["values"])
        self.save()

    @staticmethod
    def _sync_states(updaters, layouts) -> None:
        """Rank 0's optimizer states (``layouts``: its (index, layout) list)
        into every updater: broadcast into this rank's arrays where they fit
        rank 0's, into new ones elsewhere."""
        first = updaters[0]
        wanted = dict(layouts)
        trainer_state.drop_states(first, wanted)
        for index, layout in layouts:
            current = trainer_state.states(first).get(index)
            if current is None or _layout(current) != layout:
                current = _build(layout, _cpu_array)
                trainer_state.put_state(first, index, current)
            for j, array in enumerate(_arrays(current)):
                broadcast_(array, 0, name=f"{_NAME}state.{index}.{j}")
        for other in updaters[1:]:  # this rank's other contexts
            held = trainer_state.states(first)
            _TrainingState._put_states(other, {index: (_layout(state),
                                                       [a.asnumpy() for a in _arrays(state)])
                                               for index, state in held.items()})

    @staticmethod
    def _sync_center(trainer: DistributedTrainer, present: bool) -> None:
        """Rank 0's EASGD center on every rank (None where rank 0 has none)."""
        if not present:
            trainer._center = None
            return
        if trainer._center is None:  # a worker that just joined
            trainer._center = [mx.nd.empty(p.shape, ctx=p.list_data()[0].context,
                                           dtype=p.dtype)
                               for p in trainer_state.parameters(trainer)]
        for i, center in enumerate(trainer._center):
            broadcast_(center, 0, name=f"{_NAME}center.{i}")
