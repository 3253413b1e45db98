"""The examples as users run them: whole jobs under mpiexec -n 2, kept tiny."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
# The worktree's hvdmx first, as for a script started from the repository.
ENV = dict(os.environ, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1",
           PYTHONPATH=os.pathsep.join([os.path.abspath(ROOT)]
                                      + os.environ.get("PYTHONPATH", "").split(os.pathsep)))


def run_example(name, *args, timeout=120):
    script = os.path.join(ROOT, "examples", name)
    return subprocess.run([MPIEXEC, "-n", "2", sys.executable, script, *args], env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def load_example(name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        name.replace(".py", "_example"), os.path.join(ROOT, "examples", name))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def load_mnist_gluon():
    return load_example("mnist_gluon.py")


def refusal(capsys, name, *args):
    """What the example's command line says when it refuses `args` (exit 2),
    checked in this process: the refusals come before any rank starts, and a
    job of their own would spend seconds starting its ranks."""
    with pytest.raises(SystemExit) as refused:
        load_example(name).parse_args(list(args))
    assert refused.value.code == 2
    return capsys.readouterr().err


def test_mnist_gluon_warmup_schedule():
    # Goyal et al.'s gradual warm-up: one rank's rate at step 0, the job's
    # (size times it) from warmup_steps on, linear in between.
    warmup_lr = load_mnist_gluon().warmup_lr
    assert [warmup_lr(step, 4, 0.5, 8) for step in range(6)] == [0.5, 1.375, 2.25, 3.125, 4, 4]
    assert warmup_lr(0, 0, 0.5, 8) == 4  # no warm-up: the job's rate at once
    assert [warmup_lr(step, 3, 0.5, 1) for step in range(4)] == [0.5] * 4  # one rank


def test_mnist_gluon_default_batch_keeps_the_steps():
    example = load_mnist_gluon()
    assert example.MIN_STEPS == 20
    # The digits' 1,437 training samples, shared by 1 to 8 ranks: 32 while
    # that makes 20 steps an epoch, then the largest batch that does.
    shares = [1437 // size for size in range(1, 9)]
    batches = [example.default_batch_size(share) for share in shares]
    assert batches == [32, 32, 23, 17, 14, 11, 10, 8]
    assert all(share // batch >= 20 for share, batch in zip(shares, batches))
    assert example.default_batch_size(60000 // 8) == 32  # MNIST: 32 at 8 ranks
    assert example.default_batch_size(5) == 1


DIGITS_WITHOUT = """
import sys
sys.path.insert(0, sys.argv[1])
import mnist_gluon
mnist_gluon.SKLEARN_APART = sys.argv[2]
print(len(mnist_gluon.sklearn_digits().images))
"""


@pytest.mark.parametrize("apart", ["venv", "missing"])
def test_the_digits_come_from_scikit_learn_apart_or_a_clear_exit(apart, tmp_path):
    # `make venv` keeps scikit-learn out of site-packages (tests/scikit_learn.txt):
    # the examples find it in SKLEARN_APART, and without it say what to install.
    where = os.path.join(sys.prefix, "scikit-learn") if apart == "venv" \
        else str(tmp_path / "nowhere")
    result = subprocess.run([sys.executable, "-c", DIGITS_WITHOUT,
                             os.path.join(ROOT, "examples"), where],
                            env=ENV, capture_output=True, text=True, timeout=60)
    if apart == "venv":
        assert (result.returncode, result.stdout) == (0, "1797\n"), result.stderr
    else:
        assert result.returncode == 1 and (
            "the digits come with scikit-learn, which this Python cannot import: pip install "
            "scikit-learn, or pass --data-dir with MNIST's files\n") in result.stderr, \
            result.stderr


def test_module_mnist():
    result = run_example("module_mnist.py", "--epochs", "3")
    assert result.returncode == 0, result.stderr
    accuracy = re.search(r"test accuracy ([\d.]+) \(\d+/359\) after 3 epochs on 2 ranks",
                         result.stderr)
    assert accuracy, result.stderr
    assert float(accuracy.group(1)) > 0.5  # chance is 0.1; 10 epochs reach 0.98
    assert "parameters bitwise identical on all 2 ranks" in result.stderr


def test_mnist_gluon_with_adasum():
    result = run_example("mnist_gluon.py", "--epochs", "3", "--op", "adasum")
    assert result.returncode == 0, result.stderr
    accuracy = re.search(r"test accuracy ([\d.]+) \(\d+/359\) after 3 epochs", result.stderr)
    assert accuracy, result.stderr
    assert float(accuracy.group(1)) > 0.5  # chance is 0.1; 8 epochs reach 0.98
    assert "parameters bitwise identical on all 2 ranks" in result.stderr


def test_synthetic_benchmark_with_adasum():
    result = run_example("synthetic_benchmark.py", "--model", "resnet18_v1", "--image-size",
                         "16", "--batch-size", "2", "--num-classes", "10",
                         "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
                         "--num-iters", "2", "--op", "adasum")
    assert result.returncode == 0, result.stderr
    assert re.search(r"Total img/sec on 2 rank\(s\): [\d.]+ \+-[\d.]+", result.stdout)


def test_synthetic_benchmark_refuses_adasum_with_horovod(capsys):
    assert "--op adasum combines the gradients with hvdmx's Adasum" \
        in refusal(capsys, "synthetic_benchmark.py", "--op", "adasum", "--horovod")


def test_synthetic_benchmark():
    result = run_example("synthetic_benchmark.py", "--model", "resnet18_v1", "--image-size",
                         "32", "--batch-size", "2", "--num-classes", "10",
                         "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
                         "--num-iters", "2", "--fp16-allreduce", "--no-overlap")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Model: resnet18_v1, image size 32, batch size 2 per rank, 2 rank(s)" in out
    assert "compression: fp16, overlap with backward: no" in out
    assert len(re.findall(r"Iter #\d: [\d.]+ img/sec per rank, [\d.]+ in total", out)) == 2
    assert re.search(r"Per batch on rank 0: forward\+backward [\d.]+ ms, then "
                     r"allreduce\+update [\d.]+ ms", out), out
    assert re.search(r"Img/sec per rank: [\d.]+ \+-[\d.]+", out), out
    assert re.search(r"Total img/sec on 2 rank\(s\): [\d.]+ \+-[\d.]+", out), out


def test_synthetic_benchmark_sync_only():
    result = run_example("synthetic_benchmark.py", "--model", "resnet18_v1", "--image-size",
                         "16", "--batch-size", "2", "--num-classes", "10",
                         "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
                         "--num-iters", "2", "--sync-only")
    assert result.returncode == 0, result.stderr
    assert "2 rank(s) on cpu, gradients: not exchanged (--sync-only" in result.stdout
    assert re.search(r"Per batch on rank 0: forward\+backward\+update [\d.]+ ms, then "
                     r"waiting for the other ranks [\d.]+ ms", result.stdout), result.stdout
    assert re.search(r"Total img/sec on 2 rank\(s\): [\d.]+ \+-[\d.]+", result.stdout)


def test_synthetic_benchmark_hierarchical_local_sgd():
    result = run_example("synthetic_benchmark.py", "--model", "resnet18_v1", "--image-size",
                         "16", "--batch-size", "2", "--num-classes", "10",
                         "--num-warmup-batches", "1", "--num-batches-per-iter", "1",
                         "--num-iters", "2", "--local-sgd-steps", "2",
                         "--hierarchical-local-sgd")
    assert result.returncode == 0, result.stderr
    assert "compression: none, overlap with backward: yes, local SGD every 2 steps " \
        "(hierarchical)" in result.stdout
    assert re.search(r"Total img/sec on 2 rank\(s\): [\d.]+ \+-[\d.]+", result.stdout)
    refused = run_example("synthetic_benchmark.py", "--local-sgd-steps", "2", "--horovod",
                          timeout=60)
    assert refused.returncode != 0
    assert "--local-sgd-steps, --hierarchical-local-sgd and --easgd-beta are hvdmx's local " \
        "SGD" in refused.stderr


@pytest.mark.parametrize("flag", ["--fp16-allreduce", "--no-overlap"])
def test_synthetic_benchmark_rejects_sync_only_with_allreduce_flags(flag, capsys):
    assert f"{flag} is about the gradients' allreduce, which --sync-only leaves out" \
        in refusal(capsys, "synthetic_benchmark.py", "--sync-only", flag)


def stand_in_horovod_python(directory):
    """A `python` whose `import horovod.mxnet` gives hvdmx (hvdmx.as_horovod),
    with the launcher beside it, as benchmarks/horovod/build.sh's environment has."""
    python = directory / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hvdmx.as_horovod "$@"\n')
    python.chmod(0o755)
    # A script, not a link: Hydra finds its proxy beside the path it runs from.
    mpiexec = directory / "mpiexec"
    mpiexec.write_text(f'#!/bin/sh\nexec "{MPIEXEC}" "$@"\n')
    mpiexec.chmod(0o755)
    return str(python)


