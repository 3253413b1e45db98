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
