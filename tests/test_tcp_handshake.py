"""The TCP transport's door (csrc/hvdmx/comm/tcp_handshake.h and tcp_links.cc): every
connection proves the job's key before a byte of it is believed, strangers at a rank's
port are dropped without delaying the job, and a peer that lies about sizes fails the
comm with an error naming it, never an abort.

The protocol is written out a second time here, in Python with the standard library's
hmac, so that the C++ side is checked against an independent reading of Note
[Authenticating a connection] rather than against itself."""
import hashlib
import hmac
import os
import socket
import struct
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _hvdmx_testing as t

pytestmark = pytest.mark.timeout(120)

KEY = t.tcp_test_key
OTHER_KEY = b"o" * 32
COMM_ID = bytes(range(16))
MAGIC = b"HVDXtcp1"
HELLO = t.handshake_hello_bytes
REFUSAL = b"HVDX: your proof of the key does not verify".ljust(32, b".")[:32]
CHALLENGE = t.handshake_challenge_bytes


def hello(comm_id, generation, src, dst, nonce, magic=MAGIC):
    return magic + comm_id + struct.pack("<III", generation, src, dst) + nonce


def transcript(nc, na, comm_id, generation, connector, acceptor):
    return nc + na + comm_id + struct.pack("<III", generation, connector, acceptor)


def mac(key, label, text):
    return hmac.new(key, label + text, hashlib.sha256).digest()


