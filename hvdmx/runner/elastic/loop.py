"""hvdmxrun's elastic loop: starts one worker process a slot of the usable
hosts, watches them, and keeps the job going while hosts fail and come
(docs/elastic.md).

- A worker that exits 0 has finished; once one has, no worker is started
  any more and the job ends when the last exits.
- A worker killed by a signal (or whose remote shell lost it: exit 255, or a
  shell's 128 + N) is a failed host: the host is blacklisted (with the
  cooldown of --blacklist-cooldown-range, else for good), its other workers
  are stopped, and the survivors, whose collectives failed, join a new
  generation (membership.py).
- A host that leaves the discovery (the discovery script no longer prints
  it, or, inside a Slurm allocation, Slurm drains it or marks it down) has
  left the job: its workers are stopped (not blacklisted: should it come
  back, it gets workers again), and the survivors join a new generation, as
  after a failure. So are the workers of slots a host no longer has.
- A worker that exits with any other status failed in the training script:
  that is the user's error, not the machine's, so it is not retried; every
  worker is stopped and hvdmxrun exits with that status.
- Every membership change is one line on stderr:
  ``hvdmxrun: resumed at size N after X.X s`` (from the failure, or the new
  host's start, to rank 0's report that the job's state is restored in the
  new generation).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Mapping, Optional

from hvdmx.runner.elastic.hosts import HostManager, Slot, slots_of
from hvdmx.rendezvous.elastic_wire import SLOT_VARIABLE
from hvdmx.runner.elastic.membership import Membership
from hvdmx.runner.hosts import UsageError


StartWorker = Callable[[Slot, Mapping[str, str]], subprocess.Popen]


def lost(returncode: int) -> bool:
    """Whether a worker's exit status means its process or host was lost
    (a signal; a remote shell's 255; a shell's 128 + N) rather than an
    error of the training script."""
    return returncode < 0 or returncode >= 128


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    if returncode == 255:
        return "exit status 255 (its remote shell lost the connection)"
    return f"exit status {returncode}"


class ElasticLauncher:
    def __init__(self, hosts: HostManager, membership: Membership, start_worker: StartWorker,
                 max_np: Optional[int], discovery_interval: float = 1.0,
                 say: Optional[Callable[[str], None]] = None,
                 clock: Callable[[], float] = time.monotonic,
                 stop_grace: float = 5.0) -> None:
        self.hosts = hosts
        self.membership = membership
        self.start_worker = start_worker
        self.max_np = max_np
        self.discovery_interval = discovery_interval
        # One line of the launcher's log (hvdmxrun's NoMpiJob.say adds the prefix).
        self.say = say or (lambda line: print(f"hvdmxrun: {line}", file=sys.stderr, flush=True))
        self.clock = clock
        self.stop_grace = stop_grace
        self.workers: Dict[Slot, subprocess.Popen] = {}
        self.lost_hosts: List[str] = []
        self._finished = False
        self._change_at: Optional[float] = None  # a failure or a new worker, not yet resumed
        self._resumed_seen = 0
        self.signalled: Optional[int] = None  # set by a signal handler: stop the job

    def log(self, line: str) -> None:
        self.say(line)

    # ---- workers ----------------------------------------------------------

    def fill(self) -> None:
        """Stops the workers of slots no longer usable (their host left the
        discovery, or a failed one), then starts a worker on every usable
        slot that has none, up to max_np."""
        available = slots_of(self.hosts.usable(), None)
        self._leave(available)
        for slot in available:
            if self.max_np is not None and len(self.workers) >= self.max_np:
                return
            if slot in self.workers:
                continue
            self.workers[slot] = self.start_worker(slot, {SLOT_VARIABLE: f"{slot[0]}:{slot[1]}"})
            self.membership.add(slot)
            if self.membership.generation > 0 and self._change_at is None:
                self._change_at = self.clock()

    def _stop(self, slots: List[Slot]) -> None:
        """SIGTERM, then SIGKILL after the grace, to the workers of ``slots``."""
        procs = [self.workers.pop(slot) for slot in slots if slot in self.workers]
        for slot in slots:
            self.membership.remove(slot)
        for proc in procs:
            if proc.stdin is not None:  # hvdmxrun's bootstrap stops its rank when it ends
                try:
                    proc.stdin.close()
                except OSError:
                    pass
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + self.stop_grace
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its session (start_new_session)
                except (ProcessLookupError, PermissionError):
                    proc.kill()
                proc.wait()

    def _leave(self, available: List[Slot]) -> None:
        """Stops the workers whose slot is not in ``available``, host by host."""
        keep = set(available)
        gone: Dict[str, List[Slot]] = {}
        for slot in self.workers:
            if slot not in keep:
                gone.setdefault(slot[0], []).append(slot)
        for host, slots in gone.items():
            if host not in self.lost_hosts:
                self.lost_hosts.append(host)
            if self._change_at is None:
                self._change_at = self.clock()
            self.log(f"host {host} left the discovered hosts (or has fewer slots); its "
                     f"worker(s) {', '.join(f'{h}:{i}' for h, i in slots)} are stopped and "
                     "the job goes on without them")
            self._stop(slots)

    def stop_all(self) -> None:
        self._stop(list(self.workers))

    def fail_host(self, host: str, why: str) -> None:
        self.hosts.fail(host)
        if host not in self.lost_hosts:
            self.lost_hosts.append(host)
        self._stop([slot for slot in self.workers if slot[0] == host])
        if self._change_at is None:
            self._change_at = self.clock()
        self.log(f"host {host} failed ({why}); its workers are stopped and it is left out"
                 + ("" if self.hosts.cooldown is None else " until its cooldown has passed"))

    # ---- the loop ---------------------------------------------------------

    def step(self) -> Optional[int]:
        """One pass of the loop; the job's exit status once it is over."""
        if self.signalled is not None:
            self.log(f"got {signal.Signals(self.signalled).name}; stopping the workers")
            self.membership.end("hvdmxrun was stopped by a signal")
            self.stop_all()
            return 128 + self.signalled
        for slot, proc in list(self.workers.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.workers[slot]
            self.membership.remove(slot)
            if code == 0:
                self._finished = True
            elif lost(code):
                self.fail_host(slot[0], f"worker {slot[0]}:{slot[1]} ended by {_describe(code)}")
            else:
                self.log(f"worker {slot[0]}:{slot[1]} exited with {_describe(code)}: an error "
                         "in the training script, which is not retried; stopping the job")
                self.membership.end("the job stopped: a worker's training script failed")
                self.stop_all()
                return code
        for slot in self.membership.take_left_out():
            self.fail_host(slot[0], f"worker {slot[0]}:{slot[1]} did not rejoin within the "
                           "join window")
        resumed = self.membership.resumed
        for generation, size in resumed[self._resumed_seen:]:
            if generation > 1 and self._change_at is not None:
                self.log(f"resumed at size {size} after {self.clock() - self._change_at:.1f} s")
                self._change_at = None
        self._resumed_seen = len(resumed)
        if self._finished:
            if not self.workers:
                return 0
            return None
        why = self.membership.poll()
        if why is not None:
            lost_hosts = ", ".join(self.lost_hosts) or "none"
            self.log(f"error: the job cannot go on: {why}; hosts lost: {lost_hosts}")
            self.stop_all()
            return 1
        return None

    def run(self) -> int:
        """Runs the job to its end; returns hvdmxrun's exit status."""
        self.fill()
        next_discovery = self.clock() + self.discovery_interval
        try:
            while True:
                status = self.step()
                if status is not None:
                    return status
                if not self._finished and self.clock() >= next_discovery:
                    try:
                        self.fill()
                    except UsageError as error:  # the discovery script failed this time
                        self.log(f"warning: {error}; the hosts stay as they were")
                    next_discovery = self.clock() + self.discovery_interval
                time.sleep(0.05)
        finally:
            self.membership.end("hvdmxrun has stopped the job")
            self.stop_all()
