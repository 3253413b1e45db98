"""hvdmx.spark.run on a real Spark (pyspark from `make spark`, Java from
Debian): in local[2] mode on this host, and on a standalone cluster on test
hosts (tools/testhosts.py; the master and a worker on host 1, a worker on
host 2, one core each, the driver on host 1). One driver process per Spark
(tests/spark_jobs.py) runs every scenario of its tests, so the JVMs start
once. Failures: a rank that raises, a Spark job that cannot place every rank,
an executor killed mid-run; after each, no process of the run is left on
any host (every process of a run has the test's mark in its environment, and
the hosts share this machine's /proc). The digits example trains at 2 ranks
over the 2 workers."""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import testhosts  # noqa: E402
from spark_cluster import JOBS, PYTHON, SPARK_CONF, Cluster, Driver, spark_missing  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def marked(mark):
    """Processes whose environment holds the test's mark."""
    found = []
    needle = f"HVDMX_SPARK_TEST_MARK={mark}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        found.append((int(pid), c.read().replace(b"\0", b" ")[:120]))
        except OSError:
            pass
    return found


def assert_none_left(mark):
    """No process of the run is left: polled, as a killed process needs a
    moment to be reaped (a rank is stopped with SIGTERM, then SIGKILL 10 s later)."""
    deadline = time.monotonic() + 60
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert marked(mark) == [], "processes of the run are left"


def new_mark():
    return uuid.uuid4().hex


# ---- without pyspark ------------------------------------------------------------

def test_import_without_pyspark_and_a_clear_error_at_run():
    # pyspark is not on this PYTHONPATH, and None in sys.modules makes its
    # import fail even where it is installed in site-packages.
    code = ("import sys, hvdmx.spark\n"
            "assert 'pyspark' not in sys.modules and 'mxnet' not in sys.modules\n"
            "sys.modules['pyspark'] = None\n"
            "try:\n"
            "    hvdmx.spark.run(print, num_proc=1)\n"
            "except ImportError as error:\n"
            "    print(error)\n")
    result = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=REPO), timeout=60)
    assert result.returncode == 0, result.stderr
    assert "hvdmx.spark.run needs pyspark" in result.stdout
    assert "pip install pyspark" in result.stdout


def test_bad_arguments_are_named():
    import hvdmx.spark
    with pytest.raises(ValueError, match="num_proc=0"):
        hvdmx.spark.run(print, num_proc=0)
    with pytest.raises(ValueError, match="start_timeout=-1"):
        hvdmx.spark.run(print, start_timeout=-1)
    with pytest.raises(TypeError, match="env must map"):
        hvdmx.spark.run(print, env={"A": 1})
    with pytest.raises(TypeError, match="data must be a pyspark.sql.DataFrame"):
        hvdmx.spark.run(print, data=[1, 2])


def test_placements_keep_a_hosts_ranks_together():
    from hvdmx.spark.task import placements
    places = placements(["a:1", "b:2", "a:3", "b:4", "c:5"])
    # Partition order a, b, a, b, c -> ranks 0, 2, 1, 3, 4 (a's first).
    assert [p.rank for p in places] == [0, 2, 1, 3, 4]
    assert [(p.local_rank, p.local_size) for p in places] == [(0, 2), (0, 2), (1, 2),
                                                              (1, 2), (0, 1)]
    assert [(p.cross_rank, p.cross_size) for p in places] == [(0, 3), (1, 3), (0, 2),
                                                              (1, 2), (2, 3)]


