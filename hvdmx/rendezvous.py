"""The rendezvous of a job started without MPI (``hvdmxrun --no-mpi``): a
small authenticated TCP service that the launcher runs on a thread
(RendezvousServer), and its client, a group of processes (StoreGroup) with
the two collectives ``hvd.init()`` needs to bootstrap over it: ``allgather``
of bytes and ``split`` (MPI_Comm_split). Pure Python, standard library only:
the ranks load it before MXNet or MPI.

    group = group_from_environment()   # None unless HVDMX_RENDEZVOUS is set
    everyone = group.allgather(b"my address")   # every member's bytes, rank order
    sub = group.split(color, key)               # None where color < 0

Note [The rendezvous protocol]
Every connection starts with a mutual challenge-response over the job's
secret key K (HVDMX_SECRET_KEY, 64 hex digits = 32 bytes):

    server -> client: MAGIC (16 bytes), Ns (32 fresh random bytes)
    client -> server: Nc (32 fresh random bytes), HMAC(K, "hvdmx-rdv client" Ns Nc)
    server -> client: 1, HMAC(K, "hvdmx-rdv server" Nc Ns)     (or 0: refused, closed)

Both then use the session key S = HMAC(K, "hvdmx-rdv session" Ns Nc), new
for each connection. Every later message is a frame

    u32 length | body (length bytes) | HMAC(S, direction counter length body)

with direction b"C" (client to server) or b"S", and counter the number of
frames sent before in that direction. So a frame recorded on one connection
fails on every other (another S), and a frame replayed, dropped or
reordered on its own connection fails too (another counter). The bytes are
not encrypted: what travels here (addresses, topology) is not secret, and
the key never travels. A connection that has not proved itself within
HANDSHAKE_SECONDS is dropped; until then it costs a thread and 96 bytes.

Bodies (integers big-endian; "str" and "bytes" are u32 length + bytes):

    client: b"H" u32 rank, u32 size, u32 slot, u32 pid, str host    hello, first
            b"A" str scope, u64 seq, bytes data                     allgather post
            b"P" str scope, u64 seq, i32 color, i64 key             split post
            b"B"                                                    goodbye (close)
    server: b"W" u32 generation, u32 rank, u32 size, u64 world seq, f64 timeout,
              str world scope                                       welcome
            b"R" str scope, u64 seq, u32 n, n x bytes               allgather result
            b"S" str scope, u64 seq, str new scope ("" = none), u32 rank, u32 size
            b"E" str scope, u64 seq, str message       an error (scope "" = the connection's)

Note [Collectives at the server]
A group is a scope name and the list of its members' ranks in the job,
known to the server: the job's is "g<generation>", each split makes its
children ("<scope>.<seq>.<color>") when it completes. Each member numbers
its collectives on a group 0, 1, 2, ...; the server keeps the posts of the
operation (scope, seq) until every member has posted, then answers all of
them at once: O(size) work per operation, and no member waits for another
member's round trip. A post out of order, of the wrong kind, from a process
that is not a member, or one that would wait for a member that has crashed
fails the operation for everyone with a message that names the ranks; an
operation still incomplete after the timeout (HVDMX_RENDEZVOUS_TIMEOUT)
fails naming the members that did not post. A failed group stays failed.

Membership is kept ready for elastic jobs (issue 49): every scope starts
with the job's generation, and each member says which host and slot it is,
so that a later generation can renumber the survivors. This module serves
the static job: generation 0, ranks as the launcher gave them.
"""
from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
import socket
import struct
import sys
import threading
import time
from typing import Callable, Dict, List, Mapping, Optional, Tuple

__all__ = ["RendezvousServer", "StoreGroup", "RendezvousError", "connect",
           "group_from_environment", "parse_key", "parse_address", "TIMEOUT_VARIABLE",
           "ADDRESS_VARIABLE", "DEFAULT_TIMEOUT"]

ADDRESS_VARIABLE = "HVDMX_RENDEZVOUS"
TIMEOUT_VARIABLE = "HVDMX_RENDEZVOUS_TIMEOUT"
KEY_VARIABLES = ("HVDMX_SECRET_KEY", "HOROVOD_SECRET_KEY")
DEFAULT_TIMEOUT = 300.0  # seconds; the TCP transport gives up after as long
HANDSHAKE_SECONDS = 10.0
SEND_SECONDS = 60.0  # a member that does not read its answers for this long is dropped
MAX_POST_BYTES = 16 << 20  # one member's bytes in one allgather
MAX_SCOPE_BYTES = 512
MAX_HOST_BYTES = 255
MAX_STRANGERS = 256  # connections at once that have not proved themselves yet
MAGIC = b"hvdmx-rdv-v1\0\0\0\0"
KEY_BYTES = 32
_NONCE = 32
_MAC = 32
_HEADER = struct.Struct("!I")
_FRAME_OVERHEAD = 64 + MAX_SCOPE_BYTES + MAX_HOST_BYTES


