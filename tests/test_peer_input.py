"""Bytes from a peer are input (csrc/hvdmx/README.md, "Peer input"): the negotiation's
wire format (request lists, response lists, a round's partial, a gather) parsed in
process, valid messages round-tripped, random and mutated ones fuzzed with hypothesis
(never a crash: a valid parse or a PeerProtocolError naming the sender), a round whose
rank sends the coordinator bad bytes failing every rank with that rank named, and the
parsers' sources read for the rule's one mechanism."""
import os
import re
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _hvdmx_testing as t

pytestmark = pytest.mark.timeout(120)

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "hvdmx")
PeerProtocolError = t.PeerProtocolError

DTYPES = [0, 1, 2, 3, 4, 5, 6, 12]
ALLGATHER, ALLTOALL = 2, 3
# Hypothesis examples per fuzz test (seven tests in all, 1400 examples); they run in
# 6 to 13 s here as the shared machine's load varies, the rest of the file in 1 to 5 s.
EXAMPLES = 200
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- the rule, in the sources ------------------------------------------------------

# Files whose functions parse bytes a peer sent. In each, values come out of bytes only
# through PeerInput (no memcpy into a value), and a function that parses has no
# HVDMX_CHECK; message.cc has none at all.
PEER_PARSERS = [
    "negotiation/message.cc",
    "negotiation/round_reduction.cc",
    "negotiation/controller.cc",
]
PARSING = re.compile(r"\bPeerInput\b|\bParse\w*\(|\bRecords\(|\bForCoordinator\(")


def _code(path):
    """The file without comments and string literals (their text kept as spaces)."""
    text = open(os.path.join(CSRC, path)).read()
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def _functions(code):
    """(head, body) of each function defined at namespace scope."""
    out, depth, start, head_from = [], 0, 0, 0
    transparent = []  # braces of namespaces, which do not nest a body
    for i, c in enumerate(code):
        if c == "{":
            head = code[head_from:i]
            if depth == 0 and re.search(r"\bnamespace\b[\w\s]*$", head):
                transparent.append(True)
                head_from = i + 1
                continue
            if depth == 0:
                start = i
            depth += 1
            transparent.append(False)
        elif c == "}":
            if transparent and transparent[-1] and depth == 0:
                transparent.pop()
                head_from = i + 1
                continue
            transparent.pop()
            depth -= 1
            if depth == 0:
                out.append((code[head_from:start].strip(), code[start:i + 1]))
                head_from = i + 1
        elif c == ";" and depth == 0:
            head_from = i + 1
    return out


def test_message_cc_has_no_invariant_checks():
    assert "HVDMX_CHECK" not in _code("negotiation/message.cc")


@pytest.mark.parametrize("path", PEER_PARSERS)
def test_parsers_read_peer_bytes_only_through_peer_input(path):
    code = _code(path)
    assert not re.search(r"memcpy\s*\(\s*&", code), f"{path} reads a value out of bytes itself"
    functions = _functions(code)
    assert functions, path
    wrong = [head.split("(")[0].split()[-1] for head, body in functions
             if PARSING.search(body) and "HVDMX_CHECK" in body]
    assert not wrong, f"{path}: functions that parse peer bytes and HVDMX_CHECK: {wrong}"


def test_the_gather_parses_through_peer_input():
    bodies = [body for head, body in _functions(_code("comm/p2p_collectives.cc"))
              if "ParseGatherRecords" in head]
    assert len(bodies) == 1 and "PeerInput" in bodies[0] and "memcpy" not in bodies[0]


# ---- valid messages ----------------------------------------------------------------

names = st.binary(max_size=12)
scales = st.floats(allow_nan=False, width=64)


