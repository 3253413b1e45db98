"""Training integration: DistributedOptimizer (Module API) and
broadcast_parameters, with ``horovod.mxnet``'s names, arguments and
averaging, and the gradient reduction that DistributedTrainer (Gluon,
hvdmx/trainer.py) shares.

Gradients are reduced in place with asynchronous allreduces through MXNet's
engine, so the optimizer update that reads a gradient waits for its
allreduce and nothing here blocks the Python thread (apart from a one-time
check of the parameters on a trainer's first step).

Tensor names are derived from parameter positions, which are the same on
every rank because parameters are sorted by name:
- DistributedTrainer: ``prefix + str(index)``; a group ``"{first}:{last}"``.
- DistributedOptimizer: ``"DistributedOptimizer." + str(index)``.
- broadcast_parameters: ``prefix + str(key)``.
"""
from __future__ import annotations

import numbers
import types
import warnings
from typing import Any, Dict, List, Optional, Sequence, Type, Union

import mxnet as mx
import numpy as np
from mxnet.gluon.parameter import DeferredInitializationError, Parameter, ParameterDict

from hvdmx import _core
from hvdmx.compression import Compression, Compressor, _check_quantizable, _exchange_with_residual
from hvdmx.process_sets import ProcessSet, _check_registered, _set_for_call, global_process_set
from hvdmx.errors import InvalidArgumentError
from hvdmx.ops import Adasum, Average, Sum, _allreduce_each_, _check_root, broadcast_, \
    grouped_allreduce_

__all__ = ["DistributedOptimizer", "broadcast_parameters"]


def _split_list(items: Sequence, n: int) -> List[list]:
    """Splits ``items`` into ``n`` contiguous parts whose lengths differ by at
    most one (Horovod's split_list); parts are empty when n > len(items)."""
    d, r = divmod(len(items), n)
    return [list(items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)]) for i in range(n)]


def _check_predivide(fn: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not np.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"hvdmx.{fn}: argument 'gradient_predivide_factor'={value!r} must be "
                         "a finite number > 0 (1.0 averages after the sum)")
    return float(value)


def _check_num_groups(fn: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"hvdmx.{fn}: argument 'num_groups'={value!r} must be an int >= 0 "
                         "(0: one allreduce per gradient)")
    return int(value)


def _check_training_op(fn: str, op, predivide: float, process_set, compression) -> int:
    """``op`` of a trainer, optimizer or store: hvd.Average (gradients
    averaged) or hvd.Adasum (combined by Adasum, applied at the one-rank
    learning rate), with what Adasum refuses named at the call."""
    if isinstance(op, bool) or op not in (Average, Adasum):
        raise InvalidArgumentError(f"hvdmx.{fn}: argument 'op'={op!r} is not supported; use "
                                   "hvd.Average (the default) or hvd.Adasum")
    if op != Adasum:
        return op
    if predivide != 1.0:
        raise InvalidArgumentError(f"hvdmx.{fn}: argument 'gradient_predivide_factor'="
                                   f"{predivide!r} does not apply to op=hvd.Adasum (as in "
                                   "Horovod); leave it at 1.0")
    if process_set is not global_process_set:
        raise InvalidArgumentError(f"hvdmx.{fn}: op=hvd.Adasum combines over all ranks, and "
                                   f"process_set={process_set.process_set_id} is not the global "
                                   "set; leave 'process_set' at hvd.global_process_set, or use "
                                   "op=hvd.Average")
    if compression is Compression.onebit:
        raise InvalidArgumentError(f"hvdmx.{fn}: compression=hvd.Compression.onebit sums "
                                   "quantized gradients and cannot take op=hvd.Adasum; use "
                                   "hvd.Compression.none or hvd.Compression.fp16")
    return op


def _outside(process_set) -> bool:
    """True on a rank that is not in ``process_set`` (never for the global set)."""
    return process_set is not global_process_set and not process_set.included()


def _reduce_by_dtype(tensors: List[mx.nd.NDArray], names: List[str], priority: int,
                     prescale: float, postscale: float, process_set, op: int = Sum) -> None:
    """One grouped in-place ``op`` per dtype present in ``tensors`` (a group
    is one unit for the core, which wants a single dtype)."""
    by_dtype: Dict[np.dtype, List[int]] = {}
    for k, t in enumerate(tensors):
        by_dtype.setdefault(np.dtype(t.dtype), []).append(k)
    for ks in by_dtype.values():
        grouped_allreduce_([tensors[k] for k in ks], op=op,
                           name=f"{names[ks[0]]}:{names[ks[-1]]}", priority=priority,
                           prescale_factor=prescale, postscale_factor=postscale,
                           process_set=process_set)


