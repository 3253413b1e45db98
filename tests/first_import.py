"""Imports each of hvdmx's modules first, as a fresh interpreter would, and
runs a snippet after it: for tests/test_layers.py and tests/test_api.py.

One interpreter imports MXNet (and with it numpy), nothing of hvdmx, and
forks a child a module, in which that module is the first of hvdmx imported
(checked): as in a fresh interpreter as far as hvdmx's own imports go, which
are what is checked, without each child importing MXNet again (2 s each;
issue 50). Not mpi4py: its import initializes MPI, which a fork must not copy.
Each child's stdout and stderr go to a file of its own; it ends with
os._exit, as an interpreter's own exit with MXNet loaded takes about a second
in a forked child (what `then` needs done before, it does)."""
import os
import subprocess
import sys

CHILDREN = """
import os, sys, traceback
import mxnet
out, then = sys.argv[1], sys.argv[2]
for module in sys.argv[3:]:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        fd = os.open(os.path.join(out, module), os.O_WRONLY | os.O_CREAT)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        try:
            loaded = [m for m in sys.modules if m == "hvdmx" or m.startswith("hvdmx.")]
            assert not loaded, f"hvdmx modules imported before {module}: {loaded}"
            __import__(module)
            exec(then, {})
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    print(module, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


def import_each_first(modules, out, then="", env=None, timeout=300):
    """{module: (exit code, output)} of a child that imports the module first
    and then runs the code `then`; `out` is an empty directory for the outputs."""
    result = subprocess.run([sys.executable, "-c", CHILDREN, str(out), then, *modules],
                            capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr
    codes = dict(line.split() for line in result.stdout.splitlines())
    assert sorted(codes) == sorted(modules), result.stdout + result.stderr
    return {module: (int(code), open(os.path.join(out, module)).read())
            for module, code in codes.items()}
