"""Programs written for horovod.mxnet, run unchanged on hvdmx under mpiexec -n 2.

Sockeye 2, AWS's MXNet toolkit for machine translation, imports horovod.mxnet
itself, so it runs through ``python -m hvdmx.as_horovod``. It takes
MPI.Is_initialized() to mean that ``hvd.init()`` has run, and trains with
``hvd.broadcast_parameters`` and ``hvd.DistributedTrainer``. The pinned
versions in tests/horovod_programs.txt are installed by ``make test`` into
<venv>/horovod-programs, apart from the venv's own packages (see the Makefile).
"""
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
PROGRAMS = os.path.join(sys.prefix, "horovod-programs")


@pytest.fixture(scope="module")
def env():
    if not os.path.isdir(os.path.join(PROGRAMS, "sockeye")):
        pytest.fail(f"Sockeye is not installed in {PROGRAMS}: run `make test`, which installs "
                    f"it, or {sys.executable} -m pip install --no-deps --target {PROGRAMS} "
                    "-r tests/horovod_programs.txt")
    path = [ROOT, PROGRAMS] + os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return dict(os.environ, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1",
                PYTHONPATH=os.pathsep.join(path))


def write_corpus(directory):
    """A toy translation task: the target is the source reversed."""
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(30)]
    for split, lines in (("train", 400), ("dev", 20)):
        with open(directory / f"{split}.src", "w") as src, \
                open(directory / f"{split}.trg", "w") as trg:
            for _ in range(lines):
                words = [rng.choice(vocab) for _ in range(rng.randint(3, 8))]
                src.write(" ".join(words) + "\n")
                trg.write(" ".join(reversed(words)) + "\n")


def run(args, env, cwd, timeout):
    result = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_sockeye_trains_data_parallel(tmp_path, env):
    write_corpus(tmp_path)
    # Sockeye's Horovod mode needs prepared (sharded) data; preparing runs no MPI.
    run([sys.executable, "-m", "sockeye.prepare_data", "-s", "train.src", "-t", "train.trg",
         "-o", "prepared", "--shared-vocab", "--max-seq-len", "10:10"], env, tmp_path, 120)
    run([MPIEXEC, "-n", "2", sys.executable, "-m", "hvdmx.as_horovod", "-m", "sockeye.train",
         "--horovod", "--use-cpu", "--prepared-data", "prepared", "-vs", "dev.src",
         "-vt", "dev.trg", "-o", "model", "--num-layers", "1:1",
         "--transformer-model-size", "16", "--num-embed", "16:16",
         "--transformer-attention-heads", "2", "--transformer-feed-forward-num-hidden", "32",
         "--batch-type", "sentence", "--batch-size", "16", "--checkpoint-interval", "10",
         "--max-updates", "20", "--decode-and-evaluate", "0", "--max-seq-len", "10:10",
         "--seed", "1"], env, tmp_path, 240)
    model = tmp_path / "model"
    log = (model / "log").read_text()
    assert "Maximum # of updates (20) reached." in log, log[-3000:]
    # Sockeye puts the other ranks' files under secondary_workers/<rank>: rank 1
    # existed, so the job ran as two ranks of one Horovod world.
    second = model / "secondary_workers" / "1"
    first_checkpoint = (model / "params.00001").read_bytes()
    last_checkpoint = (model / "params.00002").read_bytes()
    assert first_checkpoint != last_checkpoint, "the parameters did not change in training"
    # Each rank trained on its own shard of the data (Sockeye splits it by
    # hvd.rank()), so equal parameters mean the gradients were averaged. (Rank 1
    # keeps only its last checkpoint.)
    assert (second / "params.00002").read_bytes() == last_checkpoint
