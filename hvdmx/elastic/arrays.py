"""The arrays of hvd.elastic's training states (hvdmx/elastic/'s
GluonState and ModuleState): the optimizer's fields and how they travel at
a sync, how an optimizer state nests (its layout) and is rebuilt from one,
and _Snapshot, the copies of a list of arrays that a commit keeps."""
from __future__ import annotations

import copy
import ctypes
from typing import Any, Callable, Dict, List, Optional, Tuple

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, check_call

from hvdmx.optimizer import DistributedOptimizer

__all__: List[str] = []


def _inner(optimizer):
    """The optimizer that holds the counts and hyperparameters."""
    return optimizer._optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer


# The optimizer's fields that are not its state: the trainer's parameters
# (and names of them), set by the trainer and the same after a restore.
_NOT_OPTIMIZER_STATE = frozenset({"param_dict", "idx2name", "sym_info"})


def _optimizer_fields(optimizer) -> Dict[str, Any]:
    """The optimizer's state (update counts, learning rate and its
    schedule, hyperparameters), copied; one deepcopy, so that its aliases
    (_index_update_count into _all_index_update_counts) stay aliases."""
    return copy.deepcopy({k: v for k, v in vars(_inner(optimizer)).items()
                          if k not in _NOT_OPTIMIZER_STATE})


def _portable_fields(optimizer, contexts) -> Dict[str, Any]:
    """The optimizer's fields as rank 0 sends them at a sync: its update
    counts by the position of the training's context in ``contexts``, not
    by device id (rank 0 trains on cpu(0), rank 1 on cpu(1), ...)."""
    fields = _optimizer_fields(optimizer)
    counts = fields.pop("_all_index_update_counts", None)
    fields.pop("_index_update_count", None)
    if counts is not None:
        fields["_counts_by_context"] = [counts.get(ctx.device_id, {}) for ctx in contexts]
    return fields


def _take_fields(optimizer, contexts, fields: Dict[str, Any]) -> None:
    """Rank 0's fields (_portable_fields) into this rank's optimizer, the
    counts under this rank's device ids."""
    optimizer = _inner(optimizer)
    fields = dict(fields)
    by_context = fields.pop("_counts_by_context", None)
    vars(optimizer).update(fields)
    if by_context is not None:
        counts = {ctx.device_id: dict(c) for ctx, c in zip(contexts, by_context)}
        first = contexts[0].device_id
        optimizer._all_index_update_counts = counts
        optimizer._index_update_count = counts[first]


def _layout(state):
    """How an optimizer state nests: arrays by (shape, dtype), other values
    as they are. Equal layouts take each other's arrays in place."""
    if isinstance(state, mx.nd.NDArray):
        return ("array", tuple(state.shape), np.dtype(state.dtype).name)
    if isinstance(state, (tuple, list)):
        return (type(state).__name__, tuple(_layout(s) for s in state))
    return ("value", state)


def _arrays(state) -> List[mx.nd.NDArray]:
    if isinstance(state, mx.nd.NDArray):
        return [state]
    if isinstance(state, (tuple, list)):
        return [a for s in state for a in _arrays(s)]
    return []


def _count_arrays(layout) -> int:
    kind = layout[0]
    if kind == "array":
        return 1
    if kind in ("tuple", "list"):
        return sum(_count_arrays(child) for child in layout[1])
    return 0


def _build(layout, make: Callable[[tuple, str], mx.nd.NDArray]):
    kind, body = layout[0], layout[1:]
    if kind == "array":
        return make(*body)
    if kind in ("tuple", "list"):
        items = [_build(child, make) for child in body[0]]
        return tuple(items) if kind == "tuple" else items
    return copy.deepcopy(body[0])


def _cpu_array(shape: tuple, dtype: str) -> mx.nd.NDArray:
    return mx.nd.empty(shape, ctx=mx.cpu(), dtype=dtype)


def _from_numpy(arrays: List[np.ndarray]) -> Callable[[tuple, str], mx.nd.NDArray]:
    """For _build: each call a new CPU NDArray holding the next of ``arrays``."""
    sources = iter(arrays)
    return lambda shape, dtype: mx.nd.array(next(sources), ctx=mx.cpu(), dtype=dtype)


class _Snapshot:
    """Copies of a list of arrays in this process's memory: one NumPy buffer
    per dtype, allocated when the arrays change (not at every save), filled
    by MXNet's synchronous copy to CPU (what ``asnumpy`` does, without its
    allocation), one C call an array. Measured on the digits model
    (benchmarks/elastic_commit.py), a tenth of what one engine copy an array
    cost, and a fifth of one concat into a flat buffer: on a busy CPU each
    engine operation costs a wake-up of its worker. It waits for the arrays'
    pending writes (the step's update), which the step needs done anyway."""

    def __init__(self) -> None:
        self.sources: List[mx.nd.NDArray] = []
        # What the arrays are (_TrainingState's): the parameters' positions, and
        # by updater the states' (index, number of arrays) and (index, layout).
        self.present: List[int] = []
        self.counts: List[List[tuple]] = []
        self.layouts: List[List[tuple]] = []
        # Then the residuals' (holder, index) and the EASGD center's length.
        self.residuals: List[Tuple[str, Any]] = []
        self.center: Optional[int] = None
        self._buffers: List[np.ndarray] = []
        self._copies: List[Tuple[Any, ctypes.c_void_p, ctypes.c_size_t]] = []
        self._views: List[np.ndarray] = []

    def take(self, arrays: List[mx.nd.NDArray]) -> None:
        if len(arrays) != len(self.sources) or \
                any(a is not b for a, b in zip(arrays, self.sources)):
            self._plan(arrays)
        copy_to_cpu = _LIB.MXNDArraySyncCopyToCPU
        for handle, address, size in self._copies:
            check_call(copy_to_cpu(handle, address, size))

    def _plan(self, arrays: List[mx.nd.NDArray]) -> None:
        self.sources = list(arrays)
        shapes = [(tuple(a.shape), np.dtype(a.dtype)) for a in arrays]
        totals: Dict[np.dtype, int] = {}
        for shape, dtype in shapes:
            totals[dtype] = totals.get(dtype, 0) + int(np.prod(shape))
        buffers = {dtype: np.empty(total, dtype=dtype) for dtype, total in totals.items()}
        used = dict.fromkeys(totals, 0)
        self._buffers, self._copies, self._views = list(buffers.values()), [], []
        for a, (shape, dtype) in zip(arrays, shapes):
            size, start = int(np.prod(shape)), used[dtype]
            used[dtype] += size
            view = buffers[dtype][start:start + size].reshape(shape)
            self._views.append(view)
            if size:
                self._copies.append((a.handle, ctypes.c_void_p(view.ctypes.data),
                                     ctypes.c_size_t(size)))

    def copy_of(self, i: int) -> np.ndarray:
        """The saved copy of array ``i`` (a view of the buffer: read only)."""
        return self._views[i]
