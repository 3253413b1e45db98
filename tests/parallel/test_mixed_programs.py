"""Random programs of mixed collectives, all pushed before any is read.

Each test draws a program from its seed (the same on every rank): a few dozen
calls of every kind, dtype, shape, op, root, name (given or generated) and
priority, with ragged first dimensions for allgather and alltoall. Every rank
pushes the whole program without waiting, so fusion, the response cache, the
output pool and the ordering across kinds all meet at once; then every result
is compared exactly with numpy's, computed from every rank's inputs. Small
fusion buffers, pieces, ring segments and shared-memory chunks make even these
small tensors take the paths that large ones take. The same runs on the even
and the odd ranks' process sets at once, each set its own program.
"""
import mxnet as mx
import numpy as np
import pytest

import hvdmx as hvd
from hvdmx import _core
from conftest import restart
from helpers import DTYPES, mixed, my_rows, reduced

FLOATS = ["float32", "float64", "float16"]
KINDS = ["allreduce", "allreduce_", "grouped_allreduce", "broadcast", "broadcast_",
         "allgather", "grouped_allgather", "alltoall", "reducescatter",
         "grouped_reducescatter"]
CALLS = 40


@pytest.fixture(scope="module", params=["auto", "shm", "shm, direct from 512 bytes", "ring",
                                        "mpi", "auto, cache of 3"])
def algo(request):
    """HVDMX_ALLREDUCE_ALGO; "direct" moves the larger blocks by reading the
    peers' buffers, the others through the stages; "cache" also evicts from
    a 3-entry response cache."""
    restart({"HVDMX_ALLREDUCE_ALGO": request.param.split(",")[0],
             "HVDMX_SHM_DIRECT_MIN_BYTES": "512" if "direct" in request.param else "-1",
             "HVDMX_CACHE_CAPACITY": "3" if "cache" in request.param else "1024",
             "HVDMX_FUSION_THRESHOLD": "2048", "HVDMX_FUSION_PIECE_BYTES": "512",
             "HVDMX_RING_SEGMENT_BYTES": "64", "HVDMX_SHM_CHUNK_BYTES": "256",
             "HVDMX_FUSION_MAX_TENSOR_BYTES": "256"})
    yield request.param
    restart({})


def values(rank, call, shape, dtype):
    """Rank `rank`'s input to call `call`: small integers, exact in every dtype."""
    return mixed(rank, int(np.prod(shape, dtype=np.int64)), salt=call).astype(dtype) \
        .reshape(shape)


def draw(seed, size):
    """The program of a set of `size` ranks: one dict per call, the same on
    every rank. Ranks, roots and rows are indices into the set."""
    rng = np.random.default_rng(seed)
    program = []
    for call in range(CALLS):
        kind = KINDS[rng.integers(len(KINDS))]
        reducing = kind in ("allreduce", "allreduce_", "grouped_allreduce", "reducescatter",
                            "grouped_reducescatter")
        dtype = str(rng.choice(FLOATS if reducing and rng.random() < 0.5 else DTYPES))
        if kind.endswith("reducescatter"):
            ops = [hvd.Sum] + ([hvd.Average] if dtype in FLOATS else [])
        else:
            ops = [hvd.Sum, hvd.Min, hvd.Max] + ([hvd.Average] if dtype in FLOATS else [])
        trailing = [(), (3,), (2, 5), (70,)][rng.integers(4)]
        count = 1 + rng.integers(3) if kind.startswith("grouped") else 1
        spec = {
            "kind": kind, "dtype": dtype, "op": ops[rng.integers(len(ops))],
            "root": int(rng.integers(size)), "priority": int(rng.integers(-5, 6)),
            "name": f"mixed.{seed}.{call}" if rng.random() < 0.5 else None,
            # Rows of each tensor of the call on each rank (allgather: ragged).
            "rows": [[int(rng.integers(0, 5)) for _ in range(size)] for _ in range(count)],
            # alltoall: splits[r][j] rows go from rank r to rank j; or equal splits.
            "splits": [[int(rng.integers(0, 3)) for _ in range(size)] for _ in range(size)]
            if rng.random() < 0.7 else None,
            "trailing": trailing,
        }
        program.append(spec)
    return program


def shape_of(spec, rank, k):
    size = len(spec["rows"][0])
    if spec["kind"] == "alltoall":
        rows = sum(spec["splits"][rank]) if spec["splits"] else 2 * size
    elif spec["kind"].endswith("allgather"):
        rows = spec["rows"][k][rank]
    else:
        rows = spec["rows"][k][0]  # the same on every rank
    return (rows,) + spec["trailing"]


def inputs(spec, call, members, rank):
    """The inputs of the set's rank `rank` (an index into `members`)."""
    return [values(members[rank], call * 4 + k, shape_of(spec, rank, k), spec["dtype"])
            for k in range(len(spec["rows"]))]


