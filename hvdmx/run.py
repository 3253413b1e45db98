"""hvdmxrun: starts a training script on N processes through the MPI launcher.

    hvdmxrun -np 4 -H a:2,b:2 --fusion-threshold-mb 32 python train.py --epochs 3
    python -m hvdmx.run -np 4 python train.py        # the same, as a module

The launcher builds one ``mpiexec``/``mpirun`` command for the MPI it finds
(MPICH and Intel MPI, both Hydra-based, or Open MPI), passes the tuning flags to
every rank as HVDMX_* environment variables, runs the command as an argument
list (never through a shell) and exits with its exit code. ``--check-build``
reports what this installation of hvdmx can do. docs/running.md has the details.

Everything between parsing and running is a pure function of its arguments
(``parse_hosts``, ``parse_hostfile`` in run_hosts.py, ``tuning_env`` in run_flags.py,
``identify_launcher``, ``build_command``) so that the commands for every MPI are
testable on a machine that has only one of them.
"""
from __future__ import annotations

import argparse
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, TextIO

from ._mpi import mpi_family
from .build_report import build_report
from .run_flags import add_tuning_flags, tuning_env
from .run_hosts import Host, UsageError, check_remote_starts, format_hosts, parse_hosts, \
    read_hostfile, resolve_num_proc, unresolved_hosts, unused_hosts

PROG = "hvdmxrun"

# Launcher flavors. Intel MPI's mpiexec is Hydra like MPICH's and takes the same
# process, host and environment flags; it differs in binding (see build_command).
MPICH = "mpich"
INTEL = "intel"
OPENMPI = "openmpi"
_FLAVOR_NAMES = {MPICH: "MPICH/Hydra", INTEL: "Intel MPI (Hydra)", OPENMPI: "Open MPI"}

# Open MPI's mpirun hands its own environment only to the ranks on its own host;
# the ranks elsewhere get what -x names. These are forwarded (when set) so that
# every rank finds the same Python, libraries and hvdmx/MXNet/NCCL settings.
# Hydra passes the launcher's whole environment to every rank by itself.
FORWARDED_NAMES = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "OMP_NUM_THREADS")
FORWARDED_PREFIXES = ("HVDMX_", "HOROVOD_", "MXNET_", "NCCL_")

# Flags that --mpi-args must not repeat: hvdmxrun sets them itself.
_COUNT_FLAGS = ("-n", "-np", "--np", "-c", "--n")
_HOST_FLAGS = ("-H", "--host", "-host", "-hosts", "--hosts", "-f", "-hostfile", "--hostfile",
               "-machinefile", "--machinefile", "-machine")
_BINDING_FLAGS = ("-bind-to", "--bind-to", "-binding")
_MAPPING_FLAGS = ("-map-by", "--map-by")


@dataclass(frozen=True)
class Launcher:
    path: str
    flavor: str  # MPICH, INTEL or OPENMPI
    version: str

    def describe(self) -> str:
        return f"{self.path} ({_FLAVOR_NAMES[self.flavor]} {self.version})"


def remote_shell(launcher: Launcher, mpi_args: Sequence[str]) -> Optional[List[str]]:
    """The command the launcher starts remote processes with, as hvdmxrun can
    try it: the -launcher-exec (-bootstrap-exec) of Hydra or the
    plm_rsh_agent of Open MPI, else ssh; None when the launcher starts them
    another way (Slurm, a batch system, fork)."""
    args = list(mpi_args)

    def value(flags):
        for i, arg in enumerate(args):
            name, eq, rest = arg.partition("=")
            if name in flags:
                return rest if eq else (args[i + 1] if i + 1 < len(args) else None)
        return None

    if launcher.flavor == OPENMPI:
        for i, arg in enumerate(args[:-2]):
            if arg in ("--mca", "-mca") and args[i + 1] in ("plm_rsh_agent", "orte_rsh_agent"):
                return shlex.split(args[i + 2])
        if value(("--launch-agent",)) is not None or os.environ.get("SLURM_JOB_ID"):
            return None
        return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=20"]
    exec_path = value(("-launcher-exec", "-bootstrap-exec"))
    kind = value(("-launcher", "-bootstrap"))
    if exec_path:
        return [exec_path]
    if kind not in (None, "ssh", "rsh"):
        return None
    if kind is None and any(os.environ.get(v) for v in ("SLURM_JOB_ID", "PBS_JOBID",
                                                           "LSB_JOBID")):
        return None  # Hydra starts the proxies through the batch system
    if kind == "rsh":
        return ["rsh"]
    return ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=20"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: expected the number of processes, an integer >= 1")
    return value