class RendezvousError(RuntimeError):
    """A collective of the rendezvous failed (a member did not arrive in
    time, crashed, or called another collective), or the server is gone."""


class ProtocolError(Exception):
    """Bytes from the network that are not what the protocol says."""


# ---- configuration ----------------------------------------------------------

def parse_key(text: str, name: str = "HVDMX_SECRET_KEY") -> bytes:
    """The job's key from its 64 hex digits; the error names the variable
    and never repeats its value."""
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise ValueError(f"{name} must be {2 * KEY_BYTES} hex digits (a 256-bit key), but it "
                         f"has {len(text)} characters; make one with: python -c 'import "
                         "secrets; print(secrets.token_hex(32))', or unset it and hvdmxrun "
                         "makes one for the job")
    return key


def key_from_environment(environ: Mapping[str, str]) -> bytes:
    for name in KEY_VARIABLES:
        if environ.get(name):
            return parse_key(environ[name], name)
    raise ValueError(f"{ADDRESS_VARIABLE} is set but HVDMX_SECRET_KEY is not: the rendezvous "
                     "needs the job's secret key; start the ranks with hvdmxrun --no-mpi, "
                     "which sets both")


def parse_address(text: str, name: str = ADDRESS_VARIABLE) -> Tuple[str, int]:
    """'host:port' or '[v6 address]:port'."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}={text!r} is not an address; write host:port, e.g. "
                         "10.0.0.1:29500 (hvdmxrun --no-mpi sets it for every rank)")
    return host, int(port)


def parse_timeout(text: Optional[str], name: str = TIMEOUT_VARIABLE) -> float:
    if text is None or text == "":
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < math.inf:
        raise ValueError(f"{name}={text!r} must be a number of seconds > 0 (default "
                         f"{DEFAULT_TIMEOUT:g})")
    return seconds


def _integer(environ: Mapping[str, str], name: str, low: int, high: Optional[int] = None) -> int:
    text = environ.get(name)
    if text is None or not text.strip().isdigit() or int(text) < low or \
            (high is not None and int(text) > high):
        bound = f">= {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"{name}={text!r} must be an integer {bound}; hvdmxrun --no-mpi sets "
                         "it for every rank" if text is not None else
                         f"{ADDRESS_VARIABLE} is set but {name} is not; hvdmxrun --no-mpi "
                         "sets both for every rank")
    return int(text)


# ---- bytes on the wire --------------------------------------------------------

def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _pack_bytes(data: bytes) -> bytes:
    return _HEADER.pack(len(data)) + data


def _pack_str(text: str) -> bytes:
    return _pack_bytes(text.encode("utf-8"))


class _Reader:
    """Reads a body's fields; every read checks that the bytes are there."""

    def __init__(self, body: bytes):
        self.body, self.at = body, 0

    def take(self, count: int) -> bytes:
        if count < 0 or self.at + count > len(self.body):
            raise ProtocolError(f"a message of {len(self.body)} bytes ends at byte {self.at}, "
                                f"where {count} more were due")
        data = self.body[self.at:self.at + count]
        self.at += count
        return data

    def unpack(self, fmt: str) -> tuple:
        s = struct.Struct("!" + fmt)
        return s.unpack(self.take(s.size))

    def blob(self, limit: int, what: str) -> bytes:
        (length,) = self.unpack("I")
        if length > limit:
            raise ProtocolError(f"{what} of {length} bytes, over the limit of {limit}")
        return self.take(length)

    def text(self, limit: int, what: str) -> str:
        try:
            return self.blob(limit, what).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"{what} is not UTF-8") from None

    def end(self) -> None:
        if self.at != len(self.body):
            raise ProtocolError(f"{len(self.body) - self.at} bytes after the end of a message")


def _receive_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(min(count - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed" + (
                f" in the middle of a message ({len(data)} of {count} bytes)" if data else ""))
        data += chunk
    return bytes(data)


