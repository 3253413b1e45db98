"""Checkpoints of a data-parallel job: rank 0 writes one file, any one rank
reads it back, and every rank resumes with its values.

    hvd.save_checkpoint("ckpt.params", net, trainer, epoch=3)        # rank 0 writes
    extra = hvd.load_checkpoint("ckpt.params", net, trainer)         # rank 0 reads
    start_epoch = extra["epoch"] + 1

A checkpoint holds the model's parameters, and with ``trainer`` the
trainer's optimizer (its hyperparameters, update counts and learning-rate
schedule, as ``Trainer.save_states`` keeps them) and the optimizer states
(momentum, Adam's moments, float32 master weights), plus any picklable
``extra`` values. Resuming from it reproduces the uninterrupted run bitwise.

The file is an MXNet NDArray file (``mx.nd.load`` reads it):
``param:<key>`` for each parameter, ``state:<key>:<j>`` for the arrays of
its optimizer state, and ``hvdmx.checkpoint``, a uint8 array holding the
pickled rest (the optimizer, how states nest, ``extra``).

With gradient compression that keeps residuals (Compression.onebit in
DistributedTrainer or DistributedOptimizer, hvd.KVStore's 2bit and 1bit),
each rank's residuals (what it has not yet sent of past gradients) are saved
too, as ``residual:<holder>:<key>:<rank>``, and each rank gets its own back.
They differ by rank, so such a save is collective: every rank must call
``save_checkpoint``, and the checkpoint's residuals load only into a job of
the same size (another size starts them at zero, with a warning).

Parameters are identified by key, not by position: for a Block the
structural key that ``Block.save_parameters`` uses (``"0.weight"``), which
does not depend on the block's name prefix, so a checkpoint loads into a
freshly built copy of the model; for a dict, its keys. Optimizer states are
stored under the key of their parameter, so they reach the right parameter
even when a new trainer orders its parameters differently.
"""
from __future__ import annotations

import os
import pickle
from typing import Any, Dict, List, Optional, Tuple, Union

import mxnet as mx
import numpy as np
from mxnet.gluon.parameter import Parameter, ParameterDict

from hvdmx.basics import rank, size
from hvdmx.checkpoint_residuals import gather_residuals, scatter_residuals, without_residuals
from hvdmx.ops import Sum, _check_root, allreduce, broadcast_
from hvdmx import trainer_state

__all__ = ["load_checkpoint", "save_checkpoint"]

_META_KEY = "hvdmx.checkpoint"
_FORMAT = 1

Params = Union[mx.gluon.Block, ParameterDict, Dict[str, Any]]


def _named(fn: str, params: Params) -> Dict[str, Union[Parameter, mx.nd.NDArray]]:
    """The parameters by key (see the module docstring)."""
    if isinstance(params, mx.gluon.Block):
        return params._collect_params_with_prefix()
    if isinstance(params, (ParameterDict, dict)):
        named = dict(params.items())
        for key, value in named.items():
            if not isinstance(key, str):
                raise TypeError(f"hvdmx.{fn}: the keys of argument 'params' must be str, got "
                                f"{key!r}")
            if not isinstance(value, (Parameter, mx.nd.NDArray)):
                raise TypeError(f"hvdmx.{fn}: params[{key!r}] must be a Parameter or an "
                                f"NDArray, got {type(value).__name__}")
        return named
    raise TypeError(f"hvdmx.{fn}: argument 'params' must be a gluon Block (the model), a "
                    "ParameterDict (net.collect_params()) or a dict of Parameters or NDArrays "
                    f"(Module's arg_params), got {type(params).__name__}")


def _check_trainer(fn: str, trainer) -> None:
    if not isinstance(trainer, mx.gluon.Trainer):
        raise TypeError(f"hvdmx.{fn}: argument 'trainer' must be a gluon.Trainer (an "
                        "hvd.DistributedTrainer, or a Trainer with kvstore=hvd.KVStore()) or "
                        f"None, got {type(trainer).__name__}")
    kvstore = trainer_state.kvstore_updating(trainer)
    if kvstore is not None:
        raise ValueError(f"hvdmx.{fn}: the trainer updates its parameters on its kvstore "
                         f"({kvstore}), which holds the optimizer states; use "
                         "hvd.DistributedTrainer or kvstore=hvd.KVStore(), whose states "
                         "live in the trainer")


def _trainer_keys(fn: str, trainer, named) -> List[str]:
    """The key of each of the trainer's parameters, by position."""
    key_of = {id(p): k for k, p in named.items() if isinstance(p, Parameter)}
    keys = []
    for p in trainer_state.parameters(trainer):
        if id(p) not in key_of:
            raise ValueError(f"hvdmx.{fn}: the trainer's parameter '{p.name}' is not among "
                             "argument 'params'; pass the model whose parameters the trainer "
                             "trains")
        keys.append(key_of[id(p)])
    return keys