@st.composite
def requests(draw, sender, size):
    n = draw(st.integers(0, 3))
    kind = draw(st.integers(0, 6))
    sizes_only = draw(st.booleans())
    if kind == ALLTOALL and sizes_only:
        splits = draw(st.lists(st.integers(0, 2**40), min_size=size, max_size=size))
    else:
        splits = draw(st.lists(st.integers(0, 2**40), max_size=6))
    return dict(rank=sender, type=kind, name=draw(names),
                dtypes=draw(st.lists(st.sampled_from(DTYPES), min_size=n, max_size=n)),
                shapes=draw(st.lists(st.lists(st.integers(0, 1000), max_size=3),
                                     min_size=n, max_size=n)),
                op=draw(st.integers(0, 5)), root=draw(st.integers(0, size - 1)),
                pre=draw(scales), post=draw(scales), device=draw(st.integers(-1, 8)),
                sizes_only=sizes_only, splits=splits, stalled=draw(st.booleans()),
                error=draw(names))


@st.composite
def responses(draw, size):
    n = draw(st.integers(0, 3))
    kind = draw(st.integers(0, 6))
    error = draw(names)
    want = 0
    if not error and kind == ALLGATHER:
        want = n * size
    elif not error and kind == ALLTOALL:
        want = size * size
    return dict(type=kind, name=draw(names),
                dtypes=draw(st.lists(st.sampled_from(DTYPES), min_size=n, max_size=n)),
                counts=draw(st.lists(st.integers(0, 2**40), min_size=n, max_size=n)),
                op=draw(st.integers(0, 5)), root=draw(st.integers(0, size - 1)),
                pre=draw(scales), post=draw(scales), sizes_only=draw(st.booleans()),
                splits=draw(st.lists(st.integers(0, 2**40), min_size=want, max_size=want)),
                error=error)


@st.composite
def request_lists(draw):
    size = draw(st.integers(1, 5))
    sender = draw(st.integers(0, size - 1))
    return size, sender, draw(st.lists(requests(sender, size), max_size=4))


@st.composite
def response_lists(draw):
    size = draw(st.integers(1, 5))
    return size, draw(st.lists(responses(size), max_size=4))


@FUZZ
@given(request_lists(), st.data())
def test_valid_request_lists_round_trip(case, data):
    size, sender, qs = case
    assert t.parse_requests(t.serialize_requests(qs), sender, size) == qs
    capacity = data.draw(st.integers(1, 200))
    slots = data.draw(st.lists(st.integers(-1, capacity - 1), min_size=len(qs),
                               max_size=len(qs)))
    got = t.parse_requests(t.serialize_requests(qs, slots), sender, size, capacity)
    assert got == (qs, slots)


@FUZZ
@given(response_lists())
def test_valid_response_lists_round_trip(case):
    size, ps = case
    assert t.parse_responses(t.serialize_responses(ps), 0, size) == ps


# ---- mutated and random messages ---------------------------------------------------

# Values that break a field: counts of -1 and 2^62, ranks and enums out of range, flags
# that are not 0 or 1.
EVIL64 = [-1, 0, 1, 2**62, 2**63 - 1, -2**63, 2**56 + 1, 5, 100]
EVIL32 = [-1, 0, 1, 2, 5, 7, 13, 99, 2**31 - 1, -2**31]


@st.composite
def mutated(draw, valid):
    b = bytearray(valid)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["cut", "extend", "int64", "int32", "byte"]))
        at = draw(st.integers(0, max(len(b), 1)))
        if how == "cut":
            del b[at:]
        elif how == "extend":
            b += draw(st.binary(min_size=1, max_size=16))
        elif how == "int64":
            b[at:at + 8] = struct.pack("<q", draw(st.sampled_from(EVIL64)))
        elif how == "int32":
            b[at:at + 4] = struct.pack("<i", draw(st.sampled_from(EVIL32)))
        else:
            b[at:at + 1] = bytes([draw(st.integers(0, 255))])
    return bytes(b)


def parses_or_names(parse, data, sender):
    """The parse either succeeds or raises PeerProtocolError naming `sender`; anything
    else (another exception, or a crash of this process) fails the test."""
    try:
        return parse(data)
    except PeerProtocolError as e:
        message, peer = e.args
        assert peer == sender, (peer, message)
        assert f"rank {sender} sent " in message and "protocol does not allow" in message, message
        assert "different versions of hvdmx" in message, message
        return None


