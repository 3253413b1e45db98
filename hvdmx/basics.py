"""Process-level calls: init, shutdown and the job's shape."""
from __future__ import annotations

import atexit
import os
import sys
from typing import Any, List, Optional, Sequence, Union

# No mpi4py here: MPI is loaded by init in a job that uses it (load_mpi
# imports mpi4py.MPI, which loads libmpi, after refusing a launcher that MPI
# could not join, then has the core open its MPI plugin, bound to that same
# library by soname, so a script can use mpi4py and hvdmx side by side). A job
# under hvdmxrun --no-mpi loads no MPI library. See hvdmx/_mpi.py, load_mpi.
from hvdmx import _core, _job, process_sets as _process_sets
from hvdmx._job import check_running as _check_running, topology as _topology
from hvdmx._mpi import load_mpi as _load_mpi, mpi_library as _mpi_library, \
    srun_task as _srun_task, started_by_srun as _started_by_srun, \
    started_without_mpi as _without_mpi, venv_mpiexec as _venv_mpiexec
import mxnet as mx

_core.load_mxnet(mx.base._LIB._name)

_atexit_registered = False
_owned_comm = None  # a communicator init() created from a list of ranks

def init(comm: Optional[Union[Any, Sequence[int]]] = None,
         process_sets: Optional[Sequence[Any]] = None) -> None:
    """Starts hvdmx on this process; a second call is a no-op.

    ``comm`` is an mpi4py communicator to run on, or a list of ranks of
    ``MPI.COMM_WORLD``; by default the whole job. Every rank of the
    communicator must call ``init``. ``process_sets`` lists ProcessSets (or
    lists of ranks) to add at once, as ``hvd.add_process_set`` would.

    If MPI is not running yet (mpi4py was imported with
    ``mpi4py.rc.initialize = False``), init starts it, and MPI is finalized
    when the process exits, after hvdmx has shut down: as Horovod does, and as
    Open MPI's launcher requires of a process that started MPI.

    In a job started by ``hvdmxrun --no-mpi`` the ranks meet through the
    launcher's rendezvous instead, MPI never starts, and ``comm`` must be
    None (``process_sets`` as lists of ranks work as ever).
    """
    global _atexit_registered, _owned_comm
    if _core.is_initialized():
        return
    if _without_mpi():
        _init_without_mpi(comm, process_sets)
        return
    MPI = _load_mpi()
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
        # atexit runs last-registered first: registered before shutdown, this
        # runs after it.
        atexit.register(_finalize_mpi)
    _check_launcher(os.environ)
    _check_process_sets_argument(process_sets)
    if comm is None:
        _job.comm = MPI.COMM_WORLD
        address = 0
    elif isinstance(comm, MPI.Comm):
        if comm == MPI.COMM_NULL:
            raise ValueError("hvdmx.init: argument 'comm' is MPI.COMM_NULL; pass a valid "
                             "communicator, e.g. MPI.COMM_WORLD")
        _job.comm = comm
        address = MPI._addressof(comm)
    elif isinstance(comm, (list, tuple)) and all(isinstance(r, int) for r in comm):
        world = MPI.COMM_WORLD
        ranks = list(comm)
        bad = [r for r in ranks if not 0 <= r < world.Get_size()]
        if bad or len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"hvdmx.init: argument 'comm'={ranks!r} must be a non-empty list "
                             f"of distinct ranks in [0, {world.Get_size()})")
        if world.Get_rank() not in ranks:
            raise ValueError(f"hvdmx.init: this process (world rank {world.Get_rank()}) is not "
                             f"in comm={ranks!r}; only the listed ranks may call init")
        _owned_comm = world.Create_group(world.Get_group().Incl(ranks))
        _job.comm = _owned_comm
        address = MPI._addressof(_owned_comm)
    else:
        raise TypeError("hvdmx.init: argument 'comm' must be None, an mpi4py communicator "
                        f"or a list of ranks, got {type(comm).__name__}")
    _process_sets._forget_all()
    _core.init(address)
    _started(process_sets)


def _started(process_sets) -> None:
    """What every init does once the core runs: the exit hooks, and the
    process sets asked for. A job that runs again (an elastic reset) has
    its peers back."""
    global _atexit_registered, _peers_gone
    _peers_gone = False
    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)
        # Registered after it, so it runs before it (and before MPI is
        # finalized by hvdmx or by mpi4py).
        atexit.register(_exit_if_peers_are_gone)
        _atexit_registered = True
    for process_set in process_sets or ():
        _process_sets.add_process_set(process_set)


def _leave_group() -> None:
    """After shutdown, in an elastic job: the next init joins the job's next
    generation instead of running on this one's group again."""
    if _job.group is not None:
        group, _job.group = _job.group, None
        group.close()


