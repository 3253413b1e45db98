"""Collectives on picklable Python objects.

These return objects, so they wait for the data (unlike the NDArray
collectives). Objects are serialized with cloudpickle, as Horovod does, so
lambdas, local functions and classes travel too. They unpickle what other
ranks send: use them only within a job whose every process you trust, as
pickle can run code.
"""
from __future__ import annotations

import pickle
from typing import Any, List

import cloudpickle
import mxnet as mx
import numpy as np

from hvdmx import ops
from hvdmx.process_sets import _set_for_call, global_process_set


def _to_bytes(array) -> bytes:
    return array.asnumpy().tobytes()


def broadcast_object(obj: Any, root_rank: int = 0, name=None,
                     process_set=global_process_set) -> Any:
    """Returns ``root_rank``'s ``obj`` on every rank of ``process_set``
    (``obj`` is ignored elsewhere)."""
    fn = "broadcast_object"
    ops._check_common(fn, name, 0)
    set_id, set_ranks, me = _set_for_call(fn, process_set)
    root = ops._check_root(fn, root_rank, set_ranks)
    name = name if name is not None else ops._auto_name(fn, set_id)
    payload = cloudpickle.dumps(obj) if me == root else b""
    length = mx.nd.array([len(payload)], dtype="int64")
    ops.broadcast_(length, root_rank, name=name + ".length", process_set=process_set)
    n = int(length.asnumpy()[0])
    data = (mx.nd.array(np.frombuffer(payload, dtype=np.uint8), dtype="uint8") if me == root
            else mx.nd.empty((n,), dtype="uint8"))
    ops.broadcast_(data, root_rank, name=name + ".data", process_set=process_set)
    return obj if me == root else pickle.loads(_to_bytes(data))


def allgather_object(obj: Any, name=None, process_set=global_process_set) -> List[Any]:
    """Returns the list of every rank's ``obj``, in rank order of
    ``process_set``."""
    fn = "allgather_object"
    ops._check_common(fn, name, 0)
    set_id, _, _ = _set_for_call(fn, process_set)
    name = name if name is not None else ops._auto_name(fn, set_id)
    payload = np.frombuffer(cloudpickle.dumps(obj), dtype=np.uint8)
    lengths = ops.allgather(mx.nd.array([payload.size], dtype="int64"), name=name + ".length",
                            process_set=process_set)
    data = ops.allgather(mx.nd.array(payload, dtype="uint8"), name=name + ".data",
                         process_set=process_set)
    raw = _to_bytes(data)
    out, start = [], 0
    for n in lengths.asnumpy().tolist():
        out.append(pickle.loads(raw[start:start + n]))
        start += n
    return out
