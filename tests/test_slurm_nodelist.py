"""hvdmx/runner/slurm.py and allocation.py: Slurm's node lists and task
counts as hvdmxrun reads them, checked against Slurm's own expansion
(`scontrol show hostnames`, which needs a slurm.conf but no running Slurm)
for generated lists, and the errors for malformed ones; the hostfile
variables an MPI launcher reads (the MPI Operator sets them); and hvdmxrun's
errors for a malformed allocation before anything starts."""
import os
import shutil
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from hvdmx.runner.hosts import Host, UsageError
from hvdmx.runner.allocation import HOSTFILE_VARIABLES, SRUN_SHELL, scheduler_hosts, \
    scheduler_shell
from hvdmx.runner.slurm import allocation, expand_nodelist, expand_tasks
from hvdmx.runner.srun_shell import srun_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(120)
SCONTROL = shutil.which("scontrol", path=os.environ.get("PATH", "") + ":/usr/bin")


@pytest.mark.parametrize("text, names", [
    ("node[01-03,7],gpu-a1", ["node01", "node02", "node03", "node7", "gpu-a1"]),
    ("a", ["a"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[008-011]", ["n008", "n009", "n010", "n011"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("rack[1-2]-node[09-10],login", ["rack1-node09", "rack1-node10", "rack2-node09",
                                     "rack2-node10", "login"]),
    ("x[1-2],y[3],z", ["x1", "x2", "y3", "z"]),
    ("h.c[0-1]", ["h.c0", "h.c1"]),
])
def test_node_lists(text, names):
    assert expand_nodelist(text) == names


@pytest.mark.parametrize("text, why", [
    ("", "empty"), (" a", "white space"), ("a,,b", "empty entry"), ("a,", "empty entry"),
    ("n[3-1]", "backwards"), ("n[1-", "not closed"), ("n]", "without its '['"),
    ("n[[1]]", "inside brackets"), ("n[1-3x]", "holds '1-3x'"), ("n[]", "holds ''"),
    ("n[1,1]", "more than once"), ("a,a", "more than once"), ("n[1-99999999]", "more than"),
    ("[1-2]", None), ("-x", "names no host"), ("h[0-1].c", "after its last ']'"),
])
def test_malformed_node_lists(text, why):
    if why is None:  # Slurm takes bare numbers as names; so does hvdmxrun
        assert expand_nodelist(text) == ["1", "2"]
        return
    with pytest.raises(UsageError) as error:
        expand_nodelist(text)
    message = str(error.value)
    assert f"SLURM_JOB_NODELIST={text!r}" in message and why in message, message


@pytest.mark.parametrize("text, counts", [
    ("2(x3),1", [2, 2, 2, 1]), ("4", [4]), ("1,2,3", [1, 2, 3]), ("3(x1)", [3]),
])
def test_task_counts(text, counts):
    assert expand_tasks(text) == counts


@pytest.mark.parametrize("text", ["", "2(x3", "2x3", "0", "2(x0)", "a", "1,,2", "-1",
                                  "2(x999999999)"])
def test_malformed_task_counts(text):
    with pytest.raises(UsageError, match=r"SLURM_TASKS_PER_NODE=") as error:
        expand_tasks(text)
    assert repr(text) in str(error.value)


def test_allocation_pairs_nodes_and_tasks():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3],g1",
           "SLURM_TASKS_PER_NODE": "2(x3),1"}
    found = allocation(env)
    assert found.job_id == "7" and found.tasks == 7
    assert found.hosts == [Host("n1", 2), Host("n2", 2), Host("n3", 2), Host("g1", 1)]
    assert allocation({}) is None
    with pytest.raises(UsageError, match="counts tasks for 3 node.* lists 4"):
        allocation(dict(env, SLURM_TASKS_PER_NODE="2(x3)"))
    with pytest.raises(UsageError, match="SLURM_TASKS_PER_NODE is not"):
        allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "a"})


# ---- against Slurm's own expansion -------------------------------------------

def _number_range():
    def build(low, length, width):
        high = low + length
        return (str(low).zfill(width) if width else str(low),
                str(high).zfill(width) if width else str(high))
    return st.builds(build, st.integers(0, 120), st.integers(0, 12),
                     st.sampled_from([0, 0, 2, 3]))


_WORD = st.text("abcxyz-.", min_size=1, max_size=5).filter(lambda w: not w.startswith("-"))
_SUFFIX = st.text("abcxyz-.", max_size=3)


@st.composite
def node_lists(draw):
    """Entries of text and bracket groups; now and then text after the last
    group, which Slurm refuses."""
    entries = []
    for _ in range(draw(st.integers(1, 3))):
        entry = draw(_WORD)
        for index in range(draw(st.integers(0, 2))):
            items = []
            for low, high in draw(st.lists(_number_range(), min_size=1, max_size=3)):
                items.append(low if low == high and draw(st.booleans()) else f"{low}-{high}")
            entry += (draw(_SUFFIX) if index else "") + "[" + ",".join(items) + "]"
        if "[" in entry and draw(st.integers(0, 9)) == 0:
            entry += draw(_WORD)
        entries.append(entry)
    return ",".join(entries)


