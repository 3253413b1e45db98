"""hvd.init() binds every thread of a rank to one CPU when the host's ranks are
at least as many as their CPUs (Note [Binding a rank's threads to one CPU] in
csrc/hvdmx/platform/cpu_binding.h), and hvd.shutdown() gives the threads their
affinity back. The expected CPU is worked out here from what the launcher
gave each rank, so the tests hold at any -n and on any host.
"""
import os
import threading

import numpy as np
import pytest

import mxnet as mx
import hvdmx as hvd
from hvdmx import _core
import conftest
from conftest import host_allgather, restart


def thread_cpus() -> dict:
    """Every thread of this process: tid -> the CPUs it may run on."""
    cpus = {}
    for name in os.listdir("/proc/self/task"):
        try:
            cpus[int(name)] = frozenset(os.sched_getaffinity(int(name)))
        except OSError:  # the thread ended meanwhile
            pass
    return cpus


def launch_cpus():
    """(this rank's CPUs at launch, local rank, local size, whether every rank of
    this host has the same CPUs), once hvdmx runs again without binding."""
    restart({"HVDMX_CPU_BIND": "none"})
    mine = conftest.launch_cpus
    # Whatever the runs before bound, shutdown gave back.
    assert set(thread_cpus().values()) == {frozenset(mine)}
    every = host_allgather(mine)
    return mine, hvd.local_rank(), len(every), all(c == mine for c in every)


def expected_cpu(mode, cpus, local_rank, local_size, same):
    if mode == "none" or len(cpus) < 2:
        return None
    if mode == "auto" and (not same or local_size < len(cpus)):
        return None
    return cpus[local_rank % len(cpus)]


def check_still_works():
    x = mx.nd.array(np.arange(300, dtype=np.float32) + hvd.rank())
    got = hvd.allreduce(x, op=hvd.Sum, name="cpu_binding.check").asnumpy()
    want = np.arange(300, dtype=np.float32) * hvd.size() + sum(range(hvd.size()))
    assert np.array_equal(got, want)


@pytest.mark.parametrize("mode", ["auto", "core", "none"])
def test_binds_every_thread_and_gives_the_affinity_back(mode):
    cpus, local_rank, local_size, same = launch_cpus()
    want = expected_cpu(mode, cpus, local_rank, local_size, same)
    try:
        restart({"HVDMX_CPU_BIND": mode})
        binding = _core.stats()["cpu_binding"]
        now = thread_cpus()
        if want is None:
            assert binding["cpu"] == -1
            assert set(now.values()) == {frozenset(cpus)}
        else:
            assert binding["cpu"] == want
            # Those there before init (MXNet's among them), and hvdmx's own.
            assert set(now.values()) == {frozenset([want])}, now
            # A thread started later by a bound thread is bound too.
            seen = []
            t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
            t.start()
            t.join()
            assert seen == [{want}]
        # The shared-memory waits count the CPUs the process had at launch.
        assert binding["usable_cpus"] == len(cpus)
        check_still_works()
    finally:
        restart({"HVDMX_CPU_BIND": "none"})
    # Shutdown gave every thread its launch affinity back.
    assert _core.stats()["cpu_binding"]["cpu"] == -1
    assert set(thread_cpus().values()) == {frozenset(cpus)}
    restart({})


def test_a_thread_pinned_elsewhere_keeps_its_pinning_at_shutdown():
    cpus, local_rank, local_size, same = launch_cpus()
    want = expected_cpu("core", cpus, local_rank, local_size, same)
    if want is None:
        pytest.skip(f"this rank may run on {len(cpus)} CPU(s); binding needs two or more")
    other = next(c for c in cpus if c != want)
    pinned = []
    started, release = threading.Event(), threading.Event()

    def pinned_thread():
        pinned.append(threading.get_native_id())
        started.set()
        release.wait(60)

    t = threading.Thread(target=pinned_thread)
    try:
        restart({"HVDMX_CPU_BIND": "core"})
        t.start()
        assert started.wait(60)
        os.sched_setaffinity(pinned[0], {other})
        restart({"HVDMX_CPU_BIND": "none"})
        assert os.sched_getaffinity(pinned[0]) == {other}
        assert os.sched_getaffinity(0) == set(cpus)
    finally:
        release.set()
        t.join()
        restart({})
