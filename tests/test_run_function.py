"""hvdmx.run_function, Horovod's horovod.run: a function on every rank of a
new job, its return values in rank order, a rank's exception raised here.

The functions the ranks run are this module's: they travel by name (the
ranks find this file through the caller's sys.path), as a user's module's
functions do; test_horovod_script_under_as_horovod sends one of __main__ by
value, as Horovod's own examples do.
"""
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import hvdmx
from hvdmx.runner import function_job, hosts as run_hosts

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
# Above Horovod's 30 s: the suite runs two shards of tests at once on 2 cores.
START_TIMEOUT = 90
ENV = dict(os.environ, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1",
           PYTHONPATH=os.pathsep.join([ROOT] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))


@pytest.fixture(autouse=True)
def rank_environment(monkeypatch):
    # The ranks inherit this process's environment: one thread each, and
    # this checkout's hvdmx.
    for name in ("OMP_NUM_THREADS", "MXNET_CPU_WORKER_NTHREADS", "PYTHONPATH"):
        monkeypatch.setenv(name, ENV[name])


def rank_and_sum(offset):
    """On each rank: (rank, size, the sum over the ranks of rank + offset)."""
    import mxnet as mx
    hvd = hvdmx
    hvd.init()
    total = hvd.allreduce(mx.nd.array([hvd.rank() + offset]), op=hvd.Sum, name="sum")
    return hvd.rank(), hvd.size(), float(total.asnumpy()[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_proc", [1, 2])
def test_values_in_rank_order(num_proc):
    values = hvdmx.run_function(rank_and_sum, args=(10,), num_proc=num_proc,
                                start_timeout=START_TIMEOUT)
    total = sum(r + 10 for r in range(num_proc))
    assert values == [(r, num_proc, total) for r in range(num_proc)]


def arguments(a, b=2, *, c, d=4):
    """No hvdmx: the rank the launcher gave, the arguments and a variable."""
    return (int(os.environ["PMI_RANK"]), a, b, c, d, os.environ.get("RUN_FUNCTION_TEST"))


@pytest.mark.timeout(120)
def test_args_kwargs_and_env():
    with pytest.warns(DeprecationWarning, match="np is deprecated"):
        values = hvdmx.run_function(arguments, args=[1], kwargs={"c": 3, "b": "two"}, np=2,
                                    env={"RUN_FUNCTION_TEST": "set"},
                                    start_timeout=START_TIMEOUT)
    assert values == [(r, 1, "two", 3, 4, "set") for r in range(2)]


def raises_on_last_rank():
    """The last rank raises; the others wait for it in a collective that it
    never joins."""
    import mxnet as mx
    hvd = hvdmx
    hvd.init()
    if hvd.rank() == hvd.size() - 1:
        raise ValueError(f"rank {hvd.rank()} says no")
    hvd.allreduce(mx.nd.ones(4), name="never").wait_to_read()
    return "unreachable"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_proc", [1, 2])
def test_a_ranks_exception_is_raised_here(num_proc):
    with pytest.raises(ValueError, match=f"^rank {num_proc - 1} says no$") as caught:
        hvdmx.run_function(raises_on_last_rank, num_proc=num_proc, start_timeout=START_TIMEOUT)
    cause = caught.value.__cause__
    assert isinstance(cause, function_job.RemoteTraceback)
    assert str(cause).startswith(f"rank {num_proc - 1} raised this")
    assert "in raises_on_last_rank" in str(cause) and "ValueError: rank" in str(cause)
    # The other rank waits in a collective that never completes: only the
    # launcher's ending the job lets this return before the test's timeout.


def rendezvous_sum(offset):
    """No MPI: the rendezvous group of hvdmxrun --no-mpi, used directly (as
    hvd.init() uses it)."""
    from hvdmx.rendezvous.client import group_from_environment
    group = group_from_environment()
    try:
        got = group.allgather(str(group.rank + offset).encode())
        return (group.rank, group.size, sum(int(x) for x in got),
                int(os.environ["HVDMX_LOCAL_RANK"]), "PMI_RANK" in os.environ)
    finally:
        group.close()


def raises_on_rank_1_without_mpi():
    if os.environ["HVDMX_RANK"] == "1":
        raise KeyError("rank 1 without MPI")
    time.sleep(600)  # longer than the test's timeout: the launcher must end the job
    return "unreachable"


@pytest.mark.timeout(120)
def test_use_gloo_starts_the_ranks_without_mpi():
    values = hvdmx.run_function(rendezvous_sum, args=(10,), num_proc=3, use_gloo=True,
                                use_mpi=False, start_timeout=START_TIMEOUT)
    assert values == [(r, 3, 33, r, False) for r in range(3)]


@pytest.mark.timeout(120)
def test_use_gloo_raises_a_ranks_exception():
    with pytest.raises(KeyError, match="rank 1 without MPI"):
        hvdmx.run_function(raises_on_rank_1_without_mpi, num_proc=2, use_gloo=True,
                           start_timeout=START_TIMEOUT)


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("not this one")


def exits_or_raises_oddly(how):
    if int(os.environ["PMI_RANK"]) == 1:
        if how == "exit":
            os._exit(3)
        if how == "system-exit":
            sys.exit(4)
        if how == "unpicklable-error":
            raise Unpicklable("an odd error")
        if how == "unpicklable-value":
            return threading.Lock()
    return "fine"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how,error,message", [
    ("exit", RuntimeError, r"the job ended \(launcher exit status \d+\) before ranks \[1\] "
                           r"returned"),
    ("system-exit", RuntimeError, r"rank 1 raised SystemExit: 4"),
    ("unpicklable-error", RuntimeError, r"rank 1 raised Unpicklable: an odd error"),
    ("unpicklable-value", TypeError, r"the function's return value, a lock, cannot be pickled"),
])
def test_a_rank_that_ends_oddly(how, error, message):
    with pytest.raises(error, match=message):
        hvdmx.run_function(exits_or_raises_oddly, args=(how,), num_proc=2,
                           start_timeout=START_TIMEOUT)


