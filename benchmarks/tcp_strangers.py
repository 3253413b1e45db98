"""What strangers at the ranks' ports cost a job's start: the "Strangers at the door"
table of docs/benchmarks.md.

    python benchmarks/tcp_strangers.py --rounds 3

Makes three test hosts on this machine (tools/testhosts.py) and starts a job of one
rank on each of the first two (hvdmx's TCP transport between them). While the ranks
wait between their address exchange and their links (HVDMX_TESTING_LINK_DELAY_SECONDS,
the same in every variant), the third host holds --count connections to each listening
port of theirs (tools/strangers.py): none, silent ones, ones that send garbage, or ones
that send a forged hello. Each job prints, per rank, the seconds from the start of the
script to the first allreduce's result; the table gives the median over the rounds of
the slower rank's time, and what the strangers added to it against no strangers, and
against their program running on the third host without connecting ("idle": what the
strangers cost the machine, two cores shared by three hosts, rather than the
protocol), in the same rounds. Variants run interleaved, round by round, so that the machine's drift
falls on all of them alike.
"""
import argparse
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import strangers  # noqa: E402
import testhosts  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1",
       "MXNET_ENGINE_TYPE": "ThreadedEnginePerDevice", "PYTHONPATH": REPO}
JOB = """
import sys, time
t0 = time.perf_counter()
import numpy as np, mxnet as mx, hvdmx as hvd
hvd.init()
x = mx.nd.array(np.arange(10, dtype=np.float32) + hvd.rank())
out = hvd.allreduce(x, op=hvd.Sum, name="first").asnumpy()
assert (out == np.arange(10) * hvd.size() + sum(range(hvd.size()))).all()
sys.stdout.write(f"first {time.perf_counter() - t0:.4f}\\n")
"""


def one_job(th, mode, count, delay):
    env = th.env(dict(os.environ, **ENV, HVDMX_TESTING_LINK_DELAY_SECONDS=str(delay)))
    proc = subprocess.Popen(th.mpiexec([1, 1], [sys.executable, "-c", JOB]), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    # "idle": the strangers' program runs on the third host but connects to
    # nothing, so that what the strangers cost the machine (two cores shared
    # by three hosts) is told apart from what they cost the protocol.
    attacks = [] if mode == "none" else strangers.attack_each_comm(
        th, proc, "silent" if mode == "idle" else mode, 0 if mode == "idle" else count,
        hold=delay + 3)
    out, err = proc.communicate(timeout=300)
    held = strangers.held(attacks)
    times = [float(line.split()[1]) for line in out.splitlines() if line.startswith("first ")]
    if proc.returncode != 0 or len(times) != 2:
        raise SystemExit(f"{mode}: the job failed (exit {proc.returncode}):\n{out}\n{err}")
    return max(times), held


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=100,
                        help="connections per listening port (default 100)")
    parser.add_argument("--delay", type=float, default=1.0,
                        help="HVDMX_TESTING_LINK_DELAY_SECONDS in every variant (default 1)")
    args = parser.parse_args(argv)
    reason = testhosts.unavailable()
    if reason:
        raise SystemExit(f"tcp_strangers: no test hosts here: {reason}")
    modes = ["none", "idle", "silent", "garbage", "forged"]
    times = {m: [] for m in modes}
    held = {m: [] for m in modes}
    with testhosts.hosts(3) as th:
        for _ in range(args.rounds):
            for mode in modes:
                t, h = one_job(th, mode, args.count, args.delay)
                times[mode].append(t)
                held[mode].append(h)
    base = statistics.median(times["none"])
    idle = statistics.median(times["idle"])
    print(f"# 2 hosts x 1 rank, strangers on a third host, {args.count} connections per "
          f"listening port, link delay {args.delay} s, median of {args.rounds} rounds")
    print(f"{'strangers':>10} {'held':>6} {'first collective (s)':>21} {'added (s)':>10} "
          f"{'added vs idle (s)':>18}")
    for mode in modes:
        t = statistics.median(times[mode])
        print(f"{mode:>10} {int(statistics.median(held[mode])):>6} {t:>21.3f} "
              f"{t - base:>10.3f} {t - idle:>18.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
