# The seam between hvdmx's Python and its C++ core: every name of the
# pybind11 module hvdmx._core (csrc/hvdmx/python/bindings.cc), typed for
# checkers. tests/test_core_stub.py holds this file to dir(_core) in both
# directions and each function to the signature pybind11 writes in its
# __doc__; a name added to the bindings needs its line here.
#
# Arrays cross the seam as MXNet NDArray handles (``NDArray.handle.value``,
# an address as an int). Parameters pybind11 leaves unnamed are positional-only here.
from typing import Any, Optional, Sequence

# ---- what the build holds ---------------------------------------------------

def mpi_built() -> bool: ...
# The MPI the loaded plugin was built against ("MPICH 5.0.2"); "" before load_mpi.
def mpi_vendor() -> str: ...
# Opens the MPI plugin at ``path`` (hvdmx._mpi.load_mpi); returns its mpi_vendor().
def load_mpi(path: str, /) -> str: ...
# 1 when built with NCCL (an int, as Horovod's nccl_built returns).
def nccl_built() -> int: ...
def cuda_built() -> bool: ...
# Loads MXNet's C API from the library at ``path`` (libmxnet.so).
def load_mxnet(path: str, /) -> None: ...

# ---- the job -----------------------------------------------------------------

# Starts the global runtime over MPI_COMM_WORLD, or over the MPI
# communicator at ``comm_address`` (an MPI_Comm's address, from mpi4py).
def init(comm_address: int = 0) -> None: ...
# Starts it over a Python object that moves bytes between the ranks (the
# no-MPI launcher's group: hvdmx/_job.py).
def init_group(group: object, /) -> None: ...
def shutdown() -> None: ...
def is_initialized() -> bool: ...
# (status code, message): why the runtime stopped, or (STATUS_OK, "").
def stop_status() -> tuple[int, str]: ...
def stall_shutdown_seconds() -> float: ...
# (rank, size, local_rank, local_size, cross_rank, cross_size,
#  whether MPI gave MPI_THREAD_MULTIPLE).
def topology() -> tuple[int, int, int, int, int, int, bool]: ...
# Every host's ranks, hosts in the order of their lowest rank.
def hosts() -> list[list[int]]: ...
# "tcp" or "mpi": how the ranks of process set ``set_id`` talk.
def transport(set_id: int = 0) -> str: ...
# Ends the process with status 1 after ``seconds`` unless it has exited.
def exit_after(seconds: float, message: str, /) -> None: ...
# True when no runtime of this rank has a collective in MXNet's engine or
# waiting for the other ranks.
def all_idle() -> bool: ...
# Counters of the running job: "shm" (None when off), "negotiation",
# "fusion_buffer_bytes", "mpi_huge_pages", "output_pool", "cpu_binding"
# (bindings.cc, Stats()); the first four only while a runtime runs.
def stats() -> dict[str, Any]: ...

# ---- process sets --------------------------------------------------------------

# Registers a set of ``ranks`` and returns its id (0 is the global set).
def add_process_set(ranks: Sequence[int], same_everywhere: bool, /) -> int: ...
def remove_process_set(set_id: int, /) -> None: ...
def process_set_ids() -> list[int]: ...

# ---- the timeline (rank 0's; other ranks' calls do nothing) ----------------------

def start_timeline(path: str, mark_cycles: bool, /) -> None: ...
def stop_timeline() -> None: ...

# ---- arrays -----------------------------------------------------------------------

# (dtype code, stype, device type id, device id, shape or None, ARRAY_*
#  verdict) of the NDArray at ``handle``.
def describe(handle: int, /) -> tuple[int, int, int, int, Optional[tuple[int, ...]], int]: ...
# A new NDArray's handle: uninitialized, of ``shape``, dtype code ``dtype``.
def new_array(shape: Sequence[int], dtype: int, dev_type: int, dev_id: int, /) -> int: ...
# A new int32 CPU NDArray's handle holding ``values``.
def new_int32_array(values: Sequence[int], /) -> int: ...
# Converts the NDArray at ``handle`` to the plain dense layout if oneDNN
# holds it in its own.
def ensure_default_layout(handle: int, /) -> None: ...

