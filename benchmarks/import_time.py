"""How long a process takes to import hvdmx, in two installations side by side
(issue 62: the binary wheel's venv against the development build): each
command is run 9 times after one warm-up run, as a whole `python -c` process
started from outside the checkout with OMP_NUM_THREADS=1, and the table gives
the median and the minimum of the wall time.

    python benchmarks/import_time.py --wheel /tmp/w/bin/python \\
        --dev .venv/bin/python [--dev-path .]
"""
import argparse
import os
import statistics
import subprocess
import tempfile
import time

COMMANDS = {
    "python -c pass": "pass",
    "import hvdmx": "import hvdmx",
    "import hvdmx as hvd; hvd.rank": "import hvdmx as hvd; hvd.rank",
}


def wall_times(python: str, code: str, env: dict, cwd: str, runs: int) -> list:
    subprocess.run([python, "-c", code], env=env, cwd=cwd, capture_output=True, check=True)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([python, "-c", code], env=env, cwd=cwd, capture_output=True, check=True)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", required=True, help="the Python of a venv with the wheel")
    parser.add_argument("--dev", required=True, help="the Python of the development venv")
    parser.add_argument("--dev-path", default=None,
                        help="PYTHONPATH for --dev (a checkout with `make build` done)")
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    base = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/")}
    setups = [("wheel", args.wheel, base),
              ("development", args.dev,
               dict(base, PYTHONPATH=os.path.abspath(args.dev_path)) if args.dev_path else base)]
    print(f"{'installation':12} | {'command':30} | median (ms) | min (ms)")
    with tempfile.TemporaryDirectory() as cwd:
        for label, python, env in setups:
            for name, code in COMMANDS.items():
                times = wall_times(python, code, env, cwd, args.runs)
                print(f"{label:12} | {name:30} | {statistics.median(times) * 1000:11.0f} | "
                      f"{min(times) * 1000:8.0f}")


if __name__ == "__main__":
    main()
