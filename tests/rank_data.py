"""Inputs that catch misplaced data, for the single-process tests and
tests/parallel alike (no hvdmx import): small integers that depend on rank,
index and a salt with no period."""
import numpy as np


def mixed(rank, count, salt=0, modulus=11):
    """Integers in [0, modulus) that depend on rank, index and ``salt`` with
    no period: a 64-bit mix (splitmix64's finalizer) of (rank, salt, index).
    Data with a period (``(i * 7 + rank * 3) % 11`` repeats every 11
    elements) lets a block misplaced by a multiple of the period pass.
    With the default modulus, sums stay <= 10 * size: exact in float16 up
    to 204 ranks."""
    x = np.arange(count, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    x += np.uint64((rank + 1) * 0xBF58476D1CE4E5B9 % 2**64) + np.uint64(salt * 0x632BE59BD9B4E019
                                                                         % 2**64)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(29)
    return (x % np.uint64(modulus)).astype(np.int64)
