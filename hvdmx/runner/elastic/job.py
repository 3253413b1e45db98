"""hvdmxrun's elastic job (--min-np, --max-np, --host-discovery-script):
the workers are started without MPI, as --no-mpi starts ranks
(hvdmx/runner/nompi.py: the bootstrap, the key on standard input, tagged output),
but each learns its rank at the elastic rendezvous (service.py) at
every reset, and loop.ElasticLauncher keeps the job going while
hosts fail and come. docs/elastic.md has the model.

    hvdmxrun -np 3 --min-np 2 -H a:1,b:1,c:1 python train.py
    hvdmxrun -np 2 --max-np 4 --host-discovery-script ./hosts.sh --slots-per-host 1 \\
        python train.py
    salloc -N 3 hvdmxrun --min-np 2 python train.py   # slurm_discovery.py
"""
from __future__ import annotations

import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hvdmx.runner.elastic.hosts import HostManager, Slot, run_discovery_script
from hvdmx.rendezvous.elastic_wire import RESET_LIMIT_VARIABLE
from hvdmx.runner.elastic.loop import ElasticLauncher
from hvdmx.runner.elastic.membership import Membership
from hvdmx.runner.elastic.service import ElasticService
from hvdmx.runner.elastic.slurm_discovery import SlurmDiscovery
from hvdmx.rendezvous.wire import ADDRESS_VARIABLE
from hvdmx.runner.hosts import Host, UsageError, is_this_host
from hvdmx.runner.nompi import NoMpiJob, Placement, remote_shell

# How long a generation waits for a live worker that has not asked to join
# (its host cut off) once --min-np have: seconds (HVDMX_ELASTIC_JOIN_WINDOW).
JOIN_WINDOW_VARIABLE = "HVDMX_ELASTIC_JOIN_WINDOW"
DEFAULT_JOIN_WINDOW = 10.0


@dataclass(frozen=True)
class ElasticOptions:
    num_proc: int
    min_np: int
    max_np: int
    hosts: Optional[List[Host]]  # -H/--hostfile, or None with a discovery script
    discovery_script: Optional[str]
    slots_per_host: Optional[int]
    elastic_timeout: float
    reset_limit: Optional[int]
    cooldown: Optional[Tuple[float, float]]
    # With hosts from a Slurm allocation: its SLURM_JOB_NODELIST, which the
    # discovery asks sinfo about (slurm_discovery.py).
    slurm_nodelist: Optional[str] = None


def check_options(num_proc: Optional[int], min_np: Optional[int], max_np: Optional[int],
                  hosts: Optional[List[Host]], discovery_script: Optional[str],
                  slots_per_host: Optional[int], elastic_timeout: float,
                  reset_limit: Optional[int],
                  cooldown: Optional[Sequence[float]],
                  slurm_nodelist: Optional[str] = None,
                  scheduler: Optional[str] = None) -> ElasticOptions:
    """The elastic flags, checked together; UsageError naming the flags.
    ``scheduler``: where ``hosts`` came from when a scheduler gave them (a
    Slurm allocation, the MPI Operator's hostfile): -np then defaults to
    their slots, at most --max-np. ``slurm_nodelist``: the hosts are the
    Slurm allocation's, whose nodes leave the job when Slurm drains them."""
    if discovery_script is not None and hosts is not None:
        raise UsageError("--host-discovery-script and -H/--hostfile both name the hosts; give "
                         "one of them")
    if discovery_script is None and hosts is None:
        hosts = [Host(socket.gethostname(), num_proc or max_np or min_np or 1)]
    if num_proc is None and scheduler and hosts:
        num_proc = sum(host.slots for host in hosts)
        if min_np is not None and min_np > num_proc:
            raise UsageError(f"--min-np {min_np} is more than the {num_proc} slot(s) of "
                             f"{scheduler}; ask the scheduler for more, or lower --min-np")
        if max_np is not None:
            num_proc = min(num_proc, max_np)
    if num_proc is None:
        num_proc = max_np or min_np
        if num_proc is None:
            raise UsageError("an elastic job needs -np (the processes to start with)")
    min_np = num_proc if min_np is None else min_np
    max_np = num_proc if max_np is None else max_np
    if not 1 <= min_np <= num_proc <= max_np:
        raise UsageError(f"--min-np {min_np}, -np {num_proc} and --max-np {max_np} must satisfy "
                         "1 <= min-np <= np <= max-np")
    if elastic_timeout <= 0:
        raise UsageError(f"--elastic-timeout {elastic_timeout:g} must be seconds > 0")
    if reset_limit is not None and reset_limit < 0:
        raise UsageError(f"--reset-limit {reset_limit} must be >= 0")
    pair = None
    if cooldown is not None:
        low, high = cooldown
        if not 0 < low <= high:
            raise UsageError(f"--blacklist-cooldown-range {low:g} {high:g}: expected MIN MAX "
                             "seconds with 0 < MIN <= MAX")
        pair = (float(low), float(high))
    if slots_per_host is not None and slots_per_host < 1:
        raise UsageError(f"--slots-per-host {slots_per_host} must be >= 1")
    return ElasticOptions(num_proc, min_np, max_np, hosts, discovery_script, slots_per_host,
                          elastic_timeout, reset_limit, pair, slurm_nodelist)