# ---- the MPI launcher -----------------------------------------------------

def find_mpiexec(explicit: Optional[str], environ: Mapping[str, str],
                 executable: str) -> str:
    """--mpiexec, else $HVDMX_MPIEXEC, else mpiexec/mpirun beside the Python
    interpreter (where the mpich wheel puts its own), else on PATH."""
    for flag, value in (("--mpiexec", explicit),
                        ("HVDMX_MPIEXEC", environ.get("HVDMX_MPIEXEC") or None)):
        if value is None:
            continue
        found = shutil.which(value, path=environ.get("PATH", os.defpath))
        if found is None:
            raise UsageError(f"{flag} {value!r} is not an executable file (or not found on "
                             "PATH); point it at your MPI's mpiexec or mpirun")
        return found
    beside = os.path.dirname(executable)
    for name in ("mpiexec", "mpirun"):
        candidate = os.path.join(beside, name)
        if beside and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name, path=environ.get("PATH", os.defpath))
        if found is not None:
            return found
    raise UsageError(f"no MPI launcher found: looked for mpiexec and mpirun in {beside or '.'} "
                     "and on PATH; install one (pip install mpich) or pass --mpiexec "
                     "/path/to/mpiexec")


def identify_launcher(path: str, version_output: str) -> Launcher:
    """Tells the MPI from the output of `<path> --version`."""
    text = version_output
    match = re.search(r"Intel\(R\) MPI Library.*?Version\s+([^\s,]+)", text)
    if match or "Intel(R) MPI" in text:
        return Launcher(path, INTEL, match.group(1) if match else "?")
    match = re.search(r"\((?:Open MPI|OpenRTE)\)\s+(\S+)", text)
    if match or "open-mpi.org" in text:
        return Launcher(path, OPENMPI, match.group(1) if match else "?")
    if "HYDRA" in text:
        match = re.search(r"Version:\s+(\S+)", text)
        return Launcher(path, MPICH, match.group(1) if match else "?")
    first = text.strip().splitlines()[0] if text.strip() else "(no output)"
    raise UsageError(f"cannot tell which MPI {path} belongs to: '{path} --version' says "
                     f"{first!r}; hvdmxrun knows MPICH, Intel MPI and Open MPI. Pass "
                     "--mpiexec with one of theirs, or run that launcher yourself")


def detect_launcher(path: str) -> Launcher:
    try:
        result = subprocess.run([path, "--version"], capture_output=True, text=True,
                                timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"'{path} --version' failed ({e}); check the MPI installation or "
                         "pass --mpiexec with a working launcher") from None
    return identify_launcher(path, result.stdout + result.stderr)


def _flags_in(args: Sequence[str], flags: Sequence[str]) -> List[str]:
    return [a for a in args if a.split("=", 1)[0] in flags]


def check_mpi_args(mpi_args: Sequence[str]) -> None:
    """--mpi-args may add any launcher flag except the ones hvdmxrun sets from its
    own flags (a second process count or host list confuses both launchers)."""
    for flags, own in ((_COUNT_FLAGS, "-np"), (_HOST_FLAGS, "-H or --hostfile")):
        clash = _flags_in(mpi_args, flags)
        if clash:
            raise UsageError(f"--mpi-args {shlex.join(mpi_args)!r} contains {clash[0]!r}; "
                             f"give that with hvdmxrun's {own} instead")


