"""Bad negotiation bytes across hosts (issue 60, item 3): a real job of three ranks, one
on each of three test hosts (tools/testhosts.py), negotiating over hvdmx's TCP with
the product's runtime and controller, in which one rank sends its peers bytes the
protocol does not allow. The liar is rank 0 (the coordinator: its responses) or a
worker (rank 1 or 2: its requests, with the bit-and or by the gather, its gather
message's records, its bit-and message itself). The bytes are the ones
tests/test_peer_input.py fuzzes in process: cut short, counts of -1 and 2^62, a rank
out of range, an enum value out of range.

The liar's process wraps its own negotiation comm before hvd.init() with the tests'
module (_hvdmx_testing.lie_in_negotiation, csrc/hvdmx/testing/testing_liar_bindings.cc);
nothing else in the job is a test's. Each rank writes what its first allreduce
raised and waits for the others' reports before it exits, so that no rank's exit
reaches another before it has found the lie. Asserted: no rank crashes (mpiexec's
exit code is 0 or 1: no signal), the job ends (a timeout kills it and fails the test
otherwise), and every honest rank's allreduce fails with the error of the product's
parser or transport that names the lying rank and what was wrong, never the stall
error (which would mean it waited). What reaches which rank follows the design
(csrc/hvdmx/README.md, "Peer input"; Note [Negotiation round]): what the coordinator
finds in a rank's requests or gather it broadcasts instead of the responses, so every
rank fails naming that rank; responses from a lying coordinator reach every rank
alike; a bit-and message each rank reads itself. A bad bit-and sent to one worker
only is found by that worker alone, which reports its finding to the ranks it
negotiates with before it stops (Note [A rank's finding reaches every rank]), so that
every honest rank names the liar, through the reporter
(test_a_bit_and_lie_to_one_worker_reaches_every_rank).

Needs root (network namespaces); without it every test is skipped with the reason.
One set of three hosts serves the module and is removed at the end, also when a test
fails (and by the harness's reaper if pytest dies)."""
import functools
import json
import os
import struct
import subprocess
import sys

import pytest

import _hvdmx_testing as t

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import testhosts  # noqa: E402

PYTHON = sys.executable
SIZE = 3
CAPACITY = 64  # HVDMX_CACHE_CAPACITY of the jobs: the bound of a request's cache slot
STALL = 5      # HVDMX_STALL_SHUTDOWN_TIME_SECONDS of the jobs
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
           OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1",
           MXNET_ENGINE_TYPE="ThreadedEnginePerDevice",
           HVDMX_CACHE_CAPACITY=str(CAPACITY), HVDMX_STALL_SHUTDOWN_TIME_SECONDS=str(STALL),
           HVDMX_STALL_CHECK_TIME_SECONDS="0")
JOB_TIMEOUT = 120
pytestmark = pytest.mark.timeout(JOB_TIMEOUT + 60)

# One rank of the job. argv: the reports' directory and the cases, a JSON list of
# [liar, how, lie (hex), ranks a bit-and lie goes to]. Each case is a run of the
# job of its own: hvd.init(), the liar's wrap first; one allreduce; every rank's
# report; a barrier on the reports; hvd.shutdown().
RANK = """
import json, os, socket, sys, time
import _hvdmx_testing
import mxnet as mx
import hvdmx as hvd
from hvdmx import _job
out, cases = sys.argv[1], json.loads(sys.argv[2])
rank = int(os.environ["PMI_RANK"])
for i, (liar, how, lie, to) in enumerate(cases):
    if rank == liar:
        _hvdmx_testing.lie_in_negotiation(how, bytes.fromhex(lie), to)
    report = dict(rank=rank, host=socket.gethostname(), error="", kind="", stop=[0, ""])
    start = time.monotonic()
    try:
        hvd.init()
        assert hvd.rank() == rank and hvd.size() == 3
        hvd.allreduce(mx.nd.ones((4,)) * (rank + 1), name="x").wait_to_read()
    except Exception as e:
        report.update(error=str(e), kind=type(e).__name__, stop=list(_job.stop_status()))
    report["seconds"] = time.monotonic() - start
    # A call of hvdmx's own after the stop raises the stop's error itself.
    try:
        hvd.barrier()
        report["after"] = ""
    except Exception as e:
        report["after"] = type(e).__name__
    _hvdmx_testing.stop_lying()
    path = os.path.join(out, f"case{i}.rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f)
    os.rename(path + ".tmp", path)
    # No rank ends its runtime before every rank has found what it finds.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            os.path.exists(os.path.join(out, f"case{i}.rank{r}.json")) for r in range(3)):
        time.sleep(0.1)
    try:
        hvd.shutdown()
    except Exception as e:
        print(f"rank {rank}, case {i}: hvd.shutdown raised {e}", flush=True)
"""


