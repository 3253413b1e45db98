"""The digits examples' test accuracy under each of the CPU kernels MXNet may
run: a training run's path, and so the accuracy it ends at, depends on how
the convolution and matrix kernels round, which differs between instruction
sets (MKLDNN's ISA, OpenBLAS's core type). A target that holds on one CPU
only is no target (issue 59); this program shows the margin.

    .venv/bin/python benchmarks/kernel_accuracy.py                   # everything
    .venv/bin/python benchmarks/kernel_accuracy.py --modes onebit --ranks 2

Each cell is one run of the example with its defaults and the mode's flags
(mnist_gluon.py under the venv's mpiexec; elastic_mnist.py under
`hvdmxrun --no-mpi`), OMP_NUM_THREADS=1 MXNET_CPU_WORKER_NTHREADS=1, the
kernel's variables set and every other OpenBLAS/DNNL variable of this
shell removed. Prints one row per mode and rank count, one column per kernel
and the row's minimum; a cell that did not end with an accuracy is 'error'
(its output's tail goes to stderr). Exit status 1 when any cell is below
--target or failed.
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)

MODES = {
    "plain": ("mnist_gluon.py", []),
    "onebit": ("mnist_gluon.py", ["--compression", "onebit"]),
    "lsgd4": ("mnist_gluon.py", ["--local-sgd-steps", "4"]),
    "easgd": ("mnist_gluon.py", ["--local-sgd-steps", "4", "--easgd-beta", "0.9"]),
    "elastic": ("elastic_mnist.py", []),
}

# The kernels, as the variables that select them. MXNet 1.9.1's wheel runs
# convolutions and dense layers on MKLDNN (oneDNN), which picks its code by the
# CPU's instruction set unless DNNL_MAX_CPU_ISA holds it lower; with
# MXNET_MKLDNN_ENABLED=0 they run on im2col and OpenBLAS, whose core type
# OPENBLAS_CORETYPE forces (its autodetection otherwise). "haswell" is MKLDNN
# beside OpenBLAS forced to Haswell, as some machines set it for all programs.
KERNELS = {
    "default": {},
    "haswell": {"OPENBLAS_CORETYPE": "Haswell"},
    "dnnl-avx2": {"DNNL_MAX_CPU_ISA": "AVX2"},
    "dnnl-avx": {"DNNL_MAX_CPU_ISA": "AVX"},
    "dnnl-sse41": {"DNNL_MAX_CPU_ISA": "SSE41"},
    "blas-auto": {"MXNET_MKLDNN_ENABLED": "0"},
    "blas-skylakex": {"MXNET_MKLDNN_ENABLED": "0", "OPENBLAS_CORETYPE": "SkylakeX"},
    "blas-haswell": {"MXNET_MKLDNN_ENABLED": "0", "OPENBLAS_CORETYPE": "Haswell"},
    "blas-sandybridge": {"MXNET_MKLDNN_ENABLED": "0", "OPENBLAS_CORETYPE": "SandyBridge"},
    "blas-prescott": {"MXNET_MKLDNN_ENABLED": "0", "OPENBLAS_CORETYPE": "Prescott"},
}

ACCURACY = re.compile(r"test accuracy (\d\.\d+) \(\d+/\d+\)")


def command(mode, ranks, extra=()):
    script, flags = MODES[mode]
    path = os.path.join(ROOT, "examples", script)
    if script == "elastic_mnist.py":
        launcher = [os.path.join(BIN, "hvdmxrun"), "--no-mpi", "-np", str(ranks)]
    else:
        launcher = [os.path.join(BIN, "mpiexec"), "-n", str(ranks)]
    return launcher + [sys.executable, path, "--log-interval", "1000"] + flags + list(extra)


def environment(kernel):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OPENBLAS_", "DNNL_", "MKLDNN_", "MXNET_MKLDNN"))}
    env.update(OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1")
    env.update(KERNELS[kernel])
    return env


def accuracy(mode, ranks, kernel, timeout, extra=()):
    """The run's test accuracy, or None (its output's tail on stderr)."""
    try:
        result = subprocess.run(command(mode, ranks, extra), env=environment(kernel), cwd=ROOT,
                                capture_output=True, text=True, timeout=timeout)
        text = result.stdout + result.stderr
    except subprocess.TimeoutExpired as timed_out:
        text = f"timed out after {timeout} s\n{timed_out.stderr or ''}"
        result = None
    found = ACCURACY.search(text)
    if result is None or result.returncode != 0 or not found:
        print(f"--- {mode} at {ranks} ranks, {kernel}:\n{text[-2000:]}", file=sys.stderr)
        return None
    return float(found.group(1))


def split(value, known, what):
    names = value.split(",")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown)}; "
                                         f"choose from {', '.join(known)}")
    return names


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES),
                        type=lambda v: split(v, MODES, "mode"),
                        help="comma-separated modes: " + ", ".join(
                            f"{name} ({' '.join(flags) or 'defaults'}, {script})"
                            for name, (script, flags) in MODES.items()))
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        type=lambda v: split(v, KERNELS, "kernel"),
                        help="comma-separated kernels: " + ", ".join(
                            f"{name} ({' '.join(f'{k}={v}' for k, v in env.items()) or 'as is'})"
                            for name, env in KERNELS.items()))
    parser.add_argument("--ranks", default="2,4",
                        type=lambda v: [int(n) for n in v.split(",")],
                        help="comma-separated rank counts")
    parser.add_argument("--target", type=float, default=0.95,
                        help="the accuracy every cell must reach")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take")
    parser.add_argument("extra", nargs="*",
                        help="more flags for every run, after --: e.g. -- --epochs 12")
    args = parser.parse_args(argv)

    width = max(len(k) for k in args.kernels + ["mode x ranks"]) + 1
    header = f"{'mode x ranks':<16}" + "".join(f"{k:>{width}}" for k in args.kernels) \
        + f"{'min':>{width}}"
    print(header, flush=True)
    bad = 0
    for mode in args.modes:
        for ranks in args.ranks:
            cells = [accuracy(mode, ranks, kernel, args.timeout, args.extra)
                     for kernel in args.kernels]
            bad += sum(1 for c in cells if c is None or c < args.target)
            good = [c for c in cells if c is not None]
            row = f"{f'{mode} x {ranks}':<16}" + "".join(
                f"{'error' if c is None else f'{c:.4f}':>{width}}" for c in cells)
            print(row + f"{min(good) if good else float('nan'):>{width}.4f}", flush=True)
    print(f"{bad} cell(s) below {args.target} or failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
