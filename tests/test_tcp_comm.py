"""TcpComm (csrc/hvdmx/comm/tcp_comm.h) in one process: threads as ranks over real
sockets on this host, 1 to 7 ranks, every collective of the Comm interface from every
root, the bit-and both ways (rank to rank, and by recursive doubling beyond
direct_bit_and_ranks), the exchange and ring allreduces over it (checked as
tests/comm_checks.py says, as for LocalComm); a comm that only negotiates links only
with its negotiation peers; and a peer that goes away."""
import pytest

import _hvdmx_testing
from comm_checks import check_collectives

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("direct", [16, 1])
def test_every_collective_from_every_root(n, direct):
    count = 37
    results = _hvdmx_testing.tcp_collectives(n, direct_bit_and_ranks=direct, count=count,
                                             segment_bytes=12)
    check_collectives(results, n, count, direct)
    # Connections are made at init, one per pair.
    assert [got["connections"] for got in results] == [n - 1] * n


def test_a_wait_calls_its_idle_function_with_the_calls_before_it():
    # Comm::set_idle's contract: idle(i) gets the number of calls before it in this
    # wait, so i == 0 starts a wait. The runtime's stall shutdown measures a wait from
    # that call: a gather whose first poll moved bytes used to skip 0, and the runtime
    # then measured from an earlier wait (or, in a new runtime, from the clock's
    # epoch) and gave up at once with the stall error (seen in
    # tests/test_peer_input_tcp.py, whose jobs start a runtime per case).
    calls = _hvdmx_testing.tcp_gather_idle_calls(delay=0.2)
    assert calls, "rank 0 never waited for rank 2"
    assert calls == list(range(len(calls))), calls[:10]


@pytest.mark.parametrize("n", [6, 9])
def test_a_negotiating_comm_links_only_with_its_peers(n):
    results = _hvdmx_testing.tcp_negotiation(n, direct_bit_and_ranks=1)
    assert [got["error"] for got in results] == [""] * n
    for r, got in enumerate(results):
        assert got["linked"] == _hvdmx_testing.negotiation_peers(r, n, 1), r
        assert got["gathered"] == ([f"from {j}" for j in range(n)] if r == 0 else [])
        assert got["string"] == "from rank 0"
        assert got["and"] == ((1 << 64) - 1) & ~((1 << n) - 1)


@pytest.mark.parametrize("n", [2, 3])
def test_a_peer_that_closes_its_connections_fails_the_waits_naming_it(n):
    results = _hvdmx_testing.tcp_peer_gone(n, "close")
    assert results[n - 1]["error"] == ""
    for r in range(n - 1):
        assert (f"the connection to rank {n - 1} (host " in results[r]["error"] and
                "was closed by that rank" in results[r]["error"]), results[r]["error"]


@pytest.mark.parametrize("n", [2, 3])
def test_a_silent_peer_fails_the_waits_after_the_give_up_time(n):
    results = _hvdmx_testing.tcp_peer_gone(n, "silent")
    assert results[n - 1]["error"] == ""
    for r in range(n - 1):
        assert (f"no bytes have moved between this rank and rank {n - 1} (host "
                in results[r]["error"] and "for 0.5" in results[r]["error"]), results[r]["error"]


@pytest.mark.parametrize("bytes_", [64, 4, -1])
def test_a_peers_report_fails_any_receive_from_it_naming_it_and_saying_what_it_reports(bytes_):
    # Note [A rank's finding reaches every rank]: a report frame ends a receive of
    # known size (longer or shorter than the report) or of any size up to 8 bytes
    # (shorter than the report) alike, not as a message of the wrong size; the
    # reporter's "hvdmx: " goes, and its control characters show as '?'.
    finding = "hvdmx: rank 7 sent a bad count\n\x1b[31m, which the protocol does not allow"
    results = _hvdmx_testing.tcp_report(finding, bytes_)
    assert results[1]["error"] == "", results
    error = results[0]["error"]
    assert error.startswith("hvdmx: rank 1 (host "), error
    assert error.endswith(" reports that rank 7 sent a bad count??[31m, which the protocol "
                          "does not allow"), error


def test_a_report_carries_at_most_4096_bytes():
    results = _hvdmx_testing.tcp_report("z" * 10000, 16)
    error = results[0]["error"]
    assert error.split(" reports that ", 1)[1] == "z" * 4096, error[:200]


@pytest.mark.timeout(60)
def test_a_peer_that_never_answers_the_handshake_fails_the_connection_in_bounded_time():
    """A listener whose accept queue is full drops further SYNs, as a host that
    is gone or drops packets does: a blocking connect would retry for about two
    minutes (and this test fail by its timeout); hvdmx gives up after 10 s with
    an error naming the peer."""
    import socket
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # room for one connection, never accepted
    address = "127.0.0.1:%d stuffed-listener" % listener.getsockname()[1]
    stuffers = []
    try:
        for _ in range(4):  # fill the queue whatever the kernel's slack
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(listener.getsockname())
            stuffers.append(s)
        got = _hvdmx_testing.tcp_connect_to(address)
    finally:
        for s in stuffers:
            s.close()
        listener.close()
    assert "could not be made within 10 s" in got, got
    assert "rank 1 (host stuffed-listener" in got, got


@pytest.mark.parametrize("address", ["no-port-here host", "127.0.0.1:1", "127.0.0.1:1 a b c",
                                     "256.0.0.1:1 host"])
def test_an_address_exchange_entry_that_does_not_parse_fails_naming_the_rank(address):
    # What rank 1 gives the exchange is "<address> 1 <id>": input, checked field by field.
    got = _hvdmx_testing.tcp_connect_to(address)
    assert "rank 1 sent the address exchange" in got and "protocol does not allow" in got, got


@pytest.mark.timeout(30)
def test_a_peer_that_refuses_fails_the_connection_at_once():
    import socket
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    address = "127.0.0.1:%d closed-port" % probe.getsockname()[1]
    probe.close()  # nothing listens there now
    got = _hvdmx_testing.tcp_connect_to(address)
    assert "rank 1 (host closed-port" in got, got
    assert "could not be made: Connection refused" in got, got