def test_a_share_round_trips_and_bad_columns_are_named(tmp_path, monkeypatch):
    import numpy as np

    import hvdmx.spark
    from hvdmx.spark.data import write_share

    class Vector:  # as pyspark.ml.linalg's vectors: toArray()
        def __init__(self, values):
            self.values = values

        def toArray(self):
            return np.asarray(self.values, dtype=np.float64)

    rows = [{"x": Vector([i, i + 0.5]), "y": i, "z": [i, 2 * i, 3 * i]} for i in range(5)]
    path = str(tmp_path / "share.npz")
    assert write_share(iter(rows), ["y", "x", "z"], path) == 5
    monkeypatch.setenv(hvdmx.spark.DATA_VARIABLE, path)
    share = hvdmx.spark.rank_data()
    assert list(share) == ["y", "x", "z"]  # the DataFrame's order, not the file's
    assert share["x"].shape == (5, 2) and share["x"][3, 1] == 3.5
    assert share["z"].tolist()[4] == [4, 8, 12] and share["y"].tolist() == list(range(5))
    x, = hvdmx.spark.rank_arrays("x")
    assert x.shape == (5, 2)
    with pytest.raises(KeyError, match="no column 'w' in data"):
        hvdmx.spark.rank_arrays("w")
    with pytest.raises(ValueError, match="column 'z' of data holds arrays of different"):
        write_share(iter([{"z": [1, 2]}, {"z": [1]}]), ["z"], path)
    monkeypatch.delenv(hvdmx.spark.DATA_VARIABLE)
    with pytest.raises(RuntimeError, match="not a rank of hvdmx.spark.run"):
        hvdmx.spark.rank_data()


# ---- local[2] on this host -----------------------------------------------------------

@pytest.fixture(scope="module")
def local_driver():
    reason = spark_missing()
    if reason:
        pytest.fail(reason)
    conf = SPARK_CONF + ["spark.driver.host=127.0.0.1", "spark.driver.bindAddress=127.0.0.1"]
    driver = Driver([PYTHON, JOBS, "local[2]", *conf], REPO)
    try:
        yield driver
    finally:
        driver.stop()


def test_local_ranks_under_horovod_spark_run(local_driver):
    # horovod.spark.run under hvdmx.as_horovod: the function uses horovod.mxnet.
    ranks = local_driver.ask(scenario="horovod", num_proc=2).get("value")
    assert ranks, local_driver.output()
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["local_rank"] for r in ranks] == [0, 1]
    assert {(r["size"], r["local_size"], r["cross_rank"], r["cross_size"], r["sum"], r["hvd"])
            for r in ranks} == {(2, 2, 0, 1, 3.0, "horovod.mxnet")}


def test_local_rank_that_raises(local_driver):
    mark = new_mark()
    answer = local_driver.ask(scenario="raises", rank=1, num_proc=2, mark=mark)
    assert answer.get("error") == "ValueError", answer
    assert answer["message"] == "rank 1 fails on purpose"
    assert "rank 1 raised this" in answer["cause"]
    # The rank's own traceback: the function (pickled by value from the
    # driver's __main__) and the exception's line.
    assert ", in raise_on\n" in answer["cause"]
    assert "ValueError: rank 1 fails on purpose" in answer["cause"]
    assert_none_left(mark)


def test_local_ranks_that_return_then_fail(local_driver, tmp_path):
    # As run_function when its launcher fails: the values are not returned.
    mark = new_mark()
    answer = local_driver.ask(scenario="returns_then_fails", num_proc=2, mark=mark,
                              marker_dir=str(tmp_path))
    assert answer.get("error") == "RuntimeError", answer
    # The first task to fail fails the barrier stage, and Spark kills the
    # other: which statuses reached the driver first varies; the task's own
    # error, in Spark's, names the status.
    assert re.search(r"every rank returned, but then (ranks \[(0, 1|0|1)\] exited with a "
                     r"status other than 0 and )?the Spark job failed", answer["message"]), answer
    assert re.search(r"hvdmx.spark: rank [01] \(partition [01], host .*\) exited with status 3",
                     answer["message"]), answer
    assert_none_left(mark)


# ---- a standalone cluster on two test hosts ---------------------------------------------

@pytest.fixture(scope="module")
def cluster():
    reason = spark_missing()
    if reason:
        pytest.fail(reason)
    if testhosts.unavailable():  # as every test of the test hosts: not root
        pytest.skip(testhosts.unavailable())
    with testhosts.hosts(2) as hosts, tempfile.TemporaryDirectory(prefix="hvdmx-spark-") as d:
        instance = Cluster(hosts, d)
        try:
            instance.start()
            yield instance
        finally:
            instance.stop()


