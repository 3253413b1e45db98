"""hvd.init refuses a process that a launcher started as one of several but
that MPI sees alone: the launcher belongs to another MPI than hvdmx's (Open
MPI's mpirun starting a program on the mpich wheel), and each process would
otherwise train by itself as rank 0 of 1, silently.

Where MPI would not start at all (a PMIx launcher, and the mpich wheel's
MPICH, which has no PMIx), hvdmx says why before MPICH aborts. The real
Open MPI mpirun is in test_one_mpi.py."""
import os
import subprocess
import sys

import pytest

import hvdmx

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
# One write per rank: the ranks share stdout.
SCRIPT = ("import os, sys, hvdmx as hvd\n"
          "hvd.init()\n"
          "sys.stdout.write(f'size {hvd.size()} PMI_SIZE {os.environ.get(\"PMI_SIZE\")}\\n')\n")


def run(command, **env):
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_NAMESPACE", "MPI4PY_LIBMPI")}
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


WHEEL_LIBMPI = os.path.realpath(os.path.join(sys.prefix, "lib", "libmpi.so.12"))
PMIX_REFUSAL = ("RuntimeError: hvdmx: a PMIx launcher (Open MPI's mpirun, or srun --mpi=pmix) "
                "started this process (PMIX_NAMESPACE is set), but the MPI that mpi4py loads "
                f"is the mpich wheel's ({WHEEL_LIBMPI}), which has no PMIx support: it would "
                f"abort in MPI_Init. Start the job with hvdmxrun -np N ..., or with {MPIEXEC} "
                "-n N ...")
MPICH_ABORT = "unsupported PMI version PMIx"


@pytest.mark.parametrize("program", [["-c", SCRIPT],
                                     ["-m", "hvdmx.bench", "allreduce", "--max-bytes", "4"]])
def test_a_pmix_launchers_process_is_refused_before_mpi_starts(program):
    assert hvdmx._wheel_libmpi() == WHEEL_LIBMPI
    result = run([sys.executable] + program, PMIX_NAMESPACE="job.1")
    assert result.returncode != 0
    assert PMIX_REFUSAL in result.stderr, result.stderr
    assert "PMI_SIZE is set too" not in result.stderr
    assert MPICH_ABORT not in result.stderr  # MPI never started


def test_pmix_variables_inherited_under_hydra_are_named():
    # MPICH's mpiexec run inside a PMIx job step passes PMIX_NAMESPACE on.
    result = run([sys.executable, "-c", SCRIPT], PMIX_NAMESPACE="job.1", PMI_SIZE="1")
    assert result.returncode != 0
    assert PMIX_REFUSAL in result.stderr, result.stderr
    assert ("PMI_SIZE is set too, so MPICH's own launcher started this process from inside "
            "a PMIx job step: unset the PMIX_* variables") in result.stderr
    assert "or start it with hvdmxrun, which leaves them out." in result.stderr


def test_an_mpi_chosen_through_mpi4py_is_left_to_it():
    # MPI4PY_LIBMPI names the library: hvdmx does not guess what it supports.
    result = run([sys.executable, "-c", SCRIPT], PMIX_NAMESPACE="job.1",
                 MPI4PY_LIBMPI=WHEEL_LIBMPI)
    assert result.returncode != 0
    assert "a PMIx launcher" not in result.stderr
    assert MPICH_ABORT in result.stderr, result.stderr


def test_an_mpich_built_with_pmix_is_not_refused(tmp_path):
    without, with_pmix = tmp_path / "libmpi.so.12", tmp_path / "pmix" / "libmpi.so.12"
    with_pmix.parent.mkdir()
    without.write_bytes(b"\x7fELF libfabric.so.1\0libc.so.6\0")
    with_pmix.write_bytes(b"\x7fELF libfabric.so.1\0libpmix.so.2\0libc.so.6\0")
    environ = {"PMIX_NAMESPACE": "job.1"}
    assert hvdmx._pmix_refusal(environ, str(without)).startswith("hvdmx: a PMIx launcher")
    assert hvdmx._pmix_refusal(environ, str(with_pmix)) is None
    assert hvdmx._pmix_refusal({}, str(without)) is None
    assert hvdmx._pmix_refusal(environ, None) is None
