"""Gradient compression across two test hosts with a capped link: the
"Gradient compression across hosts" table of docs/benchmarks.md.

    python benchmarks/compression_hosts.py               # 1 Gbit/s cap, 2 hosts x 1 rank
    python benchmarks/compression_hosts.py --per-host 2 --schemes none,onebit,local4,hlocal4

Makes two test hosts (tools/testhosts.py) whose links are capped at --rate, and
for each scheme (none: float32 gradients, fp16, onebit; localH: local SGD, the
parameters averaged every H steps; hlocalH: hierarchical local SGD, gradients
averaged inside each host every step; easgdH: elastic averaging every H steps,
beta 0.9) runs, in interleaved rounds:

- examples/synthetic_benchmark.py (--model, synthetic images) twice, with a short
  and a long run; the bytes each host sent over its link in the long run minus
  the short one, divided by the extra batches, is what one training step sends
  (start-up, the first broadcast of the parameters and warm-up cancel out); the
  long run's ms per batch on rank 0 is the step time;
- once, examples/mnist_gluon.py with that scheme (the digits example): its
  final test accuracy.

Prints one table: medians over the rounds.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import testhosts  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1",
       "MXNET_ENGINE_TYPE": "ThreadedEnginePerDevice", "PYTHONPATH": REPO}
MS = re.compile(r"\(([\d.]+) ms per batch on rank 0\)")
ACCURACY = re.compile(r"test accuracy ([\d.]+)")


LOCAL = re.compile(r"(h?)(local|easgd)(\d+)$")


def scheme_flags(scheme):
    """The flags of examples/synthetic_benchmark.py and mnist_gluon.py for a scheme."""
    if scheme in ("none", "fp16", "onebit"):
        return ["--compression", scheme]
    local = LOCAL.match(scheme)
    if not local or int(local[3]) < 2:
        raise SystemExit(f"compression_hosts.py: unknown scheme {scheme!r}; give none, fp16, "
                         "onebit, localH, hlocalH or easgdH (H >= 2)")
    return (["--local-sgd-steps", local[3]] + (["--hierarchical-local-sgd"] if local[1] else [])
            + (["--easgd-beta", "0.9"] if local[2] == "easgd" else []))


def run(th, per_host, argv, timeout):
    cmd = th.mpiexec(per_host, argv)
    result = subprocess.run(cmd, env=th.env(dict(os.environ, **ENV)), cwd=REPO,
                            capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise SystemExit(f"compression_hosts.py: {' '.join(argv)} failed:\n"
                         f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return result.stdout + result.stderr


def sent(th, hosts):
    return sum(th.counters(h)["tx_bytes"] for h in hosts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="1gbit", help="link cap (tc rate)")
    parser.add_argument("--per-host", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="resnet18_v1")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--batches", default="4,12", help="short and long run, in batches")
    parser.add_argument("--schemes", "--compressions", default="none,fp16,onebit",
                        help="comma-separated: none, fp16, onebit, localH, hlocalH, easgdH")
    parser.add_argument("--digits-epochs", type=int, default=0,
                        help="epochs of the digits example (0: its default)")
    parser.add_argument("--timeout", type=int, default=1200)
    args = parser.parse_args(argv)
    reason = testhosts.unavailable()
    if reason:
        raise SystemExit(f"compression_hosts.py: {reason}")
    short, long_ = (int(b) for b in args.batches.split(","))
    kinds = args.schemes.split(",")
    for kind in kinds:
        scheme_flags(kind)  # an unknown one stops here, before any host is made
    per_host = [args.per_host, args.per_host]
    bytes_per_step = {k: [] for k in kinds}
    step_ms = {k: [] for k in kinds}
    accuracy = {k: [] for k in kinds}
    with testhosts.hosts(2, prefix="hvdmx-cmp", rate=args.rate) as th:
        hosts = th.hosts[:2]
        for r in range(args.rounds):
            for kind in kinds:
                base = [sys.executable, "examples/synthetic_benchmark.py", "--model",
                        args.model, "--image-size", str(args.image_size), "--batch-size",
                        str(args.batch_size), "--num-classes", "10", "--num-warmup-batches",
                        "2", "--num-batches-per-iter", "1"] + scheme_flags(kind) + [
                        "--num-iters"]
                moved = []
                for batches in (short, long_):
                    before = sent(th, hosts)
                    out = run(th, per_host, base + [str(batches)], args.timeout)
                    moved.append(sent(th, hosts) - before)
                # Bytes sent per step by each rank, over the link.
                per_rank = (moved[1] - moved[0]) / (long_ - short) / sum(per_host)
                bytes_per_step[kind].append(per_rank)
                times = [float(m) for m in MS.findall(out)]
                step_ms[kind].append(statistics.median(times))
                print(f"# round {r + 1} {kind}: {per_rank / 1e6:.2f} MB sent per rank and "
                      f"step, {statistics.median(times):.1f} ms per step", flush=True)
                if r == 0:
                    digits = [sys.executable, "examples/mnist_gluon.py"] + scheme_flags(kind)
                    if args.digits_epochs:
                        digits += ["--epochs", str(args.digits_epochs)]
                    out = run(th, per_host, digits, args.timeout)
                    found = ACCURACY.findall(out)
                    accuracy[kind].append(float(found[-1]) if found else float("nan"))
                    print(f"# digits with {kind}: test accuracy {accuracy[kind][-1]}",
                          flush=True)
    base = statistics.median(bytes_per_step["none"]) if "none" in kinds else None
    print(f"\n{args.model} (synthetic {args.image_size}x{args.image_size}, batch "
          f"{args.batch_size} per rank), 2 hosts x {args.per_host}, links capped at "
          f"{args.rate}; medians of {args.rounds} interleaved rounds\n")
    print("| scheme | MB sent per rank and step | fewer than float32 | ms per step | "
          "digits test accuracy |")
    print("| --- | --- | --- | --- | --- |")
    for kind in kinds:
        b = statistics.median(bytes_per_step[kind])
        ratio = f"{base / b:.1f}x" if base else "-"
        print(f"| {kind} | {b / 1e6:.2f} | {ratio} | {statistics.median(step_ms[kind]):.1f} | "
              f"{accuracy[kind][0]:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
