"""hvdmx/_core.pyi tells the truth about the built module hvdmx._core: the
same public names in both directions, each constant of the type the stub
gives it, and each function's parameters (names, kinds, types, which have
defaults) and return type as pybind11 writes them in its __doc__."""
import ast
import os
import re

import pytest

from hvdmx import _core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUB = os.path.join(ROOT, "hvdmx", "_core.pyi")


def stub_tree():
    return ast.parse(open(STUB, encoding="utf-8").read(), STUB)


def stub_names():
    """{name: the ast node declaring it} of the stub's top level."""
    names = {}
    for node in stub_tree().body:
        if isinstance(node, ast.FunctionDef):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign):
            names[node.target.id] = node
    return names


STUBBED = stub_names()
PUBLIC = sorted(n for n in dir(_core) if not n.startswith("__"))


def test_every_name_of_the_module_is_in_the_stub():
    assert sorted(set(PUBLIC) - set(STUBBED)) == []


def test_every_name_of_the_stub_is_in_the_module():
    assert sorted(set(STUBBED) - set(PUBLIC)) == []


CONSTANTS = [n for n in PUBLIC if isinstance(STUBBED.get(n), ast.AnnAssign)]
FUNCTIONS = [n for n in PUBLIC if isinstance(STUBBED.get(n), ast.FunctionDef)]


def test_the_stub_has_both_kinds_of_name():
    # A parse that found nothing would pass the two tests below vacuously.
    assert len(CONSTANTS) >= 20 and len(FUNCTIONS) >= 30, (CONSTANTS, FUNCTIONS)


TYPES = {"int": int, "str": str, "float": float, "bool": bool, "dict": dict, "tuple": tuple,
         "list": list}


@pytest.mark.parametrize("name", CONSTANTS)
def test_each_constant_has_the_stubs_type(name):
    annotation = STUBBED[name].annotation
    outer = annotation.value if isinstance(annotation, ast.Subscript) else annotation
    value = getattr(_core, name)
    assert type(value) is TYPES[outer.id], (name, ast.unparse(annotation), value)
    if isinstance(value, dict):  # dict[str, int]
        assert all(type(k) is str and type(v) is int for k, v in value.items()), value
    if isinstance(value, tuple):  # tuple[str, ...]
        assert value and all(type(v) is str for v in value), value


def doc_signature(name):
    """(parameters, return type) from the first line of pybind11's __doc__:
    parameters as (name, kind, type, has default), kind "keyword" after a
    bare ``*``, "positional" before; types as the stub writes them."""
    first = getattr(_core, name).__doc__.strip().splitlines()[0]
    match = re.fullmatch(re.escape(name) + r"\((.*)\) -> (.+)", first)
    assert match, first
    params, kind = [], "positional"
    for part in split_top_level(match.group(1)):
        if part == "*":
            kind = "keyword"
            continue
        pname, rest = part.split(": ", 1)
        ptype, _, default = rest.partition(" = ")
        params.append((pname, kind, plain(ptype), bool(default)))
    return params, plain(match.group(2))


def split_top_level(text):
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    if text.strip():
        parts.append(text[start:].strip())
    return parts


def plain(text):
    """pybind11's spelling of a type as the stub's: what converts to an int
    (or float) is an int (float), and the typing prefixes go."""
    text = text.replace("typing.SupportsInt | typing.SupportsIndex", "int")
    text = text.replace("typing.SupportsFloat | typing.SupportsIndex", "float")
    return text.replace("collections.abc.", "").replace("typing.", "")


def stub_signature(name):
    """The stub's (parameters, return type) in doc_signature's form; a
    positional-only parameter stands for one pybind11 calls argN."""
    fn = STUBBED[name]
    args = fn.args
    params = []
    positional = args.posonlyargs + args.args
    first_default = len(positional) - len(args.defaults)
    for i, a in enumerate(positional):
        pname = f"arg{i}" if a in args.posonlyargs else a.arg
        params.append((pname, "positional", ast.unparse(a.annotation), i >= first_default))
    for a, default in zip(args.kwonlyargs, args.kw_defaults):
        params.append((a.arg, "keyword", ast.unparse(a.annotation), default is not None))
    return params, ast.unparse(fn.returns)


def loose(type_text):
    """A return type with its arguments dropped where pybind11 writes only
    the outer type (``tuple``, ``dict``) of what the binding builds by hand."""
    return type_text.split("[", 1)[0]


@pytest.mark.parametrize("name", FUNCTIONS)
def test_each_function_matches_its_doc(name):
    doc_params, doc_returns = doc_signature(name)
    params, returns = stub_signature(name)
    assert params == doc_params, name
    if "[" not in doc_returns:
        assert loose(returns) == doc_returns, name
    else:  # an ``object`` inside (built by hand) may be anything more precise
        pattern = r"[^,]+(?:\[.*\])?".join(map(re.escape, doc_returns.split("object")))
        assert re.fullmatch(pattern, returns), (name, returns, doc_returns)
