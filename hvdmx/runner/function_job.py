"""``hvdmx.run_function``: runs a Python function on every rank of a job and
returns the ranks' return values in rank order; Horovod's ``horovod.run``
(which ``python -m hvdmx.as_horovod`` provides under that name).

    def train(lr):
        import hvdmx as hvd
        hvd.init()
        ...
        return accuracy

    accuracies = hvdmx.run_function(train, args=(0.1,), num_proc=2)  # [rank 0's, rank 1's]

The job is an hvdmxrun job: plan_launch (hvdmx/runner/mpi.py) builds the MPI
launcher's command, and every rank runs ``python -m hvdmx.runner.function_job``
(under ``-m hvdmx.as_horovod`` when this process has made ``import horovod``
give hvdmx, so that the function's ``horovod.mxnet`` is hvdmx there too).
This process is not a rank; it loads neither MXNet nor MPI. It serves the
call and collects the outcomes:

1. It pickles the call with cloudpickle (as Horovod does: a function of
   ``__main__`` travels by value, one of an importable module by name), and
   listens on a TCP port whose addresses reach the ranks in their
   environment (HVDMX_FUNCTION_JOB_ADDRESSES), beside the job's secret key.
2. Each rank connects, and both prove that they hold the key (See Note [The
   function job's handshake]); the rank says which rank it is, and receives
   this process's ``sys.path`` and the call. It runs the function and sends
   back its return value, or the exception it raised with its traceback.
3. The call returns once every rank has sent a value and the launcher has
   ended with status 0. The first exception a rank sends is raised here as
   soon as the launcher has ended (MPI's launchers end the job when a rank
   exits with an error), or after ``_FAILURE_GRACE_SECONDS`` more, when this
   process ends it. A rank that ends without sending anything, and a job
   whose ranks do not all connect within ``start_timeout``, raise too: the
   call never waits forever for a rank that is gone.
"""
from __future__ import annotations

import os
import pickle
import queue
import shlex
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from hvdmx.rendezvous.wire import Channel, Protocol, accept_channel, open_channel
from hvdmx.runner.mpi import PROG, job_environ, launcher_environ, mpi_without_init, \
    plan_launch, split_mpi_args
from hvdmx.runner.hosts import Host, UsageError, format_hosts, is_this_host, parse_hosts, \
    read_hostfile, resolve_num_proc
from hvdmx.runner.allocation import scheduler_hosts

ADDRESSES_VARIABLE = "HVDMX_FUNCTION_JOB_ADDRESSES"
_START_TIMEOUT_VARIABLES = ("HVDMX_START_TIMEOUT", "HOROVOD_START_TIMEOUT")
_DEFAULT_START_TIMEOUT = 30.0  # Horovod's default
_HANDSHAKE_SECONDS = 10.0  # for a connection to prove itself, either way
_FAILURE_GRACE_SECONDS = 10.0  # after a rank's error, for the launcher to end the job
_EXIT_GRACE_SECONDS = 60.0  # after the last value, for the launcher to end
_STOP_SECONDS = 5.0  # after SIGTERM to the launcher, before SIGKILL
# The channel to the ranks: the rendezvous's (hvdmx/rendezvous/wire.py), as
# a protocol of its own, with a u64 length: a pickled call or result may be
# larger than 4 GiB. The peer has proved it holds the key before any frame.
PROTOCOL = Protocol(b"hvdmx-fnjob-v2\0\0", b"hvdmx-fnjob", "hvdmx.run_function launcher",
                    struct.Struct("!Q"))
_MAX_FRAME_BYTES = 1 << 40

