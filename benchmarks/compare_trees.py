"""The headline's hvdmx figures from two checkouts in turn, at np=2 on this host: to
show that a change of layout changed no speed (docs/benchmarks.md, "Headline").

    python benchmarks/compare_trees.py --rounds 2 OLD_TREE NEW_TREE

Each tree must have its extension built in place (setup.py build_ext --inplace);
both run with this venv's Python and mpiexec. Prints each figure per round, then a
table with both trees' figures, round by round.
"""
import argparse
import json
import os
import subprocess
import sys

PY = sys.executable
MPIEXEC = os.path.join(os.path.dirname(PY), "mpiexec")

def sized(kind, size, iters):
    return [kind, "--min-bytes", size, "--max-bytes", size, "--iters", iters]


CMDS = [("4 B allreduce in place, us", sized("allreduce", "4", "2000"), "ip_us"),
        ("64 MiB allreduce in place busbw GB/s", sized("allreduce", "64M", "10"), "ip_busbw"),
        ("64 MiB allgather, us", sized("allgather", "64M", "10"), "oop_us"),
        ("64 MiB broadcast in place, us", sized("broadcast", "64M", "10"), "ip_us"),
        ("ResNet-50 set, ms", ["model", "--iters", "20"], "hvdmx_ms")]
parser = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("old")
parser.add_argument("new")
parser.add_argument("--rounds", type=int, default=2)
args = parser.parse_args()
TREES = {f"{os.path.basename(args.old)}": os.path.abspath(args.old),
         f"{os.path.basename(args.new)}": os.path.abspath(args.new)}
res = {(m, t): [] for m, *_ in CMDS for t in TREES}
for rnd in range(args.rounds):
    for t, tree in TREES.items():
        for m, args, key in CMDS:
            env = dict(os.environ, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1",
                       PYTHONPATH=tree)
            out = subprocess.run([MPIEXEC, "-n", "2", PY, "-m", "hvdmx.bench", *args, "--json"],
                                 cwd=tree, env=env, capture_output=True, text=True,
                                 timeout=600).stdout
            start = min(i for i in (out.find("["), out.find("{")) if i >= 0)
            data = json.loads(out[start:])
            row = data[0] if isinstance(data, list) else data
            res[(m, t)].append(row[key])
            print(f"round {rnd+1} {t} {m}: {row[key]:.4g}", flush=True)
print("\n| measure | " + " | ".join(TREES) + " |\n| --- | --- | --- |")
for m, *_ in CMDS:
    cells = [", ".join(f"{v:.3g}" for v in res[(m, t)]) for t in TREES]
    print(f"| {m} | " + " | ".join(cells) + " |")
