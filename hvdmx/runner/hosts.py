"""hvdmxrun's hosts: the -H list and the hostfile, how many processes go
where, and whether each host resolves and can start a process (see
hvdmx/runner/launch.py, the launcher, which uses these)."""
from __future__ import annotations

import re
import shlex
import shutil
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import List, NamedTuple, Optional, Sequence

class UsageError(Exception):
    """A bad flag, value or environment; the message names it and the fix."""


class Host(NamedTuple):
    name: str
    slots: int


# ---- hosts ----------------------------------------------------------------

def _host_from(text: str, where: str) -> Host:
    """'name' (1 slot) or 'name:slots'."""
    name, sep, slots_text = text.partition(":")
    if not name or any(c.isspace() for c in name) or "=" in name or ":" in slots_text:
        raise UsageError(f"{where}: {text!r} is not a host; write 'host' or 'host:slots', "
                         "e.g. 'node1:4'")
    if not sep:
        return Host(name, 1)
    if not re.fullmatch(r"[0-9]+", slots_text) or int(slots_text) < 1:
        raise UsageError(f"{where}: {text!r} has slots {slots_text!r}; the slots after ':' "
                         "must be an integer >= 1, e.g. 'node1:4'")
    return Host(name, int(slots_text))


def _no_duplicates(hosts: List[Host], where: str) -> List[Host]:
    seen = set()
    for host in hosts:
        if host.name in seen:
            raise UsageError(f"{where}: host {host.name!r} is listed more than once; list "
                             "each host once with its total slots")
        seen.add(host.name)
    return hosts


def parse_hosts(spec: str, flag: str = "-H/--hosts") -> List[Host]:
    """Parses -H's 'a:2,b:2' (a host without ':N' has one slot); errors name
    `flag` (run_function's argument is ``hosts=``)."""
    where = f"{flag} {spec!r}"
    items = spec.split(",")
    if not spec.strip() or any(not item.strip() for item in items):
        raise UsageError(f"{where} has an empty entry; write host:slots pairs separated by "
                         "commas, e.g. node1:4,node2:4")
    return _no_duplicates([_host_from(item.strip(), where) for item in items], where)


def parse_hostfile(text: str, path: str, flag: str = "--hostfile") -> List[Host]:
    """Parses a hostfile: one host a line, as 'host slots=N', 'host:N' or 'host'
    (one slot); '#' starts a comment; blank lines are skipped."""
    hosts = []
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{flag} {path!r}, line {number}"
        host = _host_from(words[0], where)
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key != "slots" or ":" in words[0]:
                raise UsageError(f"{where}: {line.strip()!r} is not understood; write "
                                 "'host slots=N' or 'host:N'")
            if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
                raise UsageError(f"{where}: slots={value!r}; slots must be an integer >= 1")
            host = Host(host.name, int(value))
        hosts.append(host)
    if not hosts:
        raise UsageError(f"{flag} {path!r} lists no hosts; add lines such as "
                         "'node1 slots=4'")
    return _no_duplicates(hosts, f"{flag} {path!r}")


def read_hostfile(path: str, flag: str = "--hostfile") -> List[Host]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise UsageError(f"{flag} {path!r} cannot be read ({reason}); pass a readable "
                         "text file with one 'host slots=N' line per host") from None
    return parse_hostfile(text, path, flag)


def format_hosts(hosts: Sequence[Host]) -> str:
    return ",".join(f"{host.name}:{host.slots}" for host in hosts)


