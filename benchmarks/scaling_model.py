"""The alpha-beta-gamma model of a training step of docs/scaling.md: checked against
the scale harness's cached rounds (python -m hvdmx.bench scale --json), then taken to
1,024, 6,000 and 27,600 ranks.

    python -m hvdmx.bench scale --model none --json > scale.json
    python benchmarks/scaling_model.py --harness scale.json --alpha-us 13 \\
        --c0-us 10 --c-req-us 0.55 --overlap 0.5

The constants (docs/scaling.md says where each was measured):
  alpha   one network latency of a small message between hosts;
  c0      a rank's CPU for a cached round with one request, c_req per request more;
  beta    seconds per byte on a host's link (1 / bandwidth);
  gamma   seconds per byte to reduce one operand into another (memory-bound add);
  B_shm   bytes a second a host moves through shared memory.

A cached negotiation round at N ranks, L a host, H = N / L hosts:
  host tree   c0 + c_req R + D(H) alpha        (D: the doubling's latencies)
  flat        c0 + c_req R + D(N) alpha
  coordinator 2 ceil(log2 N) alpha + c_req R N (Horovod's original design: rank 0
              reads every rank's R requests every cycle)
On the harness every rank is a thread on C cores, so a round there takes at least
all ranks' CPU over the cores, N c_rank / C (c_rank = c0 + c_req R): the model's
floor, checked against the one the harness measures.

The hierarchical allreduce of S bytes in pieces of F (fusion buffers), k = ceil(S/F):
  2 S (L-1)/L / B_shm + S gamma                   (inside the host)
  + 2 (H-1) k alpha + 2 (H-1)/H S beta            (the ring between hosts, L rings
                                                    sharing the host's link)
A step is compute + negotiation + the allreduce not hidden behind the backward pass.
"""
from __future__ import annotations

import argparse
import json
import math


def doubling_latencies(n: int, direct: int = 4) -> int:
    """Network latencies of the point-to-point bit-and over n ranks (upper bound)."""
    if n <= 1:
        return 0
    if n <= direct:
        return 1
    p = 1 << (n.bit_length() - 1)
    return int(math.log2(p)) + (2 if p != n else 0)


def bit_and_messages(n: int, direct: int = 4) -> int:
    """Messages the busiest rank sends and receives in one point-to-point bit-and."""
    if n <= 1:
        return 0
    if n <= direct:
        return 2 * (n - 1)
    p = 1 << (n.bit_length() - 1)
    return 2 * (int(math.log2(p)) + (p != n))


