"""Collectives on NDArrays, pushed into MXNet's engine as async ops:
allreduce and broadcast, barrier and join, and what every collective checks
(allgather, alltoall and reducescatter are in hvdmx/gather_scatter.py).

Every call checks what it can see locally, then returns at once: the
collective runs when the engine has the inputs ready, and reading the
result (``asnumpy()``, ``wait_to_read()``, a later op) waits for it. A
mismatch between ranks raises ``MXNetError`` at that read, on every rank.

Argument errors are ``hvdmx.errors`` classes, which are ``MXNetError`` as
well as ``ValueError``/``TypeError`` (see that module and docs/errors.md).

A call's checked parts (``_Common``, ``_Reduction``, ``_Checked``) make one
``_Call``, whose ``push`` is the one way from here to ``_core.push_async``;
hvdmx/_core.pyi types the core's side.
"""
from __future__ import annotations

import numbers
import warnings
from typing import List, NamedTuple, Optional, Sequence, Tuple

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

# MXNet's (device type id, device id) of an array.
_Device = Tuple[int, int]


class _Checked(NamedTuple):
    """An NDArray argument that _check_tensor accepted, as the core describes
    it (and as push_async takes it): its dtype code, device and shape."""
    code: int
    device: _Device
    shape: Tuple[int, ...]


def _check_tensor(fn: str, arg: str, tensor) -> _Checked:
    """Validates one NDArray argument (``arg`` names it in the error)."""
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"hvdmx.{fn}: argument '{arg}' must be an mxnet.nd.NDArray, got "
                        f"{type(tensor).__name__}; convert it with mx.nd.array(...)")
    # One C call for what would be four ctypes calls through the properties;
    # the core checks the array too (CheckArray in csrc/hvdmx/python/bindings.cc).
    code, _, dev_type, dev_id, shape, problem = _core.describe(tensor.handle.value)
    if problem != _core.ARRAY_OK:
        raise _array_error(fn, arg, tensor, problem, (dev_type, dev_id))
    assert shape is not None  # ARRAY_NO_SHAPE otherwise
    return _Checked(code, (dev_type, dev_id), shape)


def _array_error(fn: str, arg: str, tensor, problem: int, device: _Device) -> Exception:
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


def _new_array(like, shape: Sequence[int], code: int, device: _Device):
    """An uninitialized array (allocated when first written) of ``shape``,
    dtype ``code`` and ``device``, of ``like``'s class (mx.nd or mx.np)."""
    handle = mx.base.NDArrayHandle(_core.new_array(shape, code, device[0], device[1]))
    if isinstance(like, mx.np.ndarray):
        return mx.np.ndarray(handle)
    return mx.nd.NDArray(handle)


def _int32_array(values: Sequence[int]):
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


class _Common(NamedTuple):
    """What a collective's call says besides its tensors, checked once
    (_Common.check): the public function that errors name, the process set
    (its id, its ranks as ranks of the job, this rank's index in them), the
    name given (None: generate one) and the priority."""
    fn: str
    set_id: int
    set_ranks: Sequence[int]
    me: int
    name: Optional[str]
    priority: int

    @classmethod
    def check(cls, fn: str, name, priority, process_set) -> "_Common":
        _check_common(fn, name, priority)
        set_id, set_ranks, me = _set_for_call(fn, process_set)
        return cls(fn, set_id, set_ranks, me, name, int(priority))

    def unit_name(self, kind: str) -> str:
        """The name given, or the next generated name of ``kind`` on the set
        (taken only here, once every check has passed)."""
        return self.name if self.name is not None else _auto_name(kind, self.set_id)


class _Reduction(NamedTuple):
    """How a reducing collective combines: the op (a REDUCE_OPS code) and
    the factors applied before and after; the defaults reduce nothing."""
    op: int
    prescale: float = 1.0
    postscale: float = 1.0

    @classmethod
    def check(cls, fn: str, op: int, prescale_factor, postscale_factor) -> "_Reduction":
        """``op`` already checked (its rules differ by collective); the
        factors checked here."""
        return cls(op, _check_scale(fn, "prescale_factor", prescale_factor),
                   _check_scale(fn, "postscale_factor", postscale_factor))


