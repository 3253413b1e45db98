"""Builds hvdmx: the Python package hvdmx/, the core as a shared library
hvdmx/libhvdmx_core.so, one extension, hvdmx._core, and the MPI plugin
hvdmx/libhvdmx_mpi.so.

The core library is every csrc/hvdmx/<layer>/*.cc compiled together (C++17) except
csrc/hvdmx/testing/ and the two pybind11 files python/bindings.cc and
python/bindings_support.cc; csrc/hvdmx/README.md says what each layer folder holds.
It is plain C++ with default visibility and no Python or MPI in it. hvdmx._core is
bindings.cc and bindings_support.cc (pybind11), linked against it and finding it
beside itself (RUNPATH $ORIGIN). The library is one of the build's extensions
(named CORE_LIBRARY below, given a plain file name by build_ext.get_ext_filename),
so setuptools puts it wherever it puts _core: the build directory, the source
tree (--inplace, editable installs), the wheel.

The tests' module
    `setup.py build_ext` (which `make build` and `make test` run) also builds
    tests/_hvdmx_testing, the test suite's entry points (csrc/hvdmx/testing/*.cc
    and bindings_support.cc), linked against the same library (RUNPATH
    $ORIGIN/../hvdmx): one core in memory, whose singletons (the job, the output
    pool, the timeline) the tests' module and _core share
    (tests/test_core_ships_no_tests.py checks that it carries no copy of its own).
    Installing (pip install, a wheel, pip install -e .) leaves it out: hvdmx
    ships none of it.
The MPI plugin
    csrc/hvdmx/mpi/mpi_plugin.c, plain C, the one source that includes
    mpi.h and the one file that links libmpi: the core opens it at run time, and
    only in a job that uses MPI (Note [MPI as a plugin] in
    csrc/hvdmx/mpi/mpi_plugin.h), so `import hvdmx` and a job under
    `hvdmxrun --no-mpi` need no MPI library.

It needs two things from the build environment, both found here:

MPI (for the plugin only)
    The wrapper compiler is chosen in this order: $MPICC; $HVDMX_MPI_HOME/bin/mpicc;
    the mpicc beside sys.executable (a venv with the `mpich` wheel); mpicc on PATH
    (under pip's build isolation, the `mpich` build requirement). We only ask it for
    its flags (`mpicc --showme:compile/--showme:link` for Open MPI, `mpicc -show` for
    MPICH and its derivatives) and compile with the ordinary C++ compiler.
    See Note [Finding libmpi at run time].

MXNet
    Headers only, from the installed wheel's mxnet/include, located without importing
    mxnet. The extension reaches MXNet through its C API at run time, resolved with
    dlsym from the libmxnet that `import mxnet` already loaded; it links no MXNet
    symbol, so no compiler or C++ ABI match with the wheel is needed.

OpenSSL's libcrypto (HMAC-SHA256 and random keys for the TCP transport's
handshake) is neither compiled against nor linked: the core opens it at run time
by soname (Note [Loading libcrypto at run time] in csrc/hvdmx/base/crypto.cc), so
the build needs no OpenSSL headers and a wheel runs with whichever libcrypto the
machine has.

Environment variables read here (build time only):
    MPICC               the MPI C wrapper to take flags from (a system MPI)
    HVDMX_MPI_HOME      an MPI installation prefix; its bin/mpicc is used
    HVDMX_BUILD_JOBS    parallel compile jobs (default: the CPUs this process may use)
With MPICC or HVDMX_MPI_HOME set, the `mpich` wheel is not a runtime dependency.

Note [Finding libmpi at run time]
---------------------------------
The plugin links libmpi by its soname (`-lmpi`, giving NEEDED libmpi.so.12 for
MPICH, libmpi.so.40 for Open MPI) and records no rpath from the MPI wrapper when
the MPI was found automatically: under build isolation that directory is a
temporary build environment that is deleted after the build. Instead:
  1. The package imports mpi4py.MPI before it opens the plugin (load_mpi in
     hvdmx/_mpi.py). mpi4py has loaded the MPI library, and the dynamic loader
     satisfies the plugin's NEEDED entry with the loaded object whose soname
     matches, so both share one MPI.
  2. As a fallback, RUNPATH $ORIGIN/../../.. (in the plugin, in hvdmx/) points
     from <prefix>/lib/pythonX.Y/site-packages/hvdmx to <prefix>/lib, where the
     `mpich` wheel puts libmpi.
When the MPI was chosen explicitly (MPICC/HVDMX_MPI_HOME), it is a lasting
installation: its wrapper's rpath is kept and the wheel fallback is left out.
"""

