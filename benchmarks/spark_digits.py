"""hvdmx.spark.run against hvdmxrun --no-mpi on the same two test hosts
(docs/benchmarks.md, "Training from Spark"): the digits at 2 ranks, one per
host, 8 epochs of 22 steps of 32 x 2.

    python benchmarks/spark_digits.py --rounds 3

Brings up two test hosts (tools/testhosts.py) and a standalone Spark cluster
on them (tests/spark_cluster.py: master and a worker on host 1, a worker on
host 2, one core each, the driver on host 1), then, in turns, each round:
examples/spark_digits.py through that driver (the seconds from the call of
hvdmx.spark.run to the end of the first allreduce, and rank 0's epoch
times), and examples/mnist_gluon.py under hvdmxrun --no-mpi started on host
1 (rank 0's epoch times); and, first, a run of a function that returns at
once (no MXNet, no data: the cost of Spark's job, the bootstrap and the
function job). Prints every round and the medians; epoch 0 is
left out of the epoch medians (it holds MXNet's first-call costs).
Needs root (the test hosts) and `make spark`.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "tools"), os.path.join(REPO, "tests")]
import testhosts  # noqa: E402
from spark_cluster import ENV, PYTHON, Cluster, spark_missing  # noqa: E402


def spark_round(cluster, epochs):
    answer = cluster.driver.ask(scenario="digits", timeout=600,
                                argv=["--num-proc", "2", "--epochs", str(epochs)])
    out = answer["value"]["stdout"]
    first = float(re.search(r"first allreduce ([\d.]+) s", out).group(1))
    epochs_s = [float(x) for x in re.search(r"epoch seconds \(rank 0\) ([\d. ]+)", out)
                .group(1).split()]
    accuracy = float(re.search(r"test accuracy ([\d.]+)", out).group(1))
    return first, epochs_s, accuracy, answer["seconds"]


def trivial_round(cluster):
    """Seconds of a run whose ranks return at once (no MXNet, no data): what
    Spark, the bootstrap and the function job cost before any training."""
    answer = cluster.driver.ask(scenario="environment", num_proc=2)
    assert "value" in answer, answer
    return answer["seconds"]


def nompi_round(hosts, epochs):
    argv = [PYTHON, "-m", "hvdmx.run", "--no-mpi", "-np", "2", "-H",
            f"{hosts.hosts[0]}:1,{hosts.hosts[1]}:1", "--ssh-exec", hosts.launcher,
            PYTHON, "examples/mnist_gluon.py", "--epochs", str(epochs)]
    result = subprocess.run(hosts.command("h1", argv), cwd=REPO, env=hosts.env(ENV),
                            capture_output=True, text=True, timeout=600)
    text = result.stdout + result.stderr
    if result.returncode:
        raise RuntimeError(f"hvdmxrun --no-mpi failed:\n{text[-3000:]}")
    epochs_s = [float(x) for x in re.findall(r"Epoch\[\d+\] Time cost=([\d.]+)", text)]
    accuracy = float(re.search(r"test accuracy ([\d.]+)", text).group(1))
    return epochs_s, accuracy


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    reason = spark_missing() or testhosts.unavailable()
    if reason:
        sys.exit(reason)
    firsts, trivials, spark_epochs, nompi_epochs = [], [], [], []
    with testhosts.hosts(2) as hosts, tempfile.TemporaryDirectory(prefix="hvdmx-spark-") as d:
        cluster = Cluster(hosts, d)
        try:
            cluster.start()
            for index in range(args.rounds):
                trivials.append(trivial_round(cluster))
                print(f"round {index} spark: a run of a function that returns at once "
                      f"{trivials[-1]:.2f} s", flush=True)
                first, epochs, accuracy, seconds = spark_round(cluster, args.epochs)
                firsts.append(first)
                spark_epochs += epochs[1:]
                print(f"round {index} spark: first allreduce {first:.2f} s, epochs "
                      f"{' '.join(f'{e:.3f}' for e in epochs)}, accuracy {accuracy:.4f}, "
                      f"run {seconds:.1f} s", flush=True)
                epochs, accuracy = nompi_round(hosts, args.epochs)
                nompi_epochs += epochs[1:]
                print(f"round {index} hvdmxrun --no-mpi: epochs "
                      f"{' '.join(f'{e:.3f}' for e in epochs)}, accuracy {accuracy:.4f}",
                      flush=True)
        finally:
            cluster.stop()
    print(f"median: a run returning at once {statistics.median(trivials):.2f} s; "
          f"first allreduce {statistics.median(firsts):.2f} s after hvdmx.spark.run; "
          f"epoch {statistics.median(spark_epochs):.3f} s under Spark, "
          f"{statistics.median(nompi_epochs):.3f} s under hvdmxrun --no-mpi")


if __name__ == "__main__":
    main()
