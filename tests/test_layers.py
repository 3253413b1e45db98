"""The Python layer imports in one direction: the layers listed in
hvdmx/__init__.py's docstring, bottom up. Every import of hvdmx's own modules
(at a module's top or inside a function) names a module listed above the
importer, and each module imports first in a fresh interpreter. The rooms
(hvdmx/README.md): the rank API never imports the launcher (hvdmx/runner/),
and the launcher and the rendezvous never import MXNet or the rank API."""
import ast
import os
import re
import subprocess
import sys

import pytest

import hvdmx
from first_import import import_each_first

PACKAGE = os.path.dirname(hvdmx.__file__)


def layers():
    """The module names of the docstring's list, bottom up."""
    doc = hvdmx.__doc__
    block = doc[doc.index("Layers, bottom up"):]
    names = re.findall(r"^    ([\w.]+)  ", block, re.M)
    assert names, "no layer list in hvdmx/__init__.py's docstring"
    return names


def module_files():
    """{file path: its layer}: hvdmx/x.py is layer x, hvdmx/__init__.py the
    facade 'hvdmx', a subpackage's hvdmx/x/y.py layer x.y and its
    hvdmx/x/__init__.py layer x."""
    files = {}
    for folder, dirs, names in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, PACKAGE)[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[path] = ".".join(parts) or "hvdmx"
    return files


def is_module(name: str) -> bool:
    """Whether hvdmx.<name> (dotted) is a module or a package of hvdmx."""
    where = os.path.join(PACKAGE, *name.split("."))
    return name == "_core" or os.path.exists(where + ".py") or os.path.isdir(where)


def layer_of(parts):
    """The layer of an import of hvdmx.<parts...>: the longest of its
    prefixes that is a module of hvdmx (an import of a module's name, as in
    ``from hvdmx.ops import allreduce``, is the module's)."""
    for end in range(len(parts), 0, -1):
        if is_module(".".join(parts[:end])):
            return ".".join(parts[:end])
    return parts[0]


def imported_layers(path: str):
    """(line, layer) for each import of a module of hvdmx in the file."""
    tree = ast.parse(open(path).read(), path)
    # The package a relative import starts from, as a list of names.
    package = ["hvdmx"] + os.path.relpath(os.path.dirname(path), PACKAGE).split(os.sep)
    package = [p for p in package if p != "."]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "hvdmx":
                    yield node.lineno, layer_of(parts[1:]) if len(parts) > 1 else "hvdmx"
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                parts = base + (node.module.split(".") if node.module else [])
            else:
                parts = node.module.split(".")
            if parts[0] != "hvdmx":
                continue
            for alias in node.names:  # from hvdmx[.x] import y: module [x.]y, or a name of [x]
                yield node.lineno, layer_of(parts[1:] + [alias.name]) if len(parts) > 1 else \
                    alias.name if is_module(alias.name) else "hvdmx"


def test_every_module_is_in_the_list_once():
    order = layers()
    assert len(order) == len(set(order)), order
    present = set(module_files().values()) | {"_core"}
    assert present == set(order), (f"not in the list: {sorted(present - set(order))}; "
                                   f"listed but missing: {sorted(set(order) - present)}")


def test_no_module_imports_one_above_it():
    order = {name: i for i, name in enumerate(layers())}
    upward = []
    for path, layer in sorted(module_files().items()):
        for line, imported in imported_layers(path):
            if imported == layer:
                continue
            assert imported in order, f"{path}:{line} imports hvdmx.{imported}, not in the list"
            if order[imported] > order[layer]:
                upward.append(f"{os.path.relpath(path, PACKAGE)}:{line} ({layer}) imports "
                              f"{imported}, a layer above it")
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    # The checker itself: a module of the list that imports one above it.
    fake = tmp_path / "hvdmx"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "errors.py").write_text("def f():\n    from hvdmx.basics import rank\n")
    (fake / "ops.py").write_text("from . import basics\nfrom hvdmx import allreduce\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", str(fake))
    assert list(imported_layers(str(fake / "errors.py"))) == [(2, "basics")]
    assert list(imported_layers(str(fake / "ops.py"))) == [(1, "hvdmx"), (2, "hvdmx")]
    (fake / "basics.py").write_text("")
    assert list(imported_layers(str(fake / "ops.py"))) == [(1, "basics"), (2, "hvdmx")]


# ---- the rooms ----------------------------------------------------------------

