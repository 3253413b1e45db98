"""Collectives on NDArrays, pushed into MXNet's engine as async ops:
allreduce and broadcast, barrier and join, and what every collective checks
(allgather, alltoall and reducescatter are in hvdmx/gather_scatter.py).

Every call checks what it can see locally, then returns at once: the
collective runs when the engine has the inputs ready, and reading the
result (``asnumpy()``, ``wait_to_read()``, a later op) waits for it. A
mismatch between ranks raises ``MXNetError`` at that read, on every rank.

Argument errors are ``hvdmx.errors`` classes, which are ``MXNetError`` as
well as ``ValueError``/``TypeError`` (see that module and docs/errors.md).
"""
from __future__ import annotations

import numbers
import warnings
from typing import List, Optional, Sequence

import mxnet as mx
import numpy as np

from hvdmx import _core, _job
from hvdmx.basics import _check_running, _topology
from hvdmx.errors import InvalidArgumentError, InvalidTypeError
from hvdmx.process_sets import ProcessSet, _auto_name, _set_for_call, global_process_set

# Reduction ops, as the core numbers them (csrc/hvdmx/base/common.h, exported
# as _core.REDUCE_OPS); the values are Horovod's.
Average = _core.REDUCE_OPS["Average"]
Sum = _core.REDUCE_OPS["Sum"]
Adasum = _core.REDUCE_OPS["Adasum"]
Min = _core.REDUCE_OPS["Min"]
Max = _core.REDUCE_OPS["Max"]
Product = _core.REDUCE_OPS["Product"]
_OP_NAMES = {code: name for name, code in _core.REDUCE_OPS.items()}

# The dtypes the collectives take (_core.ARRAY_DTYPES), as the errors list
# them: floats, then unsigned, then signed integers, each by size.
_SUPPORTED_NAMES = ", ".join(sorted(_core.ARRAY_DTYPES, key=lambda name: (
    "fui".index(np.dtype(name).kind), np.dtype(name).itemsize)))

def _check_tensor(fn: str, arg: str, tensor):
    """Validates one NDArray argument; returns (dtype code, device, shape),
    device being MXNet's (device type id, device id)."""
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"hvdmx.{fn}: argument '{arg}' must be an mxnet.nd.NDArray, got "
                        f"{type(tensor).__name__}; convert it with mx.nd.array(...)")
    # One C call for what would be four ctypes calls through the properties;
    # the core checks the array too (CheckArray in csrc/hvdmx/python/bindings.cc).
    code, _, dev_type, dev_id, shape, problem = _core.describe(tensor.handle.value)
    if problem != _core.ARRAY_OK:
        raise _array_error(fn, arg, tensor, problem, (dev_type, dev_id))
    return code, (dev_type, dev_id), shape


def _array_error(fn: str, arg: str, tensor, problem: int, device) -> Exception:
    """The error for an NDArray argument that the core's check refused
    (``problem``, one of _core.ARRAY_*); ``device`` is the array's."""
    if problem == _core.ARRAY_SPARSE:
        return InvalidArgumentError(f"hvdmx.{fn}: argument '{arg}' is a sparse NDArray (stype="
                                    f"'{tensor.stype}'); hvdmx reduces dense arrays: pass "
                                    f"{arg}.tostype('default')")
    if problem == _core.ARRAY_DTYPE:
        return InvalidTypeError(f"hvdmx.{fn}: argument '{arg}' has dtype {np.dtype(tensor.dtype)}, "
                                f"which hvdmx does not support; use one of {_SUPPORTED_NAMES} "
                                f"(e.g. {arg}.astype('float32'))")
    if problem == _core.ARRAY_NEEDS_CUDA:
        return InvalidArgumentError(f"hvdmx.{fn}: argument '{arg}' is on {_device_str(device)}, "
                                    "but this hvdmx was built without CUDA (GPU support is not "
                                    "there yet); move it to mx.cpu()")
    assert problem == _core.ARRAY_NO_SHAPE, problem  # the core's last check
    return InvalidArgumentError(f"hvdmx.{fn}: argument '{arg}' has no known shape yet; run the "
                                "op that produces it first")