import glob
import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
from pybind11.setup_helpers import build_ext as _pybind11_build_ext
from setuptools import Extension, setup
from setuptools.errors import CompileError

CSRC_DIR = os.path.join("csrc", "hvdmx")

# The GPU path is not built: no CUDA or NCCL probe exists yet, and these macros say
# so to the C++ (nccl_built(), cuda_built()).
GPU_MACROS = [("HVDMX_NCCL_BUILT", "0"), ("HVDMX_CUDA_BUILT", "0")]

# Needed only if a source includes <mxnet/engine.h> from the wheel's headers (none does
# today: mxnet_engine.cc mirrors the three small types it needs). mshadow/base.h would
# otherwise include mkl_blas.h and cuda.h, which the wheel lacks.
MXNET_HEADER_MACROS = [("MSHADOW_USE_MKL", "0"), ("MSHADOW_USE_CUDA", "0")]


def explicit_mpi() -> bool:
    """True when the user picked an MPI installation rather than the mpich wheel."""
    return bool(os.environ.get("MPICC") or os.environ.get("HVDMX_MPI_HOME"))


def runtime_requires() -> list:
    requires = ["mxnet==1.9.1", "numpy<1.24", "mpi4py", "cloudpickle"]
    if not explicit_mpi():
        requires.append("mpich")
    return requires


class BuildError(SystemExit):
    def __init__(self, message: str):
        super().__init__("error: hvdmx: " + message)


# --------------------------------------------------------------------------- MPI


def find_mpicc() -> list:
    """The MPI C wrapper as a command (a list), in the order the module docstring gives."""
    if os.environ.get("MPICC"):
        command = shlex.split(os.environ["MPICC"])
        if not shutil.which(command[0]):
            raise BuildError(f"MPICC={os.environ['MPICC']!r} is not an executable.")
        return command
    home = os.environ.get("HVDMX_MPI_HOME")
    if home:
        path = os.path.join(home, "bin", "mpicc")
        if not os.access(path, os.X_OK):
            raise BuildError(
                f"HVDMX_MPI_HOME={home!r} has no bin/mpicc. Point it at the MPI "
                "installation prefix, or set MPICC=/path/to/mpicc instead."
            )
        return [path]
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpicc")
    if os.access(beside_python, os.X_OK):
        return [beside_python]
    on_path = shutil.which("mpicc")
    if on_path:
        return [on_path]
    raise BuildError(
        "no MPI found: no mpicc beside the Python interpreter or on PATH. Either "
        "`pip install mpich` into this environment, or use a system MPI with "
        "MPICC=/path/to/mpicc or HVDMX_MPI_HOME=/path/to/mpi/prefix."
    )


def _run(command: list) -> str:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    return result.stdout.strip() if result.returncode == 0 else ""


def mpi_wrapper_flags(mpicc: list) -> list:
    """The wrapper's compile and link flags, without the compiler itself."""
    compile_flags = _run(mpicc + ["--showme:compile"])  # Open MPI
    link_flags = _run(mpicc + ["--showme:link"])
    if compile_flags or link_flags:
        return shlex.split(compile_flags) + shlex.split(link_flags)
    shown = shlex.split(_run(mpicc + ["-show"]))  # MPICH, Intel MPI, MVAPICH
    if not shown:
        raise BuildError(
            f"{' '.join(mpicc)} answered neither --showme:compile (Open MPI) nor -show "
            "(MPICH). Set MPICC to the C wrapper of an MPI installation."
        )
    return shown[1:]