# The launcher's rooms: what starts a job (hvdmx/runner/) and the rendezvous
# it serves (hvdmx/rendezvous/, which the ranks join).
LAUNCHER = ("runner", "rendezvous", "spark")
# What the launcher may import of hvdmx besides its rooms: the version and MPI's identity
# (which MPI hvdmx was built with, for the launcher-mismatch warning), not
# the rank API; neither loads MXNet.
MPI_IDENTITY = {"_mpi", "_core", "_version"}
# Programs on top of both sides, not the rank API: they run the launcher
# (run: python -m hvdmx.run; as_horovod: horovod.run; bench.cli: the
# runner's number flags for its own; build_report: loads MPI as hvdmxrun does).
PROGRAMS = {"run", "as_horovod", "bench.cli", "build_report"}
# The rank API's one door to the launcher: the facade's hvd.run_function
# (Horovod's horovod.run), a launcher a script calls; loaded on first use,
# never at import (test_the_rank_api_loads_no_launcher).
DOORS = {("hvdmx", "runner.function_job")}
# The packages the launcher may import besides the standard library: mpi4py
# (loaded without MPI_Init, for MPI's identity) and cloudpickle (for
# run_function's function and results). Never MXNet or numpy.
LAUNCHER_PACKAGES = {"mpi4py", "cloudpickle"}
# hvdmx.spark, the launcher of a Spark job, may also import pyspark (in a
# function: it is not installed everywhere) and numpy (a rank's share of a
# DataFrame travels as arrays); never MXNet (imported in the rank's own
# process, by rank_dataset) nor the rank API.
SPARK_PACKAGES = {"pyspark", "numpy"}
# The one module of hvdmx.spark that a rank calls: rank_dataset imports MXNet
# in its body (the rank has loaded it), never at the module's import.
RANK_SIDE_OF_SPARK = {"spark.data": {"mxnet"}}


def in_rooms(layer: str, rooms) -> bool:
    return layer.split(".")[0] in rooms


def other_imports(path: str):
    """(line, top-level name) of each absolute import of a package other
    than hvdmx in the file (at its top or inside a function)."""
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            if name.split(".")[0] != "hvdmx":
                yield node.lineno, name.split(".")[0]


def rank_api_imports_of_the_runner():
    for path, layer in sorted(module_files().items()):
        if in_rooms(layer, LAUNCHER) or layer in PROGRAMS:
            continue
        for line, imported in imported_layers(path):
            if in_rooms(imported, ("runner",)) and (layer, imported) not in DOORS:
                yield f"{os.path.relpath(path, PACKAGE)}:{line} ({layer}) imports {imported}"


def launcher_imports_of_the_rank_side():
    for path, layer in sorted(module_files().items()):
        if not in_rooms(layer, LAUNCHER):
            continue
        where = os.path.relpath(path, PACKAGE)
        # The rendezvous is shared: standard library and itself only.
        rooms = ("rendezvous",) if in_rooms(layer, ("rendezvous",)) else LAUNCHER
        for line, imported in imported_layers(path):
            if not (in_rooms(imported, rooms) or
                    (rooms == LAUNCHER and imported in MPI_IDENTITY)):
                yield f"{where}:{line} ({layer}) imports hvdmx.{imported}"
        for line, name in other_imports(path):
            if name not in sys.stdlib_module_names and \
                    not (rooms == LAUNCHER and name in LAUNCHER_PACKAGES) and \
                    not (in_rooms(layer, ("spark",)) and name in SPARK_PACKAGES) and \
                    name not in RANK_SIDE_OF_SPARK.get(layer, ()):
                yield f"{where}:{line} ({layer}) imports {name}"


def test_the_rank_api_never_imports_the_runner():
    found = list(rank_api_imports_of_the_runner())
    assert not found, "\n".join(found)


def test_the_runner_and_rendezvous_never_import_mxnet_or_the_rank_api():
    found = list(launcher_imports_of_the_rank_side())
    assert not found, "\n".join(found)