def _new_array(like, shape, code: int, device):
    """An uninitialized array (allocated when first written) of ``shape``,
    dtype ``code`` and ``device``, of ``like``'s class (mx.nd or mx.np)."""
    handle = mx.base.NDArrayHandle(_core.new_array(shape, code, device[0], device[1]))
    if isinstance(like, mx.np.ndarray):
        return mx.np.ndarray(handle)
    return mx.nd.NDArray(handle)


def _int32_array(values):
    """A new int32 NDArray on the CPU holding ``values``, written at once
    (mx.nd.array waits for an engine op to copy them in)."""
    return mx.nd.NDArray(mx.base.NDArrayHandle(_core.new_int32_array(values)))


def _check_common(fn: str, name, priority) -> None:
    _check_running()
    if name is not None and not isinstance(name, str):
        raise TypeError(f"hvdmx.{fn}: argument 'name' must be a str or None, got "
                        f"{type(name).__name__}")
    if priority.__class__ is int:  # the usual case, without the ABC check below
        return
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
        raise InvalidArgumentError(f"hvdmx.{fn}: argument 'op'={op!r} is not a reduction op; use "
                                   "hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product or "
                                   "hvd.Adasum")
    return op


# Adasum combines floating gradients (csrc/hvdmx/algorithms/adasum.h).
_ADASUM_CODES = frozenset(_core.DTYPE_CODES[name] for name in
                          ("float16", "bfloat16", "float32", "float64")
                          if name in _core.ARRAY_DTYPES)
_CODE_NAMES = {code: name for name, code in _core.DTYPE_CODES.items()}


def _check_adasum(fn: str, codes: Sequence[int], set_id: int, labels: Sequence[str]) -> None:
    """What op=hvd.Adasum refuses at the call (the same on every rank, since
    every rank makes the same call): a process set other than the global one,
    and tensors that are not floating point."""
    if set_id != 0:
        raise InvalidArgumentError(f"hvdmx.{fn}: op=hvd.Adasum combines over all ranks, and "
                                   f"process_set={set_id} is not the global set (as in "
                                   "Horovod); use process_set=hvd.global_process_set, or "
                                   "op=hvd.Average on the set")
    for code, label in zip(codes, labels):
        if code not in _ADASUM_CODES:
            raise InvalidTypeError(f"hvdmx.{fn}: op=hvd.Adasum needs floating tensors, and "
                                   f"argument '{label}' has dtype {_CODE_NAMES[code]}; use "
                                   "float16, float32 or float64 (e.g. "
                                   f"{label}.astype('float32')), or op=hvd.Sum")


def _check_scale(fn: str, arg: str, value) -> float:
    if value.__class__ is float and value == 1.0:  # the default, on every call
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"hvdmx.{fn}: argument '{arg}' must be a real number, got {value!r}")
    value = float(value)
    if not np.isfinite(value):
        raise InvalidArgumentError(f"hvdmx.{fn}: argument '{arg}'={value!r} must be finite")
    return value


