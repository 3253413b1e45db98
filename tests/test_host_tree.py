"""The negotiation across hosts (csrc/hvdmx/shm/host_tree_comm.h, Note [Negotiation
across hosts]) in one process: hosts of threads sharing plain memory, their leaders
over LocalComm. Every rank gets the AND of every rank's words, rank 0 every rank's
string (pieces longer than a shared-memory mailbox included), every rank rank 0's
broadcast; only leaders send messages, at most log2(hosts) + 1 each way a bit-and."""
import pytest

import _hvdmx_testing
from comm_checks import doubling_bounds

pytestmark = pytest.mark.timeout(120)

BIG = _hvdmx_testing.SHM_MAX_PAYLOAD_BYTES * 2 + 5


def blocked(n_hosts, per_host):
    return [[h * per_host + i for i in range(per_host)] for h in range(n_hosts)]


def cyclic(n_hosts, per_host):
    # Rank r on host r % n_hosts: mpiexec's round-robin placement.
    return [[i * n_hosts + h for i in range(per_host)] for h in range(n_hosts)]


@pytest.mark.parametrize("hosts", [
    blocked(1, 3), blocked(2, 2), blocked(3, 2), blocked(5, 3), blocked(8, 2),
    cyclic(3, 2), cyclic(4, 3),
], ids=lambda h: f"{len(h)}x{len(h[0])}-{'blocked' if h[0][:2] == [0, 1] else 'cyclic'}")
@pytest.mark.parametrize("direct", [4, 1])
def test_every_rank_gets_the_and_the_gather_and_the_broadcast(hosts, direct):
    n_hosts, per_host = len(hosts), len(hosts[0])
    n = n_hosts * per_host
    results = _hvdmx_testing.host_tree(hosts, direct_bit_and_ranks=direct, big=BIG)
    assert [r["error"] for r in results] == [""] * n
    leaders = {h[0] for h in hosts}
    for round_ in range(3):
        expected = ~sum(1 << ((r + round_) % 64) for r in range(n)) & ((1 << 64) - 1)
        for r in range(n):
            assert results[r]["ands"][round_] == [expected] * 3, (r, round_)
            assert results[r]["strings"][round_] == bytes([ord("A") + round_]) * (BIG + round_)
            want = ([_hvdmx_testing.gather_string(j, round_, BIG).encode("latin-1")
                     for j in range(n)] if r == 0 else [])
            assert [g.encode("latin-1") for g in results[r]["gathers"][round_]] == want
    # Only leaders touch the network; every rank of a host knows the hops.
    for r in range(n):
        if r not in leaders:
            assert results[r]["bit_and_sent"] == results[r]["bit_and_received"] == 0
    for h in hosts:
        assert len({results[r]["hops"][0] for r in h}) == 1
    if n_hosts == 1:
        assert all(results[r]["hops"] == [0, 0, 0] for r in range(n))
    elif n_hosts <= direct:
        assert all(results[r]["bit_and_sent"] == n_hosts - 1 for r in leaders)
    else:
        most_sent, most_received, hops = doubling_bounds(n_hosts)
        assert max(results[r]["bit_and_sent"] for r in leaders) == most_sent
        assert max(results[r]["bit_and_received"] for r in leaders) == most_received
        assert max(results[r]["hops"][0] for r in range(n)) <= hops
