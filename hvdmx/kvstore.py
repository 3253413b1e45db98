"""The kvstore plugin: a key-value store for MXNet's own training loops
(``gluon.Trainer``, ``mx.mod.Module``) that combines values across ranks with
hvdmx collectives.

    trainer = gluon.Trainer(net.collect_params(), "sgd", {...}, kvstore=hvd.KVStore())
    ...
    trainer.step(batch_size * hvd.size())   # the batch of the whole job

There is no store: ``pushpull`` is an in-place Sum allreduce and
``broadcast`` a broadcast from rank 0, both pushed into MXNet's engine and
returned from at once. The optimizer runs in the Trainer (or Module) on every
rank after the allreduce (``is_capable('optimizer')`` is False).

What a kvstore means to MXNet, and so what this one does:

- ``pushpull`` sums over the values given (one per device of this rank) and
  over all ranks, like MXNet's ``dist_sync`` store. Trainer then divides by
  the batch size given to ``step``, so ``step`` must be given the batch size
  of the whole job (local batch x ``hvd.size()``) to apply the average
  gradient; that is exactly one process training on the whole batch.
  Module multiplies its batch size by ``num_workers`` by itself for a store
  whose type has ``dist`` and ``_sync`` in it, which this one's has.
- ``broadcast`` gives every rank rank 0's value. Trainer calls it for every
  parameter at its first step, after that step's backward pass; call
  ``hvd.broadcast_parameters`` before training for the first step's gradients
  to come from the same parameters too.
- ``init`` has no store to fill (Module calls it) and does nothing.

Tensor names: ``prefix + "kvstore.pushpull." + str(key)`` and
``prefix + "kvstore.broadcast." + str(key)``. Trainer's keys are parameter
indices, so two trainers whose steps overlap need stores with different
prefixes.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, List, Optional, Tuple, Type, Union

import mxnet as mx
from mxnet.kvstore import KVStoreBase

from hvdmx.basics import rank, size
from hvdmx.compression import Compression, Compressor, _check_quantizable, _exchange_with_residual
from hvdmx.errors import InvalidArgumentError
from hvdmx.process_sets import global_process_set
from hvdmx.ops import Adasum, Average, Sum, allreduce, allreduce_, broadcast_
from hvdmx.optimizer import _check_training_op, _plain_layout

__all__ = ["KVStore"]

# A key or a list of keys, and an NDArray (per key) or a list of them.
Keys = Union[int, str, List[Union[int, str]]]
Values = Union[mx.nd.NDArray, List[mx.nd.NDArray]]
_TYPE = "dist_sync_hvdmx"


def _check_key(fn: str, arg: str, key):
    if isinstance(key, bool) or not isinstance(key, (numbers.Integral, str)):
        raise TypeError(f"hvdmx.KVStore.{fn}: argument '{arg}' must be an int or a str (or a "
                        f"list of them), got {key!r} of type {type(key).__name__}")
    return key


def _check_arrays(fn: str, arg: str, value, want_shape=None) -> List[mx.nd.NDArray]:
    """``value`` as a non-empty list of dense NDArrays of one shape."""
    arrays = list(value) if isinstance(value, (list, tuple)) else [value]
    if not arrays:
        raise InvalidArgumentError(f"hvdmx.KVStore.{fn}: argument '{arg}' is an empty list; pass "
                                   "an NDArray or a list with one NDArray per device")
    for i, a in enumerate(arrays):
        where = arg if len(arrays) == 1 and not isinstance(value, (list, tuple)) \
            else f"{arg}[{i}]"
        if not isinstance(a, mx.nd.NDArray):
            raise TypeError(f"hvdmx.KVStore.{fn}: argument '{where}' must be an "
                            f"mxnet.nd.NDArray, got {type(a).__name__}")
        if isinstance(a, mx.nd.sparse.BaseSparseNDArray):
            raise InvalidArgumentError(f"hvdmx.KVStore.{fn}: argument '{where}' is a sparse "
                                       f"NDArray (stype='{a.stype}'); hvdmx.KVStore handles dense "
                                       "arrays only: use dense parameters and gradients "
                                       "(stype='default')")
        shape = want_shape if want_shape is not None else arrays[0].shape
        if a.shape != shape:
            raise InvalidArgumentError(f"hvdmx.KVStore.{fn}: argument '{where}' has shape "
                                       f"{a.shape}, but the value has shape {shape}; every array "
                                       "of one key must have the same shape")
    return arrays


def _check_priority(fn: str, priority) -> int:
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise TypeError(f"hvdmx.KVStore.{fn}: argument 'priority' must be an int, got "
                        f"{priority!r}")
    return int(priority)


def _no_push_pull(fn: str):
    raise NotImplementedError(
        f"hvdmx.KVStore.{fn}: there is no push, pull or row_sparse_pull (MXNet calls them "
        "for sparse gradients or weights): use dense parameters (stype='default', "
        "grad_stype='default'), whose gradients go through pushpull")


def _entries(fn: str, key, value, out) -> List[Tuple[Any, List[mx.nd.NDArray],
                                                    Optional[List[mx.nd.NDArray]]]]:
    """(key, values, outs) per key, for a single key or a list of keys."""
    if isinstance(key, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            raise InvalidArgumentError(f"hvdmx.KVStore.{fn}: with a list of {len(key)} keys, "
                                       "argument 'value' must be a list of as many values (an "
                                       "NDArray or a list of NDArrays each)")
        if out is not None and (not isinstance(out, (list, tuple)) or len(out) != len(key)):
            raise InvalidArgumentError(f"hvdmx.KVStore.{fn}: with a list of {len(key)} keys, "
                                       "argument 'out' must be None or a list of as many outputs")
        each_out = out if out is not None else [None] * len(key)
        return [e for k, v, o in zip(key, value, each_out) for e in _entries(fn, k, v, o)]
    _check_key(fn, "key", key)
    values = _check_arrays(fn, "value", value)
    outs = None if out is None else _check_arrays(fn, "out", out, values[0].shape)
    return [(key, values, outs)]


class KVStore(KVStoreBase):
    """A kvstore that sums values over all ranks with hvdmx (see the module
    docstring for how gluon.Trainer and Module use it).

    ``compression`` is hvd.Compression.none or hvd.Compression.fp16 (values
    travel as float16); MXNet's own compression comes through
    set_gradient_compression. ``prefix`` starts every tensor name, so that stores
    used at the same time do not mix up their keys. Needs ``hvd.init()``
    first. ``mx.kv.create('dist_sync_hvdmx')`` makes one with the defaults.

    ``op=hvd.Adasum`` combines the ranks' values by Adasum
    (docs/collectives.md) instead of summing them, multiplied by
    ``hvd.size()`` so that the Trainer's and Module's division by the whole
    job's batch (see above) leaves the Adasum of the ranks' mean gradients:
    the learning rate is then the one of a single rank (docs/training.md).
    It takes Compression.none or Compression.fp16, and no
    set_gradient_compression.
    """

    def __init__(self, compression: Type[Compressor] = Compression.none,
                 prefix: Optional[str] = None, op: int = Average) -> None:
        if not (callable(getattr(compression, "compress", None))
                and callable(getattr(compression, "decompress", None))):
            raise TypeError("hvdmx.KVStore: argument 'compression' must be "
                            "hvd.Compression.none, hvd.Compression.fp16 or another object "
                            f"with compress() and decompress(), got {compression!r}")
        if prefix is not None and not isinstance(prefix, str):
            raise TypeError("hvdmx.KVStore: argument 'prefix' must be a str or None, got "
                            f"{type(prefix).__name__}")
        size()  # raises a clear error before init()
        self._op = _check_training_op("KVStore", op, 1.0, global_process_set, compression)
        self._compression = compression
        self._prefix = prefix if prefix else ""
        # set_gradient_compression's (type, threshold), and its residuals by
        # key (a Trainer's keys are its parameters' indices)
        self._gradient_compression: Optional[Tuple[str, float]] = None
        self._residuals: Dict[Any, mx.nd.NDArray] = {}

    def __repr__(self) -> str:
        compression = getattr(self._compression, "__name__", repr(self._compression))
        op = ", op=hvd.Adasum" if self._op == Adasum else ""
        return f"hvdmx.KVStore(compression={compression}, prefix={self._prefix!r}{op})"

    # --- what the job looks like ----------------------------------------

    @property
    def type(self) -> str:
        """'dist_sync_hvdmx': synchronous and distributed, so that Module
        scales its gradients by the whole job's batch."""
        return _TYPE

    @property
    def rank(self) -> int:
        return rank()

    @property
    def num_workers(self) -> int:
        return size()

    @staticmethod
    def is_capable(capability: str) -> bool:
        """False for 'optimizer': the optimizer runs in the Trainer or Module."""
        if isinstance(capability, str) and capability.lower() == KVStoreBase.OPTIMIZER:
            return False
        raise ValueError(f"hvdmx.KVStore.is_capable: unknown capability {capability!r}; the "
                         f"one MXNet asks about is '{KVStoreBase.OPTIMIZER}'")

    # --- the collectives ------------------------------------------------

    def broadcast(self, key: Keys, value: Values,
                  out: Values, priority: int = 0) -> None:
        """Writes rank 0's ``value`` to ``out`` (an NDArray or a list, one per
        device) on every rank. Returns at once; reads of ``out`` wait."""
        priority = _check_priority("broadcast", priority)
        if isinstance(key, (list, tuple)):
            raise TypeError("hvdmx.KVStore.broadcast: argument 'key' must be one int or str, "
                            f"got a {type(key).__name__}")
        if out is None:
            raise TypeError("hvdmx.KVStore.broadcast: argument 'out' must be an NDArray or a "
                            "list of NDArrays (pass [value] to broadcast into 'value' itself)")
        ((key, values, outs),) = _entries("broadcast", key, value, out)
        if len(values) != 1:
            raise InvalidArgumentError("hvdmx.KVStore.broadcast: argument 'value' must be one "
                                       f"NDArray, got a list of {len(values)}")
        source = values[0]
        name = f"{self._prefix}kvstore.broadcast.{key}"
        assert outs is not None  # 'out' was given
        handles = {o.handle.value for o in outs}
        if source.handle.value in handles:
            broadcast_(_plain_layout(source), 0, name=name, priority=priority)
        else:
            # Root's value travels in a copy: 'value' itself is only read.
            copy = _plain_layout(source.copy())
            broadcast_(copy, 0, name=name, priority=priority)
            source = copy
        for o in outs:
            if o.handle.value != source.handle.value:
                source.copyto(o)

    def pushpull(self, key: Keys, value: Values,
                 out: Optional[Values] = None, priority: int = 0) -> None:
        """Sums ``value`` (an NDArray or a list of them, one per device) over
        the list and over all ranks, and writes the sum to ``out``, or back
        to every array of ``value`` when ``out`` is None. ``key`` may be a
        list of keys, with a list of values (and outs) to match. Returns at
        once; reads of the results wait."""
        priority = _check_priority("pushpull", priority)
        for k, values, outs in _entries("pushpull", key, value, out):
            self._pushpull_one(k, f"{self._prefix}kvstore.pushpull.{k}", values, outs, priority)

    def _pushpull_one(self, key, name: str, values: List[mx.nd.NDArray],
                      outs: Optional[List[mx.nd.NDArray]], priority: int) -> None:
        if self._gradient_compression is not None:
            self._pushpull_quantized(key, name, values, outs)
            return
        in_place = outs is None
        total = values[0] if in_place or len(values) == 1 else values[0].copy()
        for other in values[1:]:
            total += other.as_in_context(total.context)
        sent, ctx = self._compression.compress(total)
        # Adasum's result is one gradient's size: times size() for the
        # division by the whole job's batch (see the class doc).
        op, post = (Adasum, float(size())) if self._op == Adasum else (Sum, 1.0)
        if outs is None:  # in place
            allreduce_(sent, op=op, name=name, priority=priority, postscale_factor=post)
            if sent is not total:
                self._compression.decompress(sent, ctx).copyto(total)
            targets = values[1:]
        else:
            # 'value' is only read: the sum goes to a new array, then to 'out'.
            total = self._compression.decompress(
                allreduce(sent, op=op, name=name, priority=priority, postscale_factor=post), ctx)
            targets = outs
        for t in targets:
            if t.handle.value != total.handle.value:
                total.copyto(t)

    def init(self, key: Keys, value: Values) -> None:
        """Does nothing: there is no store to fill. (Module calls it with its
        initial parameters; give every rank the same ones with
        hvd.broadcast_parameters.)"""
        _entries("init", key, value, None)

    # --- what an allreduce store does not do ------------------------------

    def push(self, key: Keys, value: Values, priority: int = 0) -> None:
        _no_push_pull("push")

    def pull(self, key: Keys, out: Optional[Values] = None, priority: int = 0,
             ignore_sparse: bool = True) -> None:
        _no_push_pull("pull")

    def row_sparse_pull(self, key: Keys, out: Optional[Values] = None, priority: int = 0,
                        row_ids: Any = None) -> None:
        _no_push_pull("row_sparse_pull")

    def set_optimizer(self, optimizer: mx.optimizer.Optimizer) -> None:
        raise NotImplementedError(
            "hvdmx.KVStore keeps no optimizer (is_capable('optimizer') is False): the "
            "optimizer runs on every rank in the Trainer or Module; create the Trainer with "
            "update_on_kvstore=None or False")

    def _pushpull_quantized(self, key, name: str, values: List[mx.nd.NDArray],
                            outs: Optional[List[mx.nd.NDArray]]) -> None:
        """pushpull under set_gradient_compression: this rank's sum over its
        devices is quantized with its residual for the key, the codes are
        allgathered, and every rank adds up every rank's values in rank
        order (csrc/hvdmx/algorithms/twobit.h, onebit.h)."""
        assert self._gradient_compression is not None  # the caller's condition
        kind, threshold = self._gradient_compression
        for i, v in enumerate(values):
            _check_quantizable(f"hvdmx.KVStore.pushpull: gradient compression '{kind}' needs "
                               "float32 values", f"value[{i}] of '{name}'", v)
        total = values[0] if outs is None else values[0].copy()
        for other in values[1:]:
            total += other.as_in_context(total.context)
        if kind == "2bit":
            _exchange_with_residual("twobit", self._residuals, key, total, name,
                                    global_process_set, threshold)
        else:
            _exchange_with_residual("onebit", self._residuals, key, total, name,
                                    global_process_set)
        for t in (values[1:] if outs is None else outs):
            if t.handle.value != total.handle.value:
                total.copyto(t)

    def set_gradient_compression(self, compression_params: Dict[str, Any]) -> None:
        """MXNet's gradient compression: ``{'type': '2bit', 'threshold': t}``
        (t > 0, default 0.5) with MXNet's semantics (values beyond +-t travel
        as +-t, the rest waits in a residual; 16x fewer bytes), or
        ``{'type': '1bit'}``, hvdmx's Compression.onebit (signs and two levels
        per 256 values, with error feedback; 25x fewer). ``gluon.Trainer(...,
        kvstore=hvd.KVStore(), compression_params=...)`` calls it, so scripts
        written for ``dist_sync`` with ``--gc-type 2bit`` run unchanged. Values
        must be float32 on the CPU."""
        fn = "hvdmx.KVStore.set_gradient_compression"
        if not isinstance(compression_params, dict):
            raise TypeError(f"{fn}: argument 'compression_params' must be a dict such as "
                            f"{{'type': '2bit', 'threshold': 0.5}}, got {compression_params!r}")
        params = dict(compression_params)
        kind = params.pop("type", None)
        if kind not in ("2bit", "1bit"):
            raise ValueError(f"{fn}: compression_params['type']={kind!r} is not supported; use "
                             "'2bit' (MXNet's, with a 'threshold') or '1bit' (hvdmx's "
                             "Compression.onebit)")
        if self._op == Adasum:
            raise ValueError(f"{fn}: compression_params['type']={kind!r} sums quantized "
                             "values and cannot take this store's op=hvd.Adasum; use "
                             "hvd.KVStore(op=hvd.Adasum, compression=hvd.Compression.fp16) "
                             "without compression_params, or op=hvd.Average")
        if self._compression is not Compression.none:
            raise ValueError(f"{fn}: this store was created with compression="
                             f"{getattr(self._compression, '__name__', self._compression)}; use "
                             "one compression: hvd.KVStore() with compression_params, or "
                             "hvd.KVStore(compression=...) without")
        threshold = 0.0
        if kind == "2bit":
            threshold = params.pop("threshold", 0.5)
            if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) \
                    or not math.isfinite(threshold) or threshold <= 0:
                raise ValueError(f"{fn}: compression_params['threshold']={threshold!r} must be "
                                 "a finite number > 0 (MXNet's default is 0.5)")
        elif "threshold" in params:
            raise ValueError(f"{fn}: compression_params['threshold'] does not apply to '1bit', "
                             "which sends every value as one of two levels per 256 values; "
                             "leave it out")
        if params:
            raise ValueError(f"{fn}: unknown compression_params {sorted(params)}; give 'type' "
                             "and, for '2bit', 'threshold'")
        self._gradient_compression = (kind, float(threshold))
        self._residuals = {}

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        raise NotImplementedError(
            "hvdmx.KVStore keeps no optimizer states: they live in the Trainer (or Module) on "
            "every rank; save them with hvd.save_checkpoint(path, net, trainer) or "
            "trainer.save_states(fname)")

    def load_optimizer_states(self, fname: str) -> None:
        raise NotImplementedError(
            "hvdmx.KVStore keeps no optimizer states: they live in the Trainer (or Module) on "
            "every rank; load them with hvd.load_checkpoint(path, net, trainer) or "
            "trainer.load_states(fname)")


# mx.kv.create(name) looks the name up in KVStoreBase's registry, whose key is the
# registered class's lowercased __name__; this subclass exists to carry the name.
# The name has 'dist' in it because gluon.Trainer (MXNet 1.9.1's _create_kvstore)
# silently drops a store given by a name without 'dist' when the trainer has one
# device, which would leave every rank training on its own.
KVStoreBase.register(type(_TYPE, (KVStore,), {
    "__module__": __name__,
    "__doc__": "hvdmx.KVStore with its defaults, as mx.kv.create('dist_sync_hvdmx') makes it.",
}))
