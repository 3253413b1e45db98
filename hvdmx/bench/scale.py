"""``python -m hvdmx.bench scale``: N ranks of the core as threads of this one
process (csrc/hvdmx/bench/scale_harness.h), no MPI and no MXNet in the ranks, hosts
made of rank groups that share memory and real TCP between them on the loopback
interface; per cached negotiation round, what the busiest rank sends and receives,
the latencies on the critical path and the time, and a gradient set's step."""
from __future__ import annotations

import os

import numpy as np

# What a cached round costs the machine that runs every rank: the CPU all ranks
# used, spread over its cores, is the least wall time the round can take here.
_CORES = len(os.sched_getaffinity(0))


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _step_counts(model: str) -> list:
    from hvdmx.bench.model import model_gradients
    return [int(np.prod(shape)) for shape, _ in model_gradients(model)]


def run_scale(args) -> list:
    """One row per (ranks, scheme): the harness's figures, the busiest rank's."""
    from hvdmx import _core
    counts = _step_counts(args.model) if args.model != "none" else []
    set_bytes = 4 * sum(counts)
    if args.requests is None:
        args.requests = len(counts) or 161
    rows = []
    for n in args.ranks:
        per_host = min(args.per_host, n)
        if n % per_host:
            raise SystemExit(f"hvdmx.bench scale: --per-host {per_host} does not divide "
                             f"--ranks {n}; give rank counts that are multiples of it")
        # Each rank holds the set, and the harness's memory is one process's.
        fits = set_bytes * n <= 0.4 * _mem_available()
        for scheme in args.schemes:
            got = _core.scale(ranks=n, per_host=per_host, host_tree=scheme == "tree",
                              rounds=args.rounds, requests=args.requests,
                              step_counts=counts if fits else [], steps=args.steps)
            ranks = got["ranks"]
            errors = [f"rank {r}: {x['error']}" for r, x in enumerate(ranks) if x["error"]]
            if errors:
                raise SystemExit("hvdmx.bench scale: " + "; ".join(errors[:3]))
            rows.append({
                "ranks": n, "hosts": n // per_host, "per_host": per_host, "scheme": scheme,
                "max_msgs": max(x["sent_messages"] + x["received_messages"] for x in ranks),
                "max_bytes": max(x["sent_bytes"] + x["received_bytes"] for x in ranks),
                "hops": max(x["hops"] for x in ranks),
                "links": max(x["links"] for x in ranks),
                "round_us": 1e6 * got["round_seconds"],
                "cpu_us": 1e6 * max(x["cpu_seconds"] for x in ranks),
                "floor_us": 1e6 * sum(x["cpu_seconds"] for x in ranks) / _CORES,
                "uncached_ms": 1e3 * got["uncached_seconds"],
                "step_ms": 1e3 * got["step_seconds"] if got["step_seconds"] >= 0 else None,
                "step_correct": got["step_correct"],
                "step_note": "" if fits or not counts else
                f"needs {set_bytes * n / 2 ** 30:.0f} GiB",
            })
            print_row(rows[-1], header=len(rows) == 1, args=args, counts=counts)
    return rows


def print_row(r: dict, header: bool, args, counts: list) -> None:
    if header:
        model = (f"{args.model}'s {len(counts)} gradients, {4 * sum(counts) / 1e6:.1f} MB "
                 "float32" if counts else "none")
        print(f"# hvdmx negotiation at scale: ranks are threads of one process on "
              f"{_CORES} cores; {args.requests} requests a round, cached; figures per "
              f"cached round, mean of {args.rounds}; msgs and bytes: sent + received by "
              f"the busiest rank over the network; hops: network latencies on the "
              f"critical path; CPU: the busiest rank's; floor: all ranks' CPU / cores; "
              f"step: a cached round and the hierarchical allreduce of the set ({model})")
        print(f"{'ranks':>6} {'hosts':>5} {'x':>3} {'scheme':>6} | {'max msgs/rank':>13} "
              f"{'max B/rank':>10} {'hops':>4} {'links':>5} | {'round(us)':>10} "
              f"{'CPU(us)':>8} {'floor(us)':>9} | {'uncached(ms)':>12} | {'step(ms)':>9}")
    step = (f"{r['step_ms']:>9.1f}" + ("" if r["step_correct"] else " WRONG")
            if r["step_ms"] is not None else f"{r['step_note'] or '-':>9}")
    print(f"{r['ranks']:>6} {r['hosts']:>5} {r['per_host']:>3} {r['scheme']:>6} | "
          f"{r['max_msgs']:>13.1f} {r['max_bytes']:>10.0f} {r['hops']:>4} {r['links']:>5} | "
          f"{r['round_us']:>10.0f} {r['cpu_us']:>8.0f} {r['floor_us']:>9.0f} | "
          f"{r['uncached_ms']:>12.1f} | {step}", flush=True)
