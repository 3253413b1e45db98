"""The 2-host job of the cluster tests (tests/test_slurm.py,
tests/test_mpi_operator.py): every rank prints its place, its host and the
sum over the ranks of an array that depends on the rank and the index
(exact in float32); `check` reads the reports back and checks them against
the hosts the ranks should be on."""
import json
import re

PROGRAM = r"""
import json, socket
import numpy as np
import mxnet as mx
import hvdmx as hvd
hvd.init()
x = mx.nd.array(np.arange(5) + 10 * hvd.rank())
total = hvd.allreduce(x, average=False, name="x").asnumpy().tolist()
print("REPORT " + json.dumps(dict(
    rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
    local_size=hvd.local_size(), cross_rank=hvd.cross_rank(), host=socket.gethostname(),
    total=total)), flush=True)
"""


def check(out, hosts, per_host=2):
    """The reports in `out`: rank r on hosts[r // per_host], every total the
    sum over the ranks."""
    found = {}
    # Under MPI, ranks' lines can run into each other: a report is read by
    # its braces (it holds no nested ones).
    for match in re.finditer(r"REPORT (\{[^{}]*\})", out):
        report = json.loads(match.group(1))
        found[report["rank"]] = report
    size = len(hosts) * per_host
    assert sorted(found) == list(range(size)), out
    expected = [float(size * i + 10 * sum(range(size))) for i in range(5)]
    for rank, report in found.items():
        assert report["size"] == size and report["total"] == expected, report
        assert report["host"] == hosts[rank // per_host], report
        assert (report["local_rank"], report["local_size"]) == (rank % per_host, per_host)
        assert report["cross_rank"] == rank // per_host