class _Call(NamedTuple):
    """One collective as the core takes it, built from checked parts once
    every check of the call has passed, then pushed (``push``): the one path
    from a public function to _core.push_async. ``inputs`` and ``outputs``
    are NDArrays (the same list for an in-place call), ``checked`` describes
    each input, all on ``device``."""
    collective: int
    common: _Common
    name: str
    inputs: Sequence[mx.nd.NDArray]
    outputs: Sequence[mx.nd.NDArray]
    checked: Sequence[_Checked]
    device: _Device
    reduction: _Reduction = _Reduction(Sum)
    root: int = 0
    splits: Sequence[int] = ()

    def push(self) -> None:
        handles = [t.handle.value for t in self.inputs]
        outputs = self.outputs
        try:
            _core.push_async(set_id=self.common.set_id, collective=self.collective,
                             name=self.name, inputs=handles,
                             outputs=handles if outputs is self.inputs else
                             [t.handle.value for t in outputs],
                             dtypes=[c.code for c in self.checked],
                             shapes=[c.shape for c in self.checked], op=self.reduction.op,
                             root=self.root, prescale=self.reduction.prescale,
                             postscale=self.reduction.postscale, splits=list(self.splits),
                             priority=self.common.priority, dev_type=self.device[0],
                             dev_id=self.device[1])
        except RuntimeError:
            # hvdmx stopped between the call's check and its push (a peer lost,
            # another rank's shutdown): say why, as the check would have.
            if not _core.is_initialized():
                raise _job.not_running() from None
            raise


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


def _check_root(fn: str, root_rank, set_ranks: Sequence[int]) -> int:
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


def _one_device(fn: str, checked: Sequence[_Checked]) -> _Device:
    """The one device of the arguments ``checked``."""
    device = checked[0].device if checked else (1, 0)
    for _, other, _ in checked[1:]:
        if other != device:
            raise InvalidArgumentError(f"hvdmx.{fn}: all tensors must be on one device; got "
                                       f"{_device_str(device)} and {_device_str(other)}")
    return device


def _device_str(device: _Device) -> str:
    return str(mx.Context(mx.Context.devtype2str[device[0]], device[1]))


def _check_distinct(fn: str, tensors: Sequence[mx.nd.NDArray]) -> None:
    if len(tensors) < 2:
        return
    handles = [t.handle.value for t in tensors]
    if len(set(handles)) != len(handles):
        raise InvalidArgumentError(f"hvdmx.{fn}: the same NDArray appears twice in 'tensors'; an "
                                   "in-place call needs distinct arrays")


def _labels(tensors: Sequence[mx.nd.NDArray]) -> List[str]:
    """How errors name each tensor of an allreduce's call."""
    return ["tensor"] if len(tensors) == 1 else [f"tensors[{i}]" for i in range(len(tensors))]


def _allreduce(common: _Common, kind: str, tensors: Sequence[mx.nd.NDArray], outputs, *,
               average, op, prescale_factor, postscale_factor):
    """The allreduce of ``tensors`` into new arrays when ``outputs`` is None,
    else into ``outputs``; ``kind`` names its generated name, the keywords
    are the public function's own, unchecked."""
    fn = common.fn
    labels = _labels(tensors)
    checked = [_check_tensor(fn, label, t) for label, t in zip(labels, tensors)]
    op = _resolve_op(fn, average, op)
    if op == Adasum:
        _check_adasum(fn, [c.code for c in checked], common.set_id, labels)
    reduction = _Reduction.check(fn, op, prescale_factor, postscale_factor)
    device = _one_device(fn, checked)
    if outputs is None:
        outputs = [_new_array(t, shape, code, device)
                   for t, (code, _, shape) in zip(tensors, checked)]
    else:
        _check_distinct(fn, outputs)
    _Call(_core.ALLREDUCE, common, common.unit_name(kind), tensors, outputs, checked, device,
          reduction).push()
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
    common = _Common.check("allreduce", name, priority, process_set)
    return _allreduce(common, "allreduce", [tensor], None, average=average, op=op,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor)[0]


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
        tensors = [tensor]  # as inputs and outputs: one list, so _Call sees it is in place
        return _allreduce(_Common.check(fn, name, priority, process_set), "allreduce", tensors,
                          tensors, average=average, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor)[0]
    # Named (as DistributedTrainer's and the kvstore's are): the core checks
    # and describes the tensor while it pushes, a quarter of the call's cost
    # (docs/benchmark-notes.md, "Small messages: latency through the whole
    # stack").
    common = _Common.check(fn, name, priority, process_set)
    op = _resolve_op(fn, average, op)
    if op == Adasum:
        _check_adasum(fn, [_check_tensor(fn, "tensor", tensor).code], common.set_id, ["tensor"])
    reduction = _Reduction.check(fn, op, prescale_factor, postscale_factor)
    _push_each_in_place(common, reduction, [tensor], [name], [common.priority], "tensor")
    return tensor


