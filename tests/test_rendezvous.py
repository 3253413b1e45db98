"""hvdmx/rendezvous/client.py in one process: threads as ranks, each with its own
connection to a RendezvousServer on the loopback. The collectives' results
(allgather in rank order, split like MPI_Comm_split), their failures (a
member late, crashed, or calling another collective: an error naming the
ranks), and the server's defence: a wrong key, garbage, oversized,
truncated, altered or replayed frames are refused naming the peer, and the
server goes on serving the others."""
import os
import secrets
import socket
import struct
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hvdmx.rendezvous import client as rdv, server as rdv_server
from hvdmx.rendezvous import wire

pytestmark = pytest.mark.timeout(120)
KEY = bytes(range(32))


@pytest.fixture
def server():
    made = []

    def make(size, timeout=30.0, key=KEY, **limits):
        s = rdv_server.RendezvousServer(size, key, host="127.0.0.1", timeout=timeout,
                                 on_problem=lambda text: None, **limits)
        made.append(s)
        return s
    yield make
    for s in made:
        s.close()


def run_ranks(size, body, srv, join_timeout=60, ranks=None):
    """Runs body(group) on `size` threads (or those of `ranks` only), one
    connection each; returns {rank: result or the exception raised}."""
    results = {}

    def one(rank):
        try:
            group = rdv.connect(srv.address(), KEY, rank, size, host=f"h{rank // 2}",
                                slot=rank % 2)
        except Exception as error:  # noqa: BLE001 - the test reads it
            results[rank] = error
            return
        try:
            results[rank] = body(group)
        except Exception as error:  # noqa: BLE001
            results[rank] = error
        finally:
            group.close()
    threads = [threading.Thread(target=one, args=(r,), daemon=True)
               for r in (range(size) if ranks is None else ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
        assert not t.is_alive(), "a rank hung"
    return results


def wait_for_problem(srv, *words, seconds=10):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for line in list(srv.problems):
            if all(w in line for w in words):
                return line
        time.sleep(0.02)
    raise AssertionError(f"no problem with {words} reported; reported: {srv.problems}")


def data_of(rank, size, step=0):
    # Different lengths (rank 0's is empty), content depending on rank, size, step.
    return bytes((rank * 7 + size * 3 + step + i) % 256 for i in range(rank * 5 + step))


# ---- results -----------------------------------------------------------------------

@pytest.mark.parametrize("size", range(1, 9))
def test_allgather_gives_everyones_bytes_in_rank_order(server, size):
    srv = server(size)

    def body(g):
        assert (g.rank, g.size) == (g.rank, size)
        return [g.allgather(data_of(g.rank, size, step)) for step in range(3)], g.rank
    results = run_ranks(size, body, srv)
    for rank in range(size):
        gathered, got_rank = results[rank]
        assert got_rank == rank
        for step in range(3):
            assert gathered[step] == [data_of(r, size, step) for r in range(size)]


def test_split_groups_by_color_orders_by_key_then_rank(server):
    size = 7
    srv = server(size)
    # color: rank % 3, but rank 6 opts out; keys tie in pairs, so the old rank breaks ties.
    colors = {r: (-1 if r == 6 else r % 3) for r in range(size)}
    keys = {r: -(r // 2) for r in range(size)}

    def body(g):
        sub = g.split(colors[g.rank], keys[g.rank])
        if sub is None:
            return None
        got = sub.allgather(str(g.rank).encode())
        return sub.rank, sub.size, [int(x) for x in got]
    results = run_ranks(size, body, srv)
    assert results[6] is None
    for color in range(3):
        members = [r for r in range(size) if colors[r] == color]
        order = sorted(members, key=lambda r: (keys[r], r))
        for r in members:
            assert results[r] == (order.index(r), len(order), order), (r, results[r])


def test_nested_splits_and_the_parent_go_on_independently(server):
    size = 6
    srv = server(size)

    def body(g):
        half = g.split(g.rank // 3, 0)
        pair = half.split(half.rank // 2, -half.rank)   # reversed inside
        out = [pair.allgather(bytes([g.rank])), g.allgather(bytes([g.rank])),
               half.allgather(bytes([g.rank]))]
        alone = g.split(-5, 0)
        return out, alone
    results = run_ranks(size, body, srv)
    for r in range(size):
        (pair, world, half), alone = results[r]
        assert alone is None
        assert world == [bytes([x]) for x in range(size)]
        base = r // 3 * 3
        assert half == [bytes([base + x]) for x in range(3)]
        inside = r - base
        mates = [base + x for x in range(3) if x // 2 == inside // 2]
        assert pair == [bytes([x]) for x in sorted(mates, reverse=True)]


def test_groups_used_at_once_from_two_threads_do_not_mix(server):
    # Each rank splits the job twice, then runs allgathers on both groups from
    # two threads at once over its one connection.
    size = 4
    srv = server(size)

    def body(g):
        a = g.split(0, g.rank)
        b = g.split(0, -g.rank)
        got = {}

        def use(name, group):
            got[name] = [group.allgather(f"{name}{g.rank}.{i}".encode()) for i in range(20)]
        threads = [threading.Thread(target=use, args=(n, x)) for n, x in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return got
    results = run_ranks(size, body, srv)
    for r in range(size):
        got = results[r]
        for i in range(20):
            assert got["a"][i] == [f"a{x}.{i}".encode() for x in range(size)]
            assert got["b"][i] == [f"b{x}.{i}".encode() for x in reversed(range(size))]


def test_a_rank_may_close_and_connect_again(server):
    # hvd.shutdown() then hvd.init(): the rank comes back, collectives go on.
    size = 3
    srv = server(size)

    def body(g):
        first = g.allgather(b"1")
        g.close()
        again = rdv.connect(srv.address(), KEY, g.rank, size)
        try:
            return first, again.allgather(bytes([again.rank]))
        finally:
            again.close()
    results = run_ranks(size, body, srv)
    for r in range(size):
        assert results[r] == ([b"1"] * 3, [bytes([x]) for x in range(size)])


def test_group_from_environment(server, monkeypatch):
    assert rdv.group_from_environment({}) is None
    srv = server(1)
    env = {"HVDMX_RENDEZVOUS": srv.address(), "HVDMX_SECRET_KEY": KEY.hex(),
           "HVDMX_RANK": "0", "HVDMX_SIZE": "1", "HVDMX_LOCAL_RANK": "0"}
    group = rdv.group_from_environment(env)
    try:
        assert (group.rank, group.size) == (0, 1)
        assert group.allgather(b"x") == [b"x"]
        assert srv.connected()[0][1] == 0
    finally:
        group.close()


@pytest.mark.parametrize("change, words", [
    ({"HVDMX_RENDEZVOUS": "nowhere"}, ["HVDMX_RENDEZVOUS='nowhere'", "host:port"]),
    ({"HVDMX_RENDEZVOUS": "h:99999"}, ["HVDMX_RENDEZVOUS='h:99999'"]),
    ({"HVDMX_SECRET_KEY": "abc"}, ["HVDMX_SECRET_KEY must be 64 hex digits", "3 characters"]),
    ({"HVDMX_SECRET_KEY": None}, ["HVDMX_SECRET_KEY is not"]),
    ({"HVDMX_RANK": "2"}, ["HVDMX_RANK='2'", "from 0 to 1"]),
    ({"HVDMX_RANK": "x"}, ["HVDMX_RANK='x'"]),
    ({"HVDMX_SIZE": None}, ["HVDMX_SIZE is not"]),
    ({"HVDMX_SIZE": "0"}, ["HVDMX_SIZE='0'", ">= 1"]),
])
def test_group_from_environment_names_a_bad_variable(change, words):
    env = {"HVDMX_RENDEZVOUS": "127.0.0.1:1", "HVDMX_SECRET_KEY": KEY.hex(),
           "HVDMX_RANK": "0", "HVDMX_SIZE": "2"}
    for name, value in change.items():
        if value is None:
            env.pop(name)
        else:
            env[name] = value
    with pytest.raises(ValueError) as caught:
        rdv.group_from_environment(env)
    for word in words:
        assert word in str(caught.value)
    assert KEY.hex() not in str(caught.value)


def test_an_unreachable_server_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens once closed
    with pytest.raises(ConnectionError, match=rf"rendezvous server at 127\.0\.0\.1:{port}"):
        rdv.connect(f"127.0.0.1:{port}", KEY, 0, 1, connect_timeout=0.5)


# ---- failures of a collective ---------------------------------------------------------

def test_a_member_that_never_posts_times_out_naming_it(server):
    size = 4
    srv = server(size, timeout=1.5)

    def body(g):
        if g.rank == 2:
            time.sleep(4)  # connected, never posts
            return "waited"
        return g.allgather(b"x")
    start = time.monotonic()
    results = run_ranks(size, body, srv)
    assert time.monotonic() - start < 20
    for r in (0, 1, 3):
        error = results[r]
        assert isinstance(error, rdv.RendezvousError), error
        assert "allgather #0 of group g0 failed: ranks 2 did not reach it within 1.5 s " \
               "(HVDMX_RENDEZVOUS_TIMEOUT)" in str(error)
        assert "never connected" not in str(error)


def test_a_rank_that_never_connects_is_named(server):
    srv = server(4, timeout=1)
    results = run_ranks(4, lambda g: g.allgather(b"x"), srv, ranks=[0, 2])
    for r in (0, 2):
        assert isinstance(results[r], rdv.RendezvousError), results[r]
        assert "ranks 1, 3 did not reach it" in str(results[r])
        assert "ranks 1, 3 never connected" in str(results[r])


def test_a_crashed_member_fails_the_others_at_once_naming_it(server):
    size = 3
    srv = server(size, timeout=60)

    def body(g):
        if g.rank == 1:
            _drop_without_goodbye(g)
            return "gone"
        return g.allgather(b"x")
    start = time.monotonic()
    results = run_ranks(size, body, srv)
    assert time.monotonic() - start < 20  # not the 60 s timeout
    for r in (0, 2):
        assert isinstance(results[r], rdv.RendezvousError), results[r]
        assert "rank 1 (host h0, pid" in str(results[r]) and "disconnected" in str(results[r])


def _drop_without_goodbye(group):
    sock = group._connection.channel.sock
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def test_members_that_call_different_collectives_all_fail(server):
    srv = server(3)

    def body(g):
        return g.split(0, 0) if g.rank == 1 else g.allgather(b"x")
    results = run_ranks(3, body, srv)
    for r in range(3):
        assert isinstance(results[r], rdv.RendezvousError), results[r]
        # The first mismatch fails the group; who posted after it learns that.
        text = str(results[r])
        assert "the members called different collectives" in text, text
        assert "called allgather" in text and "ranks 1 called split" in text, text


def test_a_failed_group_stays_failed(server):
    srv = server(2, timeout=0.5)

    def body(g):
        if g.rank == 0:
            with pytest.raises(rdv.RendezvousError, match="did not reach"):
                g.allgather(b"first")
        time.sleep(1.5)
        with pytest.raises(rdv.RendezvousError, match="the group failed before"):
            g.allgather(b"second")
        return "ok"
    assert run_ranks(2, body, srv) == {0: "ok", 1: "ok"}


# ---- what the server refuses ---------------------------------------------------------------

def test_a_wrong_key_is_refused_both_ways(server):
    srv = server(1)
    with pytest.raises(PermissionError, match="refused this process: its HVDMX_SECRET_KEY"):
        rdv.connect(srv.address(), bytes(32), 0, 1)
    wait_for_problem(srv, "refused 127.0.0.1:", "does not hold the job's secret key")
    # A server with another key does not pass for this job's either.
    other = server(1, key=bytes(32))
    with pytest.raises(PermissionError):
        rdv.connect(other.address(), KEY, 0, 1)
    # And the real rank still gets in.
    assert run_ranks(1, lambda g: g.allgather(b"a"), srv) == {0: [b"a"]}


def test_a_rank_outside_the_job_or_twice_is_refused(server):
    srv = server(2)
    with pytest.raises(ConnectionRefusedError, match="rank 5 of 2, but this job has 2 ranks"):
        rdv.connect(srv.address(), KEY, 5, 2)
    with pytest.raises(ConnectionRefusedError, match="this job has 2 ranks"):
        rdv.connect(srv.address(), KEY, 0, 3)
    first = rdv.connect(srv.address(), KEY, 0, 2)
    try:
        with pytest.raises(ConnectionRefusedError, match="rank 0 is already connected"):
            rdv.connect(srv.address(), KEY, 0, 2)
    finally:
        first.close()
    wait_for_problem(srv, "rank 0 is already connected")


class Raw:
    """A client that speaks the protocol by hand, to send what a rank never would."""

    def __init__(self, srv, key=KEY):
        self.sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        self.name = "127.0.0.1:%d" % self.sock.getsockname()[1]
        hello = self.recv(len(wire.MAGIC) + 32)
        theirs, mine = hello[len(wire.MAGIC):], secrets.token_bytes(32)
        self.sock.sendall(mine + wire.mac(key, b"hvdmx-rdv client", theirs, mine))
        assert self.recv(1) == b"\1"
        self.recv(32)
        self.session = wire.mac(key, b"hvdmx-rdv session", theirs, mine)
        self.sent = self.received = 0

    def recv(self, n):
        return wire.receive_exactly(self.sock, n)

    def frame(self, body, length=None, mac=None):
        header = struct.pack("!I", len(body) if length is None else length)
        tag = wire.mac(self.session, b"C", struct.pack("!Q", self.sent), header, body)
        self.sent += 1
        return header + body + (tag if mac is None else mac)

    def receive(self):
        """The server's next frame's body, its MAC checked."""
        header = self.recv(4)
        body = self.recv(struct.unpack("!I", header)[0])
        tag = self.recv(32)
        assert tag == wire.mac(self.session, b"S", struct.pack("!Q", self.received), header,
                               body)
        self.received += 1
        return body

    def hello(self, rank, size):
        self.sock.sendall(self.frame(b"H" + struct.pack("!IIII", rank, size, 0, 1) +
                                     wire.pack_str("raw")))

    def close(self):
        self.sock.close()


def assert_still_serves(srv, size):
    results = run_ranks(size, lambda g: g.allgather(bytes([g.rank])), srv)
    assert results == {r: [bytes([x]) for x in range(size)] for r in range(size)}


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200))
def test_garbage_before_the_handshake_is_refused_naming_the_peer(server, garbage):
    srv = server(1)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        name = "127.0.0.1:%d" % s.getsockname()[1]
        s.sendall(garbage)
        s.shutdown(socket.SHUT_WR)
        wait_for_problem(srv, f"refused {name}")
    assert_still_serves(srv, 1)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300))
def test_garbage_frames_after_the_handshake_are_refused_naming_the_peer(server, body):
    # A correctly framed and authenticated body of random bytes, as the first
    # message (hello) and after a valid hello.
    srv = server(2)
    for with_hello in (False, True):
        raw = Raw(srv)
        if with_hello:
            raw.hello(1, 2)
        raw.sock.sendall(raw.frame(body))
        raw.sock.settimeout(10)
        try:
            while raw.sock.recv(4096):
                pass  # until the server closes: it must, or the recv times out
        except socket.timeout:
            pytest.fail(f"the server kept a connection that sent {body!r}")
        except OSError:
            pass
        raw.close()
        if not (with_hello and body == b"B"):
            wait_for_problem(srv, raw.name)
    if body == b"B":
        assert_still_serves(srv, 2)  # a goodbye: rank 1 may come back
    else:
        # Rank 1 sent garbage: it is lost for this static job, and the server
        # says so to rank 0 at once.
        results = run_ranks(2, lambda g: g.allgather(b"x"), srv, ranks=[0])
        assert "rank 1 (host raw, pid 1," in str(results[0]), results


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from([b"A", b"P"]),
       scope=st.one_of(st.just("g0"), st.text(max_size=20)),
       seq=st.integers(0, 2**64 - 1), color=st.integers(-2**31, 2**31 - 1),
       key=st.integers(-2**63, 2**63 - 1), data=st.binary(max_size=50))
def test_well_formed_posts_of_no_such_collective_get_an_error(server, kind, scope, seq,
                                                              color, key, data):
    # Rank 2 of 3 posts to a group or a collective that does not exist (any
    # scope, any number): it gets an error naming it, nothing crashes, and
    # (unless it made the job's group fail) the job's collectives go on.
    if scope == "g0" and seq == 0:
        seq = 1
    srv = server(3)
    raw = Raw(srv)
    raw.hello(2, 3)
    assert raw.receive()[:1] == b"W"
    fields = struct.pack("!Q", seq) + (wire.pack_bytes(data) if kind == b"A"
                                       else struct.pack("!iq", color, key))
    raw.sock.sendall(raw.frame(kind + wire.pack_str(scope) + fields))
    answer = raw.receive()
    assert answer[:1] == b"E"
    text = answer.decode(errors="replace")
    if scope == "g0":
        assert f"rank 2 posted collective #{seq} while the group is at #0" in text
    else:
        assert "no such group" in text
        # The job goes on: rank 2 (by hand) and ranks 0 and 1 gather.
        raw.sock.sendall(raw.frame(b"A" + wire.pack_str("g0") + struct.pack("!Q", 0) +
                                   wire.pack_bytes(b"2")))
        results = run_ranks(3, lambda g: g.allgather(bytes([48 + g.rank])), srv, ranks=[0, 1])
        assert results == {0: [b"0", b"1", b"2"], 1: [b"0", b"1", b"2"]}
        assert raw.receive()[:1] == b"R"
    raw.close()


@pytest.mark.parametrize("how", ["oversized", "truncated body", "truncated header",
                                 "bad mac", "replayed", "unknown type", "short fields",
                                 "long scope", "trailing bytes"])
def test_bad_frames_are_refused_naming_the_peer_and_the_others_go_on(server, how):
    srv = server(2, timeout=30)
    raw = Raw(srv)
    hello = b"H" + struct.pack("!IIII", 1, 2, 0, 1) + wire.pack_str("raw")
    if how == "oversized":
        raw.sock.sendall(struct.pack("!I", 0xFFFFFFF0) + b"x" * 100)
        words = ["a frame of 4294967280 bytes announced, over the limit"]
    elif how == "truncated body":
        raw.sock.sendall(raw.frame(hello)[:20])
        raw.sock.shutdown(socket.SHUT_WR)
        words = ["the connection closed in the middle of a message"]
    elif how == "truncated header":
        raw.sock.sendall(b"\0\0")
        raw.sock.shutdown(socket.SHUT_WR)
        words = ["the connection closed in the middle"]
    elif how == "bad mac":
        raw.sock.sendall(raw.frame(hello, mac=bytes(32)))
        words = ["MAC does not match"]
    elif how == "replayed":
        # A valid frame of another connection, replayed here.
        other = Raw(srv)
        recorded = other.frame(hello)
        other.close()
        raw.sock.sendall(recorded)
        words = ["MAC does not match"]
    elif how == "unknown type":
        raw.hello(1, 2)
        raw.sock.sendall(raw.frame(b"Z123"))
        words = ["rank 1 (host raw, pid 1,", "unknown type b'Z'"]
    elif how == "short fields":
        raw.sock.sendall(raw.frame(b"H\0\0\0"))
        words = ["ends at byte 0, where 16 more were due"]
    elif how == "long scope":
        raw.hello(1, 2)
        raw.sock.sendall(raw.frame(b"A" + struct.pack("!I", 1 << 30) + b"g0"))
        words = ["a group scope of 1073741824 bytes, over the limit of 512"]
    else:
        raw.hello(1, 2)
        raw.sock.sendall(raw.frame(b"A" + wire.pack_str("g0") + struct.pack("!Q", 0) +
                                   wire.pack_bytes(b"x") + b"junk"))
        words = ["4 bytes after the end of a message"]
    line = wait_for_problem(srv, *words)
    assert raw.name in line, line
    raw.close()
    if how in ("unknown type", "long scope", "trailing bytes"):
        # It was rank 1: the job's collectives now fail naming it, at once.
        results = run_ranks(2, lambda g: g.allgather(b"x"), srv, ranks=[0])
        assert "rank 1 (host raw" in str(results[0]) and "disconnected" in str(results[0])
    else:
        assert_still_serves(srv, 2)


def test_posts_and_results_over_the_limits_are_refused(server):
    srv = server(2, max_post_bytes=100, max_result_bytes=150)
    # Within both limits: fine. Over the result's: everyone fails, naming it.
    assert run_ranks(2, lambda g: g.allgather(b"x" * 60), srv) == {0: [b"x" * 60] * 2,
                                                                   1: [b"x" * 60] * 2}
    srv = server(2, max_post_bytes=100, max_result_bytes=150)
    results = run_ranks(2, lambda g: g.allgather(b"x" * 100), srv)
    for r in (0, 1):
        assert isinstance(results[r], rdv.RendezvousError)
        assert "its result would be 200 bytes, over the limit of 150" in str(results[r])
    # Over a post's: that member is dropped (naming it) and the others fail at once.
    srv = server(2, max_post_bytes=100)
    results = run_ranks(2, lambda g: g.allgather(b"x" * (101 if g.rank else 1)), srv)
    wait_for_problem(srv, "dropped rank 1 (host h0", "an allgather's data of 101 bytes, over "
                     "the limit of 100")
    assert "rank 1 (host h0" in str(results[0]) and "disconnected" in str(results[0])
    assert isinstance(results[1], ConnectionError)


def test_silent_strangers_do_not_delay_the_ranks(server):
    srv = server(2, handshake_seconds=1.0)
    strangers = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(20)]
    try:
        start = time.monotonic()
        assert_still_serves(srv, 2)
        assert time.monotonic() - start < 10
        wait_for_problem(srv, "did not prove itself within 1 s")
    finally:
        for s in strangers:
            s.close()


def test_the_key_never_appears_in_messages(server):
    srv = server(1)
    with pytest.raises(PermissionError) as caught:
        rdv.connect(srv.address(), bytes(32), 0, 1)
    wait_for_problem(srv, "refused")
    for text in [str(caught.value), *srv.problems]:
        assert KEY.hex() not in text and bytes(32).hex() not in text


def test_pid_and_host_of_members_are_known_for_elastic_renumbering(server):
    srv = server(2)
    # Read between two collectives: nobody has closed yet.
    seen = run_ranks(2, lambda g: (g.allgather(b""), srv.connected(), g.allgather(b""))[1],
                     srv)
    assert seen[0] == {0: ("h0", 0, os.getpid()), 1: ("h0", 1, os.getpid())}
    assert srv.world == "g0" and srv.generation == 0
