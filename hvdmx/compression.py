"""Gradient compression for DistributedTrainer, with Horovod's interface.

A compressor turns a gradient into the tensor that travels
(``compress(tensor) -> (compressed, ctx)``) and back
(``decompress(compressed, ctx) -> tensor``); ``ctx`` is whatever
``decompress`` needs. ``Compression.none`` sends gradients as they are;
``Compression.fp16`` sends floating-point gradients as float16 and leaves
integer tensors untouched.
"""
from __future__ import annotations

from typing import Any, Tuple

import mxnet as mx
import numpy as np


class Compressor:
    """Interface for compressing and decompressing a tensor."""

    @staticmethod
    def compress(tensor: mx.nd.NDArray) -> Tuple[mx.nd.NDArray, Any]:
        """Returns the tensor to send and the context ``decompress`` needs."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: mx.nd.NDArray, ctx: Any) -> mx.nd.NDArray:
        """Returns the tensor ``compress`` was given, from what was sent."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 (half the bytes); the context is
    the original dtype. Integer tensors and float16 tensors pass unchanged (no copy)."""

    @staticmethod
    def compress(tensor):
        if np.dtype(tensor.dtype).kind == "f":
            return tensor.astype("float16", copy=False), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is not None and np.dtype(ctx).kind == "f":
            return tensor.astype(ctx, copy=False)
        return tensor


class OneBitCompressor(Compressor):
    """Sends each float32 gradient as a sign per value and, per 256 values,
    two levels (the mean of the values >= 0 and of the others), with error
    feedback: 1.25 bits a value, 25.6x fewer bytes than float32.

    Each rank adds its residual (what it has not yet sent of past gradients)
    to the gradient, sends each value as its chunk's level for its sign, and
    keeps the difference as its new residual, so nothing is lost, only
    delayed. The packed signs and levels are allgathered and every rank adds
    up every rank's values in rank order, so all ranks get the same bits. See
    Note [One-bit compression] in csrc/hvdmx/algorithms/onebit.h.

    It keeps state (the residuals), so it has no stateless compress() and
    decompress(): DistributedTrainer and DistributedOptimizer use it through
    ``exchange``.
    """

    @staticmethod
    def compress(tensor):
        raise TypeError("hvdmx: Compression.onebit keeps a residual per gradient; pass it to "
                        "DistributedTrainer(compression=...) or DistributedOptimizer instead "
                        "of calling compress() yourself")

    @staticmethod
    def decompress(tensor, ctx):
        OneBitCompressor.compress(tensor)

    @staticmethod
    def exchange(grad: mx.nd.NDArray, residual: mx.nd.NDArray, name: str, process_set) -> None:
        """Replaces ``grad`` (float32, on the CPU) with the sum over the
        process set's ranks of what each sends for it, updating ``residual``
        (this rank's, shaped like ``grad``); asynchronous."""
        _packed_exchange("onebit", grad, residual, name, process_set)


def _check_quantizable(head: str, label: str, array: mx.nd.NDArray, fix: str = "") -> None:
    """Raises TypeError unless ``array`` is float32 on the CPU, which the
    packing kernels need: "``head`` on the CPU; ``label`` is <dtype> on
    <context>``fix``"."""
    if np.dtype(array.dtype) != np.float32 or array.context.device_type != "cpu":
        raise TypeError(f"{head} on the CPU; {label} is {np.dtype(array.dtype)} on "
                        f"{array.context}{fix}")


def _exchange_with_residual(kind: str, residuals: dict, key, grad: mx.nd.NDArray, name: str,
                            process_set, *extra) -> None:
    """_packed_exchange with this rank's residual for ``key`` in
    ``residuals``, zeros at the first call."""
    residual = residuals.get(key)
    if residual is None:
        residual = residuals[key] = mx.nd.zeros(grad.shape, dtype="float32")
    _packed_exchange(kind, grad, residual, name, process_set, *extra)


def _packed_exchange(kind: str, grad: mx.nd.NDArray, residual: mx.nd.NDArray, name: str,
                     process_set, *extra) -> None:
    """Packs ``grad`` + ``residual`` with the core's ``kind`` kernels (onebit,
    or twobit with the threshold in ``extra``), allgathers the packed words
    under ``name`` and replaces ``grad`` with the sum of every rank's values,
    decoded in rank order. Every step is an engine op: nothing waits here."""
    from hvdmx import _core
    from hvdmx.gather_scatter import allgather

    n = int(np.prod(grad.shape))
    packed = mx.nd.empty((getattr(_core, f"{kind}_words")(n),), dtype="int32")
    getattr(_core, f"{kind}_pack")(grad.handle.value, residual.handle.value, packed.handle.value,
                                   n, *extra)
    gathered = allgather(packed, name=name, process_set=process_set)
    getattr(_core, f"{kind}_unpack_sum")(gathered.handle.value, process_set.size(),
                                         grad.handle.value, n)


class Compression:
    """The compression algorithms: ``Compression.none``, ``Compression.fp16``
    and ``Compression.onebit`` (hvdmx's own)."""

    none = NoneCompressor
    fp16 = FP16Compressor
    onebit = OneBitCompressor
