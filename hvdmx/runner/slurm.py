"""A Slurm allocation as hvdmxrun reads it: the nodes of SLURM_JOB_NODELIST,
written in Slurm's compressed host-list syntax, and the tasks of each from
SLURM_TASKS_PER_NODE. Pure functions of the environment (no Slurm command is
run), so they are tested against `scontrol show hostnames` and with any
input; a malformed value is a UsageError naming the variable and the value.

The syntax, as Slurm writes these variables:
- a node list is entries separated by commas outside brackets:
  ``node[01-03,7],gpu-a1`` is node01 node02 node03 node7 gpu-a1;
- an entry is text with bracket groups; each group lists numbers and
  ranges ``LO-HI`` (LO <= HI) separated by commas, and an entry with several
  groups stands for every combination, the first group varying slowest
  (``r[1-2]n[1-2]``: r1n1 r1n2 r2n1 r2n2), and ends with its last group;
- a number written with leading zeros fixes the width of every number of its
  range (``[08-10]``: 08 09 10), as Slurm prints zero-padded node names;
- a task count is ``N`` or ``N(xK)`` (K nodes with N tasks each), separated by
  commas: ``2(x3),1`` is 2, 2, 2, 1.
"""
from __future__ import annotations

import re
from typing import List, Mapping, NamedTuple, Optional

from hvdmx.runner.hosts import Host, UsageError

NODELIST = "SLURM_JOB_NODELIST"
TASKS = "SLURM_TASKS_PER_NODE"
JOB_ID = "SLURM_JOB_ID"
# A node list longer than this is refused rather than expanded (a typo such
# as [1-100000000] would otherwise fill the memory).
MAX_NODES = 100_000

_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TASK = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


class Allocation(NamedTuple):
    job_id: str
    hosts: List[Host]          # the nodes in Slurm's order, each with its tasks as slots

    @property
    def tasks(self) -> int:
        return sum(host.slots for host in self.hosts)


def _bad(variable: str, value: str, why: str) -> UsageError:
    what = "task counts" if variable == TASKS else "node list"
    return UsageError(f"{variable}={value!r} is not a Slurm {what}: {why}. hvdmxrun reads "
                      "it inside a Slurm allocation (salloc, sbatch, srun); run it there, or "
                      "unset SLURM_JOB_ID and name the hosts with -H")


def _split_top(text: str, variable: str, value: str) -> List[str]:
    """Splits at the commas outside brackets; brackets must pair, unnested."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            if depth:
                raise _bad(variable, value, f"a '[' inside brackets at position {i}")
            depth = 1
        elif c == "]":
            if not depth:
                raise _bad(variable, value, f"a ']' without its '[' at position {i}")
            depth = 0
        elif c == "," and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise _bad(variable, value, "a '[' is not closed")
    parts.append(text[start:])
    return parts


def _group(body: str, variable: str, value: str) -> List[str]:
    """The numbers of one bracket group, as strings of their width."""
    numbers: List[str] = []
    for item in body.split(","):
        match = _RANGE.fullmatch(item)
        if not match:
            raise _bad(variable, value, f"'[{body}]' holds {item!r}; a bracket lists numbers "
                       "and ranges LO-HI separated by commas")
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if low > high:
            raise _bad(variable, value, f"the range {item!r} runs backwards")
        if len(numbers) + high - low + 1 > MAX_NODES:
            raise _bad(variable, value, f"it names more than {MAX_NODES} nodes")
        width = len(low_text) if low_text.startswith("0") and len(low_text) > 1 else 0
        numbers.extend(str(n).zfill(width) for n in range(low, high + 1))
    return numbers


def expand_nodelist(value: str, variable: str = NODELIST) -> List[str]:
    """The node names of a Slurm node list, in its order."""
    if not value or value != value.strip() or any(c.isspace() for c in value):
        raise _bad(variable, value, "it is empty or holds white space")
    names: List[str] = []
    for entry in _split_top(value, variable, value):
        if not entry:
            raise _bad(variable, value, "it has an empty entry (two commas in a row, or a "
                       "comma at an end)")
        pieces = re.split(r"\[([^\]]*)\]", entry)  # text, group, text, group, ..., text
        if len(pieces) > 1 and pieces[-1]:
            raise _bad(variable, value, f"the entry {entry!r} goes on after its last ']'")
        expanded = [""]
        for index, piece in enumerate(pieces):
            choices = _group(piece, variable, value) if index % 2 else [piece]
            if len(expanded) * len(choices) + len(names) > MAX_NODES:
                raise _bad(variable, value, f"it names more than {MAX_NODES} nodes")
            expanded = [head + choice for head in expanded for choice in choices]
        if expanded == [""] or any(not name or name.startswith("-") for name in expanded):
            raise _bad(variable, value, f"the entry {entry!r} names no host")
        names.extend(expanded)
    seen = set()
    for name in names:
        if name in seen:
            raise _bad(variable, value, f"node {name!r} is listed more than once")
        seen.add(name)
    return names


def expand_tasks(value: str, variable: str = TASKS) -> List[int]:
    """The task counts of SLURM_TASKS_PER_NODE, one per node: '2(x3),1' is
    [2, 2, 2, 1]."""
    counts: List[int] = []
    for item in value.split(","):
        match = _TASK.fullmatch(item)
        if not match:
            raise _bad(variable, value, f"{item!r} is not 'N' or 'N(xK)'")
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        if count < 1 or repeat < 1:
            raise _bad(variable, value, f"{item!r} counts zero")
        if len(counts) + repeat > MAX_NODES:
            raise _bad(variable, value, f"it counts more than {MAX_NODES} nodes")
        counts.extend([count] * repeat)
    return counts


def allocation(environ: Mapping[str, str]) -> Optional[Allocation]:
    """The allocation this process runs in (SLURM_JOB_ID set), or None.
    Each node's slots are its tasks (SLURM_TASKS_PER_NODE): what salloc or
    sbatch was asked for, e.g. -N 2 --ntasks-per-node=2."""
    job = environ.get(JOB_ID)
    if not job:
        return None
    for name in (NODELIST, TASKS):
        if not environ.get(name):
            raise UsageError(f"{JOB_ID}={job!r} is set but {name} is not: hvdmxrun cannot "
                             "tell the allocation's nodes and tasks. Run it in the job's "
                             "own shell or script (salloc, sbatch), where Slurm sets both, "
                             "or name the hosts with -H")
    nodes = expand_nodelist(environ[NODELIST])
    tasks = expand_tasks(environ[TASKS])
    if len(tasks) != len(nodes):
        raise UsageError(f"{TASKS}={environ[TASKS]!r} counts tasks for {len(tasks)} node(s), "
                         f"but {NODELIST}={environ[NODELIST]!r} lists {len(nodes)}; both "
                         "must come from the same allocation")
    return Allocation(job, [Host(name, count) for name, count in zip(nodes, tasks)])
