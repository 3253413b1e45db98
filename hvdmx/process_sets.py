"""Process sets: collectives over a subset of the job's ranks.

A process set negotiates on a communicator of its own, with its own
background thread, so collectives on different sets run independently (the
even ranks and the odd ranks can each reduce at once). Ranks are ranks of
the whole job (``hvd.rank()``), as is every ``root_rank``.

Adding and removing a set are collective over the whole job: every rank
calls ``add_process_set`` with the same ranks, in the same order of calls,
members and non-members alike.
"""
from __future__ import annotations

import itertools
import numbers
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import sys

from hvdmx import _core
from hvdmx._job import check_running, job_comm, topology
from hvdmx.errors import InvalidArgumentError


class ProcessSet:
    """A set of ranks of the job, given as a list of ranks or an mpi4py
    communicator (its ranks in the communicator hvdmx was initialized on).

    Usable in collectives once registered with ``hvd.add_process_set`` (or
    ``hvd.init(process_sets=[...])``), which sets ``process_set_id``.
    """

    def __init__(self, ranks_or_comm: Union[Sequence[int], Any]) -> None:
        self.process_set_id: Optional[int] = None
        self._comm = None
        # An mpi4py communicator, which only a program that loaded mpi4py.MPI
        # has (hvdmx loads no MPI in a job without it).
        MPI = sys.modules.get("mpi4py.MPI")
        if MPI is not None and isinstance(ranks_or_comm, MPI.Comm):
            # Resolved when the set is added: a rank outside the
            # communicator holds MPI.COMM_NULL and learns the ranks then.
            self._comm = ranks_or_comm
            self._ranks: Optional[List[int]] = None
        else:
            self._ranks = _check_ranks("ProcessSet", "ranks_or_comm", ranks_or_comm)

    @property
    def ranks(self) -> List[int]:
        """The set's ranks, ascending (ranks of the whole job)."""
        if self._ranks is None:
            raise ValueError("hvdmx: this ProcessSet was made from a communicator and has not "
                             "been added yet; call hvd.add_process_set(process_set) on every "
                             "rank first")
        return list(self._ranks)

    @property
    def mpi_comm(self):
        """The mpi4py communicator the set was made from, or None (as in Horovod)."""
        return self._comm

    def size(self) -> int:
        return len(self.ranks)

    def included(self) -> bool:
        """True when this process belongs to the set."""
        return _core.topology()[0] in self.ranks

    def rank(self) -> int:
        """This process's rank within the set."""
        me = _core.topology()[0]
        if me not in self.ranks:
            raise ValueError(f"hvdmx: this process (rank {me}) is not in {self!r}")
        return self.ranks.index(me)

    def __repr__(self) -> str:
        ranks = "from a communicator" if self._ranks is None else f"ranks={self._ranks}"
        return f"ProcessSet(process_set_id={self.process_set_id}, {ranks})"


class _GlobalProcessSet(ProcessSet):
    """Every rank of the job; always registered, with id 0."""

    def __init__(self):
        self.process_set_id = 0
        self._comm = None
        self._ranks = None

    @property
    def ranks(self) -> List[int]:
        return list(range(_core.topology()[1]))

    def __repr__(self) -> str:
        return "global_process_set"


global_process_set = _GlobalProcessSet()
# Registered sets by id (the global set is not listed).
_registered: Dict[int, ProcessSet] = {}
# The count of unnamed calls so far, by (kind of call, set id): see _auto_name.
_counters: Dict[Tuple[str, int], Iterator[int]] = {}


def _check_ranks(fn: str, arg: str, ranks) -> List[int]:
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"hvdmx.{fn}: argument '{arg}' must be a list of ranks or an mpi4py "
                        f"communicator, got {type(ranks).__name__}")
    ranks = list(ranks)
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, numbers.Integral):
            raise TypeError(f"hvdmx.{fn}: argument '{arg}' must hold int ranks, got {r!r}")
    if not ranks:
        raise ValueError(f"hvdmx.{fn}: argument '{arg}' is empty; a process set needs at "
                         "least one rank")
    if len(set(ranks)) != len(ranks):
        dup = sorted({r for r in ranks if ranks.count(r) > 1})
        raise ValueError(f"hvdmx.{fn}: argument '{arg}'={ranks} lists rank(s) {dup} more "
                         "than once; list each rank once")
    return sorted(int(r) for r in ranks)


