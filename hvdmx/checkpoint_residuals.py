"""Gradient compression residuals in checkpoints (hvdmx/checkpoint.py).

Compression.onebit (in DistributedTrainer and DistributedOptimizer) and
hvd.KVStore's 2bit and 1bit keep, on every rank, what that rank has not yet
sent of past gradients: a residual per parameter, which differs by rank. So
it cannot travel as the rest of a checkpoint does (the root's values to every
rank): save sends each rank's residuals to rank 0, stored as
``residual:<holder>:<key>:<rank>``, and load sends each rank its own, one
broadcast per rank either way (every rank receives each; a checkpoint is
rare). Residuals of a job of another size cannot be given out rank by rank
and are left out, with a warning.
"""
from __future__ import annotations

import copy
import warnings
from typing import Dict, List, Tuple

import mxnet as mx
import numpy as np

from hvdmx.basics import rank, size
from hvdmx.compression import Compression
from hvdmx.kvstore import KVStore
from hvdmx.ops import broadcast_
from hvdmx.optimizer import DistributedOptimizer
from hvdmx.trainer import DistributedTrainer
from hvdmx import trainer_state

__all__ = ["gather_residuals", "residual_holders", "scatter_residuals", "without_residuals"]


def residual_holders(trainer=None, optimizer=None, kvstore=None) -> Dict[str, dict]:
    """The residual dicts (by parameter index) that a Gluon ``trainer``, or
    a Module's ``optimizer`` and ``kvstore``, train with:
    DistributedTrainer's and DistributedOptimizer's Compression.onebit, and
    hvd.KVStore's set_gradient_compression. Checkpoints and hvd.elastic's
    states find them here."""
    holders = {}
    if trainer is not None:
        if isinstance(trainer, DistributedTrainer) and \
                trainer._compression is Compression.onebit:
            holders["trainer"] = trainer._residuals
        optimizer = trainer_state.optimizer(trainer)
        kvstore = trainer_state.kvstore(trainer)
    if isinstance(optimizer, DistributedOptimizer) and optimizer._compression is Compression.onebit:
        holders["optimizer"] = optimizer._residuals
    if isinstance(kvstore, KVStore) and kvstore._gradient_compression is not None:
        holders["kvstore"] = kvstore._residuals
    return holders


def without_residuals(optimizer):
    """The optimizer to pickle: a DistributedOptimizer's residuals are this
    rank's own and are saved apart."""
    if isinstance(optimizer, DistributedOptimizer):
        optimizer = copy.copy(optimizer)
        object.__setattr__(optimizer, "_residuals", {})
    return optimizer


def _flat(values) -> mx.nd.NDArray:
    """The arrays end to end, as one vector: what one broadcast carries."""
    return mx.nd.concat(*[value.reshape((-1,)) for value in values], dim=0)


def _pieces(flat: mx.nd.NDArray, layout):
    """((holder, key, shape), its part of ``flat``) for each entry of the layout."""
    offset = 0
    for entry in layout:
        count = int(np.prod(entry[2]))
        yield entry, flat[offset:offset + count].reshape(entry[2])
        offset += count


def gather_residuals(trainer, keys) -> Tuple[List[tuple], Dict[str, mx.nd.NDArray]]:
    """(layout, arrays): the (holder, key, shape) of each residual the
    trainer keeps, the same on every rank, and on rank 0 every rank's
    residuals as ``residual:<holder>:<key>:<rank>`` (elsewhere empty)."""
    found = sorted((holder, keys[index], value)
                   for holder, residuals in residual_holders(trainer).items()
                   for index, value in residuals.items())
    if not found:
        return [], {}
    layout = [(holder, key, tuple(value.shape)) for holder, key, value in found]
    flat = _flat(value for _, _, value in found)
    arrays: Dict[str, mx.nd.NDArray] = {}
    for r in range(size()):
        if r > 0:
            buffer = flat if r == rank() else mx.nd.empty(flat.shape, dtype="float32")
            received = broadcast_(buffer, r, name=f"save_checkpoint.residuals.{r}")
        else:
            received = flat
        if rank() == 0:
            for (holder, key, _), piece in _pieces(received, layout):
                arrays[f"residual:{holder}:{key}:{r}"] = piece
    return layout, arrays


def scatter_residuals(trainer, keys, saved, arrays, root: int, path: str) -> None:
    """Gives each rank its residuals from the checkpoint (see above)."""
    if not saved:
        return
    if saved["ranks"] != size():
        warnings.warn(f"hvdmx.load_checkpoint: checkpoint '{path}' holds the gradient "
                      f"compression residuals of {saved['ranks']} ranks and this job has "
                      f"{size()}; they were not loaded, so compression starts again from "
                      "zero residuals", stacklevel=3)
        return
    trainer_state.init_kvstore(trainer)  # as Trainer.load_states: the kvstore holds some
    layout = saved["layout"]
    count = sum(int(np.prod(shape)) for _, _, shape in layout)
    for r in range(size()):
        if rank() == root:
            buffer = _flat(arrays[f"residual:{holder}:{key}:{r}"] for holder, key, _ in layout)
        else:
            buffer = mx.nd.empty((count,), dtype="float32")
        received = broadcast_(buffer, root, name=f"load_checkpoint.residuals.{r}")
        if r == rank():
            own = received
    holders, index_of = residual_holders(trainer), {k: i for i, k in enumerate(keys)}
    unused = set()
    for (holder, key, _), piece in _pieces(own, layout):
        if holder in holders:
            holders[holder][index_of[key]] = piece.copy()
        else:
            unused.add(holder)
    own.wait_to_read()
    if unused:
        warnings.warn(f"hvdmx.load_checkpoint: checkpoint '{path}' holds gradient compression "
                      f"residuals of the {', '.join(sorted(unused))} that this trainer does not "
                      "compress with; they were not loaded", stacklevel=3)
