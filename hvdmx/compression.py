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


class Compression:
    """The compression algorithms: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