def _check_root(fn: str, root_rank, set_ranks: List[int]) -> int:
    """The root's index in the process set; ``root_rank`` is a rank of the job."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, numbers.Integral):
        raise TypeError(f"hvdmx.{fn}: argument 'root_rank' must be an int, got {root_rank!r}")
    n = _topology()[1]
    if not 0 <= int(root_rank) < n:
        raise InvalidArgumentError(f"hvdmx.{fn}: argument 'root_rank'={root_rank} is out of range; "
                                   f"it must be in [0, {n}) for a job of size {n}")
    if root_rank not in set_ranks:
        raise InvalidArgumentError(f"hvdmx.{fn}: argument 'root_rank'={root_rank} is not in the "
                                   f"process set (ranks {set_ranks}); pick a root among them "
                                   "(root_rank is a rank of the whole job)")
    return set_ranks.index(int(root_rank))


def _one_device(fn: str, checked):
    """The one device of the (code, device, shape) triples ``checked``."""
    device = checked[0][1] if checked else (1, 0)
    for _, other, _ in checked[1:]:
        if other != device:
            raise InvalidArgumentError(f"hvdmx.{fn}: all tensors must be on one device; got "
                                       f"{_device_str(device)} and {_device_str(other)}")
    return device


def _device_str(device) -> str:
    return str(mx.Context(mx.Context.devtype2str[device[0]], device[1]))


def _check_distinct(fn: str, tensors: Sequence[mx.nd.NDArray]) -> None:
    if len(tensors) < 2:
        return
    handles = [t.handle.value for t in tensors]
    if len(set(handles)) != len(handles):
        raise InvalidArgumentError(f"hvdmx.{fn}: the same NDArray appears twice in 'tensors'; an "
                                   "in-place call needs distinct arrays")


def _push(set_id, ctype, name, tensors, outputs, checked, device, op=Sum, root=0,
          prescale=1.0, postscale=1.0, splits=(), priority=0):
    """Pushes the collective; ``checked`` holds _check_tensor's triple for
    each tensor, all on ``device``."""
    handles = [t.handle.value for t in tensors]
    try:
        _core.push_async(set_id=set_id, collective=ctype, name=name, inputs=handles,
                         outputs=handles if outputs is tensors else
                         [t.handle.value for t in outputs],
                         dtypes=[c[0] for c in checked], shapes=[c[2] for c in checked], op=op,
                         root=root, prescale=prescale, postscale=postscale,
                         splits=list(splits), priority=int(priority), dev_type=device[0],
                         dev_id=device[1])
    except RuntimeError:
        # hvdmx stopped between the call's check and its push (a peer lost,
        # another rank's shutdown): say why, as the check would have.
        if not _core.is_initialized():
            raise _job.not_running() from None
        raise


def _allreduce(fn, tensors, outputs, average, name, priority, prescale_factor,
               postscale_factor, op, kind, process_set):
    _check_common(fn, name, priority)
    set_id, _, _ = _set_for_call(fn, process_set)
    checked = [_check_tensor(fn, "tensor" if len(tensors) == 1 else f"tensors[{i}]", t)
               for i, t in enumerate(tensors)]
    op = _resolve_op(fn, average, op)
    if op == Adasum:
        _check_adasum(fn, [c[0] for c in checked], set_id,
                      ["tensor"] if len(tensors) == 1 else [f"tensors[{i}]"
                                                            for i in range(len(tensors))])
    prescale = _check_scale(fn, "prescale_factor", prescale_factor)
    postscale = _check_scale(fn, "postscale_factor", postscale_factor)
    device = _one_device(fn, checked)
    if outputs is None:
        outputs = [_new_array(t, shape, code, device)
                   for t, (code, _, shape) in zip(tensors, checked)]
    else:
        _check_distinct(fn, outputs)
    _push(set_id, _core.ALLREDUCE, name if name is not None else _auto_name(kind, set_id),
          tensors, outputs, checked, device, op=op, prescale=prescale, postscale=postscale,
          priority=priority)
    return outputs


def allreduce(tensor: mx.nd.NDArray, average: Optional[bool] = None, name: Optional[str] = None,
              priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set,
              op: Optional[int] = None) -> mx.nd.NDArray:
    """Reduces ``tensor`` over all ranks and returns the result as a new NDArray.

    ``op`` is hvd.Average (the default), hvd.Sum, hvd.Min, hvd.Max,
    hvd.Product or hvd.Adasum (floating tensors, the global process set;
    docs/collectives.md); ``average`` is the deprecated boolean form. The input is
    multiplied by ``prescale_factor`` before and the result by
    ``postscale_factor`` after the reduction. ``name`` must match across
    ranks (one is generated from a per-op counter when omitted).
    """
    return _allreduce("allreduce", [tensor], None, average, name, priority, prescale_factor,
                      postscale_factor, op, "allreduce", process_set)[0]


def allreduce_(tensor: mx.nd.NDArray, average: Optional[bool] = None, name: Optional[str] = None,
               priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set,
               op: Optional[int] = None) -> mx.nd.NDArray:
    """In-place ``allreduce``: the result replaces ``tensor``, which is returned."""
    fn = "allreduce_"
    if not isinstance(tensor, mx.nd.NDArray):  # before the checks that assume one
        _check_tensor(fn, "tensor", tensor)
    if name is None:
        # The generated name must not be used up by a call that fails its
        # checks: the full path takes it only once they have passed.
        tensors = [tensor]  # as inputs and outputs: one list, so _push sees it is in place
        return _allreduce(fn, tensors, tensors, average, name, priority, prescale_factor,
                          postscale_factor, op, "allreduce", process_set)[0]
    # Named (as DistributedTrainer's and the kvstore's are): the core checks
    # and describes the tensor while it pushes, a quarter of the call's cost
    # (docs/benchmark-notes.md, "Small messages: latency through the whole
    # stack").
    _check_common(fn, name, priority)
    set_id, _, _ = _set_for_call(fn, process_set)
    op = _resolve_op(fn, average, op)
    if op == Adasum:
        _check_adasum(fn, [_check_tensor(fn, "tensor", tensor)[0]], set_id, ["tensor"])
    prescale = _check_scale(fn, "prescale_factor", prescale_factor)
    postscale = _check_scale(fn, "postscale_factor", postscale_factor)
    _push_each_in_place(fn, set_id, [tensor], [name], [int(priority)], op, prescale, postscale,
                        "tensor")
    return tensor


def _push_each_in_place(fn, set_id, tensors, names, priorities, op, prescale, postscale, label):
    """Has the core check every NDArray of ``tensors`` (the check behind
    _check_tensor), then push an in-place allreduce of each; if it refuses
    one, nothing is pushed and allreduce_'s own error is raised for it
    (``label.format(i)`` names the argument)."""
    bad, problem = _core.push_allreduce_each(set_id=set_id, names=names,
                                             handles=[t.handle.value for t in tensors],
                                             priorities=priorities, op=op, prescale=prescale,
                                             postscale=postscale)
    if bad >= 0:
        _, _, dev_type, dev_id, _, _ = _core.describe(tensors[bad].handle.value)
        raise _array_error(fn, label.format(bad), tensors[bad], problem, (dev_type, dev_id))


def _allreduce_each_(tensors, names, priorities, op, prescale_factor, postscale_factor,
                     process_set):
    """``allreduce_`` of each tensor under its name and priority, each its own
    unit, pushed in one C call: DistributedTrainer's gradients (one Python
    call per gradient cost about as much as the push itself). Raises
    allreduce_'s error for the first tensor it would refuse, before any is
    pushed."""
    fn = "allreduce_"
    _check_common(fn, None, 0)
    set_id, _, _ = _set_for_call(fn, process_set)
    prescale = _check_scale(fn, "prescale_factor", prescale_factor)
    postscale = _check_scale(fn, "postscale_factor", postscale_factor)
    for i, t in enumerate(tensors):
        if not isinstance(t, mx.nd.NDArray):
            _check_tensor(fn, f"tensors[{i}]", t)
    if op == Adasum:
        _check_adasum(fn, [_check_tensor(fn, f"tensors[{i}]", t)[0]
                           for i, t in enumerate(tensors)],
                      set_id, [f"tensors[{i}]" for i in range(len(tensors))])
    _push_each_in_place(fn, set_id, tensors, names, priorities, op, prescale, postscale,
                        "tensors[{}]")
    return tensors


def _check_list(fn: str, tensors) -> List[mx.nd.NDArray]:
    if isinstance(tensors, mx.nd.NDArray) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"hvdmx.{fn}: argument 'tensors' must be a list of NDArrays, got "
                        f"{type(tensors).__name__}")
    return list(tensors)


def grouped_allreduce(tensors: List[mx.nd.NDArray], average: Optional[bool] = None,
                      name: Optional[str] = None, priority: int = 0, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                      op: Optional[int] = None) -> List[mx.nd.NDArray]:
    """Allreduces a list of tensors as one unit (negotiated and delivered
    together) and returns the list of results."""
    tensors = _check_list("grouped_allreduce", tensors)
    return _allreduce("grouped_allreduce", tensors, None, average, name, priority,
                      prescale_factor, postscale_factor, op, "grouped_allreduce", process_set)


def grouped_allreduce_(tensors: List[mx.nd.NDArray], average: Optional[bool] = None,
                       name: Optional[str] = None, priority: int = 0, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                       op: Optional[int] = None) -> List[mx.nd.NDArray]:
    """In-place ``grouped_allreduce``; returns ``tensors``."""
    tensors = _check_list("grouped_allreduce_", tensors)
    for i, t in enumerate(tensors):
        _check_tensor("grouped_allreduce_", f"tensors[{i}]", t)
    return _allreduce("grouped_allreduce_", tensors, tensors, average, name, priority,
                      prescale_factor, postscale_factor, op, "grouped_allreduce", process_set)


def _broadcast(fn, tensor, output, root_rank, name, priority, process_set):
    _check_common(fn, name, priority)
    set_id, set_ranks, _ = _set_for_call(fn, process_set)
    checked = _check_tensor(fn, "tensor", tensor)
    code, device, shape = checked
    root = _check_root(fn, root_rank, set_ranks)
    if output is None:
        output = _new_array(tensor, shape, code, device)
    tensors = [tensor]
    _push(set_id, _core.BROADCAST, name if name is not None else _auto_name("broadcast", set_id),
          tensors, tensors if output is tensor else [output], [checked], device, root=root,
          priority=priority)
    return output


def broadcast(tensor: mx.nd.NDArray, root_rank: int, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """Returns a new NDArray holding ``root_rank``'s ``tensor`` on every rank
    (``root_rank`` is a rank of the whole job, in ``process_set``)."""
    return _broadcast("broadcast", tensor, None, root_rank, name, priority, process_set)


def broadcast_(tensor: mx.nd.NDArray, root_rank: int, name: Optional[str] = None, priority: int = 0,
               process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """In-place ``broadcast``: ``tensor`` takes ``root_rank``'s value; returned."""
    if not isinstance(tensor, mx.nd.NDArray):  # before the checks that assume one
        _check_tensor("broadcast_", "tensor", tensor)
    return _broadcast("broadcast_", tensor, tensor, root_rank, name, priority, process_set)


