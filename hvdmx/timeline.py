"""Reads the timeline hvdmx writes (``HVDMX_TIMELINE=file.json`` or
``hvd.start_timeline``): a Chrome trace with one row per tensor.

    python -m hvdmx.timeline summary file.json [--top 20]
    python -m hvdmx.timeline plot file.json -o timeline.png [--top 30]

Each tensor's row reads as in Horovod's timeline: NEGOTIATE_<OP> (for
example NEGOTIATE_ALLREDUCE), then the operation <OP> (ALLREDUCE, BROADCAST,
ALLGATHER, ALLTOALL, REDUCESCATTER, BARRIER, JOIN, or ERROR) holding its steps
(QUEUE, MEMCPY_IN_FUSION_BUFFER, the transport such as MPI_ALLREDUCE or
SHM_BCAST, MEMCPY_OUT_FUSION_BUFFER); see docs/timeline.md.

``summary`` prints the time spent in each phase (negotiations, operations and
their steps) over all tensors, then per tensor, the busiest first (by the time
from submission to completion, each microsecond counted once). ``plot`` draws
the busiest tensors against time (matplotlib): each operation as an outline
with its steps inside. Open the file itself in chrome://tracing or
https://ui.perfetto.dev for the full picture.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from typing import DefaultDict, Dict, List, Tuple

# The top-level events of a row (Horovod's names); every other event but a
# negotiation is a step nested inside one of these.
OPERATIONS = ("ALLREDUCE", "BROADCAST", "ALLGATHER", "ALLTOALL", "REDUCESCATTER", "BARRIER",
              "JOIN", "ERROR")
# Step order in tables and plots; transports not listed come after these.
_FIRST = ["QUEUE", "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_IN_OUTPUT"]
_LAST = ["MEMCPY_OUT_FUSION_BUFFER"]


def is_negotiation(name: str) -> bool:
    """NEGOTIATE_<OP> (and the plain NEGOTIATE of older hvdmx timelines)."""
    return name.startswith("NEGOTIATE")


def is_top_level(name: str) -> bool:
    """A negotiation or an operation: the events that do not nest in another."""
    return is_negotiation(name) or name in OPERATIONS


def load(path: str) -> Tuple[Dict[int, str], List[dict]]:
    """(row id -> tensor name, the complete and instant events)."""
    with open(path) as f:
        events = json.load(f)
    if not isinstance(events, list):
        raise ValueError(f"{path}: not an hvdmx timeline (expected a JSON array of events)")
    rows = {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    return rows, [e for e in events if e.get("ph") in ("X", "i")]


def phase_order(names) -> List[str]:
    """Negotiations, then operations, then the steps in the order they run."""
    negotiations = sorted(n for n in names if is_negotiation(n))
    operations = [n for n in OPERATIONS if n in names]
    steps = [n for n in names if not is_top_level(n)]
    middle = sorted(n for n in steps if n not in _FIRST and n not in _LAST)
    return (negotiations + operations + [n for n in _FIRST if n in steps] + middle +
            [n for n in _LAST if n in steps])


def summarize(rows: Dict[int, str], events: List[dict]):
    """Per phase: (count, total us); per tensor: {phase: total us}. A step's
    time is inside its operation's."""
    per_phase: DefaultDict[str, List[float]] = collections.defaultdict(lambda: [0, 0])
    per_tensor: DefaultDict[str, DefaultDict[str, float]] = collections.defaultdict(
        lambda: collections.defaultdict(int))
    for e in events:
        if e["ph"] != "X":
            continue
        per_phase[e["name"]][0] += 1
        per_phase[e["name"]][1] += e.get("dur", 0)
        per_tensor[rows.get(e["pid"], str(e["pid"]))][e["name"]] += e.get("dur", 0)
    return per_phase, per_tensor


