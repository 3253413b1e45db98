"""hvdmx's public surface as a type checker sees it: ``import hvdmx as hvd;
hvd.allreduce`` has allreduce's type, not Any, although the names load
lazily at run time (hvdmx/__init__.py). `make typecheck` runs mypy over
hvdmx/ and examples/; this runs it over a user's snippet."""
import ast
import os
import subprocess
import sys

import pytest

import hvdmx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def type_checking_imports():
    """{name: module} of the imports under ``if TYPE_CHECKING:`` in
    hvdmx/__init__.py."""
    tree = ast.parse(open(hvdmx.__file__).read())
    names = {}
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom), ast.dump(imp)
                for alias in imp.names:
                    # "import X as X": the re-export form that checkers honour.
                    assert alias.asname == alias.name, ast.dump(alias)
                    module = imp.module if imp.module != "hvdmx" else alias.name
                    names[alias.name] = module.removeprefix("hvdmx.")
    return names


def test_the_checkers_names_are_the_lazy_names():
    expected = dict(hvdmx._EXPORTS, errors="errors", elastic="elastic")
    assert type_checking_imports() == expected


def mypy(tmp_path, code):
    """mypy's result on ``code``, as `make typecheck` configures it."""
    pytest.importorskip("mypy")
    snippet = tmp_path / "snippet.py"
    snippet.write_text(code)
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", os.path.join(ROOT, "pyproject.toml"),
         "--no-incremental", "--cache-dir", os.devnull, str(snippet)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, MYPYPATH=ROOT))


SNIPPET = """
import hvdmx as hvd
reveal_type(hvd.allreduce)
reveal_type(hvd.DistributedTrainer)
reveal_type(hvd.errors.MismatchError)
reveal_type(hvd.size())
"""


def test_reveal_type_of_the_public_names_is_not_any(tmp_path):
    result = mypy(tmp_path, SNIPPET)
    revealed = [line for line in result.stdout.splitlines() if "Revealed type" in line]
    assert len(revealed) == 4, result.stdout + result.stderr
    types = [line.split("Revealed type is ", 1)[1].strip('"') for line in revealed]
    # Not "Any": allreduce's own signature (MXNet's NDArray is Any, MXNet
    # having no hints, but the rest is hvdmx's).
    assert types[0].startswith("def (tensor: ") and \
        "process_set: hvdmx.process_sets.ProcessSet" in types[0], types[0]
    assert types[1].endswith("-> hvdmx.trainer.DistributedTrainer"), types[1]
    assert types[2].endswith("-> hvdmx.errors.MismatchError"), types[2]
    assert types[3] in ("int", "builtins.int"), types[3]


# The seam to the C++ core, as hvdmx/_core.pyi types it (tests/test_core_stub.py
# holds the stub to the built module): the checker sees _core's signatures,
# so a wrong argument at ops.py's push is an error, and follows the checked
# tensor's description from _core.describe through ops._Call.
CORE_SNIPPET = """
from hvdmx import _core
from hvdmx.ops import _Call, _check_tensor
reveal_type(_core.topology())
reveal_type(_check_tensor("f", "tensor", None).shape)
reveal_type(_Call.push)
_core.push_async(set_id=0, collective=_core.ALLREDUCE, name=1, inputs=[], outputs=[],
                 dtypes=[], shapes=[])
"""


def test_the_checker_sees_the_cores_types(tmp_path):
    result = mypy(tmp_path, CORE_SNIPPET)
    revealed = [line.split("Revealed type is ", 1)[1].strip('"')
                for line in result.stdout.splitlines() if "Revealed type" in line]
    assert revealed[:2] == ["tuple[int, int, int, int, int, int, bool]", "tuple[int, ...]"], \
        result.stdout + result.stderr
    # The call object as a typed record: the checked descriptions inside.
    assert revealed[2].startswith("def (self: ") and \
        "fallback=hvdmx.ops._Checked]]" in revealed[2], revealed[2]
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and 'Argument "name" to "push_async"' in errors[0] and \
        'expected "str"' in errors[0], result.stdout
