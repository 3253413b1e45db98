#!/usr/bin/env python3
"""Test hosts: N "hosts" on this machine, made of Linux namespaces, for running
hvdmx (and any MPI program) across hosts without a cluster. docs/testhosts.md
has the details; in short:

    python tools/testhosts.py up 2 --prefix hvdmx-demo [--rate 1gbit]
    python tools/testhosts.py mpiexec --prefix hvdmx-demo --per-host 2 -- python prog.py
    python tools/testhosts.py exec --prefix hvdmx-demo hvdmx-demo-h1 -- hostname
    python tools/testhosts.py down --prefix hvdmx-demo

Each host is a network namespace with its own loopback and one interface, eth0,
holding 10.213.0.I/24 (I = 1, 2, ...), plus a persistent UTS namespace with its
own host name, PREFIX-hI. The eth0s are veth pairs whose other ends are ports
of a bridge in a namespace of its own, PREFIX-sw; so nothing of the harness
appears in the machine's own namespace, and the test range exists only inside
it. Host names resolve inside the hosts only: every command run in a host gets
a private mount namespace in which the harness's own hosts file is bind-mounted
over /etc/hosts (the machine's /etc/hosts is not touched).

`launch` (a shell script in the instance's directory under
/run/hvdmx-testhosts) is what Hydra runs instead of ssh:
`mpiexec -launcher ssh -launcher-exec LAUNCH -hosts PREFIX-h1:2,PREFIX-h2:2`,
with mpiexec itself started in the first host. Like ssh, it takes
`LAUNCH [ssh options] HOST WORDS...` and runs the words, joined by spaces, with
`sh -c` in that host; `LAUNCH --exec HOST ARGV...` runs ARGV as given.

Used from Python (tests/test_many_hosts.py):

    with testhosts.hosts(3, rate="1gbit") as th:   # removed again on any exit
        subprocess.run(th.mpiexec([2, 2, 2], ["python", "prog.py"]), env=th.env())

`unavailable()` says in one line why hosts cannot be made here (not root, no
`ip`, no namespaces), or returns None. An instance records the process that
made it, and a small reaper process removes the instance when that process
dies without removing it (killed, or ended by os._exit); `cleanup` removes
the leftovers of every instance whose name starts with a prefix.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, Iterator, List, Optional, Sequence

STATE_ROOT = "/run/hvdmx-testhosts"
NETNS_DIR = "/run/netns"
SUBNET = "10.213.0"          # host I has SUBNET.I/24 on its eth0
DEFAULT_PREFIX = "hvdmx-cli"
MAX_HOSTS = 200
# What MPI programs need in the hosts: MPICH's UCX only over TCP (no shared
# memory or cross-memory attach between "hosts" that are one machine), and only
# on the host's own interface.
MPI_ENV = {"UCX_TLS": "self,tcp", "UCX_NET_DEVICES": "eth0"}
_PREFIX_RE = re.compile(r"hvdmx(-[a-z0-9]+)*")
_TOOLS = ("ip", "nsenter", "unshare", "mount", "umount")


class HarnessError(Exception):
    """Something the harness could not do; the message says what and the fix."""


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    if check and result.returncode != 0:
        raise HarnessError(f"'{shlex.join(argv)}' failed (exit {result.returncode}): "
                           f"{(result.stderr or result.stdout).strip()}")
    return result


def check_prefix(prefix: str) -> str:
    if not _PREFIX_RE.fullmatch(prefix) or len(prefix) > 40:
        raise HarnessError(f"--prefix {prefix!r} is not usable: a prefix is 'hvdmx' followed "
                           "by '-word' parts of lower-case letters and digits, at most 40 "
                           "characters, e.g. 'hvdmx-bench' (the 'hvdmx' start keeps its "
                           "names apart from anything real)")
    return prefix


def unavailable() -> Optional[str]:
    """One line saying why test hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return (f"test hosts need root to make network namespaces (running as uid "
                f"{os.geteuid()})")
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return (f"test hosts need {', '.join(missing)} (iproute2, util-linux), not found "
                "on PATH")
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return ("test hosts cannot make namespaces here: 'unshare --net --uts --mount true' "
                f"says {probe.stderr.strip() or 'exit ' + str(probe.returncode)}")
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tbf_burst(rate: str) -> str:
    """A token bucket that holds a few of veth's 64 KiB segments and one timer
    tick (4 ms) of the rate."""
    match = re.fullmatch(r"([0-9.]+)\s*([kmgt]?)(bit|bps)?", rate.lower())
    if not match:
        raise HarnessError(f"--rate {rate!r} is not a rate; write it as tc does, e.g. '1gbit' "
                           "or '500mbit'")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match.group(2)]
    bits = float(match.group(1)) * scale * (8 if match.group(3) == "bps" else 1)
    return str(max(256 * 1024, int(bits / 8 * 0.004)))


