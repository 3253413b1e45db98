"""hvdmxrun: starts a training script on N processes through the MPI launcher,
or, with --no-mpi, by itself (hvdmx/runner/nompi.py).

    hvdmxrun -np 4 -H a:2,b:2 --fusion-threshold-mb 32 python train.py --epochs 3
    python -m hvdmx.run -np 4 python train.py        # the same, as a module

The launcher builds one ``mpiexec``/``mpirun`` command for the MPI it finds
(MPICH and Intel MPI, both Hydra-based, or Open MPI), passes the tuning flags to
every rank as HVDMX_* environment variables, runs the command as an argument
list (never through a shell) and exits with its exit code. ``--check-build``
reports what this installation of hvdmx can do. docs/running.md has the details.

Everything between parsing and running is a pure function of its arguments
(``parse_hosts``, ``parse_hostfile`` in hosts.py, ``tuning_env`` in flags.py,
``identify_launcher``, ``build_command`` in mpi.py) so that the commands for
every MPI are testable on a machine that has only one of them.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
from typing import List, Mapping, Optional, Sequence, TextIO

from hvdmx._version import __version__
from hvdmx.runner.flags import add_tuning_flags, tuning_env
from hvdmx.runner.hosts import Host, UsageError, check_remote_starts, format_hosts, parse_hosts, \
    read_hostfile, resolve_num_proc, unresolved_hosts, unused_hosts
from hvdmx.runner.mpi import INTEL, MPICH, OPENMPI, PROG, Launcher, build_command, \
    detect_launcher, find_mpiexec, identify_launcher, job_environ, launcher_environ, \
    launcher_mismatch, mpi_without_init, plan_launch, remote_shell, split_mpi_args
from hvdmx.runner.elastic.job import check_options as check_elastic_options, launch_elastic
from hvdmx.runner.nompi import launch as launch_without_mpi
from hvdmx.runner.allocation import SLURM_HOSTS, scheduler_hosts, scheduler_shell
from hvdmx.runner.slurm import NODELIST

# Also hvdmxrun's, for the tests and for scripts that use them from here.
__all__ = ["INTEL", "MPICH", "OPENMPI", "Host", "Launcher", "UsageError", "build_command",
           "check_remote_starts", "detect_launcher", "find_mpiexec", "format_hosts",
           "identify_launcher", "job_environ", "launcher_environ", "launcher_mismatch",
           "main", "make_parser", "parse_hosts", "read_hostfile", "remote_shell",
           "resolve_num_proc", "run_command", "tuning_env", "unresolved_hosts", "unused_hosts"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: expected the number of processes, an integer >= 1")
    return value


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
    # The report loads MXNet and the rank API, which the launcher does not:
    # it is built by a process of its own (hvdmx/build_report.py), which
    # says on stderr, without a traceback, why hvdmx cannot load.
    report = subprocess.run([sys.executable, "-m", "hvdmx.build_report", launcher_line],
                            stdout=subprocess.PIPE, text=True, check=False)
    out.write(report.stdout)
    return report.returncode


# ---- command line ---------------------------------------------------------

def check_no_mpi_flags(args: argparse.Namespace) -> None:
    """--no-mpi and the MPI launcher's own flags exclude each other."""
    if args.no_mpi:
        for flag, value in (("--mpi-args", args.mpi_args), ("--mpiexec", args.mpiexec)):
            if value:
                raise UsageError(f"--no-mpi and {flag} {value!r} contradict each other: "
                                 f"--no-mpi starts the ranks without MPI's launcher, which "
                                 f"{flag} is for; drop one of them")
    elif args.ssh_exec is not None and not is_elastic(args):
        raise UsageError(f"--ssh-exec {args.ssh_exec!r} applies with --no-mpi only; add "
                         "--no-mpi, or name MPI's remote shell with --mpi-args "
                         "\"-launcher-exec PATH\" (Open MPI: \"--mca plm_rsh_agent PATH\")")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{PROG} [options] command [args ...]\n       {PROG} --check-build",
        description="Starts `command` on N processes through the MPI launcher (mpiexec or\n"
                    "mpirun of MPICH, Intel MPI or Open MPI), with hvdmx's tuning flags\n"
                    "passed to every rank as HVDMX_* environment variables. Options go\n"
                    "before the command; from the command on, every argument is passed\n"
                    "to it unchanged. With --no-mpi, hvdmxrun starts the processes itself\n"
                    "(ssh to other hosts) and serves their rendezvous: no MPI needed.",
        epilog="examples:\n"
               f"  {PROG} -np 4 python train.py --epochs 3\n"
               f"  {PROG} -np 8 -H node1:4,node2:4 --fusion-threshold-mb 32 python train.py\n"
               f"  {PROG} --hostfile hosts.txt --verbose python train.py\n"
               f"  {PROG} --no-mpi -np 4 -H node1:2,node2:2 python train.py\n"
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
    launch.add_argument("--version", action="version", version=f"hvdmx {__version__}",
                        help="print hvdmx's version and exit")

    nompi = parser.add_argument_group("without MPI (see docs/running.md, \"Without MPI\")")
    nompi.add_argument("--no-mpi", action="store_true",
                       help="start the ranks without MPI's launcher: here as child processes, "
                            "on other hosts through ssh; they meet at a rendezvous this "
                            "process serves (HVDMX_RENDEZVOUS), authenticated with the job's "
                            "secret key; each output line is tagged [rank]<stdout>:")
    nompi.add_argument("--ssh-exec", metavar="PATH",
                       help="with --no-mpi, the program that starts ranks on other hosts, "
                            "called as ssh is: PATH -x HOST 'COMMAND' (default: ssh -x -o "
                            "BatchMode=yes -o ConnectTimeout=20)")

    elastic = parser.add_argument_group(
        "elastic training (see docs/elastic.md; starts the job without MPI)")
    elastic.add_argument("--min-np", type=_positive_int, metavar="N",
                         help="the fewest processes the job goes on with after hosts fail "
                              "(default: -np)")
    elastic.add_argument("--max-np", type=_positive_int, metavar="N",
                         help="the most processes the job grows to as hosts come (default: -np)")
    elastic.add_argument("--host-discovery-script", metavar="PATH",
                         help="an executable that prints the usable hosts, one 'host' or "
                              "'host:slots' a line; run every second, new hosts join at the "
                              "next commit(), hosts no longer printed leave (default inside "
                              "a Slurm allocation: its nodes that Slurm has not drained)")
    elastic.add_argument("--slots-per-host", type=_positive_int, metavar="N",
                         help="slots of a host the discovery script prints without ':slots'")
    elastic.add_argument("--elastic-timeout", type=float, default=600.0, metavar="SECONDS",
                         help="how long the job waits for --min-np processes before it ends "
                              "with an error (default: 600)")
    elastic.add_argument("--reset-limit", type=int, metavar="N",
                         help="the most resets a worker's hvd.elastic.run makes before it "
                              "gives up (default: no limit)")
    elastic.add_argument("--blacklist-cooldown-range", type=float, nargs=2,
                         metavar=("MIN", "MAX"),
                         help="seconds a failed host is left out: MIN after its first failure, "
                              "doubling with each, at most MAX (default: for good)")

    add_tuning_flags(parser)
    return parser


