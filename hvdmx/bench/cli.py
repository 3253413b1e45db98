"""The command line of ``python -m hvdmx.bench`` (its --help is the
package's docstring), and the idle measurement."""
from __future__ import annotations

import argparse
import json
import resource
import time

from hvdmx import bench
from hvdmx.bench.collectives import BUS_FACTOR, DTYPES, MPI_CALL, run_collective
from hvdmx.bench.model import run_model
from hvdmx.bench.scale import run_scale
from hvdmx.bench.tables import plot_rows, print_collective, print_idle, print_model
from hvdmx.bench.timing import load_mpi, parse_size
from hvdmx.runner.flags import _number


def run_idle(args) -> list:
    import hvdmx as hvd
    hvd.init()
    load_mpi().COMM_WORLD.Barrier()
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    time.sleep(args.seconds)
    after = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.perf_counter() - start
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rows = load_mpi().COMM_WORLD.gather({"rank": hvd.rank(), "cpu_s": cpu, "wall_s": wall,
                                     "core_percent": 100 * cpu / wall}, root=0)
    hvd.shutdown()
    return rows or []


def _rank_list(text: str) -> list:
    try:
        ranks = [int(v) for v in text.split(",")]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError(
            f"expected rank counts like 2,16,256 (each at least 1), got {text!r}")
    return ranks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdmx.bench", description=bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for kind in BUS_FACTOR:
        ar = sub.add_parser(kind, help=f"hvdmx {kind} beside {MPI_CALL[kind]}")
        ar.add_argument("--min-bytes", type=parse_size, default=4,
                        help="smallest size (4, 1K, 1M)")
        ar.add_argument("--max-bytes", type=parse_size, default=64 << 20, help="largest size")
        ar.add_argument("--factor", type=int, default=4, help="size multiplier between rows")
        ar.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
        ar.add_argument("--iters", type=int, default=0, help="timed iterations (0: by size)")
        ar.add_argument("--rounds", type=_number("rounds", integer=True, minimum=1), default=1,
                        help="time every column this many times, in turn, and print each "
                             "one's median (default: 1)")
        ar.add_argument("--vs-mpi", action=argparse.BooleanOptionalAction, default=True,
                        help=f"also time {MPI_CALL[kind]} in the same run (default: on)")
        ar.add_argument("--json", action="store_true", help="print JSON instead of a table")
        ar.add_argument("--plot", metavar="FILE", help="also draw busbw against size (matplotlib)")
        ar.add_argument("--mpi-memory", choices=["numpy", "mxnet"], default="numpy",
                        help="what MPI's buffers are: numpy arrays (which get huge pages "
                             "from 4 MiB up), or memory that MXNet allocated, like hvdmx's "
                             "(4 KiB pages unless the kernel or malloc give huge ones)")
        ar.add_argument("--unnamed", action="store_true",
                        help="call hvdmx without a name, so that every call is a new name "
                             "that misses the response cache, as in scripts that name "
                             "none (default: one name for all calls)")
        if kind == "allgather":
            ar.add_argument("--tensors", type=_number("tensors", integer=True, minimum=1),
                            default=1, metavar="K",
                            help="cut each rank's part into K tensors: one grouped_allgather "
                                 "beside K MPI_Allgather calls (default: 1, a plain allgather)")
        if kind == "alltoall":
            ar.add_argument("--splits", action="store_true",
                            help="pass the splits as a list, so that each call also returns "
                                 "the received splits (default: no splits, an equal split)")
    model = sub.add_parser("model", help="allreduce a model-zoo network's gradients per "
                                "iteration, beside MPI and the memory floor")
    model.add_argument("--model", default="resnet50_v1", help="mx.gluon.model_zoo.vision name")
    model.add_argument("--iters", type=int, default=20, help="timed iterations")
    model.add_argument("--rounds", type=_number("rounds", integer=True, minimum=1), default=1,
                       help="time every column this many times, in turn, and print each "
                            "one's median (default: 1)")
    model.add_argument("--warmup", type=int, default=None,
                       help="untimed iterations first (default: iters/10, at least 2); "
                            "with HVDMX_AUTOTUNE=1, give it time to tune")
    model.add_argument("--vs-mpi", action=argparse.BooleanOptionalAction, default=True,
                       help="also time MPI_Allreduce per tensor and fused, with and without "
                            "the copies into the fused buffer (default: on)")
    model.add_argument("--adasum", action="store_true",
                       help="also time the gradient set with op=hvd.Adasum, as "
                            "DistributedTrainer(..., op=hvd.Adasum) reduces it, beside "
                            "Average (default: off)")
    model.add_argument("--json", action="store_true")
    scale = sub.add_parser("scale", help="N ranks of the core as threads of this process "
                           "(no mpiexec): the negotiation's messages, latencies and time at "
                           "scale, and a gradient set's step")
    scale.add_argument("--ranks", type=_rank_list, default=[2, 4, 8, 16, 32, 64, 128, 256],
                       help="rank counts, comma-separated (default: 2,4,...,256)")
    scale.add_argument("--per-host", type=_number("per-host", integer=True, minimum=1),
                       default=16, help="ranks a simulated host (default: 16, or all ranks "
                                        "when fewer); must divide every rank count")
    scale.add_argument("--scheme", choices=["tree", "flat", "both"], default="both",
                       help="negotiate through one leader a host (tree, what hvdmx does when "
                            "hosts have equal rank counts), over every rank alike (flat), or "
                            "both side by side (default)")
    scale.add_argument("--rounds", type=_number("rounds", integer=True, minimum=1), default=20,
                       help="cached rounds timed (default: 20)")
    scale.add_argument("--requests", type=_number("requests", integer=True, minimum=1),
                       default=None, help="tensors a round (default: the model's "
                                          "gradients, 161 without one)")
    scale.add_argument("--model", default="resnet50_v1",
                       help="model-zoo network whose gradient set a step allreduces, or "
                            "'none' (default: resnet50_v1; skipped where the ranks' copies "
                            "would not fit in memory)")
    scale.add_argument("--steps", type=_number("steps", integer=True, minimum=1), default=2,
                       help="steps timed (default: 2)")
    scale.add_argument("--json", action="store_true", help="also print the rows as JSON")
    idle = sub.add_parser("idle", help="CPU used by an initialized, idle process")
    idle.add_argument("--seconds", type=float, default=5.0)
    idle.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "scale":
        args.schemes = ["tree", "flat"] if args.scheme == "both" else [args.scheme]
        rows = run_scale(args)
        if args.json:
            print(json.dumps(rows, indent=1))
        return 1 if any(r["step_ms"] is not None and not r["step_correct"] for r in rows) else 0

    MPI = load_mpi()
    rank, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if args.command in BUS_FACTOR:
        rows = run_collective(args)
        if rank == 0:
            if args.json:
                print(json.dumps(rows, indent=1))
            else:
                print_collective(rows, n, args.command)
            if args.plot:
                plot_rows(rows, args.command, n, args.plot)
        return 1 if any(r["hvdmx_wrong"] or r["mpi_wrong"] for r in rows) else 0
    if args.command == "model":
        row = run_model(args)
        if rank == 0:
            if args.json:
                print(json.dumps(row, indent=1))
            else:
                print_model(row, n)
        return 0
    rows = run_idle(args)
    if rank == 0:
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            print_idle(rows, args.seconds)
    return 0

