"""hvdmxrun --no-mpi: starts the ranks itself, without MPI's launcher, and
serves their rendezvous (hvdmx/rendezvous/server.py) from this process.

    hvdmxrun --no-mpi -np 4 -H a:2,b:2 [--ssh-exec PATH] python train.py

Ranks on this host are child processes; ranks on another host are started
through a remote shell called as Hydra calls ssh, ``SHELL -x HOST 'WORDS'``
(``ssh -x -o BatchMode=yes -o ConnectTimeout=20`` by default, or
``--ssh-exec PATH``), WORDS being ``cd DIR && exec [env PYTHONPATH=...]
PYTHON -m hvdmx.runner.bootstrap COMMAND ...``. Every rank gets HVDMX_RENDEZVOUS (the
address of this process's server that reaches its host), HVDMX_RANK,
HVDMX_SIZE, HVDMX_LOCAL_RANK/SIZE, HVDMX_CROSS_RANK/SIZE, the tuning
variables, and on other hosts the variables MPI launchers forward
(FORWARDED_NAMES/PREFIXES). The job's secret key is never on a command line:
each rank's first line of standard input carries it, and a remote rank's
variables with it (See Note [The rank's bootstrap]).

Each line a rank prints comes out here with its rank, as horovodrun's
Gloo mode prints it: ``[1]<stdout>:text`` on stdout, ``[1]<stderr>:text``
on stderr. When a rank exits with a status other than 0 (or is killed), the
others are stopped (SIGTERM, then SIGKILL after STOP_GRACE_SECONDS) and
hvdmxrun exits with that status after naming the rank and its host; SIGINT,
SIGTERM or SIGHUP to hvdmxrun stop every rank the same way (exit 128 + N).

Everything but NoMpiJob is a pure function of its arguments, so that the
commands are testable without starting anything.
"""
from __future__ import annotations

import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Dict, List, Mapping, Optional, Sequence, Tuple

from hvdmx.rendezvous.server import RendezvousServer
from hvdmx.rendezvous.wire import ADDRESS_VARIABLE, KEY_VARIABLES, TIMEOUT_VARIABLE, parse_key, \
    parse_timeout
from hvdmx.runner.bootstrap import variables_line
from hvdmx.runner.hosts import Host, UsageError, check_remote_starts, format_hosts, is_this_host, \
    unused_hosts
from hvdmx.runner.mpi import FORWARDED_NAMES, FORWARDED_PREFIXES, PROG

STOP_GRACE_SECONDS = 10.0  # after SIGTERM to the ranks, before SIGKILL
DEFAULT_SHELL = ("ssh", "-x", "-o", "BatchMode=yes", "-o", "ConnectTimeout=20")
SHELL_FLAG = "--ssh-exec PATH"

# What each rank runs first, on its host (See Note [The rank's bootstrap]
# in hvdmx/runner/bootstrap.py).
BOOTSTRAP = "hvdmx.runner.bootstrap"
# The variables a remote interpreter needs before it can run the bootstrap
# (PYTHONPATH finds hvdmx, LD_LIBRARY_PATH may find libpython): on its command
# line. The others reach it on its standard input.
_INTERPRETER_NAMES = ("PYTHONPATH", "LD_LIBRARY_PATH")


@dataclass(frozen=True)
class Placement:
    """Where a rank runs and its place in the topology (Horovod's names)."""
    rank: int
    host: str
    local: bool  # on this host: a child process, no remote shell
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def place_ranks(num_proc: int, hosts: Optional[Sequence[Host]],
                here=is_this_host) -> List[Placement]:
    """The ranks in order: the slots of `hosts` fill in list order (default:
    all on this host). cross_rank/cross_size are the host's place among the
    hosts that have a rank with the same local rank, as in Horovod."""
    if not hosts:
        hosts = [Host(socket.gethostname(), num_proc)]
    counts: List[Tuple[Host, int]] = []
    left = num_proc
    for host in hosts:
        if left <= 0:
            break
        counts.append((host, min(host.slots, left)))
        left -= host.slots
    out: List[Placement] = []
    for index, (host, count) in enumerate(counts):
        local = here(host.name)
        for local_rank in range(count):
            with_it = [i for i, (_, n) in enumerate(counts) if n > local_rank]
            out.append(Placement(len(out), host.name, local, local_rank, count,
                                 with_it.index(index), len(with_it)))
    return out


