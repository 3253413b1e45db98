"""hvdmx in a real Slurm cluster: Debian's slurmctld and slurmd on three test
hosts (tools/slurm_cluster.py, started once for this file and removed at its
end, on failure too). The Slurm recipes of docs/clusters.md run as written:
hvdmxrun inside salloc and sbatch, under MPI and without, takes its hosts and
-np from the allocation; srun starts the ranks with no launcher of ours, and
hvd.init() meets them without MPI (Note [Meeting under srun] in
hvdmx/rendezvous/srun.py), also inside sbatch and without a PMI. Also: the dry
run's placement, a failing rank, the errors for -np beyond the allocation,
for MPI asked for under srun without a PMI, and for srun tasks that cannot
meet; Slurm's node list against `scontrol show hostnames`. Each job is a
2 x 2 allreduce whose result every rank checks against the ranks' own inputs
(on the first two nodes; the third is for the elastic job that outlives a
node Slurm drains)."""
import ast
import os
import re
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import slurm_cluster  # noqa: E402

import allreduce_report  # noqa: E402

from hvdmx.runner.slurm import expand_nodelist, expand_tasks  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(180)

@pytest.fixture(scope="session")
def cluster():
    reason = slurm_cluster.unavailable()
    if reason:
        pytest.skip(reason)
    with slurm_cluster.cluster(3) as instance:
        yield instance


