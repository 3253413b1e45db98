"""Elastic training's costs across test hosts: the "Elastic training" table of
docs/benchmarks.md (issue 49's targets).

    python benchmarks/elastic.py [--rounds 2] [--epochs 8]

Makes three test hosts (tools/testhosts.py) and runs, from the first, one
rank a host, in interleaved rounds:

- mnist --no-mpi: examples/mnist_gluon.py under hvdmxrun --no-mpi (the same
  launch, no elastic state);
- elastic: examples/elastic_mnist.py under hvdmxrun -np 3 --min-np 2, no
  failure (the cost of hvd.elastic.run and of its commits);
- elastic, a host lost: the same, with the third host's processes killed
  (SIGKILL) as soon as epoch 1 has ended; the job goes on at two ranks.

For each: the training time the program prints, the test accuracy, the size
it ended at, and for the lost host the time hvdmxrun reports from the
failure to the job's state restored in the new generation ("resumed at size
2 after X s"). Medians over the rounds.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import testhosts  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1",
       "MXNET_ENGINE_TYPE": "ThreadedEnginePerDevice", "PYTHONPATH": REPO}
PYTHON = sys.executable


def run(th, flags, program, kill_after=None, timeout=600):
    """(exit code, output, seconds) of hvdmxrun in the first host; with
    kill_after (a regex), the third host's processes of the job are killed
    when a line matches it."""
    marker = f"hvdmx-bench-{os.getpid()}-{time.monotonic_ns()}"
    argv = [PYTHON, "-m", "hvdmx.run", *flags, "--ssh-exec", th.launcher, PYTHON, *program]
    env = th.env(dict(os.environ, **ENV, HVDMX_BENCH_MARKER=marker))
    started = time.monotonic()
    proc = subprocess.Popen(th.command(th.hosts[0], argv), cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    lines = []
    killed = threading.Event()
    for line in proc.stdout:
        lines.append(line)
        if kill_after and not killed.is_set() and re.search(kill_after, line):
            kill_in(th.hosts[2], marker)
            killed.set()
        if time.monotonic() - started > timeout:
            th.kill_all()
            break
    proc.wait()
    return proc.returncode, "".join(lines), time.monotonic() - started


def kill_in(host, marker):
    pids = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True)
    for pid in pids.stdout.split():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"HVDMX_BENCH_MARKER={marker}".encode() in f.read().split(b"\0"):
                    os.kill(int(pid), 9)
        except OSError:
            pass


def parse(out):
    found = re.search(r"test accuracy (\d\.\d+) \(\d+/\d+\) after \d+ epochs; training took "
                      r"(\d+\.\d) s(?:, ending)? on (\d+) ranks", out)
    resumed = re.search(r"resumed at size \d+ after (\d+\.\d) s", out)
    return (float(found.group(1)) if found else None, float(found.group(2)) if found else None,
            int(found.group(3)) if found else None,
            float(resumed.group(1)) if resumed else None)


def _median(rows, i):
    values = [r[i] for r in rows if r[i] is not None]
    return statistics.median(values) if values else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    reason = testhosts.unavailable()
    if reason:
        sys.exit(f"benchmarks/elastic.py: {reason}")
    epochs = ["--epochs", str(args.epochs)]
    with testhosts.hosts(3, prefix="hvdmx-benchel") as th:
        h = th.hosts
        three = ["-H", f"{h[0]}:1,{h[1]}:1,{h[2]}:1"]
        cases = {
            "mnist --no-mpi": (["--no-mpi", "-np", "3", *three],
                               ["examples/mnist_gluon.py", *epochs], None),
            "elastic": (["-np", "3", "--min-np", "2", *three],
                        ["examples/elastic_mnist.py", *epochs], None),
            "elastic, a host lost": (["-np", "3", "--min-np", "2", *three],
                                     ["examples/elastic_mnist.py", *epochs],
                                     r"Epoch\[1\] Time cost"),
        }
        results = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, (flags, program, kill_after) in cases.items():
                code, out, wall = run(th, flags, program, kill_after)
                if code != 0:
                    sys.exit(f"{name}: exit {code}\n{out[-3000:]}")
                results[name].append(parse(out) + (wall,))
    print(f"# elastic training across 3 test hosts x 1 rank, digits, {args.epochs} epochs; "
          f"medians of {args.rounds} rounds")
    print(f"{'case':<24} {'end size':>8} {'train s':>8} {'wall s':>7} {'accuracy':>8} "
          f"{'resumed after s':>15}")
    for name, rows in results.items():
        acc, train, size, resumed, wall = (_median(rows, i) for i in range(5))
        resumed_text = "-" if resumed is None else f"{resumed:.1f}"
        print(f"{name:<24} {int(size):>8} {train:>8.1f} {wall:>7.1f} {acc:>8.4f} "
              f"{resumed_text:>15}")


if __name__ == "__main__":
    main()
