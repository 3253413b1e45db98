"""python -m hvdmx.as_horovod: programs that import horovod.mxnet run on hvdmx.

Each test starts its own interpreter, as a user would, because the alias and
MPI's start are process-wide. tests/test_horovod_programs.py runs a real one
(Sockeye) under mpiexec.
"""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENV = dict(os.environ, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1",
           PYTHONPATH=os.pathsep.join([ROOT] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))


def as_horovod(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "hvdmx.as_horovod", *args], cwd=cwd,
                          env=env or ENV, capture_output=True, text=True, timeout=120)


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_script_sees_hvdmx_under_horovod_names(tmp_path):
    script = write(tmp_path / "train.py", """\
        import sys
        import horovod.mxnet as hvd
        import hvdmx
        # Every form of import a Horovod program may use.
        from horovod.mxnet.mpi_ops import allreduce
        from horovod.mxnet.compression import Compression
        from horovod.mxnet.functions import broadcast_object
        from horovod.mxnet import mpi_ops, functions, compression
        import horovod.mxnet.mpi_ops as ops_module
        import horovod
        assert horovod.mxnet is hvd and hvd.__name__ == "horovod.mxnet"
        assert hvd.DistributedTrainer is hvdmx.DistributedTrainer and hvd.Sum == hvdmx.Sum
        assert allreduce is mpi_ops.allreduce is ops_module.allreduce is hvdmx.allreduce
        assert hvd.mpi_ops is ops_module and mpi_ops.init is hvdmx.init
        assert Compression is compression.Compression is hvdmx.Compression
        assert broadcast_object is functions.broadcast_object is hvdmx.broadcast_object
        assert "init" in dir(hvd) and "allgather_object" in dir(functions)
        # Every name Horovod's functions module holds (its own two and what it imports).
        from horovod.mxnet.functions import allgather, allgather_object, broadcast_, rank, size
        assert (allgather, allgather_object, broadcast_, rank, size) == (
            hvdmx.allgather, hvdmx.allgather_object, hvdmx.broadcast_, hvdmx.rank, hvdmx.size)
        print(__name__, sys.argv[1:], sys.path[0])
        """)
    result = as_horovod(script, "--epochs", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["__main__", "['--epochs',", "'3']", str(tmp_path)]


def test_import_does_not_start_mpi_init_does(tmp_path):
    # Sockeye's pattern: import Horovod, keep mpi4py from starting MPI, and take
    # MPI.Is_initialized() to mean that hvd.init() has run.
    script = write(tmp_path / "train.py", """\
        import horovod.mxnet as hvd
        import mpi4py
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI
        import atexit
        import mxnet as mx
        assert not MPI.Is_initialized(), "importing horovod.mxnet started MPI"
        # Runs last at exit, being registered first.
        atexit.register(lambda: print("finalized", MPI.Is_finalized()))
        hvd.init()
        assert MPI.Is_initialized()
        out = hvd.allreduce(mx.nd.array([1.0, 2.0]), op=hvd.Sum, name="x")
        print(hvd.rank(), hvd.size(), out.asnumpy().tolist())
        """)
    result = as_horovod(script)
    assert result.returncode == 0, result.stderr
    # hvdmx started MPI, so it finalized it at exit, as Horovod does.
    assert result.stdout.split() == ["0", "1", "[1.0,", "2.0]", "finalized", "True"]


def test_mpi_started_by_mpi4py_is_left_to_it(tmp_path):
    script = write(tmp_path / "train.py", """\
        import atexit
        from mpi4py import MPI
        import horovod.mxnet as hvd
        atexit.register(lambda: print("finalized", MPI.Is_finalized()))
        hvd.init()
        hvd.shutdown()
        hvd.init()  # init again after shutdown: MPI must still be running
        print(hvd.size())
        """)
    result = as_horovod(script)
    assert result.returncode == 0, result.stderr
    # mpi4py finalizes after every atexit function has run.
    assert result.stdout.split() == ["1", "finalized", "False"]


def test_module_runs_as_main(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write(package / "train.py", """\
        import sys
        import horovod.mxnet as hvd
        hvd.init()
        print(__name__, sys.argv[1:], hvd.size())
        """)
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(tmp_path), ENV["PYTHONPATH"]]))
    result = as_horovod("-m", "pkg.train", "-x", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["__main__", "['-x']", "1"]


def test_exit_status_is_the_programs(tmp_path):
    script = write(tmp_path / "fail.py", "import sys\nsys.exit(3)\n")
    assert as_horovod(script).returncode == 3


def test_usage():
    result = as_horovod()
    assert result.returncode == 2
    assert "usage: python -m hvdmx.as_horovod SCRIPT [ARGS ...]" in result.stderr
    result = as_horovod("--help")
    assert result.returncode == 0 and "-m MODULE [ARGS ...]" in result.stdout


def test_bad_arguments_are_named(tmp_path):
    result = as_horovod("-m")
    assert result.returncode == 2
    assert "-m needs a module name, e.g. -m sockeye.train" in result.stderr
    result = as_horovod("-m", "no_such_module")
    assert result.returncode == 1
    assert result.stderr == "hvdmx.as_horovod: no module named 'no_such_module'\n"
    result = as_horovod("-m", "no_such_package.train")
    assert result.returncode == 1
    assert result.stderr.startswith("hvdmx.as_horovod: cannot find module "
                                    "'no_such_package.train' (No module named "
                                    "'no_such_package')")
    missing = str(tmp_path / "nope.py")
    result = as_horovod(missing)
    assert result.returncode == 2
    assert f"script {missing!r} is not a file; give a Python script, or -m MODULE" \
        in result.stderr


def test_unknown_names_raise_attribute_error(tmp_path):
    script = write(tmp_path / "train.py", """\
        import horovod.mxnet as hvd
        try:
            hvd.no_such_call
        except AttributeError as e:
            print(e)
        """)
    result = as_horovod(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "module 'hvdmx' has no attribute 'no_such_call'"


def test_refuses_when_real_horovod_is_already_imported(tmp_path):
    # A stand-in for an installed Horovod, imported before the alias.
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text("")
    code = ("import horovod, hvdmx.as_horovod as a\n"
            "try:\n    a.install()\nexcept RuntimeError as e:\n    print(e)\n")
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(tmp_path), ENV["PYTHONPATH"]]))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "module 'horovod' is already imported from" in result.stdout
    assert "install the alias before anything imports Horovod" in result.stdout
