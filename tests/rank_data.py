"""Inputs that catch misplaced data, for the single-process tests and
tests/parallel alike (no hvdmx import): small integers that depend on rank,
index and a salt with no period."""
import collections

import numpy as np

# mixed()'s recent results, in the smallest dtype that holds them: a test's
# reference computes every rank's input, for every op, dtype and algorithm
# alike, and computing them took most of the time of the largest tests
# (tests/parallel/test_shm.py's every-dtype test: 7 of its 12 s per rank at -n 4).
_CACHE_BYTES = 256 << 20
_cache = collections.OrderedDict()
_cached_bytes = 0


def mixed(rank, count, salt=0, modulus=11, start=0):
    """Integers in [0, modulus) that depend on rank, index and ``salt`` with
    no period: a 64-bit mix (splitmix64's finalizer) of (rank, salt, index).
    Data with a period (``(i * 7 + rank * 3) % 11`` repeats every 11
    elements) lets a block misplaced by a multiple of the period pass.
    With the default modulus, sums stay <= 10 * size: exact in float16 up
    to 204 ranks. Returns a new int64 array (the caller may change it) of
    the values at indices ``start`` to ``count - 1`` (each value depends on
    its index only, not on ``count``)."""
    global _cached_bytes
    key = (rank, count, salt, modulus, start)
    values = _cache.get(key)
    if values is None:
        values = _mix(rank, start, count, salt, modulus)
        _cache[key] = values
        _cached_bytes += values.nbytes
        while _cached_bytes > _CACHE_BYTES and len(_cache) > 1:
            _cached_bytes -= _cache.popitem(last=False)[1].nbytes
    else:
        _cache.move_to_end(key)
    return values.astype(np.int64)


def _mix(rank, start, count, salt, modulus):
    x = np.arange(start, count, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    # The same sum, wrapped around 2**64 in Python integers (numpy warns).
    x += np.uint64(((rank + 1) * 0xBF58476D1CE4E5B9 + salt * 0x632BE59BD9B4E019) % 2**64)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(29)
    x %= np.uint64(modulus)
    compact = np.uint8 if modulus <= 256 else np.uint16 if modulus <= 65536 else np.uint64
    return x.astype(compact)