@pytest.fixture(scope="module")
def th():
    reason = testhosts.unavailable()
    if reason:
        pytest.skip(reason)
    with testhosts.hosts(SIZE) as instance:
        yield instance


def run_liar_jobs(th, tmp_path, cases):
    """Runs the job, one rank a host, through `cases` ((liar, how, lie, to), one
    run of the job each); returns each case's reports (by rank) and the job's
    output. Past JOB_TIMEOUT everything in the hosts is killed and the test fails;
    so does a job that ends by a signal or leaves a rank without a report."""
    argv = [PYTHON, "-c", RANK, str(tmp_path),
            json.dumps([[liar, how, lie.hex(), list(to)] for liar, how, lie, to in cases])]
    proc = subprocess.Popen(th.mpiexec([1] * SIZE, argv), cwd=REPO, env=th.env(ENV),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        th.kill_all()
        out, _ = proc.communicate()
        pytest.fail(f"the job did not end in {JOB_TIMEOUT} s:\n{out[-4000:]}")
    # 1: a rank that stopped for a lost peer exits without finalizing MPI
    # (hvdmx/basics.py); a crash or an abort would be a signal.
    assert proc.returncode in (0, 1), f"exit {proc.returncode}\n{out[-4000:]}"
    for crash in ("Segmentation fault", "Aborted", "terminate called", "core dumped",
                  "Traceback", "hvd.shutdown raised"):
        assert crash not in out, out[-4000:]
    found = []
    for i in range(len(cases)):
        reports = {}
        for r in range(SIZE):
            path = tmp_path / f"case{i}.rank{r}.json"
            assert path.exists(), f"case {cases[i][:2]}: rank {r} wrote no report:\n{out[-4000:]}"
            reports[r] = json.loads(path.read_text())
            assert reports[r]["host"] == th.hosts[r], reports[r]
        found.append(reports)
    return found, out


def parser_error(parse, lie):
    """What the product's parser (the one the runtime uses) says of `lie`."""
    with pytest.raises(t.PeerProtocolError) as info:
        parse(lie)
    return info.value.args[0]


def what_was_wrong(said):
    """The part of a PeerProtocolError's text after the sender: the message, the
    field, its value and bound."""
    return said.split(" sent ", 1)[1].split(", which the protocol", 1)[0]


def assert_every_honest_rank_names(reports, out, liar, said, case):
    """Every rank but the liar failed its allreduce with the PeerProtocolError text
    `said` (naming the liar and the field), as MXNetError (MXNet's engine raises it
    at the read) or hvdmx.PeerProtocolError (a call after the stop), the runtime
    stopped with STATUS_PEER_PROTOCOL: a peer broke the protocol, not a wait."""
    from hvdmx import _core
    for r, report in reports.items():
        if r == liar:
            continue
        assert report["kind"] in ("MXNetError", "PeerProtocolError"), (case, r, report,
                                                                        out[-3000:])
        assert said in report["error"], (case, r, said, report)
        assert "which the protocol does not allow" in report["error"], (case, r, report)
        assert "not taken part in negotiation" not in report["error"], (case, r, report)
        assert report["stop"][0] == _core.STATUS_PEER_PROTOCOL, (case, r, report)
        assert report["after"] == "PeerProtocolError", (case, r, report)


# ---- the lies ----------------------------------------------------------------------

def request(rank, **changes):
    q = dict(rank=rank, type=0, name=b"x", dtypes=[0], shapes=[[4]], op=1, root=0, pre=1.0,
             post=1.0, device=-1, sizes_only=False, splits=[], stalled=False, error=b"")
    q.update(changes)
    return q


def request_lies(liar, slots):
    """A worker's request list, cut short, with counts of -1 and 2^62, a request of
    rank 7 and one of collective type 9; with cache slots if `slots` (the list sent
    with the bit-and) or without (by the gather)."""
    def wire(qs):
        return t.serialize_requests(qs, [-1] * len(qs)) if slots else t.serialize_requests(qs)
    valid = wire([request(liar)])
    return {
        "cut": valid[:len(valid) // 2],
        "count-1": struct.pack("<q", -1),
        "count-2^62": struct.pack("<q", 2**62),
        "rank-7": wire([request(7)]),
        "type-9": wire([request(liar, type=9)]),
    }


def response_lies():
    """The coordinator's response list, cut short, with counts of -1 and 2^62, the
    finding that rank 7 broke the protocol, and a response of collective type 9."""
    response = dict(type=0, name=b"x", dtypes=[0], counts=[4], op=1, root=0, pre=1.0,
                    post=1.0, sizes_only=False, splits=[], error=b"")
    valid = t.serialize_responses([response])
    empty = t.serialize_responses([])
    assert empty[-8:] == struct.pack("<q", 0)  # the list ends with its count
    return {
        "cut": valid[:len(valid) // 2],
        "count-1": empty[:-8] + struct.pack("<q", -1),
        "count-2^62": empty[:-8] + struct.pack("<q", 2**62),
        "rank-7": t.serialize_peer_failure(7, "hvdmx: rank 7 sent nothing"),
        "type-9": t.serialize_responses([dict(response, type=9)]),
    }


LIES = ["cut", "count-1", "count-2^62", "rank-7", "type-9"]
# What the parser names for each lie (besides the sender), so that a test that
# fails says which field it expected.
FIELDS = {"count-1": "of -1", "count-2^62": "of 4611686018427387904", "rank-7": " 7",
          "type-9": " 9"}


# ---- a lying coordinator -----------------------------------------------------------

def test_a_coordinator_that_sends_bad_responses_fails_every_worker_naming_it(th, tmp_path):
    lies = response_lies()
    cases = [(0, "responses", lies[lie], ()) for lie in LIES]
    found, out = run_liar_jobs(th, tmp_path, cases)
    for lie, reports in zip(LIES, found):
        said = parser_error(lambda b: t.parse_responses(b, 0, SIZE), lies[lie])
        assert "rank 0 sent a response list" in said and FIELDS.get(lie, "") in said, said
        assert_every_honest_rank_names(reports, out, 0, said, lie)


# ---- a lying worker ----------------------------------------------------------------

def test_a_worker_that_sends_bad_requests_fails_every_rank_naming_it(th, tmp_path):
    # Rank 1 with the bit-and (how a round of up to 4 ranks over TCP sends requests),
    # rank 2 by the gather (when a rank's list does not go with it): the coordinator
    # finds it and broadcasts its finding in place of the responses.
    cases, expected = [], []
    for liar, how in [(1, "payload"), (2, "gather")]:
        lies = request_lies(liar, how == "payload")
        for lie in LIES:
            cases.append((liar, how, lies[lie], ()))
            capacity = CAPACITY if how == "payload" else None
            said = parser_error(functools.partial(t.parse_requests, sender=liar, size=SIZE,
                                                  cache_capacity=capacity), lies[lie])
            assert f"rank {liar} sent a request list" in said and FIELDS.get(lie, "") in said
            expected.append((liar, f"{how} {lie}", said))
    found, out = run_liar_jobs(th, tmp_path, cases)
    for (liar, label, said), reports in zip(expected, found):
        assert_every_honest_rank_names(reports, out, liar, said, label)


# Gather messages whose records break the gather's framing: cut short, a record of
# 2^62 bytes, a record of rank 7.
FRAMES = {"cut": b"\x01\x02\x03", "length-2^62": struct.pack("<IQ", 2, 2**62),
          "rank-7": struct.pack("<IQ", 7, 0)}


def test_a_worker_whose_gather_breaks_its_framing_fails_every_rank_naming_it(th, tmp_path):
    # The coordinator reads the gather (the liar forces one) and broadcasts its
    # finding. Over TCP the sender is named with its host and address.
    liar = 2
    found, out = run_liar_jobs(th, tmp_path, [(liar, "frame", f, ()) for f in FRAMES.values()])
    for (frame, wire), reports in zip(FRAMES.items(), found):
        said = parser_error(lambda b: t.parse_gather(b, liar, SIZE), wire)
        assert f"rank {liar} sent a gather" in said, said
        assert_every_honest_rank_names(reports, out, liar, what_was_wrong(said), frame)
        for r in range(SIZE):
            if r != liar:
                assert f"rank {liar} (host {th.hosts[liar]}, " in reports[r]["error"], reports


# ---- a bit-and message that breaks the transport's framing -------------------------

def bit_and_words():
    return 1 + (CAPACITY + 63) // 64 + 1  # Controller::BitWords


def test_a_bit_and_too_short_fails_every_rank_naming_its_sender(th, tmp_path):
    # The transport's own framing (P2PComm::FailProtocol, not PeerInput): each rank
    # reads every rank's bit-and message itself (up to 4 ranks), so each finds it;
    # the coordinator lies in one run, a worker in the other.
    liars = [0, 1]
    found, out = run_liar_jobs(th, tmp_path, [
        (liar, "bitand", b"\x01\x02\x03", [r for r in range(SIZE) if r != liar])
        for liar in liars])
    expected = f"a bit-and of 3 bytes where {bit_and_words() * 8 + 8} were expected"
    for liar, reports in zip(liars, found):
        assert_every_honest_rank_names(reports, out, liar, expected, f"liar {liar}")
        for r in range(SIZE):
            if r != liar:
                assert f"rank {liar} (host {th.hosts[liar]}, " in reports[r]["error"], reports


def test_a_bit_and_lie_to_one_worker_reaches_every_rank(th, tmp_path):
    # Rank 1 sends rank 2 a bit-and whose partial claims 2^62 bytes and rank 0 an
    # honest one (which says its requests come by the gather), then takes part in
    # nothing more. Rank 2 finds the lie, names rank 1, and reports it to ranks 0
    # and 1 before it stops; rank 0, waiting for rank 2's gather, reads the report
    # and broadcasts it in place of the responses, so it fails naming rank 1 as
    # rank 2 reports it, not with a lost peer after the stall shutdown time.
    lie = b"\xff" * (bit_and_words() * 8) + struct.pack("<Q", 2**62)
    [reports], out = run_liar_jobs(th, tmp_path, [(1, "bitand", lie, [2])])
    partial = "a bit-and partial of 4611686018427387904 bytes"
    assert_every_honest_rank_names(reports, out, 1, partial, "rank 1's bit-and")
    named = f"rank 1 (host {th.hosts[1]}, "
    assert reports[2]["error"].startswith(f"hvdmx: {named}"), reports[2]
    reporter = f"hvdmx: rank 2 (host {th.hosts[2]}, "
    assert reports[0]["error"].startswith(reporter), reports[0]
    assert f" reports that {named}" in reports[0]["error"], reports[0]
