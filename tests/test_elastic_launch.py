"""hvdmxrun's elastic loop (hvdmx/runner/elastic/loop.py) with stand-in workers
(shell commands): what it does when a worker finishes, fails in the
script, or is lost with its host."""
import io
import subprocess
import threading
import time

import pytest

from hvdmx.runner.elastic.hosts import HostManager
from hvdmx.runner.elastic.job import check_options
from hvdmx.runner.elastic.loop import SLOT_VARIABLE, ElasticLauncher, lost
from hvdmx.runner.elastic.membership import Membership
from hvdmx.runner.hosts import Host, UsageError

pytestmark = pytest.mark.timeout(60)


def launcher(hosts, commands, min_np=1, elastic_timeout=60, cooldown=None, max_np=None):
    """An ElasticLauncher whose worker of slot (h, i) runs commands[(h, i)]
    (default: sleep)."""
    started = []

    def start(slot, env):
        assert env[SLOT_VARIABLE] == f"{slot[0]}:{slot[1]}"
        started.append(slot)
        return subprocess.Popen(["sh", "-c", commands.get(slot, "sleep 30")])

    err = io.StringIO()
    membership = Membership(min_np, elastic_timeout, join_window=5)
    job = ElasticLauncher(HostManager(lambda: dict(hosts), time.monotonic, cooldown), membership,
                          start, max_np, discovery_interval=0.1,
                          say=lambda line: err.write(f"hvdmxrun: {line}\n"), stop_grace=2)
    return job, membership, started, err


def test_exit_statuses_that_mean_a_lost_worker():
    assert lost(-9) and lost(137) and lost(255)
    assert not lost(1) and not lost(2) and not lost(0)


def test_every_worker_finishing_ends_the_job_with_0():
    job, _, started, _ = launcher({"a": 2, "b": 1}, {("a", 0): "exit 0", ("a", 1): "exit 0",
                                                     ("b", 0): "sleep 0.3"})
    assert job.run() == 0
    assert started == [("a", 0), ("a", 1), ("b", 0)]
    assert not job.workers


def test_an_error_in_the_script_is_not_retried_and_stops_everyone():
    job, _, _, err = launcher({"a": 1, "b": 1}, {("b", 0): "sleep 0.3; exit 3"})
    begun = time.monotonic()
    assert job.run() == 3
    assert time.monotonic() - begun < 10  # a's sleep 30 was stopped
    assert "worker b:0 exited with exit status 3: an error in the training script, which is " \
           "not retried" in err.getvalue()


def test_a_lost_host_is_blacklisted_and_the_job_goes_on_without_it():
    job, membership, started, err = launcher({"a": 1, "b": 1, "c": 1},
                                             {("a", 0): "sleep 2; exit 0",
                                              ("b", 0): "kill -9 $$",
                                              ("c", 0): "sleep 2; exit 0"}, min_np=2)
    assert job.run() == 0
    assert job.lost_hosts == ["b"]
    assert "host b failed (worker b:0 ended by exit status 137" in err.getvalue() or \
        "host b failed (worker b:0 ended by signal SIGKILL" in err.getvalue()
    assert started.count(("b", 0)) == 1  # not started again: no cooldown
    assert job.hosts.blacklisted("b")


