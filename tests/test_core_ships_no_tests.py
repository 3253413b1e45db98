"""hvdmx._core is the product: the test suite's entry points are in a module of
their own, tests/_hvdmx_testing (csrc/hvdmx/testing/, built by setup.py build_ext),
which hvdmx neither contains nor installs."""

import os
import shutil
import subprocess

import pytest

import _hvdmx_testing
from hvdmx import _core

HVDMX_DIR = os.path.dirname(os.path.abspath(_core.__file__))


def symbols(path, *flags):
    nm = shutil.which("nm")
    if nm is None:
        pytest.fail("nm (binutils) is needed to read the symbols of " + path)
    out = subprocess.run([nm, "-C", *flags, path], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_core_registers_no_testing_name():
    assert [name for name in dir(_core) if "testing" in name.lower()] == []


@pytest.mark.parametrize("flags", [(), ("-D",)], ids=["all", "dynamic"])
def test_core_has_no_testing_symbol(flags):
    found = [s for s in symbols(_core.__file__, *flags) if "Testing" in s or "::testing::" in s]
    assert found == []


def test_the_tests_module_lives_outside_the_package():
    here = os.path.dirname(os.path.abspath(__file__))
    assert os.path.dirname(os.path.abspath(_hvdmx_testing.__file__)) == here
    assert not [f for f in os.listdir(HVDMX_DIR) if "testing" in f]
    # And it holds what the tests drive, with its symbols.
    assert hasattr(_hvdmx_testing, "reduce_into") and hasattr(_hvdmx_testing, "LocalJob")
    assert any("TestingReduceInto" in s for s in symbols(_hvdmx_testing.__file__))


def test_stats_before_and_while_running_report_the_process():
    stats = _core.stats()
    assert stats["cpu_binding"]["cpu"] == -1
    assert stats["output_pool"]["min_bytes"] > 0
    assert "shm" not in stats  # no runtime runs in this process


# ---- one core in memory -------------------------------------------------------
# _core and the tests' module both link the core library hvdmx/libhvdmx_core.so
# (setup.py): neither carries a copy of the core's code, so the process has one
# of each of its singletons.

CORE_LIBRARY = os.path.join(HVDMX_DIR, "libhvdmx_core.so")


def defined_functions(path):
    """The hvdmx:: functions `path` defines, not inline (a header's inline
    functions and templates are weak, W, wherever they are used) and not local
    to a file (an anonymous namespace's may share a name across files)."""
    found = set()
    for line in symbols(path, "--defined-only"):
        parts = line.split(" ", 2)
        if (len(parts) == 3 and parts[1] in ("T", "t") and parts[2].startswith("hvdmx::")
                and "(anonymous namespace)" not in parts[2]):
            found.add(parts[2])
    return found


def needed(path):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.fail("readelf (binutils) is needed to read the NEEDED entries of " + path)
    out = subprocess.run([readelf, "-d", path], capture_output=True, text=True, check=True)
    return [line.split("[", 1)[1].rstrip("]") for line in out.stdout.splitlines()
            if "(NEEDED)" in line]


@pytest.mark.parametrize("module", ["core", "testing"])
def test_modules_link_the_core_library_and_define_none_of_it(module):
    path = _core.__file__ if module == "core" else _hvdmx_testing.__file__
    assert "libhvdmx_core.so" in needed(path)
    core = defined_functions(CORE_LIBRARY)
    assert "hvdmx::OutputPool::Get()" in core
    assert sorted(defined_functions(path) & core) == []


def test_the_process_maps_one_core():
    with open("/proc/self/maps") as f:
        mapped = {line.split()[-1] for line in f if line.rstrip().endswith("libhvdmx_core.so")}
    assert mapped == {os.path.realpath(CORE_LIBRARY)}


def test_the_tests_module_acts_on_the_cores_output_pool():
    # A block taken through the tests' module is one _core counts as out.
    bytes_ = 1 << 20
    before = _core.stats()["output_pool"]["out_bytes"]
    block = _hvdmx_testing.output_pool_take(bytes_)
    assert block != 0
    try:
        taken = _hvdmx_testing.output_pool_class(bytes_)
        assert _core.stats()["output_pool"]["out_bytes"] == before + taken
    finally:
        _hvdmx_testing.output_pool_give(block, bytes_)
    assert _core.stats()["output_pool"]["out_bytes"] == before
