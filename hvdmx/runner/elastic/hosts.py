"""An elastic job's hosts, as hvdmxrun sees them: which hosts may run ranks
now (the -H list, or what --host-discovery-script prints), which failed and
wait out a cooldown, and how the ranks of a new membership are numbered.
Pure logic, below the launcher: the clock and the script are passed in, so
that every rule is testable without processes.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hvdmx.runner.hosts import UsageError

# A worker process is one slot of one host: (host, slot index on that host).
Slot = Tuple[str, int]


def parse_discovery_output(text: str, slots_per_host: Optional[int],
                           script: str) -> Dict[str, int]:
    """What a discovery script printed: one host a line, ``host`` or
    ``host:slots`` (Horovod's format); a line without slots takes
    ``slots_per_host``. Blank lines are skipped; a host listed twice, a bad
    slot count or a line without slots and no --slots-per-host is an error
    naming the script and the line."""
    hosts: Dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        name, sep, count = line.partition(":")
        where = f"--host-discovery-script {script!r} printed line {number} {raw!r}"
        if not name or any(c.isspace() for c in name):
            raise UsageError(f"{where}: expected 'host' or 'host:slots'")
        if sep:
            if not count.isdigit() or int(count) < 1:
                raise UsageError(f"{where}: the slots after ':' must be a whole number >= 1")
            slots = int(count)
        elif slots_per_host is not None:
            slots = slots_per_host
        else:
            raise UsageError(f"{where}: it gives no slots; print 'host:slots', or pass "
                             "--slots-per-host N")
        if name in hosts:
            raise UsageError(f"{where}: host {name!r} is listed twice")
        hosts[name] = slots
    return hosts


def run_discovery_script(script: str, slots_per_host: Optional[int],
                         timeout: float = 30) -> Dict[str, int]:
    """Runs the discovery script (an executable, no shell) and parses what it
    prints; a failing or hanging script is an error naming it."""
    try:
        done = subprocess.run([script], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise UsageError(f"--host-discovery-script {script!r} could not be run: {error}") \
            from error
    if done.returncode != 0:
        raise UsageError(f"--host-discovery-script {script!r} exited with status "
                         f"{done.returncode}: {done.stderr.strip()[-500:]}")
    return parse_discovery_output(done.stdout, slots_per_host, script)


@dataclass
class _Failure:
    count: int = 0
    until: float = 0.0


@dataclass
class HostManager:
    """The hosts an elastic job may use. ``discover()`` returns the hosts and
    their slots (the -H list, or the discovery script's answer); a host that
    failed is left out until its cooldown has passed: ``cooldown[0]`` seconds
    after its first failure, doubling with each further one, at most
    ``cooldown[1]`` (hvdmxrun's --blacklist-cooldown-range). Without a
    cooldown range, a failed host stays out for the rest of the job."""

    discover: Callable[[], Dict[str, int]]
    clock: Callable[[], float]
    cooldown: Optional[Tuple[float, float]] = None
    _failures: Dict[str, _Failure] = field(default_factory=dict)

    def fail(self, host: str) -> None:
        failure = self._failures.setdefault(host, _Failure())
        failure.count += 1
        if self.cooldown is None:
            failure.until = float("inf")
        else:
            low, high = self.cooldown
            failure.until = self.clock() + min(high, low * 2 ** (failure.count - 1))

    def blacklisted(self, host: str) -> bool:
        failure = self._failures.get(host)
        return failure is not None and self.clock() < failure.until

    def usable(self) -> Dict[str, int]:
        """The hosts to run ranks on now, in the order discovered."""
        return {host: slots for host, slots in self.discover().items()
                if not self.blacklisted(host)}


def slots_of(hosts: Dict[str, int], max_np: Optional[int]) -> List[Slot]:
    """Every slot of ``hosts`` in order (host by host), at most ``max_np``."""
    slots = [(host, i) for host, count in hosts.items() for i in range(count)]
    return slots if max_np is None else slots[:max_np]


@dataclass(frozen=True)
class Place:
    """A worker's place in one membership (generation) of the job."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def number_ranks(previous: Sequence[Slot], members: Sequence[Slot]) -> Dict[Slot, Place]:
    """The ranks of a new membership ``members``: the survivors of the
    previous one (``previous``, in its rank order) keep their order, so the
    oldest survivor is rank 0; workers new to the job follow, in the order
    given. Local ranks count within a host in rank order; cross ranks among
    the ranks of the same local rank, as hvd.init computes them."""
    member_set = set(members)
    if len(member_set) != len(members):
        raise ValueError(f"a membership lists a worker twice: {list(members)}")
    survivors = [slot for slot in previous if slot in member_set]
    known = set(survivors)
    order = survivors + [slot for slot in members if slot not in known]
    by_host: Dict[str, List[Slot]] = {}
    for slot in order:
        by_host.setdefault(slot[0], []).append(slot)
    local = {slot: (ranks.index(slot), len(ranks)) for ranks in by_host.values()
             for slot in ranks}
    by_local: Dict[int, List[Slot]] = {}
    for slot in order:
        by_local.setdefault(local[slot][0], []).append(slot)
    return {slot: Place(rank, len(order), local[slot][0], local[slot][1],
                        by_local[local[slot][0]].index(slot), len(by_local[local[slot][0]]))
            for rank, slot in enumerate(order)}
