"""The per-collective runs of ``python -m hvdmx.bench``: hvdmx's collective and
the matching MPI call on the same bytes, each size first checked (#wrong),
then timed (see hvdmx/bench/__init__.py)."""
from __future__ import annotations

import statistics

import numpy as np

from hvdmx.bench.timing import load_mpi, rounds, sizes

DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
          "int32": np.int32, "int64": np.int64, "uint8": np.uint8, "int8": np.int8}


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
        MPI = load_mpi()
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
    import mxnet as mx
    if array.size == 0:
        return array
    nd = mx.nd.array(array.reshape(-1), dtype=array.dtype)
    keep.append(nd)
    return mxnet_memory(nd).reshape(array.shape)


def mxnet_address(nd) -> int:
    """The address of the first element of the MXNet array `nd`."""
    import ctypes
    import mxnet as mx
    ptr = ctypes.c_void_p()
    mx.base.check_call(mx.base._LIB.MXNDArrayGetData(nd.handle, ctypes.byref(ptr)))
    return ptr.value or 0  # None for no memory (an empty array)


def mxnet_memory(nd) -> np.ndarray:
    """The memory of the MXNet array `nd` (once written) as a flat numpy
    array, without a copy: valid while `nd` lives, and showing what is
    later written to it."""
    import ctypes
    nd.wait_to_read()
    dtype = np.dtype(nd.dtype)
    raw = (ctypes.c_uint8 * (nd.size * dtype.itemsize)).from_address(mxnet_address(nd))
    return np.frombuffer(raw, dtype=dtype)


def _outputs(result) -> list:
    """A step's outputs as a list (grouped calls return one already)."""
    return result if isinstance(result, list) else [result]


def _read(result) -> None:
    for out in _outputs(result):
        out.wait_to_read()


def run_collective(args) -> list:
    import hvdmx as hvd
    comm = load_mpi().COMM_WORLD
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
        times = rounds({prefix: (step if prefix == "mpi" else
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
