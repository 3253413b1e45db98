"""The rendezvous server: runs in hvdmxrun --no-mpi (a thread of the
launcher) and serves the collectives of the job's groups
(hvdmx/rendezvous/client.py has the overview, hvdmx/rendezvous/wire.py the bytes).

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

import hmac
import math
import os
import secrets
import socket
import struct
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from hvdmx.rendezvous.wire import FRAME_OVERHEAD, HANDSHAKE_SECONDS, KEY_BYTES, MAC_BYTES, MAGIC, \
    MAX_HOST_BYTES, MAX_POST_BYTES, MAX_RESULT_BYTES, MAX_SCOPE_BYTES, MAX_STRANGERS, NONCE, \
    SEND_SECONDS, TIMEOUT_VARIABLE, Channel, ProtocolError, Reader, drop, mac, pack_bytes, \
    pack_str, parse_timeout, peer_name, receive_exactly

# ---- the server ----------------------------------------------------------------

class _Member:
    """A rank's connection at the server."""

    def __init__(self, channel: Channel, peer: str, rank: int, host: str, slot: int, pid: int):
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
    every collective (default $HVDMX_RENDEZVOUS_TIMEOUT, else 300 s),
    `handshake_seconds` how long a new connection has to prove itself;
    `max_post_bytes` bounds a member's bytes in one allgather and
    `max_result_bytes` all of them together. What it
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
                 max_post_bytes: int = MAX_POST_BYTES,
                 max_result_bytes: int = MAX_RESULT_BYTES,
                 handshake_seconds: float = HANDSHAKE_SECONDS):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"RendezvousServer: size={size!r} must be an int >= 1")
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise ValueError(f"RendezvousServer: key must be {KEY_BYTES} bytes")
        self.size, self.key = size, key
        self.timeout = parse_timeout(os.environ.get(TIMEOUT_VARIABLE)) if timeout is None \
            else float(timeout)
        if not 0 < self.timeout < math.inf:
            raise ValueError(f"RendezvousServer: timeout={timeout!r} must be seconds > 0")
        self.max_post_bytes, self.max_result_bytes = max_post_bytes, max_result_bytes
        self.handshake_seconds = handshake_seconds
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
            drop(sock)
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
                peer = peer_name(sock)
                drop(sock)
                self._problem(f"refused {peer}: {MAX_STRANGERS} connections are already "
                              "proving themselves")
                continue
            threading.Thread(target=self._serve, args=(sock,), name="hvdmx-rdv-conn",
                             daemon=True).start()

    def _handshake(self, sock: socket.socket) -> Channel:
        mine = secrets.token_bytes(NONCE)
        sock.sendall(MAGIC + mine)
        answer = receive_exactly(sock, NONCE + MAC_BYTES)
        theirs, proof = answer[:NONCE], answer[NONCE:]
        if not hmac.compare_digest(proof, mac(self.key, b"hvdmx-rdv client", mine, theirs)):
            try:
                sock.sendall(b"\0")
            except OSError:
                pass
            raise PermissionError("it does not hold the job's secret key")
        sock.sendall(b"\1" + mac(self.key, b"hvdmx-rdv server", theirs, mine))
        session = mac(self.key, b"hvdmx-rdv session", mine, theirs)
        return Channel(sock, session, b"S", b"C", self.max_post_bytes + FRAME_OVERHEAD)

    def _serve(self, sock: socket.socket) -> None:
        peer = peer_name(sock)
        member: Optional[_Member] = None
        proven = False
        clean = False
        try:
            sock.settimeout(self.handshake_seconds)
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
                    Reader(body[1:]).end()
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
                              f"{self.handshake_seconds:g} s")
            else:
                self._refuse(member, peer, "sending it an answer took too long")
        except (ConnectionError, OSError) as error:
            if not proven and not self._closed.is_set():
                self._problem(f"refused {peer}: {error} before it proved itself")
        except Exception as error:  # our bug: this connection ends, the server goes on
            self._problem(f"dropped {member.describe() if member else peer} after an internal "
                          f"error: {type(error).__name__}: {error}")
        finally:
            with self._lock:
                if not proven:
                    self._strangers -= 1
                self._sockets.discard(sock)
            if member is not None:  # first, so that the peer sees the close after it
                self._leave(member, clean)
            drop(sock)

    def _refuse(self, member: Optional[_Member], peer: str, why: str) -> None:
        who = member.describe() if member is not None else peer
        self._problem(f"dropped {who}: {why}")
        if member is not None:
            try:
                member.channel.send(b"E" + pack_str("") + struct.pack("!Q", 0) +
                                    pack_str(f"the rendezvous server dropped this "
                                              f"connection: {why}"))
            except OSError:
                pass

    @staticmethod
    def _read_hello(channel: Channel, peer: str) -> Tuple[_Member, int]:
        """The connection's first message, a hello: (its member, as it says
        it is, and the job's size it says)."""
        body = channel.receive()
        if body[:1] != b"H":
            raise ProtocolError(f"the first message is {body[:1]!r}, not a hello")
        r = Reader(body[1:])
        rank, size, slot, pid = r.unpack("IIII")
        host = r.text(MAX_HOST_BYTES, "a host name")
        r.end()
        return _Member(channel, peer, rank, host, slot, pid), size

    def _hello(self, channel: Channel, peer: str) -> _Member:
        member, size = self._read_hello(channel, peer)
        rank = member.rank
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
                                        world_seq, self.timeout) + pack_str(self.world))
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
        r = Reader(body[1:])
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
        total = sum(len(p) for p in op.posts.values()) if kind == b"A" else 0  # type: ignore
        if total + 4 * len(group) > self.max_result_bytes:
            return self._fail(scope, seq, f"its result would be {total} bytes, over the limit "
                              f"of {self.max_result_bytes}; gather less at a time")
        del self._pending[(scope, seq)]
        self._next[scope] = seq + 1
        members = [self._members.get(rank) for rank in group]
        if kind == b"A":
            head = b"R" + pack_str(scope) + struct.pack("!QI", seq, len(group))
            body = head + b"".join(pack_bytes(op.posts[i])  # type: ignore[arg-type]
                                   for i in range(len(group)))
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
            answers.append((m, b"S" + pack_str(scope) + struct.pack("!Q", seq) +
                            pack_str(child) + struct.pack("!II", new_rank, new_size)))
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
                drop(member.channel.sock)


def _kind_name(kind: bytes) -> str:
    return {b"A": "allgather", b"P": "split"}.get(kind, "collective")


def _ranks(ranks: List[int]) -> str:
    return ", ".join(map(str, ranks))


def _error(scope: str, seq: int, text: str) -> bytes:
    return b"E" + pack_str(scope) + struct.pack("!Q", seq) + pack_str(text)