@FUZZ
@given(request_lists(), st.data())
def test_mutated_request_lists_parse_or_name_the_sender(case, data):
    size, sender, qs = case
    capacity = data.draw(st.integers(1, 100))
    if data.draw(st.booleans()):
        bad = data.draw(mutated(t.serialize_requests(qs)))
        parses_or_names(lambda b: t.parse_requests(b, sender, size), bad, sender)
    else:
        slots = [min(i, capacity - 1) for i in range(len(qs))]
        bad = data.draw(mutated(t.serialize_requests(qs, slots)))
        parses_or_names(lambda b: t.parse_requests(b, sender, size, capacity), bad, sender)


@FUZZ
@given(response_lists(), st.data())
def test_mutated_response_lists_parse_or_name_the_sender(case, data):
    size, ps = case
    bad = data.draw(mutated(t.serialize_responses(ps)))
    parses_or_names(lambda b: t.parse_responses(b, 0, size), bad, 0)


@FUZZ
@given(st.binary(max_size=200), st.integers(1, 5), st.data())
def test_random_bytes_parse_or_name_the_sender(data_bytes, size, data):
    sender = data.draw(st.integers(0, size - 1))
    parses_or_names(lambda b: t.parse_requests(b, sender, size), data_bytes, sender)
    parses_or_names(lambda b: t.parse_requests(b, sender, size, 64), data_bytes, sender)
    parses_or_names(lambda b: t.parse_responses(b, sender, size), data_bytes, sender)
    parses_or_names(lambda b: t.parse_round_partial(b, sender, [3, 0, 5]), data_bytes, sender)
    parses_or_names(lambda b: t.parse_gather(b, sender, size), data_bytes, sender)