# Note [The function job's handshake]
# The port of the process that calls run_function is open to anyone who can
# reach it, and what travels on it is pickled code, run where it arrives: a
# rank must not run a stranger's call, and the launcher must not unpickle a
# stranger's "result". So, before either side unpickles anything, both prove
# that they hold the job's secret key (HVDMX_SECRET_KEY, which job_environ
# makes and the launcher gives the ranks in their environment only), by the
# rendezvous's handshake (Note [The rendezvous protocol]): the launcher
# accepts, each rank connects, under this protocol's own MAGIC and labels,
# so that no exchange of the rendezvous proves anything here. Every frame
# after it carries an HMAC under a key new for the connection and a counter,
# so a frame altered, replayed or reordered is refused. A connection that
# has not proved itself within _HANDSHAKE_SECONDS is dropped. As with the
# ranks' own TCP connections (docs/running.md, "Who can join a job"), what
# travels is not encrypted.


def _secret_key(environ: Mapping[str, str]) -> Optional[bytes]:
    key = environ.get("HVDMX_SECRET_KEY") or environ.get("HOROVOD_SECRET_KEY")
    return key.encode() if key else None


# ---- the rank's side ------------------------------------------------------

def _world_rank(environ: Mapping[str, str]) -> int:
    """This process's rank in the launcher's job, from the variables the
    launchers set (hvdmxrun --no-mpi: HVDMX_RANK; Hydra: PMI_RANK; Open MPI:
    OMPI_COMM_WORLD_RANK; PMIx)."""
    for name in ("HVDMX_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    raise RuntimeError("no rank in the environment (HVDMX_RANK, PMI_RANK, "
                       "OMPI_COMM_WORLD_RANK or PMIX_RANK): this program is started by "
                       "hvdmx.run_function through a launcher, not by hand")


def connect_to_launcher(addresses: str, key: bytes) -> Channel:
    """A connection to the launcher that has passed the handshake: the
    addresses are tried in order (the first that works on this host wins)."""
    reasons = []
    for address in addresses.split(","):
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=_HANDSHAKE_SECONDS)
        except (OSError, ValueError) as error:
            reasons.append(f"{address}: {error}")
            continue
        try:
            channel = open_channel(sock, key, _MAX_FRAME_BYTES, address, PROTOCOL)
        except (OSError, PermissionError) as error:
            sock.close()
            reasons.append(f"{address}: {error}")
            continue
        sock.settimeout(None)
        return channel
    raise ConnectionError("cannot reach the process that called hvdmx.run_function at "
                          + "; ".join(reasons))


def outcome_of_error(error: BaseException) -> tuple:
    """What a rank sends for an exception: the exception itself pickled (None
    if it cannot be), its type's name, its text and its traceback."""
    try:
        pickled: Optional[bytes] = cloudpickle_module().dumps(error)
    except Exception:
        pickled = None
    return ("error", pickled, type(error).__qualname__, str(error),
            "".join(traceback.format_exception(type(error), error, error.__traceback__)))


def cloudpickle_module():
    import cloudpickle  # here: the ranks need it only once connected
    return cloudpickle


def _rank_main() -> int:
    """The program every rank runs (python -m hvdmx.runner.function_job)."""
    addresses = os.environ.get(ADDRESSES_VARIABLE)
    key = _secret_key(os.environ)
    if not addresses or key is None:
        print(f"hvdmx.runner.function_job: {ADDRESSES_VARIABLE} and HVDMX_SECRET_KEY are "
              "not both set; this program is started by hvdmx.run_function, not by hand",
              file=sys.stderr)
        return 2
    try:
        rank = _world_rank(os.environ)
        channel = connect_to_launcher(addresses, key)
    except (RuntimeError, ConnectionError) as error:
        print(f"hvdmx.runner.function_job: {error}", file=sys.stderr)
        return 2
    with channel.sock:
        channel.send(pickle.dumps(("hello", rank, socket.gethostname(), os.getpid())))
        call = pickle.loads(channel.receive())
        # The caller's module path first, so that the function's modules are
        # found as they were there (a script's directory, say).
        sys.path[:] = call["sys_path"] + [p for p in sys.path if p not in call["sys_path"]]
        try:
            fn, args, kwargs = cloudpickle_module().loads(call["call"])
            value = fn(*args, **kwargs)
        except BaseException as error:  # the caller gets it, SystemExit included
            channel.send(pickle.dumps(outcome_of_error(error)))
            return 1
        try:
            pickled = cloudpickle_module().dumps(value)
        except Exception as error:
            problem = TypeError(f"the function's return value, a {type(value).__name__}, "
                                f"cannot be pickled ({error}); return a value that cloudpickle "
                                "can serialize")
            channel.send(pickle.dumps(outcome_of_error(problem)))
            return 1
        channel.send(pickle.dumps(("value", pickled)))
    return 0


