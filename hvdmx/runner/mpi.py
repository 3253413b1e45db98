"""hvdmxrun's MPI launcher: which one, the command that starts N ranks
through it, and the environment it runs in. Below the facade (see the
layers in hvdmx/__init__.py), so that hvdmxrun (launch.py) and
hvdmx.run_function (function_job.py) both start their jobs with it.

Everything here but detect_launcher, plan_launch and the helpers that load
MPI is a pure function of its arguments (``identify_launcher``,
``build_command``, ...), so that the commands for every MPI are testable on a
machine that has only one of them.
"""
from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from hvdmx._mpi import mpi_family
from hvdmx.runner.hosts import Host, UsageError, check_remote_starts, format_hosts, \
    unresolved_hosts, unused_hosts


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
                     "and on PATH; install one (pip install mpich mpi4py), pass --mpiexec "
                     "/path/to/mpiexec, or start the job with --no-mpi, which needs no MPI")


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


def check_mpi_args(mpi_args: Sequence[str], flag: str = "--mpi-args",
                   own: Tuple[str, str] = ("hvdmxrun's -np",
                                           "hvdmxrun's -H or --hostfile")) -> None:
    """--mpi-args may add any launcher flag except the ones hvdmxrun sets from its
    own flags (a second process count or host list confuses both launchers);
    `own` names those (run_function's are arguments)."""
    for flags, instead in ((_COUNT_FLAGS, own[0]), (_HOST_FLAGS, own[1])):
        clash = _flags_in(mpi_args, flags)
        if clash:
            raise UsageError(f"{flag} {shlex.join(mpi_args)!r} contains {clash[0]!r}; "
                             f"give that with {instead} instead")


def build_command(launcher: Launcher, num_proc: int, hosts: Optional[Sequence[Host]],
                  env: Mapping[str, str], mpi_args: Sequence[str], command: Sequence[str],
                  environ: Mapping[str, str], as_root: bool = False,
                  forward_names: Sequence[str] = ()) -> List[str]:
    """The launcher's argument list.

    MPICH and Intel MPI (Hydra): ``-n N``, ``-hosts a:2,b:2``, ``-genv NAME VALUE``
    per tuning variable (Hydra hands its own environment to every rank already).
    MPICH gets ``-bind-to none``; Intel MPI keeps its own pinning, which gives each
    rank its share of the cores.

    Open MPI: ``-np N``, ``-H a:2,b:2``, ``--bind-to none --map-by slot``,
    ``-x NAME=VALUE`` per tuning variable and ``-x NAME`` for the variables of
    FORWARDED_NAMES/FORWARDED_PREFIXES that are set, or named in
    `forward_names`, and ``--allow-run-as-root`` when running as root.

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
            if name not in env and (name in FORWARDED_NAMES or name in forward_names
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


def mpi_without_init() -> None:
    """Loads the MPI library without starting MPI in this process.

    The launcher is not a rank, and hvdmxrun loads hvdmx only to read what it
    was built with. An MPI_Init here could not even succeed everywhere: inside
    a PMIx job step (hvdmxrun run under srun --mpi=pmix), the mpich wheel
    aborts in it. With mpi4py.MPI loaded first, hvdmx's own refusal of that
    case (hvdmx._mpi.load_mpi) does not apply to this process either: it is
    meant for the ranks, whose environment launcher_environ cleans.

    Without mpi4py or an MPI library (a venv for hvdmxrun --no-mpi only),
    nothing is loaded: the launcher itself needs none, and what a job lacks
    is said where it is needed (no mpiexec found; hvd.init's error)."""
    if "mpi4py.MPI" in sys.modules:  # run.main() called by a program that uses MPI
        return
    try:
        import mpi4py
    except ImportError:
        return
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    try:
        import mpi4py.MPI  # noqa: F401
    except (ImportError, RuntimeError):  # mpi4py found no MPI library
        return


def split_mpi_args(text: str, flag: str = "--mpi-args",
                   own: Tuple[str, str] = ("hvdmxrun's -np",
                                           "hvdmxrun's -H or --hostfile")) -> List[str]:
    """The launcher flags of --mpi-args (or of run_function's ``mpi_args``),
    split the way a shell splits words, and checked (check_mpi_args)."""
    try:
        mpi_args = shlex.split(text)
    except ValueError as e:
        raise UsageError(f"{flag} {text!r} cannot be split ({e}); balance its quotes") from None
    check_mpi_args(mpi_args, flag, own)
    return mpi_args


def plan_launch(mpiexec: Optional[str], num_proc: int, hosts: Optional[List[Host]],
                host_flag: str, mpi_args: Sequence[str], env: Mapping[str, str],
                command: Sequence[str], environ: Mapping[str, str], check_hosts: bool = True,
                host_timeout: float = 60, forward_names: Sequence[str] = (),
                np_flag: str = "-np") -> Tuple[Launcher, List[str]]:
    """(launcher, its argument list) for a job of `num_proc` ranks running
    `command`: what hvdmxrun runs, and hvdmx.run_function too.

    Finds and identifies the launcher (`mpiexec`, else see find_mpiexec); with
    `check_hosts`, refuses a host that does not resolve or where the remote
    shell cannot start a process within `host_timeout` seconds (UsageError);
    warns on stderr about hosts that get no process and about a launcher of
    another MPI than hvdmx's. `env` and `forward_names` are as in
    build_command; `environ` is the launcher's environment."""
    launcher = detect_launcher(find_mpiexec(mpiexec, os.environ, sys.executable))
    if hosts and check_hosts:
        unresolved_hosts(hosts, host_flag)
        shell = remote_shell(launcher, mpi_args)
        if shell is not None:
            check_remote_starts(hosts, shell, timeout=host_timeout)
    if hosts and unused_hosts(num_proc, hosts):
        print(f"{PROG}: warning: {np_flag} {num_proc} fills the slots of {host_flag} "
              f"({format_hosts(hosts)}) in order, so {', '.join(unused_hosts(num_proc, hosts))} "
              f"get(s) no process; raise {np_flag} or list fewer hosts", file=sys.stderr)
    cmd = build_command(launcher, num_proc, hosts, env, mpi_args, command, environ,
                        as_root=os.geteuid() == 0, forward_names=forward_names)
    warning = launcher_mismatch(_built_vendor() or "", launcher)
    if warning:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    return launcher, cmd
