"""Allgather, alltoall and reducescatter on NDArrays: the collectives that
split or join along the first dimension (the checks and the push that all
collectives share are in hvdmx/ops.py).

Allgather and alltoall must know every rank's sizes to allocate their
output: the call first exchanges the sizes (shapes and splits, never the
data) with the other ranks' same call, then pushes the data exchange as an
engine op. So the call waits for the other ranks to *make* the call, but
never for the input to be computed or for any data to move. A mismatch
found in that exchange raises ``hvdmx.errors.MismatchError`` from the call,
on every rank: the round that finds it is one negotiation round, whose
error response every rank of the call receives.
"""
from __future__ import annotations

import numbers
from typing import List, Optional, Sequence, Tuple, Union

import mxnet as mx
import numpy as np

from hvdmx import _core
from hvdmx.errors import InvalidArgumentError, InvalidTypeError
from hvdmx.ops import Average, _Device, Sum, _Call, _Checked, _check_list, _check_tensor, _Common, \
    _int32_array, _new_array, _one_device, _raise_if, _Reduction
from hvdmx.process_sets import ProcessSet, global_process_set

def _check_rows(fn: str, arg: str, shape) -> None:
    if len(shape) == 0:
        raise InvalidArgumentError(f"hvdmx.{fn}: argument '{arg}' is a 0-d (scalar) array; {fn} "
                                   f"works on the first dimension: pass {arg}.reshape((1,))")


def _check_row_tensors(fn: str, tensors) -> List[_Checked]:
    """Validates the tensors of a call that splits or joins along dim 0."""
    label = "tensor" if len(tensors) == 1 and not fn.startswith("grouped") else "tensors[{}]"
    checked = []
    for i, t in enumerate(tensors):
        checked.append(_check_tensor(fn, label.format(i), t))
        _check_rows(fn, label.format(i), checked[-1][2])
    return checked


def _sizes_round(call: _Call) -> List[int]:
    """Exchanges sizes with the other ranks' same call (see the module doc)
    and returns the response's splits, or raises its error: a mismatch
    (MismatchError) reaches every rank of the call in this same round, so no
    rank goes on to push the data exchange while another raises. ``call``
    is the exchange still to push: its splits are what this rank sends
    (none for allgather), its outputs not made yet."""
    error, sizes, _, code = _core.negotiate(set_id=call.common.set_id, collective=call.collective,
                                            name=call.name + "#sizes",
                                            dtypes=[c.code for c in call.checked],
                                            shapes=[c.shape for c in call.checked],
                                            splits=list(call.splits), sizes_only=True,
                                            dev_type=call.device[0], dev_id=call.device[1])
    _raise_if(error, code)
    assert sizes is not None  # no error
    return sizes


def _allgather(common: _Common, tensors: List[mx.nd.NDArray]) -> List[mx.nd.NDArray]:
    fn = common.fn
    checked = _check_row_tensors(fn, tensors)
    device = _one_device(fn, checked)
    call = _Call(_core.ALLGATHER, common, common.unit_name(fn), tensors, [], checked, device)
    sizes = _sizes_round(call)
    if not tensors:  # the sizes round checked that every rank's group is empty too
        return []
    n = len(common.set_ranks)
    outputs = [_new_array(t, (sum(sizes[i * n:(i + 1) * n]),) + shape[1:], code, device)
               for i, (t, (code, _, shape)) in enumerate(zip(tensors, checked))]
    call._replace(outputs=outputs, splits=sizes).push()
    return outputs