# The launcher. Hydra calls it as ssh: `launch -x HOST 'word word ...'`.
_LAUNCH = r"""#!/bin/sh
# Test hosts' launcher for the instance __PREFIX__ (made by tools/testhosts.py;
# removed with the instance). Runs a command in a test host, as ssh would:
#   launch [ssh options] HOST WORDS...   the words, joined by spaces, with sh -c
#   launch --exec HOST ARGV...            ARGV as given
# HOST is a host name (__PREFIX__-h1), its short form (h1) or its address.
dir=__DIR__
mode=ssh
if [ "$1" = --exec ]; then mode=exec; shift; fi
while [ $# -gt 0 ]; do
  case $1 in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
if [ $# -lt 1 ]; then
  echo "testhosts launch: no host given; usage: $0 [--exec] HOST COMMAND..." >&2
  exit 255
fi
case $1 in
__CASES__
  *)
    echo "testhosts launch: '$1' is not a host of __PREFIX__ (hosts: __NAMES__)" >&2
    exit 255 ;;
esac
shift
if [ ! -e "/run/netns/$host" ]; then
  echo "testhosts launch: host $host is down (no /run/netns/$host); bring it up with" \
       "tools/testhosts.py up" >&2
  exit 255
fi
# A private mount namespace, so that the instance's hosts file can stand in
# for /etc/hosts here and nowhere else.
run="mount --bind $dir/hosts /etc/hosts || exit 255"
if [ $mode = exec ]; then
  exec nsenter --net=/run/netns/$host --uts=$dir/$host.uts -- \
    unshare --mount --propagation private -- sh -c "$run; exec \"\$@\"" sh "$@"
fi
exec nsenter --net=/run/netns/$host --uts=$dir/$host.uts -- \
  unshare --mount --propagation private -- sh -c "$run; exec sh -c \"\$1\"" sh "$*"
"""


