"""The Kubernetes MPI Operator's contract, without Kubernetes: the MPIJob
manifest of docs/clusters.md is parsed and its fields checked against what
hvdmxrun reads, then what the operator sets up for that manifest is made on
three test hosts (tools/testhosts.py) — the hostfile of the workers in the
form the operator writes for the implementation, the variable naming it, and
"ssh" to the workers (here the test hosts' launcher, under the name ssh on
PATH) — and the launcher's command runs unchanged in the first host, under
MPI and with --no-mpi, with its ranks on the two "workers". The plain-ssh
recipes of docs/clusters.md run there the same way."""
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import testhosts  # noqa: E402

import allreduce_report  # noqa: E402
from hvdmx.runner.hosts import Host  # noqa: E402
from hvdmx.runner.allocation import HOSTFILE_VARIABLES, scheduler_hosts  # noqa: E402

pytestmark = pytest.mark.timeout(240)
DOC = os.path.join(REPO, "docs", "clusters.md")
HOSTFILE = "/etc/mpi/hostfile"  # where the operator mounts it in the launcher


def section(title):
    text = open(DOC, encoding="utf-8").read()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def blocks(title, language):
    return re.findall(rf"```{language}\n(.*?)```", section(title), re.S)


def manifest():
    (text,) = blocks("Kubernetes", "yaml")
    return yaml.safe_load(text)


# The operator's hostfile and variables for each implementation (v2beta1,
# pkg/controller/mpi_job_controller.go).
def operator_setup(job, workers=None):
    """({variable: value}, hostfile text) the operator makes for `job`;
    `workers` replaces the workers' service names (test hosts here)."""
    spec = job["spec"]
    name, namespace = job["metadata"]["name"], job["metadata"].get("namespace", "default")
    slots = spec["slotsPerWorker"]
    replicas = spec["mpiReplicaSpecs"]["Worker"]["replicas"]
    names = workers or [f"{name}-worker-{i}.{name}.{namespace}.svc" for i in range(replicas)]
    implementation = spec["mpiImplementation"]
    if implementation == "OpenMPI":
        lines = [f"{host} slots={slots}" for host in names]
        variables = {"OMPI_MCA_orte_default_hostfile": HOSTFILE,
                     "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10"}
    else:
        lines = [f"{host}:{slots}" for host in names]
        variables = {"MPICH": {"HYDRA_HOST_FILE": HOSTFILE,
                               "HYDRA_LAUNCH_EXTRA_ARGS": "-o ConnectionAttempts=10"},
                     "Intel": {"I_MPI_HYDRA_HOST_FILE": HOSTFILE}}[implementation]
    return variables, "".join(line + "\n" for line in lines)


def launcher_command(job):
    (container,) = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"]
    return list(container.get("command", [])) + list(container.get("args", []))


def test_the_manifest_in_the_docs(tmp_path):
    job = manifest()
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v2beta1", "MPIJob")
    spec = job["spec"]
    assert spec["mpiImplementation"] == "MPICH"  # the family of hvdmx's mpich wheel
    assert spec["mpiReplicaSpecs"]["Launcher"]["replicas"] == 1
    # The launcher runs hvdmxrun with neither -np nor hosts: both come from
    # the operator's hostfile.
    command = launcher_command(job)
    assert command[0] == "hvdmxrun"
    assert not {"-np", "--num-proc", "-H", "--hosts", "--hostfile"} & set(command)
    # What hvdmxrun reads of the operator's set-up for this manifest.
    variables, text = operator_setup(job)
    path = tmp_path / "hostfile"
    path.write_text(text)
    (variable,) = [v for v in variables if v in HOSTFILE_VARIABLES]
    hosts, where = scheduler_hosts({variable: str(path)})
    replicas = spec["mpiReplicaSpecs"]["Worker"]["replicas"]
    name = job["metadata"]["name"]
    assert hosts == [Host(f"{name}-worker-{i}.{name}.default.svc", spec["slotsPerWorker"])
                     for i in range(replicas)]
    assert where == f"{variable}={path}"
    # The docs say which hostfile line and how many ranks this manifest gives.
    doc = section("Kubernetes")
    assert f"`{name}-worker-0.{name}.default.svc:{spec['slotsPerWorker']}`" in doc
    assert f"({replicas * spec['slotsPerWorker']} here)" in doc


@pytest.fixture(scope="module")
def th():
    reason = testhosts.unavailable()
    if reason:
        pytest.skip(reason)
    with testhosts.hosts(3, prefix=f"hvdmx-op-p{os.getpid()}") as instance:
        yield instance