def test_cluster_places_a_rank_on_each_worker(cluster):
    # The ranks' variables (hvd.init reads them; the digits test runs it here).
    ranks = cluster.driver.ask(scenario="environment", num_proc=2).get("value")
    assert ranks, cluster.logs()
    hosts = [r["host"] for r in ranks]
    assert sorted(hosts) == sorted(cluster.hosts.hosts)  # one rank on each host
    for r in ranks:
        assert (r["size"], r["local_rank"], r["local_size"], r["cross_size"]) == (2, 0, 1, 2)
        assert r["key_in_env"]  # put there by the bootstrap, from its standard input
    assert [(r["rank"], r["cross_rank"]) for r in ranks] == [(0, 0), (1, 1)]


def test_cluster_shares_of_a_dataframe(cluster):
    shares = cluster.driver.ask(scenario="share", num_proc=2, rows=101).get("value")
    assert shares, cluster.logs()
    ids = sorted(i for s in shares for i in s["ids"])
    assert ids == list(range(101))  # every row once, none at two ranks
    for s in shares:
        assert s["columns"] == ["id", "pair"] and s["pairs_ok"]
        assert s["pair_shape"] == [len(s["ids"]), 2]


def test_cluster_a_share_that_cannot_be_written(cluster):
    # Arrays of different lengths: the task says why, and the run fails at once.
    mark = new_mark()
    answer = cluster.driver.ask(scenario="ragged", num_proc=2, rows=20, mark=mark)
    assert answer.get("error") == "RuntimeError", answer
    assert "could not start it: ValueError: hvdmx.spark.run: column 'ragged' of data holds " \
        "arrays of different lengths" in answer["message"], answer
    assert_none_left(mark)


def test_digits_example_over_two_workers(cluster):
    answer = cluster.driver.ask(scenario="digits", timeout=240,
                                argv=["--num-proc", "2", "--epochs", "8"])
    assert answer.get("value", {}).get("code") == 0, cluster.logs()
    out = answer["value"]["stdout"]
    accuracy = float(out.split("test accuracy ")[1].split()[0])
    assert accuracy >= 0.95, out
    assert "parameters bitwise identical on all 2 ranks" in out
    assert "[0]<stdout>:epoch 0: " in out  # rank 0's lines, forwarded to the driver


def test_cluster_rank_that_raises(cluster):
    mark = new_mark()
    answer = cluster.driver.ask(scenario="raises", rank=1, num_proc=2, mark=mark)
    assert answer.get("error") == "ValueError", answer
    assert "rank 1 raised this" in answer["cause"]
    assert_none_left(mark)


def test_cluster_cannot_place_every_rank(cluster):
    mark = new_mark()
    answer = cluster.driver.ask(scenario="unplaceable", num_proc=3, start_timeout=5, mark=mark)
    assert answer.get("error") == "TimeoutError", answer
    assert "0 of 3 ranks were placed in Spark tasks" in answer["message"]
    assert "start_timeout=5 s" in answer["message"]
    assert_none_left(mark)


def test_cluster_lost_executor_fails_the_run(cluster):
    cluster.wait_for_executors()
    mark = new_mark()
    markers = tempfile.mkdtemp(prefix="hvdmx-spark-markers-")
    cluster.driver.send(scenario="lost", num_proc=2, marker_dir=markers, mark=mark)
    deadline = time.monotonic() + 120
    while len(os.listdir(markers)) < 2:
        assert time.monotonic() < deadline, "the ranks did not start:\n" + cluster.logs()
        time.sleep(0.2)
    # The ranks have the mark (env= reaches them): the checks for what is
    # left after each failure look for something that is there while it runs.
    assert len(marked(mark)) >= 2, marked(mark)
    pids = cluster.executor_pids("h2")
    assert pids, "no executor on host 2:\n" + cluster.logs()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    answer = cluster.driver._result(120)
    assert answer.get("error") == "RuntimeError", answer
    assert "ended without returning" in answer["message"], answer
    assert_none_left(mark)
