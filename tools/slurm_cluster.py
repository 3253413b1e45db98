#!/usr/bin/env python3
"""A real Slurm cluster on test hosts (tools/testhosts.py), for the tests of
hvdmxrun inside an allocation, of srun, and for timing them. docs/clusters.md
has the recipes that run on it; in short:

    python tools/slurm_cluster.py up 2 --prefix hvdmx-demo      # hosts + Slurm
    python tools/slurm_cluster.py exec --prefix hvdmx-demo -- sinfo
    python tools/slurm_cluster.py exec --prefix hvdmx-demo -- \
        salloc -N 2 --ntasks-per-node=2 hvdmxrun python train.py
    python tools/slurm_cluster.py down --prefix hvdmx-demo

What it runs is Debian's Slurm (slurmctld, slurmd, slurm-client) and munge,
installed by `make slurm`, with everything of its own under
/run/hvdmx-slurm/PREFIX/ (SLURM_CONF points the commands there):
- a cluster named by the prefix (SLURM_CLUSTER_NAME), so that jobs of two
  clusters up at once (another prefix) never share a name;
- one munged, with a fresh key and its own socket, for every host: the
  hosts share this machine's filesystem, and the Slurm commands reach it by
  the socket named in slurm.conf's AuthInfo;
- slurmctld in the first host, and one slurmd in every host, each in its
  host's network and UTS namespaces, so that it is the node named by the
  host's name (PREFIX-hI); spool, pid and log files are per node (`%n`);
- process tracking by /proc (proctrack/linuxproc) and no task plugin: no
  cgroups of the machine are touched. MpiDefault=pmi2, so that srun's tasks
  find the mpich wheel's MPI without a flag.

The machine's own network, /etc/slurm, /etc/munge and services are never
touched: the daemons listen only inside the test hosts, and the files live
in the instance's directory. stop() (and the with-block of `cluster()`, on
any exit) kills the daemons and removes the files, then the hosts.
`unavailable()` says in one line why no cluster can be made here.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, Iterator, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import testhosts  # noqa: E402

STATE_ROOT = "/run/hvdmx-slurm"
DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")
CLIENTS = ("sinfo", "salloc", "sbatch", "srun", "scontrol", "squeue", "scancel")
PACKAGES = "slurmctld slurmd slurm-client munge"
# Slots each node offers: the tests run 2 nodes x 2 tasks, and an -np larger
# than the allocation must be possible to ask for.
CPUS_PER_NODE = 4


class ClusterError(Exception):
    """Something the cluster could not do; the message says what and the fix."""


def unavailable() -> Optional[str]:
    """One line saying why no Slurm cluster can be made here, or None."""
    reason = testhosts.unavailable()
    if reason:
        return reason
    missing = [p for p in ("munged", "slurmctld", "slurmd", *CLIENTS) if not _which(p)]
    if missing:
        return (f"Slurm's test cluster needs {', '.join(missing)}, not found (install "
                f"them with `make slurm`, as root: apt-get install {PACKAGES})")
    return None


def _which(name: str) -> Optional[str]:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


_CONF = """\
# Slurm of the test hosts __PREFIX__ (tools/slurm_cluster.py); removed with them.
# The prefix, so that two clusters that run at once have different names: job
# numbers start at 1 in each, and what a job keys by cluster and job number
# (hvdmx's srun meeting file, under $HOME) must not meet the other's.
ClusterName=__PREFIX__
SlurmctldHost=__FIRST__
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=__DIR__/munge.socket
StateSaveLocation=__DIR__/ctld
SlurmdSpoolDir=__DIR__/spool-%n
SlurmctldPidFile=__DIR__/slurmctld.pid
SlurmdPidFile=__DIR__/slurmd-%n.pid
SlurmctldLogFile=__DIR__/slurmctld.log
SlurmdLogFile=__DIR__/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=pmi2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=10
NodeName=__NODES__ CPUs=__CPUS__ RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """Slurm on the test hosts `hosts` (a testhosts.TestHosts that is up)."""

    def __init__(self, hosts: testhosts.TestHosts):
        self.hosts = hosts
        self.dir = os.path.join(STATE_ROOT, hosts.prefix)
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.nodes = list(hosts.hosts)
        self.controller = self.nodes[0]
        self._daemons: List[subprocess.Popen] = []

    # ---- up and down --------------------------------------------------------

    def start(self, timeout: float = 60) -> "SlurmCluster":
        """Starts munged, slurmctld and the slurmds; returns once sinfo shows
        every node idle. Removes what it started if anything fails."""
        reason = unavailable()
        if reason:
            raise ClusterError(reason)
        if os.path.exists(self.dir):
            raise ClusterError(f"{self.dir} exists already: a cluster of {self.hosts.prefix} "
                               "runs, or a run left it; remove it with tools/slurm_cluster.py "
                               "cleanup")
        try:
            self._write_files()
            self._start_munge()
            self._daemon(self.controller, [_which("slurmctld"), "-D", "-i", "-f", self.conf],
                         "slurmctld")
            for node in self.nodes:
                self._daemon(node, [_which("slurmd"), "-D", "-f", self.conf], f"slurmd-{node}")
            self._wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _write_files(self) -> None:
        os.makedirs(STATE_ROOT, mode=0o755, exist_ok=True)
        os.mkdir(self.dir, 0o700)
        os.mkdir(os.path.join(self.dir, "ctld"), 0o700)
        for node in self.nodes:
            os.mkdir(os.path.join(self.dir, f"spool-{node}"), 0o700)
        # The hostlist expression of the nodes, as Slurm reads it.
        first = self.nodes[0].rsplit("-h", 1)[0]
        nodes = f"{first}-h[1-{len(self.nodes)}]"
        text = (_CONF.replace("__PREFIX__", self.hosts.prefix).replace("__DIR__", self.dir)
                .replace("__FIRST__", self.controller).replace("__NODES__", nodes)
                .replace("__CPUS__", str(CPUS_PER_NODE)))
        with open(self.conf, "w", encoding="utf-8") as f:
            f.write(text)
        # The cluster's own munge key: 1024 random bits, readable by root only.
        fd = os.open(os.path.join(self.dir, "munge.key"), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                     0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(128))

    def _start_munge(self) -> None:
        d = self.dir
        # In the first host, so that removing the hosts kills it too; its
        # socket is a file, reached from every host.
        cmd = [_which("munged"), "-F", "--force", f"--socket={d}/munge.socket",
               f"--key-file={d}/munge.key", f"--pid-file={d}/munged.pid",
               f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed", "--num-threads=4"]
        self._daemon(self.controller, cmd, "munged")
        deadline = time.monotonic() + 20
        while not os.path.exists(os.path.join(d, "munge.socket")):
            self._check_alive()
            if time.monotonic() > deadline:
                raise ClusterError(f"munged made no socket in 20 s; see {d}/munged.log")
            time.sleep(0.05)

    def _daemon(self, host: str, argv: Sequence[str], name: str) -> None:
        out = open(os.path.join(self.dir, f"{name}.out"), "wb")
        with out:
            proc = subprocess.Popen(self.hosts.command(host, list(argv)), env=self.env(),
                                    stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        proc.name = name  # type: ignore[attr-defined]
        self._daemons.append(proc)

    def _check_alive(self) -> None:
        for proc in self._daemons:
            if proc.poll() is not None:
                name = proc.name  # type: ignore[attr-defined]
                said = _tail(os.path.join(self.dir, f"{name}.out"))
                log = os.path.join(self.dir, f"{name}.log")
                raise ClusterError(f"{name} exited with status {proc.returncode} "
                                   f"({said or 'no output'}; see {log})")

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            self._check_alive()
            result = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=30, check=False)
            last = (result.stdout + result.stderr).strip()
            states = dict(line.split() for line in result.stdout.splitlines()
                          if len(line.split()) == 2)
            if result.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes):
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"the Slurm nodes were not idle within {timeout:g} s; "
                                   f"sinfo says: {last!r}; see the logs in {self.dir}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Ends the daemons (and every job step) and removes the files;
        safe to call more than once, and on a half-started cluster."""
        for proc in self._daemons:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        # Two seconds to stop (slurmctld saves its state, which is thrown
        # away here anyway), then SIGKILL.
        deadline = time.monotonic() + 2
        for proc in self._daemons:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._daemons.clear()
        # Whatever still runs in the hosts (job steps, ranks) goes with them:
        # the hosts' down() kills every process in their namespaces.
        self.hosts.kill_all()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- running commands ---------------------------------------------------

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """The environment for Slurm's commands and what they start: the test
        hosts' (MPI over eth0), SLURM_CONF, and /usr/sbin on PATH."""
        env = self.hosts.env(base)
        env["SLURM_CONF"] = self.conf
        path = env.get("PATH", "")
        if "/usr/sbin" not in path.split(":"):
            env["PATH"] = path + ":/usr/sbin"
        for name in [n for n in env if n.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))
                     and n != "SLURM_CONF"]:
            del env[name]
        return env

    def command(self, argv: Sequence[str], host: Optional[str] = None) -> List[str]:
        """argv run in `host` (default: the first, the controller's): where a
        user would type salloc or sbatch."""
        return self.hosts.command(host or self.controller, list(argv))

    def run(self, argv: Sequence[str], timeout: float = 120, check: bool = True,
            env: Optional[Dict[str, str]] = None, host: Optional[str] = None,
            cwd: Optional[str] = None) -> subprocess.CompletedProcess:
        result = subprocess.run(self.command(argv, host), env=env or self.env(),
                                capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL, cwd=cwd)
        if check and result.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} failed (exit {result.returncode}): "
                               f"{(result.stderr or result.stdout).strip()}")
        return result


