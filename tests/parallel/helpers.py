"""Inputs that catch misplaced data, and their exact expected reductions.

Values are small integers that depend on rank and index, so every dtype
(float16 and int8 included) holds every sum and product exactly and results
can be compared with equality. And ``restarted(env)``, the block that runs
under other settings.
"""
import collections
import contextlib

import numpy as np

import hvdmx as hvd
# Where an MXNet array's memory is, and that memory seen from numpy without a
# copy (for checking arrays of gigabytes, which asnumpy() would copy first).
from hvdmx.bench.collectives import mxnet_address, mxnet_memory  # noqa: F401
from conftest import all_equal_across_ranks, restart
from rank_data import mixed  # noqa: F401 (tests import it from here too)

# The dtypes the collectives take, as the core lists them (csrc/hvdmx/python/bindings.cc).
DTYPES = list(hvd._core.ARRAY_DTYPES)
OPS = [hvd.Sum, hvd.Min, hvd.Max, hvd.Product, hvd.Average]


def counts_for(size):
    """0, 1, size-1, size+1 and a large count not divisible by size."""
    return sorted({0, 1, max(size - 1, 0), size + 1, 100_003 * size + 1})


def rank_input(rank, count, dtype, op, start=0):
    """Rank ``rank``'s operand of ``count`` elements for ``op``, or, with
    ``start``, its elements at indices ``start`` to ``count - 1``."""
    if op == hvd.Product:
        values = 1 + mixed(rank, count, modulus=2, start=start)  # products stay <= 2**size
    else:
        values = mixed(rank, count, start=start)  # sums stay <= 10 * size
    return values.astype(dtype)


# expected()'s recent results: tests run the same calls under several settings
# (shared memory with two chunk sizes, every algorithm), and the reference of
# a few-MiB call took longer than the call.
_EXPECTED_BYTES = 128 << 20
_expected = collections.OrderedDict()
_expected_bytes = 0


def expected(size, count, dtype, op, prescale=1.0, postscale=1.0, start=0):
    """The reduction of every rank's rank_input (from index ``start`` on,
    when given), as the core computes it; read-only (a test that changes it
    fails loudly instead of changing the next test's reference)."""
    global _expected_bytes
    key = (size, count, np.dtype(dtype).str, op, prescale, postscale, start)
    want = _expected.get(key)
    if want is not None:
        _expected.move_to_end(key)
        return want
    want = reduced([rank_input(r, count, dtype, op, start).astype(np.float64) * prescale
                    for r in range(size)], dtype, op, postscale)
    want.setflags(write=False)
    _expected[key] = want
    _expected_bytes += want.nbytes
    while _expected_bytes > _EXPECTED_BYTES and len(_expected) > 1:
        _expected_bytes -= _expected.popitem(last=False)[1].nbytes
    return want


def check_my_share(out, rank, size, count, dtype, op):
    """Checks the allreduce of rank_input(r, count, dtype, op) over `size`
    ranks, each rank its own share of the elements (my_rows) against the
    reference of that share alone, and every rank's whole result against
    the others' bytes: every element is compared with the reference once,
    and every rank holds the same. A large count's reference computed on
    every rank took most of the time of the jobs of 10 and 16 ranks (each
    rank reducing every rank's input on two shared cores); a wrong share
    fails its rank, which aborts the job (conftest)."""
    got = out.asnumpy()
    assert got.dtype == np.dtype(dtype) and got.shape == (count,), (got.dtype, got.shape)
    start, end = my_rows(count, size, rank)
    want = expected(size, end, dtype, op, start=start)
    assert np.array_equal(got[start:end], want), \
        f"elements {start}..{end - 1}: got {got[start:start + 8]} want {want[:8]}"
    assert all_equal_across_ranks(got)


def reduced(arrays, dtype, op, postscale=1.0):
    """Every rank's array (one each, in float64) reduced by `op`, then scaled
    and cast to `dtype` the way the core does it."""
    inputs = [np.asarray(a, dtype=np.float64) for a in arrays]
    if op in (hvd.Sum, hvd.Average):
        out = np.sum(inputs, axis=0)
    elif op == hvd.Min:
        out = np.min(inputs, axis=0)
    elif op == hvd.Max:
        out = np.max(inputs, axis=0)
    else:
        out = np.prod(inputs, axis=0)
    dt = np.dtype(dtype)
    if dt.kind in "iu" and op not in (hvd.Min, hvd.Max):
        # Integer sums and products wrap around in the dtype, as in the core
        # (products with a prescale overflow int8 and uint8 from 5 ranks on).
        out = out.astype(np.int64).astype(dt).astype(np.float64)
    factor = postscale / len(inputs) if op == hvd.Average else postscale
    return scaled(out, dtype, factor)