def _resolve(process_set: ProcessSet, comm) -> List[int]:
    """The set's ranks as this process sees them. A set made from a
    communicator learns them from its members (collective over ``comm``, the
    job's communicator); a communicator from ``Split`` gives every group its
    own set, so each rank gets its own group's ranks."""
    if process_set._comm is None:
        return process_set.ranks
    if comm is None:
        raise ValueError("hvdmx.add_process_set: a process set made from an mpi4py "
                         "communicator needs MPI, but hvdmxrun started this job without MPI "
                         "(--no-mpi); give the set as a list of ranks")
    from hvdmx._mpi import load_mpi
    MPI = load_mpi()  # loaded already: the set holds an mpi4py communicator
    mine = None
    if process_set._comm != MPI.COMM_NULL:
        mine = sorted(MPI.Group.Translate_ranks(process_set._comm.Get_group(),
                                                list(range(process_set._comm.Get_size())),
                                                comm.Get_group()))
    views = comm.allgather(mine)
    for rank, view in enumerate(views):
        if view is None:
            continue
        if MPI.UNDEFINED in view:
            raise ValueError("hvdmx.add_process_set: the communicator has ranks outside the "
                             "communicator hvdmx was initialized on")
        if rank not in view or any(views[other] != view for other in view):
            raise ValueError("hvdmx.add_process_set: the communicators passed on different "
                             "ranks do not split the job into groups (rank "
                             f"{rank} sees {view}); pass each rank its group's communicator, "
                             "e.g. from comm.Split(color)")
    if mine is not None:
        return mine
    return sorted({r for view in views if view is not None for r in view})


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Registers a process set on every rank and returns it (collective over
    the whole job; every rank passes the same ranks)."""
    check_running()
    n = topology()[1]
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set is global_process_set or process_set.process_set_id is not None:
        raise ValueError(f"hvdmx.add_process_set: {process_set!r} is already registered")
    ranks = _resolve(process_set, job_comm())
    bad = [r for r in ranks if not 0 <= r < n]
    if bad:
        raise ValueError(f"hvdmx.add_process_set: ranks {bad} are out of range for a job of "
                         f"size {n}; ranks must be in [0, {n})")
    if not ranks:
        raise ValueError("hvdmx.add_process_set: the communicator is MPI.COMM_NULL on every "
                         "rank; a process set needs at least one rank")
    process_set._ranks = ranks
    process_set.process_set_id = _core.add_process_set(ranks, process_set._comm is None)
    _registered[process_set.process_set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set on every rank (collective over the whole
    job). Returns False if it was not registered."""
    if not isinstance(process_set, ProcessSet):
        raise TypeError("hvdmx.remove_process_set: argument 'process_set' must be a "
                        f"ProcessSet, got {type(process_set).__name__}")
    if process_set is global_process_set or process_set.process_set_id == 0:
        raise ValueError("hvdmx.remove_process_set: the global process set cannot be "
                         "removed; it lives until hvd.shutdown()")
    set_id = process_set.process_set_id
    if set_id is None or _registered.get(set_id) is not process_set:
        return False
    check_running()
    del _registered[set_id]
    _core.remove_process_set(set_id)
    process_set.process_set_id = None
    return True


def _forget_all() -> None:
    """After shutdown: every set but the global one is gone, and so are the
    counts of their unnamed calls: the next init gives their ids again, and
    a new set must name its calls alike on every rank, whichever old sets of
    that id the rank was in."""
    global _host
    for process_set in _registered.values():
        process_set.process_set_id = None
    _registered.clear()
    _host = None
    for key in [key for key in _counters if key[1] != 0]:
        del _counters[key]


def _restart_names() -> None:
    """After hvd.elastic reset hvdmx over a new membership: the counts of
    unnamed calls start again on every rank, the global set's too, so that
    a worker that joined (its counts at zero) names them as the others do."""
    _counters.clear()


def _host_process_set() -> Optional[ProcessSet]:
    """The process set of this host's ranks (those that share memory with
    this one, as local_rank counts them), or None when this rank is alone on
    its host. The global set when one host holds every rank. The first call
    after init is collective over the whole job: every rank registers one set
    per host of two or more ranks (the core learned every host's ranks at
    init); later calls return the same set."""
    global _host
    if _host is None:
        check_running()
        hosts = sorted(tuple(ranks) for ranks in _core.hosts())
        mine = next(ranks for ranks in hosts if topology()[0] in ranks)
        found: Optional[ProcessSet] = global_process_set if len(hosts) == 1 else None
        for ranks in hosts:
            if len(hosts) > 1 and len(ranks) > 1:  # every rank adds every host's set
                added = add_process_set(list(ranks))
                found = added if ranks == mine else found
        _host = [found]
    return _host[0]


_host: Optional[list] = None  # [_host_process_set's answer] until shutdown


def _auto_name(kind: str, set_id: int = 0) -> str:
    # One counter per kind and process set: ranks outside a set do not
    # count its calls, and the names must agree within each set.
    counter = _counters.setdefault((kind, set_id), itertools.count())
    suffix = f"@{set_id}" if set_id else ""
    return f"{kind}.noname.{next(counter)}{suffix}"


def _check_registered(fn: str, process_set) -> None:
    """Raises unless ``process_set`` is a registered ProcessSet (this rank
    may be outside it)."""
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"hvdmx.{fn}: argument 'process_set' must be a ProcessSet (e.g. "
                        f"hvd.global_process_set), got {type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise InvalidArgumentError(f"hvdmx.{fn}: {process_set!r} is not registered; call "
                                   "hvd.add_process_set(process_set) on every rank first")


def _set_for_call(fn: str, process_set) -> tuple:
    """(set id, the set's ranks as a sequence, this rank's index in them) for
    a collective on ``process_set``, or a clear error."""
    if process_set is global_process_set:  # every call's default: nothing to build or search
        rank, size = _core.topology()[:2]
        return 0, range(size), rank
    _check_registered(fn, process_set)
    ranks = process_set.ranks
    me = _core.topology()[0]
    if me not in ranks:
        raise InvalidArgumentError(f"hvdmx.{fn}: this process (rank {me}) is not in process "
                                   f"set {process_set.process_set_id} (ranks {ranks}); only its "
                                   "ranks may call collectives on it")
    return process_set.process_set_id, ranks, ranks.index(me)