def _tail(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().strip().splitlines()
    except OSError:
        return ""
    return lines[-1] if lines else ""


@contextlib.contextmanager
def cluster(count: int = 2, prefix: Optional[str] = None,
            timeout: float = 60) -> Iterator[SlurmCluster]:
    """`count` test hosts running Slurm for the duration of a with block,
    stopped and removed on any exit (the hosts' reaper removes the hosts,
    and with them the daemons, if this process dies inside the block)."""
    with testhosts.hosts(count, prefix=prefix or f"hvdmx-slurm-p{os.getpid()}") as th:
        instance = SlurmCluster(th)
        try:
            yield instance.start(timeout)
        finally:
            instance.stop()


def cleanup() -> List[str]:
    """Removes the files of every cluster whose test hosts are gone."""
    removed = []
    if os.path.isdir(STATE_ROOT):
        for name in os.listdir(STATE_ROOT):
            if not os.path.exists(os.path.join(testhosts.STATE_ROOT, name)):
                shutil.rmtree(os.path.join(STATE_ROOT, name), ignore_errors=True)
                removed.append(name)
    return removed


# ---- command line -----------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up", help="make COUNT test hosts and start Slurm on them; stays in "
                                  "the foreground until Ctrl-C or SIGTERM, then removes all")
    p.add_argument("count", type=int)
    p.add_argument("--prefix", default="hvdmx-slurm")
    p = sub.add_parser("exec", help="run a command in the first host with SLURM_CONF set")
    p.add_argument("--prefix", default="hvdmx-slurm")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    sub.add_parser("check", help="say whether a cluster can be made here")
    sub.add_parser("cleanup", help="remove the files of clusters whose hosts are gone")
    args = parser.parse_args(argv)
    if args.cmd == "check":
        reason = unavailable()
        print(reason or "a Slurm cluster can be made here")
        return 1 if reason else 0
    if args.cmd == "cleanup":
        for name in cleanup():
            print(f"removed {os.path.join(STATE_ROOT, name)}")
        return 0
    if args.cmd == "exec":
        words = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        instance = SlurmCluster(testhosts.TestHosts.attach(args.prefix))
        return subprocess.call(instance.command(words), env=instance.env())
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        with cluster(args.count, prefix=args.prefix) as instance:
            print(json.dumps({"conf": instance.conf, "nodes": instance.nodes}), flush=True)
            while not stop:
                time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except (ClusterError, testhosts.HarnessError) as e:
        print(f"slurm_cluster: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