class _Channel:
    """One authenticated connection's frames, each way (See Note [The
    rendezvous protocol]). send() may be called from any thread."""

    def __init__(self, sock: socket.socket, session: bytes, mine: bytes, theirs: bytes,
                 limit: int):
        self.sock, self.session, self.limit = sock, session, limit
        self.mine, self.theirs = mine, theirs
        self.sent = self.received = 0
        self.send_lock = threading.Lock()

    def send(self, body: bytes) -> None:
        with self.send_lock:
            header = _HEADER.pack(len(body))
            tag = _mac(self.session, self.mine, struct.pack("!Q", self.sent), header, body)
            self.sent += 1
            self.sock.sendall(header + body + tag)

    def receive(self) -> bytes:
        header = _receive_exactly(self.sock, _HEADER.size)
        (length,) = _HEADER.unpack(header)
        if length > self.limit:
            raise ProtocolError(f"a frame of {length} bytes announced, over the limit of "
                                f"{self.limit}")
        body = _receive_exactly(self.sock, length)
        tag = _receive_exactly(self.sock, _MAC)
        want = _mac(self.session, self.theirs, struct.pack("!Q", self.received), header, body)
        if not hmac.compare_digest(tag, want):
            raise ProtocolError("a frame whose MAC does not match (altered, replayed from "
                                "another connection, or out of order)")
        self.received += 1
        return body


def _peer_name(sock: socket.socket) -> str:
    try:
        peer = sock.getpeername()
    except OSError:
        return "an unknown peer"
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"[{peer[0]}]:{peer[1]}" if ":" in str(peer[0]) else f"{peer[0]}:{peer[1]}"
    return str(peer)


# ---- the server ----------------------------------------------------------------

class _Member:
    """A rank's connection at the server."""

    def __init__(self, channel: _Channel, peer: str, rank: int, host: str, slot: int, pid: int):
        self.channel, self.peer = channel, peer
        self.rank, self.host, self.slot, self.pid = rank, host, slot, pid

    def describe(self) -> str:
        return f"rank {self.rank} (host {self.host}, pid {self.pid}, {self.peer})"


class _Operation:
    def __init__(self, kind: bytes, deadline: float):
        self.kind, self.deadline = kind, deadline
        self.posts: Dict[int, object] = {}  # member index in the group -> data
        self.kinds: Dict[int, bytes] = {}


