"""Generations of an elastic job (hvdmx/runner/elastic/membership.py), with threads
as workers and a clock the test moves."""
import threading
import time

import pytest

from hvdmx.runner.elastic.membership import Membership, MembershipError

pytestmark = pytest.mark.timeout(60)

A, B, C, D = ("a", 0), ("b", 0), ("c", 0), ("d", 0)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def joining(membership, slots, timeout=30):
    """Starts a thread per slot that joins; returns {slot: result or error}."""
    results, threads = {}, []
    for slot in slots:
        def run(slot=slot):
            try:
                results[slot] = membership.join(slot, timeout)
            except MembershipError as error:
                results[slot] = error
        threads.append(threading.Thread(target=run, daemon=True))
        threads[-1].start()
    return results, threads


def wait_for(results, n):
    deadline = time.monotonic() + 20
    while len(results) < n:
        assert time.monotonic() < deadline, f"only {results} joined"
        time.sleep(0.01)


def test_the_first_generation_forms_when_every_worker_has_joined():
    m = Membership(min_np=2, elastic_timeout=60, join_window=5, clock=Clock())
    for slot in (A, B, C):
        m.add(slot)
    results, _ = joining(m, [A, B])
    time.sleep(0.2)
    assert results == {}  # C has not asked yet
    more, _ = joining(m, [C])
    wait_for(results, 2)
    wait_for(more, 1)
    results.update(more)
    assert {slot: r[1].rank for slot, r in results.items()} == {A: 0, B: 1, C: 2}
    assert all(r[0] == 1 and r[1].size == 3 for r in results.values())
    assert m.members() == [A, B, C]


def test_a_dead_worker_is_not_waited_for_and_survivors_keep_their_order():
    m = Membership(min_np=2, elastic_timeout=60, join_window=5, clock=Clock())
    for slot in (A, B, C):
        m.add(slot)
    results, _ = joining(m, [A, B, C])
    wait_for(results, 3)
    m.remove(A)  # the launcher saw A's process die
    results, _ = joining(m, [C, B])
    wait_for(results, 2)
    assert {slot: r[1].rank for slot, r in results.items()} == {B: 0, C: 1}
    assert all(r[0] == 2 for r in results.values())
    assert m.take_left_out() == []


def test_a_silent_worker_is_left_out_after_the_join_window():
    clock = Clock()
    m = Membership(min_np=2, elastic_timeout=60, join_window=5, clock=clock)
    for slot in (A, B, C):
        m.add(slot)
    first, _ = joining(m, [A, B, C])
    wait_for(first, 3)
    results, _ = joining(m, [A, B])  # C's host is cut off: it never asks
    time.sleep(0.2)
    assert results == {}
    clock.now += 5
    wait_for(results, 2)
    assert [r[1].size for r in results.values()] == [2, 2]
    assert m.take_left_out() == [C]
    assert m.take_left_out() == []


def test_too_few_workers_end_the_job_after_the_elastic_timeout():
    clock = Clock()
    m = Membership(min_np=2, elastic_timeout=30, join_window=5, clock=clock)
    m.add(A)
    m.add(B)
    m.remove(B)
    results, _ = joining(m, [A])
    assert m.poll() is None
    clock.now += 31
    assert "only 1 worker(s) left, fewer than --min-np 2, for 30 s" in m.poll()
    wait_for(results, 1)
    assert isinstance(results[A], MembershipError)


def test_a_newcomer_is_seen_once_it_waits_and_joins_with_the_members():
    clock = Clock()
    m = Membership(min_np=1, elastic_timeout=60, join_window=5, clock=clock)
    m.add(B)
    m.add(C)
    first, _ = joining(m, [B, C])
    wait_for(first, 2)
    assert not m.newcomers()
    m.add(A)  # a new host's worker, still starting: not seen yet
    assert not m.newcomers()
    results, _ = joining(m, [A], timeout=1000)
    deadline = time.monotonic() + 10
    while not m.newcomers():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # Waiting alone, it forms nothing, even past the join window: the
    # members join at their next commit.
    clock.now += 60
    time.sleep(0.2)
    assert results == {} and m.generation == 1
    more, _ = joining(m, [C, B])
    wait_for(results, 1)
    wait_for(more, 2)
    results.update(more)
    assert {slot: r[1].rank for slot, r in results.items()} == {B: 0, C: 1, A: 2}
    assert not m.newcomers() and m.take_left_out() == []


def test_a_newcomer_still_starting_is_not_waited_for_nor_left_out():
    clock = Clock()
    m = Membership(min_np=1, elastic_timeout=60, join_window=5, clock=clock)
    m.add(B)
    first, _ = joining(m, [B])
    wait_for(first, 1)
    m.add(A)
    m.remove(B)  # B's host fails while A starts; C joins the job
    m.add(C)
    results, _ = joining(m, [C])
    wait_for(results, 1)
    assert results[C][1].size == 1 and m.take_left_out() == []
    late, _ = joining(m, [A])
    assert m.newcomers()


def test_a_worker_not_in_the_job_cannot_join():
    m = Membership(min_np=1, elastic_timeout=60, join_window=5, clock=Clock())
    with pytest.raises(MembershipError, match="worker d:0 is not part of this job"):
        m.join(D, 1)


def test_resumed_is_recorded_once_per_generation():
    m = Membership(min_np=1, elastic_timeout=60, join_window=5, clock=Clock())
    m.add(A)
    results, _ = joining(m, [A])
    wait_for(results, 1)
    m.report_resumed(1)
    m.report_resumed(1)
    m.report_resumed(7)  # not the current generation: ignored
    assert m.resumed == [(1, 1)]