# ---- collectives --------------------------------------------------------------------

# Pushes one collective (a COLLECTIVE type below) into MXNet's engine; the
# inputs and outputs are NDArray handles, described by dtypes and shapes.
def push_async(*, set_id: int, collective: int, name: str, inputs: Sequence[int],
               outputs: Sequence[int], dtypes: Sequence[int], shapes: Sequence[Sequence[int]],
               op: int = ..., root: int = ..., prescale: float = ..., postscale: float = ...,
               splits: Sequence[int] = ..., priority: int = ..., dev_type: int = ...,
               dev_id: int = ...) -> None: ...
# An in-place allreduce of each NDArray at ``handles`` under its name and
# priority; (-1, ARRAY_OK), or (index, ARRAY_* verdict) of the first array
# refused, in which case nothing was pushed.
def push_allreduce_each(*, set_id: int, names: Sequence[str], handles: Sequence[int],
                        priorities: Sequence[int], op: int, prescale: float = ...,
                        postscale: float = ...) -> tuple[int, int]: ...
# One negotiated round that waits for its response: (error or None,
# splits or None, root (JOIN: the rank that joined last), status code).
def negotiate(*, set_id: int, collective: int, name: str, dtypes: Sequence[int] = ...,
              shapes: Sequence[Sequence[int]] = ..., splits: Sequence[int] = ...,
              sizes_only: bool = ..., dev_type: int = ..., dev_id: int = ...
              ) -> tuple[Optional[str], Optional[list[int]], int, int]: ...

# ---- gradient compression (engine ops on float32 CPU arrays, by handle) ---------------

def onebit_pack(gradient: int, residual: int, packed: int, n: int, /) -> None: ...
def onebit_unpack_sum(packed: int, ranks: int, out: int, n: int, /) -> None: ...
def onebit_words(n: int, /) -> int: ...
def twobit_pack(gradient: int, residual: int, packed: int, n: int, threshold: float, /) -> None: ...
def twobit_unpack_sum(packed: int, ranks: int, out: int, n: int, /) -> None: ...
def twobit_words(n: int, /) -> int: ...

# ---- the scale harness (hvdmx/bench/scale.py) --------------------------------------------

def scale(*, ranks: int, per_host: int, host_tree: bool, rounds: int, requests: int,
          step_counts: Sequence[int], steps: int) -> dict[str, Any]: ...

# ---- codes --------------------------------------------------------------------------------

# Collective types (push_async's and negotiate's ``collective``).
ALLREDUCE: int
BROADCAST: int
ALLGATHER: int
ALLTOALL: int
REDUCESCATTER: int
BARRIER: int
JOIN: int

# Status codes (stop_status, negotiate), mapped to exceptions by hvdmx/_job.py.
STATUS_OK: int
STATUS_INVALID_ARGUMENT: int
STATUS_MISMATCH: int
STATUS_SHUTDOWN: int
STATUS_INTERNAL: int
STATUS_PEER_SHUTDOWN: int
STATUS_STALLED: int
STATUS_PEER_GONE: int
STATUS_PEER_PROTOCOL: int

# Dtype codes by name (every DataType), and the names the collectives take.
DTYPE_CODES: dict[str, int]
ARRAY_DTYPES: tuple[str, ...]
# Reduction op codes by Horovod's names ("Average", "Sum", ...).
REDUCE_OPS: dict[str, int]

# describe()'s and push_allreduce_each()'s verdict on an array.
ARRAY_OK: int
ARRAY_SPARSE: int
ARRAY_DTYPE: int
ARRAY_NEEDS_CUDA: int
ARRAY_NO_SHAPE: int