def recv_exactly(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


# ------------------------------------------------------------------ the handshake alone


def run_pair(connector, acceptor):
    """Passes bytes between two handshakes until neither moves."""
    for _ in range(10):
        moved = False
        for a, b in ((connector, acceptor), (acceptor, connector)):
            out = a.output()
            if out and b.want():
                n = min(len(out), b.want())
                b.feed(out[:n])
                a.sent(n)
                moved = True
        if not moved:
            break


def test_two_ranks_with_the_key_finish_the_handshake():
    c = t.Handshake.connector(KEY, COMM_ID, 3, self=1, size=4, peer=2)
    a = t.Handshake.acceptor(KEY, COMM_ID, 3, self=2)
    run_pair(c, a)
    assert (c.state(), a.state()) == ("done", "done")
    assert a.peer() == 1 and c.peer() == 2
    assert c.output() == b"" and a.output() == b""


@pytest.mark.parametrize("whose", ["connector", "acceptor"])
def test_a_rank_with_another_key_is_refused_as_such(whose):
    c = t.Handshake.connector(OTHER_KEY if whose == "connector" else KEY, COMM_ID, 0, 0, 2, 1)
    a = t.Handshake.acceptor(OTHER_KEY if whose == "acceptor" else KEY, COMM_ID, 0, 1)
    run_pair(c, a)
    # The connector checks first: it refuses the acceptor's proof, and says so
    # in place of its own, so that both know why.
    assert c.state() == "rejected" and c.wrong_key(), c.why()
    assert a.state() == "rejected" and a.wrong_key() and "refused" in a.why(), a.why()


def test_the_acceptor_proves_the_key_as_the_protocol_says():
    """C++'s acceptor against this file's connector: the MACs agree byte for byte."""
    a = t.Handshake.acceptor(KEY, COMM_ID, 7, self=5)
    nc = os.urandom(32)
    a.feed(hello(COMM_ID, 7, 2, 5, nc))
    reply = a.output()
    assert len(reply) == CHALLENGE and a.peer() == 2
    na, their_mac = reply[:32], reply[32:]
    text = transcript(nc, na, COMM_ID, 7, 2, 5)
    assert their_mac == mac(KEY, b"A", text)
    a.sent(len(reply))
    a.feed(mac(KEY, b"C", text))
    assert a.state() == "done"


def test_the_connector_proves_the_key_as_the_protocol_says():
    c = t.Handshake.connector(KEY, COMM_ID, 1, self=0, size=3, peer=2)
    h = c.output()
    assert len(h) == HELLO and h[:8] == MAGIC and h[8:24] == COMM_ID
    assert struct.unpack("<III", h[24:36]) == (1, 0, 2)
    nc = h[36:]
    c.sent(len(h))
    na = os.urandom(32)
    text = transcript(nc, na, COMM_ID, 1, 0, 2)
    c.feed(na + mac(KEY, b"A", text))
    assert c.state() == "done" and c.output() == mac(KEY, b"C", text)


def test_a_replayed_proof_does_not_verify():
    """A proof recorded from one handshake, replayed in the next: the acceptor's
    nonce is new, so it fails."""
    first = t.Handshake.acceptor(KEY, COMM_ID, 0, self=1)
    nc = os.urandom(32)
    first.feed(hello(COMM_ID, 0, 0, 1, nc))
    na = first.output()[:32]
    recorded = mac(KEY, b"C", transcript(nc, na, COMM_ID, 0, 0, 1))
    second = t.Handshake.acceptor(KEY, COMM_ID, 0, self=1)
    second.feed(hello(COMM_ID, 0, 0, 1, nc))
    second.sent(len(second.output()))
    second.feed(recorded)
    assert second.state() == "rejected" and second.wrong_key()


@pytest.mark.parametrize("field, value, why", [
    ("magic", b"HVDXtcp0", "not an hvdmx hello"),
    ("comm_id", bytes(16), "another communicator"),
    ("generation", 4, "generation 4"),
    ("to", 2, "connecting to rank 2"),
    ("from", 3, "claims rank 3"),
    ("from", 1, "claims rank 1"),
])
def test_a_hello_for_someone_else_is_dropped_before_any_proof(field, value, why):
    fields = {"magic": MAGIC, "comm_id": COMM_ID, "generation": 3, "from": 0, "to": 1}
    fields[field] = value
    a = t.Handshake.acceptor(KEY, COMM_ID, 3, self=1)
    a.feed(hello(fields["comm_id"], fields["generation"], fields["from"], fields["to"],
                 os.urandom(32), magic=fields["magic"]))
    assert a.state() == "rejected" and not a.wrong_key()
    assert why in a.why(), a.why()
    assert a.output() == b""


@settings(max_examples=400, deadline=None)
@given(data=st.binary(max_size=200), chunks=st.lists(st.integers(1, 80), max_size=20),
       role=st.sampled_from(["acceptor", "connector"]))
def test_any_bytes_leave_the_handshake_running_or_rejected(data, chunks, role):
    """Fuzz: whatever arrives, in whatever pieces, the handshake never reads past
    the message it expects, never finishes without the key, and never crashes."""
    if role == "acceptor":
        h = t.Handshake.acceptor(KEY, COMM_ID, 0, self=1)
    else:
        h = t.Handshake.connector(KEY, COMM_ID, 0, 0, 2, 1)
        h.sent(len(h.output()))
    at = 0
    for size in chunks + [len(data)]:
        if h.state() != "running" or at >= len(data):
            break
        want = h.want()
        assert 0 < want <= HELLO
        piece = data[at:at + min(size, want)]
        at += len(piece)
        h.feed(piece)
        if h.output():
            h.sent(len(h.output()))
    assert h.state() in ("running", "rejected")


# ------------------------------------------------------------------ strangers at the port


def stranger(ip="127.0.0.2"):
    """A client from another address than the ranks' (127.0.0.1), as another host."""
    s = socket.socket()
    s.bind((ip, 0))
    return s


def endpoint(entry):
    ip, port = entry.split()[0].split(":")
    return ip, int(port)


class Strangers:
    """What `how` does to every rank's port before the ranks make their links; the
    sockets stay open until close()."""

    def __init__(self, how, count):
        self.how, self.count, self.sockets, self.threads = how, count, [], []

    def __call__(self, entries):
        comm_id = bytes.fromhex(entries[0].split()[-1])
        for rank, entry in enumerate(entries):
            for _ in range(self.count):
                s = stranger()
                s.connect(endpoint(entry))
                self.sockets.append(s)
                if self.how == "garbage":
                    s.sendall(os.urandom(HELLO))
                elif self.how == "slow":
                    s.sendall(MAGIC[:3])
                elif self.how in ("replay", "wrong_key") and rank > 0:
                    # A hello that passes every check (the id is known), then a
                    # proof that is not: recorded from another handshake, or made
                    # with another key.
                    nc = os.urandom(32)
                    s.sendall(hello(comm_id, 0, 0, rank, nc))
                    if self.how == "replay":
                        s.sendall(os.urandom(32))
                    else:
                        # The challenge comes once the rank makes its links,
                        # after this call returns.
                        text = (nc, comm_id, rank)
                        self.threads.append(threading.Thread(
                            target=self.prove_another_key, args=(s, text), daemon=True))
                        self.threads[-1].start()

    @staticmethod
    def prove_another_key(s, text):
        nc, comm_id, rank = text
        try:
            na = recv_exactly(s, CHALLENGE)[:32]
            s.sendall(mac(OTHER_KEY, b"C", transcript(nc, na, comm_id, 0, 0, rank)))
        except OSError:
            pass  # dropped first

    def close(self):
        for s in self.sockets:
            s.close()
        for thread in self.threads:
            thread.join(10)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how, count", [("silent", 100), ("slow", 10), ("garbage", 10),
                                        ("replay", 5), ("wrong_key", 5)])