def build_command(launcher: Launcher, num_proc: int, hosts: Optional[Sequence[Host]],
                  env: Mapping[str, str], mpi_args: Sequence[str], command: Sequence[str],
                  environ: Mapping[str, str], as_root: bool = False) -> List[str]:
    """The launcher's argument list.

    MPICH and Intel MPI (Hydra): ``-n N``, ``-hosts a:2,b:2``, ``-genv NAME VALUE``
    per tuning variable (Hydra hands its own environment to every rank already).
    MPICH gets ``-bind-to none``; Intel MPI keeps its own pinning, which gives each
    rank its share of the cores.

    Open MPI: ``-np N``, ``-H a:2,b:2``, ``--bind-to none --map-by slot``,
    ``-x NAME=VALUE`` per tuning variable and ``-x NAME`` for the variables of
    FORWARDED_NAMES/FORWARDED_PREFIXES that are set, and ``--allow-run-as-root``
    when running as root.

    Processes are never bound to one core by default: each rank runs MXNet's
    thread pools and hvdmx's background thread, which one core would serialize.
    A binding or mapping flag in `mpi_args` replaces hvdmxrun's. Without hosts,
    the MPI's default applies (this host, or the batch scheduler's allocation).
    `mpi_args` come last before the command, as given.
    """
    cmd = [launcher.path]
    user_binds = bool(_flags_in(mpi_args, _BINDING_FLAGS))
    if launcher.flavor == OPENMPI:
        if as_root:
            cmd.append("--allow-run-as-root")
        cmd += ["-np", str(num_proc)]
        if hosts:
            cmd += ["-H", format_hosts(hosts)]
        if not user_binds:
            cmd += ["--bind-to", "none"]
        if not _flags_in(mpi_args, _MAPPING_FLAGS):
            cmd += ["--map-by", "slot"]
        for name, value in env.items():
            cmd += ["-x", f"{name}={value}"]
        for name in environ:
            if name not in env and (name in FORWARDED_NAMES
                                    or name.startswith(FORWARDED_PREFIXES)):
                cmd += ["-x", name]
    else:
        cmd += ["-n", str(num_proc)]
        if hosts:
            cmd += ["-hosts", format_hosts(hosts)]
        if launcher.flavor == MPICH and not user_binds:
            cmd += ["-bind-to", "none"]
        for name, value in env.items():
            cmd += ["-genv", name, value]
    return cmd + list(mpi_args) + list(command)


def launcher_environ(launcher: Launcher, environ: Mapping[str, str]) -> Dict[str, str]:
    """The environment the launcher runs in: `environ` without the PMIx
    variables (PMIX_*) when the launcher is Hydra.

    Hydra is the process manager of the ranks it starts and hands them its own
    PMI (PMI_SIZE, PMI_RANK, ...). PMIx variables that hvdmxrun inherited from
    an outer launcher (hvdmxrun run inside an srun --mpi=pmix step, say)
    describe that launcher's job, not this one; passed on, they make MPICH
    abort in MPI_Init ("Found both env vars PMI_SIZE and PMIX_NAMESPACE").
    Each rank's hvdmx drops them as well before MPI starts
    (hvdmx._mpi.settle_pmix), which also catches those that srun sets again for
    Hydra's proxies inside a Slurm allocation; dropping them here also covers
    programs that start MPI before loading hvdmx. Open MPI's mpirun sets up
    PMIx for its ranks itself and gets `environ` unchanged."""
    if launcher.flavor == OPENMPI:
        return dict(environ)
    return {name: value for name, value in environ.items() if not name.startswith("PMIX_")}


def job_environ(environ: Mapping[str, str]) -> Dict[str, str]:
    """`environ` with the job's secret key, HVDMX_SECRET_KEY: the one the user
    set (or its HOROVOD_ twin), else 256 fresh bits from the operating system's
    random source. It reaches the ranks through the launcher's environment
    (Hydra hands that to every rank, Open MPI's -x forwards it by name), never
    on a command line, and is never printed: --dry-run and --verbose show the
    command only."""
    out = dict(environ)
    if "HVDMX_SECRET_KEY" not in out and "HOROVOD_SECRET_KEY" not in out:
        out["HVDMX_SECRET_KEY"] = secrets.token_hex(32)
    return out


def launcher_mismatch(built_vendor: str, launcher: Launcher) -> Optional[str]:
    """A warning when hvdmx's MPI and the launcher's cannot talk to each other:
    every rank would then start alone, as a job of size 1."""
    built, runs = mpi_family(built_vendor), mpi_family(launcher.flavor)
    if built is None or built == runs:
        return None
    return (f"hvdmx was built with {built_vendor}, but the launcher {launcher.describe()} "
            f"starts {runs} jobs, which that MPI cannot join: every rank would run alone "
            f"(size() == 1). Pass --mpiexec with the launcher of {built_vendor}")


