"""hvdmx's source distribution holds everything a build from source needs
(issue 62), checked without the minutes of compiling that `pip install
hvdmx-VERSION.tar.gz` takes: the sdist is built as `make sdist` builds it
(from a copy of the checkout's files, as a fresh clone has them), unpacked
outside the checkout, and from the unpacked tree alone

  - setup.py's own lists (the core's sources, the bindings, the MPI plugin)
    name files that are there, and every one of them preprocesses (`g++ -M`,
    with the include flags of the build: it fails on a missing header);
  - the metadata is written from it (`setup.py dist_info`): the version, the
    license, the dependencies;
  - it carries what the package index and the user read: README.md,
    CHANGELOG.md, LICENSE.

Cost: seconds (the sdist, then one preprocessor run per source, two at a time).
The full build from the sdist is measured by hand (docs/benchmarks.md).
"""
import concurrent.futures
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile

import pytest

import hvdmx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEEL_TOOLS = os.path.join(sys.prefix, "wheel-tools")

pytestmark = pytest.mark.timeout(300)


def run(command, **kwargs):
    return subprocess.run(command, capture_output=True, text=True, check=False,
                          timeout=240, **kwargs)


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory):
    """The sdist, built from this checkout as `make sdist` does, unpacked
    into a directory of its own: (the tree's root, the members' names)."""
    if not os.path.isdir(os.path.join(WHEEL_TOOLS, "build")):
        pytest.fail(f"the `build` package is not in {WHEEL_TOOLS}: run `make wheel-tools` "
                    "(`make test` does)")
    # From a copy of the checkout's files (tracked, or new and not ignored), as
    # a fresh clone has them: in the checkout itself, setuptools would also
    # take every file a stale hvdmx.egg-info/SOURCES.txt lists.
    clean = tmp_path_factory.mktemp("clone")
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                 cwd=ROOT)
    assert listed.returncode == 0, listed.stderr
    for name in filter(None, listed.stdout.split("\0")):
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(os.path.dirname(os.path.join(clean, name)), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), os.path.join(clean, name))
    dist = tmp_path_factory.mktemp("sdist")
    env = dict(os.environ, PYTHONPATH=WHEEL_TOOLS)
    result = run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir",
                  str(dist), str(clean)], env=env, cwd=str(clean))
    assert result.returncode == 0, result.stdout + result.stderr
    (archive,) = os.listdir(dist)
    assert archive == f"hvdmx-{hvdmx.__version__}.tar.gz", archive
    where = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(dist / archive) as tar:
        names = tar.getnames()
        if hasattr(tarfile, "data_filter"):
            tar.extractall(where, filter="data")
        else:
            tar.extractall(where)
    root = where / f"hvdmx-{hvdmx.__version__}"
    assert not str(root).startswith(ROOT)
    return str(root), names


def unpacked_setup(root: str):
    """The unpacked tree's setup.py as a module (it builds nothing on import)."""
    spec = importlib.util.spec_from_file_location("unpacked_setup", os.path.join(root, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    cwd = os.getcwd()
    os.chdir(root)  # its lists are relative paths
    try:
        spec.loader.exec_module(module)
    finally:
        os.chdir(cwd)
    return module


def test_the_sdist_carries_the_readme_changelog_license_and_build_files(unpacked):
    root, _ = unpacked
    for name in ("README.md", "CHANGELOG.md", "LICENSE", "pyproject.toml", "setup.py",
                 "MANIFEST.in", os.path.join("hvdmx", "_version.py"),
                 os.path.join("hvdmx", "_core.pyi"), os.path.join("hvdmx", "py.typed")):
        assert os.path.isfile(os.path.join(root, name)), name
    with open(os.path.join(root, "LICENSE"), "rb") as a, \
            open(os.path.join(ROOT, "LICENSE"), "rb") as b:
        assert a.read() == b.read()


def test_every_source_setup_py_builds_is_there_and_preprocesses(unpacked):
    root, _ = unpacked
    setup = unpacked_setup(root)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        core = setup.core_sources()
        mpi = setup.MpiFlags(setup.mpi_wrapper_flags(setup.find_mpicc()), keep_rpath=False)
        mxnet_include = setup.mxnet_include_dir()
    finally:
        os.chdir(cwd)
    assert len(core) > 50 and all(s.endswith(".cc") for s in core), core
    import pybind11
    common = ["-I" + setup.CSRC_DIR, "-isystem", mxnet_include]
    for name, value in setup.MXNET_HEADER_MACROS + setup.GPU_MACROS:
        common.append(f"-D{name}={value}")
    cxx = ["g++", "-std=c++17", "-M"] + common
    jobs = [cxx + [source] for source in core]
    jobs += [cxx + ["-isystem", sysconfig.get_paths()["include"], "-isystem",
                    pybind11.get_include(), source]
             for source in (setup.CORE_BINDINGS, setup.BINDINGS_SUPPORT)]
    jobs.append(["gcc", "-M", "-I" + setup.CSRC_DIR] + ["-I" + d for d in mpi.include_dirs]
                + [setup.MPI_PLUGIN_SOURCE])

    def preprocess(command):
        return command[-1], run(command, cwd=root)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(preprocess, jobs))
    failed = [f"{source}: {result.stderr.strip()}" for source, result in results
              if result.returncode != 0]
    assert not failed, "\n".join(failed)
    # Each source's own headers were found in the unpacked tree, none in the
    # checkout (whose .venv, which holds MXNet's headers, does not count).
    venv = os.path.realpath(sys.prefix) + os.sep
    for source, result in results:
        deps = result.stdout.replace("\\\n", " ").split(":", 1)[1].split()
        assert not [d for d in deps if d.startswith(ROOT + os.sep)
                    and not os.path.realpath(d).startswith(venv)], (source, deps)
        assert any(d.startswith("csrc/hvdmx/") and d.endswith(".h") for d in deps) or \
            source.endswith("mpi_plugin.c"), (source, deps)


def test_the_metadata_is_written_from_the_sdist(unpacked, tmp_path):
    root, _ = unpacked
    result = run([sys.executable, "setup.py", "-q", "dist_info", "--output-dir", str(tmp_path)],
                 cwd=root)
    assert result.returncode == 0, result.stdout + result.stderr
    (info,) = os.listdir(tmp_path)
    assert info == f"hvdmx-{hvdmx.__version__}.dist-info"
    with open(tmp_path / info / "METADATA") as f:
        text = f.read()
    assert f"\nVersion: {hvdmx.__version__}\n" in text
    assert "\nLicense-Expression: Apache-2.0\n" in text
    assert "\nLicense-File: LICENSE\n" in text
    for requirement in ("mxnet==1.9.1", "numpy<1.24", "mpi4py", "mpich"):
        assert f"\nRequires-Dist: {requirement}\n" in text, requirement
    assert os.path.isfile(tmp_path / info / "licenses" / "LICENSE")