def test_strangers_at_the_ports_are_dropped_and_the_job_runs(how, count):
    """Every rank's port has `count` strangers in its queue when the links are made:
    the job still gets the right sum, every rank drops connections, and (a handshake
    at a time, at 2 s each, would take minutes) the test's timeout is never near."""
    n = 3
    strangers = Strangers(how, count)
    try:
        results = t.tcp_strangers(n, [], strangers)
    finally:
        strangers.close()
    assert [r["error"] for r in results] == [""] * n
    expected = [float(sum(r * 10 + i for r in range(n))) for i in range(5)]
    assert all(r["sum"] == expected for r in results)
    # Ranks above 0 accept their lower peers, and with them the strangers that
    # queued first: each is dropped when it fails, after 2 s, or when the port
    # closes. Rank 0 accepts from no one (its queue closes with the port).
    if how != "silent":
        assert all(r["dropped"] > 0 for r in results[1:]), [r["dropped"] for r in results]


def test_a_rank_with_another_key_is_refused_on_every_rank():
    results = t.tcp_strangers(3, [KEY, KEY, OTHER_KEY], lambda entries: None,
                              give_up_seconds=5)
    # Rank 2 meets another key in whichever of ranks 0 and 1 reaches it first and
    # names it. Rank 1 names rank 2: as holding another key, or, when rank 2 had
    # already ended for that reason before rank 1's connect arrived, as gone.
    for other in (0, 1):
        error = results[2]["error"]
        if f"rank {other} (host" in error:
            assert "do not hold the same secret key" in error, error
    error = results[1]["error"]
    assert "rank 2 (host" in error, error
    assert "do not hold the same secret key" in error or "Connection refused" in error or \
        "closed" in error, error
    assert "do not hold the same secret key" in results[2]["error"], results[2]["error"]
    # Rank 0 meets rank 2's key too, unless rank 1, gone for that reason
    # already, refuses its connection first: then it names rank 1 as gone.
    error = results[0]["error"]
    assert ("rank 2 (host" in error and "do not hold the same secret key" in error) or \
        ("rank 1 (host" in error and ("Connection refused" in error or "closed" in error)), error


# ------------------------------------------------------------------ a peer that lies


class LyingPeer:
    """Rank 1 of a pair, played here: answers rank 0's handshake with `key`, then
    sends `frames` (raw bytes) and waits for rank 0 to close (or, without
    `linger`, closes)."""

    def __init__(self, frames, key=KEY, linger=True):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.frames, self.key, self.linger, self.error = frames, key, linger, None
        self.refused = False
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    @property
    def address(self):
        return "127.0.0.1:%d" % self.listener.getsockname()[1]

    def serve(self):
        try:
            conn, _ = self.listener.accept()
            with conn:
                h = recv_exactly(conn, HELLO)
                comm_id, nc = h[8:24], h[36:]
                generation, src, dst = struct.unpack("<III", h[24:36])
                na = os.urandom(32)
                text = transcript(nc, na, comm_id, generation, src, dst)
                conn.sendall(na + mac(self.key, b"A", text))
                proof = recv_exactly(conn, 32)
                if proof == REFUSAL:
                    self.refused = True
                    return
                assert proof == mac(self.key, b"C", text)
                conn.sendall(self.frames)
                if not self.linger:
                    return
                conn.settimeout(30)
                try:
                    while conn.recv(1 << 16):
                        pass
                except ConnectionResetError:
                    pass  # rank 0 closed with our bytes unread
        except Exception as e:  # reported by the test
            self.error = e

    def close(self):
        self.listener.close()
        self.thread.join(30)


