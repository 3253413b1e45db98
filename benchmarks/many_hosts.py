"""hvdmx across hosts beside MPI and Horovod: the "Many hosts" table of
docs/benchmarks.md.

    python benchmarks/many_hosts.py --horovod-python /tmp/hvdmx-horovod/venv/bin/python

Makes two test hosts on this machine (tools/testhosts.py: network namespaces joined
by a bridge, MPI's bytes over TCP with UCX_TLS=self,tcp), without and then with a
bandwidth cap on each host's link (--caps), and at 1 and 2 ranks per host
(--per-host) runs one program, benchmarks/horovod/collectives_job.py, under each
variant in turn, in interleaved rounds:

- horovod: Horovod 0.28.1 (--horovod-python, from tools/horovod/build.sh), with the
  mpiexec beside that Python;
- hvdmx: hvdmx through `python -m hvdmx.as_horovod` with its defaults (over hosts:
  its own TCP transport);
- hvdmx-mpi: the same with HVDMX_TRANSPORT=mpi, hvdmx's path before its TCP transport;
- hvdmx-hier: the same with HVDMX_HIERARCHICAL_ALLREDUCE=1 (at 2 ranks per host);
- hvdmx-noround: hvdmx's defaults but HVDMX_ROUND_ALLREDUCE_BYTES=0, small
  allreduces taking their own exchange after the negotiation round (Note [Small
  tensors in the round]).

--variants picks some of them.

Each job also times MXNet's engine round trip (an in-place op on a 1-element array,
pushed and waited for) and MPI_Allreduce (mpi4py) on the same bytes, and, for the model,
MPI_Allreduce per tensor and MPI_Iallreduce of all tensors then MPI_Waitall; the MPI
column is the median over every job of the layout. Prints one table per cap: medians
over the rounds, times in microseconds (ms for the model), and busbw in GB/s
(2(n-1)/n x bytes / time) for the largest size; under the smallest size, each
variant's engine round trip and the small-message target of issue 48, that round
trip plus twice MPI's time.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import testhosts  # noqa: E402

JOB = os.path.join(REPO, "benchmarks", "horovod", "collectives_job.py")
ENV = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1",
       "MXNET_ENGINE_TYPE": "ThreadedEnginePerDevice", "PYTHONPATH": REPO}


VARIANTS = ["horovod", "hvdmx", "hvdmx-noround", "hvdmx-mpi", "hvdmx-hier"]


def variants(horovod_python, per_host, chosen):
    out = {}
    if horovod_python:
        out["horovod"] = ([horovod_python, JOB], {},
                          os.path.join(os.path.dirname(horovod_python), "mpiexec"))
    hvdmx = [sys.executable, "-m", "hvdmx.as_horovod", JOB]
    out["hvdmx"] = (hvdmx, {}, None)
    out["hvdmx-noround"] = (hvdmx, {"HVDMX_ROUND_ALLREDUCE_BYTES": "0"}, None)
    out["hvdmx-mpi"] = (hvdmx, {"HVDMX_TRANSPORT": "mpi"}, None)
    if per_host > 1:
        out["hvdmx-hier"] = (hvdmx, {"HVDMX_HIERARCHICAL_ALLREDUCE": "1"}, None)
    return {name: job for name, job in out.items() if name in chosen}


def run_job(th, per_host, argv, env, mpiexec, timeout):
    cmd = th.mpiexec(per_host, argv, mpiexec=mpiexec)
    result = subprocess.run(cmd, env=th.env(dict(os.environ, **ENV, **env)), cwd=REPO,
                            capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise SystemExit(f"many_hosts.py: {' '.join(cmd)} failed ({result.returncode}):\n"
                         f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return json.loads(lines[-1])


def med(values):
    return statistics.median(values) if values else float("nan")


def table(results, sizes, names, per_hosts):
    """Rows: layout x measure; columns: MPI, then each variant."""
    head = ["layout", "measure", "MPI"] + names
    rows = []
    for per_host in per_hosts:
        jobs = results[per_host]  # name -> [job output per round]
        n = 2 * per_host
        layout = f"2 hosts x {per_host}"
        for size in sizes:
            mpi = med([j["sizes"][str(size)]["mpi_us"] for v in jobs.values() for j in v])
            cells = [med([j["sizes"][str(size)]["hvd_us"] for j in jobs[name]])
                     if name in jobs else float("nan") for name in names]
            if size == sizes[-1] and size >= 1 << 20:
                factor = size * 2 * (n - 1) / n / 1e9
                rows.append([layout, f"{size} B busbw GB/s", f"{factor / (mpi * 1e-6):.3f}"] +
                            [f"{factor / (c * 1e-6):.3f}" for c in cells])
            else:
                rows.append([layout, f"{size} B us", f"{mpi:.1f}"] + [f"{c:.1f}" for c in cells])
            if size == sizes[0]:
                engine = [med([j["engine_us"] for j in jobs[name]]) if name in jobs
                          else float("nan") for name in names]
                rows.append([layout, "  engine round trip us", ""] +
                            [f"{e:.1f}" for e in engine])
                rows.append([layout, f"  target: engine + 2 x MPI({size} B)", ""] +
                            [f"{e + 2 * mpi:.1f}" for e in engine])
        models = [j["model"] for v in jobs.values() for j in v if j["model"]]
        if models:
            per_tensor = med([m["mpi_per_tensor_ms"] for m in models])
            iall = med([m["mpi_iallreduce_ms"] for m in models])
            cells = [med([j["model"]["hvd_ms"] for j in jobs[name]]) if name in jobs
                     else float("nan") for name in names]
            rows.append([layout, f"{models[0]['name']} set ms (MPI per tensor)",
                         f"{per_tensor:.1f}"] + [f"{c:.1f}" for c in cells])
            rows.append([layout, "  (MPI Iallreduce+Waitall)", f"{iall:.1f}"] +
                        [""] * len(names))
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(head, widths)) + " |",
             "| " + " | ".join("-" * w for w in widths) + " |"]
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"
              for r in rows]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--horovod-python", default="", help="Python with horovod.mxnet")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--per-host", default="1,2", help="ranks per host, comma-separated")
    parser.add_argument("--caps", default="none,1gbit",
                        help="link caps (tc rates; none: no cap), comma-separated")
    parser.add_argument("--sizes", default="4,256K,64M")
    parser.add_argument("--model", default="resnet50_v1", help="'' for none")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per job")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated, of " + ", ".join(VARIANTS))
    args = parser.parse_args(argv)
    reason = testhosts.unavailable()
    if reason:
        raise SystemExit(f"many_hosts.py: {reason}")
    sizes = [int(s[:-1]) * {"K": 1 << 10, "M": 1 << 20}[s[-1]] if s[-1] in "KM" else int(s)
             for s in args.sizes.split(",")]
    per_hosts = [int(p) for p in args.per_host.split(",")]
    for cap in args.caps.split(","):
        rate = None if cap == "none" else cap
        results = {}
        with testhosts.hosts(2, prefix="hvdmx-mhb", rate=rate) as th:
            for per_host in per_hosts:
                jobs = variants(args.horovod_python, per_host, args.variants.split(","))
                results[per_host] = {name: [] for name in jobs}
                for r in range(args.rounds):
                    for name, (argv, env, mpiexec) in jobs.items():
                        job = [*argv, "--sizes", args.sizes]
                        if args.model:
                            job += ["--model", args.model]
                        out = run_job(th, [per_host, per_host], job, env, mpiexec, args.timeout)
                        results[per_host][name].append(out)
                        print(f"# cap {cap}, 2x{per_host}, round {r + 1}, {name}: "
                              f"{json.dumps(out)}", flush=True)
        names = [n for n in VARIANTS if any(n in results[p] for p in per_hosts)]
        print(f"\n## link cap: {cap}; medians of {args.rounds} interleaved rounds\n")
        print(table(results, sizes, names, per_hosts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
