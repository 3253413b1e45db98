"""The rendezvous's bytes on the wire (hvdmx/rendezvous/client.py has the
overview): the names of its variables, their parsing, and one
authenticated connection's frames.

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
"""
from __future__ import annotations

import hashlib
import hmac
import math
import socket
import struct
import threading
from typing import Mapping, Optional, Tuple

ADDRESS_VARIABLE = "HVDMX_RENDEZVOUS"
TIMEOUT_VARIABLE = "HVDMX_RENDEZVOUS_TIMEOUT"
KEY_VARIABLES = ("HVDMX_SECRET_KEY", "HOROVOD_SECRET_KEY")
DEFAULT_TIMEOUT = 300.0  # seconds; the TCP transport gives up after as long
HANDSHAKE_SECONDS = 10.0
SEND_SECONDS = 60.0  # a member that does not read its answers for this long is dropped
MAX_POST_BYTES = 16 << 20  # one member's bytes in one allgather
MAX_RESULT_BYTES = 1 << 30  # all members' bytes in one allgather (a frame's length is a u32)
MAX_SCOPE_BYTES = 512
MAX_HOST_BYTES = 255
MAX_STRANGERS = 256  # connections at once that have not proved themselves yet
MAGIC = b"hvdmx-rdv-v1\0\0\0\0"
KEY_BYTES = 32
NONCE = 32
MAC_BYTES = 32
HEADER = struct.Struct("!I")
FRAME_OVERHEAD = 64 + MAX_SCOPE_BYTES + MAX_HOST_BYTES


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


def integer_variable(environ: Mapping[str, str], name: str, low: int,
                     high: Optional[int] = None) -> int:
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

def mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def pack_bytes(data: bytes) -> bytes:
    return HEADER.pack(len(data)) + data


def pack_str(text: str) -> bytes:
    return pack_bytes(text.encode("utf-8"))


class Reader:
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


def receive_exactly(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(min(count - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed" + (
                f" in the middle of a message ({len(data)} of {count} bytes)" if data else ""))
        data += chunk
    return bytes(data)


class Channel:
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
            header = HEADER.pack(len(body))
            tag = mac(self.session, self.mine, struct.pack("!Q", self.sent), header, body)
            self.sent += 1
            self.sock.sendall(header + body + tag)

    def receive(self) -> bytes:
        header = receive_exactly(self.sock, HEADER.size)
        (length,) = HEADER.unpack(header)
        if length > self.limit:
            raise ProtocolError(f"a frame of {length} bytes announced, over the limit of "
                                f"{self.limit}")
        body = receive_exactly(self.sock, length)
        tag = receive_exactly(self.sock, MAC_BYTES)
        want = mac(self.session, self.theirs, struct.pack("!Q", self.received), header, body)
        if not hmac.compare_digest(tag, want):
            raise ProtocolError("a frame whose MAC does not match (altered, replayed from "
                                "another connection, or out of order)")
        self.received += 1
        return body


def peer_name(sock: socket.socket) -> str:
    try:
        peer = sock.getpeername()
    except OSError:
        return "an unknown peer"
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"[{peer[0]}]:{peer[1]}" if ":" in str(peer[0]) else f"{peer[0]}:{peer[1]}"
    return str(peer)


def drop(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