# A report's text: what its sender stopped on (TcpComm::ReportStop).
REPORT = b"rank 3 sent y, which the protocol does not allow"


def frame(length, body=b""):
    return struct.pack("<Q", length) + body


@pytest.mark.parametrize("what, size, frames, expected", [
    ("recv", 16, frame(17, b"x" * 17), "a message of 17 bytes where 16 were expected"),
    ("recv", 16, frame(2 ** 62), "a message of 4611686018427387904 bytes where 16 were expected"),
    # The header's top bit marks a report (Note [A rank's finding reaches every
    # rank]), whose length is bounded too.
    ("recv", 16, frame(2 ** 63 + 5000), "a report of 5000 bytes where at most 4096 may follow"),
    ("recv", 16, frame(2 ** 63 + 2 ** 40), "a report of 1099511627776 bytes where at most 4096"),
    ("recv", 16, frame(2 ** 63 + len(REPORT), REPORT), " reports that rank 3 sent y, which"),
    ("gather", 0, frame(2 ** 40), "bytes where at most 1073741824 were expected"),
    ("gather", 0, frame(5, b"abcde"), "a gather of 5 bytes with record's rank 1684234849, outside"),
    ("gather", 0, frame(12, struct.pack("<IQ", 0, 0)),
     "a gather record for rank 0, which is not of its subtree or came twice"),
    ("gather", 0, frame(12, struct.pack("<IQ", 1, 9)),
     "a count of record's bytes of 9, outside [0, 0]"),
    ("bit_and", 0, frame(3, b"abc"), "a bit-and of 3 bytes where 16 were expected"),
    # Rank 0 takes, with each rank's word, its partial's length and up to 24 KiB
    # of partial, and a payload of up to 64 MiB.
    ("bit_and", 0, frame(2 ** 40),
     "bytes where at most %d were expected" % (16 + 24 * 1024 + (64 << 20))),
    ("bit_and", 0, frame(24, struct.pack("<QQ", 2 ** 64 - 1, 9) + b"x" * 8),
     "a bit-and partial of 9 bytes, where 8 followed"),
])
def test_a_peer_that_lies_about_sizes_fails_the_comm_naming_it(what, size, frames, expected):
    peer = LyingPeer(frames)
    try:
        got = t.tcp_lying_peer(peer.address, what, size)
    finally:
        peer.close()
    assert peer.error is None, peer.error
    assert expected in got, got
    assert "rank 1 (host lying-peer" in got and "protocol does not allow" in got, got


def test_a_listener_with_another_key_is_refused():
    peer = LyingPeer(b"", key=OTHER_KEY)
    try:
        got = t.tcp_lying_peer(peer.address, "recv", 1)
    finally:
        peer.close()
    assert peer.error is None and peer.refused, peer.error
    assert "rank 1 (host lying-peer" in got and "do not hold the same secret key" in got, got


@settings(max_examples=60, deadline=None)
@given(what=st.sampled_from(["recv", "gather", "bit_and"]),
       frames=st.lists(st.tuples(st.integers(0, 2 ** 64 - 1) | st.integers(0, 64),
                                 st.binary(max_size=64)), max_size=4),
       tail=st.binary(max_size=12))
def test_any_frames_end_in_a_result_or_an_error_naming_the_peer(what, frames, tail):
    """Fuzz: after a good handshake the peer sends frames with any lengths and
    bodies (and stray bytes), then closes. Rank 0 either gets a message it accepts
    or fails naming rank 1, never crashes or waits on."""
    data = b"".join(frame(length, body) for length, body in frames) + tail
    peer = LyingPeer(data, linger=False)
    try:
        got = t.tcp_lying_peer(peer.address, what, 16)
    finally:
        peer.close()
    assert peer.error is None, peer.error
    assert got == "" or "rank 1 (host lying-peer" in got, got
