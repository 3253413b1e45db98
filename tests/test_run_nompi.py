"""hvdmxrun --no-mpi (hvdmx/runner/nompi.py): ranks started without MPI meet at
the launcher's rendezvous and see each other; their environment, their
tagged output; a failing or killed rank, or a signal to hvdmxrun, ends the
job with no process left behind; ranks on "other hosts" through a remote
shell given with --ssh-exec (here a script that runs the command on this
machine, as tools/testhosts.py's launcher does in a test host); the usage
errors. The programs use the rendezvous group directly: hvd.init() over it
is the core's part."""
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
ENV = dict(os.environ, PYTHONPATH=REPO)
for _name in ("HVDMX_SECRET_KEY", "HOROVOD_SECRET_KEY", "HVDMX_RENDEZVOUS"):
    ENV.pop(_name, None)
pytestmark = pytest.mark.timeout(120)
HVDMXRUN = [PYTHON, "-m", "hvdmx.run"]
OTHER_HOST = "198.51.100.7"  # TEST-NET-2: not this machine, routed like any far host

# Each rank: the group's allgather of its rank and host, its place, and
# whether the key is in its environment but on no command line it can see.
PROGRAM = r"""
import hashlib, json, os, socket, sys, time
from hvdmx.rendezvous.client import group_from_environment
group = group_from_environment()
seen = group.allgather(json.dumps([group.rank, socket.gethostname()]).encode())
key = os.environ["HVDMX_SECRET_KEY"]
def cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace")
report = {name: os.environ.get(name) for name in (
    "HVDMX_RANK", "HVDMX_SIZE", "HVDMX_LOCAL_RANK", "HVDMX_LOCAL_SIZE", "HVDMX_CROSS_RANK",
    "HVDMX_CROSS_SIZE", "HVDMX_RENDEZVOUS", "HVDMX_FUSION_THRESHOLD", "PYTHONPATH", "PATH",
    "NOT_FORWARDED")}
report.update(rank=group.rank, size=group.size, seen=[json.loads(x) for x in seen],
              key_ok=len(key) == 64, key_hash=hashlib.sha256(key.encode()).hexdigest(),
              key_on_a_command_line=any(key in cmdline(p) for p in (os.getpid(), os.getppid())),
              stdin_empty=sys.stdin.read() == "")
group.close()
print("REPORT " + json.dumps(report), flush=True)
print("to stderr", file=sys.stderr, flush=True)
"""


def run(argv, env=None, timeout=90, cwd=REPO):
    result = subprocess.run([*HVDMXRUN, *argv], env=dict(ENV, **(env or {})), cwd=cwd,
                            capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL)
    return result.returncode, result.stdout, result.stderr


def reports(out):
    found = {}
    for line in out.splitlines():
        match = re.fullmatch(r"\[(\d+)\]<stdout>:REPORT (.*)", line)
        if match:
            found[int(match.group(1))] = json.loads(match.group(2))
    return found


def test_every_rank_sees_every_other(tmp_path):
    code, out, err = run(["--no-mpi", "-np", "3", "--fusion-threshold-mb", "2", PYTHON, "-c",
                          PROGRAM])
    assert code == 0, err
    got = reports(out)
    assert sorted(got) == [0, 1, 2], out
    host = socket.gethostname()
    for rank, report in got.items():
        assert report["rank"] == rank and report["size"] == 3
        assert report["seen"] == [[r, host] for r in range(3)]
        assert (report["HVDMX_RANK"], report["HVDMX_SIZE"]) == (str(rank), "3")
        assert (report["HVDMX_LOCAL_RANK"], report["HVDMX_LOCAL_SIZE"]) == (str(rank), "3")
        assert (report["HVDMX_CROSS_RANK"], report["HVDMX_CROSS_SIZE"]) == ("0", "1")
        assert report["HVDMX_RENDEZVOUS"].startswith("127.0.0.1:")
        assert report["HVDMX_FUSION_THRESHOLD"] == str(2 * 1024 * 1024)  # a tuning flag
        assert report["key_ok"] and not report["key_on_a_command_line"]
        assert report["stdin_empty"]
    assert len({r["key_hash"] for r in got.values()}) == 1
    assert sorted(line for line in err.splitlines() if line.endswith("to stderr")) == [
        f"[{r}]<stderr>:to stderr" for r in range(3)]