# ---- the caller's side ----------------------------------------------------

class RemoteTraceback(Exception):
    """The traceback of an exception raised on a rank: the ``__cause__`` of
    the exception that run_function raises for it."""


def _number_of_processes(num_proc: Optional[int], np: Optional[int]) -> Optional[int]:
    if np is not None:
        # As Horovod warns: from its own module, so hidden by Python's default filters.
        warnings.warn("np is deprecated, use num_proc instead", DeprecationWarning, stacklevel=1)
        if num_proc is not None and num_proc != np:
            raise ValueError(f"hvdmx.run_function: num_proc={num_proc} and np={np} disagree; "
                             "give num_proc only (np is its deprecated name)")
        num_proc = np
    if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int)
                                 or num_proc < 1):
        raise ValueError(f"hvdmx.run_function: num_proc={num_proc!r} must be an int >= 1")
    return num_proc


def start_timeout_seconds(value: Optional[float], environ: Mapping[str, str],
                          variables: Sequence[str] = _START_TIMEOUT_VARIABLES,
                          default: float = _DEFAULT_START_TIMEOUT,
                          prog: str = "hvdmx.run_function") -> float:
    """start_timeout, else the first of ``variables`` set, else ``default``;
    ValueError naming ``prog`` and where a bad value came from. Also
    hvdmx.spark.run's, with its own variables and default."""
    where, raw = "start_timeout", value  # type: Tuple[str, object]
    if value is None:
        for name in variables:
            if environ.get(name):
                where, raw = name, environ[name]
                break
        else:
            return default
    try:
        seconds = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{prog}: {where}={raw!r} must be a number of seconds > 0")
    return seconds


def _refuse_unsupported(**given: Any) -> None:
    elastic = [name for name in ("min_num_proc", "max_num_proc", "min_np", "max_np", "slots",
                                 "reset_limit", "cooldown_range") if given[name] is not None]
    if elastic:
        raise NotImplementedError(
            f"hvdmx.run_function: {', '.join(elastic)} ask for elastic training, which hvdmx "
            "does not have yet (issue 49): leave them unset to run a fixed number of ranks")
    for name, fix in (("ssh_port", "set Port for those hosts in ~/.ssh/config"),
                      ("ssh_identity_file", "set IdentityFile for those hosts in ~/.ssh/config"),
                      ("output_filename", "pass the launcher's own flag in mpi_args (MPICH: "
                                          "-outfile-pattern and -errfile-pattern, Open MPI: "
                                          "--output-filename)")):
        if given[name] is not None:
            raise NotImplementedError(f"hvdmx.run_function: {name} is not supported; {fix}")


