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


def system_includes(path):
    return re.findall(r"^#include <([^>]+)>", open(path).read(), re.M)


def layer_files(layer):
    folder = os.path.join(CSRC, layer)
    return [os.path.join(folder, name) for name in sorted(os.listdir(folder))]


# MPI is one transport among several: its calls live in the plugin mpi/ (the
# one file that includes <mpi.h>), which comm/mpi_comm.* call through, and the
# choice of what runs over it in job/ (csrc/hvdmx/README.md). The rest of the
# core, shm/ above all, works over any Comm or Group.
MPI_MAY_BE_INCLUDED_BY = ("comm/mpi_comm.h", "comm/mpi_comm.cc", "mpi/mpi_plugin.c")
MPI_LAYERS = ("job",)


def mpi_includers():
    found = []
    for layer in layer_order():
        for path in layer_files(layer):
            rel = os.path.relpath(path, CSRC)
            if "mpi.h" in system_includes(path) or "comm/mpi_comm.h" in includes(path):
                found.append(rel)
    return found


def test_only_the_plugin_includes_mpi_h():
    # The core links no MPI (Note [MPI as a plugin]): mpi.h is the plugin's alone.
    found = [os.path.relpath(path, CSRC) for layer in layer_order()
             for path in layer_files(layer) if "mpi.h" in system_includes(path)]
    assert found == ["mpi/mpi_plugin.c"], found


def test_only_the_mpi_comm_and_the_job_reach_mpi():
    wrong = [rel for rel in mpi_includers()
             if rel not in MPI_MAY_BE_INCLUDED_BY and rel.split("/")[0] not in MPI_LAYERS]
    assert not wrong, "files that include <mpi.h> or comm/mpi_comm.h outside comm/mpi_comm.* " \
                      "and job/:\n" + "\n".join(wrong)
    # The rule has something to see: the job does reach MPI.
    assert any(rel.startswith("job/") for rel in mpi_includers())


def test_python_holds_only_bindings():
    # Every file of python/ is pybind11's (the job it binds is job/'s), and
    # no layer below it knows pybind11.
    not_bindings = [os.path.relpath(p, CSRC) for p in layer_files("python")
                    if not any(inc.startswith("pybind11/") for inc in system_includes(p))
                    and not any(inc.startswith("python/") for inc in includes(p))]
    assert not not_bindings, f"files in python/ that are not bindings: {not_bindings}"
    below = [os.path.relpath(p, CSRC) for layer in layer_order()
             if layer not in ("python", "testing") for p in layer_files(layer)
             if any(inc.startswith("pybind11/") for inc in system_includes(p))]
    assert not below, f"files outside python/ and testing/ that include pybind11: {below}"
