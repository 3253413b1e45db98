"""How the tasks of one srun step meet when no launcher of hvdmx started them
(``srun -N 2 --ntasks-per-node=2 python train.py``): rank, size and the
node's tasks come from Slurm's variables, task 0 serves the rendezvous on a
thread of its own process, and the others find it through a meeting file.
Standard library and the rendezvous only, like the rest of this package.

    group = group_from_slurm()     # this task's StoreGroup, as rank SLURM_PROCID

Note [Meeting under srun]
Task 0 (SLURM_PROCID=0) starts a RendezvousServer for the step's
SLURM_STEP_NUM_TASKS tasks and writes the meeting file

    $HVDMX_SRUN_DIR/<cluster>-<job>.<step>.json  (default ~/.hvdmx/srun/)

holding the addresses the server listens on and a fresh 256-bit key. The
file is made 0600 under another name and renamed into place, so a reader
sees it whole or not at all; the directory, when hvdmx makes it, is 0700.
Every other task waits for the file (HVDMX_RENDEZVOUS_TIMEOUT, 300 s by
default), refuses one that is not a regular file of its own user readable
by it alone (another user may have planted it), reads it and connects. A
file left by an earlier step of the same number (task 0 killed; a cluster
whose job numbers began again) names a server that is gone or holds another
key: the task reads the file again until the deadline, so task 0's new file
replaces it. Task 0 removes the file once every task has joined
(forget_meeting, called by hvd.init()) and, failing that, when it exits.

With HVDMX_SECRET_KEY set (the same in every task, from the batch script's
environment, say), the file holds no key but a check of it (an HMAC of a
fixed label), so a task whose key differs stops at once, saying so, instead
of being refused by the server until the timeout.

So who can join the job is who can read the file (its user, and root on
any node that mounts the directory) or who holds HVDMX_SECRET_KEY; the
trust model is written out in docs/running.md, "Who can join a job".
"""
from __future__ import annotations

import atexit
import json
import os
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple, cast

from hvdmx.rendezvous.client import StoreGroup, connect
from hvdmx.rendezvous.server import RendezvousServer
from hvdmx.rendezvous.wire import KEY_BYTES, KEY_VARIABLES, ProtocolError, RendezvousError, \
    TIMEOUT_VARIABLE, mac, parse_key, parse_timeout

DIR_VARIABLE = "HVDMX_SRUN_DIR"
DEFAULT_DIR = os.path.join("~", ".hvdmx", "srun")
FORMAT = "hvdmx-srun-1"
# How long one try to reach task 0's server may take before the file is
# read again (a stale file's server is gone, or is another one).
_CONNECT_TRY_SECONDS = 5.0
_POLL_SECONDS = 0.2


@dataclass(frozen=True)
class SlurmTask:
    """This task's place in its srun step, from Slurm's variables."""
    rank: int        # SLURM_PROCID
    size: int        # SLURM_STEP_NUM_TASKS (SLURM_NTASKS when that is not set)
    local_rank: int  # SLURM_LOCALID
    job: str         # SLURM_JOB_ID
    step: str        # SLURM_STEP_ID
    cluster: str     # SLURM_CLUSTER_NAME ("slurm" when not set)
    node: str        # this node's name

    def describe(self) -> str:
        return f"task {self.rank} of {self.size} (node {self.node})"


def _integer(environ: Mapping[str, str], name: str, low: int, high: Optional[int] = None) -> int:
    text = environ.get(name)
    if text is None:
        raise ValueError(f"hvdmx under srun: {name} is not set, but the other variables of an "
                         "srun task are; hvd.init() reads rank and size from Slurm's SLURM_PROCID, "
                         "SLURM_STEP_NUM_TASKS (or SLURM_NTASKS) and SLURM_LOCALID: start the "
                         "job with srun, or unset SLURM_STEP_ID to run one process alone")
    if not text.isdigit() or int(text) < low or (high is not None and int(text) > high):
        bound = f">= {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"hvdmx under srun: {name}={text!r} must be an integer {bound} (Slurm "
                         "sets it for every task; a script that changes it breaks the job's "
                         "numbering): leave it as srun set it")
    return int(text)


def _word(environ: Mapping[str, str], name: str, default: Optional[str] = None) -> str:
    text = environ.get(name, default)
    if text is None or not text or any(c in text for c in "/\0\n") or text in (".", ".."):
        raise ValueError(f"hvdmx under srun: {name}={text!r} is not what srun sets (a job or "
                         "step number, or a cluster's name); leave it as srun set it")
    return text