@pytest.mark.timeout(60)
def test_ranks_that_never_start_time_out(tmp_path):
    # An "interpreter" that never runs the rank's program, so never connects.
    stuck = tmp_path / "stuck"
    stuck.write_text("#!/bin/sh\nexec sleep 100\n")
    stuck.chmod(0o755)
    # It sleeps longer than the test's timeout: only start_timeout ends the wait.
    with pytest.raises(TimeoutError, match=r"0 of 2 ranks started within start_timeout=2 s "
                                           r"\(not started: ranks 0, 1\)"):
        hvdmx.run_function(arguments, args=(1,), kwargs={"c": 3}, num_proc=2, start_timeout=2,
                           executable=str(stuck))


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore:np is deprecated")
@pytest.mark.parametrize("kwargs,error,message", [
    ({"use_gloo": True, "mpi_args": "-ppn 2"}, ValueError,
     r"mpi_args='-ppn 2' is for MPI's launcher, but use_gloo=True starts the ranks without "
     r"it"),
    ({"use_gloo": True, "use_mpi": True}, ValueError, "use_gloo and use_mpi"),
    ({"min_np": 2}, NotImplementedError, r"min_np ask for elastic training"),
    ({"max_num_proc": 4, "reset_limit": 1}, NotImplementedError,
     r"max_num_proc, reset_limit ask for elastic training"),
    ({"ssh_port": 2222}, NotImplementedError, r"ssh_port is not supported; set Port"),
    ({"output_filename": "out"}, NotImplementedError, r"-outfile-pattern"),
    ({"num_proc": 0}, ValueError, r"num_proc=0 must be an int >= 1"),
    ({"num_proc": 2.0}, ValueError, r"num_proc=2.0 must be an int >= 1"),
    ({"num_proc": 2, "np": 3}, ValueError, r"num_proc=2 and np=3 disagree"),
    ({"hosts": "localhost:1", "hostfile": "hosts.txt"}, ValueError,
     r"give hosts or hostfile, not both"),
    ({"hosts": "localhost::1"}, ValueError, r"hosts= 'localhost::1': 'localhost::1' is not a "
                                            r"host"),
    ({"hosts": "localhost:2", "num_proc": 3}, ValueError,
     r"num_proc= 3 is more than the 2 slot\(s\) of hosts= \(localhost:2\)"),
    ({"hostfile": "/nonexistent/hosts"}, ValueError, r"hostfile= '/nonexistent/hosts' cannot "
                                                     r"be read"),
    ({"mpi_args": "-n 3"}, ValueError, r"mpi_args= '-n 3' contains '-n'; give that with "
                                       r"num_proc instead"),
    ({"mpi_args": ["-hosts", "a"]}, ValueError, r"mpi_args= '-hosts a' contains '-hosts'; give "
                                                r"that with hosts or hostfile instead"),
    ({"start_timeout": -1}, ValueError, r"start_timeout=-1 must be a number of seconds > 0"),
    ({"args": "ab"}, TypeError, r"args must be a tuple or list, got str"),
    ({"kwargs": [("c", 1)]}, TypeError, r"kwargs must be a dict or None, got list"),
    ({"env": {"A": 1}}, TypeError, r"env must map names \(str\) to values \(str\)"),
    ({"args": (threading.Lock(),)}, TypeError, r"fn, args and kwargs must be picklable"),
])
def test_bad_arguments_are_refused_before_anything_starts(kwargs, error, message):
    with pytest.raises(error, match=message):
        hvdmx.run_function(arguments, **kwargs)