def test_a_host_back_from_its_cooldown_gets_a_worker_again():
    job, _, started, _ = launcher({"a": 1, "b": 1}, {("b", 0): "kill -TERM $$"},
                                  cooldown=(0.3, 1))
    thread = threading.Thread(target=job.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while started.count(("b", 0)) < 2:
        assert time.monotonic() < deadline, started
        time.sleep(0.05)
    job.membership.end("test over")
    job._finished = True
    job.stop_all()
    thread.join(20)


def test_too_few_workers_for_min_np_end_the_job_naming_the_lost_hosts():
    job, _, _, err = launcher({"a": 1, "b": 1}, {("b", 0): "kill -9 $$"}, min_np=2,
                              elastic_timeout=0.5)
    assert job.run() == 1
    assert "error: the job cannot go on: only 1 worker(s) left, fewer than --min-np 2" in \
        err.getvalue()
    assert "hosts lost: b" in err.getvalue()


def test_max_np_caps_the_workers():
    job, _, started, _ = launcher({"a": 2, "b": 2}, {}, max_np=3)
    job.fill()
    try:
        assert started == [("a", 0), ("a", 1), ("b", 0)]
    finally:
        job.stop_all()


def test_a_new_worker_after_the_first_generation_is_a_membership_change():
    job, membership, started, err = launcher({"a": 1}, {})
    job.fill()
    try:
        threading.Thread(target=membership.join, args=(("a", 0), 10), daemon=True).start()
        deadline = time.monotonic() + 10
        while membership.generation < 1:
            membership.poll()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        job.hosts.discover = lambda: {"a": 1, "b": 1}
        job.fill()
        assert started == [("a", 0), ("b", 0)] and not membership.newcomers()  # starting
        for slot in (("b", 0), ("a", 0)):
            threading.Thread(target=membership.join, args=(slot, 10), daemon=True).start()
            while slot == ("b", 0) and not membership.newcomers():  # b waits: seen
                assert time.monotonic() < deadline
                time.sleep(0.01)
        while membership.generation < 2:
            membership.poll()
            assert time.monotonic() < deadline
            time.sleep(0.01)
        membership.report_resumed(2)
        assert job.step() is None
        assert "hvdmxrun: resumed at size 2 after" in err.getvalue()
    finally:
        job.stop_all()


def test_a_host_that_leaves_the_discovery_has_its_workers_stopped_and_may_come_back():
    # Slurm drains a node, or the operator's discover_hosts.sh stops printing
    # a pod: its workers are stopped (they would run on), the host is not
    # blacklisted, and its slots get workers again once it is back.
    job, membership, started, err = launcher({"a": 1, "b": 2}, {})
    job.fill()
    try:
        b_workers = [job.workers[("b", 0)], job.workers[("b", 1)]]
        job.hosts.discover = lambda: {"a": 1}
        job.fill()
        assert sorted(job.workers) == [("a", 0)]
        assert all(proc.poll() is not None for proc in b_workers)
        assert not membership.started(("b", 0)) and not membership.started(("b", 1))
        assert "host b left the discovered hosts (or has fewer slots); its worker(s) b:0, b:1 " \
               "are stopped and the job goes on without them" in err.getvalue()
        assert not job.hosts.blacklisted("b") and job.lost_hosts == ["b"]
        job.hosts.discover = lambda: {"a": 1, "b": 1}  # back, with one slot
        job.fill()
        assert sorted(job.workers) == [("a", 0), ("b", 0)]
        assert started == [("a", 0), ("b", 0), ("b", 1), ("b", 0)]
    finally:
        job.stop_all()


def test_with_a_schedulers_hosts_np_defaults_to_their_slots():
    hosts = [Host("n1", 2), Host("n2", 1)]
    where = "the Slurm allocation (SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE)"

    def options(min_np=None, max_np=None, scheduler=where):
        return check_options(None, min_np, max_np, hosts, None, None, 600.0, None, None,
                             slurm_nodelist="n[1-2]", scheduler=scheduler)
    chosen = options(min_np=2)
    assert (chosen.num_proc, chosen.min_np, chosen.max_np) == (3, 2, 3)
    assert chosen.slurm_nodelist == "n[1-2]"
    assert options(min_np=1, max_np=2).num_proc == 2
    assert options(min_np=2, scheduler=None).num_proc == 2  # -H: --max-np, else --min-np
    with pytest.raises(UsageError, match=r"--min-np 4 is more than the 3 slot\(s\) of the "
                       r"Slurm allocation \(SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE\); ask "
                       "the scheduler for more, or lower --min-np"):
        options(min_np=4)
