"""Elastic jobs across test hosts (tools/testhosts.py): hvdmxrun's elastic
mode started in the first host, workers on up to four hosts through the hosts'
launcher (--ssh-exec). A host's processes killed mid-epoch (with 1-bit
compression and EASGD too), two of four lost in turn, a host added by
the discovery script, a host's link taken down, an error in the script, and
too few hosts left: the job goes on, grows, or ends as docs/elastic.md says,
and no process is left in any host.

Needs root (network namespaces); without it every test is skipped with the
reason. One set of four hosts serves the module and is removed at the end."""
import os
import re
import subprocess
import sys
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import testhosts  # noqa: E402

PYTHON = sys.executable
ENV = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1",
           MXNET_ENGINE_TYPE="ThreadedEnginePerDevice",
           # A peer cut off is given up on after 3 s; a worker that stays
           # silent is left out of the next generation after 3 s.
           HVDMX_STALL_SHUTDOWN_TIME_SECONDS="3", HVDMX_STALL_CHECK_TIME_SECONDS="0",
           HVDMX_ELASTIC_JOIN_WINDOW="3")
JOB = os.path.join(REPO, "tests", "elastic_job.py")
TIMEOUT = 200
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def th():
    reason = testhosts.unavailable()
    if reason:
        pytest.skip(reason)
    # The default prefix (hvdmx-pPID): another run of the suite on this machine
    # (a sanitizer run, a developer beside CI) has hosts of its own.
    with testhosts.hosts(4) as instance:
        yield instance


class Job:
    """hvdmxrun in the first host; its output read line by line on threads."""

    def __init__(self, th, flags, program, env=None):
        self.th = th
        self.marker = f"hvdmx-elastic-{os.getpid()}-{time.monotonic_ns()}"
        argv = [PYTHON, "-m", "hvdmx.run", *flags, "--ssh-exec", th.launcher, *program]
        # Every process of the job has it in its environment (hvdmxrun
        # forwards HVDMX_ variables to other hosts).
        env = dict(ENV, HVDMX_TEST_MARKER=self.marker, **(env or {}))
        self.proc = subprocess.Popen(th.command(th.hosts[0], argv), cwd=REPO, env=th.env(env),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL)
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=self._read, args=(s, b), daemon=True)
                        for s, b in ((self.proc.stdout, self.out),
                                     (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, lines):
        for line in stream:
            lines.append(line)

    def text(self):
        return "".join(self.out) + "".join(self.err)

    def wait_for(self, pattern, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"{pattern!r} never came:\n{self.text()[-4000:]}")
            time.sleep(0.1)

    def finish(self, timeout=TIMEOUT):
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not end within {timeout} s:\n{self.text()[-4000:]}")
        for reader in self.readers:
            reader.join(10)
        return self.proc.returncode

    def kill(self):
        self.th.kill_all()
        self.proc.wait(30)

    def left(self):
        """The job's processes still running in any host."""
        return [f"{host} {pid}" for host in self.th.hosts
                for pid in job_pids(host, self.marker)]


def job_pids(host, marker):
    """The processes in `host` whose environment holds the job's marker."""
    listed = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True)
    found = []
    for pid in listed.stdout.split():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"HVDMX_TEST_MARKER={marker}".encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def kill_host(th, host, marker):
    """SIGKILL to every process of the job in `host` (the host is lost)."""
    pids = job_pids(host, marker)
    assert pids, f"no process of the job ran in {host}"
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass


def assert_nothing_left(job):
    deadline = time.monotonic() + 30
    while job.left():
        assert time.monotonic() < deadline, f"processes left behind: {job.left()}"
        time.sleep(0.2)


def assert_losses_warned(text, survivors):
    """Each survivor logged its lost peer once, as a warning, and no rank an
    hvdmx ERROR line (the job went on, as expected)."""
    assert "hvdmx ERROR" not in text, text[-4000:]
    warnings = re.findall(r"hvdmx WARNING rank \d+\] hvdmx: .*hvd\.elastic\.run goes on with the "
                          r"ranks left", text)
    assert len(warnings) == survivors, text[-4000:]


# The digits example with each of its ways of training that keeps state a
# commit must keep: plain SGD (momentum), 1-bit compression (each rank's
# residuals; 16 epochs, its default) and EASGD (the center, every 4 steps).
@pytest.mark.parametrize("flags, epochs", [
    ([], 8),
    (["--compression", "onebit"], 16),
    (["--local-sgd-steps", "4", "--easgd-beta", "0.9"], 8),
], ids=["sgd", "onebit", "easgd"])
def test_a_killed_host_mid_epoch_and_the_digits_go_on_at_two(th, flags, epochs):
    h1, h2, h3 = th.hosts[:3]
    job = Job(th, ["-np", "3", "--min-np", "2", "-H", f"{h1}:1,{h2}:1,{h3}:1"],
              [PYTHON, "examples/elastic_mnist.py", "--epochs", str(epochs), "--commit-every",
               "5", *flags])
    job.wait_for(r"Epoch\[1\] Time cost")
    lost_at = time.monotonic()
    kill_host(th, h3, job.marker)
    assert job.finish() == 0, job.text()[-4000:]
    text = job.text()
    resumed = re.search(r"hvdmxrun: resumed at size 2 after (\d+\.\d) s", text)
    assert resumed, text[-4000:]
    assert float(resumed.group(1)) <= time.monotonic() - lost_at
    assert f"host {h3} failed" in text
    accuracy = re.search(rf"test accuracy (\d\.\d+) \(\d+/\d+\) after {epochs} epochs; .* "
                         r"ending on 2 ranks", text)
    assert accuracy and float(accuracy.group(1)) >= 0.95, text[-4000:]
    assert "parameters bitwise identical on all 2 ranks" in text
    assert_losses_warned(text, 2)
    assert_nothing_left(job)