def pod_env(th, tmp_path, variables):
    """The launcher pod's environment: the operator's variables, "ssh" that
    reaches the workers (the test hosts' launcher), hvdmx's venv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if not (bin_dir / "ssh").exists():
        os.symlink(th.launcher, bin_dir / "ssh")
    env = th.env()
    for name in [n for n in env if n.startswith("SLURM_") or n in HOSTFILE_VARIABLES or
                 n in ("HVDMX_SECRET_KEY", "HOROVOD_SECRET_KEY", "HVDMX_RENDEZVOUS")]:
        del env[name]
    env.update(variables, PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{env['PATH']}",
               PYTHONPATH=REPO, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1")
    return env


def run_in_launcher(th, argv, env, cwd):
    return subprocess.run(th.command("h1", argv), env=env, cwd=str(cwd), capture_output=True,
                          text=True, timeout=200, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("implementation, flags", [
    ("MPICH", []), ("MPICH", ["--no-mpi"]), ("OpenMPI", ["--no-mpi"]), ("Intel", ["--no-mpi"])])
def test_the_operators_launcher_runs_unchanged(th, tmp_path, implementation, flags):
    job = manifest()
    job["spec"]["mpiImplementation"] = implementation
    workers = th.hosts[1:]
    variables, text = operator_setup(job, workers)
    hostfile = tmp_path / "hostfile"  # /etc/mpi/hostfile in the pod
    hostfile.write_text(text)
    variables = {k: str(hostfile) if v == HOSTFILE else v for k, v in variables.items()}
    (tmp_path / "train.py").write_text(allreduce_report.PROGRAM)
    command = launcher_command(job)
    result = run_in_launcher(th, [command[0], *flags, *command[1:]],
                             pod_env(th, tmp_path, variables), tmp_path)
    assert result.returncode == 0, result.stderr
    allreduce_report.check(result.stdout, workers, per_host=job["spec"]["slotsPerWorker"])


def test_the_plain_ssh_recipes(th, tmp_path):
    (tmp_path / "train.py").write_text(allreduce_report.PROGRAM)
    workers = th.hosts[1:]
    (tmp_path / "hosts.txt").write_text(f"{workers[0]} slots=2\n{workers[1]}:2\n")
    (block,) = blocks("Plain ssh hosts", "sh")
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) == 2
    for line in lines:
        line = line.replace("node1", workers[0]).replace("node2", workers[1])
        result = run_in_launcher(th, ["sh", "-c", line], pod_env(th, tmp_path, {}), tmp_path)
        assert result.returncode == 0, (line, result.stderr)
        allreduce_report.check(result.stdout, workers)


# ---- elastic: the operator's discover_hosts.sh --------------------------------

def discover_script(job, running):
    """discover_hosts.sh as the operator writes it (updateDiscoverHostsInConfigMap
    of pkg/controller/mpi_job_controller.go): one echo per running worker,
    sorted by pod name, no slots; `running` are the pods' host names."""
    return "#!/bin/sh\n" + "".join(f"echo {host}\n" for host in sorted(running))


def test_the_discover_script_and_the_elastic_command_in_the_docs():
    job = manifest()
    name = job["metadata"]["name"]
    script, command = blocks("Kubernetes", "sh")
    workers = [f"{name}-worker-{i}.{name}.default.svc"
               for i in range(job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"])]
    assert script == discover_script(job, workers)
    words = command.split()
    assert words[0] == "hvdmxrun"
    assert words[words.index("--host-discovery-script") + 1] == "/etc/mpi/discover_hosts.sh"
    assert int(words[words.index("--slots-per-host") + 1]) == job["spec"]["slotsPerWorker"]


def write_script(path, text):
    """Replaces the script at once, as the kubelet swaps a ConfigMap's files."""
    new = path.with_name(path.name + ".new")
    new.write_text(text)
    new.chmod(0o555)
    os.replace(new, path)


def test_an_elastic_job_goes_on_when_the_operator_drops_a_worker(th, tmp_path):
    # The operator's set-up for the manifest (hostfile, HYDRA_HOST_FILE, ssh,
    # discover_hosts.sh printing both workers), the elastic command of the docs
    # in the launcher; tests/elastic_job.py (60 committed steps) as train.py.
    # At step 3 the second worker's pod stops running: the operator rewrites
    # the script without it. The job goes on at size 2 (one worker x 2 slots)
    # and checks its sum and that the ranks' vectors are bitwise identical.
    job = manifest()
    workers = th.hosts[1:]
    variables, text = operator_setup(job, workers)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(text)
    variables = {k: str(hostfile) if v == HOSTFILE else v for k, v in variables.items()}
    script = tmp_path / "discover_hosts.sh"
    write_script(script, discover_script(job, workers))
    (tmp_path / "train.py").write_text(
        "import runpy, sys\n"
        f"sys.argv = [{os.path.join(REPO, 'tests', 'elastic_job.py')!r}, '60']\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    (_, command) = blocks("Kubernetes", "sh")
    argv = command.replace("/etc/mpi/discover_hosts.sh", str(script)).split()
    env = pod_env(th, tmp_path, variables)
    env.update(HVDMX_STALL_SHUTDOWN_TIME_SECONDS="3", HVDMX_STALL_CHECK_TIME_SECONDS="0",
               HVDMX_ELASTIC_JOIN_WINDOW="3")
    proc = subprocess.Popen(th.command("h1", argv), env=env, cwd=str(tmp_path),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 150
        while not any("STEP 3 SIZE 4" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-4000:]
            time.sleep(0.1)
        write_script(script, discover_script(job, workers[:1]))
        assert proc.wait(timeout=150) == 0, "".join(lines)[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(30)
    out = "".join(lines)
    gone = workers[1]
    assert f"hvdmxrun: host {gone} left the discovered hosts (or has fewer slots); its " \
           f"worker(s) {gone}:0, {gone}:1 are stopped" in out, out[-4000:]
    assert "hvdmxrun: resumed at size 2" in out
    done = [line for line in lines if "DONE" in line]
    assert len(done) == 1 and re.search(r"DONE value (\S+) expected \1 size 2 identical True",
                                        done[0]), out[-4000:]
    resets = sorted(re.findall(r"^\[(\S+)\]<stdout>:RESET size 2$", out, re.M))
    assert resets == [f"{workers[0]}:0", f"{workers[0]}:1"], out[-4000:]