def _addresses(hosts: Optional[List[Host]], environ: Mapping[str, str]) -> Tuple[str, List[str]]:
    """(the address to listen on, the addresses the ranks try, in order).
    Ranks all on this host reach it on the loopback; otherwise each remote
    host gets the address of this host's interface on the route to it
    (with the hosts of a batch scheduler's allocation, which are not listed:
    the addresses of this host's name), the loopback last."""
    remote = [h.name for h in hosts if not is_this_host(h.name)] if hosts else []
    batch = hosts is None and any(environ.get(name) for name in
                                  ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID"))
    if not remote and not batch:
        return "127.0.0.1", ["127.0.0.1"]
    found: List[str] = []
    for name in remote:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((name, 9))  # no packet is sent: this only picks the route
                found.append(probe.getsockname()[0])
        except OSError:
            pass
    if batch:
        try:
            found += [str(a[4][0]) for a in socket.getaddrinfo(socket.gethostname(), None,
                                                               socket.AF_INET)]
        except OSError:
            pass
    return "0.0.0.0", list(dict.fromkeys(found + ["127.0.0.1"]))


def _rank_command(executable: Optional[str]) -> List[str]:
    python = executable or sys.executable
    alias = getattr(sys.modules.get("horovod"), "_hvdmx_alias", False)
    # Under hvdmx.as_horovod here, under it on the ranks too: the function
    # may use horovod.mxnet, which only the alias makes hvdmx.
    return [python, "-m", "hvdmx.as_horovod", "-m", "hvdmx.runner.function_job"] if alias \
        else [python, "-m", "hvdmx.runner.function_job"]


def _no_mpi_command(num_proc: int, hosts: Optional[List[Host]],
                    network_interface: Optional[str], verbose: Optional[bool],
                    executable: Optional[str], environ: Mapping[str, str]
                    ) -> Tuple[List[str], Dict[str, str]]:
    """(hvdmxrun --no-mpi's command, its environment) for a job without MPI
    (use_gloo=True): hvdmxrun runs in a process of its own, so that the job
    is ended as the MPI launcher's is (stop_launcher). It finds hvdmx where this
    process found it."""
    cmd = [sys.executable, "-m", "hvdmx.runner.launch", "--no-mpi", "-np", str(num_proc)]
    if hosts:
        cmd += ["-H", format_hosts(hosts)]
    if network_interface:
        cmd += ["--network-interface", network_interface]
    if verbose:
        cmd.append("--verbose")
    env = dict(environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([here] + ([env["PYTHONPATH"]]
                                                  if env.get("PYTHONPATH") else []))
    return cmd + ["--", *_rank_command(executable)], env


def stop_launcher(process: subprocess.Popen) -> None:
    """Ends the launcher, which passes SIGTERM on to the ranks, and waits for
    it; then kills what is left of its process group (the launcher started
    in a group of its own, which holds its local proxies and ranks), so that
    no rank of this host outlives the call."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def raise_for(rank: int, outcome: tuple, others: str) -> None:
    _, pickled, type_name, text, remote_traceback = outcome
    cause = RemoteTraceback(f"rank {rank} raised this{others}:\n\n{remote_traceback}")
    error: Optional[BaseException] = None
    if pickled is not None:
        try:
            error = pickle.loads(pickled)
        except Exception:
            error = None
    if not isinstance(error, Exception):  # unreadable here, or SystemExit and the like
        error = RuntimeError(f"hvdmx.run_function: rank {rank} raised {type_name}: {text}")
    raise error from cause


class FunctionServer:
    """The listening port, one thread that accepts and one per connection:
    each reports to the caller's thread through `events`, as
    ("hello", connection, ("hello", rank, host, pid)), ("outcome", connection, the
    rank's message or None if it ended without one), or ("stranger", reason)."""

    def __init__(self, listen: str, key: bytes,
                 serve: Optional[Callable[[socket.socket], None]] = None):
        """`serve`, when given, serves each accepted connection instead of
        the function job's conversation (hvdmx.spark's task server)."""
        self.key = key
        self._serve_one = serve or self._serve
        self.events: "queue.Queue[tuple]" = queue.Queue()
        self.listener = socket.create_server((listen, 0))
        self.port = self.listener.getsockname()[1]
        self.threads: List[threading.Thread] = []
        self.connections: List[socket.socket] = []
        self.channels: Dict[socket.socket, Channel] = {}
        self.closed = threading.Event()
        # accept() wakes up every 0.2 s to see whether the server is closed:
        # closing a socket does not wake a thread blocked in accept() on it.
        self.listener.settimeout(0.2)
        self.acceptor = threading.Thread(target=self._accept, name="hvdmx-function-job",
                                         daemon=True)
        self.acceptor.start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                connection, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            connection.setblocking(True)
            thread = threading.Thread(target=self._serve_one, args=(connection,), daemon=True)
            self.connections.append(connection)
            self.threads.append(thread)
            thread.start()

    def _serve(self, connection: socket.socket) -> None:
        try:
            connection.settimeout(_HANDSHAKE_SECONDS)
            channel = accept_channel(connection, self.key, _MAX_FRAME_BYTES, PROTOCOL)
            hello = pickle.loads(channel.receive())
            connection.settimeout(None)
            self.channels[connection] = channel
        except Exception as error:  # a stranger, or a rank that died at once
            self.events.put(("stranger", str(error)))
            connection.close()
            return
        self.events.put(("hello", connection, hello))
        try:
            outcome = pickle.loads(channel.receive())
        except Exception:
            outcome = None
        self.events.put(("outcome", connection, outcome))

    def send(self, connection: socket.socket, payload: bytes) -> None:
        """One frame to a rank that has said hello."""
        self.channels[connection].send(payload)

    def wait_for_connections(self, seconds: float) -> None:
        """Waits up to `seconds` for every connection's thread to end."""
        deadline = time.monotonic() + seconds
        for thread in list(self.threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    @staticmethod
    def drop(connection: socket.socket) -> None:
        try:
            connection.shutdown(socket.SHUT_RDWR)  # wakes its thread's recv
        except OSError:
            pass
        connection.close()

    def close(self) -> None:
        self.closed.set()
        self.acceptor.join()
        self.listener.close()
        for connection in self.connections:
            self.drop(connection)


def run_function(fn: Callable[..., Any], args: Sequence[Any] = (),
                 kwargs: Optional[Mapping[str, Any]] = None, num_proc: Optional[int] = None,
                 min_num_proc: Optional[int] = None, max_num_proc: Optional[int] = None,
                 slots: Optional[int] = None, reset_limit: Optional[int] = None,
                 cooldown_range: Optional[Tuple[float, float]] = None,
                 hosts: Optional[str] = None, hostfile: Optional[str] = None,
                 start_timeout: Optional[float] = None, ssh_port: Optional[int] = None,
                 ssh_identity_file: Optional[str] = None, disable_cache: Optional[bool] = None,
                 output_filename: Optional[str] = None, verbose: Optional[bool] = None,
                 use_gloo: Optional[bool] = None, use_mpi: Optional[bool] = None,
                 mpi_args: Optional[Union[str, Sequence[str]]] = None,
                 network_interface: Optional[str] = None, executable: Optional[str] = None,
                 np: Optional[int] = None, min_np: Optional[int] = None,
                 max_np: Optional[int] = None,
                 env: Optional[Mapping[str, str]] = None) -> List[Any]:
    """Runs ``fn(*args, **kwargs)`` on every rank of a new job and returns
    the ranks' return values, a list in rank order.

    Horovod's ``horovod.run``, with its arguments: ``num_proc`` ranks
    (``np`` is its deprecated name; default 1, or all the slots of ``hosts``)
    on ``hosts`` ("node1:4,node2:4") or the hosts of ``hostfile`` (default:
    as hvdmxrun, this host or the batch scheduler's allocation), started
    through MPI's launcher with ``mpi_args`` added to its command and the
    Python ``executable`` (default: this one). ``start_timeout`` (seconds;
    default $HVDMX_START_TIMEOUT or $HOROVOD_START_TIMEOUT, else 30) bounds
    the checks of the hosts and the start of every rank. ``verbose`` prints
    the launcher's command on stderr; ``network_interface`` sets
    HVDMX_TCP_IFACE on the ranks. ``env`` (hvdmx's, as in
    ``horovod.spark.run``) adds variables to the ranks' environment, which is
    otherwise this process's. ``disable_cache`` changes nothing: hvdmx keeps
    no cache of its checks.

    ``fn`` and its arguments are pickled with cloudpickle, and so is every
    return value. When a rank raises, the first exception to arrive is raised
    here with the rank's traceback as its ``__cause__`` (a RemoteTraceback),
    once the job has ended; a job that ends otherwise without every value,
    or whose ranks do not all start within ``start_timeout``, raises
    RuntimeError or TimeoutError. ``use_gloo=True`` starts the ranks without
    MPI, as ``hvdmxrun --no-mpi`` does (then ``mpi_args`` is refused);
    otherwise MPI's launcher starts them (Horovod's automatic choice when
    neither is asked for, where MPI is built). Not supported yet, each with a
    NotImplementedError that says so: the elastic arguments (issue 49), and
    ``ssh_port``, ``ssh_identity_file`` and ``output_filename``.
    """
    if use_gloo and use_mpi:
        raise ValueError("hvdmx.run_function: use_gloo and use_mpi are both True; set one")
    _refuse_unsupported(min_num_proc=min_num_proc, max_num_proc=max_num_proc, min_np=min_np,
                        max_np=max_np, slots=slots, reset_limit=reset_limit,
                        cooldown_range=cooldown_range, use_gloo=use_gloo, ssh_port=ssh_port,
                        ssh_identity_file=ssh_identity_file, output_filename=output_filename)
    if not callable(fn):
        raise TypeError(f"hvdmx.run_function: fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"hvdmx.run_function: args must be a tuple or list, got "
                        f"{type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"hvdmx.run_function: kwargs must be a dict or None, got "
                        f"{type(kwargs).__name__}")
    if env is not None and not (isinstance(env, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise TypeError("hvdmx.run_function: env must map names (str) to values (str)")
    if hosts is not None and hostfile is not None:
        raise ValueError("hvdmx.run_function: give hosts or hostfile, not both")
    environ = dict(os.environ, **(env or {}))
    num_proc = _number_of_processes(num_proc, np)
    timeout = start_timeout_seconds(start_timeout, environ)
    try:
        pickled = cloudpickle_module().dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as error:
        raise TypeError(f"hvdmx.run_function: fn, args and kwargs must be picklable with "
                        f"cloudpickle ({type(error).__name__}: {error})") from error
    try:
        if hosts is not None:
            host_list: Optional[List[Host]] = parse_hosts(hosts, "hosts=")
            host_flag = "hosts="
        elif hostfile is not None:
            host_list, host_flag = read_hostfile(os.fspath(hostfile), "hostfile="), "hostfile="
        else:  # an MPI hostfile's variable, or the Slurm allocation (issue 63)
            host_list, host_flag = scheduler_hosts(environ)
        num_proc = resolve_num_proc(num_proc if num_proc is not None else
                                    (None if host_list else 1), host_list, host_flag,
                                    "num_proc=")
        own = ("num_proc", "hosts or hostfile")
        if mpi_args is None or isinstance(mpi_args, str):
            text = mpi_args or ""
        else:
            text = shlex.join(mpi_args)
        launcher_args = split_mpi_args(text, "mpi_args=", own)
    except UsageError as error:
        raise ValueError(f"hvdmx.run_function: {error}") from None
    tuning = {"HVDMX_TCP_IFACE": network_interface} if network_interface else {}
    # As Horovod chooses: Gloo (here: hvdmxrun --no-mpi) when asked for; with
    # neither asked for (use_mpi=False and use_gloo=False included, as
    # Horovod's own examples pass them), MPI, which hvdmx always has.
    no_mpi = bool(use_gloo)
    if no_mpi and launcher_args:
        raise ValueError(f"hvdmx.run_function: mpi_args={mpi_args!r} is for MPI's launcher, "
                         "but use_gloo=True starts the ranks without it; drop one of them")

    if not no_mpi:
        mpi_without_init()  # this process is no rank (see hvdmx/runner/mpi.py)
    environ = job_environ(environ)
    key = _secret_key(environ)
    assert key is not None  # job_environ made one if there was none
    listen, addresses = _addresses(host_list, environ)
    server = FunctionServer(listen, key)
    environ[ADDRESSES_VARIABLE] = ",".join(f"{a}:{server.port}" for a in addresses)
    try:
        if no_mpi:
            cmd, launcher_env = _no_mpi_command(num_proc, host_list, network_interface,
                                                verbose, executable, environ)
        else:
            try:
                launcher, cmd = plan_launch(None, num_proc, host_list, host_flag,
                                            launcher_args, tuning, _rank_command(executable),
                                            environ, host_timeout=timeout,
                                            forward_names=list(env or {}), np_flag="num_proc=")
            except UsageError as error:
                raise ValueError(f"hvdmx.run_function: {error}") from None
            launcher_env = launcher_environ(launcher, environ)
        if verbose:
            print(f"{PROG}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        # A session of its own: stop_launcher can end all of it (Ctrl-C here raises
        # KeyboardInterrupt, and stop_launcher ends the job).
        process = subprocess.Popen(cmd, env=launcher_env, start_new_session=True)
        try:
            return _collect(server, process, num_proc, pickled, timeout)
        finally:
            stop_launcher(process)
    finally:
        server.close()


def _collect(server: FunctionServer, process: subprocess.Popen, num_proc: int, pickled: bytes,
             start_timeout: float) -> List[Any]:
    """Serves the call to every rank and gathers the outcomes (see the
    module's docstring); returns the values in rank order, or raises."""
    call = pickle.dumps({"sys_path": list(sys.path), "call": pickled})
    ranks: Dict[socket.socket, int] = {}
    values: Dict[int, Any] = {}
    failures: List[Tuple[int, tuple]] = []  # in the order they arrived

    def take(event: tuple) -> None:
        if event[0] == "hello":
            _, connection, hello = event
            rank = hello[1] if isinstance(hello, tuple) and len(hello) == 4 else None
            if not isinstance(rank, int) or not 0 <= rank < num_proc or rank in ranks.values():
                server.drop(connection)  # not a rank of this job
                return
            ranks[connection] = rank
            try:
                server.send(connection, call)
            except OSError:
                pass  # it ended; it will be missing from the values
        elif event[0] == "outcome" and event[1] in ranks and event[2] is not None:
            rank, outcome = ranks[event[1]], event[2]
            if outcome[0] != "value":
                failures.append((rank, outcome))
                return
            try:
                values[rank] = pickle.loads(outcome[1])
            except Exception as error:
                failures.append((rank, outcome_of_error(RuntimeError(
                    f"rank {rank}'s return value cannot be unpickled here "
                    f"({type(error).__name__}: {error})"))))

    start_by = time.monotonic() + start_timeout
    stop_by: Optional[float] = None  # when to end a job that has failed or is done
    while process.poll() is None:
        try:
            take(server.events.get(timeout=0.1))
        except queue.Empty:
            pass
        now = time.monotonic()
        if stop_by is None and (failures or len(values) == num_proc):
            stop_by = now + (_FAILURE_GRACE_SECONDS if failures else _EXIT_GRACE_SECONDS)
        if stop_by is None and len(ranks) < num_proc and now > start_by:
            stop_launcher(process)
            missing = sorted(set(range(num_proc)) - set(ranks.values()))
            raise TimeoutError(
                f"hvdmx.run_function: {len(ranks)} of {num_proc} ranks started within "
                f"start_timeout={start_timeout:g} s (not started: ranks "
                f"{', '.join(map(str, missing))}); check the hosts and their output above, "
                "or raise start_timeout")
        if stop_by is not None and now > stop_by:
            stop_launcher(process)
    code = process.returncode
    # The ranks have ended, and with them their connections: what they sent
    # last is read by now, or about to be.
    server.wait_for_connections(_STOP_SECONDS)
    while not server.events.empty():
        take(server.events.get())
    if failures:
        rank, outcome = failures[0]
        others = sorted(r for r, _ in failures[1:])
        raise_for(rank, outcome, f" (ranks {others} raised after it)" if others else "")
    missing = sorted(set(range(num_proc)) - set(values))
    if missing:
        raise RuntimeError(f"hvdmx.run_function: the job ended (launcher exit status {code}) "
                           f"before ranks {missing} returned; their output above says why")
    if code != 0:
        raise RuntimeError(f"hvdmx.run_function: every rank returned, but the launcher "
                           f"exited with status {code}")
    return [values[rank] for rank in range(num_proc)]


if __name__ == "__main__":
    sys.exit(_rank_main())
