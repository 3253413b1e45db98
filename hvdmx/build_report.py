"""What ``hvdmxrun --check-build`` prints: which MPI this hvdmx was built
against and loads, and checklists of what it can do. hvdmx/runner/launch.py finds the
launcher and reports errors; this module only builds the text."""
from __future__ import annotations

import atexit
import os
import sys

from hvdmx._mpi import mpi_library


def _nccl_version(code: int) -> str:
    # NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9, major*1000 before.
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


_COLLECTIVES = ("allreduce", "grouped_allreduce", "broadcast", "allgather",
                "grouped_allgather", "alltoall", "reducescatter", "grouped_reducescatter",
                "barrier", "join", "broadcast_object", "allgather_object")


def _thread_support(MPI) -> str:
    """The report's MPI_THREAD_MULTIPLE line. Only a running MPI can say
    which thread level it provides: MPI starts here for the question, unless
    a PMIx launcher's variables are set (inside another job's step, where the
    mpich wheel's MPI_Init would abort)."""
    if not MPI.Is_initialized():
        if "PMIX_NAMESPACE" in os.environ:
            return ("[?] MPI_THREAD_MULTIPLE (not checked: PMIX_NAMESPACE is set, and MPI "
                    "is not started inside another job's step)")
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        atexit.register(MPI.Finalize)
    multiple = MPI.Query_thread() == MPI.THREAD_MULTIPLE
    return f"{'[x]' if multiple else '[ ]'} MPI_THREAD_MULTIPLE"


def build_report(launcher_line: str) -> str:
    """What this hvdmx can do, as a checklist: [x] available, [ ] not."""
    import mxnet as mx

    import hvdmx
    from hvdmx import _core
    from hvdmx._mpi import NoMpiError, load_mpi

    def box(flag: bool) -> str:
        return "[x]" if flag else "[ ]"

    nccl = _core.nccl_built()
    try:
        MPI = load_mpi()
    except NoMpiError as e:  # no MPI here: jobs run under hvdmxrun --no-mpi only
        MPI, why = None, str(e)
    if MPI is not None:
        import mpi4py
        mpi_lines = [
            f"    compiled against  {_core.mpi_vendor()}",
            f"    library loaded    {mpi_library(MPI)}",
            f"    launcher          {launcher_line}",
            f"    {_thread_support(MPI)}",
        ]
        loaded = f"mpi4py {mpi4py.__version__}"
    else:
        mpi_lines = [
            f"    none loaded       {why}",
            f"    launcher          {launcher_line}",
            "    jobs run under hvdmxrun --no-mpi, which needs no MPI",
        ]
        loaded = "no MPI"
    lines = [
        f"hvdmx {hvdmx.__version__} (Python {sys.version.split()[0]}, "
        f"MXNet {mx.__version__}, {loaded})",
        "",
        "MPI:",
    ] + mpi_lines + [
        "",
        "Training with MXNet:",
        f"    {box(hasattr(hvdmx, 'DistributedTrainer'))} Gluon: DistributedTrainer",
        f"    {box(hasattr(hvdmx, 'DistributedOptimizer'))} Module: DistributedOptimizer",
        f"    {box(hasattr(hvdmx, 'KVStore'))} kvstore plugin: KVStore",
        "",
        "Communication:",
        f"    {box(MPI is not None)} MPI (CPU tensors)",
        "    [x] hvdmx's TCP transport (hvdmxrun --no-mpi, and between hosts)",
        f"    {box(nccl > 0)} NCCL{f' {_nccl_version(nccl)}' if nccl else ''} (GPU tensors)",
        f"    {box(_core.cuda_built())} CUDA",
        f"    {box(hvdmx.gloo_built())} Gloo",
        f"    {box(hvdmx.ccl_built())} oneCCL",
        "",
        "Collectives:",
    ]
    lines += [f"    {box(hasattr(hvdmx, name))} {name}" for name in _COLLECTIVES]
    lines += ["", "Tools:", f"    {box(hasattr(hvdmx, 'start_timeline'))} timeline"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """``python -m hvdmx.build_report LAUNCHER_LINE``: the report on stdout,
    which hvdmxrun --check-build runs in a process of its own (the launcher
    loads neither MXNet nor the rank API); exit code 1, and why on stderr,
    when hvdmx cannot load here."""
    from hvdmx.runner.mpi import mpi_without_init
    args = sys.argv[1:] if argv is None else list(argv)
    mpi_without_init()  # as for hvdmxrun itself: no rank, no MPI_Init at load
    try:
        report = build_report(args[0] if args else "not given")
    except ImportError as e:  # hvdmx cannot load here: say why, without a traceback
        print(f"hvdmxrun --check-build: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
