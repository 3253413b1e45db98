"""Docs kept true: every reference to a Note (``See Note [X]``, ``Note [X] in
file``) names a Note that is defined (a line ``// Note [X]`` or ``# Note
[X]``), in the file it names; and every repo path written in docs/*.md and in
the code's comments exists."""
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("csrc", "hvdmx", "docs", "tests", "examples", "benchmarks", "tools")
EXTENSIONS = (".h", ".cc", ".py", ".md", ".sh")

# Wrong references in files this branch must not edit (another branch
# rewrites csrc/hvdmx/comm/): (file, note, the file it wrongly names).
# Remove an entry once its file is fixed; the test fails on a stale one.
KNOWN_WRONG: set = set()


def sources():
    files = [os.path.join(ROOT, name) for name in ("README.md", "setup.py", "Makefile")]
    for top in FOLDERS:
        for folder, dirs, names in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "plots")]
            files += [os.path.join(folder, n) for n in names if n.endswith(EXTENSIONS)]
    return {os.path.relpath(p, ROOT): open(p, encoding="utf-8").read() for p in sorted(files)}


SOURCES = sources()


def definitions():
    """{note title: [files that define it]}."""
    found = {}
    for path, text in SOURCES.items():
        for title in re.findall(r"^[ \t]*(?://|#)?[ \t]*Note \[([^\]\n]+)\][ \t]*$", text, re.M):
            found.setdefault(title, []).append(path)
    return found


def joined(text):
    """The text with line breaks (and the comment markers after them) as
    spaces, so a reference broken across lines reads as one."""
    return re.sub(r"[ \t]*\n[ \t]*(?://|#|\*)?[ \t]*", " ", text)


REFERENCE = re.compile(r"Note \[([^\]]+)\](?:,? in `?([\w./-]+\.(?:h|cc|py|md))`?)?")


def test_every_note_is_defined_once():
    twice = {title: files for title, files in definitions().items() if len(files) > 1}
    assert not twice, twice


def test_every_note_reference_resolves_to_its_file():
    defined = definitions()
    wrong = set()
    for path, text in SOURCES.items():
        if path == "tests/test_docs.py":
            continue
        for title, where in REFERENCE.findall(joined(text)):
            if title not in defined:
                wrong.add((path, title, "nowhere"))
            elif where and not any(f == where or f.endswith("/" + where)
                                   for f in defined[title]):
                wrong.add((path, title, where))
    assert wrong - KNOWN_WRONG == set(), sorted(wrong - KNOWN_WRONG)
    assert KNOWN_WRONG <= wrong, f"fixed, remove from KNOWN_WRONG: {KNOWN_WRONG - wrong}"


# A repo path: starts at a top-level folder (or csrc/hvdmx's layer folders,
# as the C++ writes them) and ends in a known extension.
LAYERS = sorted(d for d in os.listdir(os.path.join(ROOT, "csrc", "hvdmx"))
                if os.path.isdir(os.path.join(ROOT, "csrc", "hvdmx", d)))
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w\.(?:h|cc|py|md|sh|toml|txt))(?![\w/])"
                  % "|".join(FOLDERS + tuple(LAYERS)))


# MXNet's headers, which the C++ names as mxnet/engine.h (in the wheel's include/).
MXNET_INCLUDE = os.path.join(importlib.util.find_spec("mxnet").submodule_search_locations[0],
                             "include")
# Names a file had once, written as such ("then tools/interleave.py"): {doc: paths}.
FORMER_NAMES = {"docs/benchmark-notes.md": {"tools/interleave.py", "tools/direct_reads.py",
                                           "hvdmx/bench.py"}}


def missing_paths(text, former=()):
    for path in set(PATH.findall(text)) - set(former):
        candidates = [os.path.join(ROOT, path), os.path.join(ROOT, "csrc", "hvdmx", path),
                      os.path.join(ROOT, "docs", path), os.path.join(MXNET_INCLUDE, path)]
        if not any(os.path.exists(c) for c in candidates):
            yield path


@pytest.mark.parametrize("path", [p for p in SOURCES if p.endswith(".md")
                                  or p.startswith(("csrc/", "hvdmx/"))])
def test_every_path_written_exists(path):
    assert sorted(missing_paths(SOURCES[path], FORMER_NAMES.get(path, ()))) == [], path


# ---- the docs' rooms (docs/README.md) and their sizes ----------------------------

DOCS = os.path.join(ROOT, "docs")
PAGES = sorted(n for n in os.listdir(DOCS) if n.endswith(".md") and n != "README.md")
# No page longer than a reader can hold (the C++ files' limit too); the
# benchmarks page, which several engineers add to, stays well under it.
MAX_LINES = 800
MAX_BENCHMARKS_LINES = 600


def line_count(name):
    with open(os.path.join(DOCS, name), encoding="utf-8") as f:
        return sum(1 for _ in f)


def test_no_docs_page_is_over_800_lines():
    long = {name: line_count(name) for name in PAGES + ["README.md"]
            if line_count(name) > MAX_LINES}
    assert long == {}, f"cut these pages by concept (at most {MAX_LINES} lines): {long}"


def test_the_benchmarks_page_is_at_most_600_lines():
    assert line_count("benchmarks.md") <= MAX_BENCHMARKS_LINES, \
        "move lab detail to a lab-notes page (docs/README.md lists them)"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_every_docs_page_is_in_the_index():
    index = SOURCES["docs/README.md"]
    linked = {target.split("#", 1)[0] for target in LINK.findall(index)}
    assert sorted(set(PAGES) - linked) == [], "list each page in docs/README.md, in its room"
    assert PAGES, DOCS


def anchors(text):
    """GitHub's anchors of a page's headings (outside code blocks)."""
    found, fenced = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line.lstrip("#").strip().lower())
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("path", [p for p in SOURCES if p.endswith(".md")])
def test_every_link_between_pages_resolves(path):
    """A relative link names a file that exists and, with ``#anchor``, a
    heading of that page (so that cutting a page keeps its links working)."""
    broken = []
    for target in LINK.findall(SOURCES[path]):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        where = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(os.path.join(ROOT, where)):
            broken.append(target)
        elif anchor and where.endswith(".md"):
            with open(os.path.join(ROOT, where), encoding="utf-8") as f:
                if anchor not in anchors(f.read()):
                    broken.append(target)
    assert broken == [], path
