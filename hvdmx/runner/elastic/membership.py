"""Who is in an elastic job, generation by generation: the launcher's side of
a reset (docs/elastic.md). Workers (one process a slot) ask to join. The
first generation forms when every worker started has asked; a later one
when every live member of the current generation has, with the newcomers
that wait (a newcomer still starting joins at the next reset), or, when a
live member stays silent (its host cut off), once the join window has
passed since a member asked, with at least --min-np workers waiting: the
silent members are then left out, and the launcher fails their hosts.
Survivors keep their rank order (the oldest is rank 0;
hosts.number_ranks). Thread-safe: the rendezvous's
connection threads call join(), the launcher's loop calls the rest.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

from hvdmx.runner.elastic.hosts import Place, Slot, number_ranks


class MembershipError(RuntimeError):
    """The job cannot go on: too few workers left for --min-np within
    --elastic-timeout, or the job ended while a worker waited to join."""


class Membership:
    def __init__(self, min_np: int, elastic_timeout: float, join_window: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.min_np = min_np
        self.elastic_timeout = elastic_timeout
        self.join_window = join_window
        self._clock = clock
        self._cv = threading.Condition()
        self.generation = 0
        self._alive: Set[Slot] = set()
        self._waiting: Set[Slot] = set()
        self._first_member_wait: Optional[float] = None  # when a member first asked to rejoin
        self._short_since: Optional[float] = None  # since when fewer than min_np could join
        self._places: Dict[Slot, Tuple[int, Place]] = {}  # each member's latest place
        self._order: List[Slot] = []  # the current generation, in rank order
        self._left_out: List[Slot] = []  # live workers the last generation left out
        self._ended: Optional[str] = None
        self.resumed: List[Tuple[int, int]] = []  # (generation, size) reported by rank 0

    # ---- the launcher's side ----------------------------------------------

    def add(self, slot: Slot) -> None:
        """A worker process has been started for ``slot``."""
        with self._cv:
            self._alive.add(slot)
            self._cv.notify_all()

    def remove(self, slot: Slot) -> None:
        """The worker of ``slot`` has exited or been stopped."""
        with self._cv:
            self._alive.discard(slot)
            self._waiting.discard(slot)
            self._cv.notify_all()

    def end(self, why: str) -> None:
        """The job is over: workers waiting to join get ``why``."""
        with self._cv:
            self._ended = why
            self._cv.notify_all()

    def started(self, slot: Slot) -> bool:
        """Whether a worker runs for ``slot`` (started, not exited)."""
        with self._cv:
            return slot in self._alive

    def members(self) -> List[Slot]:
        """The current generation's workers, in rank order."""
        with self._cv:
            return list(self._order)

    def take_left_out(self) -> List[Slot]:
        """Live workers that the latest generation formed without (their
        host is to be failed); each is returned once."""
        with self._cv:
            left, self._left_out = self._left_out, []
            return left

    def newcomers(self) -> bool:
        """Whether a worker outside the current generation waits to join:
        the members should reset to take it in (State.check_host_updates).
        One still starting (importing, say) is not counted yet."""
        with self._cv:
            return any(slot not in self._order for slot in self._waiting & self._alive)

    def poll(self) -> Optional[str]:
        """Forms a generation if one is due (the launcher calls this about
        every 0.1 s); returns why the job cannot go on, or None."""
        with self._cv:
            self._maybe_form()
            return self._ended

    # ---- the workers' side ------------------------------------------------

    def join(self, slot: Slot, timeout: float) -> Tuple[int, Place]:
        """Blocks until ``slot`` is in a new generation; returns it and the
        worker's place in it."""
        deadline = self._clock() + timeout
        with self._cv:
            if slot not in self._alive:
                raise MembershipError(f"worker {slot[0]}:{slot[1]} is not part of this job "
                                      "(its host failed or the job ended); it stops here")
            joined_at = self.generation
            self._waiting.add(slot)
            if self._first_member_wait is None and slot in self._order:
                self._first_member_wait = self._clock()
            self._cv.notify_all()
            while True:
                self._maybe_form()
                if slot in self._places and self._places[slot][0] > joined_at:
                    return self._places[slot]
                if self._ended is not None:
                    raise MembershipError(self._ended)
                if slot not in self._alive:
                    raise MembershipError(f"worker {slot[0]}:{slot[1]} was left out of the "
                                          "job's new membership (its host was failed)")
                if self._clock() >= deadline:
                    self._waiting.discard(slot)
                    raise MembershipError(f"worker {slot[0]}:{slot[1]} waited {timeout:g} s to "
                                          "join and no membership formed")
                self._cv.wait(0.05)

    def report_resumed(self, generation: int) -> None:
        """Rank 0 of ``generation`` has restored the job's state in it."""
        with self._cv:
            if generation == self.generation and \
                    not any(g == generation for g, _ in self.resumed):
                self.resumed.append((generation, len(self._order)))

    # ---- forming ----------------------------------------------------------

    def _maybe_form(self) -> None:
        now = self._clock()
        waiting = self._waiting & self._alive
        if len(self._alive) < self.min_np:
            if self._short_since is None:
                self._short_since = now
            elif now - self._short_since >= self.elastic_timeout and self._ended is None:
                self._ended = (f"only {len(self._alive)} worker(s) left, fewer than --min-np "
                               f"{self.min_np}, for {self.elastic_timeout:g} s "
                               "(--elastic-timeout)")
            return
        self._short_since = None
        members = set(self._order) & self._alive
        if self._order:
            # A reset: the live members, and the newcomers that have asked
            # (one still starting joins at the next reset). Only a member's
            # request starts the join window: newcomers waiting alone wait
            # for the members' next commit.
            expected = members | waiting
            started = self._first_member_wait
        else:
            expected = set(self._alive)  # the first generation: every worker started
            started = None
        if not waiting:
            return
        everyone = expected <= waiting
        window_over = started is not None and now - started >= self.join_window
        if not everyone and not (window_over and len(waiting) >= self.min_np):
            return
        ordered = [slot for slot in self._order if slot in waiting] + \
            sorted(waiting - set(self._order))
        places = number_ranks(self._order, ordered)
        self.generation += 1
        for slot, place in places.items():
            self._places[slot] = (self.generation, place)
        self._left_out += sorted(members - waiting)
        self._order = sorted(places, key=lambda s: places[s].rank)
        self._waiting.clear()
        self._first_member_wait = None
        self._cv.notify_all()