def _partial(counts, slots):
    """A round's partial holding float32 operands of the units at `slots`."""
    out = b""
    for s in slots:
        out += struct.pack("<Q", s) + bytes((counts[s] * 4 + 7) // 8 * 8)
    return out


@FUZZ
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.data())
def test_round_partials_round_trip_or_name_the_sender(counts, data):
    slots = sorted(data.draw(st.sets(st.integers(0, len(counts) - 1))))
    valid = _partial(counts, slots)
    assert t.parse_round_partial(valid, 2, counts) == [
        (s, (counts[s] * 4 + 7) // 8 * 8) for s in slots]
    bad = data.draw(mutated(valid))
    parses_or_names(lambda b: t.parse_round_partial(b, 2, counts), bad, 2)


@FUZZ
@given(st.integers(1, 6), st.data())
def test_gathers_round_trip_or_name_the_sender(size, data):
    records = data.draw(st.lists(st.tuples(st.integers(0, size - 1), st.binary(max_size=20)),
                                 max_size=5))
    valid = b"".join(struct.pack("<IQ", r, len(s)) + s for r, s in records)
    assert t.parse_gather(valid, 1, size) == records
    bad = data.draw(mutated(valid))
    parses_or_names(lambda b: t.parse_gather(b, 1, size), bad, 1)


# ---- what each bound says ----------------------------------------------------------

def _request(**changes):
    q = dict(rank=1, type=0, name=b"w", dtypes=[0], shapes=[[4]], op=1, root=0, pre=1.0,
             post=1.0, device=-1, sizes_only=False, splits=[], stalled=False, error=b"")
    q.update(changes)
    return q


def _error(parse, data):
    with pytest.raises(PeerProtocolError) as info:
        parse(data)
    return info.value.args


@pytest.mark.parametrize("count, bound", [(-1, "outside [0, 0]"), (2**62, "outside [0, 0]")])
def test_a_count_past_the_bytes_left_names_the_bound(count, bound):
    message, peer = _error(lambda b: t.parse_requests(b, 1, 4), struct.pack("<q", count))
    assert peer == 1 and f"a count of requests of {count}, {bound}" in message, message


@pytest.mark.parametrize("changes, field", [
    (dict(rank=3), "a request of rank 3, where a rank sends only its own"),
    (dict(root=4), "root 4, outside [0, 3]"),
    (dict(type=7), "collective type 7, outside [0, 6]"),
    (dict(op=6), "reduce op 6, outside [0, 5]"),
    (dict(device=-2), "device -2, outside [-1, "),
    (dict(dtypes=[7]), "dtype code 7, which is none that hvdmx knows"),
    (dict(shapes=[[-1]]), "dimension -1, outside [0, "),
    (dict(shapes=[[2**40, 2**40]]), "a shape of more than"),
    (dict(shapes=[]), "0 shapes for 1 dtypes"),
    (dict(type=ALLTOALL, sizes_only=True, splits=[1, 2]), "an alltoall's sizes with 2 splits"),
    (dict(splits=[-5]), "split -5, outside [0, "),
])
def test_a_field_out_of_range_is_named_with_its_value_and_bound(changes, field):
    data = t.serialize_requests([_request(**changes)])
    message, peer = _error(lambda b: t.parse_requests(b, 1, 4), data)
    assert peer == 1 and field in message and "rank 1 sent a request list" in message, message


def test_a_flag_other_than_0_or_1_and_trailing_bytes_are_named():
    data = bytearray(t.serialize_requests([_request()]))
    data[-9] = 2  # `stalled`, just before the error string's length
    message, _ = _error(lambda b: t.parse_requests(b, 1, 4), bytes(data))
    assert "flag stalled 2, where 0 or 1 was expected" in message, message
    message, _ = _error(lambda b: t.parse_requests(b, 1, 4),
                        t.serialize_requests([_request()]) + b"x")
    assert "1 bytes after its last field" in message, message


def test_a_cache_slot_past_the_capacity_is_named():
    data = t.serialize_requests([_request()], [64])
    message, _ = _error(lambda b: t.parse_requests(b, 1, 4, 64), data)
    assert "cache slot 64, outside [-1, 63]" in message, message


def test_a_response_whose_splits_do_not_fit_its_collective_is_named():
    p = dict(type=ALLGATHER, name=b"g", dtypes=[0], counts=[4], op=1, root=0, pre=1.0, post=1.0,
             sizes_only=True, splits=[1, 2], error=b"")
    message, peer = _error(lambda b: t.parse_responses(b, 0, 3), t.serialize_responses([p]))
    assert peer == 0 and "allgather response with 2 splits among 3 ranks, where 3" in message


def test_the_coordinators_finding_fails_every_reader_naming_the_rank():
    data = t.serialize_peer_failure(2, "hvdmx: rank 2 sent a request list ...")
    message, peer = _error(lambda b: t.parse_responses(b, 0, 4), data)
    assert (message, peer) == ("hvdmx: rank 2 sent a request list ...", 2)


# ---- a rank that sends the coordinator bad bytes -----------------------------------

LIES = [
    struct.pack("<q", -1),
    struct.pack("<q", 2**62),
    struct.pack("<q", 1) + struct.pack("<i", 9),  # a request of rank 9
    b"\x01\x02\x03",
]


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("how", ["gather", "payload"])
@pytest.mark.parametrize("lie", LIES)
def test_a_rank_that_sends_bad_requests_fails_every_rank_naming_it(size, how, lie):
    liar = size - 1
    start = time.monotonic()
    results = t.negotiation_liar(size, liar, how, lie, timeout=20.0)
    assert time.monotonic() - start < 10, "the ranks waited instead of failing"
    for r, result in enumerate(results):
        assert not result["abandoned"], (r, results)
        assert result["peer"] == liar, (r, results)
        assert f"rank {liar} sent a request list" in result["error"], (r, results)


# Gather messages whose records break the framing: cut short, a length of 2^62, a rank
# out of range, no record at all.
FRAMES = [b"\x01\x02\x03", struct.pack("<iq", 1, 2**62), struct.pack("<iq", 7, 0), b""]


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("frame", FRAMES)
def test_a_rank_whose_gather_breaks_its_framing_fails_every_rank_naming_it(size, frame):
    start = time.monotonic()
    results = t.negotiation_liar(size, 1, "frame", frame, timeout=20.0)
    assert time.monotonic() - start < 10, "the ranks waited instead of failing"
    for r, result in enumerate(results):
        assert not result["abandoned"] and result["peer"] == 1, (r, results)
        assert "rank 1 sent a gather" in result["error"], (r, results)


@pytest.mark.parametrize("size", [3, 4])
def test_a_workers_finding_about_another_worker_reaches_every_rank(size):
    # Rank 1 sends rank size-1 a bit-and whose partial claims 2^62 bytes, the others
    # an honest one, and then nothing. Rank size-1 finds it and reports it before it
    # stops (Note [A rank's finding reaches every rank]); rank 0 reads the report in
    # its gather from the rank that reported it to it and broadcasts it; each fails
    # saying that rank size-1 reports that rank 1 sent it, through the chain of
    # ranks that passed it on ("rank 2 reports that rank 3 reports that ..."),
    # none waiting.
    words = 1 + (16 + 63) // 64 + 1  # Controller::BitWords(16)
    lie = b"\xff" * (words * 8) + struct.pack("<Q", 2**62)
    finder = size - 1
    results = t.negotiation_liar(size, 1, "bitand", lie, timeout=20.0)
    said = "rank 1 sent a bit-and partial of 4611686018427387904 bytes"
    assert results[finder]["peer"] == 1, results
    assert results[finder]["error"].startswith(f"hvdmx: {said}"), results
    for r in range(size):
        if r in (1, finder):
            continue
        result = results[r]
        assert not result["abandoned"] and result["peer"] not in (-1, 1, r), (r, results)
        error = result["error"]
        assert error.startswith(f"hvdmx: rank {result['peer']} reports that "), (r, results)
        assert f"rank {finder} reports that {said}" in error, (r, results)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_a_job_whose_rank_sends_bad_requests_stops_every_rank_naming_it(size):
    # Whole runtimes, one a rank: rank size-1's first requests reach rank 0 as a count
    # of 2^62; every rank's collective fails with the error naming it, none waits.
    from hvdmx import _core

    liar = size - 1
    job = t.LocalJob(size, {}, False, liar=liar, lie=struct.pack("<q", 2**62))
    keep, tickets = [], []
    try:
        for r in range(size):
            x = np.arange(4, dtype=np.float32) + r
            out = np.empty_like(x)
            keep.append((x, out))
            tickets.append(job.submit(rank=r, kind="allreduce", name="t", inputs=[x],
                                      outputs=[out], dtype=0, op=1))
        for r, ticket in enumerate(tickets):
            error = job.wait(ticket, 20.0)
            assert error is not None and f"rank {liar} sent a request list" in error, (r, error)
            assert "count of requests of 4611686018427387904" in error, (r, error)
            assert job.stop_at_callback(ticket) == _core.STATUS_PEER_PROTOCOL, r
    finally:
        job.shutdown()


@pytest.mark.parametrize("changes, field", [
    (dict(type=ALLGATHER), "collective allgather, where this rank asked for allreduce"),
    (dict(dtypes=[1]), "dtype "),
    (dict(counts=[4, 4]), "tensors 2, where this rank asked for 1"),
    (dict(counts=[5]), "tensor 0's elements 5, where this rank asked for 4"),
])
def test_a_response_that_does_not_fit_this_ranks_request_names_the_coordinator(changes, field):
    # The executor sizes this rank's buffers by the response: a count from rank 0
    # that is not this rank's would move bytes past its tensors.
    p = dict(type=0, name=b"w", dtypes=[0], counts=[4], op=1, root=0, pre=1.0, post=1.0,
             sizes_only=False, splits=[], error=b"")
    t.check_response_fits(_request(), p)
    message, peer = _error(lambda r: t.check_response_fits(_request(), r), dict(p, **changes))
    assert peer == 0 and "rank 0 sent a response for 'w' with " + field in message, message


def test_an_allgather_response_may_count_another_ranks_first_dimension():
    request = _request(type=ALLGATHER, shapes=[[3, 2]])
    p = dict(type=ALLGATHER, name=b"w", dtypes=[0], counts=[10], op=1, root=0, pre=1.0,
             post=1.0, sizes_only=False, splits=[5, 3, 1, 1], error=b"")
    t.check_response_fits(request, p)