def test_where_the_ranks_reach_the_caller():
    # All ranks on this host: the loopback only. Hosts elsewhere, or a batch
    # scheduler's allocation: every interface, the route's address first.
    assert function_job._addresses(None, {}) == ("127.0.0.1", ["127.0.0.1"])
    local = [run_hosts.Host("localhost", 2), run_hosts.Host(socket.gethostname(), 1)]
    assert function_job._addresses(local, {}) == ("127.0.0.1", ["127.0.0.1"])
    listen, addresses = function_job._addresses(None, {"SLURM_JOB_ID": "7"})
    assert listen == "0.0.0.0" and addresses[-1] == "127.0.0.1"


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="fn must be callable, got int"):
        hvdmx.run_function(3)


def test_start_timeout_from_the_environment(monkeypatch):
    monkeypatch.setenv("HOROVOD_START_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="HOROVOD_START_TIMEOUT='soon' must be a number"):
        hvdmx.run_function(arguments)


@pytest.mark.parametrize("rank_key,launcher_key,refused", [
    (b"k" * 64, b"k" * 64, None),
    (b"k" * 64, b"x" * 64, "launcher"),  # the launcher finds the rank's MAC wrong
])
def test_the_handshake_needs_the_key_on_both_sides(rank_key, launcher_key, refused):
    launcher, rank = socket.socketpair()
    outcome = {}

    def launcher_side():
        try:
            function_job.accept_channel(launcher, launcher_key, 1 << 20, function_job.PROTOCOL)
            outcome["launcher"] = "ok"
        except PermissionError as error:
            outcome["launcher"] = str(error)
            launcher.close()

    thread = threading.Thread(target=launcher_side)
    thread.start()
    rank.settimeout(10)
    try:
        function_job.open_channel(rank, rank_key, 1 << 20, "the launcher",
                                  function_job.PROTOCOL)
        outcome["rank"] = "ok"
    except (PermissionError, ConnectionError) as error:
        outcome["rank"] = str(error)
    thread.join(10)
    if refused is None:
        assert outcome == {"launcher": "ok", "rank": "ok"}
    else:
        assert outcome["launcher"] == "it does not hold the job's secret key"
        assert outcome["rank"] != "ok"


def test_a_launcher_without_the_key_is_refused_by_the_rank():
    launcher, rank = socket.socketpair()
    # A nonce, then "accepted" and a MAC made up.
    thread = threading.Thread(target=lambda: launcher.sendall(
        function_job.PROTOCOL.magic + b"n" * 32 + b"\1" + b"m" * 32))
    thread.start()
    rank.settimeout(10)
    with pytest.raises(PermissionError, match="run_function launcher at the launcher does not "
                                              "hold the job's secret key"):
        function_job.open_channel(rank, b"k" * 64, 1 << 20, "the launcher",
                                  function_job.PROTOCOL)
    thread.join(10)


HOROVOD_SCRIPT = """\
    import argparse
    import horovod
    import horovod.mxnet as hvd
    import mxnet as mx

    parser = argparse.ArgumentParser()
    parser.add_argument("--num-proc", type=int)
    parser.add_argument("--communication")


    def main(args):
        hvd.init()
        total = hvd.allreduce(mx.nd.array([hvd.rank() + 1]), op=hvd.Sum, name="t")
        return hvd.rank(), hvd.size(), float(total.asnumpy()[0]), args.num_proc


    if __name__ == "__main__":
        args = parser.parse_args()
        # As Horovod's examples/mxnet/mxnet_mnist.py calls it.
        values = horovod.run(main, args=(args,), np=args.num_proc, hosts=None,
                             use_gloo=args.communication == "gloo",
                             use_mpi=args.communication == "mpi")
        print("values", values)
        assert horovod.runner.run is horovod.run
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("communication", [[], ["--communication", "gloo"]],
                         ids=["default", "gloo"])
def test_horovod_script_under_as_horovod(tmp_path, communication):
    # main is a function of __main__, so it travels by value, and it uses
    # horovod.mxnet: the ranks run under hvdmx.as_horovod too. With gloo the
    # job runs without MPI: hvd.init() over the launcher's rendezvous.
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(HOROVOD_SCRIPT))
    run = [sys.executable, "-m", "hvdmx.as_horovod", str(script), "--num-proc", "2",
           *communication]
    env = dict(ENV, HVDMX_START_TIMEOUT=str(START_TIMEOUT))
    result = subprocess.run(run, env=env, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr
    assert "values [(0, 2, 3.0, 2), (1, 2, 3.0, 2)]" in result.stdout