def _check_process_sets_argument(process_sets) -> None:
    if process_sets is not None and not isinstance(process_sets, (list, tuple)):
        raise TypeError("hvdmx.init: argument 'process_sets' must be a list of ProcessSets "
                        f"or None, got {type(process_sets).__name__}")


def _init_without_mpi(comm, process_sets) -> None:
    """init in a job that hvdmxrun started without MPI: over the group the
    launcher's rendezvous gives (hvdmx/rendezvous/client.py)."""
    from hvdmx.elastic import worker as elastic_worker
    from hvdmx.rendezvous import client as rendezvous, srun
    by_srun = _started_by_srun()
    if comm is not None:
        raise ValueError(
            "hvdmx.init: argument 'comm' needs MPI, but " +
            ("srun started this task and hvdmx runs it without MPI (see 'srun' in "
             "docs/clusters.md); call hvd.init() without it (process sets as lists of ranks "
             "work), or have hvdmx start MPI under srun: HVDMX_SRUN_MPI=1 with srun --mpi=pmi2"
             if by_srun else
             "hvdmxrun started this job without MPI (--no-mpi); call hvd.init() without it "
             "(process sets as lists of ranks work), or start the job with MPI"))
    _check_process_sets_argument(process_sets)
    # One connection a process: a later init (after hvd.shutdown()) runs on
    # the same group, whose collectives every rank numbers alike.
    if _job.group is None:
        # An elastic worker learns its place at each reset (hvd.elastic);
        # an srun task from Slurm's variables (Note [Meeting under srun]).
        if elastic_worker.elastic():
            _job.group = elastic_worker.join()
        elif by_srun:
            _job.group, key = srun.group_from_slurm()
            # The ranks' own TCP connections prove the same key (the core
            # reads it from the environment, as under hvdmxrun).
            if not any(os.environ.get(n) for n in ("HVDMX_SECRET_KEY", "HOROVOD_SECRET_KEY")):
                os.environ["HVDMX_SECRET_KEY"] = key.hex()
        else:
            _job.group = rendezvous.group_from_environment()
    _job.comm = None
    _process_sets._forget_all()
    _core.init_group(_job.group)
    if by_srun:
        srun.forget_meeting()  # every task has joined: the file's work is done
    _started(process_sets)


# What launchers tell each process about the job: (variable, who sets it).
_LAUNCHER_SIZES = (("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun/mpiexec"),
                   ("PMI_SIZE", "a PMI launcher (such as the mpiexec of MPICH or Intel MPI)"))


def _check_launcher(environ) -> None:
    """Refuses to start a process that a launcher started as one of several
    but that MPI sees alone: the launcher belongs to another MPI than the one
    hvdmx loaded (Open MPI's mpirun starting a program on the mpich wheel,
    say), or srun started it without a PMI, and every process would train on
    its own, each as rank 0 of 1."""
    MPI = _load_mpi()  # loaded by init already
    if MPI.COMM_WORLD.Get_size() != 1:
        return
    for variable, launcher in _LAUNCHER_SIZES:
        value = environ.get(variable, "")
        if value.isdigit() and int(value) > 1:
            library = _mpi_library(MPI)
            raise RuntimeError(
                f"hvdmx.init: {launcher} started this process as one of {value} "
                f"({variable}={value}), but the MPI library hvdmx uses ({library}) sees it "
                "alone: the launcher belongs to another MPI, and every process would train "
                "by itself as rank 0 of 1. Start the job with the launcher of hvdmx's MPI: "
                f"hvdmxrun -np {value} ... finds it, or {_venv_mpiexec()} -n {value} ...")
    # Slurm's srun without a PMI plugin (--mpi=none, the default on many
    # clusters) starts the tasks with none of the variables above: MPI then
    # starts each one alone. Only where no MPI launcher's variable is set:
    # ranks of mpiexec/mpirun inside an allocation inherit the step variables
    # of the proxies that srun started for the launcher.
    launchers = [variable for variable, _ in _LAUNCHER_SIZES] + ["PMIX_NAMESPACE"]
    if any(name in environ for name in launchers):
        return
    value = environ.get("SLURM_STEP_NUM_TASKS", "")
    if value.isdigit() and int(value) > 1:
        raise RuntimeError(
            f"hvdmx.init: Slurm's srun started this process as one of {value} tasks "
            f"(SLURM_STEP_NUM_TASKS={value}) but gave MPI no way to find the others (no PMI: "
            f"srun --mpi=none, or the cluster's default), so the MPI library hvdmx uses "
            f"({_mpi_library(MPI)}) sees it alone, and every process would train by itself "
            f"as rank 0 of 1. Start the job with hvdmxrun -np {value} ... inside the "
            "allocation (it runs this MPI's own launcher, which reads Slurm's allocation), "
            "or give srun a PMI plugin that this MPI supports (srun --mpi=pmi2; srun "
            "--mpi=list shows them)" +
            ("; or leave MPI out: it was asked for (HVDMX_SRUN_MPI=1, HVDMX_TRANSPORT=mpi, "
             "or mpi4py.MPI imported before hvdmx), and without that hvd.init() meets "
             "srun's tasks by itself" if _srun_task(environ) else "") +
            ". To run one process alone here on purpose, unset SLURM_STEP_NUM_TASKS.")