def resolve_num_proc(num_proc: Optional[int], hosts: Optional[List[Host]],
                     host_flag: str, np_flag: str = "-np") -> int:
    """-np, or the hosts' total slots when -np is not given. Asking for more
    processes than slots is refused for every MPI (Open MPI refuses it too, MPICH
    would stack the extra ranks on the listed hosts): list more slots instead."""
    if hosts is None:
        if num_proc is None:
            raise UsageError("give the number of processes with -np N (or hosts with "
                             "-H/--hostfile, whose slots then set it), before the command: "
                             "hvdmxrun -np 4 python train.py")
        return num_proc
    slots = sum(host.slots for host in hosts)
    if num_proc is None:
        return slots
    if num_proc > slots:
        raise UsageError(f"{np_flag} {num_proc} is more than the {slots} slot(s) of {host_flag} "
                         f"({format_hosts(hosts)}); lower {np_flag} to {slots} or give the hosts "
                         "more slots (host:slots)")
    return num_proc


def unused_hosts(num_proc: int, hosts: Sequence[Host]) -> List[str]:
    """The hosts that get no process: the slots fill in list order, so -np
    below the total leaves the last hosts empty."""
    unused, left = [], num_proc
    for host in hosts:
        if left <= 0:
            unused.append(host.name)
        left -= host.slots
    return unused


def unresolved_hosts(hosts: Sequence[Host], host_flag: str,
                     resolve=socket.getaddrinfo) -> None:
    """Refuses a host whose name does not resolve here: the launcher would
    fail on it later, with a message about ssh or a proxy."""
    for host in hosts:
        try:
            resolve(host.name, None)
        except (OSError, UnicodeError) as e:
            reason = getattr(e, "strerror", None) or str(e)
            raise UsageError(f"{host_flag}: host {host.name!r} does not resolve on this machine "
                             f"({reason}); check the name, or give its address, or make it "
                             "resolve (DNS, /etc/hosts)") from None


def is_this_host(name: str) -> bool:
    """Whether `name` is this machine (its name, localhost, or one of its
    addresses): no remote shell is needed to start a process there."""
    here = socket.gethostname()
    if name in ("localhost", here, here.split(".")[0]):
        return True
    try:
        addresses = {str(a[4][0]) for a in socket.getaddrinfo(name, None)}
        mine = {str(a[4][0]) for a in socket.getaddrinfo(here, None)}
    except OSError:
        return False
    return any(a.startswith("127.") or a == "::1" or a in mine for a in addresses)


_MPI_SHELL_FLAG = ("--mpi-args \"-launcher-exec PATH\" (Open MPI: \"--mca plm_rsh_agent "
                   "PATH\")")


def check_remote_starts(hosts: Sequence[Host], shell: Sequence[str], timeout: float = 60,
                        is_this_host=is_this_host, shell_flag: str = _MPI_SHELL_FLAG) -> None:
    """Starts `true` on every host that is not this one through `shell`, all
    at once; refuses the first that fails or takes over `timeout` seconds,
    naming it and the fix, before the launcher would fail or wait on it.
    `shell_flag` is how the user names another remote shell (the fix)."""
    remote = [h.name for h in hosts if not is_this_host(h.name)]
    if not remote:
        return
    if shutil.which(shell[0]) is None:
        raise UsageError(f"hosts {', '.join(remote)} would be reached with {shell[0]!r}, which "
                         f"is not found; install it, or name the remote shell with {shell_flag}, "
                         "or pass --no-host-check")

    def attempt(name):
        cmd = [*shell, name, "true"]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                    stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return name, cmd, f"no answer within {timeout:g} s"
        except OSError as e:
            return name, cmd, str(e)
        if result.returncode != 0:
            said = (result.stderr or result.stdout).strip().splitlines()
            return name, cmd, f"exit {result.returncode}" + (f": {said[-1]}" if said else "")
        return None

    with ThreadPoolExecutor(max_workers=min(16, len(remote))) as pool:
        for failure in pool.map(attempt, remote):
            if failure:
                name, cmd, why = failure
                raise UsageError(f"cannot start a process on host {name!r}: '{shlex.join(cmd)}' "
                                 f"failed ({why}); make '{shlex.join([*shell, name])}' work "
                                 "without a password prompt (ssh keys, known hosts), or name "
                                 f"another remote shell with {shell_flag}, or pass "
                                 "--no-host-check to skip this check")