def test_scaling_benchmark(tmp_path):
    script = os.path.join(ROOT, "examples", "scaling_benchmark.py")
    result = subprocess.run(
        [sys.executable, script, "--rounds", "1",
         "--horovod-python", stand_in_horovod_python(tmp_path), "--", "--model", "resnet18_v1",
         "--image-size", "16", "--batch-size", "2", "--num-classes", "10",
         "--num-warmup-batches", "1", "--num-batches-per-iter", "1", "--num-iters", "2"],
        env=ENV, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    rows = re.findall(r"^ *(1 process|2 independent|2 ranks in step|2 ranks, hvdmx|"
                      r"2 ranks, Horovod) +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)$",
                      result.stdout, re.M)
    assert [r[0] for r in rows] == ["1 process", "2 independent", "2 ranks in step",
                                    "2 ranks, hvdmx", "2 ranks, Horovod"], result.stdout
    one = float(rows[0][1])
    assert float(rows[0][3]) == 1.0 and float(rows[1][4]) == 1.0
    for row in rows[2:]:
        total = float(row[1])
        assert abs(float(row[3]) - total / (2 * one)) < 0.01


def test_synthetic_benchmark_rejects_sync_only_with_horovod(capsys):
    assert "--sync-only needs hvd.barrier(), which horovod.mxnet does not have" \
        in refusal(capsys, "synthetic_benchmark.py", "--sync-only", "--horovod")


def test_scaling_benchmark_rejects_a_missing_horovod_python(tmp_path):
    script = os.path.join(ROOT, "examples", "scaling_benchmark.py")
    missing = str(tmp_path / "nothing" / "python")
    result = subprocess.run([sys.executable, script, "--horovod-python", missing], env=ENV,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"--horovod-python {missing!r} is not an executable file" in result.stderr


def test_scaling_benchmark_rejects_one_rank():
    script = os.path.join(ROOT, "examples", "scaling_benchmark.py")
    result = subprocess.run([sys.executable, script, "--np", "1"], env=ENV,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--np must be >= 2 (got 1)" in result.stderr


def test_horovod_model_allreduce_script():
    # benchmarks/horovod/model_allreduce.py, run here with hvdmx standing in for
    # horovod.mxnet (hvdmx.as_horovod): it builds the gradient set and times it
    # (a small model: the script's path, not a figure).
    script = os.path.join(ROOT, "benchmarks", "horovod", "model_allreduce.py")
    result = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "hvdmx.as_horovod",
                             script, "--model", "squeezenet1.1", "--iters", "2"], env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "# squeezenet1.1 gradients: 52 tensors, 4.9 MB, 2 ranks" in result.stdout
    assert re.search(r"^horovod [\d.]+$", result.stdout, re.M), result.stdout


INTERLEAVE = os.path.join(ROOT, "benchmarks", "interleave.py")


def test_interleave_streaming_stores_preset():
    # benchmarks/interleave.py --preset streaming-stores: two rounds of each
    # value, a small model, the memory floor first and last.
    result = subprocess.run([MPIEXEC, "-n", "2", sys.executable, INTERLEAVE, "--preset",
                             "streaming-stores", "--model", "squeezenet1.1", "--rounds", "2",
                             "--iters", "1", "--warmup", "0"],
                            env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ("# 2 ranks; us per iteration of squeezenet1.1's 52 gradients: "
                        "HVDMX_SHM_STREAMING_STORES=0, =1, =auto, with the memory floor first "
                        "and last")
    assert lines[1].split() == ["round", "collective", "size(B)", "floor", "0", "1", "auto",
                                "floor"]
    for r, line in enumerate(lines[2:], 1):
        cells = line.split()
        assert cells[:3] == [str(r), "model", "4941984"] and len(cells) == 8
        assert all(float(c) > 0 for c in cells[3:])
    assert len(lines) == 4


def test_interleave_direct_reads_preset():
    # benchmarks/interleave.py --preset direct-reads: one round of two
    # collectives at two sizes.
    result = subprocess.run([MPIEXEC, "-n", "2", sys.executable, INTERLEAVE, "--preset",
                             "direct-reads", "--rounds", "1",
                             "--iters", "1", "--warmup", "0", "--sizes", "64K,1M",
                             "--kinds", "alltoall,broadcast"],
                            env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ("# 2 ranks; us per call: HVDMX_SHM_DIRECT_MIN_BYTES=-1 (off), =0 "
                        "(direct), and the MPI call on numpy arrays")
    assert lines[1].split() == ["round", "collective", "size(B)", "off", "direct", "MPI"]
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("1", "alltoall", "65536"), ("1", "alltoall", "1048576"),
        ("1", "broadcast", "65536"), ("1", "broadcast", "1048576")]
    assert all(float(c) > 0 for r in rows for c in r[3:])


def build_stage_floor(tmp_path):
    """benchmarks/stage_floor.c built with the venv's mpicc (the C compiler the
    extension's build already needs; the tool itself uses no MPI)."""
    binary = str(tmp_path / "stage_floor")
    mpicc = os.path.join(os.path.dirname(sys.executable), "mpicc")
    subprocess.run([mpicc, "-O2", "-Wall", "-Werror", "-o", binary,
                    os.path.join(ROOT, "benchmarks", "stage_floor.c")], check=True, timeout=120)
    return binary


def test_stage_floor_tool(tmp_path):
    # Two sizes, a few broadcasts each: every way must deliver the root's bytes
    # (the tool checks the peer's last byte and exits 1 if it is wrong).
    result = subprocess.run([build_stage_floor(tmp_path), "--min-bytes", "65536",
                             "--max-bytes", "262144", "--iters", "3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("# bare 2-process broadcast floor, us per call (mean of 3")
    assert lines[1].split() == ["size(B)", "|", "local", "|", "stages", "root", "busy",
                                "peer", "busy", "|", "readv", "readv", "huge"]
    rows = [[c for c in line.split() if c != "|"] for line in lines[2:]]
    assert [r[0] for r in rows] == ["65536", "262144"]
    assert all(len(r) == 7 and all(float(c) > 0 for c in r[1:]) for r in rows)


@pytest.mark.parametrize("args,message", [
    (["--iters", "0"], "--iters must be a positive integer (got 0)"),
    (["--min-bytes", "4M"], "--min-bytes must be a positive integer (got 4M)"),
    (["--min-bytes", "4096", "--max-bytes", "1024"],
     "want --min-bytes <= --max-bytes (got 4096 > 1024)"),
    (["--iters", "5000000"], "--iters must be at most 1000000"),
    (["--sizes", "1"], "usage:"),
    (["--iters"], "usage:"),
])
def test_stage_floor_rejects_bad_input(tmp_path, args, message):
    result = subprocess.run([build_stage_floor(tmp_path)] + args, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr


@pytest.mark.parametrize("args,message", [
    (["--preset", "direct-reads", "--kinds", "alltoall,gather"],
     "--kinds: 'gather' is not one of broadcast, allgather, alltoall"),
    (["--preset", "direct-reads", "--sizes", "4M,lots"],
     "--sizes: '4M,lots' is not a list of byte counts"),
    (["--preset", "direct-reads", "--rounds", "0"], "--rounds must be >= 1 (got 0)"),
    (["--preset", "streaming-stores", "--kinds", "allreduce"],
     "--kinds: 'allreduce' is not one of model"),
    (["--preset", "streaming", "--rounds", "1"], "argument --preset: invalid choice: 'streaming'"),
    (["X=1", "--preset", "direct-reads"], "give a variable (X=...) or --preset direct-reads, "
                                          "not both"),
    ([], "give the variable to vary (NAME=VALUE[,VALUE...]) or --preset"),
    (["HVDMX_HUGE_PAGES"], "'HVDMX_HUGE_PAGES' is not NAME=VALUE[,VALUE...]"),
    (["HVDMX_HUGE_PAGES=0,,1"], "'HVDMX_HUGE_PAGES=0,,1' is not NAME=VALUE[,VALUE...]"),
    (["X=1", "--set", "HVDMX_ALLREDUCE_ALGO=ring,mpi"],
     "--set HVDMX_ALLREDUCE_ALGO: give one value, got ring,mpi"),
    (["X=1", "--kinds", "reducescatter"],
     "--kinds: 'reducescatter' is not one of allreduce, broadcast, allgather, alltoall, model"),
    (["X=1", "--kinds", "allreduce,model"], "--kinds: model is timed alone"),
    (["X=1", "--warmup", "-1"], "--warmup must be >= 0 (got -1)"),
])
def test_interleave_rejects_bad_input(args, message):
    result = subprocess.run([sys.executable, INTERLEAVE] + args, env=ENV, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr


def test_placement_script():
    # benchmarks/placement.py, with binding forced: every busy thread of a rank stays
    # on one CPU, each rank on its own if there are two.
    script = os.path.join(ROOT, "benchmarks", "placement.py")
    result = subprocess.run([MPIEXEC, "-n", "2", sys.executable, script, "--kind", "allreduce",
                             "--bytes", "4096", "--iters", "20000", "--label", "core"],
                            env={**ENV, "HVDMX_CPU_BIND": "core"}, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    head, rank0, rank1 = result.stdout.strip().split(" | ")
    label, kind, nbytes, unit, us, micro = head.split()
    assert (label, kind, nbytes, unit, micro) == ("core", "allreduce", "4096", "B:", "us")
    assert float(us) > 0
    cpus = []
    for r, part in enumerate([rank0, rank1]):
        assert part.startswith(f"rank {r}: ")
        threads = dict(t.split("@") for t in part[len(f"rank {r}: "):].split(", "))
        assert "python" in threads  # the thread that made the calls
        seen = {c for where in threads.values() for c in where.split(",") if c}
        assert len(seen) == 1, threads
        cpus.append(seen.pop())
    if len(os.sched_getaffinity(0)) >= 2:
        assert cpus[0] != cpus[1]


def test_interleave_script():
    # benchmarks/interleave.py: one round, two values of a variable, a fixed one.
    result = subprocess.run([MPIEXEC, "-n", "2", sys.executable, INTERLEAVE, "HVDMX_HUGE_PAGES=0,1",
                             "--set", "HVDMX_ALLREDUCE_ALGO=ring", "--rounds", "1", "--iters",
                             "1", "--warmup", "0", "--sizes", "64K,4M",
                             "--kinds", "allreduce,alltoall"],
                            env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ("# 2 ranks; us per call: HVDMX_HUGE_PAGES=0, =1, and the MPI call on "
                        "numpy arrays; with HVDMX_ALLREDUCE_ALGO=ring")
    assert lines[1].split() == ["round", "collective", "size(B)", "0", "1", "MPI"]
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("1", "allreduce", "65536"), ("1", "allreduce", "4194304"),
        ("1", "alltoall", "65536"), ("1", "alltoall", "4194304")]
    assert all(float(c) > 0 for r in rows for c in r[3:])


ELASTIC_TRAINER = """
import sys
sys.path.insert(0, "examples")
import hvdmx as hvd
import mnist_gluon
import elastic_mnist

built = []
real = mnist_gluon.build_trainer
mnist_gluon.build_trainer = lambda *a: built.append(real(*a)) or built[-1]
elastic_mnist.main(sys.argv[2:] + ["--epochs", "1"])
t = built[0]
print("BUILT", t._compression is getattr(hvd.Compression, sys.argv[1]), t._local_sgd_steps,
      t._easgd_beta, t._op == hvd.Adasum)
"""


@pytest.mark.parametrize("flags, want", [
    (["onebit"], "BUILT True 1 None False"),
    (["fp16", "--fp16-allreduce", "--op", "adasum"], "BUILT True 1 None True"),
    (["none", "--local-sgd-steps", "4", "--easgd-beta", "0.9"], "BUILT True 4 0.9 False"),
], ids=["onebit", "fp16-adasum", "easgd"])
def test_elastic_mnist_builds_the_trainer_its_flags_ask_for(flags, want):
    # It once parsed mnist_gluon's flags and built a plain trainer: asked for
    # 1-bit compression, it silently trained without. One rank, one epoch.
    compression, *rest = flags
    argv = [compression] + (["--compression", compression] if compression != "fp16" else [])
    result = subprocess.run([sys.executable, "-c", ELASTIC_TRAINER, *argv, *rest], cwd=ROOT,
                            env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert want in result.stdout, result.stdout + result.stderr[-3000:]