def test_a_key_given_by_the_user_is_the_jobs():
    key = "ab" * 32
    code, out, err = run(["--no-mpi", "-np", "2", PYTHON, "-c",
                          "import os; print(os.environ['HVDMX_SECRET_KEY'])"],
                         env={"HVDMX_SECRET_KEY": key})
    assert code == 0, err
    assert sorted(out.splitlines()) == [f"[0]<stdout>:{key}", f"[1]<stdout>:{key}"]


# Each rank writes its pid, then: rank `fail` ends as asked, the others sleep
# (rank `stubborn` ignoring SIGTERM).
WAITER = r"""
import os, signal, sys, time
rank = int(os.environ["HVDMX_RANK"])
how, fail, stubborn, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with open(os.path.join(folder, f"{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(folder, f"{rank}.tmp"), os.path.join(folder, f"{rank}.pid"))
print("ready", flush=True)
if rank == stubborn:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if rank == fail:
    # Once every rank has written its pid, so that the test can look for them.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(
            [n for n in os.listdir(folder) if n.endswith(".pid")]) < int(os.environ["HVDMX_SIZE"]):
        time.sleep(0.05)
    time.sleep(0.2)
    if how == "exit":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(100)
"""


def pids_of(folder, count, seconds=30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        names = [n for n in os.listdir(folder) if n.endswith(".pid")]
        if len(names) == count:
            time.sleep(0.1)
            return [int(open(os.path.join(folder, n)).read()) for n in names]
        time.sleep(0.05)
    raise AssertionError(f"not every rank started: {os.listdir(folder)}")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def none_alive(pids, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how, code, said", [
    ("exit", 3, "rank 1 (host {host}) exited with status 3; stopping the other ranks"),
    ("kill", 137, "rank 1 (host {host}) exited with status 137; stopping the other ranks"),
])
def test_a_failing_rank_stops_the_others(tmp_path, how, code, said):
    started = time.monotonic()
    got, out, err = run(["--no-mpi", "-np", "3", PYTHON, "-c", WAITER, how, "1", "2",
                         str(tmp_path)])
    assert got == code, err
    assert f"hvdmxrun: {said.format(host=socket.gethostname())}" in err.splitlines()
    # Rank 2 ignores SIGTERM: its bootstrap kills it 5 s later.
    assert time.monotonic() - started < 40
    pids = pids_of(tmp_path, 3)
    assert none_alive(pids, 5), "a rank outlived the job"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_hvdmxrun_stops_every_rank(tmp_path, signum):
    launcher = subprocess.Popen([*HVDMXRUN, "--no-mpi", "-np", "3", PYTHON, "-c", WAITER,
                                 "none", "-1", "0", str(tmp_path)], env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = pids_of(tmp_path, 3)
        started = time.monotonic()
        launcher.send_signal(signum)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signum, err
    assert f"hvdmxrun: got {signal.Signals(signum).name}; stopping the ranks" in err
    assert time.monotonic() - started < 30
    assert none_alive(pids, 5)


def test_ranks_do_not_outlive_a_killed_hvdmxrun(tmp_path):
    launcher = subprocess.Popen([*HVDMXRUN, "--no-mpi", "-np", "2", PYTHON, "-c", WAITER,
                                 "none", "-1", "-1", str(tmp_path)], env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pids = pids_of(tmp_path, 2)
        launcher.kill()  # no chance to stop anything: the ranks' stdin ends
        launcher.wait(30)
    finally:
        launcher.kill()
    assert none_alive(pids, 20), "ranks outlived a killed hvdmxrun"


# A remote shell for tests: logs its arguments, then runs the command here
# with sh -c, as ssh runs it on the host (and testhosts' launch in a test host),
# in an environment as bare as a remote login's: what a rank has of
# hvdmxrun's environment came on its command line or its standard input.
FAKE_SSH = """#!/bin/sh
printf '%s\\n' "$@" >> {log}
printf -- '----\\n' >> {log}
while [ $# -gt 0 ]; do
  case $1 in
    -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
shift
exec env -i HOME="$HOME" PATH=/usr/bin:/bin sh -c "$*"
"""


def fake_ssh(tmp_path):
    log = tmp_path / "ssh.log"
    script = tmp_path / "fake-ssh"
    script.write_text(FAKE_SSH.format(log=log))
    script.chmod(0o755)
    return str(script), log


def route_here(host):
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError as error:
        pytest.skip(f"no route to {host} here ({error})")


def test_ranks_on_another_host_start_through_ssh_exec(tmp_path):
    address = route_here(OTHER_HOST)
    ssh, log = fake_ssh(tmp_path)
    code, out, err = run(["--no-mpi", "-H", f"localhost:1,{OTHER_HOST}:2", "--ssh-exec", ssh,
                          "--fusion-threshold-mb", "1", PYTHON, "-c", PROGRAM],
                         env={"HVDMX_SECRET_KEY": "cd" * 32, "NOT_FORWARDED": "x"})
    assert code == 0, err
    got = reports(out)
    assert sorted(got) == [0, 1, 2], out + err
    places = {r: (got[r]["HVDMX_LOCAL_RANK"], got[r]["HVDMX_LOCAL_SIZE"],
                  got[r]["HVDMX_CROSS_RANK"], got[r]["HVDMX_CROSS_SIZE"]) for r in got}
    # Horovod's cross rank: the host's place among the hosts with this local rank.
    assert places == {0: ("0", "1", "0", "2"), 1: ("0", "2", "1", "2"),
                      2: ("1", "2", "0", "1")}
    assert got[0]["HVDMX_RENDEZVOUS"].startswith("127.0.0.1:")
    port = got[0]["HVDMX_RENDEZVOUS"].split(":")[1]
    for r in (1, 2):
        assert got[r]["HVDMX_RENDEZVOUS"] == f"{address}:{port}"
        assert got[r]["HVDMX_FUSION_THRESHOLD"] == str(1024 * 1024)
        assert got[r]["PYTHONPATH"] == REPO  # forwarded on the command line
        assert got[r]["PATH"] == ENV["PATH"]  # forwarded on standard input
        assert got[r]["NOT_FORWARDED"] is None
        assert got[r]["seen"] == [[x, socket.gethostname()] for x in range(3)]
    assert all(r["key_ok"] and not r["key_on_a_command_line"] for r in got.values())
    calls = log.read_text().split("----\n")
    # The host check, then one start per remote rank: ssh-like, -x, the host,
    # one string for the remote shell; the key is on none of them.
    starts = [c.splitlines() for c in calls if c and "true" not in c.splitlines()]
    assert [c.splitlines() for c in calls if c.splitlines()[-1:] == ["true"]] == [
        ["-x", OTHER_HOST, "true"]]
    assert len(starts) == 2
    for words in starts:
        # One line: the interpreter's PYTHONPATH, the bootstrap module and the
        # command; the rank's variables and the rest came on standard input.
        assert words[:2] == ["-x", OTHER_HOST]
        assert "\n".join(words[2:]) == f"cd {REPO} && exec env PYTHONPATH={REPO} {PYTHON} " \
            f"-m hvdmx.runner.bootstrap {PYTHON} -c {shlex.quote(PROGRAM)}"
    assert "cd" * 32 not in log.read_text()


def test_a_remote_shell_that_fails_is_named(tmp_path):
    bad = tmp_path / "bad-ssh"
    bad.write_text("#!/bin/sh\necho 'no route to that host' >&2\nexit 255\n")
    bad.chmod(0o755)
    route_here(OTHER_HOST)
    code, out, err = run(["--no-mpi", "-H", f"localhost:1,{OTHER_HOST}:1", "--ssh-exec",
                          str(bad), PYTHON, "-V"])
    assert code == 2
    assert f"cannot start a process on host '{OTHER_HOST}': '{bad} -x {OTHER_HOST} true' " \
           "failed (exit 255: no route to that host)" in err
    assert "or name another remote shell with --ssh-exec PATH" in err


def test_a_remote_rank_that_fails_stops_the_job(tmp_path):
    route_here(OTHER_HOST)
    ssh, _ = fake_ssh(tmp_path)
    started = time.monotonic()
    code, out, err = run(["--no-mpi", "-H", f"localhost:1,{OTHER_HOST}:1", "--ssh-exec", ssh,
                          PYTHON, "-c", WAITER, "exit", "1", "-1", str(tmp_path)])
    assert code == 3, err
    assert f"hvdmxrun: rank 1 (host {OTHER_HOST}) exited with status 3; stopping the other " \
           "ranks" in err
    assert time.monotonic() - started < 40
    assert none_alive(pids_of(tmp_path, 2), 5)


@pytest.mark.parametrize("line, message", [
    (b"HVDMX_SECRET_KEY=ab\n", "its first line is not a JSON object"),
    (b'["a", "b"]\n', "must be a JSON object of variable names"),
    (b'{"A=B": "x"}\n', "must be a JSON object of variable names"),
    (b'{"A": 1}\n', "must be a JSON object of variable names"),
    (b"\xff\n", "its first line is not a JSON object"),
])
def test_the_bootstrap_refuses_a_bad_first_line(line, message):
    result = subprocess.run([PYTHON, "-m", "hvdmx.runner.bootstrap", "true"], input=line,
                            env=ENV, capture_output=True, timeout=60)
    assert result.returncode == 125, result.stderr
    assert message in result.stderr.decode(), result.stderr


def test_the_bootstrap_puts_its_first_line_into_the_environment():
    from hvdmx.runner.bootstrap import parse_variables, variables_line
    odd = {"HVDMX_SECRET_KEY": "cd" * 32, "SPACED": "a b 'c' \"d\" $e !f", "LINES": "1\n2",
           "PATH": os.environ["PATH"]}
    line = variables_line(odd)
    assert line.count(b"\n") == 1 and line.endswith(b"\n")
    assert parse_variables(line) == odd
    show = "import json, os; print(json.dumps({n: os.environ.get(n) for n in %r}))" % sorted(odd)
    # Its standard input stays open while the command runs (its end stops it).
    bootstrap = subprocess.Popen([PYTHON, "-m", "hvdmx.runner.bootstrap", PYTHON, "-c", show],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=ENV)
    try:
        bootstrap.stdin.write(line)
        bootstrap.stdin.flush()
        out = bootstrap.stdout.read()
        assert bootstrap.wait(60) == 0
    finally:
        bootstrap.kill()
        bootstrap.stdin.close()
        bootstrap.stdout.close()
    assert json.loads(out) == odd
    # No first line (hvdmxrun went away): 125, the command never started.
    result = subprocess.run([PYTHON, "-m", "hvdmx.runner.bootstrap", PYTHON, "-c", show],
                            input=b"", env=ENV, capture_output=True, timeout=60)
    assert (result.returncode, result.stdout) == (125, b"")


def test_dry_run_prints_each_ranks_command_without_the_key(tmp_path):
    route_here(OTHER_HOST)
    code, out, err = run(["--no-mpi", "--dry-run", "-H", f"localhost:1,{OTHER_HOST}:1",
                          "--ssh-exec", "/bin/true", PYTHON, "train.py"],
                         env={"HVDMX_SECRET_KEY": "ef" * 32})
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("rank 0 on localhost (here) with HVDMX_RENDEZVOUS=127.0.0.1:PORT "
                               "HVDMX_RANK=0 HVDMX_SIZE=2 ")
    assert lines[0].endswith(f": {PYTHON} -m hvdmx.runner.bootstrap {PYTHON} train.py")
    # The remote rank's variables by value, hvdmxrun's it forwards by name:
    # both travel on its standard input; the command is one readable line.
    assert lines[1].startswith(f"rank 1 on {OTHER_HOST} (through the remote shell) with "
                               "HVDMX_RENDEZVOUS=ADDRESS:PORT HVDMX_RANK=1 HVDMX_SIZE=2 ")
    names = re.search(r" and hvdmxrun's ([A-Z_, ]+): ", lines[1])
    assert names and "PATH" in names.group(1).split(", "), lines[1]
    assert lines[1].endswith(f": /bin/true -x {OTHER_HOST} 'cd {REPO} && exec env "
                             f"PYTHONPATH={REPO} {PYTHON} -m hvdmx.runner.bootstrap {PYTHON} "
                             "train.py'")
    assert ENV["PATH"] not in out
    assert "ef" * 32 not in out + err


@pytest.mark.parametrize("argv, env, message", [
    (["--no-mpi", "--mpi-args", "-ppn 2", "-np", "2"], {},
     "--no-mpi and --mpi-args '-ppn 2' contradict each other"),
    (["--no-mpi", "--mpiexec", "mpiexec", "-np", "2"], {},
     "--no-mpi and --mpiexec 'mpiexec' contradict each other"),
    (["--ssh-exec", "/bin/true", "-np", "2"], {},
     "--ssh-exec '/bin/true' applies with --no-mpi only; add --no-mpi"),
    (["--no-mpi", "--ssh-exec", "/no/such/ssh", "-np", "2"], {},
     "--ssh-exec '/no/such/ssh' is not an executable file"),
    (["--no-mpi", "-np", "2"], {"HVDMX_SECRET_KEY": "12345"},
     "HVDMX_SECRET_KEY must be 64 hex digits (a 256-bit key), but it has 5 characters"),
    (["--no-mpi", "-np", "2"], {"HVDMX_RENDEZVOUS_TIMEOUT": "soon"},
     "HVDMX_RENDEZVOUS_TIMEOUT='soon' must be a number of seconds > 0"),
    (["--no-mpi"], {}, "give the number of processes with -np N"),
])
def test_usage_errors_name_the_flag_and_the_fix(argv, env, message):
    code, out, err = run([*argv, PYTHON, "-V"], env=env, timeout=60)
    assert code == 2, err
    assert message in err.splitlines()[-1], err
    assert "12345" not in err or "HVDMX_SECRET_KEY" not in env


def test_a_command_that_cannot_start_is_named():
    code, out, err = run(["--no-mpi", "-np", "2", "/no/such/program", "x"])
    assert code == 127, err
    assert re.search(r"^\[[01]\]<stderr>:hvdmxrun: cannot start '/no/such/program' on "
                     rf"{re.escape(os.uname().nodename)}: \[Errno 2\] No such file", err, re.M), err
    assert re.search(r"^hvdmxrun: rank [01] \(host .*\) exited with status 127", err, re.M), err


def test_unused_hosts_are_warned_about(tmp_path):
    code, out, err = run(["--no-mpi", "-np", "1", "-H", "localhost:1,127.0.0.1:1", PYTHON,
                          "-c", "print('one')"])
    assert code == 0, err
    assert out == "[0]<stdout>:one\n"
    assert "hvdmxrun: warning: -np 1 fills the slots of -H (localhost:1,127.0.0.1:1) in " \
           "order, so 127.0.0.1 get(s) no process" in err


def test_the_remote_command_is_one_line_any_shell_can_take():
    from hvdmx.runner import nompi as run_nompi
    place = run_nompi.Placement(1, "far", False, 0, 1, 1, 2)
    env = {"A": "x y", "B": "it's\nhere!", "PYTHONPATH": "/my path/x"}
    cmd = run_nompi.rank_command(place, env, ["python", "train.py"],
                                 ["ssh", "-x"], "/usr/bin/python3", "/home/u/my job")
    assert cmd[:3] == ["ssh", "-x", "far"] and len(cmd) == 4
    remote = cmd[3]
    # csh ends a quoted string at a newline and expands '!' inside quotes:
    # the variables travel on standard input, but those the interpreter needs.
    assert "\n" not in remote and "!" not in remote
    assert remote == ("cd '/home/u/my job' && exec env 'PYTHONPATH=/my path/x' "
                      "/usr/bin/python3 -m hvdmx.runner.bootstrap python train.py")
    # What sh runs there is the bootstrap and the command, as given.
    words = subprocess.run(["sh", "-c", 'printf "%s\\n" "$@"', "sh",
                            *shlex.split(remote.split(" && ", 1)[1])],
                           capture_output=True, text=True, timeout=30).stdout.splitlines()
    assert words == ["exec", "env", "PYTHONPATH=/my path/x", "/usr/bin/python3", "-m",
                     "hvdmx.runner.bootstrap", "python", "train.py"]
    from hvdmx.runner.bootstrap import parse_variables
    key = "ab" * 32
    assert parse_variables(run_nompi.first_line(place, env, key)) == {
        "A": "x y", "B": "it's\nhere!", "HVDMX_SECRET_KEY": key}
    here = run_nompi.Placement(0, "near", True, 0, 1, 0, 2)
    assert parse_variables(run_nompi.first_line(here, env, key)) == {"HVDMX_SECRET_KEY": key}


def test_help_describes_no_mpi():
    code, out, err = run(["--help"], timeout=60)
    assert code == 0
    assert "--no-mpi" in out and "--ssh-exec PATH" in out and "HVDMX_RENDEZVOUS" in out