def negotiation_us(scheme: str, n: int, per_host: int, c0: float, c_req: float, requests: int,
                   alpha: float) -> float:
    cpu = c0 + c_req * requests
    if scheme == "tree":
        return cpu + doubling_latencies(n // per_host) * alpha
    if scheme == "flat":
        return cpu + doubling_latencies(n) * alpha
    return 2 * math.ceil(math.log2(max(n, 2))) * alpha + c_req * requests * n  # coordinator


def allreduce_ms(n: int, per_host: int, set_bytes: float, fusion: float, alpha_us: float,
                 link_gbs: float, shm_gbs: float, reduce_gbs: float) -> float:
    hosts = n // per_host
    pieces = math.ceil(set_bytes / fusion)
    local = 2 * set_bytes * (per_host - 1) / per_host / (shm_gbs * 1e9) + \
        set_bytes / (reduce_gbs * 1e9)
    ring = 2 * (hosts - 1) * pieces * alpha_us * 1e-6 + \
        2 * (hosts - 1) / hosts * set_bytes / (link_gbs * 1e9)
    return 1e3 * (local + (ring if hosts > 1 else 0))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--harness", help="JSON of python -m hvdmx.bench scale --json (the "
                                     "table before it is skipped)")
    p.add_argument("--alpha-us", type=float, required=True,
                   help="one latency between hosts, measured (us)")
    p.add_argument("--c0-us", type=float, required=True)
    p.add_argument("--c-req-us", type=float, required=True)
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--requests", type=int, default=193)
    p.add_argument("--per-host", type=int, default=6)
    p.add_argument("--link-gbs", type=float, default=12.5, help="100 Gbit/s = 12.5 GB/s")
    p.add_argument("--shm-gbs", type=float, default=10.0)
    p.add_argument("--reduce-gbs", type=float, default=10.0)
    p.add_argument("--set-mb", type=float, default=102.3, help="ResNet-50's gradients")
    p.add_argument("--fusion-mb", type=float, default=64 * 1.048576)
    p.add_argument("--compute-ms", type=float, default=200.0,
                   help="a rank's forward and backward pass")
    p.add_argument("--overlap", type=float, default=0.0,
                   help="share of the allreduce hidden behind the backward pass")
    a = p.parse_args()

    if a.harness:
        text = open(a.harness).read()
        rows = json.loads(text[text.index("\n[") + 1:])
        print("# the model against the harness, per cached round: messages and latencies of "
              "the busiest rank, and the CPU floor (all ranks' CPU / cores, us): the model's "
              "N c_rank / cores beside the measured one; the measured wall time beside")
        print(f"{'ranks':>6} {'x':>3} {'scheme':>6} | {'msgs':>5} {'model':>5} | "
              f"{'hops':>4} {'model':>5} | {'floor':>9} {'model':>9} {'error':>7} | "
              f"{'round':>9}")
        for r in rows:
            hosts = r["ranks"] // r["per_host"] if r["scheme"] == "tree" else r["ranks"]
            floor = r["ranks"] * (a.c0_us + a.c_req_us * a.requests) / a.cores
            err = (r["floor_us"] - floor) / floor
            print(f"{r['ranks']:>6} {r['per_host']:>3} {r['scheme']:>6} | "
                  f"{r['max_msgs']:>5.0f} {bit_and_messages(hosts):>5} | {r['hops']:>4} "
                  f"{doubling_latencies(hosts):>5} | {r['floor_us']:>9.0f} {floor:>9.0f} "
                  f"{100 * err:>+6.0f}% | {r['round_us']:>9.0f}")
        print()

    print(f"# the model at scale: {a.per_host} ranks a host, alpha {a.alpha_us} us, "
          f"links {a.link_gbs} GB/s, {a.requests} requests, a {a.set_mb} MB gradient set in "
          f"{a.fusion_mb:.0f} MB pieces, compute {a.compute_ms} ms a step, "
          f"{100 * a.overlap:.0f}% of the allreduce hidden")
    print(f"{'ranks':>6} {'hosts':>5} | {'tree(us)':>9} {'flat(us)':>9} {'coord(us)':>10} | "
          f"{'allreduce(ms)':>13} | {'eff tree':>8} {'eff coord':>9}")
    for n in (6, 96, 1024, 6000, 27600):
        per_host = a.per_host
        n = max(per_host, n // per_host * per_host)
        neg = {s: negotiation_us(s, n, per_host, a.c0_us, a.c_req_us, a.requests, a.alpha_us)
               for s in ("tree", "flat", "coord")}
        ar = allreduce_ms(n, per_host, a.set_mb * 1e6, a.fusion_mb * 1e6, a.alpha_us,
                          a.link_gbs, a.shm_gbs, a.reduce_gbs)
        exposed = ar * (1 - a.overlap)

        def eff(neg_us, exposed=exposed):
            return a.compute_ms / (a.compute_ms + neg_us / 1e3 + exposed)
        print(f"{n:>6} {n // per_host:>5} | {neg['tree']:>9.0f} {neg['flat']:>9.0f} "
              f"{neg['coord']:>10.0f} | {ar:>13.1f} | {eff(neg['tree']):>8.3f} "
              f"{eff(neg['coord']):>9.3f}")


if __name__ == "__main__":
    main()
