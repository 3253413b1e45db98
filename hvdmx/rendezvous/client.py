"""The rendezvous of a job started without MPI (``hvdmxrun --no-mpi``): a
small authenticated TCP service that the launcher runs on a thread
(RendezvousServer), and its client, a group of processes (StoreGroup) with
the two collectives ``hvd.init()`` needs to bootstrap over it: ``allgather``
of bytes and ``split`` (MPI_Comm_split). Pure Python, standard library only:
the ranks load it before MXNet or MPI.

    group = group_from_environment()   # None unless HVDMX_RENDEZVOUS is set
    everyone = group.allgather(b"my address")   # every member's bytes, rank order
    sub = group.split(color, key)               # None where color < 0

The server is hvdmx/rendezvous/server.py, the bytes on the wire
hvdmx/rendezvous/wire.py (See Note [The rendezvous protocol] there).
"""
from __future__ import annotations

import os
import socket
import struct
import threading
import time
from typing import Dict, List, Mapping, Optional, Tuple

from hvdmx.rendezvous.wire import ADDRESS_VARIABLE, Channel, DEFAULT_TIMEOUT, HANDSHAKE_SECONDS, \
    KEY_BYTES, MAX_HOST_BYTES, MAX_POST_BYTES, MAX_SCOPE_BYTES, ProtocolError, Reader, \
    RendezvousError, TIMEOUT_VARIABLE, drop, integer_variable, key_from_environment, \
    open_channel, pack_bytes, pack_str, parse_address, parse_key

__all__ = ["ADDRESS_VARIABLE", "DEFAULT_TIMEOUT", "TIMEOUT_VARIABLE", "RendezvousError",
           "StoreGroup", "connect", "group_from_environment",
           "parse_address", "parse_key"]

# ---- the client -----------------------------------------------------------------

class _Connection:
    """A process's one connection to the server, shared by all its groups.
    A reader thread hands each answer to the caller waiting for its (scope,
    seq), so that groups used from different threads do not block each other."""

    def __init__(self, address: str, channel: Channel, timeout: float):
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
                r = Reader(body[1:])
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

    def request(self, scope: str, seq: int, body: bytes) -> Tuple[bytes, Reader]:
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
        drop(self.channel.sock)
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

    def call(self, kind: bytes, extra: bytes = b"") -> Tuple[bytes, Reader]:
        """One request to the server in this group's scope and order: `kind`,
        the scope and the request's number, then `extra`; returns the answer's
        kind and a Reader of the rest of it (after its scope and number)."""
        with self._seq_lock:
            seq, self._seq = self._seq, self._seq + 1
        return self._connection.request(
            self._scope, seq, kind + pack_str(self._scope) + struct.pack("!Q", seq) + extra)

    def allgather(self, data: bytes) -> List[bytes]:
        """Every member's `data`, in rank order."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"StoreGroup.allgather: data must be bytes, got "
                            f"{type(data).__name__}")
        data = bytes(data)
        if len(data) > MAX_POST_BYTES:
            raise ValueError(f"StoreGroup.allgather: {len(data)} bytes is over the limit of "
                             f"{MAX_POST_BYTES} a member posts")
        kind, r = self.call(b"A", pack_bytes(data))
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
        kind, r = self.call(b"P", struct.pack("!iq", color, key))
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
            slot: int = 0, connect_timeout: float = 30.0,
            unreachable: Optional[str] = None) -> StoreGroup:
    """The job's group, as rank `rank` of `size`, through the server at
    `address` ('host:port'). Retries a refused connection until
    `connect_timeout` (the server may still be starting); `unreachable` is
    the error's text then (default: it names HVDMX_RENDEZVOUS and hvdmxrun)."""
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
                if unreachable is not None:
                    raise ConnectionError(f"{unreachable}: {error}") from None
                raise ConnectionError(f"cannot reach the rendezvous server at {address} "
                                      f"({ADDRESS_VARIABLE}): {error}; is the launcher "
                                      "(hvdmxrun --no-mpi) still running, and is that "
                                      "address reachable from this host?") from None
            time.sleep(0.2)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        channel = open_channel(sock, key, 1 << 31, address)
        host = socket.gethostname() if host is None else host
        channel.send(b"H" + struct.pack("!IIII", rank, size, slot, os.getpid() & 0xFFFFFFFF) +
                     pack_str(host[:MAX_HOST_BYTES]))
        body = channel.receive()
        r = Reader(body[1:])
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
        drop(sock)
        raise ConnectionError(f"the rendezvous server at {address} did not answer within "
                              f"{HANDSHAKE_SECONDS:g} s") from None
    except ConnectionError as error:
        drop(sock)
        if isinstance(error, ConnectionRefusedError):
            raise
        raise ConnectionError(f"the rendezvous server at {address} closed the connection "
                              f"during the handshake ({error})") from None
    except BaseException:
        drop(sock)
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
    size = integer_variable(env, "HVDMX_SIZE", 1)
    rank = integer_variable(env, "HVDMX_RANK", 0, size - 1)
    slot = integer_variable(env, "HVDMX_LOCAL_RANK", 0) if "HVDMX_LOCAL_RANK" in env else 0
    return connect(address, key, rank, size, slot=slot)
