"""An elastic job's hosts inside a Slurm allocation: the allocation's nodes
(SLURM_JOB_NODELIST) with their tasks as slots (SLURM_TASKS_PER_NODE),
less the nodes that Slurm says can no longer run work. hvdmxrun uses it for
an elastic job (--min-np, --max-np) started inside an allocation with no
-H, --hostfile or --host-discovery-script (docs/clusters.md).

Slurm does not end the steps running on a node that an administrator
drains (`scontrol update nodename=X state=drain`); the node only takes no
new jobs. So the job must leave such a node by itself: each discovery runs

    sinfo -h -N -n NODELIST -o '%N %t'

(one line per node: its name and its compact state) and keeps a node only
while its state is one that runs jobs: alloc, mix, comp, idle, resv, maint,
plnd, without a suffix saying it does not answer or is powered off (`*`,
`~`, `%`, `!`). A drained or draining node (drain, drng), one down or
failing (down, fail, failg), and any other state, leave the job: the loop
(loop.py) stops their workers and the others go on. A node that sinfo does
not list leaves too. A node back in a good state (`scontrol update
nodename=X state=resume`) is discovered again and gets workers again, as
a host a discovery script prints again does.
"""
from __future__ import annotations

import shlex
import subprocess
from typing import Dict, List, Sequence

from hvdmx.runner.hosts import Host, UsageError

# The compact states (sinfo's %t) of a node that runs its jobs' steps.
RUNNING_STATES = frozenset({"alloc", "mix", "comp", "idle", "resv", "maint", "plnd"})
# Suffixes of a state: the node does not answer (*), is powered off (~),
# powering down (%) or about to (!).
LOST_SUFFIXES = frozenset("*~%!")
# Every suffix sinfo may add to a compact state.
SUFFIXES = "*~#!%$@^-"


def sinfo_command(nodelist: str) -> List[str]:
    """The sinfo command that reports the state of each node of ``nodelist``
    (Slurm's compressed syntax, as SLURM_JOB_NODELIST holds it)."""
    return ["sinfo", "-h", "-N", "-n", nodelist, "-o", "%N %t"]


def _error(command: Sequence[str], what: str, output: str) -> UsageError:
    said = output.strip()[-500:] or "no output"
    return UsageError(f"the Slurm discovery of hvdmxrun's elastic job: `{shlex.join(command)}` "
                      f"{what}: {said!r}. hvdmxrun runs it inside the allocation to leave "
                      "drained or failed nodes out; make sinfo work here (SLURM_CONF, PATH), "
                      "or name the hosts with --host-discovery-script or -H")


def parse_sinfo(text: str, command: Sequence[str]) -> Dict[str, str]:
    """Each node's compact state from sinfo's ``%N %t`` lines. A node listed
    more than once (it is in several partitions) keeps its first state; a
    line that is not a node and a state is an error naming the command."""
    states: Dict[str, str] = {}
    for raw in text.splitlines():
        words = raw.split()
        if not words:
            continue
        if len(words) != 2:
            raise _error(command, f"printed the line {raw!r}, not 'NODE STATE'", text)
        states.setdefault(words[0], words[1])
    return states


def runs_jobs(state: str) -> bool:
    """Whether a node in compact ``state`` (with its suffix) runs work."""
    base = state.rstrip(SUFFIXES)
    suffix = state[len(base):]
    return base in RUNNING_STATES and not set(suffix) & LOST_SUFFIXES


def usable(hosts: Sequence[Host], states: Dict[str, str]) -> Dict[str, int]:
    """The allocation's hosts (in its order, with their slots) that Slurm
    lists in a state that runs work."""
    return {host.name: host.slots for host in hosts
            if host.name in states and runs_jobs(states[host.name])}


class SlurmDiscovery:
    """A discovery for HostManager: called about every second by the loop,
    it returns the usable hosts of the allocation; UsageError naming the
    command and its output when sinfo fails or prints what it should not."""

    def __init__(self, nodelist: str, hosts: Sequence[Host], timeout: float = 30) -> None:
        self.command = sinfo_command(nodelist)
        self.hosts = list(hosts)
        self.timeout = timeout

    def __call__(self) -> Dict[str, int]:
        try:
            done = subprocess.run(self.command, capture_output=True, text=True,
                                  timeout=self.timeout, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise _error(self.command, "could not be run", str(error)) from error
        if done.returncode != 0:
            raise _error(self.command, f"exited with status {done.returncode}",
                         done.stderr + done.stdout)
        return usable(self.hosts, parse_sinfo(done.stdout, self.command))


__all__ = ["SlurmDiscovery", "parse_sinfo", "runs_jobs", "sinfo_command", "usable"]