def _finalize_mpi() -> None:
    MPI = _load_mpi()  # registered by init, which loaded it
    if not MPI.Is_finalized():
        MPI.Finalize()


# Whether hvdmx stopped on this rank because the peers it waited for may be
# gone (_job.peers_gone: the stall shutdown while this rank waited for
# collectives, csrc/hvdmx/runtime/runtime.cc, Runtime::Negotiate; a peer on
# this host found stopped or exited in shared memory, Note [A peer that
# stops] in csrc/hvdmx/shm/shm_region.h; a peer's TCP connection closed,
# failed or gone silent, csrc/hvdmx/comm/tcp_comm.h). Set by shutdown() when
# it ends a runtime that stopped so: the core forgets why once it has shut
# down.
_peers_gone = False
# The least time MPI_Finalize is given, after such a stop, before the
# process ends without it (HVDMX_STALL_SHUTDOWN_TIME_SECONDS when longer).
_FINALIZE_GRACE_SECONDS = 5.0


def _finalize_grace() -> float:
    return max(_FINALIZE_GRACE_SECONDS, _core.stall_shutdown_seconds())


def _exit_deadline() -> float:
    """How long the exit of a rank whose peers stopped taking part waits in
    MPI_Finalize before it ends without it: the finalize grace for the other
    ranks to come to their exit, plus the stall shutdown time that each of
    them then waits in its own hvd.shutdown() for this rank. Over MPI a peer
    cannot see that hvdmx stopped here (only shared memory shows it, Note [A
    peer that stops] in csrc/hvdmx/shm/shm_region.h): its shutdown round
    meets the round this rank abandoned, and gives up on it only after
    HVDMX_STALL_SHUTDOWN_TIME_SECONDS. Without that term a peer arriving
    within the grace could still be waiting when the timer fired, and this
    rank's status 1 made Hydra kill it (issue 60, item 6: the ring-3 case of
    tests/test_process_exit.py ended with mpiexec's 9 on a loaded machine;
    with a stall shutdown time of 5 s or more, every peer lost that race)."""
    return _finalize_grace() + _core.stall_shutdown_seconds()


def _exit_if_peers_are_gone() -> None:
    """At exit, after hvdmx stopped because the peers it waited for stopped
    taking part (one died, its host cannot be reached, or it stopped hvdmx
    itself), bounds the wait in MPI_Finalize: MPI_Finalize waits, through
    the launcher, for every rank of the job, and would wait forever for one
    that is dead or cut off (seen across hosts with MPICH's Hydra: a killed
    rank under -disable-auto-cleanup, or a host's link taken down). A timer
    ends the process with status 1 if the exit has not finished within
    _exit_deadline() seconds; until then the other ranks may still finish
    their scripts and finalize with this one (a rank that ended at once
    would make the launcher kill them). Not MPI_Abort: that would kill the
    other survivors, and with a host's link down it did not return either
    (tried)."""
    MPI = sys.modules.get("mpi4py.MPI")  # None: a job without MPI
    if not (_peers_gone or _job.peers_gone(_job.stop_status()[0])) or MPI is None or \
            not MPI.Is_initialized() or MPI.Is_finalized():
        return
    grace = _exit_deadline()
    # A thread of the core's, not a Python timer: when mpi4py finalizes MPI,
    # it does so after the interpreter has stopped running Python code.
    _core.exit_after(grace, f"hvdmx: rank {MPI.COMM_WORLD.Get_rank()} exits with status 1 "
                            f"without finalizing MPI, which has waited {grace:g} s for the "
                            "ranks that stopped taking part (see docs/errors.md)\n")