def push(spec, call, process_set, rank):
    """Pushes one call on the set's rank `rank`; returns the arrays to read
    and, for alltoall with splits, the received splits."""
    members = process_set.ranks
    xs = [mx.nd.array(x, dtype=x.dtype) for x in inputs(spec, call, members, rank)]
    kind, name, priority = spec["kind"], spec["name"], spec["priority"]
    common = {"name": name, "priority": priority, "process_set": process_set}
    root = members[spec["root"]]  # a global rank, as in Horovod
    if kind == "allreduce":
        return [hvd.allreduce(xs[0], op=spec["op"], **common)], None
    if kind == "allreduce_":
        hvd.allreduce_(xs[0], op=spec["op"], **common)
        return xs, None
    if kind == "grouped_allreduce":
        return hvd.grouped_allreduce(xs, op=spec["op"], **common), None
    if kind == "broadcast":
        return [hvd.broadcast(xs[0], root, **common)], None
    if kind == "broadcast_":
        hvd.broadcast_(xs[0], root, **common)
        return xs, None
    if kind == "allgather":
        return [hvd.allgather(xs[0], **common)], None
    if kind == "grouped_allgather":
        return hvd.grouped_allgather(xs, **common), None
    if kind == "alltoall":
        if spec["splits"] is None:
            return [hvd.alltoall(xs[0], **common)], None
        out, received = hvd.alltoall(xs[0], splits=spec["splits"][rank], **common)
        return [out], received
    op = spec["op"]
    if kind == "reducescatter":
        return [hvd.reducescatter(xs[0], op=op, **common)], None
    return hvd.grouped_reducescatter(xs, op=op, **common), None


def expect(spec, call, members, rank):
    """What push() returns on the set's rank `rank`, from every rank's inputs."""
    size = len(members)
    everyone = [inputs(spec, call, members, r) for r in range(size)]
    kind, dtype = spec["kind"], spec["dtype"]
    results = []
    for k in range(len(spec["rows"])):
        mine = [everyone[r][k] for r in range(size)]
        if kind.endswith("allreduce") or kind == "allreduce_":
            results.append(reduced(mine, dtype, spec["op"]))
        elif kind.startswith("broadcast"):
            results.append(mine[spec["root"]])
        elif kind.endswith("allgather"):
            results.append(np.concatenate(mine))
        elif kind == "alltoall":
            splits = spec["splits"] or [[2] * size] * size
            blocks = []
            for r in range(size):
                start = sum(splits[r][:rank])
                blocks.append(mine[r][start:start + splits[r][rank]])
            results.append(np.concatenate(blocks))
        else:
            start, end = my_rows(mine[0].shape[0], size, rank)
            results.append(reduced(mine, dtype, spec["op"])[start:end])
    return results


def run_and_check(program, process_set, where):
    """Pushes the whole program on this rank, then checks every result."""
    members, rank = process_set.ranks, process_set.rank()
    pushed = [push(spec, call, process_set, rank) for call, spec in enumerate(program)]
    for call, (spec, (outputs, received)) in enumerate(zip(program, pushed)):
        want = expect(spec, call, members, rank)
        where = f"call {call} of {where}: {spec}"
        assert len(outputs) == len(want), where
        for got, exp in zip(outputs, want):
            got = got.asnumpy()
            assert got.dtype == exp.dtype and got.shape == exp.shape, where
            assert np.array_equal(got, exp), where
        if received is not None:
            assert received.dtype == np.int32, where
            assert received.asnumpy().tolist() == [s[rank] for s in spec["splits"]], where


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_program_pushed_at_once(world, algo, seed):
    _, size = world
    info = _core.stats()["shm"]
    run_and_check(draw(seed * 100 + size, size), hvd.global_process_set,
                  f"seed {seed} ({algo})")
    if "direct" in algo and 1 < size == hvd.local_size():  # on one host
        # Some of the program's moves read the peers' buffers.
        assert _core.stats()["shm"]["direct_exchanges"] > info["direct_exchanges"]


@pytest.mark.parametrize("seed", [4, 5])
def test_random_programs_on_even_and_odd_sets_at_once(world, algo, seed):
    rank, size = world
    even = hvd.add_process_set(list(range(0, size, 2)))
    odd = hvd.add_process_set(list(range(1, size, 2))) if size > 1 else None
    try:
        mine = even if rank % 2 == 0 else odd
        parity = rank % 2
        run_and_check(draw(seed * 1000 + size * 10 + parity, mine.size()), mine,
                      f"seed {seed} on the {'odd' if parity else 'even'} ranks ({algo})")
    finally:
        hvd.remove_process_set(even)
        if odd is not None:
            hvd.remove_process_set(odd)
