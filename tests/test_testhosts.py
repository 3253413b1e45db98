"""tools/testhosts.py itself: hosts made and removed again on every way out,
leftovers of killed runs removed, the link cap, and the one-line reason
where hosts cannot be made. Needs root, else skipped with that reason."""
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import testhosts  # noqa: E402

TOOL = os.path.join(REPO, "tools", "testhosts.py")
REASON = testhosts.unavailable()
needs_hosts = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def leftovers(prefix):
    names = os.listdir(testhosts.NETNS_DIR) if os.path.isdir(testhosts.NETNS_DIR) else []
    found = [n for n in names if n.startswith(prefix + "-")]
    if os.path.exists(os.path.join(testhosts.STATE_ROOT, prefix)):
        found.append(os.path.join(testhosts.STATE_ROOT, prefix))
    return found


def test_check_says_in_one_line_why_hosts_cannot_be_made():
    if os.geteuid() == 0:
        # As an unprivileged user, the reason is root.
        result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                 sys.executable, TOOL, "check"], capture_output=True, text=True,
                                timeout=60)
    else:
        result = subprocess.run([sys.executable, TOOL, "check"], capture_output=True,
                                text=True, timeout=60)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "test hosts need root to make network namespaces (running as uid 65534)"
        if os.geteuid() == 0 else REASON]


def test_a_prefix_that_could_clash_is_refused():
    with pytest.raises(testhosts.HarnessError, match=r"--prefix 'eth' is not usable"):
        testhosts.TestHosts(1, "eth")


@needs_hosts
def test_removed_when_the_block_fails():
    prefix = f"hvdmx-tt{os.getpid()}"
    with pytest.raises(RuntimeError, match="on purpose"):
        with testhosts.hosts(2, prefix=prefix, rate="100mbit") as th:
            assert len(leftovers(prefix)) == 4  # two hosts, the switch, the directory
            shown = subprocess.run(["tc", "-n", th.hosts[0], "qdisc", "show", "dev", "eth0"],
                                   capture_output=True, text=True, timeout=60).stdout
            assert "tbf" in shown and "rate 100Mbit" in shown
            # Something left running in a host is killed too.
            subprocess.Popen(th.command("h2", ["sleep", "600"]), env=th.env())
            raise RuntimeError("on purpose")
    assert leftovers(prefix) == []


@needs_hosts
def test_removed_when_their_owner_is_killed():
    # The owner dies without cleaning up (as pytest-timeout's os._exit would):
    # the reaper removes the hosts.
    prefix = f"hvdmx-tk{os.getpid()}"
    owner = subprocess.Popen([sys.executable, "-c", f"""
import os, signal, sys
sys.path.insert(0, {os.path.join(REPO, "tools")!r})
import testhosts
held = testhosts.hosts(1, prefix={prefix!r})
held.__enter__()
print("up", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""], stdout=subprocess.PIPE, text=True)
    assert owner.stdout.readline() == "up\n"
    owner.wait(timeout=60)
    deadline = time.monotonic() + 60
    while leftovers(prefix) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftovers(prefix) == []


@needs_hosts
def test_cleanup_removes_leftovers_by_prefix():
    prefix = f"hvdmx-tc{os.getpid()}"
    testhosts.TestHosts(1, prefix).up()  # no reaper, never taken down
    assert leftovers(prefix)
    result = subprocess.run([sys.executable, TOOL, "cleanup", "--prefix", prefix],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == f"removed: {prefix}\n"
    assert leftovers(prefix) == []
