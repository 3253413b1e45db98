"""``hvdmx.spark.run``: the driver's side (docs/spark.md).

The driver is not a rank. It makes the job's key, serves the rendezvous
(as ``hvdmxrun --no-mpi`` does), the function job (hvdmx/runner/function_job.py:
each rank proves the key, gets the pickled call and sends back its value
or its exception) and the task server (See Note [The task's channel] in
hvdmx/spark/task.py), then runs one barrier-mode Spark job of ``num_proc``
tasks on a background thread, under a job group of its own. Each task
starts one rank (hvdmx/spark/task.py). The call returns the values in rank
order once every rank has sent one and the Spark job has ended; on the
first failure (a rank's exception, a rank or its task lost, the Spark job
failed, not every rank started within ``start_timeout``) it stops every
rank, cancels the job group, waits for the Spark job to end and raises.
"""
from __future__ import annotations

import os
import pickle
import queue
import secrets
import socket
import sys
import threading
import time
from typing import IO, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from hvdmx.spark._runner import KEY_VARIABLES, PROTOCOL, RendezvousServer, cloudpickle_module, \
    outcome_of_error, raise_for, FunctionServer, accept_channel, start_timeout_seconds

PROG = "hvdmx.spark.run"
START_TIMEOUT_VARIABLES = ("HVDMX_SPARK_START_TIMEOUT", "HOROVOD_SPARK_START_TIMEOUT")
DEFAULT_START_TIMEOUT = 600.0  # as Horovod's Spark run: executors may come late
_LOST_GRACE_SECONDS = 2.0  # after a rank's connection ends, for its exit status to arrive
_END_SECONDS = 60.0  # after every value, for the Spark job to end
_CANCEL_SECONDS = 60.0  # after cancelling, for the Spark job to end
_HANDSHAKE_SECONDS = 10.0
_MAX_FRAME = 1 << 20  # a task's message (one line of output at most)


def _import_pyspark() -> Any:
    try:
        import pyspark
    except ImportError as error:
        raise ImportError(f"{PROG} needs pyspark (Spark's Python API), which this Python "
                          f"cannot import ({error}): pip install pyspark (3.1 or later), or "
                          "put its directory on PYTHONPATH") from error
    return pyspark


class _TaskServer:
    """The driver's end of the tasks' channels (See Note [The task's
    channel]): the function job's listener and its thread per connection
    (hvdmx/runner/function_job.py), serving another conversation: messages go to
    `events` as ("task", message), output lines straight to `write`;
    close() closes every channel."""

    def __init__(self, key: bytes, num_proc: int, write: Callable[[int, str, bytes], None]):
        self.key, self.num_proc, self.write = key, num_proc, write  # before the acceptor starts
        self.events: "queue.Queue[tuple]" = queue.Queue()
        self.server = FunctionServer("0.0.0.0", key, serve=self._serve)
        self.port = self.server.port

    def close(self) -> None:
        self.server.close()

    def _check(self, message: Any, peer: str) -> Optional[tuple]:
        """The message if it is well formed, else None (and a note)."""
        ok = isinstance(message, tuple) and len(message) >= 3 and \
            isinstance(message[1], int) and 0 <= message[1] < self.num_proc
        if ok and message[0] == "out":
            ok = len(message) == 4 and message[2] in ("stdout", "stderr") and \
                isinstance(message[3], bytes)
        elif ok and message[0] == "placed":
            ok = len(message) == 5 and isinstance(message[3], str)
        elif ok and message[0] == "exit":
            ok = isinstance(message[2], int)
        elif ok and message[0] == "setup":
            ok = isinstance(message[2], str)
        else:
            ok = False
        if not ok:
            self.events.put(("stranger", f"{peer} sent a malformed message"))
            return None
        return message

    def _serve(self, connection: socket.socket) -> None:
        try:
            peer = "%s:%d" % connection.getpeername()[:2]
        except OSError:
            peer = "a peer"
        try:
            connection.settimeout(_HANDSHAKE_SECONDS)
            channel = accept_channel(connection, self.key, _MAX_FRAME, PROTOCOL)
            connection.settimeout(None)
        except Exception as error:
            self.events.put(("stranger", f"{peer}: {error}"))
            connection.close()
            return
        try:
            while True:
                message = self._check(pickle.loads(channel.receive()), peer)
                if message is None:
                    break
                if message[0] == "out":
                    self.write(message[1], message[2], message[3])
                else:
                    self.events.put(("task", message))
        except Exception:
            pass  # the task ended (or sent garbage): its rank's outcome says more
        connection.close()


