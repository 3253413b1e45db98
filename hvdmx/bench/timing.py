"""Timing for the benchmarks: sizes, the timed loop every benchmark program
uses (``timed``), rounds taken in turn, and MPI loaded after hvdmx's core."""
from __future__ import annotations

import time
from typing import Dict, List


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def sizes(lo: int, hi: int, factor: int):
    s = lo
    while s <= hi:
        yield s
        s *= factor


def timed(fn, warmup: int, iters: int, comm) -> float:
    """Seconds per call of ``fn``: ``warmup`` untimed calls, a barrier, then
    the mean over ``iters`` timed calls, of the slowest rank of ``comm`` (an
    mpi4py communicator). The one timing of every hvdmx benchmark program
    (benchmarks/) and of ``python -m hvdmx.bench``."""
    for _ in range(warmup):
        fn()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - start
    # The slowest rank's time is the collective's time. (MPI is loaded by
    # now: benchmarks/horovod/model_allreduce.py uses this without hvdmx's core.)
    from mpi4py import MPI
    return comm.allreduce(elapsed, op=MPI.MAX) / iters


def rounds(steps: dict, rounds: int, warmup: int, iters: int, comm) -> dict:
    """Times each step (name -> callable) in turn, ``rounds`` times over:
    name -> seconds per call, one figure per round."""
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(timed(step, warmup, iters, comm))
    return times


def load_mpi():
    """mpi4py's MPI, loaded by hvdmx (which refuses a launcher MPI cannot
    join, and opens its MPI plugin on the same library)."""
    from hvdmx._mpi import load_mpi as load
    return load()
