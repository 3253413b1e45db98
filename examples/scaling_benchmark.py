"""Scaling efficiency of data-parallel training with hvdmx on this machine.

    python examples/scaling_benchmark.py                  # resnet18_v1, 64x64, batch 32, np 2
    python examples/scaling_benchmark.py --np 4 --rounds 5 -- --model resnet50_v1

Runs examples/synthetic_benchmark.py (arguments after `--` go to it) in
interleaved rounds, each round in the same order:

- "1 process":     one rank alone (mpiexec -n 1);
- "N independent": N single-rank jobs started together, which share the
  machine but exchange nothing: the most N ranks can do here without any
  communication (cores, caches and memory bandwidth are shared);
- "N ranks in step": one job of N ranks that exchange no gradients but wait
  for each other after every batch (synthetic_benchmark.py --sync-only): what
  training in lockstep costs before any byte moves;
- "N ranks, hvdmx": one job of N ranks training data-parallel;
- "N ranks, Horovod" (with --horovod-python): the same job with horovod.mxnet,
  run by that Python and the mpiexec beside it (benchmarks/horovod/build.sh makes
  such an environment).

and prints a table of the median total images/sec of each over the rounds,
with the scaling efficiency (total / (N x one process)) and the ratio to the
independent processes, which is what the lockstep and hvdmx itself cost. Every job
gets OMP_NUM_THREADS=1 and MXNET_CPU_WORKER_NTHREADS=1 unless set.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TOTAL = re.compile(r"Total img/sec on (\d+) rank\(s\): ([\d.]+) \+-([\d.]+)")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Scaling efficiency of hvdmx: the synthetic benchmark at 1 rank, N "
                    "independent single-rank jobs side by side, and N ranks with hvdmx, "
                    "in interleaved rounds. Arguments after '--' go to "
                    "synthetic_benchmark.py.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--np", type=int, default=2, help="ranks of the data-parallel job")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds; each runs every row once")
    parser.add_argument("--mpiexec", default=os.path.join(os.path.dirname(sys.executable),
                                                          "mpiexec"),
                        help="the launcher (default: the one beside this Python)")
    parser.add_argument("--horovod-python", metavar="PYTHON",
                        help="also run the job with horovod.mxnet, by this interpreter "
                             "(one that has Horovod) and the mpiexec beside it")
    parser.add_argument("benchmark_args", nargs="*",
                        default=["--model", "resnet18_v1", "--image-size", "64",
                                 "--batch-size", "32"],
                        help="arguments for synthetic_benchmark.py, after '--'")
    args = parser.parse_args(argv)
    if args.np < 2:
        parser.error(f"--np must be >= 2 (got {args.np}): scaling compares N ranks with one")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1 (got {args.rounds})")
    if args.horovod_python and not os.access(args.horovod_python, os.X_OK):
        parser.error(f"--horovod-python {args.horovod_python!r} is not an executable file: "
                     "give the python of an environment with Horovod, e.g. the one "
                     "benchmarks/horovod/build.sh makes")
    return args


def launch(args, nranks, *extra, python=None):
    """Starts synthetic_benchmark.py under mpiexec -n nranks, with extra
    arguments; by `python` and the mpiexec beside it when given."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MXNET_CPU_WORKER_NTHREADS", "1")
    mpiexec = os.path.join(os.path.dirname(python), "mpiexec") if python else args.mpiexec
    command = [mpiexec, "-n", str(nranks), python or sys.executable,
               os.path.join(HERE, "synthetic_benchmark.py"), *args.benchmark_args, *extra]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def total_img_sec(process):
    """Waits for a benchmark job; returns its total images per second."""
    out, err = process.communicate()
    match = TOTAL.search(out)
    if process.returncode != 0 or match is None:
        raise SystemExit(f"synthetic_benchmark.py failed (exit {process.returncode}):\n"
                         f"{out}\n{err}")
    return float(match.group(2))


def main(argv=None):
    """Runs the rounds and prints the table; returns the medians by row."""
    args = parse_args(argv)
    n = args.np
    rows = {"1 process": [], f"{n} independent": [], f"{n} ranks in step": [],
            f"{n} ranks, hvdmx": []}
    if args.horovod_python:
        rows[f"{n} ranks, Horovod"] = []
    for r in range(args.rounds):
        values = [total_img_sec(launch(args, 1)),
                  sum(total_img_sec(p) for p in [launch(args, 1) for _ in range(n)]),
                  total_img_sec(launch(args, n, "--sync-only")),
                  total_img_sec(launch(args, n))]
        if args.horovod_python:
            values.append(total_img_sec(launch(args, n, "--horovod",
                                               python=args.horovod_python)))
        for row, value in zip(rows, values):
            rows[row].append(value)
        print(f"round {r + 1}/{args.rounds}: {', '.join(f'{v:.1f}' for v in values)} img/sec",
              flush=True)
    medians = {row: statistics.median(values) for row, values in rows.items()}
    one = medians["1 process"]
    independent = medians[f"{n} independent"]
    print(f"\nsynthetic_benchmark.py {' '.join(args.benchmark_args)}; medians of "
          f"{args.rounds} round(s)")
    print(f"{'run':>18} {'img/sec':>9} {'per rank':>9} {'scaling':>8} {'vs indep.':>9}")
    for row, total in medians.items():
        ranks = 1 if row == "1 process" else n
        print(f"{row:>18} {total:9.1f} {total / ranks:9.1f} {total / (ranks * one):8.2f} "
              f"{total / independent:9.2f}")
    return medians


if __name__ == "__main__":
    main()