@pytest.fixture(scope="module")
def slurm_conf(tmp_path_factory):
    if SCONTROL is None:
        pytest.skip("scontrol (Debian's slurm-client) is not installed: `make slurm` installs "
                    "it, as root")
    path = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    path.write_text("ClusterName=hvdmx\nSlurmctldHost=localhost\nNodeName=localhost\n"
                    "PartitionName=test Nodes=ALL\n")
    return str(path)


def scontrol_hostnames(conf, text):
    """Slurm's expansion of `text`, or None when Slurm finds it invalid."""
    result = subprocess.run([SCONTROL, "show", "hostnames", text], capture_output=True,
                            text=True, timeout=30, env=dict(os.environ, SLURM_CONF=conf))
    if "Invalid hostlist" in result.stdout + result.stderr:
        return None
    assert result.returncode == 0 and "rror" not in result.stderr, result.stderr
    return result.stdout.split()


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(text=node_lists())
def test_expansion_is_slurms(slurm_conf, text):
    theirs = scontrol_hostnames(slurm_conf, text)
    if theirs is None:
        with pytest.raises(UsageError, match="SLURM_JOB_NODELIST="):
            expand_nodelist(text)
    elif len(set(theirs)) != len(theirs):  # a node twice: refused, never silently kept
        with pytest.raises(UsageError, match="more than once"):
            expand_nodelist(text)
    else:
        assert expand_nodelist(text) == theirs


# ---- the MPI launchers' hostfile variables -----------------------------------

@pytest.mark.parametrize("variable", HOSTFILE_VARIABLES)
def test_hostfile_variables(tmp_path, variable):
    path = tmp_path / "hostfile"
    path.write_text("w-0.job.default.svc:2\nw-1.job.default.svc slots=3\n")
    hosts, where = scheduler_hosts({variable: str(path), "SLURM_JOB_ID": "1"})
    assert hosts == [Host("w-0.job.default.svc", 2), Host("w-1.job.default.svc", 3)]
    assert where == f"{variable}={path}"
    with pytest.raises(UsageError, match=f"{variable} '{tmp_path}/missing' cannot be read"):
        scheduler_hosts({variable: str(tmp_path / "missing")})


def test_no_scheduler():
    assert scheduler_hosts({"HOME": "/root"}) == (None, "")


def test_srun_shell_is_called_as_ssh():
    assert srun_command(["-x", "-o", "BatchMode=yes", "node2", "cd /w &&", "exec python"]) == [
        "srun", "--nodes=1", "--ntasks=1", "--nodelist=node2", "--overlap", "--mpi=none",
        "--quiet", "--kill-on-bad-exit=1", "sh", "-c", "cd /w && exec python"]
    with pytest.raises(ValueError, match="usage"):
        srun_command(["-x", "node2"])
    assert os.access(SRUN_SHELL, os.X_OK)
    assert scheduler_shell(None, scheduler_hosts(
        {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "a", "SLURM_TASKS_PER_NODE": "1"})[1]) \
        == SRUN_SHELL
    assert scheduler_shell("/bin/myssh", "x") == "/bin/myssh"
    assert scheduler_shell(None, "HYDRA_HOST_FILE=/etc/mpi/hostfile") is None


# ---- hvdmxrun with a malformed allocation: stops before anything starts ------

def hvdmxrun(argv, env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_",) +
                                                                     HOSTFILE_VARIABLES)}
    return subprocess.run([sys.executable, "-m", "hvdmx.run", *argv], capture_output=True,
                          text=True, timeout=60, env=dict(base, PYTHONPATH=REPO, **env),
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("mode", [[], ["--no-mpi"]])
@pytest.mark.parametrize("nodes, tasks, message", [
    ("n[1-2", "2(x2)", "SLURM_JOB_NODELIST='n[1-2' is not a Slurm node list"),
    ("n[1-2]", "2(y2)", "SLURM_TASKS_PER_NODE='2(y2)' is not a Slurm task counts"),
    ("n[1-2]", "2", "counts tasks for 1 node(s), but SLURM_JOB_NODELIST='n[1-2]' lists 2"),
])
def test_hvdmxrun_refuses_a_malformed_allocation(tmp_path, mode, nodes, tasks, message):
    marker = tmp_path / "started"
    result = hvdmxrun([*mode, "python", "-c", f"open({str(marker)!r}, 'w')"],
                      {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": nodes,
                       "SLURM_TASKS_PER_NODE": tasks})
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert not marker.exists()


def test_hvdmxrun_np_beyond_the_allocation(tmp_path):
    result = hvdmxrun(["--dry-run", "-np", "5", "python", "x.py"],
                      {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n[1-2]",
                       "SLURM_TASKS_PER_NODE": "2(x2)"})
    assert result.returncode == 2
    assert "-np 5 is more than the 4 slot(s) of the Slurm allocation" in result.stderr
