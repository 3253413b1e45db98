"""Collectives on NDArrays, pushed into MXNet's engine as async ops.

Every call checks what it can see locally, then returns at once: the
collective runs when the engine has the inputs ready, and reading the
result (``asnumpy()``, ``wait_to_read()``, a later op) waits for it. A
mismatch between ranks raises ``MXNetError`` at that read, on every rank.
"""
from __future__ import annotations

import itertools
import numbers
import warnings
from typing import List, Sequence

import mxnet as mx
import numpy as np

from hvdmx import _core
from hvdmx.basics import _topology

# Reduction ops; the values are Horovod's.
Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
             Product: "Product"}

# MXNet dtype codes the core reduces (see csrc/hvdmx/common.h).
_SUPPORTED_DTYPES = {
    np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.float16): 2,
    np.dtype(np.uint8): 3, np.dtype(np.int32): 4, np.dtype(np.int8): 5,
    np.dtype(np.int64): 6,
}
_SUPPORTED_NAMES = "float16, float32, float64, uint8, int8, int32, int64"

_counters = {}


def _auto_name(kind: str) -> str:
    counter = _counters.setdefault(kind, itertools.count())
    return f"{kind}.noname.{next(counter)}"


def _check_tensor(fn: str, arg: str, tensor):
    """Validates one NDArray argument; returns (dtype code, context)."""
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"hvdmx.{fn}: argument '{arg}' must be an mxnet.nd.NDArray, got "
                        f"{type(tensor).__name__}; convert it with mx.nd.array(...)")
    if isinstance(tensor, mx.nd.sparse.BaseSparseNDArray):
        raise ValueError(f"hvdmx.{fn}: argument '{arg}' is a sparse NDArray (stype="
                         f"'{tensor.stype}'); hvdmx reduces dense arrays: pass "
                         f"{arg}.tostype('default')")
    dtype = np.dtype(tensor.dtype)
    code = _SUPPORTED_DTYPES.get(dtype)
    if code is None:
        raise TypeError(f"hvdmx.{fn}: argument '{arg}' has dtype {dtype}, which hvdmx does "
                        f"not support; use one of {_SUPPORTED_NAMES} (e.g. {arg}.astype("
                        f"'float32'))")
    ctx = tensor.context
    if ctx.device_typeid == 2 and not _core.cuda_built():
        raise ValueError(f"hvdmx.{fn}: argument '{arg}' is on {ctx}, but this "
                         "hvdmx was built without CUDA (GPU support is not there yet); "
                         "move it to mx.cpu()")
    return code, ctx


def _empty_like(tensor):
    """An uninitialized array like ``tensor``, of the same class (mx.nd or mx.np)."""
    out = mx.nd.empty(tensor.shape, ctx=tensor.context, dtype=tensor.dtype)
    return out.as_np_ndarray() if isinstance(tensor, mx.np.ndarray) else out


def _check_common(fn: str, name, priority) -> None:
    if not _core.is_initialized():
        raise ValueError("hvdmx has not been initialized, or has been shut down; call "
                         "hvd.init() first")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"hvdmx.{fn}: argument 'name' must be a str or None, got "
                        f"{type(name).__name__}")
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise TypeError(f"hvdmx.{fn}: argument 'priority' must be an int, got {priority!r}")


def _resolve_op(fn: str, average, op) -> int:
    if average is not None:
        if op is not None:
            raise ValueError(f"hvdmx.{fn}: arguments 'average' and 'op' were both given "
                             f"(average={average!r}, op={op!r}); pass only op=hvd.Average or "
                             "op=hvd.Sum ('average' is deprecated)")
        warnings.warn("hvdmx: argument 'average' is deprecated; use op=hvd.Average or "
                      "op=hvd.Sum", DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    if op is None:
        return Average
    if isinstance(op, bool) or op not in _OP_NAMES:
        raise ValueError(f"hvdmx.{fn}: argument 'op'={op!r} is not a reduction op; use "
                         "hvd.Sum, hvd.Average, hvd.Min, hvd.Max or hvd.Product")
    if op == Adasum:
        raise ValueError(f"hvdmx.{fn}: op=hvd.Adasum is not implemented yet; use hvd.Sum "
                         "or hvd.Average")
    return op


def _check_scale(fn: str, arg: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"hvdmx.{fn}: argument '{arg}' must be a real number, got {value!r}")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"hvdmx.{fn}: argument '{arg}'={value!r} must be finite")
    return value


def _check_root(fn: str, root_rank) -> int:
    if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral):
        raise TypeError(f"hvdmx.{fn}: argument 'root_rank' must be an int, got {root_rank!r}")
    n = _topology()[1]
    if not 0 <= root_rank < n:
        raise ValueError(f"hvdmx.{fn}: argument 'root_rank'={root_rank} is out of range; "
                         f"it must be in [0, {n}) for a job of size {n}")
    return int(root_rank)


