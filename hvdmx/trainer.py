"""DistributedTrainer: a gluon.Trainer that averages gradients over the
ranks, with ``horovod.mxnet``'s names, arguments and averaging (see
hvdmx/optimizer.py for how gradients are reduced and named).

Tensor names: ``prefix + str(index)`` for a gradient, ``"{first}:{last}"``
for a group.
"""
from __future__ import annotations

import hashlib
import numbers
import warnings
from typing import Any, Dict, List, Optional, Sequence, Type, Union

import mxnet as mx
import numpy as np
from mxnet.gluon.parameter import Parameter, ParameterDict

from hvdmx.basics import size
from hvdmx.compression import Compression, Compressor
from hvdmx.errors import MismatchError
from hvdmx.ops import Adasum, Average, Max, Sum, _allreduce_each_, allreduce, broadcast_
from hvdmx.optimizer import DistributedOptimizer, _check_num_groups, _check_predivide, \
    _check_training_op, _onebit_exchange, _outside, _reduce_by_dtype, _split_list
from hvdmx.process_sets import ProcessSet, _check_registered, _host_process_set, \
    global_process_set

__all__ = ["DistributedTrainer"]


_DESC_BYTES = 160  # bytes of one rank's description of a parameter in the error


def _stable_hash(text: str) -> int:
    """A 48-bit hash that is the same in every process (unlike hash())."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=6).digest(), "little")


def _describe(param: Parameter) -> str:
    null = " grad_req='null'" if param.grad_req == "null" else ""
    return f"'{param.name}' shape {tuple(param.shape)} {np.dtype(param.dtype).name}{null}"


def _min_max(values: np.ndarray, name: str, process_set):
    """Elementwise (min, max) of an int64 vector over the set's ranks, in one allreduce."""
    both = mx.nd.array(np.concatenate([values, -values]), dtype="int64")
    out = allreduce(both, op=Max, name=name, process_set=process_set).asnumpy()
    n = len(values)
    return -out[n:], out[:n]


