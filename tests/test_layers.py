"""The Python layer imports in one direction: the layers listed in
hvdmx/__init__.py's docstring, bottom up. Every import of hvdmx's own modules
(at a module's top or inside a function) names a module listed above the
importer, and each module imports first in a fresh interpreter."""
import ast
import os
import re
import sys

import pytest

import hvdmx
from first_import import import_each_first

PACKAGE = os.path.dirname(hvdmx.__file__)


def layers():
    """The module names of the docstring's list, bottom up."""
    doc = hvdmx.__doc__
    block = doc[doc.index("Layers, bottom up"):]
    names = re.findall(r"^    (\w+)  ", block, re.M)
    assert names, "no layer list in hvdmx/__init__.py's docstring"
    return names


def module_files():
    """{file path: its layer}: hvdmx/x.py is layer x, hvdmx/__init__.py the
    facade 'hvdmx', and every file of a subpackage hvdmx/x/ is layer x."""
    files = {}
    for folder, dirs, names in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, PACKAGE)[:-3].split(os.sep)
            files[path] = "hvdmx" if parts == ["__init__"] else parts[0]
    return files


def is_module(name: str) -> bool:
    return name == "_core" or os.path.exists(os.path.join(PACKAGE, name + ".py")) or \
        os.path.isdir(os.path.join(PACKAGE, name))


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
                    yield node.lineno, parts[1] if len(parts) > 1 else "hvdmx"
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                parts = base + (node.module.split(".") if node.module else [])
            else:
                parts = node.module.split(".")
            if parts[0] != "hvdmx":
                continue
            if len(parts) > 1:
                yield node.lineno, parts[1]
                continue
            for alias in node.names:  # from hvdmx import x: module x, or a name of the facade
                yield node.lineno, alias.name if is_module(alias.name) else "hvdmx"


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
            if imported == layer:  # a subpackage's files import each other
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