class MpiFlags:
    """Flags for compiling and linking against MPI, parsed from its wrapper."""

    def __init__(self, tokens: list, keep_rpath: bool):
        self.include_dirs = []
        self.library_dirs = []
        self.libraries = []
        self.macros = []
        self.compile_args = []
        self.link_args = []
        self.rpaths = []
        self._parse(list(tokens))
        if not keep_rpath:
            self.rpaths = []

    @staticmethod
    def _add(flags: list, flag):
        if flag not in flags:
            flags.append(flag)

    def _parse(self, tokens: list):
        linker_words = []
        while tokens:
            token = tokens.pop(0)
            if token in ("-I", "-L", "-l", "-D", "-isystem") and tokens:
                token += tokens.pop(0)
            if token.startswith("-isystem"):
                self._add(self.include_dirs, token[len("-isystem") :])
            elif token.startswith("-I"):
                self._add(self.include_dirs, token[2:])
            elif token.startswith("-L"):
                self._add(self.library_dirs, token[2:])
            elif token.startswith("-l"):
                self._add(self.libraries, token[2:])
            elif token.startswith("-D"):
                name, _, value = token[2:].partition("=")
                self._add(self.macros, (name, value or None))
            elif token.startswith("-Wl,"):
                linker_words += token[4:].split(",")
            elif token == "-Xlinker" and tokens:
                linker_words.append(tokens.pop(0))
            elif token in ("-pthread", "-fopenmp"):
                self._add(self.compile_args, token)
                self._add(self.link_args, token)
            elif token.startswith("-"):
                self._add(self.compile_args, token)
            else:
                self._add(self.link_args, token)  # a library given by path
        while linker_words:
            word = linker_words.pop(0)
            if word in ("-rpath", "-R") and linker_words:
                self._add(self.rpaths, linker_words.pop(0))
            elif word.startswith("-rpath="):
                self._add(self.rpaths, word[len("-rpath=") :])
            elif word in ("--enable-new-dtags", "--disable-new-dtags"):
                pass  # we choose: RUNPATH, so LD_LIBRARY_PATH can still override
            else:
                self.link_args.append("-Wl," + word)


MPI_VENDOR_PROBE = r"""
#include <mpi.h>
#define HVDMX_STR_(x) #x
#define HVDMX_STR(x) HVDMX_STR_(x)
#if defined(I_MPI_VERSION)
hvdmx_mpi_vendor "Intel MPI " I_MPI_VERSION
#elif defined(MVAPICH2_VERSION)
hvdmx_mpi_vendor "MVAPICH2 " MVAPICH2_VERSION
#elif defined(OMPI_MAJOR_VERSION)
hvdmx_mpi_vendor "Open MPI " HVDMX_STR(OMPI_MAJOR_VERSION) "." HVDMX_STR(OMPI_MINOR_VERSION) "." HVDMX_STR(OMPI_RELEASE_VERSION)
#elif defined(MPICH_VERSION)
hvdmx_mpi_vendor "MPICH " MPICH_VERSION
#else
hvdmx_mpi_vendor "MPI " HVDMX_STR(MPI_VERSION) "." HVDMX_STR(MPI_SUBVERSION)
#endif
"""  # noqa: E501 (a line of C)


def mpi_vendor(compiler, mpi: MpiFlags) -> str:
    """'MPICH 5.0.2', 'Open MPI 4.1.5', ...: read from mpi.h, which also checks it is found."""
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "mpi_vendor.c")
        output = os.path.join(tmp, "mpi_vendor.i")
        with open(source, "w") as f:
            f.write(MPI_VENDOR_PROBE)
        try:
            compiler.preprocess(
                source, output, macros=mpi.macros, include_dirs=mpi.include_dirs
            )
        except CompileError as e:
            raise BuildError(
                f"cannot preprocess <mpi.h> with include dirs {mpi.include_dirs}: {e}"
            ) from e
        with open(output) as f:
            for line in f:
                if line.startswith("hvdmx_mpi_vendor"):
                    return "".join(re.findall(r'"([^"]*)"', line)).strip()
    raise BuildError("could not read the MPI version from <mpi.h>.")


# ------------------------------------------------------------------------- MXNet


def mxnet_include_dir() -> str:
    """mxnet/include of the installed wheel, found without importing mxnet."""
    spec = importlib.util.find_spec("mxnet")
    if spec is not None and spec.origin:
        include = os.path.join(os.path.dirname(spec.origin), "include")
        if os.path.isfile(os.path.join(include, "mxnet", "c_api.h")):
            return include
    raise BuildError(
        "MXNet headers not found (mxnet/include/mxnet/c_api.h). Install the wheel "
        "first: pip install mxnet==1.9.1 (it is a build requirement in pyproject.toml)."
    )