@pytest.fixture
def program(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(allreduce_report.PROGRAM)
    return str(path)


def env(cluster):
    """What a user's shell in the cluster has: hvdmx's venv first on PATH."""
    base = cluster.env()
    base["PATH"] = os.path.dirname(sys.executable) + ":" + base["PATH"]
    base.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1")
    for name in ("HVDMX_SECRET_KEY", "HOROVOD_SECRET_KEY", "HVDMX_RENDEZVOUS"):
        base.pop(name, None)
    return base


def run(cluster, argv, cwd, timeout=150, **extra):
    return cluster.run(argv, env={**env(cluster), **extra}, cwd=str(cwd), timeout=timeout,
                       check=False)


def check_reports(cluster, out):
    allreduce_report.check(out, cluster.nodes[:2])


def test_srun_without_a_pmi(cluster, program, tmp_path):
    # srun with no launcher of ours and, here, no PMI either: hvd.init()
    # takes rank, size and local rank from Slurm and meets the others
    # through task 0's rendezvous, found in the meeting file, which is gone
    # once the job ends. (The recipe of docs/clusters.md runs plain srun,
    # where the cluster's MpiDefault=pmi2 hands the tasks a PMI that hvdmx
    # leaves unused.)
    meet = tmp_path / "meet"
    result = run(cluster, ["srun", "-N", "2", "--ntasks-per-node=2", "--mpi=none", "python",
                           program], tmp_path, HVDMX_SRUN_DIR=str(meet))
    assert result.returncode == 0, result.stderr
    check_reports(cluster, result.stdout)
    assert meet.is_dir() and not list(meet.iterdir())


SRUN_BATCH = """#!/bin/sh
#SBATCH -N 2
#SBATCH --ntasks-per-node=2
srun python train.py
"""


def test_srun_inside_sbatch(cluster, program, tmp_path):
    # The batch script's own srun, with the default meeting directory.
    (tmp_path / "job.sh").write_text(SRUN_BATCH)
    out = tmp_path / "job.out"
    result = run(cluster, ["sbatch", "--wait", "-o", str(out), "job.sh"], tmp_path)
    assert result.returncode == 0, (result.stderr, out.read_text() if out.exists() else "")
    check_reports(cluster, out.read_text())


# Tasks that cannot meet: each case's shell line (run by every task before
# python), and what the tasks say. HVDMX_RENDEZVOUS_TIMEOUT=6 bounds every
# wait, so that the step ends within seconds, never hangs. One step holds two
# tasks that go wrong each its own way (a key set for task 1 only, Slurm's
# SLURM_LOCALID changed for task 3), to keep the cost of an srun down.
SRUN_BAD = {
    "two-tasks-wrong": (
        f"[ $SLURM_PROCID = 1 ] && export HVDMX_SECRET_KEY={'ab' * 32}; "
        "[ $SLURM_PROCID = 3 ] && export SLURM_LOCALID=x",
        ["HVDMX_SECRET_KEY is set for task 1 (node {h1}) but not for task 0 ({h1}); set the "
         "same key for every task", "SLURM_LOCALID='x' must be an integer from 0 to 3",
         "ranks 1, 3 did not reach it within 6 s (HVDMX_RENDEZVOUS_TIMEOUT); ranks 1, 3 never "
         "connected"]),
    "directory-not-shared": (
        "export HVDMX_SRUN_DIR=$PWD/meet-$(hostname)",
        ["task 2 of 4 (node {h2}) waited 6 s (HVDMX_RENDEZVOUS_TIMEOUT) for task 0 to write "
         "the meeting file", "set HVDMX_SRUN_DIR to a directory that every node of the job "
         "sees", "ranks 2, 3 never connected"]),
}


@pytest.mark.parametrize("case", sorted(SRUN_BAD))
def test_srun_tasks_that_cannot_meet_say_why(cluster, program, tmp_path, case):
    line, expected = SRUN_BAD[case]
    result = run(cluster, ["srun", "-N", "2", "--ntasks-per-node=2", "sh", "-c",
                           f"{line}; exec python {program}"], tmp_path, timeout=90,
                 HVDMX_RENDEZVOUS_TIMEOUT="6")
    assert result.returncode != 0
    assert "REPORT" not in result.stdout
    h1, h2 = cluster.nodes[:2]
    for text in expected:
        assert text.format(h1=h1, h2=h2) in result.stderr, result.stderr
    assert not [p for p in tmp_path.rglob("*.json")], "a meeting file was left behind"


# horovod.run(fn, np=4) as a Horovod program calls it, under hvdmx's alias
# (python -m hvdmx.as_horovod), and hvdmx's own name for it.
FUNCTION_PROGRAM = r"""
import socket, sys
def fn(scale):
    import hvdmx as hvd, mxnet as mx
    hvd.init()
    total = hvd.allreduce(mx.nd.array([hvd.rank() * scale]), average=False, name="s")
    return hvd.rank(), socket.gethostname(), float(total.asnumpy()[0])
if sys.argv[1] == "horovod":
    import horovod
    print("RESULT", horovod.run(fn, args=(2,), np=4))
else:
    import hvdmx
    print("RESULT", hvdmx.run_function(fn, args=(2,), num_proc=4))
"""


@pytest.mark.parametrize("name", ["horovod", "hvdmx"])
def test_run_function_spans_the_allocation(cluster, tmp_path, name):
    # Horovod's horovod.run inside a multi-node Slurm job used one node
    # (Horovod issues #2097, #2801); here the ranks go to the allocation's.
    (tmp_path / "fn.py").write_text(FUNCTION_PROGRAM)
    result = run(cluster, ["salloc", "-N", "2", "--ntasks-per-node=2", "python", "-m",
                           "hvdmx.as_horovod", "fn.py", name], tmp_path)
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    h1, h2 = cluster.nodes[:2]
    assert ast.literal_eval(line[len("RESULT "):]) == [(0, h1, 12.0), (1, h1, 12.0), (2, h2, 12.0),
                                           (3, h2, 12.0)]


def test_mpi_under_srun_without_a_pmi_says_what_to_do(cluster, program, tmp_path):
    # MPI asked for (HVDMX_SRUN_MPI=1), but srun gives it no PMI.
    result = run(cluster, ["srun", "-N", "2", "--ntasks-per-node=2", "--mpi=none", "python",
                           program], tmp_path, HVDMX_SRUN_MPI="1")
    assert result.returncode != 0
    assert "REPORT" not in result.stdout
    assert "srun started this process as one of 4 tasks" in result.stderr
    assert "leave MPI out: it was asked for (HVDMX_SRUN_MPI=1" in result.stderr
    assert "srun --mpi=list" in result.stderr


@pytest.mark.parametrize("mode", ["mpi", "no-mpi"])
def test_dry_run_shows_the_placement(cluster, tmp_path, mode):
    flags = [] if mode == "mpi" else ["--no-mpi"]
    result = run(cluster, ["salloc", "-N", "2", "--ntasks-per-node=2", "hvdmxrun", *flags,
                           "--dry-run", "python", "train.py"], tmp_path)
    assert result.returncode == 0, result.stderr
    h1, h2 = cluster.nodes[:2]
    if mode == "mpi":
        assert f" -n 4 -hosts {h1}:2,{h2}:2 " in result.stdout, result.stdout
    else:
        places = re.findall(r"^rank (\d) on (\S+) ", result.stdout, re.M)
        assert places == [("0", h1), ("1", h1), ("2", h2), ("3", h2)], result.stdout
        assert f"srun_shell.py -x {h2} " in result.stdout  # the remote shell: srun


def test_a_failing_rank_ends_the_job_on_every_node(cluster, tmp_path):
    # Rank 3 (on the second node, an srun step) fails; hvdmxrun stops the
    # others, and no rank is left (the hosts share this machine's processes:
    # ps sees them all; the job's ranks are found by a word of their own).
    word = f"hvdmx-slurm-rank-{os.getpid()}-{time.monotonic_ns()}"
    result = run(cluster, ["salloc", "-N", "2", "--ntasks-per-node=2", "hvdmxrun", "--no-mpi",
                           "python", "-c", "import os, sys, time; time.sleep(1); "
                           "sys.exit(3) if os.environ['HVDMX_RANK'] == '3' else "
                           "time.sleep(120)", word], tmp_path)
    assert result.returncode == 3, result.stderr
    assert f"rank 3 (host {cluster.nodes[1]}) exited with status 3" in result.stderr
    deadline = time.monotonic() + 30
    while True:
        ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True,
                            timeout=30).stdout
        left = [line for line in ps.splitlines() if word in line]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"ranks left behind: {left}"


