"""The data path allocates nothing per call: once warm, large allreduces
(alone, in place, and small ones fused) touch no fresh memory, and neither
do the new outputs of out-of-place calls, which come from the output pool.

A buffer malloc'ed per call is, at 64 MiB, a fresh mapping with glibc's
default settings (above its largest dynamic mmap threshold, 32 MiB), and
every page of it faults on first touch. MPICH's own MPI_Allreduce does this:
run with HVDMX_ALLREDUCE_ALGO=mpi, the large test below counts about 8,200
faults per call and fails. Page faults are counted for the whole process
(getrusage) and for hvdmx's background thread, which runs the collectives
and the fusion copies (/proc/self/task/*/stat). Nothing is timed.
"""
import os
import resource

import mxnet as mx
import numpy as np
import pytest

import hvdmx as hvd
from conftest import all_equal_across_ranks
from helpers import restarted

MIB = 1 << 20
CALLS = 4
# A fresh 64 MiB buffer per call would fault 16384 times per call (4 KiB
# pages; about 530 when most of it lands on huge pages), a fused group's
# 4 MiB 1024 times: over CALLS calls, at least twice MAX_FAULTS. Python and
# MXNet's own bookkeeping fault a few dozen times at most.
MAX_FAULTS = 1000


def process_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def runtime_thread_faults() -> int:
    """Minor faults of the threads named hvdmx-runtime (one per runtime)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # the thread has just exited
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        if name == "hvdmx-runtime":
            total += int(fields.split()[7])  # field 10 of proc(5): minflt
    return total


def faults_over(calls, step, warmup=3):
    """(process, background thread) minor faults over `calls` warm steps."""
    for _ in range(warmup):  # warm: buffers, caches and mappings are made here
        step()
    before = process_faults(), runtime_thread_faults()
    for _ in range(calls):
        step()
    return process_faults() - before[0], runtime_thread_faults() - before[1]


@pytest.mark.parametrize("algo", ["auto", "shm", "ring"])
def test_large_in_place_allreduce_faults_no_pages(world, algo):
    rank, size = world
    if algo == "shm" and size == 1:
        pytest.skip("one rank has no peers to share memory with")
    with restarted({"HVDMX_ALLREDUCE_ALGO": algo}):
        count = 64 * MIB // 4
        x = mx.nd.ones((count,), dtype="float32")

        def step():
            hvd.allreduce_(x, op=hvd.Max, name="alloc.large").wait_to_read()

        faults, thread_faults = faults_over(CALLS, step)
        assert faults < MAX_FAULTS, f"{faults} page faults over {CALLS} calls with {algo}"
        assert thread_faults < MAX_FAULTS, f"{thread_faults} in hvdmx's thread with {algo}"
        got = x.asnumpy()
        assert np.array_equal(got, np.ones(count, dtype="float32"))
        assert all_equal_across_ranks(got)


@pytest.mark.parametrize("kind", ["allreduce", "broadcast", "allgather", "alltoall"])
def test_large_outputs_fault_no_pages(world, kind):
    """Each call returns a new 64 MiB output. From MXNet's allocator that is a
    fresh mapping every time (about 530 faults a call here, most of them for
    2 MiB huge pages, each zeroed by the kernel); from the output pool, the
    memory of the output dropped a call before (Note [Output pool])."""
    rank, size = world
    count = 64 * MIB // 4
    x = mx.nd.full((count,), rank + 1, dtype="float32")
    part = x[:count // size]
    step = {
        "allreduce": lambda: hvd.allreduce(x, op=hvd.Max, name="alloc.out.ar"),
        "broadcast": lambda: hvd.broadcast(x, root_rank=size - 1, name="alloc.out.bc"),
        "allgather": lambda: hvd.allgather(part, name="alloc.out.ag"),
        "alltoall": lambda: hvd.alltoall(x[:count // size * size], name="alloc.out.a2a"),
    }[kind]
    last = []

    def call():
        last[:] = [step()]  # the previous output is dropped here
        last[0].wait_to_read()

    faults, _ = faults_over(CALLS, call)
    assert faults < MAX_FAULTS, f"{faults} page faults over {CALLS} out-of-place {kind}s"
    got = last[0].asnumpy()
    if kind in ("allreduce", "broadcast"):
        assert np.array_equal(got, np.full(count, size, dtype="float32"))
    else:
        want = np.repeat(np.arange(1, size + 1, dtype="float32"), count // size)
        assert np.array_equal(got, want[:got.size])


@pytest.mark.parametrize("algo", ["auto", "ring"])
def test_fused_small_allreduces_fault_no_pages(world, algo):
    rank, size = world
    # auto: shared memory, reading the tensors where they are; ring: through
    # the fusion buffer, which grows (once) to the largest group it has seen.
    # Which tensors share a round depends on timing: a 20 ms cycle puts the
    # whole round's 64 tensors in one group from the warm-up on.
    with restarted({"HVDMX_CYCLE_TIME": "20", "HVDMX_ALLREDUCE_ALGO": algo}):
        check_fused(rank, size)


def check_fused(rank, size):
    tensors = [mx.nd.full((16 * 1024,), rank + 1, dtype="float32") for _ in range(64)]  # 64 KiB

    def step():
        outs = [hvd.allreduce_(t, op=hvd.Max, name=f"alloc.small.{i}")
                for i, t in enumerate(tensors)]
        mx.nd.waitall()
        return outs

    # Only hvdmx's own thread: the whole process also counts what Python and
    # MXNet allocate for 64 calls a round, which depends on the state of
    # their heaps (in a full suite run, 128 faults a round; alone, none).
    _, thread_faults = faults_over(CALLS, step, warmup=5)
    assert thread_faults < MAX_FAULTS, f"{thread_faults} page faults over {CALLS} fused rounds"
    for t in tensors:
        got = t.asnumpy()
        assert np.array_equal(got, np.full(16 * 1024, size, dtype="float32"))
        assert all_equal_across_ranks(got)
