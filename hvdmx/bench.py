"""Benchmarks that print what the field prints (nccl-tests' columns).

Run under MPI, e.g.::

    mpiexec -n 2 python -m hvdmx.bench allreduce
    mpiexec -n 2 python -m hvdmx.bench allreduce --min-bytes 4 --max-bytes 4 --iters 2000
    mpiexec -n 2 python -m hvdmx.bench allgather --min-bytes 1M --max-bytes 64M --plot ag.png
    mpiexec -n 2 python -m hvdmx.bench model --model resnet50_v1
    mpiexec -n 2 python -m hvdmx.bench idle --seconds 10

``allreduce``, ``allgather``, ``broadcast``, ``alltoall`` and ``reducescatter``
time hvdmx through the whole stack (Python call, MXNet engine, negotiation,
collective, result read) and, in the same run, the matching MPI call through
mpi4py on the same bytes (MPI_Allreduce, MPI_Allgather, MPI_Bcast,
MPI_Alltoall, MPI_Reduce_scatter_block), and print both with their ratio.
allreduce and broadcast are timed twice, as nccl-tests does: out of place
(``allreduce(x)``: a new output per call) and in place (``allreduce_(x)``);
the other collectives have no in-place form. The ratio compares MPI with
the in-place figure where there is one (MPI runs in place there too).
Sizes are bytes of the largest buffer; GB = 1e9; busbw = algbw times
2(n-1)/n for allreduce, (n-1)/n for allgather, alltoall and reducescatter,
1 for broadcast (nccl-tests' factors). Every size first gets a correctness
pass (#wrong counts elements that differ from the exact result).
``allgather --tensors K`` cuts each rank's part into K tensors and times one
``grouped_allgather`` of them beside K MPI_Allgather calls.
``alltoall --splits`` passes the (equal) splits as a list, so each call
also returns the received splits, as Horovod scripts usually call it.
``model`` allreduces the gradient set of a model-zoo network the way
DistributedTrainer does and prints ms per iteration beside MPI_Allreduce per
tensor, on one fused buffer (the call alone), and on one fused buffer with the
copies a program with separate gradient arrays needs (each gradient copied in,
the sums copied back), and beside the memory floor: every rank reading and
writing its gradients once, all ranks at once. ``--plot`` draws busbw
against size. ``--mpi-memory mxnet`` gives MPI buffers that MXNet allocated,
the kind of memory hvdmx's inputs have, instead of numpy arrays: numpy asks
for huge pages for arrays of 4 MiB and up and MXNet does not, which changes
how fast large messages move between processes.
``--rounds R`` times every column R times, one after another in turn (hvdmx
out of place, in place, MPI, then again), and prints each column's median:
a slow phase of a shared machine then falls on hvdmx and MPI alike.
``idle`` reports the CPU time an initialized process uses while it runs no
collective.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import numpy as np

from hvdmx.run_flags import _number

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
    # The slowest rank's time is the collective's time. (MPI is loaded by
    # now: tools/horovod/model_allreduce.py uses this without hvdmx's core.)
    from mpi4py import MPI
    return comm.allreduce(elapsed, op=MPI.MAX) / iters


def _rounds(steps: dict, rounds: int, warmup: int, iters: int, comm) -> dict:
    """Times each step (name -> callable) in turn, ``rounds`` times over:
    name -> seconds per call, one figure per round."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(_timed(step, warmup, iters, comm))
    return times


def _mpi():
    from hvdmx import _core  # noqa: F401  first: it refuses a launcher MPI cannot join
    from mpi4py import MPI
    return MPI


# busbw = algbw * factor(n): what each link carries, as nccl-tests defines it.
BUS_FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reducescatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
REDOP = {"allreduce": "sum", "reducescatter": "sum"}