class RendezvousServer:
    """The rendezvous of one job of `size` ranks, holding `key` (32 bytes).

    Listens on (`host`, `port`) (default: every interface, a free port) from
    construction; serves on daemon threads until close(). `timeout` bounds
    every collective (default $HVDMX_RENDEZVOUS_TIMEOUT, else 300 s). What it
    refuses (strangers, garbage, a rank twice) it reports once through
    `on_problem` (default: a line on stderr) and in `problems`, naming the
    peer's address; it never ends or stops serving the others because of it.

    Thread use: the constructor and close() from the owner; the rest runs
    on the server's threads. State is guarded by one lock; answers are sent
    after it is released.
    """

    def __init__(self, size: int, key: bytes, host: str = "", port: int = 0,
                 timeout: Optional[float] = None,
                 on_problem: Optional[Callable[[str], None]] = None,
                 max_post_bytes: int = MAX_POST_BYTES):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"RendezvousServer: size={size!r} must be an int >= 1")
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"RendezvousServer: key must be {KEY_BYTES} bytes")
        self.size, self.key = size, key
        self.timeout = parse_timeout(os.environ.get(TIMEOUT_VARIABLE)) if timeout is None \
            else float(timeout)
        if not 0 < self.timeout < math.inf:
            raise ValueError(f"RendezvousServer: timeout={timeout!r} must be seconds > 0")
        self.max_post_bytes = max_post_bytes
        self.generation = 0
        self.world = f"g{self.generation}"
        self.problems: List[str] = []
        self._on_problem = on_problem or (lambda text: print(
            f"hvdmx rendezvous: {text}", file=sys.stderr, flush=True))
        self._lock = threading.Lock()
        self._members: Dict[int, _Member] = {}      # connected ranks
        self._lost: Dict[int, str] = {}             # ranks that crashed: why
        self._ever: Dict[int, str] = {}             # ranks ever connected: how, for messages
        self._groups: Dict[str, List[int]] = {self.world: list(range(size))}
        self._next: Dict[str, int] = {self.world: 0}
        self._failed: Dict[str, str] = {}
        self._pending: Dict[Tuple[str, int], _Operation] = {}
        self._strangers = 0
        self._sockets: set = set()
        self._closed = threading.Event()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=1024)
        self.host, self.port = self._listener.getsockname()[:2]
        self._threads = [threading.Thread(target=self._accept, name="hvdmx-rdv-accept",
                                          daemon=True),
                         threading.Thread(target=self._watch_deadlines,
                                          name="hvdmx-rdv-deadlines", daemon=True)]
        for thread in self._threads:
            thread.start()

    # ---- outside view

    def address(self, host: Optional[str] = None) -> str:
        """'host:port' for HVDMX_RENDEZVOUS (`host` default: the listening one)."""
        host = host or (self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1")
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def connected(self) -> Dict[int, Tuple[str, int, int]]:
        """{rank: (host, slot, pid)} of the ranks connected now."""
        with self._lock:
            return {r: (m.host, m.slot, m.pid) for r, m in self._members.items()}

    def close(self) -> None:
        """Stops serving: the listener and every connection close; a member
        waiting in a collective gets ConnectionError. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _drop(sock)
        for thread in self._threads:
            thread.join(5)

    def __enter__(self) -> "RendezvousServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- threads

    def _problem(self, text: str) -> None:
        with self._lock:
            self.problems.append(text)
            del self.problems[:-1000]
        try:
            self._on_problem(text)
        except Exception:
            pass

    def _accept(self) -> None:
        # accept() wakes every 0.2 s to see whether the server is closed:
        # closing a socket does not wake a thread blocked in accept() on it.
        self._listener.settimeout(0.2)
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.1)  # EMFILE and the like: let connections end
                continue
            with self._lock:
                crowded = self._strangers >= MAX_STRANGERS
                if not crowded:
                    self._strangers += 1
                    self._sockets.add(sock)
            if crowded:
                peer = _peer_name(sock)
                _drop(sock)
                self._problem(f"refused {peer}: {MAX_STRANGERS} connections are already "
                              "proving themselves")
                continue
            threading.Thread(target=self._serve, args=(sock,), name="hvdmx-rdv-conn",
                             daemon=True).start()

    def _handshake(self, sock: socket.socket) -> _Channel:
        mine = secrets.token_bytes(_NONCE)
        sock.sendall(MAGIC + mine)
        answer = _receive_exactly(sock, _NONCE + _MAC)
        theirs, proof = answer[:_NONCE], answer[_NONCE:]
        if not hmac.compare_digest(proof, _mac(self.key, b"hvdmx-rdv client", mine, theirs)):
            try:
                sock.sendall(b"\0")
            except OSError:
                pass
            raise PermissionError("it does not hold the job's secret key")
        sock.sendall(b"\1" + _mac(self.key, b"hvdmx-rdv server", theirs, mine))
        session = _mac(self.key, b"hvdmx-rdv session", mine, theirs)
        return _Channel(sock, session, b"S", b"C", self.max_post_bytes + _FRAME_OVERHEAD)

    def _serve(self, sock: socket.socket) -> None:
        peer = _peer_name(sock)
        member: Optional[_Member] = None
        proven = False
        clean = False
        try:
            sock.settimeout(HANDSHAKE_SECONDS)
            channel = self._handshake(sock)
            member = self._hello(channel, peer)
            proven = True
            with self._lock:
                self._strangers -= 1
            sock.settimeout(None)
            # Answers to a member that stops reading give up after SEND_SECONDS
            # (the kernel's send timeout: reads stay without one).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                            struct.pack("ll", int(SEND_SECONDS), 0))
            while True:
                body = channel.receive()
                if body[:1] == b"B":
                    _Reader(body[1:]).end()
                    clean = True
                    return
                self._post(member, body)
        except ProtocolError as error:
            self._refuse(member, peer, f"{error}")
        except PermissionError as error:
            self._problem(f"refused {peer}: {error}")
        except ConnectionAbortedError:
            pass  # a hello refused: _hello reported it
        except socket.timeout:
            if not proven:
                self._problem(f"refused {peer}: it did not prove itself within "
                              f"{HANDSHAKE_SECONDS:g} s")
            else:
                self._refuse(member, peer, "sending it an answer took too long")
        except (ConnectionError, OSError) as error:
            if not proven and not self._closed.is_set():
                self._problem(f"refused {peer}: {error} before it proved itself")
        finally:
            with self._lock:
                if not proven:
                    self._strangers -= 1
                self._sockets.discard(sock)
            if member is not None:  # first, so that the peer sees the close after it
                self._leave(member, clean)
            _drop(sock)

    def _refuse(self, member: Optional[_Member], peer: str, why: str) -> None:
        who = member.describe() if member is not None else peer
        self._problem(f"dropped {who}: {why}")
        if member is not None:
            try:
                member.channel.send(b"E" + _pack_str("") + struct.pack("!Q", 0) +
                                    _pack_str(f"the rendezvous server dropped this "
                                              f"connection: {why}"))
            except OSError:
                pass

    def _hello(self, channel: _Channel, peer: str) -> _Member:
        body = channel.receive()
        if body[:1] != b"H":
            raise ProtocolError(f"the first message is {body[:1]!r}, not a hello")
        r = _Reader(body[1:])
        rank, size, slot, pid = r.unpack("IIII")
        host = r.text(MAX_HOST_BYTES, "a host name")
        r.end()
        member = _Member(channel, peer, rank, host, slot, pid)
        if size != self.size or rank >= self.size:
            why = (f"it says it is rank {rank} of {size}, but this job has {self.size} ranks "
                   f"(0 to {self.size - 1}); HVDMX_RANK/HVDMX_SIZE do not belong to this job")
            self._refuse(member, peer, why)
            raise ConnectionAbortedError(why)
        with self._lock:
            other = self._members.get(rank)
            lost = self._lost.get(rank)
            if other is None and lost is None:
                self._members[rank] = member
                self._ever[rank] = member.describe()
                world_seq = self._next[self.world]
        if other is not None or lost is not None:
            why = (f"rank {rank} is already connected as {other.describe()}" if other else
                   f"rank {rank} was lost ({lost}) and a static job cannot take it back")
            self._refuse(member, peer, why)
            raise ConnectionAbortedError(why)
        channel.send(b"W" + struct.pack("!IIIQd", self.generation, rank, self.size,
                                        world_seq, self.timeout) + _pack_str(self.world))
        return member

    def _leave(self, member: _Member, clean: bool) -> None:
        """A member's connection ended: after a goodbye it may come back
        (hvd.shutdown() then hvd.init()), and collectives wait for it; a crash
        fails every operation that waits for it, now and later."""
        answers: List[Tuple[_Member, bytes]] = []
        with self._lock:
            if self._members.get(member.rank) is not member:
                return
            del self._members[member.rank]
            if clean or self._closed.is_set():
                return
            self._lost[member.rank] = f"{member.describe()} disconnected"
            for (scope, seq), op in list(self._pending.items()):
                group = self._groups[scope]
                if member.rank in group and group.index(member.rank) not in op.posts:
                    answers += self._fail(scope, seq, f"{member.describe()} disconnected "
                                          f"before it reached this {_kind_name(op.kind)}")
        self._send_all(answers)

    def _watch_deadlines(self) -> None:
        while not self._closed.wait(0.2):
            now = time.monotonic()
            answers: List[Tuple[_Member, bytes]] = []
            with self._lock:
                for (scope, seq), op in list(self._pending.items()):
                    if now < op.deadline:
                        continue
                    group = self._groups[scope]
                    missing = [rank for i, rank in enumerate(group) if i not in op.posts]
                    never = [rank for rank in missing if rank not in self._ever]
                    text = (f"ranks {_ranks(missing)} did not reach it within "
                            f"{self.timeout:g} s ({TIMEOUT_VARIABLE})")
                    if never:
                        text += f"; ranks {_ranks(never)} never connected"
                    answers += self._fail(scope, seq, text)
            self._send_all(answers)

    # ---- collectives (See Note [Collectives at the server])

    def _post(self, member: _Member, body: bytes) -> None:
        kind = body[:1]
        if kind not in (b"A", b"P"):
            raise ProtocolError(f"a message of unknown type {kind!r}")
        r = _Reader(body[1:])
        scope = r.text(MAX_SCOPE_BYTES, "a group scope")
        (seq,) = r.unpack("Q")
        if kind == b"A":
            data: object = r.blob(self.max_post_bytes, "an allgather's data")
        else:
            data = r.unpack("iq")
        r.end()
        answers: List[Tuple[_Member, bytes]] = []
        with self._lock:
            answers = self._post_locked(member, kind, scope, seq, data)
        self._send_all(answers)

    def _post_locked(self, member: _Member, kind: bytes, scope: str, seq: int,
                     data: object) -> List[Tuple[_Member, bytes]]:
        what = f"{_kind_name(kind)} #{seq} of group {scope}"
        group = self._groups.get(scope)
        if group is None or member.rank not in group:
            why = "no such group" if group is None else f"rank {member.rank} is not a member"
            return [(member, _error(scope, seq, f"{what}: {why}"))]
        if scope in self._failed:
            return [(member, _error(scope, seq, f"{what}: the group failed before: "
                                    f"{self._failed[scope]}"))]
        expected = self._next[scope]
        op = self._pending.get((scope, expected))
        if seq != expected:
            text = (f"rank {member.rank} posted collective #{seq} while the group is at "
                    f"#{expected}: the members did not call the same collectives in order")
            answers = [(member, _error(scope, seq, text))]
            return answers + (self._fail(scope, expected, text) if op else
                              self._fail_group(scope, text))
        if op is None:
            op = self._pending[(scope, seq)] = _Operation(kind, time.monotonic() + self.timeout)
        index = group.index(member.rank)
        if index in op.posts:
            return self._fail(scope, seq, f"rank {member.rank} posted it twice")
        op.posts[index] = data
        op.kinds[index] = kind
        if kind != op.kind:
            by_kind: Dict[bytes, List[int]] = {}
            for i, k in op.kinds.items():
                by_kind.setdefault(k, []).append(group[i])
            text = "; ".join(f"ranks {_ranks(sorted(v))} called {_kind_name(k)}"
                             for k, v in sorted(by_kind.items()))
            return self._fail(scope, seq, f"the members called different collectives: {text}")
        lost = [rank for i, rank in enumerate(group) if i not in op.posts and rank in self._lost]
        if lost:
            return self._fail(scope, seq, "; ".join(self._lost[rank] for rank in lost))
        if len(op.posts) < len(group):
            return []
        del self._pending[(scope, seq)]
        self._next[scope] = seq + 1
        members = [self._members.get(rank) for rank in group]
        if kind == b"A":
            head = b"R" + _pack_str(scope) + struct.pack("!QI", seq, len(group))
            body = head + b"".join(_pack_bytes(op.posts[i]) for i in range(len(group)))  # type: ignore[arg-type]
            return [(m, body) for m in members if m is not None]
        return self._split(scope, seq, group, op, members)

    def _split(self, scope: str, seq: int, group: List[int], op: _Operation,
               members: List[Optional[_Member]]) -> List[Tuple[_Member, bytes]]:
        colors: Dict[int, List[Tuple[int, int, int]]] = {}
        for i, rank in enumerate(group):
            post: Tuple[int, int] = op.posts[i]  # type: ignore[assignment]
            if post[0] >= 0:
                colors.setdefault(post[0], []).append((post[1], i, rank))
        placed: Dict[int, Tuple[str, int, int]] = {}
        for color, entries in colors.items():
            child = f"{scope}.{seq}.{color}"
            ranks = [rank for _, _, rank in sorted(entries)]
            self._groups[child] = ranks
            self._next[child] = 0
            for new_rank, rank in enumerate(ranks):
                placed[rank] = (child, new_rank, len(ranks))
        answers = []
        for rank, m in zip(group, members):
            if m is None:
                continue
            child, new_rank, new_size = placed.get(rank, ("", 0, 0))
            answers.append((m, b"S" + _pack_str(scope) + struct.pack("!Q", seq) +
                            _pack_str(child) + struct.pack("!II", new_rank, new_size)))
        return answers

    def _fail(self, scope: str, seq: int, why: str) -> List[Tuple[_Member, bytes]]:
        """Ends operation (scope, seq) with an error to every member that
        posted it, and the group with it."""
        op = self._pending.pop((scope, seq), None)
        kind = _kind_name(op.kind) if op else "collective"
        text = f"{kind} #{seq} of group {scope} failed: {why}"
        self._fail_group(scope, text)
        group = self._groups[scope]
        posted = [self._members.get(group[i]) for i in (op.posts if op else ())]
        return [(m, _error(scope, seq, text)) for m in posted if m is not None]

    def _fail_group(self, scope: str, text: str) -> List[Tuple[_Member, bytes]]:
        self._failed.setdefault(scope, text)
        return []

    def _send_all(self, answers: List[Tuple[_Member, bytes]]) -> None:
        for member, body in answers:
            try:
                member.channel.send(body)
            except OSError as error:
                self._problem(f"could not answer {member.describe()}: {error}")
                _drop(member.channel.sock)


def _kind_name(kind: bytes) -> str:
    return {b"A": "allgather", b"P": "split"}.get(kind, "collective")


def _ranks(ranks: List[int]) -> str:
    return ", ".join(map(str, ranks))


def _error(scope: str, seq: int, text: str) -> bytes:
    return b"E" + _pack_str(scope) + struct.pack("!Q", seq) + _pack_str(text)


def _drop(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


# ---- the client -----------------------------------------------------------------

class _Connection:
    """A process's one connection to the server, shared by all its groups.
    A reader thread hands each answer to the caller waiting for its (scope,
    seq), so that groups used from different threads do not block each other."""

    def __init__(self, address: str, channel: _Channel, timeout: float):
        self.address, self.channel, self.timeout = address, channel, timeout
        self.lock = threading.Lock()
        self.waiting: Dict[Tuple[str, int], list] = {}  # -> [event, answer]
        self.broken: Optional[str] = None
        self.closing = False
        self.reader = threading.Thread(target=self._read, name="hvdmx-rdv-client",
                                       daemon=True)

    def _read(self) -> None:
        why = "the connection closed"
        try:
            while True:
                body = self.channel.receive()
                kind = body[:1]
                r = _Reader(body[1:])
                scope = r.text(MAX_SCOPE_BYTES, "a group scope")
                (seq,) = r.unpack("Q")
                if kind == b"E" and scope == "":
                    why = r.text(1 << 20, "an error")
                    break
                with self.lock:
                    slot = self.waiting.pop((scope, seq), None)
                if slot is None:
                    why = f"an answer for {scope}#{seq}, which nobody asked"
                    break
                slot[1] = (kind, r)
                slot[0].set()
        except (OSError, ConnectionError, ProtocolError) as error:
            why = str(error) or type(error).__name__
        with self.lock:
            self.broken = why
            slots, self.waiting = list(self.waiting.values()), {}
        for slot in slots:
            slot[0].set()

    def request(self, scope: str, seq: int, body: bytes) -> Tuple[bytes, _Reader]:
        slot: list = [threading.Event(), None]
        with self.lock:
            if self.broken is not None:
                raise ConnectionError(f"the rendezvous server at {self.address} is gone: "
                                      f"{self.broken}")
            self.waiting[(scope, seq)] = slot
        self.channel.send(body)
        # The server ends an incomplete collective after its timeout; this
        # waits a little longer, for a server that is stuck itself.
        if not slot[0].wait(self.timeout + 30):
            with self.lock:
                self.waiting.pop((scope, seq), None)
            raise RendezvousError(f"the rendezvous server at {self.address} did not answer "
                                  f"collective #{seq} of group {scope} within "
                                  f"{self.timeout + 30:g} s")
        if slot[1] is None:
            raise ConnectionError(f"the rendezvous server at {self.address} is gone: "
                                  f"{self.broken}")
        kind, r = slot[1]
        if kind == b"E":
            raise RendezvousError(f"hvdmx rendezvous ({self.address}): "
                                  f"{r.text(1 << 20, 'an error')}")
        return kind, r

    def close(self) -> None:
        with self.lock:
            if self.closing:
                return
            self.closing = True
            broken = self.broken
        if broken is None:
            try:
                self.channel.send(b"B")
                # The server closes after a goodbye: waiting for that lets a
                # process that connects again at once find its rank free.
                self.reader.join(HANDSHAKE_SECONDS)
            except OSError:
                pass
        _drop(self.channel.sock)
        self.reader.join(1)


class StoreGroup:
    """A group of the job's processes, served by the rendezvous: `rank` in
    it, `size` of it. Each collective is called by every member, in the same
    order; groups are independent of each other (their own order) and may be
    used from different threads. Errors: RendezvousError (a member missing
    after the timeout, crashed, or calling another collective) and
    ConnectionError (the server is gone)."""

    def __init__(self, connection: _Connection, scope: str, rank: int, size: int,
                 seq: int = 0, owner: bool = False):
        self._connection, self._scope = connection, scope
        self.rank, self.size = rank, size
        self._seq = seq
        self._seq_lock = threading.Lock()
        self._owner = owner

    @property
    def scope(self) -> str:
        """The server's name of this group (the job's generation first)."""
        return self._scope

    def _next(self) -> int:
        with self._seq_lock:
            seq, self._seq = self._seq, self._seq + 1
        return seq

    def allgather(self, data: bytes) -> List[bytes]:
        """Every member's `data`, in rank order."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"StoreGroup.allgather: data must be bytes, got "
                            f"{type(data).__name__}")
        data = bytes(data)
        if len(data) > MAX_POST_BYTES:
            raise ValueError(f"StoreGroup.allgather: {len(data)} bytes is over the limit of "
                             f"{MAX_POST_BYTES} a member posts")
        seq = self._next()
        kind, r = self._connection.request(
            self._scope, seq,
            b"A" + _pack_str(self._scope) + struct.pack("!Q", seq) + _pack_bytes(data))
        if kind != b"R":
            raise RendezvousError(f"the rendezvous server answered an allgather with {kind!r}")
        (count,) = r.unpack("I")
        if count != self.size:
            raise RendezvousError(f"allgather of group {self._scope}: {count} answers for "
                                  f"{self.size} members")
        out = [r.blob(1 << 31, "a member's data") for _ in range(count)]
        r.end()
        return out

    def split(self, color: int, key: int) -> Optional["StoreGroup"]:
        """MPI_Comm_split: the members with the same `color` >= 0 form a new
        group, ranked by (`key`, rank here); None for a color < 0."""
        _check_int("color", color, 31)
        _check_int("key", key, 63)
        seq = self._next()
        kind, r = self._connection.request(
            self._scope, seq,
            b"P" + _pack_str(self._scope) + struct.pack("!Qiq", seq, color, key))
        if kind != b"S":
            raise RendezvousError(f"the rendezvous server answered a split with {kind!r}")
        child = r.text(MAX_SCOPE_BYTES, "a group scope")
        rank, size = r.unpack("II")
        r.end()
        if not child:
            return None
        return StoreGroup(self._connection, child, rank, size)

    def close(self) -> None:
        """Closes the connection if this is the job's group (its splits share
        it); a no-op for a split's group. Idempotent."""
        if self._owner:
            self._connection.close()

    def __enter__(self) -> "StoreGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StoreGroup(scope={self._scope!r}, rank={self.rank}, size={self.size})"