def test_onebit_digits_lose_two_of_four_hosts_one_after_the_other(th):
    hosts = th.hosts[:4]
    job = Job(th, ["-np", "4", "--min-np", "2", "-H", ",".join(f"{h}:1" for h in hosts)],
              [PYTHON, "examples/elastic_mnist.py", "--compression", "onebit",
               "--commit-every", "5"])
    job.wait_for(r"Epoch\[1\] Time cost")
    kill_host(th, hosts[3], job.marker)
    job.wait_for(r"hvdmxrun: resumed at size 3 after")
    job.wait_for(r"Time cost=\S+ on 3 ranks")  # an epoch at three, then the next loss
    kill_host(th, hosts[2], job.marker)
    assert job.finish() == 0, job.text()[-4000:]
    text = job.text()
    assert re.search(r"hvdmxrun: resumed at size 2 after \d+\.\d s", text), text[-4000:]
    assert f"host {hosts[3]} failed" in text and f"host {hosts[2]} failed" in text
    accuracy = re.search(r"test accuracy (\d\.\d+) \(\d+/\d+\) after 16 epochs; .* ending "
                         r"on 2 ranks", text)
    assert accuracy and float(accuracy.group(1)) >= 0.95, text[-4000:]
    assert "parameters bitwise identical on all 2 ranks" in text
    assert_losses_warned(text, 3 + 2)
    assert_nothing_left(job)


def test_a_host_from_the_discovery_script_joins_at_the_next_commit(th, tmp_path):
    h1, h2, h3 = th.hosts[:3]
    listing = tmp_path / "hosts"
    listing.write_text(f"{h1}:1\n{h2}:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    job = Job(th, ["-np", "2", "--max-np", "3", "--host-discovery-script", str(script)],
              [PYTHON, JOB, "60", "--sleep", "0.2"])
    job.wait_for(r"STEP 5 SIZE 2")
    listing.write_text(f"{h1}:1\n{h2}:1\n{h3}:1\n")
    assert job.finish() == 0, job.text()[-4000:]
    text = job.text()
    assert re.search(r"hvdmxrun: resumed at size 3 after \d+\.\d s", text), text[-4000:]
    assert re.search(r"DONE value (\S+) expected \1 size 3 identical True", text), text[-3000:]
    assert "SIZE 3" in text
    assert_nothing_left(job)


def test_a_link_down_mid_step_leaves_its_host_out(th):
    h1, h2, h3 = th.hosts[:3]
    job = Job(th, ["-np", "3", "--min-np", "2", "-H", f"{h1}:1,{h2}:1,{h3}:1"],
              [PYTHON, JOB, "40", "--sleep", "0.2"])
    job.wait_for(r"STEP 5 SIZE 3")
    th.link(h3, up=False)
    try:
        job.wait_for(r"SIZE 2")
    finally:
        th.link(h3, up=True)
    assert job.finish() == 0, job.text()[-4000:]
    text = job.text()
    assert f"host {h3} failed" in text, text[-4000:]
    assert re.search(r"DONE value (\S+) expected \1 size 2 identical True", text), text[-3000:]
    assert_nothing_left(job)


def test_an_error_in_the_script_ends_the_job_and_is_not_retried(th):
    h1, h2, h3 = th.hosts[:3]
    job = Job(th, ["-np", "3", "--min-np", "2", "-H", f"{h1}:1,{h2}:1,{h3}:1"],
              [PYTHON, JOB, "40", "--raise-on-rank", "1", "--at", "3"])
    assert job.finish() == 1, job.text()[-4000:]
    text = job.text()
    assert "ValueError: an error in the training script on rank 1" in text
    assert re.search(r"hvdmxrun: worker \S+ exited with exit status 1: an error in the "
                     r"training script, which is not retried", text), text[-4000:]
    assert "resumed at size" not in text
    assert_nothing_left(job)


def test_fewer_than_min_np_left_ends_the_job_naming_the_hosts_lost(th):
    h1, h2 = th.hosts[:2]
    job = Job(th, ["-np", "2", "--min-np", "2", "--elastic-timeout", "5", "-H",
                   f"{h1}:1,{h2}:1"], [PYTHON, JOB, "200"])
    job.wait_for(r"STEP 3 SIZE 2")
    lost_at = time.monotonic()
    kill_host(th, h2, job.marker)
    code = job.finish()
    assert code != 0
    assert time.monotonic() - lost_at < 5 + 30
    text = job.text()
    assert "error: the job cannot go on: only 1 worker(s) left, fewer than --min-np 2, for " \
           "5 s (--elastic-timeout)" in text, text[-4000:]
    assert f"hosts lost: {h2}" in text
    assert_nothing_left(job)
