"""What every collective of the Comm interface must give, as RecordCollectives
(csrc/hvdmx/testing/testing_comm_bindings.cc) runs them on any comm: checked the same
way for TcpComm (tests/test_tcp_comm.py) and LocalComm (tests/test_comm_local.py)."""
import numpy as np


def payload(rank, round_):
    """What rank `rank` sends with its bit-and in round `round_` (none from rank 1 in
    round 1)."""
    return "" if (rank, round_) == (1, 1) else f"payload of rank {rank} round {round_}"


def doubling_bounds(n):
    """Recursive doubling over n ranks (Note [The bit-and over point-to-point]): the
    most messages a rank sends, and receives, in one bit-and, and the most latencies
    on the critical path (exact when n is a power of two)."""
    p = 1 << (n.bit_length() - 1)
    log_p = p.bit_length() - 1
    folded = n != p
    return log_p + folded, log_p + folded, log_p + 2 * folded


def check_collectives(results, n, count, direct):
    """Every rank got exactly what it should: the bit-ands' words on every rank and,
    when direct (n <= `direct`), their payloads at rank 0; every root's gather, string
    and byte broadcast; the same allreduce sums, bit for bit, on every rank. The
    bit-and's messages and hops are those of its scheme: one each way to every other
    rank when direct, at most log2 a rank by doubling."""
    assert [r["error"] for r in results] == [""] * n
    carries = n <= direct
    for round_ in range(3):
        # Rank r cleared bit (r + round) of every word; the AND lacks all of them.
        expected = ~sum(1 << ((r + round_) % 64) for r in range(n)) & ((1 << 64) - 1)
        for r in range(n):
            assert results[r]["ands"][round_] == [expected] * 3, (r, round_)
        assert results[0]["payloads"][round_] == (
            [payload(j, round_) for j in range(n)] if carries else [])
        assert all(results[r]["payloads"][round_] == [] for r in range(1, n))
    if carries:
        assert all(r["hops"] == [min(1, n - 1)] * 3 for r in results)
        assert all(r["bit_and_sent"] == r["bit_and_received"] == 3 * (n - 1) for r in results)
    else:
        most_sent, most_received, hops = doubling_bounds(n)
        longest = max(r["hops"][0] for r in results)
        assert hops - (n & (n - 1) != 0) <= longest <= hops, [r["hops"] for r in results]
        assert all(len(set(r["hops"])) == 1 for r in results)
        assert max(r["bit_and_sent"] for r in results) == 3 * most_sent
        assert max(r["bit_and_received"] for r in results) == 3 * most_received
        # Every message sent is received.
        assert (sum(r["bit_and_sent"] for r in results) ==
                sum(r["bit_and_received"] for r in results))
    sums = [sum(float(r * 1000 + i) for r in range(n)) for i in range(count)]
    for r, got in enumerate(results):
        for root in range(n):
            gathered = got["gathers"][root]
            assert gathered == ([chr(ord("a") + root) * j for j in range(n)] if r == root
                                else [])
            assert got["strings"][root] == bytes([ord("A") + root]) * (root * 1000 + 1)
            assert got["bcasts"][root] == [root + 1] * count
        assert got["exchange_allreduce"] == sums
        assert got["ring_allreduce"] == sums
    # Bitwise the same on every rank.
    for key in ("exchange_allreduce", "ring_allreduce"):
        first = np.array(results[0][key], dtype=np.float32).tobytes()
        assert all(np.array(r[key], dtype=np.float32).tobytes() == first for r in results)
