"""The elastic rendezvous (hvdmx/runner/elastic/service.py, Note [The elastic
rendezvous]) with threads as workers: a join gives a place in a generation
and that generation's own rendezvous; what a stranger or a malformed
request gets."""
import secrets
import struct
import threading

import pytest

from hvdmx.elastic import worker as elastic_worker
from hvdmx.runner.elastic.membership import Membership
from hvdmx.rendezvous.elastic_wire import SCOPE, generation_answer
from hvdmx.runner.elastic.service import ElasticService
from hvdmx.rendezvous.client import RendezvousError, connect

pytestmark = pytest.mark.timeout(60)
KEY = secrets.token_bytes(32)


@pytest.fixture
def service():
    membership = Membership(min_np=1, elastic_timeout=60, join_window=5)
    problems = []
    with ElasticService(KEY, membership, host="127.0.0.1", timeout=20,
                        on_problem=problems.append) as svc:
        svc.problems_seen = problems
        yield svc


def request(client, kind, extra=b""):
    assert client.scope == SCOPE
    return client.call(kind, extra)


def join_thread(svc, slot, out):
    def run():
        client = connect(svc.address(), KEY, 0, 0, host=slot[0], slot=slot[1])
        kind, reader = request(client, b"J")
        generation, rank, size, port = generation_answer(reader)
        group = connect(f"127.0.0.1:{port}", KEY, rank, size, slot=slot[1])
        out[slot] = (generation, rank, size, group.allgather(f"{slot[0]}".encode()))
        group.close()
        client.close()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_workers_join_a_generation_and_meet_at_its_own_rendezvous(service):
    slots = [("b", 0), ("a", 0), ("a", 1)]
    for slot in slots:
        service.membership.add(slot)
    out = {}
    threads = [join_thread(service, slot, out) for slot in slots]
    for thread in threads:
        thread.join(30)
    assert sorted(out) == sorted(slots)
    ranks = {slot: got[1] for slot, got in out.items()}
    assert sorted(ranks.values()) == [0, 1, 2]
    assert all(got[0] == 1 and got[2] == 3 for got in out.values())
    by_rank = sorted(slots, key=lambda s: ranks[s])
    assert all(got[3] == [s[0].encode() for s in by_rank] for got in out.values())


def test_a_slot_the_launcher_did_not_start_is_refused(service):
    with pytest.raises(ConnectionRefusedError, match="no worker of this job runs for slot "
                                                     "ghost:3"):
        connect(service.address(), KEY, 0, 0, host="ghost", slot=3)


def test_a_static_rank_is_refused_at_the_elastic_rendezvous(service):
    service.membership.add(("a", 0))
    with pytest.raises(ConnectionRefusedError, match="this job is elastic"):
        connect(service.address(), KEY, 1, 4, host="a", slot=0)


def test_an_unknown_request_drops_the_connection_naming_the_peer(service):
    service.membership.add(("a", 0))
    client = connect(service.address(), KEY, 0, 0, host="a", slot=0)
    with pytest.raises((ConnectionError, RendezvousError)):
        request(client, b"X")
    assert any("unknown type" in p and "127.0.0.1" in p for p in service.problems_seen), \
        service.problems_seen


def test_newcomers_and_resumed_through_the_service(service):
    service.membership.add(("a", 0))
    out = {}
    join_thread(service, ("a", 0), out).join(30)
    client = connect(service.address(), KEY, 0, 0, host="a", slot=0)
    kind, reader = request(client, b"U")
    assert kind == b"U" and reader.unpack("B") == (0,)
    service.membership.add(("b", 0))
    def newcomer():
        try:
            request(connect(service.address(), KEY, 0, 0, host="b", slot=0), b"J")
        except (ConnectionError, RendezvousError):
            pass  # the service closes at the test's end, with b still waiting
    waiting = threading.Thread(target=newcomer, daemon=True)
    waiting.start()
    for _ in range(200):
        kind, reader = request(client, b"U")
        if reader.unpack("B") == (1,):
            break
        threading.Event().wait(0.02)
    else:
        pytest.fail("the waiting newcomer was never reported")
    request(client, b"Z", struct.pack("!I", 1))
    assert service.membership.resumed == [(1, 1)]


def test_the_worker_reads_its_slot_and_names_a_bad_one():
    assert elastic_worker.slot({"HVDMX_ELASTIC_SLOT": "h-1.x:3"}) == ("h-1.x", 3)
    for bad in ("", "h1", "h1:", ":2", "h1:x"):
        with pytest.raises(ValueError, match="HVDMX_ELASTIC_SLOT=.* must be 'host:index'"):
            elastic_worker.slot({"HVDMX_ELASTIC_SLOT": bad})
