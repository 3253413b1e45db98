"""The hvdmxrun launcher: hosts, tuning flags, the commands built for MPICH,
Intel MPI and Open MPI (pure functions, no MPI needed), the errors, and whole
jobs started through `python -m hvdmx.run` with the mpich wheel's mpiexec."""
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

import hvdmx
import hvdmx._mpi
import _hvdmx_testing
from hvdmx import _core
from hvdmx.runner import hosts as run_hosts, launch as run
from hvdmx.runner.launch import Host, Launcher, UsageError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
# The launcher and the ranks import this checkout's hvdmx.
ENV = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1")

MPICH = Launcher("/mpi/bin/mpiexec", run.MPICH, "4.1.2")
INTEL = Launcher("/intel/bin/mpiexec", run.INTEL, "2021.10")
OPENMPI = Launcher("/ompi/bin/mpirun", run.OPENMPI, "4.1.5")


def parse(*argv):
    return run.make_parser().parse_args(list(argv))


def usage_error(capsys, *argv):
    """Runs main(argv), which must fail as argparse does; returns the message."""
    with pytest.raises(SystemExit) as info:
        run.main(list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: hvdmxrun")
    return err.splitlines()[-1]


def launch(*argv, timeout=120, env=ENV, **kwargs):
    return subprocess.run([sys.executable, "-m", "hvdmx.run", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout, **kwargs)


# ---- hosts ----------------------------------------------------------------

def test_hosts_flag():
    assert run.parse_hosts("a:2,b:3") == [Host("a", 2), Host("b", 3)]
    assert run.parse_hosts("node-1.example.com, 10.0.0.2:4") == [
        Host("node-1.example.com", 1), Host("10.0.0.2", 4)]
    assert run.format_hosts([Host("a", 2), Host("b", 1)]) == "a:2,b:1"


@pytest.mark.parametrize("spec,expected", [
    ("", "empty entry"),
    ("a:2,,b:2", "empty entry"),
    ("a:0", "slots '0'"),
    ("a:two", "slots 'two'"),
    ("a:-1", "slots '-1'"),
    ("a:", "slots ''"),
    ("a:1:2", "is not a host"),
    (":4", "is not a host"),
    ("a b:2", "is not a host"),
    ("a:2,b:1,a:1", "host 'a' is listed more than once"),
])
def test_bad_hosts_flag(spec, expected):
    with pytest.raises(UsageError) as info:
        run.parse_hosts(spec)
    assert f"-H/--hosts {spec!r}" in str(info.value)
    assert expected in str(info.value)


def test_hostfile_formats_comments_and_blank_lines():
    text = textwrap.dedent("""\
        # two formats, comments and blank lines

        node1 slots=4   # Open MPI style
        node2:2
          node3
        node4 slots=1
    """)
    assert run_hosts.parse_hostfile(text, "hosts.txt") == [
        Host("node1", 4), Host("node2", 2), Host("node3", 1), Host("node4", 1)]


@pytest.mark.parametrize("text,expected", [
    ("a slots=4\nb slots=x\n", "line 2: slots='x'"),
    ("a slots=0\n", "line 1: slots='0'"),
    ("a max_slots=4\n", "line 1: 'a max_slots=4' is not understood"),
    ("a:2 slots=2\n", "line 1: 'a:2 slots=2' is not understood"),
    ("\n\na:x\n", "line 3: 'a:x' has slots 'x'"),
    ("# only a comment\n\n", "lists no hosts"),
    ("a:1\nb:1\na:1\n", "host 'a' is listed more than once"),
])
def test_bad_hostfile_names_the_file_and_line(text, expected):
    with pytest.raises(UsageError) as info:
        run_hosts.parse_hostfile(text, "hosts.txt")
    assert "--hostfile 'hosts.txt'" in str(info.value)
    assert expected in str(info.value)


def test_hostfile_read_from_disk(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("x slots=2\ny:1\n")
    assert run.read_hostfile(str(path)) == [Host("x", 2), Host("y", 1)]
    with pytest.raises(UsageError, match=r"--hostfile '.*missing' cannot be read \(No such "
                                         r"file or directory\); pass a readable text file"):
        run.read_hostfile(str(tmp_path / "missing"))
    with pytest.raises(UsageError, match="cannot be read"):
        run.read_hostfile(str(tmp_path))  # a directory


def test_process_count_from_np_or_slots():
    hosts = [Host("a", 2), Host("b", 2)]
    assert run.resolve_num_proc(3, None, "") == 3
    assert run.resolve_num_proc(None, hosts, "-H") == 4
    assert run.resolve_num_proc(3, hosts, "-H") == 3
    with pytest.raises(UsageError, match=r"-np 5 is more than the 4 slot\(s\) of -H "
                                         r"\(a:2,b:2\); lower -np to 4"):
        run.resolve_num_proc(5, hosts, "-H")
    with pytest.raises(UsageError, match="give the number of processes with -np N"):
        run.resolve_num_proc(None, None, "")



def test_hosts_left_without_a_process_are_named():
    hosts = [Host("a", 2), Host("b", 2), Host("c", 1)]
    assert run.unused_hosts(5, hosts) == []
    assert run.unused_hosts(3, hosts) == ["c"]
    assert run.unused_hosts(2, hosts) == ["b", "c"]


def test_np_below_the_slots_warns_naming_the_empty_hosts(capsys):
    assert run.main(["-np", "2", "-H", "a:2,b:2", "--dry-run", "prog"]) == 0
    err = capsys.readouterr().err
    assert ("hvdmxrun: warning: -np 2 fills the slots of -H (a:2,b:2) in order, so b get(s) "
            "no process; raise -np or list fewer hosts") in err


def test_a_host_that_does_not_resolve_is_named():
    def resolve(name, port):
        if name == "nowhere":
            raise socket.gaierror(-2, "Name or service not known")
        return []
    run.unresolved_hosts([Host("here", 1)], "-H", resolve)
    with pytest.raises(UsageError) as info:
        run.unresolved_hosts([Host("here", 1), Host("nowhere", 2)], "--hostfile 'h'", resolve)
    assert str(info.value) == (
        "--hostfile 'h': host 'nowhere' does not resolve on this machine (Name or service not "
        "known); check the name, or give its address, or make it resolve (DNS, /etc/hosts)")


def test_a_host_that_does_not_resolve_stops_hvdmxrun(capsys):
    message = usage_error(capsys, "-H", "localhost:1,no-such-host.invalid:1", "python", "-V")
    assert "host 'no-such-host.invalid' does not resolve on this machine" in message


@pytest.mark.parametrize("mpi_args,shell", [
    ([], ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=20"]),
    (["-launcher", "rsh"], ["rsh"]),
    (["-launcher", "ssh", "-launcher-exec", "/x/launch"], ["/x/launch"]),
    (["-bootstrap-exec=/y/l"], ["/y/l"]),
    (["-launcher", "slurm"], None),
    (["-launcher=fork"], None),
])
def test_remote_shell_of_hydra(mpi_args, shell, monkeypatch):
    for name in ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID"):
        monkeypatch.delenv(name, raising=False)
    assert run.remote_shell(MPICH, mpi_args) == shell


def test_remote_shell_of_open_mpi(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert run.remote_shell(OPENMPI, ["--mca", "plm_rsh_agent", "rsh -x"]) == ["rsh", "-x"]
    assert run.remote_shell(OPENMPI, [])[0] == "ssh"


def remote_shell_script(tmp_path, body):
    script = tmp_path / "shell"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return str(script)


def test_a_host_the_remote_shell_cannot_reach_is_named(tmp_path):
    shell = remote_shell_script(tmp_path, 'if [ "$1" = bad ]; then echo "ssh: connect to host '
                                          'bad port 22: Connection refused" >&2; exit 255; fi\n')
    here = {"near"}.__contains__
    run.check_remote_starts([Host("near", 1), Host("good", 2)], [shell], is_this_host=here)
    with pytest.raises(UsageError) as info:
        run.check_remote_starts([Host("good", 1), Host("bad", 1)], [shell], is_this_host=here)
    text = str(info.value)
    assert text.startswith(f"cannot start a process on host 'bad': '{shell} bad true' failed "
                           "(exit 255: ssh: connect to host bad port 22: Connection refused)")
    assert "or pass --no-host-check" in text


def test_a_remote_shell_that_hangs_is_named(tmp_path):
    shell = remote_shell_script(tmp_path, "exec sleep 30\n")
    with pytest.raises(UsageError, match=r"host 'slow'.*\(no answer within 0.5 s\)"):
        run.check_remote_starts([Host("slow", 1)], [shell], timeout=0.5,
                                is_this_host=lambda name: False)


def test_a_missing_remote_shell_is_named():
    with pytest.raises(UsageError, match=r"hosts far would be reached with '/no/such/ssh', "
                                         "which is not found"):
        run.check_remote_starts([Host("far", 1)], ["/no/such/ssh"],
                                is_this_host=lambda name: False)


def test_a_failing_remote_shell_stops_hvdmxrun(tmp_path, capsys):
    shell = remote_shell_script(tmp_path, "echo 'no route to that host' >&2; exit 255\n")
    # 192.0.2.1 (TEST-NET-1) resolves as an address and is not this machine.
    message = usage_error(capsys, "-H", "localhost:1,192.0.2.1:1", "--mpi-args",
                          f"-launcher ssh -launcher-exec {shell}", "python", "-V")
    assert f"cannot start a process on host '192.0.2.1': '{shell} 192.0.2.1 true' failed " \
           "(exit 255: no route to that host)" in message

# ---- tuning flags -----------------------------------------------------------

@pytest.mark.parametrize("argv,expected", [
    ([], {}),
    (["--fusion-threshold-mb", "32"], {"HVDMX_FUSION_THRESHOLD": str(32 * 1024 * 1024)}),
    (["--fusion-threshold-mb", "0.5"], {"HVDMX_FUSION_THRESHOLD": "524288"}),
    (["--fusion-threshold-mb", "0"], {"HVDMX_FUSION_THRESHOLD": "0"}),
    (["--fusion-max-tensor-kb", "1024"], {"HVDMX_FUSION_MAX_TENSOR_BYTES": "1048576"}),
    (["--fusion-max-tensor-kb", "0.5"], {"HVDMX_FUSION_MAX_TENSOR_BYTES": "512"}),
    (["--fusion-piece-kb", "4096"], {"HVDMX_FUSION_PIECE_BYTES": "4194304"}),
    (["--fusion-piece-kb", "1.5"], {"HVDMX_FUSION_PIECE_BYTES": "1536"}),
    (["--output-pool-mb", "64"], {"HVDMX_OUTPUT_POOL_BYTES": str(64 * 1024 * 1024)}),
    (["--output-pool-mb", "0"], {"HVDMX_OUTPUT_POOL_BYTES": "0"}),
    (["--cycle-time-ms", "5"], {"HVDMX_CYCLE_TIME": "5"}),
    (["--cycle-time-ms", "2.5"], {"HVDMX_CYCLE_TIME": "2.5"}),
    (["--cache-capacity", "0"], {"HVDMX_CACHE_CAPACITY": "0"}),
    (["--cache-capacity", "2048"], {"HVDMX_CACHE_CAPACITY": "2048"}),
    (["--allreduce-algo", "RING"], {"HVDMX_ALLREDUCE_ALGO": "ring"}),
    (["--allreduce-algo", "shm"], {"HVDMX_ALLREDUCE_ALGO": "shm"}),
    (["--hierarchical-allreduce"], {"HVDMX_HIERARCHICAL_ALLREDUCE": "1"}),
    (["--timeline-filename", "/tmp/a b.json"], {"HVDMX_TIMELINE": "/tmp/a b.json"}),
    (["--timeline-filename", "t.json", "--timeline-mark-cycles"],
     {"HVDMX_TIMELINE": "t.json", "HVDMX_TIMELINE_MARK_CYCLES": "1"}),
    (["--autotune", "--autotune-log-file", "tune.csv"],
     {"HVDMX_AUTOTUNE": "1", "HVDMX_AUTOTUNE_LOG": "tune.csv"}),
    (["--stall-check-warning-time-seconds", "30"], {"HVDMX_STALL_CHECK_TIME_SECONDS": "30"}),
    (["--stall-check-shutdown-time-seconds", "120.5"],
     {"HVDMX_STALL_SHUTDOWN_TIME_SECONDS": "120.5"}),
    (["--no-stall-check"], {"HVDMX_STALL_CHECK_TIME_SECONDS": "0",
                            "HVDMX_STALL_SHUTDOWN_TIME_SECONDS": "0"}),
    (["--log-level", "DEBUG"], {"HVDMX_LOG_LEVEL": "debug"}),
    (["--log-level", "warn"], {"HVDMX_LOG_LEVEL": "warn"}),
])
def test_tuning_flags_become_variables(argv, expected):
    assert run.tuning_env(parse(*argv, "prog")) == expected


def test_tuning_values_are_what_the_core_accepts():
    env = run.tuning_env(parse("--fusion-threshold-mb", "1.5", "--cycle-time-ms", "0.25",
                               "--cache-capacity", "7", "--log-level", "Info",
                               "--stall-check-warning-time-seconds", "1e1",
                               "--allreduce-algo", "Ring", "--output-pool-mb", "0.25", "prog"))
    config = _hvdmx_testing.load_config(env)
    assert config["allreduce_algo"] == "ring"
    assert config["output_pool_bytes"] == 262144
    assert config["fusion_threshold"] == 1572864
    assert config["cycle_time_ms"] == 0.25
    assert config["cache_capacity"] == 7
    assert config["stall_check_seconds"] == 10
    assert config["log_level"] == _hvdmx_testing.load_config(
        {"HVDMX_LOG_LEVEL": "info"})["log_level"]


@pytest.mark.parametrize("stall", [["--no-stall-check"],
                                   ["--stall-check-warning-time-seconds", "2.5",
                                    "--stall-check-shutdown-time-seconds", "30"]])
def test_every_flag_together_passes_the_cores_validation(tmp_path, stall):
    # Variables this build does not read yet are ignored; those it reads must accept
    # exactly what the launcher writes.
    env = run.tuning_env(parse(
        "--fusion-threshold-mb", "0", "--fusion-max-tensor-kb", "0", "--fusion-piece-kb", "1",
        "--output-pool-mb", "0.5", "--cycle-time-ms", "1e-1", "--cache-capacity", "0",
        "--allreduce-algo", "MPI", "--hierarchical-allreduce",
        "--timeline-filename", str(tmp_path / "t.json"),
        "--timeline-mark-cycles", "--autotune", "--autotune-log-file",
        str(tmp_path / "tune.csv"), "--log-level", "TRACE", *stall, "prog"))
    assert len(env) == 15
    _hvdmx_testing.load_config(env)


@pytest.mark.parametrize("argv,expected", [
    (["-np", "0"], "argument -np/--num-proc: invalid value '0': expected the number of "
                   "processes, an integer >= 1"),
    (["-np", "-2"], "argument -np/--num-proc: invalid value '-2'"),
    (["-np", "two"], "argument -np/--num-proc: invalid value 'two'"),
    (["--fusion-threshold-mb", "-1"], "argument --fusion-threshold-mb: invalid value '-1': "
                                      "expected a number >= 0 (MiB; 0 turns fusion off)"),
    (["--fusion-threshold-mb", "64MB"], "argument --fusion-threshold-mb: invalid value "
                                        "'64MB'"),
    (["--fusion-piece-kb", "0.5"], "argument --fusion-piece-kb: invalid value '0.5': "
                                   "expected a number >= 1 (KiB)"),
    (["--cycle-time-ms", "nan"], "argument --cycle-time-ms: invalid value 'nan': expected a "
                                 "number >= 0 (milliseconds"),
    (["--cycle-time-ms", "inf"], "argument --cycle-time-ms: invalid value 'inf'"),
    (["--cache-capacity", "1.5"], "argument --cache-capacity: invalid value '1.5': expected "
                                  "an integer >= 0 (entries; 0 turns the cache off)"),
    (["--stall-check-warning-time-seconds", "-5"],
     "argument --stall-check-warning-time-seconds: invalid value '-5'"),
    (["--stall-check-shutdown-time-seconds", "soon"],
     "argument --stall-check-shutdown-time-seconds: invalid value 'soon'"),
    (["--log-level", "loud"], "argument --log-level: invalid value 'loud': expected one of "
                              "trace, debug, info, warning, warn, error, fatal (any case)"),
    (["--allreduce-algo", "nccl"], "argument --allreduce-algo: invalid value 'nccl': expected "
                                   "one of auto, shm, ring, mpi (any case)"),
    (["--output-pool-mb", "-1"], "argument --output-pool-mb: invalid value '-1': expected a "
                                 "number >= 0 (MiB; 0 keeps no output memory)"),
    (["--timeline-filename", ""], "argument --timeline-filename: invalid value ''"),
    (["--no-stall-check", "--stall-check-warning-time-seconds", "5"],
     "argument --stall-check-warning-time-seconds: not allowed with argument "
     "--no-stall-check"),
    (["--no-stall-check", "--stall-check-shutdown-time-seconds", "5"],
     "--no-stall-check and --stall-check-shutdown-time-seconds 5 contradict each other"),
    (["-H", "a:1", "--hostfile", "f"], "argument --hostfile: not allowed with argument "
                                       "-H/--hosts"),
])
def test_bad_flags_exit_2_naming_flag_value_and_fix(capsys, argv, expected):
    assert expected in usage_error(capsys, *argv, "prog")


# ---- the launcher -----------------------------------------------------------

MPICH_VERSION = """HYDRA build details:
    Version:                                 4.1.2
    Release Date:                            Wed Jun  7 15:22:45 CDT 2023
"""
INTEL_VERSION = ("Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 "
                 "(id: c2e19c2f3e)\nCopyright 2003-2023, Intel Corporation.\n")
OMPI_BUGS = "\n\nReport bugs to http://www.open-mpi.org/community/help/\n"
OPENMPI4_VERSION = "mpirun (Open MPI) 4.1.5" + OMPI_BUGS
OPENMPI5_VERSION = "mpirun (Open MPI) 5.0.3" + OMPI_BUGS
OPENRTE_VERSION = "mpiexec (OpenRTE) 2.1.1" + OMPI_BUGS


@pytest.mark.parametrize("output,flavor,version", [
    (MPICH_VERSION, run.MPICH, "4.1.2"),
    (INTEL_VERSION, run.INTEL, "2021.10"),
    (OPENMPI4_VERSION, run.OPENMPI, "4.1.5"),
    (OPENMPI5_VERSION, run.OPENMPI, "5.0.3"),
    (OPENRTE_VERSION, run.OPENMPI, "2.1.1"),
])
def test_launcher_identified_from_its_version_output(output, flavor, version):
    assert run.identify_launcher("/x/mpiexec", output) == Launcher("/x/mpiexec", flavor,
                                                                   version)


def test_unknown_launcher_is_refused():
    with pytest.raises(UsageError, match=r"cannot tell which MPI /x/mpirun belongs to: "
                                         r"'/x/mpirun --version' says 'srun 23\.02'.*--mpiexec"):
        run.identify_launcher("/x/mpirun", "srun 23.02\n")


def test_the_installed_mpiexec_is_mpich():
    launcher = run.detect_launcher(MPIEXEC)
    assert launcher.flavor == run.MPICH
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?\S*", launcher.version)


def fake_executable(path):
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


def test_mpiexec_search_order(tmp_path):
    (tmp_path / "venv").mkdir()
    (tmp_path / "path").mkdir()
    python = str(tmp_path / "venv" / "python")
    on_path = fake_executable(tmp_path / "path" / "mpirun")
    environ = {"PATH": str(tmp_path / "path")}
    assert run.find_mpiexec(None, environ, python) == on_path
    beside = fake_executable(tmp_path / "venv" / "mpiexec")
    assert run.find_mpiexec(None, environ, python) == beside
    chosen = fake_executable(tmp_path / "chosen")
    assert run.find_mpiexec(None, dict(environ, HVDMX_MPIEXEC=chosen), python) == chosen
    assert run.find_mpiexec(on_path, dict(environ, HVDMX_MPIEXEC=chosen), python) == on_path
    assert run.find_mpiexec("mpirun", environ, python) == on_path  # a name: on PATH


def test_mpiexec_not_found(tmp_path):
    with pytest.raises(UsageError, match=r"no MPI launcher found: looked for mpiexec and "
                                         r"mpirun in .* and on PATH; install one \(pip "
                                         r"install mpich mpi4py\), pass --mpiexec "
                                         r"/path/to/mpiexec, or start the job with "
                                         r"--no-mpi, which needs no MPI"):
        run.find_mpiexec(None, {"PATH": str(tmp_path)}, str(tmp_path / "python"))
    with pytest.raises(UsageError, match=r"--mpiexec '/no/such/mpiexec' is not an "
                                         r"executable file"):
        run.find_mpiexec("/no/such/mpiexec", {}, sys.executable)
    with pytest.raises(UsageError, match=r"HVDMX_MPIEXEC '/no/such' is not an executable"):
        run.find_mpiexec(None, {"HVDMX_MPIEXEC": "/no/such"}, sys.executable)


def test_mpiexec_not_found_exits_2(capsys):
    message = usage_error(capsys, "-np", "1", "--mpiexec", "/no/such/mpiexec", "true")
    assert "--mpiexec '/no/such/mpiexec' is not an executable file" in message


# ---- the commands -----------------------------------------------------------

COMMAND = ["python", "train.py", "--lr", "0.1"]
TUNING = {"HVDMX_FUSION_THRESHOLD": "33554432", "HVDMX_LOG_LEVEL": "debug"}


def test_mpich_command():
    assert run.build_command(MPICH, 4, None, {}, [], COMMAND, {}) == [
        "/mpi/bin/mpiexec", "-n", "4", "-bind-to", "none", *COMMAND]
    hosts = [Host("a", 2), Host("b", 2)]
    assert run.build_command(MPICH, 3, hosts, TUNING, ["-ppn", "2"], COMMAND,
                             {"PATH": "/bin", "HVDMX_CYCLE_TIME": "1"}, as_root=True) == [
        "/mpi/bin/mpiexec", "-n", "3", "-hosts", "a:2,b:2", "-bind-to", "none",
        "-genv", "HVDMX_FUSION_THRESHOLD", "33554432", "-genv", "HVDMX_LOG_LEVEL", "debug",
        "-ppn", "2", *COMMAND]


def test_intel_command_keeps_intel_pinning():
    assert run.build_command(INTEL, 2, [Host("a", 2)], TUNING, [], COMMAND, {}) == [
        "/intel/bin/mpiexec", "-n", "2", "-hosts", "a:2",
        "-genv", "HVDMX_FUSION_THRESHOLD", "33554432", "-genv", "HVDMX_LOG_LEVEL", "debug",
        *COMMAND]


def test_openmpi_command():
    environ = {"PATH": "/venv/bin:/bin", "HOME": "/root", "PYTHONPATH": "/src",
               "HVDMX_CYCLE_TIME": "2", "HVDMX_LOG_LEVEL": "info", "HOROVOD_CACHE_CAPACITY": "9",
               "MXNET_ENGINE_TYPE": "NaiveEngine", "NCCL_DEBUG": "INFO",
               "OMP_NUM_THREADS": "1", "OMPI_MCA_x": "y"}
    assert run.build_command(OPENMPI, 4, [Host("a", 2), Host("b", 2)], TUNING, [], COMMAND,
                             environ) == [
        "/ompi/bin/mpirun", "-np", "4", "-H", "a:2,b:2", "--bind-to", "none",
        "--map-by", "slot",
        "-x", "HVDMX_FUSION_THRESHOLD=33554432", "-x", "HVDMX_LOG_LEVEL=debug",
        # set in the environment: forwarded by name (the flag's value wins above)
        "-x", "PATH", "-x", "PYTHONPATH", "-x", "HVDMX_CYCLE_TIME",
        "-x", "HOROVOD_CACHE_CAPACITY", "-x", "MXNET_ENGINE_TYPE", "-x", "NCCL_DEBUG",
        "-x", "OMP_NUM_THREADS", *COMMAND]


def test_openmpi_as_root_and_local():
    assert run.build_command(OPENMPI, 2, None, {}, [], ["./a.out"], {}, as_root=True) == [
        "/ompi/bin/mpirun", "--allow-run-as-root", "-np", "2", "--bind-to", "none",
        "--map-by", "slot", "./a.out"]


@pytest.mark.parametrize("launcher", [MPICH, OPENMPI])
def test_binding_or_mapping_in_mpi_args_replaces_ours(launcher):
    for mpi_args in (["-bind-to", "core"], ["--bind-to", "socket"], ["--bind-to=core"]):
        cmd = run.build_command(launcher, 2, None, {}, mpi_args, ["x"], {})
        assert [a for a in cmd if "bind-to" in a] == [mpi_args[0]]
        assert cmd[-1 - len(mpi_args):-1] == mpi_args
    if launcher is OPENMPI:
        cmd = run.build_command(launcher, 2, None, {}, ["--map-by", "node"], ["x"], {})
        assert cmd.count("--map-by") == 1 and "slot" not in cmd


@pytest.mark.parametrize("mpi_args,flag,own", [
    ("-n 2", "-n", "-np"), ("-np 2", "-np", "-np"), ("--np=2", "--np=2", "-np"),
    ("-hosts a:2", "-hosts", "-H or --hostfile"), ("-H a", "-H", "-H or --hostfile"),
    ("-f hosts", "-f", "-H or --hostfile"), ("--hostfile h", "--hostfile", "-H or --hostfile"),
])
def test_mpi_args_may_not_repeat_our_flags(capsys, mpi_args, flag, own):
    message = usage_error(capsys, "-np", "2", "--mpi-args", mpi_args, "prog")
    assert f"--mpi-args {mpi_args!r} contains {flag!r}; give that with hvdmxrun's {own}" in (
        message)


def test_mpi_args_value_may_start_with_a_dash(capsys):
    # and an option of the command with the same name stays the command's
    assert run.main(["--mpi-args", "-verbose", "-np", "1", "--dry-run", "prog", "--mpi-args",
                     "x"]) == 0
    assert shlex.split(capsys.readouterr().out) == [
        MPIEXEC, "-n", "1", "-bind-to", "none", "-verbose", "prog", "--mpi-args", "x"]


def test_mpi_args_with_unbalanced_quotes(capsys):
    message = usage_error(capsys, "-np", "2", "--mpi-args", "-genv A 'b", "prog")
    assert "--mpi-args \"-genv A 'b\" cannot be split (No closing quotation); balance" in (
        message)


def test_build_mismatch_warning():
    assert run.launcher_mismatch("MPICH 4.1.2", MPICH) is None
    assert run.launcher_mismatch("Intel MPI 2021.10", MPICH) is None
    assert run.launcher_mismatch("MVAPICH2 2.3.7", INTEL) is None
    assert run.launcher_mismatch("Open MPI 4.1.5", OPENMPI) is None
    assert run.launcher_mismatch("MPI 3.1", OPENMPI) is None
    warning = run.launcher_mismatch("Open MPI 4.1.5", MPICH)
    assert ("hvdmx was built with Open MPI 4.1.5, but the launcher /mpi/bin/mpiexec "
            "(MPICH/Hydra 4.1.2) starts MPICH jobs" in warning)
    assert "every rank would run alone" in warning
    assert "Pass --mpiexec with the launcher of Open MPI 4.1.5" in warning
    assert "starts Open MPI jobs" in run.launcher_mismatch("MPICH 5.0.2", OPENMPI)


def test_dry_run_prints_the_command(capsys):
    # Options after the command belong to the command, '--' is optional.
    assert run.main(["-np", "2", "--cycle-time-ms", "1", "--mpi-args", "-ppn 1", "--dry-run",
                     "--", "python", "train.py", "-np", "3", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert shlex.split(out) == [MPIEXEC, "-n", "2", "-bind-to", "none",
                                "-genv", "HVDMX_CYCLE_TIME", "1", "-ppn", "1",
                                "python", "train.py", "-np", "3", "--dry-run"]


def test_dry_run_with_a_hostfile(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb:1\n")
    assert run.main(["--hostfile", str(hostfile), "--dry-run", "prog"]) == 0
    assert shlex.split(capsys.readouterr().out) == [
        MPIEXEC, "-n", "3", "-hosts", "a:2,b:1", "-bind-to", "none", "prog"]


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as info:
        run.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ["-np", "--num-proc", "-H", "--hosts", "--hostfile", "--mpiexec", "--mpi-args",
                 "--verbose", "--dry-run", "--check-build", "--fusion-threshold-mb",
                 "--output-pool-mb", "--cycle-time-ms", "--cache-capacity",
                 "--allreduce-algo", "--hierarchical-allreduce",
                 "--timeline-filename", "--timeline-mark-cycles", "--autotune",
                 "--autotune-log-file", "--no-stall-check",
                 "--stall-check-warning-time-seconds", "--stall-check-shutdown-time-seconds",
                 "--log-level"]:
        assert re.search(rf"(^|[\s,]){re.escape(flag)}([\s,=]|$)", out, re.M), flag


def test_console_script_is_declared():
    text = open(os.path.join(REPO, "pyproject.toml")).read()
    section = re.search(r"^\[project\.scripts\]\n(.*?)(^\[|\Z)", text, re.M | re.S)
    assert section, "pyproject.toml has no [project.scripts]"
    assert re.search(r'^hvdmxrun\s*=\s*"hvdmx\.run:main"\s*$', section.group(1), re.M)


# ---- whole jobs -------------------------------------------------------------

RANK_SCRIPT = """
import json, os, sys
import hvdmx as hvd
hvd.init()
report = {"rank": hvd.rank(), "size": hvd.size(), "argv": sys.argv[1:],
          "cycle_time": os.environ.get("HVDMX_CYCLE_TIME"),
          "key": os.environ.get("HVDMX_SECRET_KEY")}
sys.stdout.write("RANK " + json.dumps(report) + "\\n")  # one write: ranks share stdout
sys.stdout.flush()
"""
TRICKY_ARGS = ["two words", "it's", 'say "hi"', "$HOME", "`id`", "*", "; exit 1", "", "a\\b"]


def test_two_ranks_with_arguments_intact(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    result = launch("-np", "2", "--verbose", "--cycle-time-ms", "0.5", sys.executable,
                    str(script), *TRICKY_ARGS)
    assert result.returncode == 0, result.stderr
    reports = [json.loads(line[len("RANK "):]) for line in result.stdout.splitlines()
               if line.startswith("RANK ")]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["size"] == 2
        assert report["argv"] == TRICKY_ARGS
        assert report["cycle_time"] == "0.5"
    # Both ranks got the job's key in their environment: the same 256 bits,
    # never on the command line.
    keys = {r["key"] for r in reports}
    assert len(keys) == 1 and re.fullmatch("[0-9a-f]{64}", keys.pop())
    assert reports[0]["key"] not in result.stderr
    # --verbose printed the command, quoted so that a shell reads back the same words.
    printed = [line for line in result.stderr.splitlines() if line.startswith(MPIEXEC)]
    assert len(printed) == 1
    assert shlex.split(printed[0]) == [MPIEXEC, "-n", "2", "-bind-to", "none",
                                       "-genv", "HVDMX_CYCLE_TIME", "0.5",
                                       sys.executable, str(script), *TRICKY_ARGS]


def test_every_job_gets_a_key_of_its_own_unless_the_user_set_one():
    first, second = run.job_environ({"PATH": "/bin"}), run.job_environ({"PATH": "/bin"})
    assert re.fullmatch("[0-9a-f]{64}", first["HVDMX_SECRET_KEY"])
    assert first["HVDMX_SECRET_KEY"] != second["HVDMX_SECRET_KEY"]
    mine = {"HVDMX_SECRET_KEY": "ab" * 32}
    assert run.job_environ(mine) == mine
    assert "HVDMX_SECRET_KEY" not in run.job_environ({"HOROVOD_SECRET_KEY": "cd" * 32})
    # Open MPI forwards it by name; its value is never an argument.
    cmd = run.build_command(OPENMPI, 2, None, {}, [], ["prog"], first)
    assert "HVDMX_SECRET_KEY" in cmd and first["HVDMX_SECRET_KEY"] not in " ".join(cmd)


def test_pmix_variables_do_not_reach_hydra_ranks():
    # Only Hydra's ranks lose PMIX_*: Open MPI's mpirun is a PMIx launcher itself.
    environ = {"PMIX_NAMESPACE": "slurm.pmix.7.0", "PMIX_RANK": "0", "PATH": "/bin",
               "HVDMX_X": "1"}
    for launcher in (MPICH, INTEL):
        assert run.launcher_environ(launcher, environ) == {"PATH": "/bin", "HVDMX_X": "1"}
    assert run.launcher_environ(OPENMPI, environ) == environ


def test_job_started_inside_a_pmix_step(tmp_path):
    # hvdmxrun run where an outer PMIx launcher (srun --mpi=pmix) left its
    # variables: hvdmxrun must not start MPI itself (the mpich wheel aborts
    # there), and the ranks must not get them (each rank's hvdmx would drop
    # them too, but not in a program that starts MPI before loading hvdmx).
    script = tmp_path / "rank.py"
    script.write_text("import os, sys\n"
                      "seen = os.environ.get('PMIX_NAMESPACE')\n"
                      "from mpi4py import MPI\n"
                      "sys.stdout.write(f'RANK {MPI.COMM_WORLD.Get_size()} {seen}\\n')\n")
    result = launch("-np", "2", sys.executable, str(script),
                    env=dict(ENV, PMIX_NAMESPACE="slurm.pmix.7.0", PMIX_RANK="0"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("RANK 2 None\n") == 2, result.stdout


def test_exit_code_of_the_job_is_returned():
    result = launch("-np", "2", sys.executable, "-c", "import sys; sys.exit(3)")
    assert result.returncode == 3, result.stderr


def test_usage_error_from_the_command_line():
    result = launch("-np", "2", "--log-level", "loud", "true")
    assert result.returncode == 2
    assert "hvdmxrun: error: argument --log-level: invalid value 'loud'" in result.stderr
    assert result.stdout == ""


def test_sigterm_is_forwarded_to_the_ranks():
    body = textwrap.dedent("""
        import os, signal, sys, time
        def stop(signum, frame):
            sys.stdout.write(f"rank {os.environ['PMI_RANK']} got {signum}\\n")
            sys.stdout.flush()
            sys.exit(7)
        signal.signal(signal.SIGTERM, stop)
        sys.stdout.write("ready\\n")
        sys.stdout.flush()
        time.sleep(100)
    """)
    # A session of its own, so that if forwarding fails the whole job (launcher,
    # mpiexec, ranks) can be killed.
    launcher = subprocess.Popen([sys.executable, "-m", "hvdmx.run", "-np", "2",
                                 sys.executable, "-c", body], cwd=REPO, env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        ready = 0
        while ready < 2:
            line = launcher.stdout.readline()
            assert line, "the job ended before both ranks were ready"
            ready += line == "ready\n"
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=60)
    except BaseException:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.wait()
        raise
    assert launcher.returncode != 0
    assert "rank 0 got 15" in out and "rank 1 got 15" in out, err


def test_check_build():
    result = launch("--check-build")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith(f"hvdmx {hvdmx.__version__} (Python ")
    # The MPI plugin's vendor, known once MPI is loaded (as the report loads it).
    hvdmx._mpi.load_mpi()
    assert _core.mpi_vendor().startswith("MPICH ")
    assert f"compiled against  {_core.mpi_vendor()}\n" in out
    assert "\n    [x] MPI_THREAD_MULTIPLE\n" in out
    # Inside an outer PMIx job step, MPI does not start, and the report says so.
    pmix = launch("--check-build", env=dict(ENV, PMIX_NAMESPACE="slurm.pmix.7.0"))
    assert pmix.returncode == 0, pmix.stderr
    assert pmix.stdout == out.replace(
        "[x] MPI_THREAD_MULTIPLE", "[?] MPI_THREAD_MULTIPLE (not checked: PMIX_NAMESPACE is "
        "set, and MPI is not started inside another job's step)")
    assert re.search(rf"launcher +{re.escape(MPIEXEC)} \(MPICH/Hydra \S+\)\n", out)
    assert "[x] MPI (CPU tensors)\n" in out
    nccl = "[x] NCCL" if _core.nccl_built() else "[ ] NCCL"
    cuda = "[x] CUDA" if _core.cuda_built() else "[ ] CUDA"
    assert nccl in out and cuda in out
    assert "[x] allreduce\n" in out and "[x] broadcast\n" in out
    assert ("[x] allgather\n" if hasattr(hvdmx, "allgather") else "[ ] allgather\n") in out
    assert "[x] Gluon: DistributedTrainer\n" in out


def test_console_script_when_installed():
    script = os.path.join(os.path.dirname(sys.executable), "hvdmxrun")
    if not os.path.exists(script):
        pytest.skip("hvdmxrun is not installed beside this Python (make venv installs it)")
    result = subprocess.run([script, "-np", "3", "--dry-run", "prog", "a b"], env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert shlex.split(result.stdout)[1:] == ["-n", "3", "-bind-to", "none", "prog", "a b"]