@pytest.mark.parametrize("mode", ["mpi", "no-mpi"])
def test_more_processes_than_the_allocation(cluster, tmp_path, mode):
    marker = tmp_path / "started"
    flags = [] if mode == "mpi" else ["--no-mpi"]
    result = run(cluster, ["salloc", "-N", "2", "--ntasks-per-node=2", "hvdmxrun", *flags,
                           "-np", "5", "python", "-c", f"open({str(marker)!r}, 'w')"],
                 tmp_path)
    assert result.returncode == 2, result.stderr
    assert "-np 5 is more than the 4 slot(s) of the Slurm allocation" in result.stderr
    assert not marker.exists()


@pytest.mark.parametrize("shape, tasks", [
    (["-N", "2", "--ntasks-per-node=2"], [2, 2]), (["-N", "2", "-n", "3"], [2, 1]),
    (["-N", "1", "-n", "3"], [3])])
def test_the_allocation_as_slurm_writes_it(cluster, tmp_path, shape, tasks):
    result = run(cluster, ["salloc", *shape, "sh", "-c",
                           "echo $SLURM_JOB_NODELIST; echo $SLURM_TASKS_PER_NODE; "
                           "scontrol show hostnames"], tmp_path)
    assert result.returncode == 0, result.stderr
    nodelist, per_node, *names = result.stdout.split()
    assert expand_nodelist(nodelist) == names == cluster.nodes[:len(tasks)]
    assert expand_tasks(per_node) == tasks


def slurm_recipes():
    """The Slurm section's recipes of docs/clusters.md: each command line, and
    the batch script whole."""
    found = []
    for block in re.findall(r"```sh\n(.*?)```", slurm_section(), re.S):
        found += [block] if block.startswith("#!") else block.splitlines()
    return [recipe for recipe in found if "--min-np" not in recipe]  # elastic: below


def slurm_section():
    text = open(os.path.join(REPO, "docs", "clusters.md"), encoding="utf-8").read()
    start = text.index("\n## Slurm")
    return text[start:text.index("\n## ", start + 1)]


RECIPES = slurm_recipes()


def test_the_recipes_are_there():
    # salloc under MPI and without, the batch script, srun.
    assert len(RECIPES) == 4, RECIPES
    assert [r.split()[0] for r in RECIPES] == ["salloc", "salloc", "#!/bin/sh", "srun"]


def _recipe_param(recipe):
    name = recipe.split("\n")[-2 if recipe.startswith("#!") else 0][:60]
    return pytest.param(recipe, id=name)


@pytest.mark.parametrize("recipe", [_recipe_param(r) for r in RECIPES])
def test_the_recipes_of_docs_clusters(cluster, tmp_path, recipe):
    (tmp_path / "train.py").write_text(allreduce_report.PROGRAM)
    if recipe.startswith("#!"):  # the batch script
        (tmp_path / "job.sh").write_text(recipe)
        out = tmp_path / "job.out"
        result = run(cluster, ["sbatch", "--wait", "-o", str(out), "job.sh"], tmp_path)
        assert result.returncode == 0, result.stderr
        check_reports(cluster, out.read_text())
    else:
        result = run(cluster, ["sh", "-c", recipe], tmp_path)
        assert result.returncode == 0, (recipe, result.stderr)
        check_reports(cluster, result.stdout)