def allgather(tensor: mx.nd.NDArray, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> mx.nd.NDArray:
    """Concatenates every rank's ``tensor`` along the first dimension, in rank
    order; the first dimension may differ between ranks, the others must
    match. Returns a new NDArray."""
    return _allgather(_Common.check("allgather", name, priority, process_set), [tensor])[0]


def grouped_allgather(tensors: List[mx.nd.NDArray], name: Optional[str] = None,
                      priority: int = 0,
                      process_set: ProcessSet = global_process_set) -> List[mx.nd.NDArray]:
    """``allgather`` of each tensor in a list, as one unit; returns the list
    of results."""
    tensors = _check_list("grouped_allgather", tensors)
    return _allgather(_Common.check("grouped_allgather", name, priority, process_set), tensors)


def _check_splits(fn: str, splits, rows: int, n: int) -> List[int]:
    if isinstance(splits, mx.nd.NDArray):
        if np.dtype(splits.dtype).kind not in "iu":
            raise InvalidTypeError(f"hvdmx.{fn}: argument 'splits' must hold integers (int32), got "
                                   f"an NDArray of {np.dtype(splits.dtype)}; use "
                                   "splits.astype('int32')")
        values = splits.asnumpy().reshape(-1).tolist()
    elif isinstance(splits, np.ndarray):
        if splits.dtype.kind not in "iu":
            raise InvalidTypeError(f"hvdmx.{fn}: argument 'splits' must hold integers, got a numpy "
                                   f"array of {splits.dtype}")
        values = splits.reshape(-1).tolist()
    elif isinstance(splits, (list, tuple)):
        for v in splits:
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise InvalidTypeError(f"hvdmx.{fn}: argument 'splits' must hold integers, got "
                                       f"{v!r} in {list(splits)!r}")
        values = [int(v) for v in splits]
    else:
        raise InvalidTypeError(f"hvdmx.{fn}: argument 'splits' must be a list of ints or an int32 "
                               f"NDArray, got {type(splits).__name__}")
    if len(values) != n:
        raise InvalidArgumentError(f"hvdmx.{fn}: argument 'splits' has {len(values)} entries but "
                                   f"the process set has {n} ranks; give one entry per rank")
    if any(v < 0 for v in values):
        raise InvalidArgumentError(f"hvdmx.{fn}: argument 'splits'={values} has negative entries; "
                                   "each is a number of rows to send")
    if sum(values) != rows:
        raise InvalidArgumentError(f"hvdmx.{fn}: argument 'splits'={values} sums to {sum(values)}, "
                                   f"but the tensor has {rows} rows (its first dimension); they "
                                   "must be equal")
    return values


def alltoall(tensor: mx.nd.NDArray,
             splits: Optional[Union[Sequence[int], mx.nd.NDArray]] = None,
             name: Optional[str] = None, priority: int = 0,
             process_set: ProcessSet = global_process_set
             ) -> Union[mx.nd.NDArray, Tuple[mx.nd.NDArray, mx.nd.NDArray]]:
    """Sends ``splits[j]`` rows of ``tensor`` (consecutive, in rank order) to
    rank j of the process set and concatenates what every rank sent here.

    Without ``splits`` the first dimension is divided equally. Returns the
    output, or ``(output, received_splits)`` (an int32 NDArray) when
    ``splits`` was given.
    """
    fn = "alltoall"
    common = _Common.check(fn, name, priority, process_set)
    checked = _check_row_tensors(fn, [tensor])
    (code, device, shape), = checked
    n = len(common.set_ranks)
    rows = shape[0]
    if splits is None:
        if rows % n:
            raise InvalidArgumentError(f"hvdmx.{fn}: the tensor's first dimension ({rows}) does "
                                       f"not divide evenly among {n} ranks; pass 'splits' "
                                       "(rows per rank)")
        send = [rows // n] * n
    else:
        send = _check_splits(fn, splits, rows, n)
    call = _Call(_core.ALLTOALL, common, common.unit_name(fn), [tensor], [], checked, device,
                 splits=send)
    matrix = _sizes_round(call)
    recv = [matrix[j * n + common.me] for j in range(n)]
    output = _new_array(tensor, (sum(recv),) + shape[1:], code, device)
    call._replace(outputs=[output], splits=matrix).push()
    return output if splits is None else (output, _int32_array(recv))


def _reducescatter(common: _Common, tensors: List[mx.nd.NDArray], *, op, prescale_factor,
                   postscale_factor) -> List[mx.nd.NDArray]:
    """The keywords are the public function's own, unchecked."""
    fn = common.fn
    checked = _check_row_tensors(fn, tensors)
    if isinstance(op, bool) or op not in (Average, Sum):
        raise InvalidArgumentError(f"hvdmx.{fn}: argument 'op'={op!r} is not supported; "
                                   "reducescatter takes hvd.Average or hvd.Sum")
    reduction = _Reduction.check(fn, op, prescale_factor, postscale_factor)
    device: _Device = _one_device(fn, checked)
    n, me = len(common.set_ranks), common.me
    outputs = []
    for t, (code, _, shape) in zip(tensors, checked):
        rows = shape[0] // n + (1 if me < shape[0] % n else 0)
        outputs.append(_new_array(t, (rows,) + shape[1:], code, device))
    _Call(_core.REDUCESCATTER, common, common.unit_name(fn), tensors, outputs, checked, device,
          reduction).push()
    return outputs


def reducescatter(tensor: mx.nd.NDArray, op: int = Average, name: Optional[str] = None,
                  priority: int = 0, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> mx.nd.NDArray:
    """Reduces ``tensor`` over the ranks and returns this rank's block of rows
    of the result: the first dimension is split as evenly as possible, the
    first ranks taking one row more when it does not divide."""
    return _reducescatter(_Common.check("reducescatter", name, priority, process_set), [tensor],
                          op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor)[0]


def grouped_reducescatter(tensors: List[mx.nd.NDArray], op: int = Average,
                          name: Optional[str] = None, priority: int = 0,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[mx.nd.NDArray]:
    """``reducescatter`` of each tensor in a list, as one unit."""
    tensors = _check_list("grouped_reducescatter", tensors)
    return _reducescatter(_Common.check("grouped_reducescatter", name, priority, process_set),
                          tensors, op=op, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor)