class ElasticJob(NoMpiJob):
    """The elastic job: the service, the workers, the loop. run() returns
    hvdmxrun's exit status; called from the main thread (it handles SIGINT,
    SIGTERM and SIGHUP while it runs)."""

    def __init__(self, options: ElasticOptions, command: Sequence[str],
                 environ: Mapping[str, str], tuning: Mapping[str, str], shell: Sequence[str],
                 verbose: bool = False):
        super().__init__([], command, environ, tuning, shell, verbose)
        self.options = options
        self._routes: Dict[str, str] = {}
        self._slurm = None if options.slurm_nodelist is None else \
            SlurmDiscovery(options.slurm_nodelist, options.hosts or ())
        try:
            self.join_window = float(environ.get(JOIN_WINDOW_VARIABLE, DEFAULT_JOIN_WINDOW))
        except ValueError:
            raise UsageError(f"{JOIN_WINDOW_VARIABLE}={environ[JOIN_WINDOW_VARIABLE]!r} must be "
                             "seconds") from None

    def _discover(self) -> Dict[str, int]:
        if self.options.discovery_script is not None:
            return run_discovery_script(self.options.discovery_script,
                                        self.options.slots_per_host)
        if self._slurm is not None:
            return self._slurm()
        return {host.name: host.slots for host in self.options.hosts or ()}

    def _address(self, service: ElasticService, host: str) -> str:
        if is_this_host(host):
            return service.address("127.0.0.1")
        if host not in self._routes:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host, 9))  # sends nothing: picks the route only
                self._routes[host] = probe.getsockname()[0]
        return service.address(self._routes[host])

    def _start_worker(self, service: ElasticService, slot: Slot,
                      extra: Mapping[str, str]) -> subprocess.Popen:
        host, index = slot
        env = {ADDRESS_VARIABLE: self._address(service, host), **extra}
        if self.options.reset_limit is not None:
            env[RESET_LIMIT_VARIABLE] = str(self.options.reset_limit)
        env.update(self.tuning)
        place = Placement(-1, host, is_this_host(host), index, 1, 0, 1)
        process = self._spawn(place, env, f"worker {host}:{index}")
        self._pump_output(f"{host}:{index}", process)
        return process

    def run(self) -> int:
        options = self.options
        membership = Membership(options.min_np, options.elastic_timeout, self.join_window)
        remote = options.discovery_script is not None or \
            any(not is_this_host(h.name) for h in options.hosts or ())
        service = ElasticService(bytes.fromhex(self.key), membership,
                                 host="0.0.0.0" if remote else "127.0.0.1",
                                 timeout=self.timeout,
                                 on_problem=lambda text: self.say(f"rendezvous: {text}"))
        hosts = HostManager(self._discover, time.monotonic, options.cooldown)
        launcher = ElasticLauncher(
            hosts, membership, lambda slot, extra: self._start_worker(service, slot, extra),
            options.max_np, say=self.say)
        handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

        def on_signal(number, _frame):
            launcher.signalled = number
        previous = {s: signal.signal(s, on_signal) for s in handled}
        try:
            return launcher.run()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            for pump in self.pumps:
                pump.join(5)
            service.close()


def launch_elastic(options: ElasticOptions, command: Sequence[str], environ: Mapping[str, str],
                   tuning: Mapping[str, str], ssh_exec: Optional[str] = None,
                   verbose: bool = False) -> int:
    """hvdmxrun's elastic job after parsing; returns the exit status."""
    job = ElasticJob(options, command, environ, tuning, remote_shell(ssh_exec, environ),
                     verbose)
    return job.run()


__all__ = ["ElasticJob", "ElasticOptions", "check_options", "launch_elastic",
           "JOIN_WINDOW_VARIABLE"]