# ---------------------------------------------------------------------- building


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class ObjectFreshness:
    """ParallelCompile's needs_recompile: an object file is rebuilt when it is older
    than its source, any header under csrc/hvdmx, or setup.py, or when the compile
    command changed since the last build (see build_ext.build_extensions). Either
    way an object compiled during this build is not compiled again for the second
    module that shares it (bindings_support.cc)."""

    def __init__(self):
        self.force = True
        self.started = time.time()

    def __call__(self, obj: str, src: str) -> bool:
        if self.force:
            return os.stat(obj).st_mtime < self.started
        inputs = [src, __file__] + glob.glob(os.path.join(CSRC_DIR, "*", "*.h"))
        newest_input = max(os.stat(path).st_mtime for path in inputs)
        return os.stat(obj).st_mtime < newest_input


object_freshness = ObjectFreshness()


class build_ext(_pybind11_build_ext):
    """Adds the MPI and MXNet flags to the core library and the modules just before
    they are compiled, so that commands which compile nothing (egg_info, sdist)
    need neither."""

    def get_ext_filename(self, fullname: str) -> str:
        # A library, not a module: no EXT_SUFFIX. distutils asks with the last
        # part of the name too (get_ext_fullpath).
        for library, file in ((CORE_LIBRARY, CORE_LIBRARY_FILE), (MPI_PLUGIN, MPI_PLUGIN_FILE)):
            if fullname in (library, library.split(".")[-1]):
                return os.path.join(*fullname.split(".")[:-1], file)
        return super().get_ext_filename(fullname)

    def build_extensions(self):
        mpicc = find_mpicc()
        mpi = MpiFlags(mpi_wrapper_flags(mpicc), keep_rpath=explicit_mpi())
        vendor = mpi_vendor(self.compiler, mpi)
        mxnet_include = mxnet_include_dir()
        if explicit_mpi():
            rpaths = mpi.rpaths
        else:
            rpaths = ["$ORIGIN/../../.."]  # See Note [Finding libmpi at run time]
        # The core library, built first (it is the first extension): where the
        # modules link it from.
        core_dir = os.path.dirname(self.get_ext_fullpath(CORE_LIBRARY))
        for ext in self.extensions:
            ext.define_macros += MXNET_HEADER_MACROS + GPU_MACROS
            ext.libraries += ["dl", "pthread"]
            if ext.name == MPI_PLUGIN:
                # The one MPI user (Note [MPI as a plugin]): MPI's flags, its
                # vendor, and the rpath of Note [Finding libmpi at run time].
                ext.include_dirs += mpi.include_dirs
                ext.library_dirs += mpi.library_dirs
                ext.libraries += mpi.libraries
                ext.define_macros += mpi.macros + [("HVDMX_MPI_VENDOR", f'"{vendor}"')]
                ext.extra_compile_args += mpi.compile_args
                ext.extra_link_args += (
                    mpi.link_args
                    + ["-Wl,--enable-new-dtags"]
                    + ["-Wl,-rpath," + path for path in rpaths]
                )
                continue
            if ext.name != CORE_LIBRARY:
                ext.library_dirs.append(core_dir)
                ext.libraries.append(CORE_LIBRARY_NAME)
            # The modules find the core library beside them (the tests' module
            # from tests/).
            ext_rpaths = {CORE_MODULE: ["$ORIGIN"], TESTING_MODULE: ["$ORIGIN/../hvdmx"]}
            # -isystem: the MXNet headers are not ours to keep -Wall clean.
            ext.extra_compile_args += ["-isystem", mxnet_include]
            ext.extra_link_args += ["-Wl,--enable-new-dtags"] + [
                "-Wl,-rpath," + path for path in ext_rpaths.get(ext.name, [])
            ]
        print(
            f"hvdmx: MPI {vendor} from {' '.join(mpicc)}; MXNet headers {mxnet_include}"
        )
        # Object files are reused only if the compile command is the one that made
        # them; the record is written after a successful build, so a build that
        # fails half way with new flags leaves no stale objects marked fresh.
        record = os.path.join(self.build_temp, "hvdmx_compile_command.sha256")
        digest = self._compile_command_digest()
        previous = ""
        if os.path.exists(record):
            with open(record) as f:
                previous = f.read()
        object_freshness.force = previous != digest
        if object_freshness.force and previous:
            os.remove(record)
        super().build_extensions()
        os.makedirs(self.build_temp, exist_ok=True)
        with open(record, "w") as f:
            f.write(digest)

    def _compile_command_digest(self) -> str:
        signature = repr(
            [self.compiler.compiler_so, getattr(self.compiler, "compiler_so_cxx", None)]
            + [
                (ext.include_dirs, ext.define_macros, ext.extra_compile_args)
                for ext in self.extensions
            ]
        )
        return hashlib.sha256(signature.encode()).hexdigest()