def print_summary(path: str, top: int) -> None:
    rows, events = load(path)
    per_phase, per_tensor = summarize(rows, events)
    phases = phase_order(per_phase)
    print(f"# {path}: {len(per_tensor)} tensors, {len(events)} events; times in ms")
    print(f"{'phase':<28} {'count':>8} {'total ms':>10} {'mean us':>9}")
    for p in phases:
        count, total = per_phase[p]
        print(f"{p:<28} {count:>8} {total / 1e3:>10.3f} {total / max(count, 1):>9.1f}")
    print()
    # Per tensor: its operation's name, the negotiation and operation times,
    # then each step inside the operation.
    ranked = _busiest(per_tensor)[:top]
    steps = [p for p in phases if not is_top_level(p)]
    width = max([len(name) for name, _ in ranked] + [6])
    short = {p: p.replace("MEMCPY_", "").replace("_FUSION_BUFFER", "")[:12] for p in steps}
    print(f"{'tensor':<{width}} {'operation':<13} {'NEGOTIATE':>12} {'operation':>12} " +
          " ".join(f"{short[p]:>12}" for p in steps))
    for name, times in ranked:
        ops = "/".join(p for p in OPERATIONS if p in times) or "-"
        negotiate = sum(us for p, us in times.items() if is_negotiation(p))
        operation = sum(times.get(p, 0) for p in OPERATIONS)
        print(f"{name:<{width}} {ops:<13} {negotiate / 1e3:>12.3f} {operation / 1e3:>12.3f} " +
              " ".join(f"{times.get(p, 0) / 1e3:>12.3f}" for p in steps))


def _busiest(per_tensor) -> list:
    """(tensor, {phase: us}) pairs, the most time from submission to
    completion (negotiations and operations; steps are inside these) first."""
    def busy(times):
        return sum(us for phase, us in times.items() if is_top_level(phase))
    return sorted(per_tensor.items(), key=lambda kv: -busy(kv[1]))


def plot(path: str, output: str, top: int) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("hvdmx.timeline plot needs matplotlib: pip install 'hvdmx[plot]' (or "
                         "pip install 'matplotlib<3.8' 'numpy<1.24')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, events = load(path)
    _, per_tensor = summarize(rows, events)
    ranked = [name for name, _ in _busiest(per_tensor)[:top]]
    y_of = {name: i for i, name in enumerate(ranked)}
    # One color for every negotiation (the row's operation tells which), and
    # one for each operation and step; the legend says NEGOTIATE_<OP>.
    phases = phase_order({e["name"] for e in events if e["ph"] == "X"})
    kinds = list(dict.fromkeys("NEGOTIATE_<OP>" if is_negotiation(p) else p for p in phases))
    palette = plt.cm.tab20.colors
    color_of = {k: palette[i % len(palette)] for i, k in enumerate(kinds)}
    colors = {p: color_of["NEGOTIATE_<OP>" if is_negotiation(p) else p] for p in phases}
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(ranked) + 1.5))
    for e in events:
        name = rows.get(e["pid"])
        if name not in y_of:
            continue
        if e["ph"] == "X" and e["name"] in OPERATIONS:  # an outline around its steps
            ax.barh(y_of[name], max(e.get("dur", 0), 1) / 1e3, left=e["ts"] / 1e3, height=0.85,
                    fill=False, edgecolor=colors[e["name"]], linewidth=1.2, zorder=1)
        elif e["ph"] == "X":
            ax.barh(y_of[name], max(e.get("dur", 0), 1) / 1e3, left=e["ts"] / 1e3, height=0.6,
                    color=colors[e["name"]], zorder=2)
        else:
            ax.plot([e["ts"] / 1e3], [y_of[name]], "k|", markersize=8)
    ax.set_yticks(range(len(ranked)))
    ax.set_yticklabels(ranked, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time since the timeline started (ms)")
    ax.set_title(f"hvdmx timeline: {path}")
    handles = [plt.Rectangle((0, 0), 1, 1, fill=False, edgecolor=color_of[k]) if k in OPERATIONS
               else plt.Rectangle((0, 0), 1, 1, color=color_of[k]) for k in kinds]
    ax.legend(handles, kinds, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(output, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdmx.timeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summary", help="time per phase and per tensor")
    s.add_argument("file")
    s.add_argument("--top", type=int, default=20, help="tensors to list (default 20)")
    p = sub.add_parser("plot", help="draw the phases of the busiest tensors")
    p.add_argument("file")
    p.add_argument("-o", "--output", required=True, help="image file to write (.png, .svg)")
    p.add_argument("--top", type=int, default=30, help="tensors to draw (default 30)")
    args = parser.parse_args(argv)
    try:
        if args.command == "summary":
            print_summary(args.file, args.top)
        else:
            plot(args.file, args.output, args.top)
    except BrokenPipeError:  # e.g. piped into head
        return 0
    except (OSError, ValueError, KeyError) as e:
        print(f"hvdmx.timeline: cannot read {args.file}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
