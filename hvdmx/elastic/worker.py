"""An elastic worker's side of the elastic rendezvous (Note [The elastic
rendezvous] in hvdmx/runner/elastic/service.py): its one connection to the service, the
join that gives it a place in the next generation, and the two questions
hvd.elastic asks between resets. Pure Python, below basics.
"""
from __future__ import annotations

import os
import struct
import threading
from typing import Mapping, Optional, Tuple

from hvdmx.rendezvous.elastic_wire import SLOT_VARIABLE, generation_answer
from hvdmx.rendezvous.client import StoreGroup, connect
from hvdmx.rendezvous.wire import ADDRESS_VARIABLE, Reader, key_from_environment, parse_address

_lock = threading.Lock()
_service: Optional[StoreGroup] = None  # the connection to the service, for this process's life
generation = 0  # the generation this worker last joined; 0 before the first join


def elastic(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether hvdmxrun started this process as an elastic worker."""
    return SLOT_VARIABLE in environ


def slot(environ: Mapping[str, str] = os.environ) -> Tuple[str, int]:
    """(host, index) of this worker, from HVDMX_ELASTIC_SLOT ("host:index")."""
    text = environ.get(SLOT_VARIABLE, "")
    host, sep, index = text.rpartition(":")
    if not sep or not host or not index.isdigit():
        raise ValueError(f"{SLOT_VARIABLE}={text!r} must be 'host:index' (hvdmxrun sets it)")
    return host, int(index)


def _request(kind: bytes, extra: bytes = b"") -> Reader:
    """One request to the service; the Reader of its answer."""
    global _service
    with _lock:
        if _service is None:
            host, index = slot()
            _service = connect(os.environ[ADDRESS_VARIABLE], key_from_environment(os.environ),
                               0, 0, host=host, slot=index)
        service = _service
    answer_kind, reader = service.call(kind, extra)
    if answer_kind != kind:
        raise ConnectionError(f"the elastic rendezvous answered {kind!r} with {answer_kind!r}")
    return reader


def join() -> StoreGroup:
    """Blocks until this worker has a place in the job's next generation;
    returns that generation's group (at its own rendezvous server)."""
    global generation
    joined, rank, size, port = generation_answer(_request(b"J"))
    host, _ = parse_address(os.environ[ADDRESS_VARIABLE])
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    _, index = slot()
    group = connect(where, key_from_environment(os.environ), rank, size, slot=index)
    generation = joined
    return group


def newcomers() -> bool:
    """Whether workers wait to join the job (hosts were added)."""
    reader = _request(b"U")
    (flag,) = reader.unpack("B")
    reader.end()
    return bool(flag)


def report_resumed() -> None:
    """Rank 0: the job's state is restored in the current generation (the
    launcher logs the time the change took)."""
    _request(b"Z", struct.pack("!I", generation))


__all__ = ["elastic", "generation", "join", "newcomers", "report_resumed", "slot"]