class _Case:
    """One collective at one size: hvdmx's step, MPI's step and both checks.

    ``size`` is the bytes of the largest buffer (nccl-tests' convention):
    the whole vector for allreduce, broadcast and reducescatter's input,
    allgather's output, and what each rank sends in alltoall.
    """

    def __init__(self, kind, count, dtype, rank, n, comm, tensors=1, splits=False,
                 mpi_memory="numpy", unnamed=False):
        import mxnet as mx
        import hvdmx as hvd
        MPI = _mpi()
        part = count // n  # per-rank elements where the op splits the vector
        inputs = [((np.arange(count) + r) % 7).astype(dtype) for r in range(n)]
        mine = inputs[rank]
        self._kept = []  # the MXNet arrays under MPI's buffers (mpi_memory="mxnet")
        if mpi_memory == "mxnet":
            def np_(array):
                return _on_mxnet_memory(array, self._kept)
        else:
            def np_(array):
                return array
        # Unnamed, every call is a new name, as in scripts that name none:
        # its negotiation misses the response cache and goes to rank 0.
        name = None if unnamed else f"bench.{kind}"
        self.hvdmx_in_place = None  # set where the op has an in-place form
        self.received = None  # alltoall --splits: the last call's received splits
        self.part = part
        if kind == "allreduce":
            buf = mx.nd.array(mine, dtype=dtype)
            self.want = sum(x.astype(np.int64) for x in inputs).astype(dtype)
            # In place, like the MPI call beside it. Out of place, each call
            # allocates its output through MXNet (page faults included).
            self.hvdmx = lambda: hvd.allreduce(buf, op=hvd.Sum, name=name)
            self.hvdmx_in_place = lambda: hvd.allreduce_(buf, op=hvd.Sum, name=name)
            mpi_recv = np_(mine.copy())
            self.mpi = lambda: comm.Allreduce(MPI.IN_PLACE, mpi_recv, op=MPI.SUM)
        elif kind == "allgather" and tensors > 1:
            # Tensor t is piece t of every rank's part; the results are
            # compared concatenated in tensor order.
            pieces = [np.array_split(x[:part], tensors) for x in inputs]
            bufs = [mx.nd.array(p, dtype=dtype) for p in pieces[rank]]
            self.want = np.concatenate([pieces[r][t] for t in range(tensors) for r in range(n)])
            self.hvdmx = lambda: hvd.grouped_allgather(bufs, name=name)
            # One receive buffer; tensor t's result is its t-th stretch.
            mpi_recv = np_(np.empty(part * n, dtype=dtype))
            mpi_pieces = [np_(p) for p in pieces[rank]]
            ends = np.cumsum([len(p) * n for p in pieces[rank]])
            recvs = np.split(mpi_recv, ends[:-1])

            def mpi():
                for piece, recv in zip(mpi_pieces, recvs):
                    comm.Allgather(piece, recv)
            self.mpi = mpi
        elif kind == "allgather":
            own = mine[:part]
            buf = mx.nd.array(own, dtype=dtype)
            self.want = np.concatenate([x[:part] for x in inputs])
            self.hvdmx = lambda: hvd.allgather(buf, name=name)
            mpi_own, mpi_recv = np_(own), np_(np.empty(part * n, dtype=dtype))
            self.mpi = lambda: comm.Allgather(mpi_own, mpi_recv)
        elif kind == "broadcast":
            buf = mx.nd.array(mine, dtype=dtype)
            self.want = inputs[0]
            self.hvdmx = lambda: hvd.broadcast(buf, root_rank=0, name=name)
            self.hvdmx_in_place = lambda: hvd.broadcast_(buf, root_rank=0, name=name)
            mpi_recv = np_(mine.copy())
            self.mpi = lambda: comm.Bcast(mpi_recv, root=0)
        elif kind == "alltoall":
            buf = mx.nd.array(mine[:part * n], dtype=dtype)
            self.want = np.concatenate([x[rank * part:(rank + 1) * part] for x in inputs])
            self.hvdmx = lambda: hvd.alltoall(buf, name=name)
            if splits:
                given = [part] * n

                def with_splits():
                    out, self.received = hvd.alltoall(buf, splits=given, name=name)
                    return out
                self.hvdmx = with_splits
            send, mpi_recv = np_(mine[:part * n].copy()), np_(np.empty(part * n, dtype=dtype))
            self.mpi = lambda: comm.Alltoall(send, mpi_recv)
        elif kind == "reducescatter":
            buf = mx.nd.array(mine[:part * n], dtype=dtype)
            total = sum(x[:part * n].astype(np.int64) for x in inputs).astype(dtype)
            self.want = total[rank * part:(rank + 1) * part]
            self.hvdmx = lambda: hvd.reducescatter(buf, op=hvd.Sum, name=name)
            send, mpi_recv = np_(mine[:part * n].copy()), np_(np.empty(part, dtype=dtype))
            self.mpi = lambda: comm.Reduce_scatter_block(send, mpi_recv, op=MPI.SUM)
        self.mpi_out = mpi_recv

    def hvdmx_wrong(self, step) -> int:
        got = np.concatenate([o.asnumpy() for o in _outputs(step())])
        wrong = int(np.count_nonzero(got != self.want))
        if self.received is not None:
            wrong += int(np.count_nonzero(self.received.asnumpy() != self.part))
        return wrong

    def mpi_wrong(self) -> int:
        self.mpi()
        return int(np.count_nonzero(self.mpi_out != self.want))