def test_the_room_checks_see_a_wrong_door(tmp_path, monkeypatch):
    fake = tmp_path / "hvdmx"
    (fake / "runner").mkdir(parents=True)
    (fake / "rendezvous").mkdir()
    for name in ("__init__.py", "ops.py", "_mpi.py", "runner/__init__.py", "runner/hosts.py",
                 "rendezvous/__init__.py", "rendezvous/wire.py"):
        (fake / name).write_text("")
    (fake / "trainer.py").write_text("def f():\n    from hvdmx.runner import hosts\n")
    (fake / "runner" / "mpi.py").write_text(
        "import os\nimport mxnet\nfrom hvdmx import ops, _mpi\nfrom hvdmx.runner import hosts\n")
    (fake / "rendezvous" / "client.py").write_text(
        "import socket\nimport mpi4py\nfrom hvdmx._mpi import x\nfrom . import wire\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", str(fake))
    assert list(rank_api_imports_of_the_runner()) == [
        "trainer.py:2 (trainer) imports runner.hosts"]
    assert sorted(launcher_imports_of_the_rank_side()) == [
        "rendezvous/client.py:2 (rendezvous.client) imports mpi4py",
        "rendezvous/client.py:3 (rendezvous.client) imports hvdmx._mpi",
        "runner/mpi.py:2 (runner.mpi) imports mxnet",
        "runner/mpi.py:3 (runner.mpi) imports hvdmx.ops"]


def outsiders_loaded(modules, packages):
    """What a fresh interpreter holds after importing ``modules`` that the
    launcher's rooms may not load: a module of ``packages``, or of hvdmx
    outside the launcher's rooms and MPI's identity."""
    code = (f"import sys\nfor m in {list(modules)!r}: __import__(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {tuple(packages)!r} or "
            "m.startswith('hvdmx.') and m.split('.')[1] not in "
            f"{LAUNCHER + tuple(MPI_IDENTITY)!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr
    return ast.literal_eval(result.stdout.strip())


def test_the_launcher_loads_no_mxnet_and_the_rank_api_no_launcher():
    # Every module of the launcher's rooms in one fresh interpreter: MXNet
    # and the rank API stay out. Then the rank API's modules (the facade's
    # names, hvd.elastic's): the launcher stays out.
    launcher = [m for m in SUBMODULES if in_rooms(m.removeprefix("hvdmx."), LAUNCHER)
                and not in_rooms(m.removeprefix("hvdmx."), ("spark",))]
    assert "hvdmx.runner.launch" in launcher and "hvdmx.rendezvous.client" in launcher
    assert outsiders_loaded(launcher, ("mxnet", "numpy")) == []
    code = ("import sys, hvdmx, hvdmx.elastic\n"
            "for module in (hvdmx, hvdmx.elastic):\n"
            "    [getattr(module, n) for n in module.__all__ if n != 'run_function']\n"
            "import hvdmx.checkpoint, hvdmx.elastic.gluon, hvdmx.elastic.module\n"
            "print(sorted(m for m in sys.modules if m.startswith('hvdmx.runner')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout


def test_spark_loads_no_mxnet_nor_the_rank_api():
    # hvdmx.spark runs in the Spark driver and in its tasks' Python workers:
    # numpy may come (a share of a DataFrame), MXNet and the rank API may not.
    spark = [m for m in SUBMODULES if in_rooms(m.removeprefix("hvdmx."), ("spark",))]
    assert "hvdmx.spark.driver" in spark and "hvdmx.spark.task" in spark
    assert outsiders_loaded(spark, ("mxnet",)) == []


def _declared_hook(function) -> bool:
    """Whether the function has no behaviour of its own, past its docstring:
    nothing, ``pass``, ``return None``, or raise NotImplementedError."""
    body = [s for s in function.body if not (isinstance(s, ast.Expr) and
                                             isinstance(s.value, ast.Constant))]
    if not body:
        return True
    if len(body) != 1:
        return False
    only = body[0]
    return isinstance(only, ast.Pass) or \
        (isinstance(only, ast.Return) and (only.value is None or ast.unparse(only.value) ==
                                           "None")) or \
        (isinstance(only, ast.Raise) and only.exc is not None and
         "NotImplementedError" in ast.unparse(only.exc))


def private_overrides():
    """(subclass, method) where a class of hvdmx overrides a private method
    (one underscore, not a dunder) of another class of hvdmx that has a body
    of its own: a door that only one side knows is there (issue 61:
    ElasticService overrode the rendezvous server's hooks; it now serves its
    connections through the server's public Service interface). A method
    with no behaviour of its own is the base's declared hook (elastic's
    _TrainingState), there to be overridden."""
    classes = {}
    for path in sorted(module_files()):
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ClassDef):
                methods = {f.name: _declared_hook(f) for f in node.body
                           if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
                bases = [b.id if isinstance(b, ast.Name) else b.attr if
                         isinstance(b, ast.Attribute) else "" for b in node.bases]
                classes.setdefault(node.name, []).append((bases, methods))
    for name, defs in sorted(classes.items()):
        for bases, methods in defs:
            for base in bases:
                for _, inherited in classes.get(base, []):
                    for method in sorted(set(methods) & set(inherited)):
                        if method.startswith("_") and not method.endswith("__") and \
                                not inherited[method]:
                            yield f"{name}.{method} overrides {base}.{method}"


def test_no_class_overrides_another_classes_private_method(tmp_path, monkeypatch):
    found = list(private_overrides())
    assert not found, "\n".join(found)
    fake = tmp_path / "hvdmx"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "server.py").write_text("class Server:\n    def _post(self): return 1\n"
                                    "    def close(self): pass\n"
                                    "    def _hook(self):\n        raise NotImplementedError\n")
    (fake / "service.py").write_text("from hvdmx.server import Server\n"
                                     "class Service(Server):\n    def _post(self): pass\n"
                                     "    def close(self): pass\n    def __init__(self): pass\n"
                                     "    def _hook(self): pass\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", str(fake))
    assert list(private_overrides()) == ["Service._post overrides Server._post"]


# ---- a Gluon trainer's state: one module -----------------------------------------

# The private fields of MXNet's Trainer, Module and their Updaters (with the
# updaters' states), which hvdmx/trainer_state.py alone reads and writes. A
# class's own code on ``self`` (DistributedTrainer is a Trainer) is not a
# reader from outside, nor a call of trainer_state's own functions.
MXNET_FIELDS = {"_params", "_optimizer", "_updaters", "_updater", "_kvstore",
                "_update_on_kvstore", "_kv_initialized", "_init_kvstore", "_contexts", "_context",
                "_param2idx", "_params_to_init", "_scale", "states", "states_synced",
                "aggregate_updates"}
# hvd.DistributedOptimizer's own field of that name (the optimizer it wraps),
# read right after an isinstance check names the object one.
OWN_FIELDS = {("optimizer.py", "optimizer._optimizer"), ("trainer.py", "optimizer._optimizer"),
              ("elastic/arrays.py", "optimizer._optimizer")}


def mxnet_field_accesses():
    for path in sorted(module_files()):
        where = os.path.relpath(path, PACKAGE)
        if where == "trainer_state.py":
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Attribute) and node.attr in MXNET_FIELDS and \
                    not (isinstance(node.value, ast.Name) and
                         node.value.id in ("self", "trainer_state")) and \
                    (where, ast.unparse(node)) not in OWN_FIELDS:
                yield f"{where}:{node.lineno} {ast.unparse(node)}"