# ---- elastic inside an allocation (hvdmx/runner/elastic/slurm_discovery.py) --

ELASTIC_ENV = dict(HVDMX_STALL_SHUTDOWN_TIME_SECONDS="3", HVDMX_STALL_CHECK_TIME_SECONDS="0",
                   HVDMX_ELASTIC_JOIN_WINDOW="3")


def elastic_recipe():
    (block,) = [b for b in re.findall(r"```sh\n(.*?)```", slurm_section(), re.S)
                if "--min-np" in b]
    (line,) = block.splitlines()
    return line


def test_an_elastic_job_outlives_a_node_that_slurm_drains(cluster, tmp_path):
    # The recipe of docs/clusters.md on 3 nodes, 1 task each: tests/elastic_job.py
    # (60 committed steps) as train.py. Node 3 is drained at step 3; Slurm
    # leaves its step running, so hvdmxrun must see the drain (sinfo) and stop
    # the worker itself; the two others go on at size 2 from the last commit,
    # and the program checks the sum over every membership it ran at and that
    # the ranks' vectors are bitwise identical.
    recipe = elastic_recipe()
    assert recipe.startswith("salloc -N 3 hvdmxrun --min-np 2 ")
    (tmp_path / "train.py").write_text(
        "import runpy, sys\n"
        f"sys.argv = [{os.path.join(REPO, 'tests', 'elastic_job.py')!r}, '60']\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    drained = cluster.nodes[2]
    proc = subprocess.Popen(cluster.command(["sh", "-c", recipe]),
                            env=dict(env(cluster), **ELASTIC_ENV), cwd=str(tmp_path),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()

    def wait_for(text, timeout=120):
        deadline = time.monotonic() + timeout
        while not any(text in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, \
                f"{text!r} never came:\n{''.join(lines)[-4000:]}"
            time.sleep(0.1)

    try:
        wait_for("STEP 3 SIZE 3")
        cluster.run(["scontrol", "update", f"nodename={drained}", "state=drain",
                     "reason=hvdmx-test"])
        wait_for("hvdmxrun: resumed at size 2")
        # The drained node's step has ended (Slurm would have let it run).
        deadline = time.monotonic() + 30
        while True:
            steps = cluster.run(["squeue", "-h", "-s", "-o", "%i %N"]).stdout
            if drained not in steps or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert drained not in steps, steps
        assert proc.wait(timeout=150) == 0, "".join(lines)[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cluster.run(["scontrol", "update", f"nodename={drained}", "state=resume"], check=False)
    reader.join(30)
    out = "".join(lines)
    assert f"hvdmxrun: host {drained} left the discovered hosts (or has fewer slots); its " \
           f"worker(s) {drained}:0 are stopped" in out
    done = [line for line in lines if "DONE" in line]
    assert len(done) == 1 and re.search(r"DONE value (\S+) expected \1 size 2 identical True",
                                        done[0]), out[-4000:]
    resets = sorted(re.findall(r"^\[(\S+):0\]<stdout>:RESET size 2$", out, re.M))
    assert resets == cluster.nodes[:2], out[-4000:]


def test_an_elastic_job_whose_sinfo_fails_names_it_and_starts_nothing(cluster, tmp_path):
    # A real sinfo that fails: the allocation is made, then hvdmxrun runs with
    # an empty slurm.conf (one that is not there makes sinfo retry for 60 s).
    marker = tmp_path / "started"
    (tmp_path / "empty.conf").write_text("")
    result = run(cluster, ["salloc", "-N", "2", "sh", "-c",
                           f"SLURM_CONF={tmp_path}/empty.conf exec hvdmxrun --min-np 1 "
                           f"python -c 'open({str(marker)!r}, \"w\")'"], tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"`sinfo -h -N -n '{cluster.nodes[0][:-1]}[1-2]' -o '%N %t'` exited with " \
           "status 1: 'sinfo: " in result.stderr, result.stderr
    assert "ClusterName needs to be specified" in result.stderr
    assert not marker.exists()