def _on_mxnet_memory(array, keep: list):
    """A numpy array over memory that MXNet allocated, holding `array`'s
    values; the MXNet array is appended to `keep`, which must outlive it.
    MPI's buffers then sit on the memory hvdmx's own inputs have: numpy asks
    the kernel for huge pages for arrays of 4 MiB and up, MXNet does not,
    and copies between processes run at about half the speed on 4 KiB pages."""
    import ctypes
    import mxnet as mx
    if array.size == 0:
        return array
    nd = mx.nd.array(array.reshape(-1), dtype=array.dtype)
    nd.wait_to_read()
    keep.append(nd)
    ptr = ctypes.c_void_p()
    mx.base.check_call(mx.base._LIB.MXNDArrayGetData(nd.handle, ctypes.byref(ptr)))
    raw = (ctypes.c_uint8 * array.nbytes).from_address(ptr.value)
    return np.frombuffer(raw, dtype=array.dtype).reshape(array.shape)


def _outputs(result) -> list:
    """A step's outputs as a list (grouped calls return one already)."""
    return result if isinstance(result, list) else [result]


def _read(result) -> None:
    for out in _outputs(result):
        out.wait_to_read()


def run_collective(args) -> list:
    import hvdmx as hvd
    comm = _mpi().COMM_WORLD
    hvd.init()
    rank, n = hvd.rank(), hvd.size()
    dtype = np.dtype(DTYPES[args.dtype])
    kind = args.command
    # MPI has no float16 reductions.
    mpi_runs = args.vs_mpi and not (dtype == np.float16 and kind in REDOP)
    tensors = getattr(args, "tensors", 1)  # allgather only
    splits = getattr(args, "splits", False)  # alltoall only
    rows = []
    for nbytes in sizes(args.min_bytes, args.max_bytes, args.factor):
        count = max(1, nbytes // dtype.itemsize)
        if kind in ("allgather", "alltoall", "reducescatter"):
            count = max(n, count - count % n)
        nbytes = count * dtype.itemsize
        iters = args.iters or max(5, min(1000, int(2e9 / max(nbytes, 1) / 100)))
        warmup = max(2, iters // 10)
        case = _Case(kind, count, dtype, rank, n, comm, tensors, splits, args.mpi_memory,
                     args.unnamed)
        factor = BUS_FACTOR[kind](n) if n > 1 else 0.0
        row = {"op": kind, "bytes": nbytes, "count": count, "type": args.dtype,
               "redop": REDOP.get(kind, "none"), "iters": iters, "rounds": args.rounds,
               "tensors": tensors, "splits": splits, "mpi_memory": args.mpi_memory,
               "unnamed": args.unnamed}

        runs = [("oop", case.hvdmx), ("ip", case.hvdmx_in_place), ("mpi", case.mpi)]
        runs = [(prefix, step) for prefix, step in runs
                if step is not None and (prefix != "mpi" or mpi_runs)]
        for prefix, step in runs:
            row[f"{prefix}_wrong"] = (case.mpi_wrong() if prefix == "mpi"
                                      else case.hvdmx_wrong(step))
        # Round after round of each column in turn, so that a slow phase of
        # the machine falls on hvdmx and MPI alike; each column's figure is
        # the median of its rounds.
        times = _rounds({prefix: (step if prefix == "mpi" else
                                  (lambda step=step: _read(step())))
                         for prefix, step in runs}, args.rounds, warmup, iters, comm)
        for prefix in ("oop", "ip", "mpi"):
            t = statistics.median(times[prefix]) if prefix in times else float("nan")
            row.update({f"{prefix}_us": t * 1e6, f"{prefix}_algbw": nbytes / t / 1e9,
                        f"{prefix}_busbw": nbytes / t / 1e9 * factor,
                        f"{prefix}_rounds_us": [x * 1e6 for x in times.get(prefix, [])]})
            row.setdefault(f"{prefix}_wrong", 0)
        # The figure set beside MPI's (in place where the op has that form).
        best = "ip" if case.hvdmx_in_place is not None else "oop"
        for field in ("us", "algbw", "busbw"):
            row[f"hvdmx_{field}"] = row[f"{best}_{field}"]
        row["hvdmx_wrong"] = row["oop_wrong"] + row["ip_wrong"]
        rows.append(row)
    hvd.shutdown()
    return rows


MPI_CALL = {"allreduce": "MPI_Allreduce", "allgather": "MPI_Allgather",
            "broadcast": "MPI_Bcast", "alltoall": "MPI_Alltoall",
            "reducescatter": "MPI_Reduce_scatter_block"}


def _of_rounds(rounds: int) -> str:
    return f", median of {rounds} rounds taken in turn" if rounds > 1 else ""


def print_collective(rows: list, n: int, kind: str) -> None:
    tensors = rows[0]["tensors"] if rows else 1
    what = (f"grouped_{kind} of {tensors} tensors vs {tensors} x {MPI_CALL[kind]}"
            if tensors > 1 else f"{kind} vs {MPI_CALL[kind]}")
    if rows and rows[0].get("splits"):
        what = f"{kind} with splits (and received splits back) vs {MPI_CALL[kind]}"
    memory = "MXNet's memory" if rows and rows[0].get("mpi_memory") == "mxnet" else "numpy"
    rounds = _of_rounds(rows[0]["rounds"]) if rows else ""
    if rows and rows[0].get("unnamed"):
        what += ", hvdmx calls unnamed (each a new name)"
    print(f"# hvdmx {what} (mpi4py on {memory} buffers), {n} ranks; time = mean per call "
          f"incl. result read{rounds}; GB/s = 1e9 B/s; MPI/hvdmx compares in place where "
          "hvdmx has it")
    group = f"{'':>10} {'':>7} {'':>7} {'':>6}"
    print(f"{'':>12} {'':>11} {'':>8} {'':>5} | {'hvdmx out-of-place':<{len(group)}} | "
          f"{'hvdmx in-place':<{len(group)}} | {MPI_CALL[kind]:<{len(group)}} |")
    cols = f"{'time(us)':>10} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
    print(f"{'size(B)':>12} {'count':>11} {'type':>8} {'redop':>5} | {cols} | {cols} | {cols} | "
          f"{'MPI/hvdmx':>9}")

    def figures(r, prefix):
        if r[f"{prefix}_us"] != r[f"{prefix}_us"]:  # NaN: not run
            return f"{'n/a':>10} {'':>7} {'':>7} {'':>6}"
        return (f"{r[prefix + '_us']:>10.1f} {r[prefix + '_algbw']:>7.2f} "
                f"{r[prefix + '_busbw']:>7.2f} {r[prefix + '_wrong']:>6}")

    for r in rows:
        print(f"{r['bytes']:>12} {r['count']:>11} {r['type']:>8} {r['redop']:>5} | "
              f"{figures(r, 'oop')} | {figures(r, 'ip')} | {figures(r, 'mpi')} | "
              f"{r['mpi_us'] / r['hvdmx_us']:>9.2f}")


def model_gradients(name: str) -> list:
    """The gradient shapes and dtypes of a model-zoo network, in the order
    DistributedTrainer reduces them (parameters sorted by name)."""
    import mxnet as mx
    net = mx.gluon.model_zoo.vision.get_model(name, pretrained=False)
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, 3, 224, 224)))  # resolves deferred shapes
    params = sorted(net.collect_params().items())
    return [(tuple(p.shape), np.dtype(p.dtype)) for _, p in params if p.grad_req != "null"]


