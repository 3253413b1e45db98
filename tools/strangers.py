"""Strangers at a job's door: a program on one test host (tools/testhosts.py) that
connects to the TCP ports where another host's ranks listen for their peers, and sends
nothing, garbage, or a hello of the right form that it cannot back with the job's key.

Used by tests/test_many_hosts.py (the job must run correctly) and by
benchmarks/tcp_strangers.py (what the strangers cost the job's start). The ports are
found the way a scanner would after finding them: here from the host's own socket
table (`ss -ltnp` in its namespace), which names the Python processes that listen, so
that MPI's own launcher ports (Hydra's proxies) are left alone.

Run in a host as a program: `python tools/strangers.py MODE COUNT HOLD IP:PORT...` holds
COUNT connections to each IP:PORT for HOLD seconds, then prints `held N`."""
import os
import re
import socket
import struct
import subprocess
import sys
import time
from typing import List, Sequence

MODES = ("silent", "garbage", "forged")
HELLO_BYTES = 72  # Handshake::kHelloBytes, comm/tcp_handshake.h


def rank_listeners(th, host: str) -> List[str]:
    """The "ip:port" addresses that Python processes listen on in `host`."""
    out = subprocess.run(th.command(host, ["ss", "-ltnpH"]), capture_output=True, text=True,
                         check=False).stdout
    found = []
    for line in out.splitlines():
        if '"python' not in line:
            continue
        fields = line.split()
        address = fields[3]
        if re.fullmatch(r"\d+\.\d+\.\d+\.\d+:\d+", address) and not address.startswith("127."):
            found.append(address)
    return found


def wait_for_listeners(th, hosts: Sequence[str], proc, seen=(), timeout: float = 60):
    """Every listener of the ranks in `hosts` not in `seen`, once each host has one;
    [] if the job `proc` ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        by_host = [[a for a in rank_listeners(th, h) if a not in seen] for h in hosts]
        if all(by_host):
            return [a for found in by_host for a in found]
        time.sleep(0.05)
    return []


def command(th, host: str, mode: str, count: int, hold: float, targets: Sequence[str]):
    """The argv that runs the strangers in `host` (run it with env=th.env())."""
    return th.command(host, [sys.executable, os.path.abspath(__file__), mode, str(count),
                             str(hold), *targets])


def attack_each_comm(th, proc, mode: str, count: int, hold: float, comms: int = 2):
    """While the job `proc` (ranks on the first two hosts) starts, strangers on the
    third host reach the listening ports of each of its first `comms` communicators
    (the negotiation's, then the collectives') as they open. Returns the strangers'
    processes (see held)."""
    attacks, seen = [], []
    for _ in range(comms):
        targets = wait_for_listeners(th, th.hosts[:2], proc, seen)
        if not targets:
            break
        seen += targets
        attacks.append(subprocess.Popen(command(th, th.hosts[2], mode, count, hold, targets),
                                        env=th.env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True,
                                        stdin=subprocess.DEVNULL))
    return attacks


def held(attacks) -> int:
    """How many connections the strangers made, once they are done."""
    total = 0
    for attack in attacks:
        out, err = attack.communicate(timeout=120)
        if attack.returncode != 0:
            raise RuntimeError(f"strangers failed: {err}")
        total += int(out.split()[1])
    return total


def _connection(mode: str, ip: str, port: int):
    s = socket.socket()
    s.settimeout(2)
    s.connect((ip, port))
    if mode == "garbage":
        s.sendall(os.urandom(HELLO_BYTES))
    elif mode == "forged":
        # The hello's form, rank 0 to the listener, for a communicator id it
        # cannot know, then a proof it cannot make.
        s.sendall(b"HVDXtcp1" + os.urandom(16) + struct.pack("<III", 0, 0, 1) +
                  os.urandom(32) + os.urandom(32))
    return s


def main(argv: Sequence[str]) -> int:
    mode, count, hold, targets = argv[0], int(argv[1]), float(argv[2]), argv[3:]
    if mode not in MODES:
        raise SystemExit(f"strangers: MODE must be one of {', '.join(MODES)}, not {mode!r}")
    held = []
    for target in targets:
        ip, port = target.rsplit(":", 1)
        for _ in range(count):
            try:
                held.append(_connection(mode, ip, int(port)))
            except OSError:
                break  # the port closed: that rank's links are made
    print(f"held {len(held)}", flush=True)
    time.sleep(hold)
    for s in held:
        s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