# --- optimizer states: nested tuples of NDArrays, flattened for the file -----

def _flatten(state, prefix: str, arrays: Dict[str, mx.nd.NDArray]):
    """A picklable description of ``state`` whose arrays go to ``arrays``."""
    if isinstance(state, mx.nd.NDArray):
        name = f"{prefix}:{len(arrays)}"
        arrays[name] = state
        return ("array", name)
    if isinstance(state, (tuple, list)):
        return (type(state).__name__, [_flatten(s, prefix, arrays) for s in state])
    return ("value", state)


def _rebuild(layout, arrays: Dict[str, mx.nd.NDArray]):
    kind, body = layout
    if kind == "array":
        return arrays[body]
    if kind in ("tuple", "list"):
        items = [_rebuild(child, arrays) for child in body]
        return tuple(items) if kind == "tuple" else items
    return body


# --- save --------------------------------------------------------------------

def save_checkpoint(path: str, params: Params, trainer: Optional[mx.gluon.Trainer] = None,
                    **extra: Any) -> None:
    """Writes a checkpoint of ``params`` (and of ``trainer``'s optimizer and
    states) to ``path``, on rank 0; other ranks return at once.

    ``params`` is the model (a gluon Block), a ParameterDict or a dict of
    Parameters or NDArrays. ``extra`` keyword values (an epoch, a step, ...)
    must be picklable and come back from ``load_checkpoint``. Every rank may
    call it (only rank 0 writes) or rank 0 alone, except when the trainer
    keeps gradient compression residuals: then every rank must call it, as
    each rank's residuals travel to rank 0 (see the module doc). The file is written to
    ``path + '.tmp-<pid>'`` first and renamed, so a crash never leaves a half
    written checkpoint under ``path``. Waits for the values it saves.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError("hvdmx.save_checkpoint: argument 'path' must be a str or a path, got "
                        f"{type(path).__name__}")
    named = _named("save_checkpoint", params)
    residuals: Dict[str, mx.nd.NDArray] = {}
    layout: List[tuple] = []
    if trainer is not None:
        _check_trainer("save_checkpoint", trainer)
        keys = _trainer_keys("save_checkpoint", trainer, named)
        layout, residuals = gather_residuals(trainer, keys)
    if rank() != 0:
        return
    arrays: Dict[str, mx.nd.NDArray] = {}
    for key, value in sorted(named.items()):
        if isinstance(value, Parameter):
            if value._data is None:
                raise ValueError(f"hvdmx.save_checkpoint: parameter '{key}' ({value.name}) is "
                                 "not initialized yet (its shape is deferred); save after the "
                                 "first forward pass")
            value = value.list_data()[0]
        arrays[f"param:{key}"] = value
    meta: Dict[str, Any] = {"format": _FORMAT, "params": sorted(named), "trainer": None,
                            "extra": extra}
    if trainer is not None:
        updater = trainer_state.updaters(trainer)[0]
        states = {}
        for index, state in trainer_state.states(updater).items():
            states[keys[index]] = _flatten(state, f"state:{keys[index]}", arrays)
        meta["trainer"] = {"optimizer": without_residuals(trainer_state.optimizer(trainer)),
                           "states": states}
        if layout:
            meta["residuals"] = {"ranks": size(), "layout": layout}
            arrays.update(residuals)
    try:
        blob = pickle.dumps(meta)
    except Exception as error:  # what pickle raises depends on the object
        raise TypeError(f"hvdmx.save_checkpoint: the checkpoint cannot be pickled ({error}); "
                        "every 'extra' value must be picklable") from error
    arrays[_META_KEY] = mx.nd.array(np.frombuffer(blob, dtype=np.uint8), dtype="uint8")
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        mx.nd.save(tmp, arrays)
    except mx.base.MXNetError as error:
        raise OSError(f"hvdmx.save_checkpoint: cannot write '{tmp}' (for argument "
                      f"'path'='{path}'): {str(error).strip().splitlines()[-1]}; check that "
                      "the directory exists and is writable") from error
    os.replace(tmp, path)


# --- load --------------------------------------------------------------------

def _read(path: str) -> Tuple[Dict[str, mx.nd.NDArray], bytes]:
    """The arrays and the pickled meta of the checkpoint at ``path`` (root only)."""
    with open(path, "rb"):  # FileNotFoundError / PermissionError, with the path
        pass
    try:
        arrays = mx.nd.load(path)
    except mx.base.MXNetError as error:
        raise ValueError(f"'{path}' is not an MXNet NDArray file "
                         f"({str(error).strip().splitlines()[-1]})") from error
    if not isinstance(arrays, dict) or _META_KEY not in arrays:
        raise ValueError(f"'{path}' is not an hvdmx checkpoint (it has no '{_META_KEY}' "
                         "entry); write checkpoints with hvd.save_checkpoint, or load plain "
                         "parameter files with net.load_parameters")
    return arrays, arrays.pop(_META_KEY).asnumpy().tobytes()


def _broadcast_bytes(data: Optional[bytes], root: int, name: str) -> bytes:
    """``data`` from ``root`` on every rank (None elsewhere). Blocks."""
    mine = rank() == root
    length = mx.nd.array([len(data) if data is not None and mine else 0], dtype="int64")
    n = int(broadcast_(length, root, name=f"{name}.length").asnumpy()[0])
    buffer = mx.nd.array(np.frombuffer(data, dtype=np.uint8), dtype="uint8") \
        if data is not None and mine \
        else mx.nd.empty((n,), dtype="uint8")
    return broadcast_(buffer, root, name=name).asnumpy().tobytes()


_ERRORS = {"FileNotFoundError": FileNotFoundError, "PermissionError": PermissionError,
           "IsADirectoryError": IsADirectoryError, "OSError": OSError}


def _expected(value) -> Tuple[Optional[tuple], np.dtype]:
    """The shape (None: any) and dtype that ``value`` accepts."""
    shape = value.shape if value.shape is None else tuple(value.shape)
    return shape, np.dtype(value.dtype)


def _fits(want: Optional[tuple], got: tuple, deferred: bool) -> bool:
    """Whether a saved array of shape ``got`` fits; a deferred parameter's
    unknown dimensions (0) fit any size."""
    if want is None:
        return True
    if len(want) != len(got):
        return False
    return all(w == g or (deferred and w == 0) for w, g in zip(want, got))


def _mismatch(path: str, named, trainer, meta, shapes) -> Optional[str]:
    """Why this rank's model or trainer cannot take the checkpoint, or None."""
    saved = set(meta["params"])
    missing = sorted(set(named) - saved)
    if missing:
        return (f"parameter '{missing[0]}' of the model is not in checkpoint '{path}' "
                f"({len(missing)} missing); the checkpoint has {sorted(saved)[:5]}"
                f"{' ...' if len(saved) > 5 else ''}. Load it into the model it was saved from")
    unknown = sorted(saved - set(named))
    if unknown:
        return (f"checkpoint '{path}' has parameter '{unknown[0]}', which the model does not "
                f"have ({len(unknown)} such); load it into the model it was saved from")
    for key in sorted(named):
        value = named[key]
        want_shape, want_dtype = _expected(value)
        got_shape, got_dtype = shapes[f"param:{key}"]
        deferred = isinstance(value, Parameter) and value._data is None
        if not _fits(want_shape, got_shape, deferred) or want_dtype != got_dtype:
            return (f"parameter '{key}' is {got_shape} {got_dtype} in checkpoint '{path}' but "
                    f"{want_shape} {want_dtype} in the model; load it into a model of the same "
                    "layers and sizes")
    if trainer is not None:
        if meta["trainer"] is None:
            return (f"checkpoint '{path}' has no trainer state (it was saved without "
                    "'trainer'); load it with trainer=None")
        keys = set(_trainer_keys("load_checkpoint", trainer, named))
        residuals = meta.get("residuals") or {"layout": []}
        stray = sorted(set(meta["trainer"]["states"]) - keys) \
            or sorted({key for _, key, _ in residuals["layout"]} - keys)
        if stray:
            return (f"checkpoint '{path}' has an optimizer state or a compression residual "
                    f"for parameter '{stray[0]}', which this trainer does not train; pass the "
                    "trainer of the same parameters")
    return None