class TestHosts:
    """One instance: `count` hosts named PREFIX-h1 ... PREFIX-hN.

    up() makes them (and removes what it made if it fails halfway); down()
    removes everything, killing what still runs in them first."""

    def __init__(self, count: int, prefix: str = DEFAULT_PREFIX, rate: Optional[str] = None):
        if not 1 <= count <= MAX_HOSTS:
            raise HarnessError(f"the number of hosts is {count}; give 1 to {MAX_HOSTS}")
        self.count = count
        self.prefix = check_prefix(prefix)
        self.rate = rate
        self.dir = os.path.join(STATE_ROOT, prefix)
        self.hosts = [f"{prefix}-h{i}" for i in range(1, count + 1)]
        self.switch = f"{prefix}-sw"
        self.launcher = os.path.join(self.dir, "launch")

    @classmethod
    def attach(cls, prefix: str = DEFAULT_PREFIX) -> "TestHosts":
        """The instance `prefix` that is up (made by another process)."""
        path = os.path.join(STATE_ROOT, check_prefix(prefix), "state.json")
        try:
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
        except (OSError, ValueError):
            raise HarnessError(f"no test hosts with prefix {prefix!r} are up ({path} is "
                               "missing); make them with: tools/testhosts.py up N --prefix "
                               f"{prefix}") from None
        return cls(state["count"], prefix, state.get("rate"))

    # ---- names ------------------------------------------------------------

    def address(self, host: str) -> str:
        return f"{SUBNET}.{self.hosts.index(self.host(host)) + 1}"

    def host(self, name: str) -> str:
        """PREFIX-hI for PREFIX-hI, hI or the host's address."""
        for i, full in enumerate(self.hosts, start=1):
            if name in (full, f"h{i}", f"{SUBNET}.{i}"):
                return full
        raise HarnessError(f"{name!r} is not a host of {self.prefix} (hosts: "
                           f"{', '.join(self.hosts)})")

    def _port(self, host: str) -> str:
        """The bridge port in the switch namespace that leads to `host`."""
        return f"p{self.hosts.index(self.host(host)) + 1}"

    # ---- up and down --------------------------------------------------------

    def up(self, reaper: bool = False) -> "TestHosts":
        """Makes the hosts. With `reaper`, a detached process removes them
        again when this process dies without calling down()."""
        reason = unavailable()
        if reason:
            raise HarnessError(reason)
        taken = [n for n in self._namespaces_on_disk()] or os.path.exists(self.dir)
        if taken:
            raise HarnessError(f"test hosts with prefix {self.prefix!r} exist already; "
                               f"remove them with: tools/testhosts.py down --prefix "
                               f"{self.prefix} (or use another --prefix)")
        try:
            self._make()
        except BaseException:
            self.down()
            raise
        if reaper:
            subprocess.Popen([sys.executable, os.path.abspath(__file__), "_reap", "--prefix",
                              self.prefix, "--owner", str(os.getpid())],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
        return self

    def _make(self) -> None:
        os.makedirs(self.dir)
        with open(os.path.join(self.dir, "state.json"), "w", encoding="utf-8") as f:
            json.dump({"count": self.count, "rate": self.rate, "owner": os.getpid()}, f)
        with open(os.path.join(self.dir, "hosts"), "w", encoding="utf-8") as f:
            f.write("127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n")
            for host in self.hosts:
                f.write(f"{self.address(host)} {host}\n")
        self._write_launcher()

        sw = self.switch
        _run(["ip", "netns", "add", sw])
        _run(["ip", "-n", sw, "link", "set", "lo", "up"])
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        for host in self.hosts:
            port = self._port(host)
            uts = os.path.join(self.dir, f"{host}.uts")
            _run(["ip", "netns", "add", host])
            # The veth pair is made inside the switch namespace with its other
            # end placed straight into the host: neither end ever exists in
            # the machine's own namespace.
            _run(["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                  "netns", host])
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", port, "up"])
            _run(["ip", "-n", host, "addr", "add", f"{self.address(host)}/24", "dev", "eth0"])
            _run(["ip", "-n", host, "link", "set", "lo", "up"])
            _run(["ip", "-n", host, "link", "set", "eth0", "up"])
            if self.rate:
                burst = _tbf_burst(self.rate)
                for ns, dev in ((host, "eth0"), (sw, port)):  # both directions
                    _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                          self.rate, "burst", burst, "latency", "20ms"])
            open(uts, "w").close()
            _run(["unshare", f"--uts={uts}", "hostname", host])

    def _write_launcher(self) -> None:
        cases = []
        for i, host in enumerate(self.hosts, start=1):
            cases.append(f"  {host}|h{i}|{SUBNET}.{i}) host={host} ;;")
        text = (_LAUNCH.replace("__DIR__", shlex.quote(self.dir))
                .replace("__PREFIX__", self.prefix)
                .replace("__NAMES__", " ".join(self.hosts))
                .replace("__CASES__", "\n".join(cases)))
        with open(self.launcher, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(self.launcher, 0o755)

    def _namespaces_on_disk(self) -> List[str]:
        try:
            names = os.listdir(NETNS_DIR)
        except FileNotFoundError:
            return []
        mine = set(self.hosts) | {self.switch}
        return [n for n in names if n in mine or re.fullmatch(
            re.escape(self.prefix) + r"-(h[0-9]+|sw)", n)]

    def kill_all(self) -> int:
        """SIGKILLs every process running in the hosts; returns how many."""
        killed = 0
        for ns in self._namespaces_on_disk():
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    killed += 1
                except (ProcessLookupError, ValueError):
                    pass
        return killed

    def down(self) -> None:
        """Removes the hosts, whatever state they are in."""
        for _ in range(50):
            if self.kill_all() == 0:
                break
            time.sleep(0.1)
        for ns in self._namespaces_on_disk():
            _run(["ip", "netns", "delete", ns], check=False)
        if os.path.isdir(self.dir):
            for name in os.listdir(self.dir):
                path = os.path.join(self.dir, name)
                if name.endswith(".uts"):
                    _run(["umount", path], check=False)
                os.unlink(path)
            os.rmdir(self.dir)

    def __enter__(self) -> "TestHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    # ---- running things in the hosts ----------------------------------------

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """`base` (default os.environ) with what MPI needs in the hosts."""
        return dict(os.environ if base is None else base, **MPI_ENV)

    def command(self, host: str, argv: Sequence[str]) -> List[str]:
        """argv run in `host` (its namespaces and host name)."""
        return [self.launcher, "--exec", self.host(host), *argv]

    def mpi_args(self) -> List[str]:
        """The Hydra flags that start remote processes through the launcher."""
        return ["-launcher", "ssh", "-launcher-exec", self.launcher]

    def host_list(self, per_host: Sequence[int]) -> str:
        """'PREFIX-h1:2,PREFIX-h2:2' for per_host [2, 2]."""
        if not 1 <= len(per_host) <= self.count or min(per_host) < 1:
            raise HarnessError(f"ranks per host {list(per_host)}: give 1 to {self.count} "
                               "counts, each at least 1")
        return ",".join(f"{host}:{n}" for host, n in zip(self.hosts, per_host))

    def mpiexec(self, per_host: Sequence[int], argv: Sequence[str],
                mpiexec: Optional[str] = None) -> List[str]:
        """mpiexec, started in the first host, running argv with per_host[i]
        ranks on host i (run it with env=self.env())."""
        mpiexec = mpiexec or os.path.join(os.path.dirname(sys.executable), "mpiexec")
        return self.command(self.hosts[0], [
            mpiexec, *self.mpi_args(), "-hosts", self.host_list(per_host),
            "-n", str(sum(per_host)), *argv])

    def link(self, host: str, up: bool) -> None:
        """Takes `host`'s link to the bridge down (or up again): from then on
        nothing it sends reaches the other hosts, and nothing reaches it."""
        _run(["ip", "-n", self.switch, "link", "set", self._port(host),
              "up" if up else "down"])

    def cap(self, host: str, rate: Optional[str]) -> None:
        """Caps `host`'s link at `rate` in each direction from now on (as
        --rate does for every host), or lifts the cap with None."""
        host = self.host(host)
        for ns, dev in ((host, "eth0"), (self.switch, self._port(host))):
            if rate is None:
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            else:
                _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                      rate, "burst", _tbf_burst(rate), "latency", "20ms"])

    def counters(self, host: str) -> Dict[str, int]:
        """Bytes and packets `host`'s eth0 has sent and received."""
        out = _run(["ip", "-n", self.host(host), "-s", "-j", "link", "show", "dev", "eth0"])
        stats = json.loads(out.stdout)[0]["stats64"]
        return {"rx_bytes": stats["rx"]["bytes"], "tx_bytes": stats["tx"]["bytes"],
                "rx_packets": stats["rx"]["packets"], "tx_packets": stats["tx"]["packets"]}


