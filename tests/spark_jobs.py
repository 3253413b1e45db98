"""A Spark driver that tests/test_spark.py drives: it makes one SparkSession
(the master given on the command line) and then runs the scenarios that its
standard input names, one JSON object a line ({"scenario": NAME, ...}),
answering each with one line "RESULT <json>" on standard output (the ranks'
output, forwarded by hvdmx.spark.run, comes out around it). One driver
serves every test of a cluster, so the JVM, the executors and their Python
workers start once.

    python tests/spark_jobs.py MASTER [KEY=VALUE ...]     # Spark configuration
"""
import contextlib
import io
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))


# ---- what the ranks run (pickled by value: this is __main__) -----------------

def placement():
    import socket
    import hvdmx as hvd
    hvd.init()
    import mxnet as mx
    total = hvd.allreduce(mx.nd.array([hvd.rank() + 1.0]), op=hvd.Sum, name="sum").asnumpy()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
            "cross_size": hvd.cross_size(), "host": socket.gethostname(),
            "sum": float(total[0]), "pid": os.getpid()}


def environment():
    """The rank's place as hvdmx.spark.run gives it (no MXNet: cheap)."""
    import socket
    return {name: int(os.environ["HVDMX_" + name.upper()])
            for name in ("rank", "size", "local_rank", "local_size", "cross_rank",
                         "cross_size")} | {"host": socket.gethostname(),
                                           "key_in_env": "HVDMX_SECRET_KEY" in os.environ}


def share():
    import hvdmx.spark
    data = hvdmx.spark.rank_data()
    ids, pairs = hvdmx.spark.rank_arrays("id", "pair")
    return {"rank": int(os.environ["HVDMX_RANK"]), "columns": list(data),
            "ids": ids.tolist(), "pair_shape": list(pairs.shape),
            "pairs_ok": bool((pairs[:, 1] == 2 * ids).all()) if len(ids) else True}


def raise_on(rank_that_raises):
    rank = int(os.environ["HVDMX_RANK"])
    if rank == rank_that_raises:
        raise ValueError(f"rank {rank} fails on purpose")
    time.sleep(300)  # the driver must stop this rank
    return rank


def returns_then_fails(marker_dir, num_proc):
    """Returns the rank; then, once every rank has sent its value (each marks
    that at its exit, after the send), exits with status 3: so that which
    rank's failure Spark sees first never keeps another rank's value from
    reaching the driver, which would be a different (and also right) error."""
    import atexit
    rank = int(os.environ["HVDMX_RANK"])

    def exit_when_all_returned():
        open(os.path.join(marker_dir, f"returned{rank}"), "w").close()
        deadline = time.monotonic() + 60
        while len(os.listdir(marker_dir)) < num_proc and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(3)

    atexit.register(exit_when_all_returned)
    return rank


def wait_forever(marker_dir):
    rank = int(os.environ["HVDMX_RANK"])
    with open(os.path.join(marker_dir, f"rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
    return rank


def horovod_placement():
    """placement(), written for Horovod: under hvdmx.as_horovod (the driver
    installed it), the ranks run under it too."""
    import socket
    import horovod.mxnet as hvd
    hvd.init()
    import mxnet as mx
    total = hvd.allreduce(mx.nd.array([hvd.rank() + 1.0]), op=hvd.Sum, name="sum").asnumpy()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
            "cross_size": hvd.cross_size(), "host": socket.gethostname(),
            "sum": float(total[0]), "hvd": hvd.__name__}


# ---- the scenarios ------------------------------------------------------------

def run_scenario(spark, request):
    import hvdmx.spark
    name = request["scenario"]
    env = {"HVDMX_SPARK_TEST_MARK": request.get("mark", "none")}
    num_proc = request.get("num_proc", 2)
    if name == "placement":
        return hvdmx.spark.run(placement, num_proc=num_proc, env=env)
    if name == "environment":
        return hvdmx.spark.run(environment, num_proc=num_proc, env=env)
    if name == "share":
        frame = spark.range(request["rows"]).selectExpr("id", "array(id, id * 2) as pair")
        return hvdmx.spark.run(share, num_proc=num_proc, env=env, data=frame)
    if name == "ragged":
        frame = spark.range(request["rows"]).selectExpr("id", "sequence(0, id) as ragged")
        return hvdmx.spark.run(share, num_proc=num_proc, env=env, data=frame)
    if name == "returns_then_fails":
        return hvdmx.spark.run(returns_then_fails, args=(request["marker_dir"], num_proc),
                               num_proc=num_proc, env=env)
    if name == "raises":
        return hvdmx.spark.run(raise_on, args=(request["rank"],), num_proc=num_proc, env=env)
    if name == "unplaceable":
        return hvdmx.spark.run(placement, num_proc=num_proc, env=env,
                               start_timeout=request["start_timeout"])
    if name == "lost":
        return hvdmx.spark.run(wait_forever, args=(request["marker_dir"],), num_proc=num_proc,
                               env=env)
    if name == "horovod":
        import hvdmx.as_horovod
        hvdmx.as_horovod.install()
        import horovod.spark
        return horovod.spark.run(horovod_placement, num_proc=num_proc, env=env)
    if name == "digits":
        import spark_digits
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = spark_digits.main(request["argv"])
        return {"code": code, "stdout": out.getvalue()}
    if name == "executors":
        # Executors registered (the driver's own entry excluded).
        return spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1
    raise ValueError(f"no scenario {name!r}")


def main(argv):
    from pyspark.sql import SparkSession
    builder = SparkSession.builder.master(argv[0]).appName("hvdmx tests")
    for item in argv[1:]:
        name, _, value = item.partition("=")
        builder = builder.config(name, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    print("RESULT " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        started = time.monotonic()
        try:
            answer = {"value": run_scenario(spark, request)}
        except BaseException as error:  # reported to the test, which judges it
            answer = {"error": type(error).__name__, "message": str(error),
                      "cause": str(error.__cause__) if error.__cause__ else None,
                      "traceback": traceback.format_exc()}
        answer["seconds"] = time.monotonic() - started
        print("RESULT " + json.dumps(answer), flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