def _gather_text(text: str, name: str, process_set) -> List[str]:
    """Every rank's ``text`` (cut to _DESC_BYTES bytes), via one uint8 Sum."""
    rows = np.zeros((process_set.size(), _DESC_BYTES), dtype=np.uint8)
    raw = text.encode()[:_DESC_BYTES]
    rows[process_set.rank(), :len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    out = allreduce(mx.nd.array(rows, dtype="uint8"), op=Sum, name=name,
                    process_set=process_set).asnumpy()
    return [bytes(r).rstrip(b"\0").decode(errors="replace") for r in out]


def _check_same_parameters(params: Sequence[Parameter], name: str, who: str,
                           process_set) -> None:
    """Raises MismatchError on every rank when the ranks' parameter lists differ
    in count, shape, dtype or grad_req='null' at some position (the position
    names the gradient, so a mismatch would pair unrelated gradients or hang);
    warns when only the names differ. Costs one 6-element allreduce when all
    agree; only collective calls that every rank makes (no hang)."""
    structure = [_stable_hash(f"{tuple(p.shape)}|{np.dtype(p.dtype).name}|{p.grad_req == 'null'}")
                 for p in params]
    names = [_stable_hash(p.name) for p in params]
    summary = np.array([len(params), _stable_hash(repr(structure)), _stable_hash(repr(names))],
                       dtype=np.int64)
    lo, hi = _min_max(summary, name, process_set)
    if np.array_equal(lo, hi):
        return
    by_structure = lo[0] != hi[0] or lo[1] != hi[1]
    longest = int(hi[0])
    per_param = np.full(longest, -1, dtype=np.int64)  # -1: no parameter at this position
    per_param[:len(params)] = structure if by_structure else names
    lo, hi = _min_max(per_param, f"{name}.position", process_set)
    first = int(np.flatnonzero(lo != hi)[0])
    mine = _describe(params[first]) if first < len(params) else "no parameter"
    seen = _gather_text(f"{len(params)} parameters; #{first}: {mine}", f"{name}.describe",
                        process_set)
    ranks = "; ".join(f"rank {r}: {s}" for r, s in zip(process_set.ranks, seen))
    message = (f"hvdmx.{who}: the parameters differ across ranks; the first "
               f"difference is at position {first} of the parameters sorted by name ({ranks})")
    if by_structure:
        raise MismatchError(message + ". Every rank must build the same model and pass the "
                            "same parameters, so that gradient i is the same tensor everywhere.")
    warnings.warn(message + ". Only the names differ (shapes and dtypes agree), so training "
                  "proceeds pairing parameters by position; names usually differ when one "
                  "rank creates extra blocks before the model.", stacklevel=4)



def _check_hierarchical(hierarchical, local_sgd_steps, process_set) -> None:
    if not isinstance(hierarchical, bool):
        raise ValueError("hvdmx.DistributedTrainer: argument 'hierarchical_local_sgd'="
                         f"{hierarchical!r} must be True or False")
    if hierarchical and local_sgd_steps == 1:
        raise ValueError("hvdmx.DistributedTrainer: hierarchical_local_sgd=True needs "
                         "local_sgd_steps > 1 (with 1, every step already averages over all "
                         "ranks); pass local_sgd_steps=H, the steps between averages across "
                         "hosts")
    if hierarchical and process_set is not global_process_set:
        raise ValueError("hvdmx.DistributedTrainer: hierarchical_local_sgd=True works on the "
                         f"whole job's hosts; leave 'process_set' at its default (got "
                         f"{process_set!r})")


def _check_easgd(beta, local_sgd_steps) -> None:
    if beta is None:
        return
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0 < float(beta) <= 1:
        raise ValueError(f"hvdmx.DistributedTrainer: argument 'easgd_beta'={beta!r} must be a "
                         "number in (0, 1] (how far the center moves toward the ranks' mean "
                         "at each synchronization; EASGD's paper suggests 0.9), or None")
    if local_sgd_steps == 1:
        raise ValueError("hvdmx.DistributedTrainer: easgd_beta needs local_sgd_steps > 1, the "
                         "steps between elastic averages; pass local_sgd_steps=H")


def _reject_kvstore_arguments(kwargs: Dict[str, Any]) -> None:
    kvstore = kwargs.pop("kvstore", None)
    if kvstore is not None:
        raise ValueError(f"hvdmx.DistributedTrainer: argument 'kvstore'={kvstore!r} is not "
                         "supported: DistributedTrainer averages gradients with hvdmx "
                         "allreduce and runs gluon.Trainer with kvstore=None underneath. Drop "
                         "the kvstore argument (or use a plain gluon.Trainer with an hvdmx "
                         "kvstore instead of DistributedTrainer).")
    if kwargs.pop("update_on_kvstore", None):
        raise ValueError("hvdmx.DistributedTrainer: update_on_kvstore=True is not supported; "
                         "parameters are updated locally on every rank after the allreduce")
    if kwargs.pop("compression_params", None) is not None:
        raise ValueError("hvdmx.DistributedTrainer: argument 'compression_params' is for "
                         "MXNet's kvstore; use compression=hvd.Compression.fp16 instead")
    if kwargs:
        raise TypeError("hvdmx.DistributedTrainer got unexpected keyword arguments "
                        f"{sorted(kwargs)}")


class DistributedTrainer(mx.gluon.Trainer):
    """A gluon.Trainer that averages gradients over all ranks with hvdmx.

    As in Horovod, ``_scale`` (the trainer's ``rescale_grad`` before division
    by the batch size) is multiplied by ``gradient_predivide_factor / size()``
    and gradients are reduced with Sum, prescaled by
    ``1 / gradient_predivide_factor``: ``step(batch_size)`` with the local
    batch size then applies the average over all ranks' samples.

    Parameters are sorted by name, gradient ``i`` travels as
    ``prefix + str(i)`` with priority ``-i``; ``num_groups`` > 0 reduces them
    in that many grouped allreduces. ``compression`` is Compression.none,
    Compression.fp16 or Compression.onebit (whose residuals the trainer
    keeps by parameter index). ``kvstore`` must not be given (it is None
    underneath).
    With ``process_set``, gradients are averaged over that set's ranks only
    (and ``_scale`` divided by its size). On a rank outside the set nothing
    is sent and ``step`` applies this rank's own gradients, scaled by
    ``_scale`` as everywhere, as Horovod's trainer does there.

    ``local_sgd_steps`` = H > 1 trains with local SGD (model averaging): no
    gradient is reduced; each rank updates its own parameters with its own
    gradients (``_scale`` keeps 1/batch_size of this rank's batch), and every
    H-th ``step``/``update`` ends by replacing every parameter with its
    average over the ranks (an Average allreduce, in place, named ``prefix +
    "localsgd." + str(i)``), bitwise identical on every rank afterwards.
    Optimizer state (momentum, Adam's moments) stays each rank's own; it is
    not averaged. H = 1 (the default) is ordinary synchronous training.

    ``hierarchical_local_sgd=True`` (with H > 1) is local SGD between hosts:
    every step averages the gradients over the ranks of this rank's host
    (named ``prefix + "host." + str(i)``), so each host trains as one
    synchronous worker with the same parameters and optimizer state on its
    ranks, and every H-th step averages the parameters over all ranks as
    above. Only the H-th step crosses the network between hosts. On one host
    it is synchronous training with a redundant average every H steps.

    ``easgd_beta`` = beta in (0, 1] (with H > 1) replaces the average by
    elastic averaging (synchronous EASGD, Zhang, Choromanska and LeCun 2015):
    the trainer keeps a center copy of the parameters, the same on every rank
    (rank 0's initial values, broadcast at the first step), and every H-th
    step each rank moves alpha = beta / size of the way toward the center
    while the center moves beta of the way toward the ranks' mean (one
    Average allreduce of each rank's distance to the center, named ``prefix
    + "easgd." + str(i)``). The ranks' parameters never become equal;
    ``average_parameters()`` sets every rank's to the center.

    ``op=hvd.Adasum`` (hvdmx's own argument; Horovod's MXNet binding has no
    Adasum) combines the gradients by Adasum (docs/collectives.md) instead
    of averaging them, and ``_scale`` is not divided by the number of ranks:
    train at the learning rate of one rank, with ``step`` given the local
    batch size (docs/training.md). It takes the global process set,
    Compression.none or Compression.fp16, ``gradient_predivide_factor`` 1
    and ``local_sgd_steps`` 1.
    """

    # Its own state (set in __init__), declared for type checkers: its base,
    # MXNet's Trainer, has no type hints.
    _local_sgd_steps: int
    _local_steps_done: int
    _hierarchical: bool
    _easgd_beta: Optional[float]
    _gradient_predivide_factor: float
    _prefix: str
    _num_groups: int
    _compression: Type[Compressor]
    _process_set: ProcessSet
    _hvdmx_checked: bool
    _op: int
    _unscaled: float
    _averaged: bool

    def __init__(self, params: Union[ParameterDict, Dict[str, Parameter], List[Parameter]],
                 optimizer: Union[str, mx.optimizer.Optimizer],
                 optimizer_params: Optional[Dict[str, Any]] = None,
                 compression: Type[Compressor] = Compression.none,
                 gradient_predivide_factor: float = 1.0,
                 prefix: Optional[str] = None, num_groups: int = 0,
                 process_set: ProcessSet = global_process_set, local_sgd_steps: int = 1,
                 hierarchical_local_sgd: bool = False, easgd_beta: Optional[float] = None,
                 op: int = Average, **kwargs: Any) -> None:
        _reject_kvstore_arguments(kwargs)
        if isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, numbers.Integral) \
                or local_sgd_steps < 1:
            raise ValueError("hvdmx.DistributedTrainer: argument 'local_sgd_steps'="
                             f"{local_sgd_steps!r} must be an int >= 1 (1: reduce gradients "
                             "every step; H > 1: average parameters every H steps)")
        _check_hierarchical(hierarchical_local_sgd, local_sgd_steps, process_set)
        _check_easgd(easgd_beta, local_sgd_steps)
        if isinstance(optimizer, DistributedOptimizer):
            warnings.warn("hvdmx.DistributedTrainer does not take a DistributedOptimizer as "
                          "its optimizer (gradients would be reduced twice); it has been "
                          "unwrapped for you", stacklevel=2)
            optimizer = optimizer._optimizer
        predivide = _check_predivide("DistributedTrainer", gradient_predivide_factor)
        if prefix is not None and not isinstance(prefix, str):
            raise ValueError("hvdmx.DistributedTrainer: argument 'prefix' must be a str or "
                             f"None, got {type(prefix).__name__}")
        num_groups = _check_num_groups("DistributedTrainer", num_groups)
        if not (callable(getattr(compression, "compress", None))
                and callable(getattr(compression, "decompress", None))):
            raise TypeError("hvdmx.DistributedTrainer: argument 'compression' must be "
                            "hvd.Compression.none, hvd.Compression.fp16 or another object "
                            f"with compress() and decompress(), got {compression!r}")
        size()  # raises a clear error before init()
        _check_registered("DistributedTrainer", process_set)  # this rank may be outside it
        op = _check_training_op("DistributedTrainer", op, predivide, process_set, compression)
        if op == Adasum and local_sgd_steps != 1:
            raise ValueError(f"hvdmx.DistributedTrainer: local_sgd_steps={local_sgd_steps} sends "
                             "no gradients, so op=hvd.Adasum does not apply; leave 'op' at "
                             "hvd.Average or local_sgd_steps at 1")
        n = process_set.size() if op != Adasum else 1
        if isinstance(params, (list, tuple)):
            # Sorted like the dict case (which gluon.Trainer sorts by key), so
            # that position i is the same parameter on every rank.
            params = sorted(params, key=lambda p: getattr(p, "name", ""))
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        self._unscaled = self._scale  # gluon's, before the division by the ranks below
        self._local_sgd_steps = int(local_sgd_steps)
        self._local_steps_done = 0
        self._hierarchical = hierarchical_local_sgd
        self._easgd_beta = None if easgd_beta is None else float(easgd_beta)
        self._center: Optional[List[mx.nd.NDArray]] = None  # EASGD's, by parameter index
        if self._local_sgd_steps > 1:
            if compression is not Compression.none or predivide != 1.0 or num_groups:
                raise ValueError("hvdmx.DistributedTrainer: local_sgd_steps="
                                 f"{local_sgd_steps} sends no gradients, so 'compression', "
                                 "'gradient_predivide_factor' and 'num_groups' do not apply; "
                                 "leave them at their defaults")
        else:
            self._scale *= predivide / n
        self._gradient_predivide_factor = predivide
        self._averaged = self._local_sgd_steps == 1 and op != Adasum  # _scale has 1/size
        self._prefix = prefix if prefix else ""
        self._num_groups = num_groups
        self._compression = compression
        self._residuals: Dict[int, mx.nd.NDArray] = {}  # Compression.onebit's, by index
        self._process_set = process_set
        self._hvdmx_checked = False
        self._op = op

    def _elastic_reset(self) -> None:
        """After hvd.elastic reset hvdmx over a new membership (the job's size
        may have changed): ``_scale`` divides by the new number of ranks, the
        ranks check their parameters again at the next collective (together,
        newcomers included). EASGD's center is kept: hvd.elastic's states
        restore and sync it (rank 0's reaches a worker that joins)."""
        if self._averaged:
            # As __init__ computes it, to the bit.
            self._scale = self._unscaled * (self._gradient_predivide_factor /
                                            self._process_set.size())
        self._hvdmx_checked = False

    def step(self, batch_size: int, ignore_stale_grad: bool = False) -> None:
        super().step(batch_size, ignore_stale_grad)
        self._after_update()

    def update(self, batch_size: int, ignore_stale_grad: bool = False) -> None:
        super().update(batch_size, ignore_stale_grad)
        self._after_update()

    def _after_update(self) -> None:
        """Local SGD: every local_sgd_steps-th update, average the parameters
        (or, with easgd_beta, the elastic step)."""
        if self._local_sgd_steps == 1:
            return
        self._local_steps_done += 1
        if self._local_steps_done % self._local_sgd_steps != 0:
            return
        if self._easgd_beta is None:
            self.average_parameters()
        else:
            self._elastic_step()

    def average_parameters(self) -> None:
        """Replaces every parameter with its average over the process set's
        ranks, in place and asynchronously (local SGD does this every
        ``local_sgd_steps`` steps; call it yourself to synchronize at other
        times, e.g. before evaluating). With ``easgd_beta``, once the center
        exists (from the first step on), every rank's parameters are set to
        the center instead. Every rank must call it together."""
        entries = [(i, p) for i, p in enumerate(self._params)]
        if self._center is not None:
            for (_, p), center in zip(entries, self._center):
                for data in p.list_data():
                    center.copyto(data)
            return
        if self._process_set.size() == 1 or not entries or _outside(self._process_set):
            return
        self._check_parameters()
        datas = [p.list_data() for _, p in entries]
        _allreduce_each_([d[0] for d in datas], [f"{self._prefix}localsgd.{i}" for i, _ in entries],
                         [-i for i, _ in entries], Average, 1.0, 1.0, self._process_set)
        for copies in datas:
            for other in copies[1:]:
                copies[0].copyto(other)

    def _ensure_center(self) -> None:
        """EASGD: the center starts as rank 0's parameters (of the set), on
        every rank of the set; collective the first time."""
        if self._easgd_beta is None or self._center is not None \
                or _outside(self._process_set):
            return
        self._check_parameters()
        root = self._process_set.ranks[0]
        self._center = [broadcast_(p.list_data()[0].copy(), root,
                                   name=f"{self._prefix}easgd.center.{i}", priority=-i)
                        for i, p in enumerate(self._params)]

    def _elastic_step(self) -> None:
        """EASGD's synchronization (see the class doc): with d the distance of
        this rank's parameter to the center, the parameter moves by
        -beta/size * d and the center by beta * mean(d), the same on every
        rank."""
        if _outside(self._process_set):
            return
        self._ensure_center()
        # Both set with easgd_beta, which this step runs under.
        assert self._center is not None and self._easgd_beta is not None
        beta, n = self._easgd_beta, self._process_set.size()
        datas = [p.list_data() for p in self._params]
        distances = [d[0] - c for d, c in zip(datas, self._center)]
        means = [d.copy() for d in distances]
        _allreduce_each_(means, [f"{self._prefix}easgd.{i}" for i in range(len(means))],
                         [-i for i in range(len(means))], Average, 1.0, 1.0, self._process_set)
        for copies, distance, mean, center in zip(datas, distances, means, self._center):
            copies[0][:] = copies[0] - distance * (beta / n)
            center[:] = center + mean * beta
            for other in copies[1:]:
                copies[0].copyto(other)

    def _allreduce_grads(self):
        self._ensure_center()
        entries = [(i, p) for i, p in enumerate(self._params) if p.grad_req != "null"]
        grads = [self._sum_over_contexts(p) for _, p in entries]
        f = self._gradient_predivide_factor
        # Outside the set there is nothing to exchange, and the gradients
        # are applied as they are (as Horovod's trainer does); under local
        # SGD each rank updates with its own gradients (see the class doc),
        # and gradient_predivide_factor is 1.
        inside = not _outside(self._process_set)
        if inside and self._local_sgd_steps == 1 and self._process_set.size() > 1:
            self._check_parameters()
            self._reduce(entries, grads, 1.0 / f)
        elif self._hierarchical:
            host = _host_process_set()  # collective the first time
            if host is not None:
                self._check_parameters()
                _allreduce_each_(grads, [f"{self._prefix}host.{i}" for i, _ in entries],
                                 [-i for i, _ in entries], Average, 1.0, 1.0, host)
        elif inside and f != 1.0:
            for g in grads:  # the 1/f that the allreduce would apply (_scale has f)
                g *= 1.0 / f
        for (_, p), g in zip(entries, grads):
            for other in p.list_grad()[1:]:
                g.copyto(other)

    def _check_parameters(self) -> None:
        """Before the first collective on the parameters: the ranks must hold
        the same ones (see _check_same_parameters)."""
        if not self._hvdmx_checked:
            _check_same_parameters(self._params, f"{self._prefix}DistributedTrainer.check",
                                   "DistributedTrainer", self._process_set)
            self._hvdmx_checked = True

    @staticmethod
    def _sum_over_contexts(param: Parameter) -> mx.nd.NDArray:
        """The gradient on the first context, holding the sum over this rank's
        contexts when there are several (gluon.Trainer with kvstore=None would
        not combine them)."""
        grads = param.list_grad()
        for other in grads[1:]:
            grads[0] += other.as_in_context(grads[0].context)
        return grads[0]

    def _reduce(self, entries, grads: List[mx.nd.NDArray], prescale: float) -> None:
        if self._compression is Compression.onebit:
            _onebit_exchange("DistributedTrainer", self._residuals, [i for i, _ in entries],
                             [p.name for _, p in entries], grads,
                             [f"{self._prefix}onebit.{i}" for i, _ in entries], prescale,
                             self._process_set)
            return
        compressed = [self._compression.compress(g) for g in grads]
        tensors = [t for t, _ in compressed]
        op = Adasum if self._op == Adasum else Sum
        names = [self._prefix + str(i) for i, _ in entries]
        if self._num_groups > 0:
            for g, group in enumerate(_split_list(range(len(entries)), self._num_groups)):
                if group:
                    _reduce_by_dtype([tensors[k] for k in group], [names[k] for k in group],
                                     -g, prescale, 1.0, self._process_set, op)
        else:
            _allreduce_each_(tensors, names, [-i for i, _ in entries], op, prescale, 1.0,
                             self._process_set)
        for g, (t, ctx) in zip(grads, compressed):
            if t is not g:
                self._compression.decompress(t, ctx).copyto(g)