def shutdown() -> None:
    """Stops hvdmx on every rank (agreed by all); pending ops fail with a
    "shut down" error. ``init`` may be called again afterwards.

    Raises ``MXNetError`` afterwards, with their messages, for operations
    that failed earlier and whose error no read has raised (a collective's
    output that nobody read): so that such an error does not wait for the
    process's exit. Only when nothing of hvdmx is pending on this rank: a
    pending collective fails with the shutdown, and its "shut down" error
    must still come at its read; the exit hook reports what is left."""
    global _peers_gone
    if _job.peers_gone(_job.stop_status()[0]):
        _peers_gone = True
    # Idle first, then running: a peer's shutdown that arrives in between
    # fails this rank's pending ops with its "shut down" error, which must
    # come at their reads, not here; asked in the other order, the stop could
    # fall between the two answers and be taken for an earlier failure.
    unread = _unread_errors() if _core.all_idle() and _core.is_initialized() else []
    _core.shutdown()
    _process_sets._forget_all()
    if unread:
        error = mx.base.MXNetError(
            f"hvdmx.shutdown: {len(unread)} operation(s) had failed and their results were "
            "never read (read each collective's output, or call mx.nd.waitall(), to get its "
            "error where it happens); hvdmx has shut down. The error(s): " +
            " | ".join(unread))
        error.unread = unread
        raise error


def _shutdown_at_exit() -> None:
    """The exit hook that the first ``init`` registers: ``shutdown()``, then
    the errors of operations that failed and were never read, each on
    stderr with what it means. Left to MXNet's own exit hook (which runs
    after this one), such an error came out as "Exception ignored in atexit
    callback" and a traceback into MXNet. Nothing can read an output any
    more at this point, so taking the errors out of MXNet's engine loses
    nothing. (Allgather's and alltoall's mismatches raise at the call; see
    docs/errors.md for the errors that an unread output can still hold.)"""
    try:
        rank = _topology()[0]  # answers until this rank's own shutdown, below
    except (ValueError, RuntimeError):  # never initialized
        rank = 0
    unread: List[str] = []
    try:
        shutdown()
    except mx.base.MXNetError as error:
        unread = list(getattr(error, "unread", [str(error)]))
    for message in unread + _unread_errors():
        sys.stderr.write(f"[hvdmx ERROR rank {rank}] at exit: an operation failed and its "
                         "result was never read (read each collective's output, or call "
                         f"mx.nd.waitall(), to get its error where it happens): {message}\n")
    sys.stderr.flush()


def _unread_errors() -> List[str]:
    """Waits for every operation in MXNet's engine and returns the errors no
    read has raised yet, taking them out of the engine (a later read of
    those outputs no longer raises)."""
    errors: List[str] = []
    while True:
        try:
            mx.nd.waitall()
            return errors
        except mx.base.MXNetError as error:  # one at a time, each once
            errors.append(str(error).strip())


def is_initialized() -> bool:
    """True while collectives can run: from ``init`` until this rank's
    ``shutdown``, or until another rank's shutdown (or a stall, see
    docs/errors.md) stops hvdmx here. ``rank()`` and the other topology calls
    answer for longer: until this rank's own ``shutdown``."""
    return _core.is_initialized()


def rank() -> int:
    """This process's rank in the job, 0 .. size()-1."""
    return _topology()[0]


def size() -> int:
    """The number of processes in the job."""
    return _topology()[1]


def local_rank() -> int:
    """This process's rank among the processes on its host."""
    return _topology()[2]


def local_size() -> int:
    """The number of processes on this host."""
    return _topology()[3]


def cross_rank() -> int:
    """The index of this host among hosts (rank among processes of equal local_rank)."""
    return _topology()[4]


def cross_size() -> int:
    """The number of processes with this process's local_rank (hosts, when balanced)."""
    return _topology()[5]


def mpi_threads_supported() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE. In a job without MPI
    (hvdmxrun --no-mpi) a ValueError, as Horovod's answer when MPI is not
    enabled."""
    if _without_mpi():
        raise ValueError("hvdmx.mpi_threads_supported: this job was started without MPI "
                         "(hvdmxrun --no-mpi), so MPI has no thread level; hvd.mpi_enabled() "
                         "is False")
    return _topology()[6]


def mpi_built() -> bool:
    return _core.mpi_built()


def mpi_enabled() -> bool:
    """False in a job hvdmxrun started without MPI (--no-mpi)."""
    return _core.mpi_built() and not _without_mpi()


def nccl_built() -> int:
    """The NCCL version built in, or 0."""
    return _core.nccl_built()


def cuda_built() -> bool:
    return _core.cuda_built()


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def ccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False


def rocm_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts writing the timeline (a Chrome trace, see docs/timeline.md) to
    ``file_path``; rank 0 writes it, other ranks ignore the call. Replaces a
    timeline already being written."""
    if not isinstance(file_path, str) or not file_path:
        raise TypeError("hvdmx.start_timeline: argument 'file_path' must be a non-empty str, "
                        f"got {file_path!r}")
    _check_running()
    _core.start_timeline(file_path, bool(mark_cycles))


def stop_timeline() -> None:
    """Finishes the timeline file (it is valid JSON at every moment anyway)."""
    _core.stop_timeline()