def is_elastic(args: argparse.Namespace) -> bool:
    """Whether the flags ask for an elastic job (as horovodrun decides)."""
    return any(value is not None for value in (args.min_np, args.max_np,
                                                args.host_discovery_script))


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
    if not args.no_mpi:
        mpi_without_init()
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
        check_no_mpi_flags(args)
        mpi_args = split_mpi_args(args.mpi_args)
        hosts: Optional[List[Host]]
        if args.hosts is not None:
            hosts, host_flag = parse_hosts(args.hosts), "-H"
        elif args.hostfile is not None:
            hosts, host_flag = read_hostfile(args.hostfile), "--hostfile"
        elif args.host_discovery_script is None:  # an MPI hostfile's variable, or Slurm's
            hosts, host_flag = scheduler_hosts(os.environ)
        else:
            hosts, host_flag = None, ""
        if is_elastic(args):
            if args.mpi_args or args.mpiexec:
                raise UsageError("an elastic job (--min-np, --max-np or "
                                 "--host-discovery-script) starts without MPI; drop "
                                 "--mpi-args/--mpiexec")
            options = check_elastic_options(
                args.num_proc, args.min_np, args.max_np, hosts, args.host_discovery_script,
                args.slots_per_host, args.elastic_timeout, args.reset_limit,
                args.blacklist_cooldown_range,
                slurm_nodelist=os.environ[NODELIST] if host_flag == SLURM_HOSTS else None,
                scheduler=None if host_flag in ("", "-H", "--hostfile") else host_flag)
            return launch_elastic(options, command, os.environ, tuning_env(args),
                                  ssh_exec=scheduler_shell(args.ssh_exec, host_flag),
                                  verbose=args.verbose)
        num_proc = resolve_num_proc(args.num_proc, hosts, host_flag)
        if args.no_mpi:
            return launch_without_mpi(num_proc, hosts, host_flag, command, os.environ,
                                      tuning_env(args),
                                      ssh_exec=scheduler_shell(args.ssh_exec, host_flag),
                                      check_hosts=not (args.no_host_check or args.dry_run),
                                      verbose=args.verbose, dry_run=args.dry_run)
        environ = job_environ(os.environ)
        launcher, cmd = plan_launch(args.mpiexec, num_proc, hosts, host_flag, mpi_args,
                                    tuning_env(args), command, environ,
                                    check_hosts=not (args.no_host_check or args.dry_run))
    except UsageError as e:
        parser.error(str(e))  # exits with code 2
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    if args.verbose:
        print(shlex.join(cmd), file=sys.stderr, flush=True)
    return run_command(cmd, launcher_environ(launcher, environ))


if __name__ == "__main__":
    sys.exit(main())
