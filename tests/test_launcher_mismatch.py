"""hvd.init refuses a process that a launcher started as one of several but
that MPI sees alone: the launcher belongs to another MPI than hvdmx's (Open
MPI's mpirun starting a program on the mpich wheel), or it is srun without a
PMI, and each process would otherwise train by itself as rank 0 of 1,
silently.

Where MPI would not start at all (a PMIx launcher, and the mpich wheel's
MPICH, which has no PMIx), hvdmx says why before MPICH aborts; where a PMIx
step's variables only leaked into a job of MPICH's own launcher, hvdmx drops
them. The real Open MPI mpirun is in test_one_mpi.py."""
import os
import subprocess
import sys

import pytest

import hvdmx
import hvdmx._mpi

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
# One write per rank: the ranks share stdout.
SCRIPT = ("import os, sys, hvdmx as hvd\n"
          "hvd.init()\n"
          "sys.stdout.write(f'size {hvd.size()} PMI_SIZE {os.environ.get(\"PMI_SIZE\")}\\n')\n")


def run(command, **env):
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_NAMESPACE", "MPI4PY_LIBMPI",
                         "SLURM_STEP_NUM_TASKS")}
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


def test_srun_without_a_pmi_is_refused():
    # srun --mpi=none: Slurm's step variables, and nothing for MPI.
    result = run([sys.executable, "-c", SCRIPT], SLURM_STEP_NUM_TASKS="3")
    assert result.returncode != 0
    assert "size" not in result.stdout
    assert ("hvdmx.init: Slurm's srun started this process as one of 3 tasks "
            "(SLURM_STEP_NUM_TASKS=3) but gave MPI no way to find the others") in result.stderr
    assert ("every process would train by itself as rank 0 of 1. Start the job with hvdmxrun "
            "-np 3 ... inside the allocation") in result.stderr


@pytest.mark.parametrize("tasks, command, sizes", [
    ("1", [sys.executable], ["size 1 PMI_SIZE None"]),
    # Ranks of mpiexec inside an allocation inherit the step variables of the
    # proxies srun started for it: their own launcher's variable decides.
    ("4", [MPIEXEC, "-n", "2", sys.executable], ["size 2 PMI_SIZE 2"] * 2),
    ("4", [MPIEXEC, "-n", "1", sys.executable], ["size 1 PMI_SIZE 1"]),
])
def test_slurm_step_variables_are_fine_where_mpi_sees_the_job(tasks, command, sizes):
    result = run(command + ["-c", SCRIPT], SLURM_STEP_NUM_TASKS=tasks)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == sizes


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
    assert hvdmx._mpi.wheel_libmpi() == WHEEL_LIBMPI
    result = run([sys.executable] + program, PMIX_NAMESPACE="job.1")
    assert result.returncode != 0
    assert PMIX_REFUSAL in result.stderr, result.stderr
    assert "PMI_SIZE is set too" not in result.stderr
    assert MPICH_ABORT not in result.stderr  # MPI never started


def test_pmix_variables_inherited_under_hydra_are_dropped():
    # MPICH's mpiexec run inside a PMIx job step passes PMIX_NAMESPACE on to
    # its ranks, beside its own PMI_SIZE: MPICH would abort with both.
    script = ("import os, sys\n"
              "seen = os.environ.get('PMIX_NAMESPACE')\n"
              "import hvdmx as hvd\n"
              "hvd.init()\n"
              "sys.stdout.write(f'size {hvd.size()} seen {seen} now "
              "{os.environ.get(\"PMIX_NAMESPACE\")} {os.environ.get(\"PMIX_RANK\")}\\n')\n")
    result = run([MPIEXEC, "-n", "2", sys.executable, "-c", script], PMIX_NAMESPACE="job.1",
                 PMIX_RANK="0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("size 2 seen job.1 now None None") == 2, result.stdout


def test_pmix_variables_set_for_hydras_proxies_are_dropped(tmp_path):
    # Inside a Slurm allocation Hydra starts its proxies with srun, which can
    # give them a PMIx step's variables even when mpiexec's environment has
    # none; the proxies pass their environment on to the ranks. A stand-in
    # for srun: an ssh for Hydra that sets them and runs the proxy here.
    fake = tmp_path / "ssh"
    fake.write_text("#!/bin/sh\n"
                    "while [ \"${1#-}\" != \"$1\" ]; do shift; done\n"
                    "shift\n"  # the host
                    "PMIX_NAMESPACE=slurm.pmix.9.0 PMIX_RANK=0 exec sh -c \"$*\"\n")
    fake.chmod(0o755)
    script = ("import os, sys\n"
              "seen = os.environ.get('PMIX_NAMESPACE')\n"
              "import hvdmx as hvd, mxnet as mx\n"
              "hvd.init()\n"
              "total = hvd.allreduce(mx.nd.ones(2) * (hvd.rank() + 1), op=hvd.Sum).asnumpy()\n"
              "sys.stdout.write(f'size {hvd.size()} seen {seen} sum {total.tolist()}\\n')\n")
    result = run([MPIEXEC, "-launcher", "ssh", "-launcher-exec", str(fake), "-hosts",
                  "node-a:2", "-n", "2", sys.executable, "-c", script])
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("size 2 seen slurm.pmix.9.0 sum [3.0, 3.0]") == 2, result.stdout


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
    assert hvdmx._mpi.settle_pmix(environ, str(without)).startswith("hvdmx: a PMIx launcher")
    assert hvdmx._mpi.settle_pmix(environ, str(with_pmix)) is None
    assert hvdmx._mpi.settle_pmix({}, str(without)) is None
    assert hvdmx._mpi.settle_pmix(environ, None) is None
    # Under a PMI launcher, only an MPICH without PMIx loses the variables.
    for lib, left in ((without, {"PMI_SIZE": "2", "PATH": "/bin"}),
                      (with_pmix, {"PMI_SIZE": "2", "PATH": "/bin", "PMIX_NAMESPACE": "job.1",
                                   "PMIX_RANK": "0"})):
        environ = {"PMI_SIZE": "2", "PATH": "/bin", "PMIX_NAMESPACE": "job.1", "PMIX_RANK": "0"}
        assert hvdmx._mpi.settle_pmix(environ, str(lib)) is None
        assert environ == left
