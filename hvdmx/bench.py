"""Benchmarks that print what the field prints (nccl-tests' columns).

Run under MPI, e.g.::

    mpiexec -n 2 python -m hvdmx.bench allreduce
    mpiexec -n 2 python -m hvdmx.bench allreduce --min-bytes 4 --max-bytes 4 --iters 2000
    mpiexec -n 2 python -m hvdmx.bench idle --seconds 10

``allreduce`` times hvdmx through the whole stack (Python call, MXNet engine,
negotiation, collective, result read) and, in the same run, ``MPI_Allreduce``
called through mpi4py on the same bytes, and prints both with their ratio.
Sizes are bytes; GB = 1e9; busbw = algbw * 2(n-1)/n. Every size first gets a
correctness pass (#wrong counts elements that differ from the exact sum).
``idle`` reports the CPU time an initialized process uses while it runs no
collective.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import numpy as np

DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
          "int32": np.int32, "int64": np.int64, "uint8": np.uint8, "int8": np.int8}


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


def _timed(fn, warmup: int, iters: int, comm) -> float:
    for _ in range(warmup):
        fn()
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - start
    # the slowest rank's time is the collective's time
    return comm.allreduce(elapsed, op=_mpi().MAX) / iters


def _mpi():
    from mpi4py import MPI
    return MPI


def run_allreduce(args) -> list:
    import mxnet as mx
    import hvdmx as hvd
    MPI = _mpi()
    comm = MPI.COMM_WORLD
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    dtype = np.dtype(DTYPES[args.dtype])
    rows = []
    for nbytes in sizes(args.min_bytes, args.max_bytes, args.factor):
        count = max(1, nbytes // dtype.itemsize)
        nbytes = count * dtype.itemsize
        data = ((np.arange(count) + rank) % 7).astype(dtype)
        want = sum(((np.arange(count) + r) % 7) for r in range(n)).astype(dtype)
        iters = args.iters or max(5, min(1000, int(2e9 / max(nbytes, 1) / 100)))
        warmup = max(2, iters // 10)

        x = mx.nd.array(data, dtype=dtype)
        out = hvd.allreduce(x, op=hvd.Sum, name="bench.check")
        wrong = int(np.count_nonzero(out.asnumpy() != want))
        buf = mx.nd.array(data, dtype=dtype)

        def hvdmx_step():
            hvd.allreduce_(buf, op=hvd.Sum, name="bench.ar").wait_to_read()

        t_hvd = _timed(hvdmx_step, warmup, iters, comm)

        mpi_buf = data.copy()
        check = data.copy()
        comm.Allreduce(MPI.IN_PLACE, check, op=MPI.SUM)
        mpi_wrong = int(np.count_nonzero(check != want))

        def mpi_step():
            comm.Allreduce(MPI.IN_PLACE, mpi_buf, op=MPI.SUM)

        t_mpi = _timed(mpi_step, warmup, iters, comm) if dtype != np.float16 else float("nan")
        factor = 2 * (n - 1) / n if n > 1 else 0.0
        rows.append({
            "bytes": nbytes, "count": count, "type": args.dtype, "redop": "sum",
            "hvdmx_us": t_hvd * 1e6, "hvdmx_algbw": nbytes / t_hvd / 1e9,
            "hvdmx_busbw": nbytes / t_hvd / 1e9 * factor, "hvdmx_wrong": wrong,
            "mpi_us": t_mpi * 1e6, "mpi_algbw": nbytes / t_mpi / 1e9,
            "mpi_busbw": nbytes / t_mpi / 1e9 * factor, "mpi_wrong": mpi_wrong,
            "iters": iters,
        })
    hvd.shutdown()
    return rows


def print_allreduce(rows: list, n: int) -> None:
    print(f"# hvdmx allreduce vs MPI_Allreduce (mpi4py), {n} ranks; time = mean per call "
          "incl. result read; GB/s = 1e9 B/s")
    head = (f"{'size(B)':>12} {'count':>11} {'type':>8} {'redop':>5} | "
            f"{'hvdmx us':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} | "
            f"{'MPI us':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6} | {'MPI/hvdmx':>9}")
    print(head)
    for r in rows:
        print(f"{r['bytes']:>12} {r['count']:>11} {r['type']:>8} {r['redop']:>5} | "
              f"{r['hvdmx_us']:>10.1f} {r['hvdmx_algbw']:>7.2f} {r['hvdmx_busbw']:>7.2f} "
              f"{r['hvdmx_wrong']:>6} | {r['mpi_us']:>10.1f} {r['mpi_algbw']:>7.2f} "
              f"{r['mpi_busbw']:>7.2f} {r['mpi_wrong']:>6} | "
              f"{r['mpi_us'] / r['hvdmx_us']:>9.2f}")


def run_idle(args) -> list:
    import hvdmx as hvd
    hvd.init()
    _mpi().COMM_WORLD.Barrier()
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    time.sleep(args.seconds)
    after = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.perf_counter() - start
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rows = _mpi().COMM_WORLD.gather({"rank": hvd.rank(), "cpu_s": cpu, "wall_s": wall,
                                     "core_percent": 100 * cpu / wall}, root=0)
    hvd.shutdown()
    return rows or []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdmx.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    ar = sub.add_parser("allreduce", help="hvdmx allreduce beside MPI_Allreduce")
    ar.add_argument("--min-bytes", type=parse_size, default=4, help="smallest size (4, 1K, 1M)")
    ar.add_argument("--max-bytes", type=parse_size, default=64 << 20, help="largest size")
    ar.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
    ar.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ar.add_argument("--iters", type=int, default=0, help="timed iterations (0: by size)")
    ar.add_argument("--json", action="store_true", help="print JSON instead of a table")
    idle = sub.add_parser("idle", help="CPU used by an initialized, idle process")
    idle.add_argument("--seconds", type=float, default=5.0)
    idle.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    MPI = _mpi()
    rank, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if args.command == "allreduce":
        rows = run_allreduce(args)
        if rank == 0:
            print(json.dumps(rows, indent=1)) if args.json else print_allreduce(rows, n)
        return 1 if any(r["hvdmx_wrong"] for r in rows) else 0
    rows = run_idle(args)
    if rank == 0:
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            print(f"# CPU used while idle for {args.seconds:g} s after hvd.init()")
            print(f"{'rank':>4} {'cpu s':>8} {'% of a core':>12}")
            for r in rows:
                print(f"{r['rank']:>4} {r['cpu_s']:>8.3f} {r['core_percent']:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