@contextlib.contextmanager
def hosts(count: int, prefix: Optional[str] = None, rate: Optional[str] = None
          ) -> Iterator[TestHosts]:
    """`count` test hosts for the duration of a with block, removed on any
    exit; a reaper removes them if this process dies inside the block. The
    default prefix, hvdmx-pPID, differs between processes that run at once."""
    instance = TestHosts(count, prefix or f"hvdmx-p{os.getpid()}", rate).up(reaper=True)
    try:
        yield instance
    finally:
        instance.down()


def cleanup(prefix: str) -> List[str]:
    """Removes every instance whose name starts with `prefix` (leftovers of
    killed runs, or every instance with 'hvdmx'); returns their names."""
    check_prefix(prefix)
    names = set()
    if os.path.isdir(STATE_ROOT):
        names |= {n for n in os.listdir(STATE_ROOT) if n.startswith(prefix)}
    if os.path.isdir(NETNS_DIR):
        for ns in os.listdir(NETNS_DIR):
            match = re.fullmatch(r"(hvdmx(?:-[a-z0-9]+)*)-(?:h[0-9]+|sw)", ns)
            if match and match.group(1).startswith(prefix):
                names.add(match.group(1))
    for name in sorted(names):
        _reap_instance(name)
    return sorted(names)


def _reap_instance(name: str) -> None:
    count = len([n for n in os.listdir(NETNS_DIR) if re.fullmatch(
        re.escape(name) + r"-h[0-9]+", n)]) if os.path.isdir(NETNS_DIR) else 0
    TestHosts(max(count, 1), name).down()


def _reap(prefix: str, owner: int) -> None:
    """Waits for `owner` to die; removes the instance if it is still there."""
    state = os.path.join(STATE_ROOT, prefix, "state.json")
    while os.path.exists(state) and _pid_alive(owner):
        time.sleep(0.5)
    if os.path.exists(state):
        _reap_instance(prefix)


