"""hvd.init refuses a process that a launcher started as one of several but
that MPI sees alone: the launcher belongs to another MPI than hvdmx's (Open
MPI's mpirun starting a program on the mpich wheel), and each process would
otherwise train by itself as rank 0 of 1, silently."""
import os
import subprocess
import sys

import pytest

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
# One write per rank: the ranks share stdout.
SCRIPT = ("import os, sys, hvdmx as hvd\n"
          "hvd.init()\n"
          "sys.stdout.write(f'size {hvd.size()} PMI_SIZE {os.environ.get(\"PMI_SIZE\")}\\n')\n")


def run(command, **env):
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")}
    return subprocess.run(command, env=dict(base, OMP_NUM_THREADS="1", **env),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("variable, launcher", [
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun/mpiexec"),
    ("PMI_SIZE", "a PMI launcher (such as the mpiexec of MPICH or Intel MPI)"),
])
def test_a_foreign_launchers_process_is_refused(variable, launcher):
    # What a launcher of another MPI leaves: its size variable, and an MPI
    # that starts as a singleton.
    result = run([sys.executable, "-c", SCRIPT], **{variable: "3"})
    assert result.returncode != 0
    assert "size" not in result.stdout
    assert (f"hvdmx.init: {launcher} started this process as one of 3 ({variable}=3), but "
            "the MPI library hvdmx uses (MPICH") in result.stderr
    assert ("every process would train by itself as rank 0 of 1. Start the job with the "
            f"launcher of hvdmx's MPI: hvdmxrun -np 3 ... finds it, or {MPIEXEC} -n 3 ...") \
        in result.stderr


def test_a_launcher_of_one_process_is_fine():
    result = run([sys.executable, "-c", SCRIPT], OMPI_COMM_WORLD_SIZE="1")
    assert result.returncode == 0, result.stderr
    assert "size 1" in result.stdout


def test_the_matching_launcher_is_fine():
    # Hydra, the mpich wheel's own launcher, sets PMI_SIZE to the job's size.
    result = run([MPIEXEC, "-n", "2", sys.executable, "-c", SCRIPT])
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("size 2 PMI_SIZE 2") == 2, result.stdout