def scaled(values, dtype, factor):
    """values * factor the way the core computes it for this dtype."""
    dt = np.dtype(dtype)
    if factor == 1.0:
        return values.astype(dt)
    if dt == np.float64:
        return (values * factor).astype(dt)
    if dt.kind == "f":
        # float16 is scaled in float32 before its one rounding (Note [Half
        # precision summed in float32] in reduce_kernels.cc).
        return (values.astype(np.float32) * np.float32(factor)).astype(dt)
    return np.trunc(values * factor).astype(dt)


def half_input(rank, count, offset=0):
    """float16 integers in [1024, 2048), where the spacing is 1: every rank's
    value is exact, but the sum of two or more falls where the spacing is 2
    or 4, so a sum rounded after every pairwise step differs from one
    rounded once in some elements, whatever the order."""
    i = np.arange(offset, offset + count)
    return (1024 + (i * 37 + rank * 101) % 1024).astype(np.float16)


def half_expected(size, count, op, prescale=1.0, postscale=1.0, offset=0):
    """half_input's reduction as Horovod defines it: see prescaled_half_reference."""
    return prescaled_half_reference([half_input(r, count, offset) for r in range(size)], op,
                                    prescale, postscale)


def hashed_half_input(rank, count, offset=0):
    """Integers of magnitude 256 to 2047, either sign, from a hash of (rank,
    index): no period for a chunk or segment boundary to line up with. Most
    of them times a factor such as 1/3 or 0.7 are not exact in float16, and
    a sum of such products rounded to float16 (at most 8 * 2662 in
    magnitude, nothing finer than 2^-4) is exact in float32."""
    i = np.arange(offset, offset + count, dtype=np.uint64)
    h = (i * np.uint64(0x9E3779B1) + np.uint64(rank * 0x85EBCA77 + 0x165667B1)) & np.uint64(
        0xFFFFFFFF)
    h ^= h >> np.uint64(15)
    h = (h * np.uint64(0x2C1B3C6D)) & np.uint64(0xFFFFFFFF)
    h ^= h >> np.uint64(12)
    magnitude = 256 + (h >> np.uint64(1)) % np.uint64(1792)
    sign = np.where(h & np.uint64(1), -1.0, 1.0)
    return (sign * magnitude.astype(np.float64)).astype(np.float16)


def prescaled_half_reference(inputs, op, prescale=1.0, postscale=1.0):
    """Horovod's meaning of a float16 Sum or Average with scale factors, as
    the core computes it (Note [Half precision summed in float32] in
    reduce_kernels.cc): each rank's input scaled in float16,
    float16(float32(prescale) * float32(x)), then summed (exactly here, in
    float64; the inputs keep the core's float32 sum exact too), then times
    the postscale (over size for Average) in float32 and rounded once."""
    total = np.zeros(len(inputs[0]), np.float64)
    for x in inputs:
        x = np.asarray(x, np.float32)
        w = x if prescale == 1.0 else (x * np.float32(prescale)).astype(np.float16)
        total += w.astype(np.float64)
    factor = postscale / len(inputs) if op == hvd.Average else postscale
    total = total.astype(np.float32)
    return (total if factor == 1.0 else total * np.float32(factor)).astype(np.float16)


def hashed_half_expected(size, count, op, prescale=1.0, postscale=1.0, offset=0):
    """hashed_half_input's reduction over `size` ranks: see prescaled_half_reference."""
    return prescaled_half_reference([hashed_half_input(r, count, offset) for r in range(size)],
                                    op, prescale, postscale)


def my_rows(dim0, size, rank):
    """The rows reducescatter leaves on `rank`: the first ranks get the remainder."""
    base, rem = divmod(dim0, size)
    start = rank * base + min(rank, rem)
    return start, start + base + (1 if rank < rem else 0)


def mnist_example_accuracy(args):
    """Runs examples/mnist_gluon.py's main() in this job with ``args`` and
    returns its test accuracy (its own last check raises if the ranks'
    parameters differ)."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "mnist_gluon.py")
    spec = importlib.util.spec_from_file_location("mnist_gluon_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.main(args)


@contextlib.contextmanager
def restarted(env):
    """hvdmx restarted under the extra environment variables ``env`` for the
    block, and restarted without them after it: the prologue and the
    ``finally`` of every test that needs other settings. A failure in the
    block passes through the second restart, which then aborts the job (see
    conftest.restart) instead of leaving the other ranks waiting."""
    restart(env)
    try:
        yield
    finally:
        restart({})
