"""What each rank of a tests/parallel job has run, written as it goes, for
tests/run_parallel.py: a failing rank aborts the whole job (conftest.py), so
no report written at the end of the session would survive it.

With HVDMX_TEST_PROGRESS=PREFIX set, rank r appends to PREFIX.rank<r>.progress
one tab-separated line per event, flushed at once:

    item    NODEID      the collected tests, in the order they will run (first)
    start   NODEID      a test begins (setup included)
    passed|failed|skipped   NODEID   how it ended on this rank (teardown included)

With HVDMX_TEST_RESUME_AFTER=NODEID set, the tests up to and including NODEID
(in the order above) are deselected: the job starts with the one after it.
"""
import os

import pytest

# A test's outcome over its phases (setup, call, teardown): the worst of them.
WORSE = ("passed", "skipped", "failed")


class Progress:
    def __init__(self, prefix, rank):
        self._file = open(f"{prefix}.rank{rank}.progress", "a", buffering=1)
        self._outcome = {}  # nodeid -> the worst outcome of its phases so far (WORSE)

    def _write(self, event, nodeid):
        self._file.write(f"{event}\t{nodeid}\n")

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        # trylast: after pytest has put the items in their final order (its
        # fixtures plugin groups them by module-scoped parameters).
        resume_after = os.environ.get("HVDMX_TEST_RESUME_AFTER")
        if resume_after:
            ids = [item.nodeid for item in items]
            if resume_after not in ids:
                raise pytest.UsageError(f"HVDMX_TEST_RESUME_AFTER={resume_after!r} is not "
                                        "one of the collected tests")
            cut = ids.index(resume_after) + 1
            config.hook.pytest_deselected(items=items[:cut])
            del items[:cut]
        for item in items:
            self._write("item", item.nodeid)

    def pytest_runtest_logstart(self, nodeid):
        self._write("start", nodeid)

    def pytest_runtest_logreport(self, report):
        outcome = "failed" if report.failed else "skipped" if report.skipped else "passed"
        worst = self._outcome.get(report.nodeid, "passed")
        self._outcome[report.nodeid] = max(worst, outcome, key=WORSE.index)

    def pytest_runtest_logfinish(self, nodeid):
        self._write(self._outcome.pop(nodeid, "passed"), nodeid)

    def failing(self, nodeid):
        """Records a failure now: the job is about to be aborted."""
        self._write("failed", nodeid)


def register(config, rank):
    """Registers the plugin when HVDMX_TEST_PROGRESS asks for it; returns it or None."""
    prefix = os.environ.get("HVDMX_TEST_PROGRESS")
    if not prefix:
        return None
    plugin = Progress(prefix, rank)
    config.pluginmanager.register(plugin, "hvdmx-progress")
    return plugin