def _push_each_in_place(common: _Common, reduction: _Reduction,
                        tensors: Sequence[mx.nd.NDArray], names: Sequence[str],
                        priorities: Sequence[int], label: str) -> None:
    """Has the core check every NDArray of ``tensors`` (the check behind
    _check_tensor), then push an in-place allreduce of each under its name
    and priority; if it refuses one, nothing is pushed and allreduce_'s own
    error is raised for it (``label.format(i)`` names the argument)."""
    fn = common.fn
    bad, problem = _core.push_allreduce_each(set_id=common.set_id, names=names,
                                             handles=[t.handle.value for t in tensors],
                                             priorities=priorities, op=reduction.op,
                                             prescale=reduction.prescale,
                                             postscale=reduction.postscale)
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
    common = _Common.check(fn, None, 0, process_set)
    reduction = _Reduction.check(fn, op, prescale_factor, postscale_factor)
    for i, t in enumerate(tensors):
        if not isinstance(t, mx.nd.NDArray):
            _check_tensor(fn, f"tensors[{i}]", t)
    if op == Adasum:
        _check_adasum(fn, [_check_tensor(fn, f"tensors[{i}]", t).code
                           for i, t in enumerate(tensors)],
                      common.set_id, [f"tensors[{i}]" for i in range(len(tensors))])
    _push_each_in_place(common, reduction, tensors, names, priorities, "tensors[{}]")
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
    common = _Common.check("grouped_allreduce", name, priority, process_set)
    return _allreduce(common, "grouped_allreduce", tensors, None, average=average, op=op,
                      prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def grouped_allreduce_(tensors: List[mx.nd.NDArray], average: Optional[bool] = None,
                       name: Optional[str] = None, priority: int = 0, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set,
                       op: Optional[int] = None) -> List[mx.nd.NDArray]:
    """In-place ``grouped_allreduce``; returns ``tensors``."""
    fn = "grouped_allreduce_"
    tensors = _check_list(fn, tensors)
    for i, t in enumerate(tensors):
        _check_tensor(fn, f"tensors[{i}]", t)
    return _allreduce(_Common.check(fn, name, priority, process_set), "grouped_allreduce",
                      tensors, tensors, average=average, op=op, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor)


def _broadcast(common: _Common, tensor: mx.nd.NDArray, root_rank, in_place: bool):
    """The broadcast of ``tensor`` into a new array, or into itself."""
    fn = common.fn
    checked = _check_tensor(fn, "tensor", tensor)
    code, device, shape = checked
    root = _check_root(fn, root_rank, common.set_ranks)
    tensors = [tensor]
    outputs = tensors if in_place else [_new_array(tensor, shape, code, device)]
    _Call(_core.BROADCAST, common, common.unit_name("broadcast"), tensors, outputs, [checked],
          device, root=root).push()
    return outputs[0]


def broadcast(tensor: mx.nd.NDArray, root_rank: int, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """Returns a new NDArray holding ``root_rank``'s ``tensor`` on every rank
    (``root_rank`` is a rank of the whole job, in ``process_set``)."""
    return _broadcast(_Common.check("broadcast", name, priority, process_set), tensor, root_rank,
                      in_place=False)


def broadcast_(tensor: mx.nd.NDArray, root_rank: int, name: Optional[str] = None, priority: int = 0,
               process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """In-place ``broadcast``: ``tensor`` takes ``root_rank``'s value; returned."""
    if not isinstance(tensor, mx.nd.NDArray):  # before the checks that assume one
        _check_tensor("broadcast_", "tensor", tensor)
    return _broadcast(_Common.check("broadcast_", name, priority, process_set), tensor,
                      root_rank, in_place=True)


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
    common = _Common.check("barrier", None, 0, process_set)
    error, _, _, code = _core.negotiate(set_id=common.set_id, collective=_core.BARRIER,
                                        name=common.unit_name("barrier"))
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
