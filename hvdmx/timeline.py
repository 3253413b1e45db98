"""Reads the timeline hvdmx writes (``HVDMX_TIMELINE=file.json`` or
``hvd.start_timeline``): a Chrome trace with one row per tensor.

    python -m hvdmx.timeline summary file.json [--top 20]
    python -m hvdmx.timeline plot file.json -o timeline.png [--top 30]

``summary`` prints the time spent in each phase (NEGOTIATE, QUEUE,
MEMCPY_IN_FUSION_BUFFER, the collective, MEMCPY_OUT_FUSION_BUFFER) over all
tensors, then per tensor. ``plot`` draws the phases of the busiest tensors
against time (matplotlib). Open the file itself in chrome://tracing or
https://ui.perfetto.dev for the full picture.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from typing import Dict, List, Tuple

# Phase order in tables and plots; collectives not listed come after QUEUE.
_FIRST = ["NEGOTIATE", "QUEUE", "MEMCPY_IN_FUSION_BUFFER", "MEMCPY_IN_OUTPUT"]
_LAST = ["MEMCPY_OUT_FUSION_BUFFER"]


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
    middle = sorted(n for n in names if n not in _FIRST and n not in _LAST)
    return [n for n in _FIRST if n in names] + middle + [n for n in _LAST if n in names]


def summarize(rows: Dict[int, str], events: List[dict]):
    """Per phase: (count, total us); per tensor: {phase: total us}."""
    per_phase = collections.defaultdict(lambda: [0, 0])
    per_tensor = collections.defaultdict(lambda: collections.defaultdict(int))
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
    ranked = sorted(per_tensor.items(), key=lambda kv: -sum(kv[1].values()))[:top]
    width = max([len(name) for name, _ in ranked] + [6])
    short = {p: p.replace("MEMCPY_", "").replace("_FUSION_BUFFER", "")[:12] for p in phases}
    print(f"{'tensor':<{width}} " + " ".join(f"{short[p]:>12}" for p in phases))
    for name, times in ranked:
        print(f"{name:<{width}} " + " ".join(f"{times.get(p, 0) / 1e3:>12.3f}" for p in phases))


def plot(path: str, output: str, top: int) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("hvdmx.timeline plot needs matplotlib: pip install 'hvdmx[plot]' (or "
                         "pip install 'matplotlib<3.8' 'numpy<1.24')")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, events = load(path)
    _, per_tensor = summarize(rows, events)
    ranked = [name for name, _ in sorted(per_tensor.items(),
                                         key=lambda kv: -sum(kv[1].values()))[:top]]
    y_of = {name: i for i, name in enumerate(ranked)}
    phases = phase_order({e["name"] for e in events if e["ph"] == "X"})
    colors = {p: plt.cm.tab10(i % 10) for i, p in enumerate(phases)}
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(ranked) + 1.5))
    for e in events:
        name = rows.get(e["pid"])
        if name not in y_of:
            continue
        if e["ph"] == "X":
            ax.barh(y_of[name], max(e.get("dur", 0), 1) / 1e3, left=e["ts"] / 1e3, height=0.7,
                    color=colors[e["name"]])
        else:
            ax.plot([e["ts"] / 1e3], [y_of[name]], "k|", markersize=8)
    ax.set_yticks(range(len(ranked)))
    ax.set_yticklabels(ranked, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time since the timeline started (ms)")
    ax.set_title(f"hvdmx timeline: {path}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in phases]
    ax.legend(handles, phases, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
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
