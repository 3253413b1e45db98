"""HugePageCollapser (csrc/hvdmx/platform/huge_pages.h): the memory a rank's peers read
directly is put on huge pages, once per page, and keeps its bytes."""
import re

import numpy as np
import pytest

import _hvdmx_testing

HUGE = 2 << 20


def whole_huge_pages(array):
    """The 2 MiB pages that lie wholly inside `array`."""
    start = array.ctypes.data
    end = start + array.nbytes
    return max(0, end // HUGE - (start + HUGE - 1) // HUGE)


def anon_huge_kib(array):
    """AnonHugePages (KiB) of the mappings that overlap `array`."""
    lo = array.ctypes.data
    hi = lo + array.nbytes
    total, overlaps = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                overlaps = int(m.group(1), 16) < hi and int(m.group(2), 16) > lo
            elif overlaps and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
    return total


@pytest.fixture
def small_pages():
    """numpy asks for huge pages itself from 4 MiB up: not for these arrays."""
    np.core.multiarray._set_madvise_hugepage(False)
    yield
    np.core.multiarray._set_madvise_hugepage(True)


@pytest.mark.parametrize("mib,offset", [(8, 0), (9, 4096), (5, 12345)])
def test_collapses_each_whole_page_once_and_keeps_the_bytes(small_pages, mib, offset):
    base = np.arange((mib << 20) + offset, dtype=np.uint32).astype(np.uint8)
    array = base[offset:]
    want = array.copy()
    pages = whole_huge_pages(array)
    assert pages >= 1
    # The same array twice through one collapser: asked about once.
    collapsed, refused = _hvdmx_testing.collapse_huge_pages([array, array])
    assert np.array_equal(array, want)
    assert collapsed + refused == pages
    if collapsed == 0:
        pytest.skip("this kernel refuses MADV_COLLAPSE (before Linux 6.1, or huge pages off)")
    assert anon_huge_kib(array) >= collapsed * (HUGE >> 10)


def test_smaller_than_a_huge_page_is_left_alone():
    array = np.ones(HUGE - 1, np.uint8)
    assert _hvdmx_testing.collapse_huge_pages([array, np.ones(0, np.uint8)]) == (0, 0)
