"""The data comm's links (Note [The data comm's links] in csrc/hvdmx/comm/p2p_comm.h):
rank r links with (r +- 2^k) mod n only; the set is mutual, small, and holds every
partner of the ring, the binomial tree from any root and recursive doubling; the
collectives that carry data give the same bytes over those links as over every pair
(LocalComm and TcpComm, one rank a thread); and a send to a rank outside the set fails
naming both ranks."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import _hvdmx_testing
from comm_checks import check_collectives

pytestmark = pytest.mark.timeout(120)


def tree_partners(v, n):
    """Relative rank v's parent and children in the binomial tree (Note [The binomial
    tree])."""
    out = []
    mask = 1
    while mask < n:
        if v & mask:
            out.append(v - mask)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < n:
            out.append(v + mask)
        mask >>= 1
    return out


def doubling_partners(v, n):
    """Recursive doubling's partners of v (the bit-and, Adasum): v XOR 2^k below the
    largest power of two p <= n, and the folding pair v +- p."""
    p = 1 << (n.bit_length() - 1)
    if v >= p:
        return [v - p]
    out = [v ^ m for m in (1 << k for k in range(p.bit_length() - 1))]
    return out + ([v + p] if v < n - p else [])


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=1, max_value=300))
def test_the_data_peers_are_mutual_few_and_hold_every_partner(n):
    peers = [set(_hvdmx_testing.data_peers(r, n)) for r in range(n)]
    bound = 2 * math.ceil(math.log2(n)) if n > 1 else 0
    for r in range(n):
        assert r not in peers[r] and all(r in peers[j] for j in peers[r]), r
        assert len(peers[r]) <= bound, (r, sorted(peers[r]))
        assert _hvdmx_testing.data_peers(r, n) == sorted(peers[r])
        if n > 1:
            assert {(r + 1) % n, (r - 1) % n} <= peers[r]
        for v in doubling_partners(r, n):
            assert v in peers[r], (r, v)
    # The tree from root t links relative ranks v and w, which are ranks
    # (v + t) % n and (w + t) % n: over every root, every rank r must link
    # with r + (w - v) mod n, for every tree edge (v, w). So every such offset
    # must be among every rank's offsets to its peers (the check over every
    # root and rank, in n log n instead of n^2 log n steps: 46 s at 300
    # examples before).
    tree_offsets = {(w - v) % n for v in range(n) for w in tree_partners(v, n)}
    for r in range(n):
        missing = tree_offsets - {(j - r) % n for j in peers[r]}
        assert not missing, (r, sorted(missing))
    if n <= 5:
        assert peers == [set(range(n)) - {r} for r in range(n)]


@pytest.mark.parametrize("n", [256, 27600])
def test_the_data_peers_grow_as_log_n(n):
    sizes = {len(_hvdmx_testing.data_peers(r, n)) for r in (0, 1, n // 3, n - 1)}
    assert max(sizes) <= 2 * math.ceil(math.log2(n))


@pytest.mark.parametrize("keys", [
    ["a", "a", "b", "b", "c", "c"],
    ["a", "b", "a", "b", "c", "c", "d"],
    ["x"] * 5,
    [str(r) for r in range(9)],
])
def test_the_hierarchical_adasum_pairs_are_mutual(keys):
    n = len(keys)
    peers = [_hvdmx_testing.adasum_hierarchical_peers(keys, r) for r in range(n)]
    for r in range(n):
        assert r not in peers[r] and all(r in peers[j] for j in peers[r]), (r, peers)


def alltoall_matrix(n, seed):
    """Bytes from i to j, with zeros, ones and sizes that differ per pair."""
    rng = np.random.default_rng(seed)
    m = rng.integers(0, 40, size=(n, n))
    m[rng.random((n, n)) < 0.2] = 0
    m[0, n - 1] = 1
    return [int(x) for x in m.reshape(-1)]


def alltoall_byte(i, j, k):
    return (i * 31 + j * 7 + k) % 251


def expected_alltoall(n, matrix, r):
    return bytes(alltoall_byte(j, r, k) for j in range(n) for k in range(matrix[j * n + r]))


def check_data_collectives(results, n, matrix, count):
    """What RecordDataCollectives gives, exactly."""
    assert [got["error"] for got in results] == [""] * n
    starts = np.cumsum([0] + [c + count for c in range(n)])
    gathered = []
    for c in range(n):
        gathered += [float(c * 1000 + i) for i in range(starts[c], starts[c + 1])]
    slots = b"".join(bytes(ord("a") + (c + k) % 26 for k in range(count)) for c in range(n))
    for r, got in enumerate(results):
        assert got["alltoall"] == expected_alltoall(n, matrix, r), r
        assert got["bruck_allgather"] == slots, r
        assert got["ring_allgather"] == gathered, r
        mine = [float(sum(j * 1000 + i for j in range(n))) for i in range(starts[r], starts[r + 1])]
        assert got["ring_reducescatter"] == mine, r
        # Every rank has the same Adasum bits.
        assert got["adasum"] == results[0]["adasum"], r
        assert got["hierarchical_adasum"] == results[0]["hierarchical_adasum"], r


def host_keys(n):
    """Hosts of two ranks, not in rank order, and one of a single rank when n is odd."""
    return [f"host {(r * 3) % n // 2}" for r in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 8, 9, 13])
@pytest.mark.parametrize("count", [0, 1, 37])
def test_the_data_collectives_over_the_data_links_give_what_every_pair_gives(n, count):
    matrix = alltoall_matrix(n, n * 100 + count)
    keys = host_keys(n)
    data = _hvdmx_testing.local_data_collectives(n, "data", matrix, count, keys)
    full = _hvdmx_testing.local_data_collectives(n, "all", matrix, count, keys)
    check_data_collectives(data, n, matrix, count)
    check_data_collectives(full, n, matrix, count)
    check_collectives(data, n, count, 1)
    assert all(got["links_every_pair"] for got in full)
    # Every rank chooses its algorithms alike: it links every pair on every rank or on none.
    assert len({got["links_every_pair"] for got in data}) == 1
    assert data[0]["links_every_pair"] or n > 5
    for r in range(n):
        # Bruck's exchange allreduce and alltoall, and the hierarchical Adasum over its
        # added links, give the bits of the direct ones.
        for key in ("alltoall", "exchange_allreduce", "adasum", "hierarchical_adasum",
                    "ring_allreduce", "bcasts"):
            assert data[r][key] == full[r][key], (r, key)


@pytest.mark.parametrize("n", [2, 3, 5, 6, 8, 9])
def test_a_tcp_data_comm_links_with_its_data_peers_and_runs_every_collective(n):
    matrix = alltoall_matrix(n, n)
    keys = host_keys(n)
    got = _hvdmx_testing.tcp_data_collectives(n, matrix, 5, keys)
    check_data_collectives(got, n, matrix, 5)
    check_collectives(got, n, 5, 1)
    full = _hvdmx_testing.local_data_collectives(n, "all", matrix, 5, keys)
    for r in range(n):
        want = set(_hvdmx_testing.data_peers(r, n))
        want |= set(_hvdmx_testing.adasum_hierarchical_peers(keys, r))
        assert got[r]["linked"] == sorted(want), r
        for key in ("alltoall", "exchange_allreduce", "adasum", "hierarchical_adasum"):
            assert got[r][key] == full[r][key], (r, key)


@pytest.mark.parametrize("recv", [False, True])
def test_a_send_to_an_unlinked_rank_fails_naming_both_ranks(recv):
    assert 3 not in _hvdmx_testing.data_peers(0, 6)
    got = _hvdmx_testing.local_unlinked(6, 0, 3, recv)
    assert "hvdmx internal error: rank 0 of 6" in got and "rank 3" in got, got
    assert "it links with ranks 1, 2, 4, 5" in got, got


def test_a_tcp_send_to_an_unlinked_rank_fails_naming_both_ranks():
    got = _hvdmx_testing.tcp_unlinked(8, 1, 6)
    assert "hvdmx internal error: rank 1 of 8 sent to rank 6" in got, got
    assert "no TCP link" in got and "This is a bug in hvdmx" in got, got
