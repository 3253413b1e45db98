"""The rendezvous of an elastic job (docs/elastic.md): where a worker
learns, at every reset, its place in the job's next generation.

Note [The elastic rendezvous]
An elastic worker does not know its rank: it knows its slot, the host and
index hvdmxrun started it for (HVDMX_ELASTIC_SLOT). It connects to this
service (the same handshake, key and frames as the static rendezvous,
Note [The rendezvous protocol] in hvdmx/rendezvous/wire.py, saying size 0 and its
slot in the hello) and keeps that connection for its life. Its requests:

    b"J" str scope, u64 seq                  join the next generation
    b"U" str scope, u64 seq                  are there workers waiting to join?
    b"Z" str scope, u64 seq, u32 generation  rank 0: the job's state is restored
and the answers (same scope and seq; b"E" an error, as there):
    b"J" ... u32 generation, u32 rank, u32 size, u16 port
    b"U" ... u8 0/1
    b"Z" ...

A join blocks until membership.Membership forms a generation with
the worker in it. Each generation gets a static RendezvousServer of its own
(on another port of the same address), over which the worker's hvd.init()
then runs as rank `rank` of `size`: everything the static job does, a
generation does too, and a generation's failure cannot touch the next.
"""
from __future__ import annotations

import struct
import threading
from typing import Callable, Dict, List, Optional

from hvdmx.runner.elastic.hosts import Slot
from hvdmx.runner.elastic.membership import Membership, MembershipError
from hvdmx.rendezvous.server import RendezvousServer, _Member
from hvdmx.rendezvous.elastic_wire import SCOPE
from hvdmx.rendezvous.wire import MAX_SCOPE_BYTES, Channel, ProtocolError, Reader, pack_str



class ElasticService(RendezvousServer):
    """The elastic rendezvous of one job, holding `key`; `membership` decides
    the generations. Listens on (`host`, `port`); each generation's server
    listens on the same host."""

    def __init__(self, key: bytes, membership: Membership, host: str = "", port: int = 0,
                 timeout: Optional[float] = None,
                 on_problem: Optional[Callable[[str], None]] = None):
        super().__init__(1, key, host=host, port=port, timeout=timeout, on_problem=on_problem)
        self.membership = membership
        self._listen_host = host
        self._generations: Dict[int, RendezvousServer] = {}
        self._generations_lock = threading.Lock()

    def close(self) -> None:
        super().close()
        with self._generations_lock:
            servers, self._generations = list(self._generations.values()), {}
        for server in servers:
            server.close()

    def generation_server(self, generation: int, size: int) -> RendezvousServer:
        """The static rendezvous of `generation` (made by its first joiner);
        the servers of earlier generations are closed: their members have
        left them."""
        with self._generations_lock:
            server = self._generations.get(generation)
            if server is None:
                server = RendezvousServer(size, self.key, host=self._listen_host,
                                          timeout=self.timeout, on_problem=self._problem)
                self._generations[generation] = server
                old = [g for g in self._generations if g < generation]
                closing = [self._generations.pop(g) for g in old]
            else:
                closing = []
        for done in closing:
            done.close()
        return server

    # ---- the connection of one worker

    def _hello(self, channel: Channel, peer: str) -> _Member:
        member, size = self._read_hello(channel, peer)
        member.rank = -1  # until a join gives it one
        host, index = member.host, member.slot
        slot: Slot = (host, index)
        if size != 0:
            why = ("it says it is a rank of a static job, but this job is elastic: its workers "
                   "learn their rank here (HVDMX_ELASTIC_SLOT)")
            self._refuse(member, peer, why)
            raise ConnectionAbortedError(why)
        if not self.membership.started(slot):
            why = (f"no worker of this job runs for slot {host}:{index} (its host failed, or "
                   "it was not started by this hvdmxrun)")
            self._refuse(member, peer, why)
            raise ConnectionAbortedError(why)
        channel.send(b"W" + struct.pack("!IIIQd", 0, 0, 0, 0, self.timeout) + pack_str(SCOPE))
        return member

    def _post(self, member: _Member, body: bytes) -> None:
        kind = body[:1]
        r = Reader(body[1:])
        scope = r.text(MAX_SCOPE_BYTES, "a group scope")
        (seq,) = r.unpack("Q")
        head = kind + pack_str(scope) + struct.pack("!Q", seq)
        slot: Slot = (member.host, member.slot)
        if kind == b"J":
            r.end()
            try:
                generation, place = self.membership.join(slot, self.timeout)
            except MembershipError as error:
                self._send_all([(member, _error(scope, seq, str(error)))])
                return
            server = self.generation_server(generation, place.size)
            answer = head + struct.pack("!IIIH", generation, place.rank, place.size, server.port)
        elif kind == b"U":
            r.end()
            answer = head + struct.pack("!B", int(self.membership.newcomers()))
        elif kind == b"Z":
            (generation,) = r.unpack("I")
            r.end()
            self.membership.report_resumed(generation)
            answer = head
        else:
            raise ProtocolError(f"a message of unknown type {kind!r}")
        self._send_all([(member, answer)])

    def _leave(self, member: _Member, clean: bool) -> None:
        pass  # a worker's end is the launcher's to see (its process exits)


def _error(scope: str, seq: int, text: str) -> bytes:
    return b"E" + pack_str(scope) + struct.pack("!Q", seq) + pack_str(text)


__all__: List[str] = ["ElasticService"]
