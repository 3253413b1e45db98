"""The collectives TcpComm runs (csrc/hvdmx/comm/p2p_collectives.cc) on LocalComm, one
rank per thread: 1 to 17 ranks, every collective of the Comm interface from every root
(the gather along the tree), the bit-and both ways (rank to rank with payloads, and by
recursive doubling beyond direct_bit_and_ranks, with its message and latency bounds),
checked exactly as tests/test_tcp_comm.py checks TcpComm; the ranks a negotiating rank
links with; and a peer that breaks the protocol fails the comm naming it."""
import pytest

import _hvdmx_testing
from comm_checks import check_collectives

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 17])
@pytest.mark.parametrize("direct", [16, 3, 1])
@pytest.mark.parametrize("count", [0, 37])
def test_every_collective_from_every_root(n, direct, count):
    results = _hvdmx_testing.local_collectives(n, direct_bit_and_ranks=direct, count=count,
                                               segment_bytes=12)
    check_collectives(results, n, count, direct)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 12, 16, 33, 256, 1000])
@pytest.mark.parametrize("direct", [4, 1])
def test_a_negotiating_rank_links_with_log_n_peers_and_the_links_are_mutual(n, direct):
    peers = [_hvdmx_testing.negotiation_peers(r, n, direct) for r in range(n)]
    for r in range(n):
        assert r not in peers[r] and all(r in peers[j] for j in peers[r]), r
    if n <= direct:
        assert peers == [[j for j in range(n) if j != r] for r in range(n)]
    else:
        # The tree's parent and children (at most log2 n + 1) and the doubling
        # partners (at most log2 n + 1), some of them the same ranks.
        assert max(len(p) for p in peers) <= 2 * (n.bit_length() + 1), max(map(len, peers))


@pytest.mark.parametrize("what, victim, size, expected", [
    ("recv", 0, 3, "a message of 3 bytes where 8 were expected"),
    ("recv", 1, 9, "a message of 9 bytes where 8 were expected"),
    ("bit_and", 0, 3, "a bit-and of 3 bytes where 8 were expected"),
    ("bit_and", 1, 0, "a bit-and of 0 bytes where 8 were expected"),
    # Rank 1 is never sent a payload (two ranks: the bit-and is direct).
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