def job_key(environ: Mapping[str, str]) -> str:
    """The job's key, as 64 hex digits: the one the user set, checked, or a
    fresh one."""
    import secrets
    for name in KEY_VARIABLES:
        if environ.get(name):
            try:
                parse_key(environ[name], name)
            except ValueError as error:
                raise UsageError(str(error)) from None
            return environ[name]
    return secrets.token_hex(32)


def rank_env(place: Placement, size: int, address: str, tuning: Mapping[str, str]
             ) -> Dict[str, str]:
    """The variables of one rank (tuning last: a flag wins over the user's
    environment)."""
    env = {ADDRESS_VARIABLE: address, "HVDMX_RANK": str(place.rank), "HVDMX_SIZE": str(size),
           "HVDMX_LOCAL_RANK": str(place.local_rank),
           "HVDMX_LOCAL_SIZE": str(place.local_size),
           "HVDMX_CROSS_RANK": str(place.cross_rank),
           "HVDMX_CROSS_SIZE": str(place.cross_size)}
    env.update(tuning)
    return env


def forwarded(environ: Mapping[str, str]) -> Dict[str, str]:
    """What a rank on another host gets of this process's environment: the
    variables MPI launchers forward, without the secret key."""
    return {name: value for name, value in environ.items()
            if (name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES))
            and name not in KEY_VARIABLES}


def rank_command(place: Placement, env: Mapping[str, str], command: Sequence[str],
                 shell: Sequence[str], python: str, cwd: str) -> List[str]:
    """The argument list that starts one rank: the bootstrap (See Note [The
    rank's bootstrap]) here, or through `shell` on another host with those of
    `env` (its variables) that its interpreter needs to start; the others
    reach it on its standard input (first_line)."""
    argv = [python, "-m", BOOTSTRAP, *command]
    if place.local:
        return argv
    early = [f"{name}={env[name]}" for name in _INTERPRETER_NAMES if name in env]
    words = ["exec", *(["env", *early] if early else []), *argv]
    return [*shell, place.host, f"cd {shlex.quote(cwd)} && {shlex.join(words)}"]


def first_line(place: Placement, env: Mapping[str, str], key: str) -> bytes:
    """The first line of a rank's standard input: the job's key, and for a
    rank on another host the variables of `env` not on its command line."""
    variables = {} if place.local else \
        {name: value for name, value in env.items() if name not in _INTERPRETER_NAMES}
    variables["HVDMX_SECRET_KEY"] = key
    return variables_line(variables)


def describe_command(place: Placement, cmd: Sequence[str]) -> str:
    """A command as --verbose and --dry-run print it."""
    return shlex.join(cmd)


def rendezvous_addresses(places: Sequence[Placement]) -> Tuple[str, Dict[str, str]]:
    """(the address to listen on, {host: the address it reaches this host
    at}): the loopback when every rank is here; otherwise every interface,
    and each other host the address of this host's interface on the route
    to it."""
    remote = sorted({p.host for p in places if not p.local})
    if not remote:
        return "127.0.0.1", {}
    found = {}
    for name in remote:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((name, 9))  # sends nothing: picks the route only
                found[name] = probe.getsockname()[0]
        except OSError as error:
            raise UsageError(f"-H: host {name!r} has no route from this host ({error}); "
                             "check its name or address") from None
    return "0.0.0.0", found


def remote_shell(ssh_exec: Optional[str], environ: Mapping[str, str]) -> List[str]:
    if ssh_exec is None:
        return list(DEFAULT_SHELL)
    found = shutil.which(ssh_exec, path=environ.get("PATH", os.defpath))
    if found is None:
        raise UsageError(f"--ssh-exec {ssh_exec!r} is not an executable file (or not found on "
                         "PATH); name a program that is called as ssh is: PATH [options] "
                         "HOST COMMAND")
    return [found, "-x"]


@dataclass
class _Rank:
    place: Placement
    process: subprocess.Popen
    code: Optional[int] = None