def task_from_environment(environ: Mapping[str, str]) -> SlurmTask:
    """This task's place, from the variables srun sets for it; ValueError
    naming the variable and its value when one is missing or malformed."""
    size_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    size = _integer(environ, size_name, 1)
    return SlurmTask(rank=_integer(environ, "SLURM_PROCID", 0, size - 1), size=size,
                     local_rank=_integer(environ, "SLURM_LOCALID", 0, size - 1),
                     job=_word(environ, "SLURM_JOB_ID"), step=_word(environ, "SLURM_STEP_ID"),
                     cluster=_word(environ, "SLURM_CLUSTER_NAME", "slurm"),
                     node=socket.gethostname())


def meeting_path(task: SlurmTask, environ: Mapping[str, str]) -> str:
    """The meeting file of the task's step (Note [Meeting under srun])."""
    directory = environ.get(DIR_VARIABLE) or os.path.expanduser(DEFAULT_DIR)
    if not os.path.isabs(directory):
        raise ValueError(f"hvdmx under srun: {DIR_VARIABLE}={directory!r} must be an absolute "
                         "path to a directory that every node of the job sees (a shared "
                         "filesystem)")
    return os.path.join(directory, f"{task.cluster}-{task.job}.{task.step}.json")


def _key_check(key: bytes) -> str:
    return mac(key, b"hvdmx-srun key check").hex()[:16]


def _environment_key(environ: Mapping[str, str]) -> Optional[bytes]:
    for name in KEY_VARIABLES:
        if environ.get(name):
            return parse_key(environ[name], name)
    return None


def _interface_addresses() -> List[str]:
    """Every IPv4 address of this host's interfaces but loopback's."""
    import fcntl  # here: only task 0 of an srun step needs it
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address, or down
            address = socket.inet_ntoa(answer[20:24])
            if not address.startswith("127."):
                found.append(address)
    return found


def server_addresses(environ: Mapping[str, str]) -> List[str]:
    """The addresses task 0 offers the others, best first: HVDMX_TCP_IFACE's
    alone when set (as the ranks' own connections use it), else the one the
    host's name resolves to, then its other interfaces'."""
    iface = environ.get("HVDMX_TCP_IFACE") or environ.get("HOROVOD_TCP_IFACE")
    interfaces = _interface_addresses() if not iface else []
    if iface:
        import fcntl
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                answer = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s",
                                                                         iface.encode()[:15]))
            except OSError as error:
                raise ValueError(f"hvdmx under srun: HVDMX_TCP_IFACE={iface!r} has no IPv4 "
                                 f"address on {socket.gethostname()} ({error})") from None
        return [socket.inet_ntoa(answer[20:24])]
    addresses = []
    try:
        named = socket.gethostbyname(socket.gethostname())
        if not named.startswith("127."):
            addresses.append(named)
    except OSError:
        pass
    addresses += [a for a in interfaces if a not in addresses]
    return addresses or ["127.0.0.1"]


class _Meeting:
    """Task 0's side: the server, and the file while it exists."""

    def __init__(self, server: RendezvousServer, path: Optional[str]):
        self.server, self.path = server, path
        self.lock = threading.Lock()

    def forget(self) -> None:
        """Removes the meeting file (idempotent)."""
        with self.lock:
            path, self.path = self.path, None
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.forget()
        self.server.close()


_meeting: Optional[_Meeting] = None


def forget_meeting() -> None:
    """Called once every task has joined (hvd.init() has run): task 0
    removes the meeting file; a no-op elsewhere."""
    if _meeting is not None:
        _meeting.forget()


def _close_meeting() -> None:
    if _meeting is not None:
        _meeting.close()


def _write_meeting(path: str, record: Dict[str, object]) -> None:
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        temporary = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, json.dumps(record).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)  # over a stale file of an earlier step of this number
    except OSError as error:
        raise OSError(f"hvdmx under srun: task 0 cannot write the meeting file {path} "
                      f"({error}); set {DIR_VARIABLE} to a directory this user can write that "
                      "every node of the job sees") from None


