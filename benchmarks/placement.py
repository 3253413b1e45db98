"""Times one collective in a loop and shows which CPUs each rank's busy
threads ran on meanwhile, to see how thread placement moves small-message
latency (Note [Binding a rank's threads to one CPU] in
csrc/hvdmx/platform/cpu_binding.h). Placement is settled per launch, so compare
launches, e.g. alternating:

    for i in 1 2 3 4 5 6 7 8; do for m in none auto; do
      OMP_NUM_THREADS=1 MXNET_CPU_WORKER_NTHREADS=1 HVDMX_CPU_BIND=$m \\
        .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/placement.py --label $m
    done; done

Prints one line per launch: the label, microseconds per call (mean over
--iters, slowest rank), then for each rank every thread that used CPU time
while timing, as name@CPUs: the CPU it was last seen on in each of 8 samples
taken 100 ms apart (fewer if the loop ends sooner).
"""
import argparse
import os
import threading
import time

import mxnet as mx

import hvdmx as hvd

CALLS = {
    "allgather": lambda x: hvd.allgather(x, name="placement"),
    "alltoall": lambda x: hvd.alltoall(x, name="placement"),
    "allreduce": lambda x: hvd.allreduce(x, name="placement"),
    "broadcast": lambda x: hvd.broadcast(x, 0, name="placement"),
}


def threads() -> dict:
    """tid -> (name, CPU ticks used, CPU it last ran on) for this process."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[tid] = (name, int(fields[11]) + int(fields[12]), int(fields[36]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=sorted(CALLS), default="allgather")
    parser.add_argument("--bytes", type=int, default=512 * 1024,
                        help="each rank's input in bytes (default 512 KiB)")
    parser.add_argument("--iters", type=int, default=8000, help="timed calls (default 8000)")
    parser.add_argument("--label", default="", help="printed first on the line")
    args = parser.parse_args()

    hvd.init()
    x = mx.nd.ones((max(hvd.size(), args.bytes // 4 // hvd.size() * hvd.size()),))
    call = CALLS[args.kind]
    for _ in range(100):
        call(x).wait_to_read()
    samples = []

    def sample():
        for _ in range(8):
            time.sleep(0.1)
            samples.append(threads())

    sampler = threading.Thread(target=sample)
    before = threads()
    sampler.start()
    start = time.perf_counter()
    for _ in range(args.iters):
        call(x).wait_to_read()
    elapsed = time.perf_counter() - start
    sampler.join()
    after = threads()
    busy = []
    for tid, (name, ticks, _) in before.items():
        if tid in after and after[tid][1] - ticks > 5:
            cpus = ",".join(str(s[tid][2]) for s in samples if tid in s)
            busy.append(f"{name}@{cpus}")
    per_rank = hvd.allgather_object((hvd.rank(), elapsed / args.iters * 1e6, busy))
    if hvd.rank() == 0:
        slowest = max(us for _, us, _ in per_rank)
        ranks = " | ".join(f"rank {r}: " + ", ".join(b) for r, _, b in per_rank)
        print(f"{args.label} {args.kind} {args.bytes} B: {slowest:.1f} us | {ranks}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