# ---- barrier and join ---------------------------------------------------------

def _raise_if(error, code) -> None:
    """Raises a negotiated unit's error, of the class its status code maps to
    (hvdmx/_job.py): MismatchError for the round's error response (the
    ranks' calls do not match), MXNetError when hvdmx stopped."""
    if error is not None:
        raise _job.error_for(code, error)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank of ``process_set`` has called ``barrier``.
    Collectives submitted before it are not waited for."""
    _check_common("barrier", None, 0)
    set_id, _, _ = _set_for_call("barrier", process_set)
    error, _, _, code = _core.negotiate(set_id=set_id, collective=_core.BARRIER,
                                        name=_auto_name("barrier", set_id))
    _raise_if(error, code)


def join() -> int:
    """Declares that this rank has no more data; returns once every rank has
    joined, with the rank that joined last.

    Until then this rank takes part in the other ranks' allreduces with
    zeros (an Average still divides by ``size()``), so ranks with fewer
    batches can stop early. Other collectives fail while a rank has joined.
    Collectives called before ``join`` still count this rank's data: ``join``
    first waits until each has been submitted (left MXNet's engine queue).
    """
    _check_common("join", None, 0)
    error, _, last, code = _core.negotiate(set_id=0, collective=_core.JOIN, name="hvdmx.join")
    _raise_if(error, code)
    return int(last)