class NoMpiJob:
    """One job: the server, the ranks, their output and their end.

    run() returns hvdmxrun's exit status. It is called from the main thread
    (it installs handlers for SIGINT, SIGTERM and SIGHUP while it runs)."""

    def __init__(self, places: Sequence[Placement], command: Sequence[str],
                 environ: Mapping[str, str], tuning: Mapping[str, str],
                 shell: Sequence[str], verbose: bool = False,
                 stdout: Optional[IO[bytes]] = None, stderr: Optional[IO[bytes]] = None):
        self.places, self.command = list(places), list(command)
        self.environ, self.tuning, self.shell = dict(environ), dict(tuning), list(shell)
        self.verbose = verbose
        self.stdout = stdout or sys.stdout.buffer
        self.stderr = stderr or sys.stderr.buffer
        self.key = job_key(self.environ)
        try:
            self.timeout = parse_timeout(self.environ.get(TIMEOUT_VARIABLE))
        except ValueError as error:
            raise UsageError(str(error)) from None
        self.events: "queue.Queue[Tuple[str, int]]" = queue.Queue()
        self.output_lock = threading.Lock()
        self.ranks: List[_Rank] = []
        self.pumps: List[threading.Thread] = []

    def say(self, text: str) -> None:
        with self.output_lock:
            self.stderr.write(f"{PROG}: {text}\n".encode())
            self.stderr.flush()

    def run(self) -> int:
        listen, routes = rendezvous_addresses(self.places)
        server = RendezvousServer(len(self.places), bytes.fromhex(self.key), host=listen,
                                  timeout=self.timeout,
                                  on_problem=lambda text: self.say(f"rendezvous: {text}"))
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        previous = {s: signal.signal(s, lambda n, _f: self.events.put(("signal", n)))
                    for s in handled}
        try:
            return self._run(server, routes)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._stop()
            for pump in self.pumps:
                pump.join(5)
            server.close()

    def _start(self, place: Placement, address: str) -> subprocess.Popen:
        env = rank_env(place, len(self.places), address, self.tuning)
        return self._spawn(place, env, f"rank {place.rank}")

    def _spawn(self, place: Placement, env: Mapping[str, str], label: str) -> subprocess.Popen:
        """Starts one process with `env` (this job's variables) where `place`
        says; `label` names it in --verbose's line."""
        if place.local:
            cmd = rank_command(place, env, self.command, self.shell, sys.executable,
                               os.getcwd())
            full = {n: v for n, v in self.environ.items() if n not in KEY_VARIABLES}
            full.update(env)
        else:
            remote = dict(forwarded(self.environ), **env)
            cmd = rank_command(place, remote, self.command, self.shell, sys.executable,
                               os.getcwd())
            full = {n: v for n, v in self.environ.items() if n not in KEY_VARIABLES}
        if self.verbose:
            self.say(f"{label} on {place.host}: {describe_command(place, cmd)}")
        # A session of its own: a Ctrl-C at the terminal reaches this process
        # only, which stops the ranks in order; and _stop can kill the group.
        process = subprocess.Popen(cmd, env=full, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   start_new_session=True)
        assert process.stdin is not None
        try:
            process.stdin.write(first_line(place, env if place.local else remote, self.key))
            process.stdin.flush()
        except OSError:
            pass  # it died at once: its exit status says why
        return process

    def _pump(self, rank: object, stream: IO[bytes], out: IO[bytes], name: str) -> None:
        prefix = f"[{rank}]<{name}>:".encode()
        for line in iter(stream.readline, b""):
            with self.output_lock:
                try:
                    out.write(prefix + line + (b"" if line.endswith(b"\n") else b"\n"))
                    out.flush()
                except (OSError, ValueError):
                    pass  # our output is closed: keep reading, so the rank never blocks
        stream.close()

    def _pump_output(self, tag: object, process: subprocess.Popen) -> None:
        """Forwards the process's lines, tagged [tag], on threads."""
        for stream, out, name in ((process.stdout, self.stdout, "stdout"),
                                  (process.stderr, self.stderr, "stderr")):
            pump = threading.Thread(target=self._pump, args=(tag, stream, out, name), daemon=True)
            pump.start()
            self.pumps.append(pump)

    def _wait(self, index: int, process: subprocess.Popen) -> None:
        process.wait()
        self.events.put(("exit", index))

    def _run(self, server: RendezvousServer, routes: Mapping[str, str]) -> int:
        for place in self.places:
            address = server.address("127.0.0.1" if place.local else routes[place.host])
            try:
                process = self._start(place, address)
            except OSError as error:
                self.say(f"cannot start rank {place.rank} on {place.host}: {error}")
                return 127
            rank = _Rank(place, process)
            self.ranks.append(rank)
            self._pump_output(place.rank, process)
            threading.Thread(target=self._wait, args=(len(self.ranks) - 1, process),
                             daemon=True).start()
        left = len(self.ranks)
        while left:
            kind, value = self.events.get()
            if kind == "signal":
                name = signal.Signals(value).name
                self.say(f"got {name}; stopping the ranks")
                return 128 + value
            rank = self.ranks[value]
            rank.code = rank.process.returncode
            left -= 1
            if rank.code != 0:
                code = rank.code
                status = (f"was killed by signal {signal.Signals(-code).name}" if code < 0
                          else f"exited with status {code}")
                stopping = "; stopping the other ranks" if left else ""
                self.say(f"rank {rank.place.rank} (host {rank.place.host}) {status}{stopping}")
                return 128 - code if code < 0 else code
        return 0

    def _stop(self) -> None:
        """SIGTERM to every rank still running (and the end of its standard
        input), SIGKILL to what is left after STOP_GRACE_SECONDS."""
        running = [r for r in self.ranks if r.process.poll() is None]
        for rank in running:
            try:
                rank.process.send_signal(signal.SIGTERM)
            except OSError:
                pass
        for rank in self.ranks:
            if rank.process.stdin is not None:
                try:
                    rank.process.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for rank in running:
            try:
                rank.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for rank in self.ranks:
            # The group of a rank here holds its bootstrap, the rank and what
            # it started; another host's is reached through the remote shell,
            # whose end ends the rank's standard input there.
            try:
                os.killpg(rank.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            rank.process.wait()


def launch(num_proc: int, hosts: Optional[List[Host]], host_flag: str,
           command: Sequence[str], environ: Mapping[str, str], tuning: Mapping[str, str],
           ssh_exec: Optional[str] = None, check_hosts: bool = True, verbose: bool = False,
           dry_run: bool = False, host_timeout: float = 60) -> int:
    """hvdmxrun --no-mpi after parsing: checks the hosts (as for MPI), then
    runs the job (or prints its commands with `dry_run`); returns the exit
    status. UsageError for what is wrong before anything starts."""
    shell = remote_shell(ssh_exec, environ)
    places = place_ranks(num_proc, hosts)
    if hosts and unused_hosts(num_proc, hosts):
        print(f"{PROG}: warning: -np {num_proc} fills the slots of {host_flag} "
              f"({format_hosts(hosts)}) in order, so {', '.join(unused_hosts(num_proc, hosts))} "
              "get(s) no process; raise -np or list fewer hosts", file=sys.stderr)
    if hosts and check_hosts:
        check_remote_starts(hosts[:len({p.host for p in places})], shell,
                            timeout=host_timeout, shell_flag=SHELL_FLAG)
    if dry_run:
        routes = {p.host: "ADDRESS" for p in places if not p.local}
        for place in places:
            env = rank_env(place, num_proc, f"{routes.get(place.host, '127.0.0.1')}:PORT",
                           tuning)
            cmd = rank_command(place, env if place.local else dict(forwarded(environ), **env),
                               command, shell, sys.executable, os.getcwd())
            where = "here" if place.local else "through the remote shell"
            extra = f" with {' '.join(f'{n}={v}' for n, v in env.items())}"
            if not place.local:  # and on its standard input, by name only
                names = sorted(set(forwarded(environ)) - set(env) - set(_INTERPRETER_NAMES))
                extra += f" and hvdmxrun's {', '.join(names)}" if names else ""
            print(f"rank {place.rank} on {place.host} ({where}){extra}: "
                  f"{describe_command(place, cmd)}")
        return 0
    return NoMpiJob(places, command, environ, tuning, shell, verbose=verbose).run()
