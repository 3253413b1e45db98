"""What runs in each Spark task of ``hvdmx.spark.run``'s barrier stage: it
finds its rank from the stage's task addresses, starts the rank as a child
process (the no-MPI bootstrap: hvdmx/runner/bootstrap.py, Note [The rank's
bootstrap]), forwards the rank's output to the driver and fails the task
when the rank fails.

Note [Ranks from a barrier stage]
Every task of a barrier stage sees the same ``getTaskInfos()``: one
executor address ("host:port") per partition. Each task computes the whole
placement from that list alone, so all agree without talking: the hosts in
the order their first partition appears, the ranks of one host
consecutive (partition order inside a host), local rank and size from the
host's ranks, cross rank and size as hvdmxrun computes them (among the hosts
that have a rank of the same local rank). Ranks of one host are consecutive
as hvdmxrun places them; the partition a rank gets its data from is the one
its task maps over.

Note [The task's channel]
The task connects to the driver's task server, both proving the job's key
(the function job's handshake, hvdmx/runner/function_job.py), and sends pickled
tuples: ("placed", rank, partition, host, pid), then ("out", rank, stream,
bytes) for each line of the rank's output, then ("exit", rank, status); or,
when the rank cannot be started (its share of the data cannot be written,
say), ("setup", rank, why).
The driver never sends anything; when it closes the connection (it is
done, or the run failed), the task stops its rank: that ends the rank even
before Spark has killed the task. The key reaches the task inside the
stage's closure (Spark's RPC, docs/spark.md) and the rank through the
first line of its standard input, never in an environment or command line.
"""
from __future__ import annotations

import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from hvdmx.spark._runner import ADDRESSES_VARIABLE, BOOTSTRAP, KEY_VARIABLES, Placement, \
    connect_to_launcher, stop_launcher, rank_env, variables_line
from hvdmx.spark.data import DATA_VARIABLE, write_share

STOP_SECONDS = 10.0  # for the rank's output to be read after it ended


def placements(addresses: Sequence[str]) -> List[Placement]:
    """The placement of every partition's rank, indexed by partition (See
    Note [Ranks from a barrier stage]); `addresses` are "host:port"."""
    hosts = [address.rpartition(":")[0] or address for address in addresses]
    order = list(dict.fromkeys(hosts))
    partitions = {host: [p for p, h in enumerate(hosts) if h == host] for host in order}
    out: List[Optional[Placement]] = [None] * len(hosts)
    rank = 0
    for host in order:
        count = len(partitions[host])
        for local_rank, partition in enumerate(partitions[host]):
            with_it = [h for h in order if len(partitions[h]) > local_rank]
            out[partition] = Placement(rank, host, True, local_rank, count,
                                       with_it.index(host), len(with_it))
            rank += 1
    assert all(p is not None for p in out)
    return [p for p in out if p is not None]


class _Channel:
    """The task's connection to the driver (See Note [The task's channel])."""

    def __init__(self, addresses: str, key: bytes):
        self.channel = connect_to_launcher(addresses, key)
        self.sock = self.channel.sock
        self.lock = threading.Lock()
        self.broken = False

    def send(self, message: Tuple[Any, ...]) -> None:
        with self.lock:
            if self.broken:
                return
            try:
                self.channel.send(pickle.dumps(message))
            except OSError:
                self.broken = True

    def wait_closed(self) -> None:
        """Returns when the driver closes the connection."""
        try:
            while self.sock.recv(4096):
                pass
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _stop(process: subprocess.Popen) -> None:
    """Ends the rank: its bootstrap stops the rank's group when its standard
    input ends, and on the SIGTERM that the function job's stop_launcher sends
    before it kills the group."""
    if process.poll() is None and process.stdin is not None:
        try:
            process.stdin.close()
        except OSError:
            pass
    stop_launcher(process)


def _stop_when_closed(channel: _Channel, process: subprocess.Popen) -> None:
    channel.wait_closed()
    _stop(process)


def _pump(channel: _Channel, rank: int, stream: Any, name: str) -> None:
    for line in iter(stream.readline, b""):
        channel.send(("out", rank, name, line))
    stream.close()


def run_task(plan: Mapping[str, Any], rows: Iterable[Any]) -> Iterator[int]:
    """The body of every barrier task: `plan` is what the driver put in the
    stage's closure (the key, the driver's addresses, the environment, the
    command), `rows` the task's partition."""
    from pyspark import BarrierTaskContext  # in a Spark task: pyspark is there

    context = BarrierTaskContext.get()
    partition = context.partitionId()
    places = placements([info.address for info in context.getTaskInfos()])
    place = places[partition]
    key: str = plan["key"]
    channel = _Channel(plan["task_addresses"], key.encode())
    workdir = None
    process: Optional[subprocess.Popen] = None
    try:
        channel.send(("placed", place.rank, partition, socket.gethostname(), os.getpid()))
        env: Dict[str, str] = {n: v for n, v in os.environ.items() if n not in KEY_VARIABLES}
        env.update(plan["env"])
        env.update(rank_env(place, len(places), plan["rendezvous"], {}))
        env[ADDRESSES_VARIABLE] = plan["function_addresses"]
        python = sys.executable
        command = [python, "-m", BOOTSTRAP, python, *plan["module"]]
        try:
            if plan["columns"] is not None:
                workdir = tempfile.mkdtemp(prefix="hvdmx-spark-")
                path = os.path.join(workdir, f"rank{place.rank}.npz")
                write_share(rows, plan["columns"], path)
                env[DATA_VARIABLE] = path
            else:
                for _ in rows:
                    pass
            process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       start_new_session=True)
        except Exception as error:  # the driver says why at once
            channel.send(("setup", place.rank, f"{type(error).__name__}: {error}"))
            raise
        assert process.stdin is not None
        try:
            process.stdin.write(variables_line({"HVDMX_SECRET_KEY": key}))
            process.stdin.flush()
        except OSError:
            pass  # it died at once: its status says why
        pumps = [threading.Thread(target=_pump, args=(channel, place.rank, stream, name),
                                  daemon=True)
                 for stream, name in ((process.stdout, "stdout"), (process.stderr, "stderr"))]
        for pump in pumps:
            pump.start()
        threading.Thread(target=_stop_when_closed, args=(channel, process),
                         daemon=True).start()
        code = process.wait()
        for pump in pumps:
            pump.join(STOP_SECONDS)
        channel.send(("exit", place.rank, code))
        if code != 0:
            status = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            raise RuntimeError(f"hvdmx.spark: rank {place.rank} (partition {partition}, host "
                               f"{socket.gethostname()}) {status}")
        yield code
    finally:
        if process is not None:
            _stop(process)
        channel.close()
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
