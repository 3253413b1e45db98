"""Runs a program written for ``horovod.mxnet`` on hvdmx, without editing it.

    mpiexec -n 2 python -m hvdmx.as_horovod train.py --epochs 3
    mpiexec -n 2 python -m hvdmx.as_horovod -m sockeye.train --horovod ...

For code you cannot edit (an installed package such as Sockeye, which imports
``horovod.mxnet`` itself), this makes ``import horovod.mxnet`` give hvdmx and
then runs the script or module as ``python`` would: ``__name__`` is
``"__main__"``, ``sys.argv`` holds the script and its arguments, and
``sys.path[0]`` is the script's directory (the current directory with ``-m``).
In code you can edit, ``import hvdmx as hvd`` does the same.

``horovod.mxnet`` and its submodules ``mpi_ops``, ``functions``,
``compression`` and ``elastic`` (``hvd.elastic``, which Horovod's MXNet
binding lacks) become modules of those names whose attributes are hvdmx's
(``horovod.mxnet.allreduce is hvdmx.allreduce``; ``mpi_ops`` forwards to
hvdmx, which exports everything Horovod's does), so every form of import
works. ``horovod`` itself is a package holding ``mxnet``, Horovod's
launcher function ``horovod.run`` (also ``horovod.runner.run``), which is
``hvdmx.run_function`` (its ranks run under this alias as well),
``horovod.spark.run``, which is ``hvdmx.spark.run`` (the same), and
``horovod.common.exceptions`` and ``horovod.common.elastic``, which are
hvdmx.errors and hvdmx.elastic (HorovodInternalError,
HostsUpdatedInterrupt; State, ObjectState). Nothing of
hvdmx is imported until the program uses a name, so, as with Horovod,
importing ``horovod.mxnet`` does not start MPI: ``hvd.init()`` does.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import runpy
import sys
import types

USAGE = """\
usage: python -m hvdmx.as_horovod SCRIPT [ARGS ...]
       python -m hvdmx.as_horovod -m MODULE [ARGS ...]

Runs SCRIPT (or MODULE, as python -m would) with `import horovod.mxnet`
giving hvdmx, for programs written for Horovod that you cannot edit.
Launch it like any hvdmx program: mpiexec -n 2 python -m hvdmx.as_horovod ...
"""


def _forwarder(name: str, target: str) -> types.ModuleType:
    """A module named ``name`` whose attributes are those of the module
    ``target``, looked up (and so imported) on first use."""
    module = types.ModuleType(name, f"hvdmx standing in for {name}")

    def __getattr__(attr):
        if attr.startswith("__"):  # __path__, __file__, ...: not forwarded
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        return getattr(importlib.import_module(target), attr)

    # PEP 562's module hooks, set on the new module's namespace.
    vars(module)["__getattr__"] = __getattr__
    vars(module)["__dir__"] = lambda: dir(importlib.import_module(target))
    return module


def run(*args, **kwargs):
    """horovod.run: hvdmx.run_function (hvdmx/runner/function_job.py), with
    Horovod's arguments."""
    from hvdmx.runner.function_job import run_function
    return run_function(*args, **kwargs)


def spark_run(*args, **kwargs):
    """horovod.spark.run: hvdmx.spark.run (hvdmx/spark/driver.py), with
    Horovod's arguments; its ranks run under this alias as well."""
    from hvdmx.spark import run as hvdmx_spark_run
    return hvdmx_spark_run(*args, **kwargs)


def install() -> None:
    """Makes ``import horovod.mxnet`` (and the submodules above) give hvdmx
    in this process. Fails if the real Horovod is already imported: the
    program would then hold two libraries' state."""
    present = sys.modules.get("horovod")
    if present is not None:
        if getattr(present, "_hvdmx_alias", False):
            return
        raise RuntimeError(
            f"hvdmx.as_horovod: module 'horovod' is already imported from "
            f"{getattr(present, '__file__', None)!r}; install the alias before anything "
            "imports Horovod (run the program with python -m hvdmx.as_horovod)")
    # Modules named as Horovod's, so that every form of import finds them
    # (`import horovod.mxnet.mpi_ops as m` looks the last name up as an
    # attribute of horovod.mxnet), forwarding to hvdmx's.
    package = _forwarder("horovod.mxnet", "hvdmx")
    package.__path__ = []  # a package: its submodules are found in sys.modules
    for sub, target in (("mpi_ops", "hvdmx"), ("functions", "hvdmx.functions"),
                        ("compression", "hvdmx.compression"), ("elastic", "hvdmx.elastic")):
        module = _forwarder(f"horovod.mxnet.{sub}", target)
        setattr(package, sub, module)
        sys.modules[module.__name__] = module
    sys.modules["horovod.mxnet"] = package
    runner = types.ModuleType("horovod.runner", "hvdmx standing in for horovod.runner")
    vars(runner).update(run=run)
    sys.modules["horovod.runner"] = runner
    # horovod.common: where Horovod keeps the elastic exceptions
    # (HorovodInternalError, HostsUpdatedInterrupt) and its elastic State.
    common = types.ModuleType("horovod.common", "hvdmx standing in for horovod.common")
    common.__path__ = []
    for sub, target in (("exceptions", "hvdmx.errors"), ("elastic", "hvdmx.elastic")):
        module = _forwarder(f"horovod.common.{sub}", target)
        setattr(common, sub, module)
        sys.modules[module.__name__] = module
    sys.modules["horovod.common"] = common
    # horovod.spark: hvdmx.spark.run (pyspark is imported when it is called).
    spark = types.ModuleType("horovod.spark", "hvdmx standing in for horovod.spark")
    vars(spark).update(run=spark_run)
    sys.modules["horovod.spark"] = spark
    horovod = types.ModuleType("horovod", "hvdmx standing in for Horovod")
    horovod.__path__ = []
    vars(horovod).update(_hvdmx_alias=True, mxnet=package, runner=runner, run=run,
                         common=common, spark=spark)
    sys.modules["horovod"] = horovod


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        (sys.stdout if args else sys.stderr).write(USAGE)
        return 0 if args else 2
    if args[0] == "-m":
        if len(args) < 2:
            sys.stderr.write("hvdmx.as_horovod: -m needs a module name, e.g. -m sockeye.train\n\n"
                             + USAGE)
            return 2
        install()
        try:
            # What python -m checks first: that the module can be found.
            found = importlib.util.find_spec(args[1]) is not None
        except (ImportError, ValueError) as error:
            sys.stderr.write(f"hvdmx.as_horovod: cannot find module {args[1]!r} ({error})\n")
            return 1
        if not found:
            sys.stderr.write(f"hvdmx.as_horovod: no module named {args[1]!r}\n")
            return 1
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return 0
    script = args[0]
    if not os.path.isfile(script):
        sys.stderr.write(f"hvdmx.as_horovod: script {script!r} is not a file; give a Python "
                         "script, or -m MODULE\n")
        return 2
    install()
    sys.argv = args
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