def _validate(fn: Any, args: Any, kwargs: Any, num_proc: Any, start_timeout: Any, env: Any,
              verbose: Any, data: Any) -> float:
    if not callable(fn):
        raise TypeError(f"{PROG}: fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"{PROG}: args must be a tuple or list, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"{PROG}: kwargs must be a dict or None, got {type(kwargs).__name__}")
    if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int)
                                 or num_proc < 1):
        raise ValueError(f"{PROG}: num_proc={num_proc!r} must be an int >= 1 (or None: the "
                         "cluster's default parallelism)")
    if env is not None and not (isinstance(env, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise TypeError(f"{PROG}: env must map names (str) to values (str)")
    if env is not None and any(name in KEY_VARIABLES for name in env):
        raise ValueError(f"{PROG}: env must not set the job's key ({', '.join(KEY_VARIABLES)}): "
                         "run makes a fresh one for every job")
    if isinstance(verbose, bool) or not isinstance(verbose, int) or verbose < 0:
        raise ValueError(f"{PROG}: verbose={verbose!r} must be an int >= 0")
    if data is not None and not (hasattr(data, "repartition") and hasattr(data, "columns")):
        raise TypeError(f"{PROG}: data must be a pyspark.sql.DataFrame, got "
                        f"{type(data).__name__}")
    return start_timeout_seconds(start_timeout, os.environ, START_TIMEOUT_VARIABLES,
                                 DEFAULT_START_TIMEOUT, PROG)


def _spark_summary(error: BaseException) -> str:
    """The lines of a Spark job's error that say why (not the JVM's stack):
    its first lines, and those of a task's own error (hvdmx.spark: ...)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    keep = [line for line in lines if not line.startswith("at ")][:6]
    keep += [line for line in lines if "hvdmx.spark: rank" in line and line not in keep][:3]
    return "\n  ".join(keep) if keep else type(error).__name__


def run(fn: Callable[..., Any], args: Sequence[Any] = (),
        kwargs: Optional[Mapping[str, Any]] = None, num_proc: Optional[int] = None,
        start_timeout: Optional[float] = None, env: Optional[Mapping[str, str]] = None,
        stdout: Optional[IO[str]] = None, stderr: Optional[IO[str]] = None,
        verbose: int = 1, data: Any = None) -> List[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``num_proc`` ranks placed in the tasks
    of a barrier-mode Spark stage of the active SparkContext, and returns the
    ranks' return values, a list in rank order (Horovod's
    ``horovod.spark.run``).

    ``num_proc`` defaults to the cluster's default parallelism; all ranks
    start together or not at all (barrier mode), and ``start_timeout``
    seconds (default $HVDMX_SPARK_START_TIMEOUT or
    $HOROVOD_SPARK_START_TIMEOUT, else 600) bound the wait for every rank to
    be placed and started: then TimeoutError, naming how many were. ``env``
    adds variables to the ranks' environment (the Spark task's otherwise).
    Each line a rank prints is written to ``stdout`` or ``stderr`` (default
    this process's), prefixed ``[rank]<stdout>:`` as hvdmxrun does.
    ``verbose`` >= 1 prints where the ranks run, on stderr. ``data`` (a
    pyspark DataFrame) is repartitioned into one partition per rank, each
    rank's rows written on its task's host; the rank reads them with
    ``hvdmx.spark.rank_data``, ``rank_arrays`` or ``rank_dataset``.

    A rank's exception is raised here with the rank's traceback as its
    ``__cause__``; a rank, task or executor lost, or a Spark job that fails,
    raises RuntimeError. In every case no rank is left running.
    """
    timeout = _validate(fn, args, kwargs, num_proc, start_timeout, env, verbose, data)
    pyspark = _import_pyspark()
    sc = pyspark.SparkContext._active_spark_context
    if sc is None:
        raise RuntimeError(f"{PROG}: no active SparkContext; start one first (e.g. "
                           "SparkSession.builder.master(...).getOrCreate())")
    if num_proc is None:
        num_proc = int(sc.defaultParallelism)
    try:
        pickled = cloudpickle_module().dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as error:
        raise TypeError(f"{PROG}: fn, args and kwargs must be picklable with cloudpickle "
                        f"({type(error).__name__}: {error})") from error
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    write_lock = threading.Lock()

    def write(rank: int, stream: str, line: bytes) -> None:
        text = line.decode("utf-8", "replace")
        target = out if stream == "stdout" else err
        with write_lock:
            try:
                target.write(f"[{rank}]<{stream}>:{text}" + ("" if text.endswith("\n")
                                                              else "\n"))
                target.flush()
            except (OSError, ValueError):
                pass

    def say(text: str) -> None:
        with write_lock:
            err.write(f"{PROG}: {text}\n")
            err.flush()

    key = secrets.token_hex(32)
    driver_host = sc.getConf().get("spark.driver.host") or socket.gethostname()
    rendezvous = RendezvousServer(num_proc, bytes.fromhex(key), host="0.0.0.0",
                                  on_problem=lambda text: say(f"rendezvous: {text}"))
    functions = tasks = None
    try:
        functions = FunctionServer("0.0.0.0", key.encode())
        tasks = _TaskServer(key.encode(), num_proc, write)
        alias = getattr(sys.modules.get("horovod"), "_hvdmx_alias", False)
        module = ["-m", "hvdmx.as_horovod", "-m", "hvdmx.runner.function_job"] if alias \
            else ["-m", "hvdmx.runner.function_job"]
        plan = {"key": key, "env": dict(env or {}), "module": module,
                "rendezvous": rendezvous.address(driver_host),
                "function_addresses": f"{driver_host}:{functions.port},127.0.0.1:"
                                      f"{functions.port}",
                "task_addresses": f"{driver_host}:{tasks.port},127.0.0.1:{tasks.port}",
                "columns": list(data.columns) if data is not None else None}
        job = _SparkJob(pyspark, sc, plan, num_proc, data)
        collect = _Collect(functions, tasks, job, num_proc, pickled, timeout, say, verbose)
        try:
            return collect.run()
        finally:
            tasks.close()  # every task stops its rank
            job.end(started=bool(collect.placed))
    finally:
        if tasks is not None:
            tasks.close()
        if functions is not None:
            functions.close()
        rendezvous.close()


class _SparkJob:
    """The barrier stage, collected on a thread under a job group of its own."""

    def __init__(self, pyspark: Any, sc: Any, plan: Dict[str, Any], num_proc: int, data: Any):
        from functools import partial

        from hvdmx.spark.task import run_task
        self.sc = sc
        self.group = f"hvdmx-spark-{secrets.token_hex(8)}"
        if data is not None:
            rdd = data.repartition(num_proc).rdd
        else:
            rdd = sc.parallelize(range(num_proc), num_proc)
        self.rdd = rdd.barrier().mapPartitions(partial(run_task, plan))
        self.error: Optional[BaseException] = None
        self.done = threading.Event()
        self.ended = False
        self.thread = pyspark.InheritableThread(target=self._run, name="hvdmx-spark-job",
                                                daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.sc.setJobGroup(self.group, "hvdmx.spark.run", interruptOnCancel=True)
            self.rdd.collect()
        except BaseException as error:
            self.error = error
        finally:
            self.done.set()

    def end(self, started: bool) -> None:
        """Cancels the job if it still runs and, if its tasks have `started`,
        waits for it to end (once).

        A barrier job that Spark has not started (the cluster lacks the slots)
        is not in the job group yet, so the cancel misses it: it stays pending
        until Spark gives up on it (spark.scheduler.barrier.maxConcurrentTasksCheck.*)
        or, if slots come, its tasks fail at once: the first thing a task does
        is to connect to this run's task server, which is closed by then, so
        no rank ever starts."""
        if self.ended:
            return
        self.ended = True
        if not self.done.is_set():
            self.sc.cancelJobGroup(self.group)
        if started:
            self.done.wait(_CANCEL_SECONDS)


class _Collect:
    """Serves the call and gathers the outcomes (see the module's docstring)."""

    def __init__(self, functions: FunctionServer, tasks: _TaskServer, job: _SparkJob, num_proc: int,
                 pickled: bytes, timeout: float, say: Callable[[str], None], verbose: int):
        self.functions, self.tasks, self.job = functions, tasks, job
        self.num_proc, self.timeout, self.say, self.verbose = num_proc, timeout, say, verbose
        self.call = pickle.dumps({"sys_path": list(sys.path), "call": pickled})
        self.ranks: Dict[Any, int] = {}       # function-job connection -> rank
        self.values: Dict[int, Any] = {}
        self.failures: List[Tuple[int, tuple]] = []
        self.lost: Dict[int, float] = {}      # rank -> when its connection ended unanswered
        self.placed: Dict[int, str] = {}      # rank -> host of its task
        self.exits: Dict[int, int] = {}
        self.setup: Dict[int, str] = {}       # rank -> why its task could not start it

    def _take_function_event(self, event: tuple) -> None:
        if event[0] == "hello":
            _, connection, hello = event
            rank = hello[1] if isinstance(hello, tuple) and len(hello) == 4 else None
            if not isinstance(rank, int) or not 0 <= rank < self.num_proc \
                    or rank in self.ranks.values():
                FunctionServer.drop(connection)
                return
            self.ranks[connection] = rank
            try:
                self.functions.send(connection, self.call)
            except OSError:
                pass
        elif event[0] == "outcome" and event[1] in self.ranks:
            rank, outcome = self.ranks[event[1]], event[2]
            if outcome is None:
                if rank not in self.values:
                    self.lost.setdefault(rank, time.monotonic())
            elif outcome[0] != "value":
                self.failures.append((rank, outcome))
            else:
                try:
                    self.values[rank] = pickle.loads(outcome[1])
                except Exception as error:
                    self.failures.append((rank, outcome_of_error(RuntimeError(
                        f"rank {rank}'s return value cannot be unpickled here "
                        f"({type(error).__name__}: {error})"))))
        elif event[0] == "stranger":
            self.say(f"refused a connection: {event[1]}")

    def _take_task_event(self, event: tuple) -> None:
        if event[0] == "stranger":
            self.say(f"refused a task's connection: {event[1]}")
            return
        message = event[1]
        if message[0] == "placed":
            self.placed[message[1]] = message[3]
            if self.verbose and len(self.placed) == self.num_proc:
                where = ", ".join(f"{r}:{h}" for r, h in sorted(self.placed.items()))
                self.say(f"{self.num_proc} ranks placed in Spark tasks (rank:host) {where}")
        elif message[0] == "exit":
            self.exits[message[1]] = message[2]
        elif message[0] == "setup":
            self.setup.setdefault(message[1], message[2])

    def _drain(self) -> None:
        for source, take in ((self.functions.events, self._take_function_event),
                             (self.tasks.events, self._take_task_event)):
            while True:
                try:
                    take(source.get_nowait())
                except queue.Empty:
                    break

    def _describe(self, rank: int) -> str:
        host = self.placed.get(rank)
        return f"rank {rank}" + (f" (host {host})" if host else "")

    def _ended(self, rank: int) -> str:
        code = self.exits.get(rank)
        if code is None:
            return "its Spark task or executor was lost (the Spark job's error, if any, follows)"
        if code < 0:
            return f"it was killed by signal {-code}"
        return f"it exited with status {code}"

    def run(self) -> List[Any]:
        start_by = time.monotonic() + self.timeout
        while True:
            try:
                event = self.functions.events.get(timeout=0.1)
                self._take_function_event(event)
            except queue.Empty:
                pass
            self._drain()
            now = time.monotonic()
            if self.failures:
                self._fail_with_exception()
            if self.setup:
                rank = min(self.setup)
                self._end_job()
                raise RuntimeError(f"{PROG}: the Spark task of {self._describe(rank)} could "
                                   f"not start it: {self.setup[rank]}")
            if len(self.values) == self.num_proc:
                self.job.done.wait(_END_SECONDS)
                self._drain()
                if self.job.error is not None:  # as run_function when its launcher fails
                    bad = sorted(r for r, code in self.exits.items() if code != 0)
                    after = f"ranks {bad} exited with a status other than 0 and " if bad \
                        else ""
                    raise RuntimeError(f"{PROG}: every rank returned, but then {after}the "
                                       f"Spark job failed:\n  {_spark_summary(self.job.error)}")
                return [self.values[rank] for rank in range(self.num_proc)]
            lost = [r for r, when in self.lost.items() if now > when + _LOST_GRACE_SECONDS
                    or r in self.exits or self.job.done.is_set()]
            if lost:
                rank = min(lost)
                self._end_job()
                raise RuntimeError(f"{PROG}: {self._describe(rank)} ended without returning: "
                                   f"{self._ended(rank)}{self._spark_error()}")
            if self.job.done.is_set():
                self._drain()
                if self.failures:
                    self._fail_with_exception()
                if len(self.values) == self.num_proc:
                    continue
                missing = sorted(set(range(self.num_proc)) - set(self.values))
                raise RuntimeError(f"{PROG}: the Spark job ended before ranks {missing} "
                                   f"returned{self._spark_error()}")
            if len(self.ranks) < self.num_proc and now > start_by:
                self._end_job()
                raise TimeoutError(
                    f"{PROG}: {len(self.placed)} of {self.num_proc} ranks were placed in Spark "
                    f"tasks and {len(self.ranks)} started within start_timeout="
                    f"{self.timeout:g} s; a barrier stage needs num_proc={self.num_proc} free "
                    f"task slots at once (this cluster's default parallelism is "
                    f"{self.job.sc.defaultParallelism}; Spark logs a warning when a barrier "
                    "stage needs more slots than the cluster has): lower num_proc, add "
                    "executors or cores, or raise start_timeout")

    def _spark_error(self) -> str:
        error = self.job.error
        return f"; the Spark job failed:\n  {_spark_summary(error)}" if error else ""

    def _end_job(self) -> None:
        self.tasks.close()
        self.job.end(started=bool(self.placed))
        self._drain()

    def _fail_with_exception(self) -> None:
        self._end_job()
        rank, outcome = self.failures[0]
        others = sorted(r for r, _ in self.failures[1:])
        raise_for(rank, outcome, f" (ranks {others} raised after it)" if others else "")

