"""The C++ core's folders are layers (csrc/hvdmx/README.md): a file includes headers
of its own layer or of the layers below it, never above."""

import os
import re

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "hvdmx")


def layer_order():
    text = open(os.path.join(CSRC, "README.md")).read()
    return re.findall(r"^\d+\. `([a-z]+)/`", text, re.M)


def includes(path):
    return re.findall(r'^#include "([^"]+)"', open(path).read(), re.M)


def test_every_folder_is_a_listed_layer():
    folders = sorted(d for d in os.listdir(CSRC) if os.path.isdir(os.path.join(CSRC, d)))
    assert folders == sorted(layer_order())
    assert not [f for f in os.listdir(CSRC) if f.endswith((".cc", ".h"))], "sources outside a layer"


def test_includes_go_down_the_layers_only():
    order = layer_order()
    rank = {name: i for i, name in enumerate(order)}
    wrong = []
    for layer in order:
        for name in sorted(os.listdir(os.path.join(CSRC, layer))):
            path = os.path.join(CSRC, layer, name)
            for inc in includes(path):
                target = inc.split("/")[0]
                assert "/" in inc and target in rank, f"{layer}/{name} includes {inc!r}"
                assert os.path.exists(os.path.join(CSRC, inc)), f"{layer}/{name}: {inc} missing"
                if layer != "testing" and rank[target] > rank[layer]:
                    wrong.append(f"{layer}/{name} includes {inc}")
    assert not wrong, "includes that go up a layer:\n" + "\n".join(wrong)


# A smell detector, not a design rule (issue 50): a file past it is read for
# whether it owns more than one concept, and split by concept if it does.
MAX_LINES = 800


def test_no_file_over_the_line_cap():
    long = []
    for layer in layer_order():
        for name in sorted(os.listdir(os.path.join(CSRC, layer))):
            with open(os.path.join(CSRC, layer, name)) as f:
                lines = sum(1 for _ in f)
            if lines > MAX_LINES:
                long.append(f"{layer}/{name}: {lines} lines")
    assert not long, f"files over {MAX_LINES} lines:\n" + "\n".join(long)