def _check_int(name: str, value: object, bits: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or \
            not -(1 << bits) <= value < (1 << bits):
        raise TypeError(f"StoreGroup.split: {name}={value!r} must be an int of {bits + 1} bits")


def connect(address: str, key: bytes, rank: int, size: int, host: Optional[str] = None,
            slot: int = 0, connect_timeout: float = 30.0) -> StoreGroup:
    """The job's group, as rank `rank` of `size`, through the server at
    `address` ('host:port'). Retries a refused connection until
    `connect_timeout` (the server may still be starting)."""
    target = parse_address(address)
    if len(key) != KEY_BYTES:
        raise ValueError(f"the secret key must be {KEY_BYTES} bytes")
    deadline = time.monotonic() + connect_timeout
    while True:
        try:
            sock = socket.create_connection(target, timeout=HANDSHAKE_SECONDS)
            break
        except OSError as error:
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach the rendezvous server at {address} "
                                      f"({ADDRESS_VARIABLE}): {error}; is the launcher "
                                      "(hvdmxrun --no-mpi) still running, and is that "
                                      "address reachable from this host?") from None
            time.sleep(0.2)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = _receive_exactly(sock, len(MAGIC) + _NONCE)
        if hello[:len(MAGIC)] != MAGIC:
            raise PermissionError(f"{address} is not an hvdmx rendezvous server")
        theirs, mine = hello[len(MAGIC):], secrets.token_bytes(_NONCE)
        sock.sendall(mine + _mac(key, b"hvdmx-rdv client", theirs, mine))
        status = _receive_exactly(sock, 1)
        if status != b"\1":
            raise PermissionError(f"the rendezvous server at {address} refused this process: "
                                  "its HVDMX_SECRET_KEY is not the job's")
        if not hmac.compare_digest(_receive_exactly(sock, _MAC),
                                   _mac(key, b"hvdmx-rdv server", mine, theirs)):
            raise PermissionError(f"the server at {address} does not hold the job's secret "
                                  "key: it is not this job's rendezvous")
        session = _mac(key, b"hvdmx-rdv session", theirs, mine)
        channel = _Channel(sock, session, b"C", b"S", 1 << 31)
        host = socket.gethostname() if host is None else host
        channel.send(b"H" + struct.pack("!IIII", rank, size, slot, os.getpid() & 0xFFFFFFFF) +
                     _pack_str(host[:MAX_HOST_BYTES]))
        body = channel.receive()
        r = _Reader(body[1:])
        if body[:1] == b"E":
            r.text(MAX_SCOPE_BYTES, "scope")
            r.unpack("Q")
            raise ConnectionRefusedError(f"hvdmx rendezvous ({address}): "
                                         f"{r.text(1 << 20, 'an error')}")
        if body[:1] != b"W":
            raise ProtocolError(f"the server's first message is {body[:1]!r}")
        _, got_rank, got_size, world_seq, timeout = r.unpack("IIIQd")
        world = r.text(MAX_SCOPE_BYTES, "a group scope")
        r.end()
        sock.settimeout(None)
    except socket.timeout:
        _drop(sock)
        raise ConnectionError(f"the rendezvous server at {address} did not answer within "
                              f"{HANDSHAKE_SECONDS:g} s") from None
    except ConnectionError as error:
        _drop(sock)
        if isinstance(error, ConnectionRefusedError):
            raise
        raise ConnectionError(f"the rendezvous server at {address} closed the connection "
                              f"during the handshake ({error})") from None
    except BaseException:
        _drop(sock)
        raise
    connection = _Connection(address, channel, timeout)
    connection.reader.start()
    return StoreGroup(connection, world, got_rank, got_size, world_seq, owner=True)


def group_from_environment(environ: Optional[Mapping[str, str]] = None
                           ) -> Optional[StoreGroup]:
    """The job's group when this process was started by hvdmxrun --no-mpi
    (HVDMX_RENDEZVOUS set), else None. Reads HVDMX_RENDEZVOUS,
    HVDMX_SECRET_KEY, HVDMX_RANK, HVDMX_SIZE and HVDMX_LOCAL_RANK; a bad value
    raises ValueError naming the variable, an unreachable server
    ConnectionError naming the address."""
    env = os.environ if environ is None else environ
    address = env.get(ADDRESS_VARIABLE)
    if not address:
        return None
    parse_address(address)
    key = key_from_environment(env)
    size = _integer(env, "HVDMX_SIZE", 1)
    rank = _integer(env, "HVDMX_RANK", 0, size - 1)
    slot = _integer(env, "HVDMX_LOCAL_RANK", 0) if "HVDMX_LOCAL_RANK" in env else 0
    return connect(address, key, rank, size, slot=slot)
