"""The collectives TcpComm runs (csrc/hvdmx/comm/p2p_collectives.cc) on LocalComm, one
rank per thread: 1 to 7 ranks, every collective of the Comm interface from every root,
the bit-and both ways (rank to rank, and through rank 0 beyond direct_bit_and_ranks)
with payloads, checked exactly as tests/test_tcp_comm.py checks TcpComm; and a peer
that breaks the protocol fails the comm naming it."""
import pytest

import _hvdmx_testing
from comm_checks import check_collectives

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("direct", [16, 3, 1])
@pytest.mark.parametrize("count", [0, 1, 37])
def test_every_collective_from_every_root(n, direct, count):
    results = _hvdmx_testing.local_collectives(n, direct_bit_and_ranks=direct, count=count,
                                               segment_bytes=12)
    check_collectives(results, n, count)


@pytest.mark.parametrize("what, victim, size, expected", [
    ("recv", 0, 3, "a message of 3 bytes where 8 were expected"),
    ("recv", 1, 9, "a message of 9 bytes where 8 were expected"),
    ("bit_and", 0, 3, "a bit-and of 3 bytes where 8 were expected"),
    ("bit_and", 1, 0, "a bit-and of 0 bytes where 8 were expected"),
    # Rank 1 is never sent a payload.
    ("bit_and", 1, 9, "a message of 9 bytes where at most 8 were expected"),
])
def test_a_peer_that_lies_about_sizes_fails_the_comm_naming_it(what, victim, size, expected):
    got = _hvdmx_testing.local_lying_peer(what, victim, size)
    assert f"rank {1 - victim} sent " in got and "protocol does not allow" in got, got
    assert expected in got, got


def test_a_payload_longer_than_the_limit_fails_naming_the_peer():
    most = 8 + (64 << 20)
    got = _hvdmx_testing.local_lying_peer("bit_and", 0, most + 1)
    assert f"a message of {most + 1} bytes where at most {most} were expected" in got, got
    assert _hvdmx_testing.local_lying_peer("bit_and", 0, most) == ""