def _onebit_exchange(who: str, residuals: Dict[Any, mx.nd.NDArray], keys: list, labels: list,
                     grads: List[mx.nd.NDArray], names: List[str], prescale: float,
                     process_set) -> None:
    """Compression.onebit's exchange of each of ``grads`` in place (the sum
    over the ranks of what each sends), with this rank's residual for its
    key, made at the first call; ``prescale`` multiplies the gradients
    first. Checks every gradient before it exchanges any."""
    for grad, label in zip(grads, labels):
        _check_quantizable(f"hvdmx.{who}: compression=hvd.Compression.onebit needs float32 "
                           "gradients", f"the gradient of '{label}'", grad,
                           "; use Compression.none or Compression.fp16 for it")
    for grad, key, name in zip(grads, keys, names):
        if prescale != 1.0:
            grad *= prescale
        _exchange_with_residual("onebit", residuals, key, grad, name, process_set)


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wraps an optimizer so that every gradient is averaged over all ranks
    before the wrapped optimizer's update (Module API; for Gluon use
    DistributedTrainer).

    The average is an in-place Sum allreduce with ``prescale_factor=1/f``
    and ``postscale_factor=f/size()`` (f = ``gradient_predivide_factor``),
    so after the update each gradient holds the average and ``rescale_grad``
    is left as the caller set it. (Horovod multiplies ``rescale_grad`` by
    f/size instead and leaves the sum in the gradient; the update is the same.)
    With ``num_groups`` > 0 the gradients of one update call are reduced in
    that many grouped allreduces. With ``process_set``, gradients are
    averaged over that set's ranks only. On a rank outside the set nothing
    is sent, as in Horovod (whose update reduces only where
    ``process_set.included()``): the wrapped optimizer applies this rank's
    own gradient, scaled by ``gradient_predivide_factor /
    process_set.size()`` as Horovod's ``rescale_grad`` scales it there.
    ``compression`` (hvdmx's own argument) is Compression.none or
    Compression.onebit, whose residuals this object keeps by parameter index.
    ``op=hvd.Adasum`` (hvdmx's own argument too; Horovod's MXNet binding has
    no Adasum) combines the gradients by Adasum instead of averaging them:
    each holds the Adasum of the ranks' gradients, to be applied at the
    learning rate of one rank (docs/training.md); it takes the global
    process set and Compression.none only, and gradient_predivide_factor 1.

    Attributes and the Optimizer methods (``rescale_grad``, ``idx2name``,
    ``aggregate_num``, ``lr``, ``set_learning_rate``, ``set_lr_mult``,
    ``set_wd_mult``, ``create_state*``, ...) are read from and written to the
    wrapped optimizer.
    """

    _OWN = frozenset({"_optimizer", "_gradient_predivide_factor", "_num_groups", "_process_set",
                      "_compression", "_residuals", "_op"})
    _NAME_PREFIX = "DistributedOptimizer."

    def __init__(self, optimizer: mx.optimizer.Optimizer, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, process_set: ProcessSet = global_process_set,
                 compression: Type[Compressor] = Compression.none,
                 op: int = Average) -> None:
        # Optimizer.__init__ is not called on purpose: this object keeps no
        # optimizer state of its own, everything lives in the wrapped one.
        if isinstance(optimizer, DistributedOptimizer):
            warnings.warn("hvdmx.DistributedOptimizer: the optimizer is already a "
                          "DistributedOptimizer; wrapping it again would reduce every "
                          "gradient twice, so its inner optimizer is used", stacklevel=2)
            optimizer = optimizer._optimizer
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise TypeError("hvdmx.DistributedOptimizer: argument 'optimizer' must be an "
                            f"mxnet.optimizer.Optimizer, got {type(optimizer).__name__}; "
                            "create one with mx.optimizer.create('sgd', ...)")
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_gradient_predivide_factor", _check_predivide(
            "DistributedOptimizer", gradient_predivide_factor))
        object.__setattr__(self, "_num_groups", _check_num_groups(
            "DistributedOptimizer", num_groups))
        _check_registered("DistributedOptimizer", process_set)  # this rank may be outside it
        object.__setattr__(self, "_process_set", process_set)
        if compression is not Compression.none and compression is not Compression.onebit:
            raise ValueError("hvdmx.DistributedOptimizer: argument 'compression'="
                             f"{compression!r} is not supported; use hvd.Compression.none or "
                             "hvd.Compression.onebit")
        if compression is Compression.onebit and num_groups:
            raise ValueError("hvdmx.DistributedOptimizer: compression=hvd.Compression.onebit "
                             "exchanges each gradient on its own; leave 'num_groups' at 0")
        object.__setattr__(self, "_compression", compression)
        object.__setattr__(self, "_residuals", {})
        object.__setattr__(self, "_op", _check_training_op(
            "DistributedOptimizer", op, self._gradient_predivide_factor, process_set,
            compression))

    # Attribute forwarding. Reads of anything not defined here, and every
    # write except to the fields above, go to the wrapped optimizer, so
    # Module's `optimizer.idx2name = ...` and Trainer's
    # `optimizer.rescale_grad = ...` reach the optimizer that uses them.
    def __getattr__(self, item):
        if item in DistributedOptimizer._OWN or (item.startswith("__") and item.endswith("__")):
            raise AttributeError(item)
        return getattr(self._optimizer, item)

    def __setattr__(self, key, value):
        if key in DistributedOptimizer._OWN:
            object.__setattr__(self, key, value)
        else:
            setattr(self._optimizer, key, value)

    def __delattr__(self, key):
        if key in DistributedOptimizer._OWN:
            object.__delattr__(self, key)
        else:
            delattr(self._optimizer, key)

    def __getstate__(self):
        return {k: self.__dict__[k] for k in DistributedOptimizer._OWN}

    def __setstate__(self, state):
        for k, v in state.items():
            object.__setattr__(self, k, v)

    def __repr__(self):
        op = ", op=hvd.Adasum" if getattr(self, "_op", Average) == Adasum else ""
        return (f"hvdmx.DistributedOptimizer({self._optimizer!r}, gradient_predivide_factor="
                f"{self._gradient_predivide_factor}, num_groups={self._num_groups}{op})")

    def _allreduce_grads(self, index, grad) -> None:
        n = self._process_set.size()
        outside = _outside(self._process_set)
        if n == 1 and not outside:
            return
        f = self._gradient_predivide_factor
        pre, post = 1.0 / f, f / n
        op = getattr(self, "_op", Average)  # a pickle from before op existed has none
        if op == Adasum:
            pre, post = 1.0, 1.0
        if isinstance(index, (list, tuple)):
            indices, grads = list(index), list(grad)
        else:
            indices, grads = [index], [grad]
        if outside:
            for g in grads:
                g *= post
            return
        names = [f"{self._NAME_PREFIX}{i}" for i in indices]
        if self._compression is Compression.onebit:
            labels = [self._optimizer.idx2name.get(i, str(i)) for i in indices]
            _onebit_exchange("DistributedOptimizer", self._residuals, indices, labels, grads,
                             [f"{name}.onebit" for name in names], pre, self._process_set)
            for g in grads:
                g *= post
            return
        if self._num_groups > 0 and len(indices) > 1:
            positions = _split_list(range(len(indices)), self._num_groups)
            for g, group in enumerate(positions):
                if group:
                    _reduce_by_dtype([grads[k] for k in group], [names[k] for k in group],
                                     -g, pre, post, self._process_set,
                                     Adasum if op == Adasum else Sum)
            return
        priorities = [int(-i if isinstance(i, numbers.Integral) else -k)
                      for k, i in enumerate(indices)]
        _allreduce_each_(grads, names, priorities, Adasum if op == Adasum else Sum, pre, post,
                         self._process_set)

    def update(self, index: Any, weight: mx.nd.NDArray, grad: mx.nd.NDArray,
               state: Any) -> None:
        self._allreduce_grads(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index: Any, weight: mx.nd.NDArray, grad: mx.nd.NDArray,
                               state: Any) -> None:
        self._allreduce_grads(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    # Explicit forwards of Optimizer's methods, so that the wrapped optimizer's
    # own versions run (LARS overrides _get_lrs and set_wd_mult, for instance).
    @property
    def learning_rate(self):
        return self._optimizer.learning_rate

    def create_state(self, index: Any, weight: mx.nd.NDArray) -> Any:
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index: Any, weight: mx.nd.NDArray) -> Any:
        return self._optimizer.create_state_multi_precision(index, weight)

    def set_learning_rate(self, lr: float) -> None:
        self._optimizer.set_learning_rate(lr)

    def set_lr_scale(self, args_lrscale: Dict[Any, float]) -> None:
        self._optimizer.set_lr_scale(args_lrscale)

    def set_lr_mult(self, args_lr_mult: Dict[Any, float]) -> None:
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: Dict[Any, float]) -> None:
        self._optimizer.set_wd_mult(args_wd_mult)

    def _set_current_context(self, device_id):
        self._optimizer._set_current_context(device_id)

    def _update_count(self, index):
        self._optimizer._update_count(index)

    def _get_lrs(self, indices):
        return self._optimizer._get_lrs(indices)

    def _get_lr(self, index):
        return self._optimizer._get_lr(index)

    def _get_wds(self, indices):
        return self._optimizer._get_wds(indices)

    def _get_wd(self, index):
        return self._optimizer._get_wd(index)


# --- the one-time check that every rank trains the same parameters ---------

# --- broadcast_parameters ----------------------------------------------------

def _plain_layout(array: mx.nd.NDArray) -> mx.nd.NDArray:
    """Waits for ``array`` and converts it in place if oneDNN holds it in its
    internal layout (a conv weight after an inference-mode forward), which a
    collective refuses; see Note [oneDNN layout] in csrc/hvdmx/mxnet/mxnet_engine.h.
    Waiting first matters: probing an array still being computed races its
    allocation. And it waits for the pending reads as well as the writes:
    an inference-mode forward still queued is a read that converts the
    weight to oneDNN's layout when it runs, after the probe (seen at
    broadcast_parameters right after net(x), examples/mnist_gluon.py's net)."""
    if array.context.device_typeid != 2:
        mx.base.check_call(mx.base._LIB.MXNDArrayWaitToWrite(array.handle))
        _core.ensure_default_layout(array.handle.value)
    return array


def _broadcast_arrays(arrays: List[mx.nd.NDArray], root_rank: int, name: str,
                      process_set) -> None:
    """Broadcasts the first array in place and copies it to the others (a
    parameter's copies on this rank's other contexts)."""
    broadcast_(_plain_layout(arrays[0]), root_rank, name=name, process_set=process_set)
    for other in arrays[1:]:
        arrays[0].copyto(other)


def _broadcast_after_init(param: Parameter, root_rank: int, name: str, process_set) -> None:
    """Makes ``param`` broadcast itself right after its deferred
    initialization. The hook is on ``_init_impl`` (which both
    ``_finish_deferred_init`` and a load into a deferred parameter call, as in
    Horovod), fires once and then removes itself; calling this again before
    the initialization only updates the root and name."""
    pending = "_hvdmx_broadcast_after_init"
    had_pending = pending in param.__dict__
    param.__dict__[pending] = (root_rank, name, process_set)
    if had_pending:
        return
    own = param.__dict__.get("_init_impl")  # an instance-level override to keep
    original = param._init_impl

    def init_then_broadcast(self, *args, **kwargs):
        original(*args, **kwargs)
        root, tensor_name, tensor_set = self.__dict__.pop(pending)
        if own is None:
            del self.__dict__["_init_impl"]
        else:
            self.__dict__["_init_impl"] = own
        _broadcast_arrays(self.list_data(), root, tensor_name, tensor_set)

    param.__dict__["_init_impl"] = types.MethodType(init_then_broadcast, param)


def _sorted_items(params: Dict) -> list:
    try:
        return sorted(params.items(), key=lambda kv: kv[0])
    except TypeError:  # keys of different types
        return sorted(params.items(), key=lambda kv: (type(kv[0]).__name__, str(kv[0])))


def broadcast_parameters(params: Union[ParameterDict, Dict[Any, Union[Parameter, mx.nd.NDArray]]],
                         root_rank: int = 0, prefix: Optional[str] = None,
                         process_set: ProcessSet = global_process_set) -> None:
    """Sets every rank's parameters to ``root_rank``'s, in place (every rank
    of ``process_set``; ``root_rank`` is a rank of the whole job).

    ``params`` is a ParameterDict (``net.collect_params()``) or a dict whose
    values are Parameters or NDArrays (keys of any type, e.g. the arg_params
    of the Module API). Entries go in sorted-key order, each as tensor
    ``prefix + str(key)``. A parameter whose initialization is deferred
    (shape still unknown) is broadcast right after it gets initialized, at
    the first forward pass. Returns at once; reads of the parameters wait.
    """
    if prefix is not None and not isinstance(prefix, str):
        raise ValueError("hvdmx.broadcast_parameters: argument 'prefix' must be a str or "
                         f"None, got {type(prefix).__name__}")
    _, set_ranks, _ = _set_for_call("broadcast_parameters", process_set)
    _check_root("broadcast_parameters", root_rank, set_ranks)
    root = int(root_rank)
    prefix = prefix if prefix else ""
    if isinstance(params, ParameterDict):
        items = sorted(params.items())
    elif isinstance(params, dict):
        items = _sorted_items(params)
    else:
        raise TypeError("hvdmx.broadcast_parameters: argument 'params' must be a "
                        "ParameterDict (net.collect_params()) or a dict of Parameters or "
                        f"NDArrays, got {type(params).__name__}")
    for key, value in items:
        if not isinstance(value, (Parameter, mx.nd.NDArray)):
            raise TypeError(f"hvdmx.broadcast_parameters: params[{key!r}] must be a Parameter "
                            f"or an NDArray, got {type(value).__name__}")
    for key, value in items:
        name = prefix + str(key)
        if isinstance(value, mx.nd.NDArray):
            broadcast_(_plain_layout(value), root, name=name, process_set=process_set)
            continue
        try:
            arrays = value.list_data()
        except DeferredInitializationError:
            _broadcast_after_init(value, root, name, process_set)
            continue
        _broadcast_arrays(arrays, root, name, process_set)