TESTING_DIR = os.path.join(CSRC_DIR, "testing")
# The pybind11 files, compiled into each module rather than into the core library.
CORE_BINDINGS = os.path.join(CSRC_DIR, "python", "bindings.cc")
BINDINGS_SUPPORT = os.path.join(CSRC_DIR, "python", "bindings_support.cc")
CORE_LIBRARY = "hvdmx.libhvdmx_core"
CORE_LIBRARY_NAME = "hvdmx_core"  # -lhvdmx_core
CORE_LIBRARY_FILE = "libhvdmx_core.so"
CORE_MODULE = "hvdmx._core"
MPI_PLUGIN = "hvdmx.libhvdmx_mpi"
MPI_PLUGIN_FILE = "libhvdmx_mpi.so"
MPI_PLUGIN_SOURCE = os.path.join(CSRC_DIR, "mpi", "mpi_plugin.c")
TESTING_MODULE = "tests._hvdmx_testing"
# -ffp-contract=off: see Note [Half precision summed in float32].
COMPILE_ARGS = ["-O3", "-Wall", "-ffp-contract=off"]


def module(name: str, sources: list) -> Pybind11Extension:
    """A Python module: _core or the tests' module."""
    return Pybind11Extension(
        name,
        sources,
        depends=sorted(glob.glob(os.path.join(CSRC_DIR, "*", "*.h"))),
        include_dirs=[CSRC_DIR],
        # Pybind11Extension adds -std=c++17, -fvisibility=hidden and -g0.
        cxx_std=17,
        extra_compile_args=list(COMPILE_ARGS),
        language="c++",
    )


def core_library(sources: list) -> Extension:
    """The core as a shared library: default visibility (the modules call into
    it), its soname what the modules record as NEEDED."""
    return Extension(
        CORE_LIBRARY,
        sources,
        depends=sorted(glob.glob(os.path.join(CSRC_DIR, "*", "*.h"))),
        include_dirs=[CSRC_DIR],
        extra_compile_args=["-std=c++17", "-g0"] + COMPILE_ARGS,
        extra_link_args=["-Wl,-soname," + CORE_LIBRARY_FILE],
        language="c++",
    )


def mpi_plugin() -> Extension:
    """The MPI plugin: plain C, one source (Note [MPI as a plugin])."""
    return Extension(
        MPI_PLUGIN,
        [MPI_PLUGIN_SOURCE],
        depends=[os.path.join(CSRC_DIR, "mpi", "mpi_plugin.h")],
        include_dirs=[CSRC_DIR],
        extra_compile_args=["-O2", "-Wall", "-fvisibility=hidden", "-g0"],
        extra_link_args=["-Wl,-soname," + MPI_PLUGIN_FILE],
        language="c",
    )


def core_sources() -> list:
    sources = sorted(glob.glob(os.path.join(CSRC_DIR, "*", "*.cc")))
    if not sources:
        raise BuildError(f"no C++ sources in {CSRC_DIR}/*/*.cc")
    return [
        s
        for s in sources
        if os.path.dirname(s) != TESTING_DIR and s not in (CORE_BINDINGS, BINDINGS_SUPPORT)
    ]


def extensions() -> list:
    """The core library, hvdmx._core and the MPI plugin, and with `setup.py build_ext` the tests'
    module tests/_hvdmx_testing (see the module docstring). The library comes
    first: the modules link it."""
    built = [
        core_library(core_sources()),
        module(CORE_MODULE, [CORE_BINDINGS, BINDINGS_SUPPORT]),
        mpi_plugin(),
    ]
    if "build_ext" in sys.argv[1:]:
        testing = sorted(glob.glob(os.path.join(TESTING_DIR, "*.cc")))
        built.append(module(TESTING_MODULE, testing + [BINDINGS_SUPPORT]))
    return built


# Guarded: tools/build_wheel.py imports this file for the lists and flags above
# (setuptools runs it as __main__).
if __name__ == "__main__":
    ParallelCompile(
        "HVDMX_BUILD_JOBS", default=usable_cpus(), needs_recompile=object_freshness
    ).install()

    setup(
        ext_modules=extensions(),
        cmdclass={"build_ext": build_ext},
        install_requires=runtime_requires(),
    )