def test_only_trainer_state_touches_mxnets_private_training_fields():
    found = list(mxnet_field_accesses())
    assert not found, "use hvdmx/trainer_state.py:\n" + "\n".join(found)


def test_the_field_check_sees_an_access(tmp_path, monkeypatch):
    fake = tmp_path / "hvdmx"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "trainer_state.py").write_text("def f(trainer):\n    return trainer._optimizer\n")
    (fake / "checkpoint.py").write_text(
        "def f(trainer, updater):\n    trainer._updaters[0].states[1] = 2\n"
        "    return self._kvstore, updater.states_synced, trainer_state.states(updater)\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", str(fake))
    assert sorted(mxnet_field_accesses()) == [
        "checkpoint.py:2 trainer._updaters", "checkpoint.py:2 trainer._updaters[0].states",
        "checkpoint.py:3 updater.states_synced"]


# A smell detector, not a design rule (issue 50): a file past it is read for
# whether it owns more than one concept, and split by concept if it does.
MAX_LINES = 800


def test_no_file_is_over_the_line_cap():
    long = {os.path.relpath(path, PACKAGE): n for path in module_files()
            if (n := sum(1 for _ in open(path))) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (does each own one concept?): {long}"


# Not the extension: it is loaded through hvdmx._mpi, after mpi4py has loaded
# the MPI library it binds to (alone first, it finds no libmpi).
SUBMODULES = sorted(
    ".".join(["hvdmx"] + os.path.relpath(path, PACKAGE)[:-3].split(os.sep)).replace(
        ".__init__", "")
    for path in module_files())

@pytest.fixture(scope="module")
def imported_first(tmp_path_factory):
    """{module: (exit code, output)} of importing each module first (tests/first_import.py)."""
    return import_each_first(SUBMODULES, tmp_path_factory.mktemp("imports"),
                             env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("module", SUBMODULES)
def test_each_module_imports_first_on_its_own(module, imported_first):
    code, output = imported_first[module]
    assert code == 0, output
