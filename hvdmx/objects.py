"""Collectives on picklable Python objects: broadcast_object and
allgather_object (``horovod.mxnet.functions``'s, which hvdmx/functions.py
keeps importable under that name).

These return objects, so they wait for the data (unlike the NDArray
collectives). Objects are serialized with cloudpickle, as Horovod does, so
lambdas, local functions and classes travel too. They unpickle what other
ranks send: use them only within a job whose every process you trust, as
pickle can run code.
"""
from __future__ import annotations

import pickle
from typing import Any, List, Optional

import cloudpickle
import mxnet as mx
import numpy as np

from hvdmx import ops
from hvdmx.gather_scatter import allgather
from hvdmx.process_sets import ProcessSet, _auto_name, _set_for_call, global_process_set


def _to_bytes(array) -> bytes:
    return array.asnumpy().tobytes()


def _pickle(obj: Any):
    """(bytes, None), or (b"", the exception) when ``obj`` cannot be pickled:
    the caller still takes part in the collective, so that the peers fail
    too instead of waiting for it."""
    try:
        return cloudpickle.dumps(obj), None
    except Exception as error:  # cloudpickle raises TypeError, PicklingError, ...
        return b"", error


def _unpicklable(fn: str, error: Exception) -> TypeError:
    return TypeError(f"hvdmx.{fn}: argument 'obj' cannot be pickled ({type(error).__name__}: "
                     f"{error}); pass an object cloudpickle can serialize. The other ranks' "
                     "calls fail too")


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Returns ``root_rank``'s ``obj`` on every rank of ``process_set``
    (``obj`` is ignored elsewhere)."""
    fn = "broadcast_object"
    ops._check_common(fn, name, 0)
    set_id, set_ranks, me = _set_for_call(fn, process_set)
    root = ops._check_root(fn, root_rank, set_ranks)
    name = name if name is not None else _auto_name(fn, set_id)
    payload, error = _pickle(obj) if me == root else (b"", None)
    # A length of -1 tells the other ranks that the root could not pickle.
    length = mx.nd.array([-1 if error is not None else len(payload)], dtype="int64")
    ops.broadcast_(length, root_rank, name=name + ".length", process_set=process_set)
    n = int(length.asnumpy()[0])
    if n < 0:
        if error is not None:
            raise _unpicklable(fn, error) from error
        raise ValueError(f"hvdmx.{fn}: the root, rank {root_rank}, could not pickle its object "
                         "(its own error says why); nothing was broadcast")
    data = (mx.nd.array(np.frombuffer(payload, dtype=np.uint8), dtype="uint8") if me == root
            else mx.nd.empty((n,), dtype="uint8"))
    ops.broadcast_(data, root_rank, name=name + ".data", process_set=process_set)
    return obj if me == root else pickle.loads(_to_bytes(data))


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Returns the list of every rank's ``obj``, in rank order of
    ``process_set``."""
    fn = "allgather_object"
    ops._check_common(fn, name, 0)
    set_id, set_ranks, _ = _set_for_call(fn, process_set)
    name = name if name is not None else _auto_name(fn, set_id)
    pickled, error = _pickle(obj)
    payload = np.frombuffer(pickled, dtype=np.uint8)
    # A length of -1 tells the other ranks that this one could not pickle.
    lengths = allgather(mx.nd.array([-1 if error is not None else payload.size],
                                        dtype="int64"),
                            name=name + ".length", process_set=process_set)
    data = allgather(mx.nd.array(payload, dtype="uint8"), name=name + ".data",
                         process_set=process_set)
    lengths = lengths.asnumpy().tolist()
    if error is not None:
        raise _unpicklable(fn, error) from error
    failed = [set_ranks[i] for i, n in enumerate(lengths) if n < 0]
    if failed:
        raise ValueError(f"hvdmx.{fn}: rank(s) {failed} could not pickle their object (their "
                         "own errors say why); nothing was gathered")
    raw = _to_bytes(data)
    out, start = [], 0
    for n in lengths:
        out.append(pickle.loads(raw[start:start + n]))
        start += n
    return out