# ---- command line ---------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="testhosts.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Makes test hosts on this machine (network and UTS namespaces joined by "
                    "a bridge,\naddresses 10.213.0.I/24, host names PREFIX-hI) and removes "
                    "them again. Needs root.\nSee docs/testhosts.md.",
        epilog="examples:\n"
               "  testhosts.py up 2 --prefix hvdmx-demo --rate 1gbit\n"
               "  testhosts.py mpiexec --prefix hvdmx-demo --per-host 2 -- "
               "python -m hvdmx.bench allreduce\n"
               "  testhosts.py exec --prefix hvdmx-demo h1 -- hvdmxrun -H "
               "hvdmx-demo-h1:2,hvdmx-demo-h2:2 \\\n"
               "      --mpi-args \"-launcher ssh -launcher-exec "
               "/run/hvdmx-testhosts/hvdmx-demo/launch\" python train.py\n"
               "  testhosts.py down --prefix hvdmx-demo\n"
               "  testhosts.py cleanup                 # every instance, from killed runs too")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def add(name, help_text):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--prefix", default=DEFAULT_PREFIX, type=_prefix_arg,
                       help=f"names of this instance's hosts and namespaces "
                            f"(default {DEFAULT_PREFIX}); give each instance its own")
        return p

    p = add("up", "make N hosts and print their names, the launcher and the environment")
    p.add_argument("count", type=int, metavar="N", help="number of hosts")
    p.add_argument("--rate", help="cap each host's link at this rate in each direction, "
                                  "as tc writes it (e.g. 1gbit); default: no cap")
    add("down", "remove the instance: kill what runs in its hosts, delete its namespaces "
                "and files")
    p = sub.add_parser("cleanup", help="remove every instance whose prefix starts with "
                                       "--prefix (default hvdmx: all of them)")
    p.add_argument("--prefix", default="hvdmx", type=_prefix_arg)
    add("check", "say whether test hosts can be made here (exit 0) or why not (exit 1)")
    p = add("exec", "run a command in a host (its network, host name and hosts file)")
    p.add_argument("host", help="PREFIX-hI, hI or the address")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="the command and its arguments")
    p = add("mpiexec", "run mpiexec in the first host with N ranks on each of the first "
                       "hosts, with UCX over TCP")
    p.add_argument("--per-host", default="1", metavar="N[,N...]",
                   help="ranks on each host: one number for every host, or one per host "
                        "(default 1)")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="the program and its arguments")
    p = add("link", "take a host's link down or bring it up again")
    p.add_argument("host")
    p.add_argument("state", choices=("up", "down"))
    p = add("counters", "print bytes and packets each host's eth0 sent and received (JSON)")
    p = sub.add_parser("_reap", help=argparse.SUPPRESS)
    p.add_argument("--prefix", required=True, type=_prefix_arg)
    p.add_argument("--owner", required=True, type=int)
    return parser


def _prefix_arg(text: str) -> str:
    try:
        return check_prefix(text)
    except HarnessError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _argv(rest: List[str]) -> List[str]:
    rest = rest[1:] if rest[:1] == ["--"] else rest
    if not rest:
        raise HarnessError("no command given; put it after '--', e.g. -- hostname")
    return rest


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "check":
            reason = unavailable()
            print(reason or "test hosts can be made here")
            return 1 if reason else 0
        if args.cmd == "cleanup":
            removed = cleanup(args.prefix)
            print("removed: " + (", ".join(removed) if removed else "nothing"))
            return 0
        if args.cmd == "_reap":
            _reap(args.prefix, args.owner)
            return 0
        if args.cmd == "up":
            th = TestHosts(args.count, args.prefix, args.rate).up()
            print(f"hosts:    {' '.join(f'{h}={th.address(h)}' for h in th.hosts)}")
            print(f"launcher: {th.launcher}")
            print(f"mpi args: {shlex.join(th.mpi_args())}")
            print(f"env:      {' '.join(f'{k}={v}' for k, v in MPI_ENV.items())}")
            return 0
        th = TestHosts.attach(args.prefix)
        if args.cmd == "down":
            th.down()
        elif args.cmd == "exec":
            cmd = th.command(args.host, _argv(args.argv))
            os.execve(cmd[0], cmd, th.env())
        elif args.cmd == "mpiexec":
            counts = [int(n) for n in args.per_host.split(",")]
            per_host = counts * th.count if len(counts) == 1 else counts
            cmd = th.mpiexec(per_host, _argv(args.argv))
            os.execve(cmd[0], cmd, th.env())
        elif args.cmd == "link":
            th.link(args.host, args.state == "up")
        elif args.cmd == "counters":
            print(json.dumps({h: th.counters(h) for h in th.hosts}, indent=1))
    except (HarnessError, ValueError) as e:
        print(f"testhosts.py {args.cmd}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