def _read_meeting(path: str, task: SlurmTask) -> Optional[Dict[str, object]]:
    """The meeting file's record, or None while it is not there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise PermissionError(f"hvdmx under srun: {task.describe()} cannot open the meeting "
                              f"file {path} ({error}); remove it if it is not this job's") \
            from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise PermissionError(
                f"hvdmx under srun: the meeting file {path} belongs to user {info.st_uid} with "
                f"mode {info.st_mode & 0o777:o}, but task 0 of this job writes it as user "
                f"{os.getuid()} with mode 600: someone else may have put it there, and "
                f"{task.describe()} will not trust it; remove it, or set {DIR_VARIABLE} to a "
                "directory that only this user can write")
        data = b""
        while True:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    try:
        record = json.loads(data.decode())
        if not isinstance(record, dict) or record.get("format") != FORMAT or \
                not isinstance(record.get("addresses"), list):
            raise ValueError("not a meeting record")
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"hvdmx under srun: {path} is not a meeting file of hvdmx "
                         f"({FORMAT}); remove it") from None
    return record


def _serve(task: SlurmTask, environ: Mapping[str, str], timeout: float
           ) -> Tuple[StoreGroup, bytes]:
    global _meeting
    given = _environment_key(environ)
    key = given or secrets.token_bytes(KEY_BYTES)
    path = meeting_path(task, environ) if task.size > 1 else None
    server = RendezvousServer(task.size, key, timeout=timeout)
    _meeting = _Meeting(server, None)
    atexit.register(_close_meeting)
    if path is not None:
        record: Dict[str, object] = {
            "format": FORMAT, "node": task.node, "pid": os.getpid(),
            "addresses": [server.address(a) for a in server_addresses(environ)]}
        if given is None:
            record["key"] = key.hex()
        else:
            record["key_check"] = _key_check(given)
        _write_meeting(path, record)
        _meeting.path = path
    return connect(server.address("127.0.0.1"), key, 0, task.size, slot=task.local_rank), key


def _join(task: SlurmTask, environ: Mapping[str, str], timeout: float
          ) -> Tuple[StoreGroup, bytes]:
    path = meeting_path(task, environ)
    given = _environment_key(environ)
    deadline = time.monotonic() + timeout
    tried: Optional[str] = None  # the file's text of the last failed try
    why = ""
    while True:
        record = _read_meeting(path, task)
        if record is not None and json.dumps(record, sort_keys=True) != tried:
            if "key" in record and given is not None:
                raise PermissionError(
                    f"hvdmx under srun: HVDMX_SECRET_KEY is set for task {task.rank} (node "
                    f"{task.node}) but not for task 0 ({record.get('node')}); set the same key "
                    "for every task (export it before srun), or for none: task 0 then makes one")
            if "key" not in record and given is None:
                raise PermissionError(
                    f"hvdmx under srun: HVDMX_SECRET_KEY is set for task 0 "
                    f"({record.get('node')}) but not for task {task.rank} (node {task.node}); "
                    "set the same key for every task (export it before srun), or for none: "
                    "task 0 then makes one")
            if given is not None and record.get("key_check") != _key_check(given):
                raise PermissionError(
                    f"hvdmx under srun: HVDMX_SECRET_KEY of task {task.rank} (node {task.node}) "
                    f"is not task 0's ({record.get('node')}); set the same key for every task")
            try:
                key = given if given is not None else parse_key(str(record["key"]))
            except ValueError:
                raise ValueError(f"hvdmx under srun: {path} holds a malformed key: it is not "
                                 f"a meeting file of hvdmx ({FORMAT}); remove it") from None
            for address in cast(List[object], record["addresses"]):  # checked: a list
                try:
                    return connect(str(address), key, task.rank, task.size,
                                   slot=task.local_rank,
                                   connect_timeout=min(_CONNECT_TRY_SECONDS,
                                                       max(0.0, deadline - time.monotonic())),
                                   unreachable=str(address)), key
                except (OSError, ProtocolError, RendezvousError) as error:
                    why = str(error)
            tried = json.dumps(record, sort_keys=True)
        if time.monotonic() > deadline:
            break
        time.sleep(_POLL_SECONDS)
    if tried is None:
        raise TimeoutError(
            f"hvdmx under srun: {task.describe()} waited {timeout:g} s ({TIMEOUT_VARIABLE}) for "
            f"task 0 to write the meeting file {path}, and it did not appear. Task 0 did not "
            "reach hvd.init() (see its errors), or that directory is not the same on every "
            f"node: set {DIR_VARIABLE} to a directory that every node of the job sees, or, "
            "with no shared filesystem, start the job with hvdmxrun inside the allocation "
            "(salloc or sbatch), which needs none")
    raise ConnectionError(
        f"hvdmx under srun: {task.describe()} cannot reach task 0's rendezvous, named in "
        f"{path}, within {timeout:g} s ({TIMEOUT_VARIABLE}): {why}. Task 0 may have stopped, "
        "or its addresses are not reachable from this node (set HVDMX_TCP_IFACE to the "
        "interface the nodes share)")


def group_from_slurm(environ: Optional[Mapping[str, str]] = None
                     ) -> Tuple[StoreGroup, bytes]:
    """This task's group in its srun step (Note [Meeting under srun]), and
    the job's key, which the ranks' own connections prove as well.
    ValueError names a malformed variable; TimeoutError, ConnectionError and
    PermissionError say which task on which node could not join, and why."""
    env = os.environ if environ is None else environ
    task = task_from_environment(env)
    timeout = parse_timeout(env.get(TIMEOUT_VARIABLE))
    if task.rank == 0:
        return _serve(task, env, timeout)
    return _join(task, env, timeout)
