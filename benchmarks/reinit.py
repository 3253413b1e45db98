"""How long hvd.init() and a reset (hvd.shutdown() then hvd.init()) take, in
a job started with MPI and in one started without (hvdmxrun --no-mpi, the
rendezvous an elastic reset goes through): the "Start-up and reset" rows of
docs/benchmarks.md.

    python benchmarks/reinit.py --ranks 2,4,8 --resets 5

For each rank count runs one job a launch on this host; each rank times its
first init and then `--resets` resets, each followed by a 4-byte allreduce
(the first collective of the new job). Prints, per launch and rank count,
the first init and the median reset as rank 0 measured them (the slowest
rank's time: every rank waits for the last at the end of init).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
ENV = dict(os.environ, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1", PYTHONPATH=REPO)

JOB = r"""
import json, sys, time
import mxnet as mx
import hvdmx as hvd
resets = int(sys.argv[1])
t = time.perf_counter(); hvd.init(); first = time.perf_counter() - t
hvd.allreduce(mx.nd.ones((1,)), name="warm").wait_to_read()
times = []
for i in range(resets):
    hvd.barrier()
    t = time.perf_counter()
    hvd.shutdown(); hvd.init()
    hvd.allreduce(mx.nd.ones((1,)), name="after").wait_to_read()
    times.append(time.perf_counter() - t)
slowest = hvd.allgather_object((first, times))
if hvd.rank() == 0:
    print("RESULT " + json.dumps({"first": max(s[0] for s in slowest),
                                  "resets": [max(s[1][i] for s in slowest)
                                             for i in range(resets)]}), flush=True)
"""


def run(launch, ranks, resets):
    if launch == "mpiexec":
        cmd = [os.path.join(BIN, "mpiexec"), "-n", str(ranks)]
    else:
        cmd = [os.path.join(BIN, "hvdmxrun"), "--no-mpi", "-np", str(ranks)]
    result = subprocess.run(cmd + [sys.executable, "-c", JOB, str(resets)], env=ENV,
                            capture_output=True, text=True, timeout=600)
    line = [x for x in result.stdout.splitlines() if "RESULT " in x]
    if result.returncode != 0 or not line:
        sys.exit(f"{launch} -n {ranks} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return json.loads(line[0].split("RESULT ", 1)[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--resets", type=int, default=5)
    args = parser.parse_args()
    counts = [int(x) for x in args.ranks.split(",")]
    print(f"# hvd.init() and a reset (shutdown + init + a 4 B allreduce), this host; "
          f"median of {args.resets} resets; seconds, the slowest rank's")
    print(f"{'launch':<18} {'ranks':>5} {'first init':>10} {'reset':>8}")
    for n in counts:
        for launch in ("mpiexec", "hvdmxrun --no-mpi"):
            got = run(launch, n, args.resets)
            print(f"{launch:<18} {n:>5} {got['first']:>10.3f} "
                  f"{statistics.median(got['resets']):>8.3f}", flush=True)


if __name__ == "__main__":
    main()