def _one_context(fn: str, contexts):
    ctx = contexts[0] if contexts else mx.cpu()
    for other in contexts[1:]:
        if other != ctx:
            raise ValueError(f"hvdmx.{fn}: all tensors must be on one device; got {ctx} and "
                             f"{other}")
    return ctx


def _check_distinct(fn: str, tensors: Sequence[mx.nd.NDArray]) -> None:
    handles = [t.handle.value for t in tensors]
    if len(set(handles)) != len(handles):
        raise ValueError(f"hvdmx.{fn}: the same NDArray appears twice in 'tensors'; an "
                         "in-place call needs distinct arrays")


def _allreduce(fn, tensors, outputs, average, name, priority, prescale_factor,
               postscale_factor, op, kind):
    _check_common(fn, name, priority)
    checked = [_check_tensor(fn, "tensor" if len(tensors) == 1 else f"tensors[{i}]", t)
               for i, t in enumerate(tensors)]
    op = _resolve_op(fn, average, op)
    prescale = _check_scale(fn, "prescale_factor", prescale_factor)
    postscale = _check_scale(fn, "postscale_factor", postscale_factor)
    ctx = _one_context(fn, [c for _, c in checked])
    if outputs is None:
        outputs = [_empty_like(t) for t in tensors]
    else:
        _check_distinct(fn, outputs)
    _core.allreduce_async(name if name is not None else _auto_name(kind),
                          [t.handle.value for t in tensors], [t.handle.value for t in outputs],
                          [code for code, _ in checked], [list(t.shape) for t in tensors], op,
                          prescale, postscale, int(priority), ctx.device_typeid, ctx.device_id)
    return outputs


def allreduce(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
              postscale_factor=1.0, op=None):
    """Reduces ``tensor`` over all ranks and returns the result as a new NDArray.

    ``op`` is hvd.Average (the default), hvd.Sum, hvd.Min, hvd.Max or
    hvd.Product; ``average`` is the deprecated boolean form. The input is
    multiplied by ``prescale_factor`` before and the result by
    ``postscale_factor`` after the reduction. ``name`` must match across
    ranks (one is generated from a per-op counter when omitted).
    """
    return _allreduce("allreduce", [tensor], None, average, name, priority, prescale_factor,
                      postscale_factor, op, "allreduce")[0]


def allreduce_(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
               postscale_factor=1.0, op=None):
    """In-place ``allreduce``: the result replaces ``tensor``, which is returned."""
    _check_tensor("allreduce_", "tensor", tensor)
    return _allreduce("allreduce_", [tensor], [tensor], average, name, priority,
                      prescale_factor, postscale_factor, op, "allreduce")[0]


def _check_list(fn: str, tensors) -> List[mx.nd.NDArray]:
    if isinstance(tensors, mx.nd.NDArray) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"hvdmx.{fn}: argument 'tensors' must be a list of NDArrays, got "
                        f"{type(tensors).__name__}")
    return list(tensors)


def grouped_allreduce(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                      postscale_factor=1.0, op=None):
    """Allreduces a list of tensors as one unit (negotiated and delivered
    together) and returns the list of results."""
    tensors = _check_list("grouped_allreduce", tensors)
    return _allreduce("grouped_allreduce", tensors, None, average, name, priority,
                      prescale_factor, postscale_factor, op, "grouped_allreduce")


def grouped_allreduce_(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                       postscale_factor=1.0, op=None):
    """In-place ``grouped_allreduce``; returns ``tensors``."""
    tensors = _check_list("grouped_allreduce_", tensors)
    for i, t in enumerate(tensors):
        _check_tensor("grouped_allreduce_", f"tensors[{i}]", t)
    return _allreduce("grouped_allreduce_", tensors, tensors, average, name, priority,
                      prescale_factor, postscale_factor, op, "grouped_allreduce")


def _broadcast(fn, tensor, output, root_rank, name, priority):
    _check_common(fn, name, priority)
    code, ctx = _check_tensor(fn, "tensor", tensor)
    root = _check_root(fn, root_rank)
    if output is None:
        output = _empty_like(tensor)
    _core.broadcast_async(name if name is not None else _auto_name("broadcast"),
                          [tensor.handle.value], [output.handle.value], [code],
                          [list(tensor.shape)], root, int(priority), ctx.device_typeid,
                          ctx.device_id)
    return output


def broadcast(tensor, root_rank, name=None, priority=0):
    """Returns a new NDArray holding ``root_rank``'s ``tensor`` on every rank."""
    return _broadcast("broadcast", tensor, None, root_rank, name, priority)


def broadcast_(tensor, root_rank, name=None, priority=0):
    """In-place ``broadcast``: ``tensor`` takes ``root_rank``'s value; returned."""
    _check_tensor("broadcast_", "tensor", tensor)
    return _broadcast("broadcast_", tensor, tensor, root_rank, name, priority)