def run_model(args) -> dict:
    """ms per iteration to allreduce a model's gradient set: hvdmx the way
    DistributedTrainer does (an allreduce_ per gradient, priority -i, all
    pushed in one call, then wait), MPI_Allreduce once per tensor,
    MPI_Allreduce once on one buffer holding them all (the call alone), and
    the same with the gradients copied into that buffer and the sums copied
    back, as a program whose gradients are separate arrays must; beside them the
    memory floor: every rank reads and writes each of its gradients once
    (numpy, in place), all ranks at once, which is the memory traffic an
    in-place allreduce cannot avoid on one host."""
    import mxnet as mx
    import hvdmx as hvd
    from hvdmx.ops import _allreduce_each_
    MPI = _mpi()
    comm = MPI.COMM_WORLD
    hvd.init()
    shapes = model_gradients(args.model)
    grads = [mx.nd.ones(s, dtype=d) for s, d in shapes]
    total = sum(int(np.prod(s)) * d.itemsize for s, d in shapes)

    names = [f"model.{i}" for i in range(len(grads))]
    priorities = [-i for i in range(len(grads))]

    def hvdmx_step():
        # What DistributedTrainer does: allreduce_ of each gradient, pushed in one call.
        _allreduce_each_(grads, names, priorities, hvd.Average, 1.0, 1.0, hvd.global_process_set)
        mx.nd.waitall()

    mpi_bufs = [np.ones(s, dtype=d) for s, d in shapes]
    fused = np.ones(sum(int(np.prod(s)) for s, _ in shapes), dtype=np.float32)

    def mpi_per_tensor():
        for b in mpi_bufs:
            comm.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM)

    def mpi_fused():
        comm.Allreduce(MPI.IN_PLACE, fused, op=MPI.SUM)

    ends = np.cumsum([0] + [b.size for b in mpi_bufs])
    views = [fused[ends[i]:ends[i + 1]].reshape(b.shape) for i, b in enumerate(mpi_bufs)]

    def mpi_fused_copies():
        for b, v in zip(mpi_bufs, views):
            np.copyto(v, b)
        comm.Allreduce(MPI.IN_PLACE, fused, op=MPI.SUM)
        for b, v in zip(mpi_bufs, views):
            np.copyto(b, v)

    def memory_floor():
        for b in mpi_bufs:
            np.multiply(b, 1, out=b)

    warmup = args.warmup if args.warmup is not None else max(2, args.iters // 10)
    steps = {"hvdmx": hvdmx_step, "floor": memory_floor}
    if args.vs_mpi:
        steps.update({"mpi_per_tensor": mpi_per_tensor, "mpi_fused": mpi_fused,
                      "mpi_fused_copies": mpi_fused_copies})
    times = _rounds(steps, args.rounds, warmup, args.iters, comm)
    row = {"model": args.model, "tensors": len(shapes), "bytes": total, "ranks": hvd.size(),
           "iters": args.iters, "warmup": warmup, "rounds": args.rounds}
    for name, seconds in times.items():
        row[f"{name}_ms"] = statistics.median(seconds) * 1e3
        row[f"{name}_rounds_ms"] = [x * 1e3 for x in seconds]
    hvd.shutdown()
    return row


def plot_rows(rows: list, kind: str, n: int, path: str) -> None:
    """busbw against size for hvdmx and MPI."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes_ = [r["bytes"] for r in rows]
    ax.plot(sizes_, [r["oop_busbw"] for r in rows], "o-", label="hvdmx out of place")
    if any(r["ip_us"] == r["ip_us"] for r in rows):
        ax.plot(sizes_, [r["ip_busbw"] for r in rows], "^-", label="hvdmx in place")
    if any(r["mpi_us"] == r["mpi_us"] for r in rows):  # not all NaN
        ax.plot(sizes_, [r["mpi_busbw"] for r in rows], "s--", label=MPI_CALL[kind])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"{kind}, {n} ranks, {rows[0]['type']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
    for kind in BUS_FACTOR:
        ar = sub.add_parser(kind, help=f"hvdmx {kind} beside {MPI_CALL[kind]}")
        ar.add_argument("--min-bytes", type=parse_size, default=4,
                        help="smallest size (4, 1K, 1M)")
        ar.add_argument("--max-bytes", type=parse_size, default=64 << 20, help="largest size")
        ar.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
        ar.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
        ar.add_argument("--iters", type=int, default=0, help="timed iterations (0: by size)")
        ar.add_argument("--rounds", type=_number("rounds", integer=True, minimum=1), default=1,
                        help="time every column this many times, in turn, and print each "
                             "one's median (default: 1)")
        ar.add_argument("--vs-mpi", action=argparse.BooleanOptionalAction, default=True,
                        help=f"also time {MPI_CALL[kind]} in the same run (default: on)")
        ar.add_argument("--json", action="store_true", help="print JSON instead of a table")
        ar.add_argument("--plot", metavar="FILE", help="also draw busbw against size (matplotlib)")
        ar.add_argument("--mpi-memory", choices=["numpy", "mxnet"], default="numpy",
                        help="what MPI's buffers are: numpy arrays (which get huge pages "
                             "from 4 MiB up), or memory that MXNet allocated, like hvdmx's "
                             "(4 KiB pages unless the kernel or malloc give huge ones)")
        ar.add_argument("--unnamed", action="store_true",
                        help="call hvdmx without a name, so that every call is a new name "
                             "that misses the response cache, as in scripts that name "
                             "none (default: one name for all calls)")
        if kind == "allgather":
            ar.add_argument("--tensors", type=_number("tensors", integer=True, minimum=1),
                            default=1, metavar="K",
                            help="cut each rank's part into K tensors: one grouped_allgather "
                                 "beside K MPI_Allgather calls (default: 1, a plain allgather)")
        if kind == "alltoall":
            ar.add_argument("--splits", action="store_true",
                            help="pass the splits as a list, so that each call also returns "
                                 "the received splits (default: no splits, an equal split)")
    model = sub.add_parser("model", help="allreduce a model-zoo network's gradients per "
                                "iteration, beside MPI and the memory floor")
    model.add_argument("--model", default="resnet50_v1", help="mx.gluon.model_zoo.vision name")
    model.add_argument("--iters", type=int, default=20, help="timed iterations")
    model.add_argument("--rounds", type=_number("rounds", integer=True, minimum=1), default=1,
                       help="time every column this many times, in turn, and print each "
                            "one's median (default: 1)")
    model.add_argument("--warmup", type=int, default=None,
                       help="untimed iterations first (default: iters/10, at least 2); "
                            "with HVDMX_AUTOTUNE=1, give it time to tune")
    model.add_argument("--vs-mpi", action=argparse.BooleanOptionalAction, default=True,
                       help="also time MPI_Allreduce per tensor and fused, with and without "
                            "the copies into the fused buffer (default: on)")
    model.add_argument("--json", action="store_true")
    idle = sub.add_parser("idle", help="CPU used by an initialized, idle process")
    idle.add_argument("--seconds", type=float, default=5.0)
    idle.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    MPI = _mpi()
    rank, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if args.command in BUS_FACTOR:
        rows = run_collective(args)
        if rank == 0:
            if args.json:
                print(json.dumps(rows, indent=1))
            else:
                print_collective(rows, n, args.command)
            if args.plot:
                plot_rows(rows, args.command, n, args.plot)
        return 1 if any(r["hvdmx_wrong"] or r["mpi_wrong"] for r in rows) else 0
    if args.command == "model":
        row = run_model(args)
        if rank == 0:
            if args.json:
                print(json.dumps(row, indent=1))
            else:
                print(f"# {row['model']} gradients: {row['tensors']} tensors, "
                      f"{row['bytes'] / 1e6:.1f} MB, {n} ranks; ms per iteration "
                      f"(mean of {row['iters']}{_of_rounds(row['rounds'])}); memory floor: "
                      "every rank reads and writes its gradients once, all at once")
                print(f"{'hvdmx':>10} {'memory floor':>13} {'MPI per tensor':>15} "
                      f"{'MPI fused':>10} {'MPI fused + copies':>19}")
                nan = float("nan")
                print(f"{row['hvdmx_ms']:>10.1f} {row['floor_ms']:>13.1f} "
                      f"{row.get('mpi_per_tensor_ms', nan):>15.1f}"
                      f" {row.get('mpi_fused_ms', nan):>10.1f}"
                      f" {row.get('mpi_fused_copies_ms', nan):>19.1f}")
        return 0
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
