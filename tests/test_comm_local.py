"""The collectives TcpComm runs (csrc/hvdmx/comm/p2p_collectives.cc) on LocalComm, one
rank per thread: 1 to 17 ranks, every collective of the Comm interface from every root
(the gather along the tree), the bit-and both ways (rank to rank with payloads, and by
recursive doubling beyond direct_bit_and_ranks, with its message and latency bounds),
checked exactly as tests/test_tcp_comm.py checks TcpComm; the ranks a negotiating rank
links with; and a peer that breaks the protocol fails the comm naming it."""
import numpy as np
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
    ("bit_and", 0, 3, "a bit-and of 3 bytes where 16 were expected"),
    ("bit_and", 1, 0, "a bit-and of 0 bytes where 16 were expected"),
    # The word and the partial's length, then at most 24 KiB of partial;
    # rank 1 is never sent a payload (two ranks: the bit-and is direct).
    ("bit_and", 1, 16 + 24 * 1024 + 1,
     f"a message of {16 + 24 * 1024 + 1} bytes where at most {16 + 24 * 1024} were expected"),
    ("bit_and_partial", 1, 40, "a bit-and partial of 25 bytes, where 24 followed"),
    ("bit_and_partial", 0, 40, "a bit-and partial of 25 bytes, where 24 followed"),
])
def test_a_peer_that_lies_about_sizes_fails_the_comm_naming_it(what, victim, size, expected):
    got = _hvdmx_testing.local_lying_peer(what, victim, size)
    assert f"rank {1 - victim} sent " in got and "protocol does not allow" in got, got
    assert expected in got, got


def test_a_payload_longer_than_the_limit_fails_naming_the_peer():
    most = 16 + 24 * 1024 + (64 << 20)
    got = _hvdmx_testing.local_lying_peer("bit_and", 0, most + 1)
    assert f"a message of {most + 1} bytes where at most {most} were expected" in got, got
    assert _hvdmx_testing.local_lying_peer("bit_and", 0, most) == ""


def _record(values):
    """What a rank's round partial holds for the float32 Sum allreduce at
    cache slot 0: the slot, then the operand, padded to 8 bytes."""
    body = np.asarray(values, np.float32).tobytes()
    return (0).to_bytes(8, "little") + body + b"\0" * (-len(body) % 8)


# hosts x per_host: direct and by doubling among the leaders (a power of two
# and not), and through a host's shared memory first.
LAYOUTS = [(1, 1, 4), (2, 1, 4), (3, 1, 4), (4, 1, 4), (5, 1, 4), (6, 1, 1), (8, 1, 1),
           (1, 3, 4), (2, 2, 4), (3, 2, 1), (5, 2, 1)]


@pytest.mark.parametrize("hosts, per_host, direct", LAYOUTS)
def test_operands_reduced_with_the_bit_and_are_the_same_bits_everywhere(hosts, per_host, direct):
    n = hosts * per_host
    rng = np.random.default_rng(n * 10 + direct)
    # Integers first (any order gives the exact sum), then floats whose sum
    # depends on the order: every rank must still hold the same bits.
    for values in (rng.integers(-1000, 1000, (n, 7)), rng.standard_normal((n, 5)) * 1e3):
        values = values.astype(np.float32)
        results = _hvdmx_testing.round_bit_and(hosts, per_host, direct, values.tolist())
        assert [r["error"] for r in results] == [""] * n, results
        got = [np.frombuffer(r["reduced"], np.float32)[: values.shape[1]] for r in results]
        assert len({g.tobytes() for g in got}) == 1, got
        if values[0, 0] == np.round(values[0, 0]):
            np.testing.assert_array_equal(got[0], values.sum(axis=0))
        else:
            np.testing.assert_allclose(got[0], values.astype(np.float64).sum(axis=0), rtol=1e-5)


@pytest.mark.parametrize("hosts, per_host, direct", LAYOUTS[1:])
def test_a_slot_one_rank_leaves_out_is_reduced_nowhere(hosts, per_host, direct):
    n = hosts * per_host
    for absent in {0, n // 2, n - 1}:
        values = [[] if r == absent else [float(r)] * 3 for r in range(n)]
        results = _hvdmx_testing.round_bit_and(hosts, per_host, direct, values)
        assert [(r["error"], r["reduced"]) for r in results] == [("", None)] * n, (absent, results)


@pytest.mark.parametrize("lie, why", [
    (_record([1.0, 2.0])[:-1], "record's operands cut short: 8 bytes needed, 7 left"),
    ((5).to_bytes(8, "little") + bytes(8), "record's cache slot 5, outside [0, 0]"),
    (_record([1.0, 2.0]) * 2, "cache slot 0 after slot 0, where slots must ascend"),
    (b"\1\2\3", "record's cache slot cut short: 8 bytes needed, 3 left"),
])
def test_a_partial_that_does_not_parse_fails_the_bit_and_naming_the_peer(lie, why):
    # Two hosts of one rank: rank 1 sends rank 0 a partial it cannot read.
    values = [[1.0, 2.0], [3.0, 4.0]]
    results = _hvdmx_testing.round_bit_and(2, 1, 4, values, liar=1, lie=lie)
    assert "rank 1 sent a bit-and partial" in results[0]["error"], results
    assert why in results[0]["error"], results
    # One host of two ranks: local rank 1 gives it through shared memory.
    results = _hvdmx_testing.round_bit_and(1, 2, 4, values, liar=1, lie=lie)
    assert "local rank 1 sent a bit-and partial" in results[0]["error"], results
    assert why in results[0]["error"], results