def _agree(error: Optional[str], path: str) -> None:
    """Raises ValueError on every rank if any rank has an error."""
    flags = np.zeros(size(), dtype=np.int64)
    flags[rank()] = error is not None
    failed = np.flatnonzero(allreduce(mx.nd.array(flags, dtype="int64"), op=Sum,
                                      name="load_checkpoint.agree").asnumpy())
    if error is not None:
        raise ValueError(f"hvdmx.load_checkpoint: {error}; nothing was loaded")
    if len(failed):
        raise ValueError(f"hvdmx.load_checkpoint: rank(s) {failed.tolist()} cannot load "
                         f"checkpoint '{path}' into their model (their error says why); "
                         "nothing was loaded")


def load_checkpoint(path: str, params: Params, trainer: Optional[mx.gluon.Trainer] = None,
                    root_rank: int = 0) -> Dict[str, Any]:
    """Loads a checkpoint written by ``save_checkpoint`` into ``params`` (and
    ``trainer``) on every rank, and returns its ``extra`` values as a dict.

    Only ``root_rank`` reads ``path``; the values reach the other ranks by
    broadcast, so they need not see the file (their ``path`` is not used).
    Every rank must call it. With ``trainer``, the trainer's optimizer is
    replaced by the saved one (hyperparameters, update counts, learning-rate
    schedule; as ``Trainer.load_states`` does) and its states are restored,
    and each rank gets its own compression residuals back (if the checkpoint
    was saved by a job of this size; otherwise they are left out, with a
    warning).

    Raises on every rank, before anything is loaded, when the file cannot be
    read (FileNotFoundError, PermissionError, ValueError for a file that is
    not a checkpoint) or does not fit the model or trainer (ValueError naming
    the parameter). Blocks until the values have arrived.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError("hvdmx.load_checkpoint: argument 'path' must be a str or a path, got "
                        f"{type(path).__name__}")
    path = os.fspath(path)
    root = _check_root("load_checkpoint", root_rank, list(range(size())))
    named = _named("load_checkpoint", params)
    if trainer is not None:
        _check_trainer("load_checkpoint", trainer)
    mine = rank() == root

    # 1. The root reads the file and sends what every rank needs to check
    #    and allocate: the meta, each array's shape and dtype, or the error.
    arrays: Dict[str, mx.nd.NDArray] = {}
    header: Dict[str, Any] = {"path": path, "error": None}
    if mine:
        try:
            arrays, blob = _read(path)
            meta = pickle.loads(blob)
            if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
                raise ValueError(f"'{path}' is an hvdmx checkpoint of an unknown format "
                                 f"{meta.get('format') if isinstance(meta, dict) else None!r}"
                                 f" (this hvdmx reads format {_FORMAT})")
            header.update(meta=blob, shapes={k: (tuple(a.shape), np.dtype(a.dtype))
                                             for k, a in arrays.items()})
        except Exception as error:  # noqa: BLE001 - every rank must hear of any failure
            kind = type(error).__name__ if type(error).__name__ in _ERRORS else "ValueError"
            header["error"] = (kind, str(error))
    header = pickle.loads(_broadcast_bytes(pickle.dumps(header) if mine else None, root,
                                           "load_checkpoint.header"))
    if header["error"] is not None:
        kind, text = header["error"]
        raise _ERRORS.get(kind, ValueError)(f"hvdmx.load_checkpoint: rank {root} cannot read "
                                            f"the checkpoint: {text}")
    meta, shapes, source = pickle.loads(header["meta"]), header["shapes"], header["path"]

    # 2. Every rank checks its own model and trainer; all raise if one fails.
    try:
        problem = _mismatch(source, named, trainer, meta, shapes)
    except ValueError as mismatch:
        problem = str(mismatch).removeprefix("hvdmx.load_checkpoint: ")
    _agree(problem, source)

    # 3. The arrays travel from the root, one broadcast each, in one order.
    #    (Residuals are each rank's own: step 4.)
    common = [entry for entry in sorted(shapes) if not entry.startswith("residual:")]
    for entry in common:
        shape, dtype = shapes[entry]
        buffer = arrays[entry] if mine else mx.nd.empty(shape, dtype=dtype)
        arrays[entry] = broadcast_(buffer, root, name=f"load_checkpoint.{entry}")
    for key, value in named.items():
        data = arrays[f"param:{key}"]
        if isinstance(value, Parameter):
            value._load_init(data, None)
        else:
            data.copyto(value)
    if trainer is not None:
        _restore_trainer(trainer, named, meta["trainer"], arrays)
        # 4. Each rank's compression residuals, from the root to that rank.
        scatter_residuals(trainer, _trainer_keys("load_checkpoint", trainer, named),
                           meta.get("residuals"), arrays, root, source)
    for entry in common:  # errors surface here; the names are free again
        arrays[entry].wait_to_read()
    return dict(meta["extra"])


def _restore_trainer(trainer, named, saved, arrays) -> None:
    keys = _trainer_keys("load_checkpoint", trainer, named)
    index_of = {k: i for i, k in enumerate(keys)}
    # As Trainer.load_states: the saved optimizer, with this trainer's parameters.
    states = {index_of[k]: _rebuild(layout, arrays) for k, layout in saved["states"].items()}
    trainer_state.replace_optimizer(trainer, saved["optimizer"], states)