def _built_vendor() -> Optional[str]:
    try:
        from hvdmx import _core
        return _core.mpi_vendor()
    except ImportError:
        return None


def _mpi_without_init() -> None:
    """Loads the MPI library without starting MPI in this process.

    The launcher is not a rank, and hvdmxrun loads hvdmx only to read what it
    was built with. An MPI_Init here could not even succeed everywhere: inside
    a PMIx job step (hvdmxrun run under srun --mpi=pmix), the mpich wheel
    aborts in it. With mpi4py.MPI loaded first, hvdmx's own refusal of that
    case (hvdmx._mpi.load_core) does not apply to this process either: it is
    meant for the ranks, whose environment launcher_environ cleans."""
    if "mpi4py.MPI" in sys.modules:  # run.main() called by a program that uses MPI
        return
    import mpi4py
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    import mpi4py.MPI  # noqa: F401


# ---- running --------------------------------------------------------------

def _in_terminal_foreground() -> bool:
    """True when this process group is the foreground job of its terminal."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return True
        except OSError:
            pass
    return False


def run_command(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """Runs `cmd` (no shell), forwarding SIGINT and SIGTERM to it; returns its
    exit code, or 128 + N when signal N ended it (as a shell reports it).

    The child stays in this process group, so Ctrl-C at the terminal reaches it
    directly; that SIGINT is not forwarded again, because a second one makes
    Hydra's mpiexec kill the ranks at once instead of letting them stop. (So a
    SIGINT sent with kill to a hvdmxrun in the foreground of a terminal is not
    forwarded either: send it to the process group, or send SIGTERM.)
    """
    child = None
    pending = []

    def forward(signum, _frame):
        if signum == signal.SIGINT and _in_terminal_foreground():
            return
        if child is None:
            pending.append(signum)
        elif child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        # env is given explicitly, from os.environ: should MPI have started in
        # this process (main() called by a program that uses it), what the MPI
        # library put into the C environment must not reach the launcher, which
        # would take itself for a rank.
        child = subprocess.Popen(list(cmd), env=dict(env))
        for signum in pending:
            child.send_signal(signum)
        code = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - code if code < 0 else code


# ---- --check-build --------------------------------------------------------

def check_build(args: argparse.Namespace, out: TextIO) -> int:
    try:
        launcher = detect_launcher(find_mpiexec(args.mpiexec, os.environ, sys.executable))
        launcher_line = launcher.describe()
    except UsageError as e:
        launcher_line = f"none usable: {e}"
    try:
        report = build_report(launcher_line)
    except ImportError as e:  # hvdmx cannot load here: say why, without a traceback
        print(f"{PROG} --check-build: {e}", file=sys.stderr)
        return 1
    out.write(report)
    return 0


# ---- command line ---------------------------------------------------------

def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{PROG} [options] command [args ...]\n       {PROG} --check-build",
        description="Starts `command` on N processes through the MPI launcher (mpiexec or\n"
                    "mpirun of MPICH, Intel MPI or Open MPI), with hvdmx's tuning flags\n"
                    "passed to every rank as HVDMX_* environment variables. Options go\n"
                    "before the command; from the command on, every argument is passed\n"
                    "to it unchanged.",
        epilog="examples:\n"
               f"  {PROG} -np 4 python train.py --epochs 3\n"
               f"  {PROG} -np 8 -H node1:4,node2:4 --fusion-threshold-mb 32 python train.py\n"
               f"  {PROG} --hostfile hosts.txt --verbose python train.py\n"
               f"  {PROG} --check-build\n"
               "see docs/running.md for the commands built for each MPI")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program to run on every rank, and its arguments")

    job = parser.add_argument_group("processes and hosts")
    job.add_argument("-np", "--num-proc", type=_positive_int, metavar="N",
                     help="number of processes to start (default with -H/--hostfile: all "
                          "their slots)")
    hosts = job.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help="hosts and their process slots, e.g. node1:4,node2:4 (a host "
                            "without ':N' has 1 slot); default: the MPI's own (this host, "
                            "or the batch scheduler's allocation)")
    hosts.add_argument("--hostfile", metavar="FILE",
                       help="file with one host a line: 'host slots=N' or 'host:N'; '#' "
                            "starts a comment")

    launch = parser.add_argument_group("MPI launcher")
    launch.add_argument("--mpiexec", metavar="PATH",
                        help="the mpiexec/mpirun to use (default: $HVDMX_MPIEXEC, else the "
                             "one beside this Python, else the first on PATH)")
    launch.add_argument("--mpi-args", metavar='"ARGS"', default="",
                        help="extra launcher flags, split like a shell would and added "
                             "before the command, e.g. --mpi-args \"-ppn 2\"")
    launch.add_argument("--no-host-check", action="store_true",
                        help="do not check, before starting, that every host of -H/--hostfile "
                             "resolves and that the remote shell starts a process there")
    launch.add_argument("--verbose", action="store_true",
                        help="print the launcher command to stderr before running it")
    launch.add_argument("--dry-run", action="store_true",
                        help="print the launcher command and exit without running it")
    launch.add_argument("--check-build", action="store_true",
                        help="print what this hvdmx was built with and supports, and exit")

    add_tuning_flags(parser)
    return parser


def _attach_mpi_args(parser: argparse.ArgumentParser, argv: List[str]) -> List[str]:
    """Rewrites `--mpi-args VALUE` as `--mpi-args=VALUE` among hvdmxrun's own
    options (not in the command), so that a value such as "-verbose" is not
    taken for an option by argparse."""
    argv = list(argv)
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        action = parser._option_string_actions.get(argv[i])
        if argv[i] == "--mpi-args" and i + 1 < len(argv):
            argv[i:i + 2] = ["--mpi-args=" + argv[i + 1]]
        elif action is not None and action.nargs != 0:
            i += 1  # skip the option's value
        i += 1
    return argv


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = make_parser()
    args = parser.parse_args(_attach_mpi_args(
        parser, sys.argv[1:] if argv is None else list(argv)))
    _mpi_without_init()
    if args.check_build:
        return check_build(args, sys.stdout)

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if not command:
            raise UsageError("no command given; name the program to run after the options, "
                             "e.g. hvdmxrun -np 4 python train.py")
        if args.no_stall_check and args.stall_check_shutdown_time_seconds is not None:
            raise UsageError("--no-stall-check and --stall-check-shutdown-time-seconds "
                             f"{args.stall_check_shutdown_time_seconds:g} contradict each "
                             "other; give one of them")
        try:
            mpi_args = shlex.split(args.mpi_args)
        except ValueError as e:
            raise UsageError(f"--mpi-args {args.mpi_args!r} cannot be split ({e}); balance "
                             "its quotes") from None
        check_mpi_args(mpi_args)
        if args.hosts is not None:
            hosts, host_flag = parse_hosts(args.hosts), "-H"
        elif args.hostfile is not None:
            hosts, host_flag = read_hostfile(args.hostfile), "--hostfile"
        else:
            hosts, host_flag = None, ""
        num_proc = resolve_num_proc(args.num_proc, hosts, host_flag)
        launcher = detect_launcher(find_mpiexec(args.mpiexec, os.environ, sys.executable))
        if hosts and not args.no_host_check and not args.dry_run:
            unresolved_hosts(hosts, host_flag)
            shell = remote_shell(launcher, mpi_args)
            if shell is not None:
                check_remote_starts(hosts, shell)
    except UsageError as e:
        parser.error(str(e))  # exits with code 2
    if hosts and unused_hosts(num_proc, hosts):
        print(f"{PROG}: warning: -np {num_proc} fills the slots of {host_flag} "
              f"({format_hosts(hosts)}) in order, so {', '.join(unused_hosts(num_proc, hosts))} "
              "get(s) no process; raise -np or list fewer hosts", file=sys.stderr)

    environ = job_environ(os.environ)
    cmd = build_command(launcher, num_proc, hosts, tuning_env(args), mpi_args, command,
                        environ, as_root=os.geteuid() == 0)
    warning = launcher_mismatch(_built_vendor() or "", launcher)
    if warning:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    if args.verbose:
        print(shlex.join(cmd), file=sys.stderr, flush=True)
    return run_command(cmd, launcher_environ(launcher, environ))


if __name__ == "__main__":
    sys.exit(main())
