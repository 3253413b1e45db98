"""A Spark for tests/test_spark.py and benchmarks/spark_digits.py: pyspark
from `make spark` (.venv/spark), a driver process running
tests/spark_jobs.py (Driver), and a standalone cluster on test hosts
(tools/testhosts.py; Cluster: the master and a worker on host 1, a worker
on every other host, one core each, the driver on host 1)."""
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
SPARK_DIR = os.path.join(sys.prefix, "spark")  # `make spark` (tests/spark.txt)
SPARK_HOME = os.path.join(SPARK_DIR, "pyspark")
JOBS = os.path.join(REPO, "tests", "spark_jobs.py")
# Small JVMs: Spark's floor for an executor is 450 MB of heap, mostly never touched.
JVM_FLAGS = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Xss1m"
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, SPARK_DIR]), PYSPARK_PYTHON=PYTHON,
           SPARK_HOME=SPARK_HOME, OMP_NUM_THREADS="1", MXNET_CPU_WORKER_NTHREADS="1",
           MXNET_ENGINE_TYPE="ThreadedEnginePerDevice", SPARK_DAEMON_MEMORY="256m",
           SPARK_DAEMON_JAVA_OPTS=JVM_FLAGS, PYTHONUNBUFFERED="1")
SPARK_CONF = ["spark.ui.enabled=false", "spark.driver.memory=512m",
              f"spark.driver.extraJavaOptions={JVM_FLAGS}",
              "spark.executor.memory=512m", f"spark.executor.extraJavaOptions={JVM_FLAGS}",
              f"spark.pyspark.python={PYTHON}",
              f"spark.executorEnv.PYTHONPATH={ENV['PYTHONPATH']}",
              "spark.executorEnv.OMP_NUM_THREADS=1",
              "spark.executorEnv.MXNET_CPU_WORKER_NTHREADS=1",
              "spark.executorEnv.MXNET_ENGINE_TYPE=ThreadedEnginePerDevice",
              "spark.sql.shuffle.partitions=2", "spark.default.parallelism=2"]


def spark_missing():
    if not os.path.isdir(SPARK_HOME):
        return (f"pyspark is not in {SPARK_DIR}: run `make spark` (it installs "
                "tests/spark.txt there)")
    if subprocess.run(["sh", "-c", "command -v java"], capture_output=True).returncode:
        return "no java on PATH: apt-get install openjdk-17-jre-headless (or `make java`)"
    return None


class Driver:
    """tests/spark_jobs.py in a process of its own (in a test host, with
    `command`): ask() sends it a scenario and returns its answer."""

    def __init__(self, argv, cwd):
        self.proc = subprocess.Popen(argv, cwd=cwd, env=ENV, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines = []
        self.results = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._result(180)
        assert ready == {"ready": True}, self.output()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("RESULT "):
                self.results.put(json.loads(line[len("RESULT "):]))
        self.results.put(None)

    def _result(self, timeout):
        try:
            answer = self.results.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the driver gave no answer within {timeout} s:\n"
                                 + self.output()) from None
        assert answer is not None, "the driver ended:\n" + self.output()
        return answer

    def send(self, **request):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def ask(self, timeout=120, **request):
        self.send(**request)
        return self._result(timeout)

    def output(self):
        return "".join(self.lines[-200:])

    def stop(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()



class Cluster:
    def __init__(self, hosts, workdir):
        self.hosts, self.workdir = hosts, workdir
        self.master_address = hosts.address("h1")
        self.daemons = []
        self.driver = None

    def daemon(self, host, argv, name):
        log = open(os.path.join(self.workdir, f"{name}.log"), "w")
        env = dict(ENV, SPARK_LOCAL_IP=self.hosts.address(host),
                   SPARK_WORKER_DIR=os.path.join(self.workdir, f"{name}-work"),
                   SPARK_LOCAL_DIRS=self.workdir, SPARK_LOG_DIR=self.workdir)
        proc = subprocess.Popen(self.hosts.command(host, argv), cwd=self.workdir, env=env,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.daemons.append(proc)

    def start(self):
        spark_class = os.path.join(SPARK_HOME, "bin", "spark-class")
        url = f"spark://{self.master_address}:7077"
        self.daemon("h1", [spark_class, "org.apache.spark.deploy.master.Master", "--host",
                           self.master_address, "--port", "7077", "--webui-port", "8080"],
                    "master")
        for host in self.hosts.hosts:
            self.daemon(host, [spark_class, "org.apache.spark.deploy.worker.Worker", "--host",
                               self.hosts.address(host), "--cores", "1", "--memory", "768m",
                               "--webui-port", "8081", url], f"worker-{host}")
        conf = SPARK_CONF + [f"spark.driver.host={self.master_address}",
                             f"spark.driver.bindAddress={self.master_address}",
                             f"spark.cores.max={len(self.hosts.hosts)}",
                             "spark.executor.cores=1"]
        self.driver = Driver(self.hosts.command("h1", [PYTHON, JOBS, url, *conf]), REPO)
        self.wait_for_executors()

    def wait_for_executors(self):
        """Until every worker's executor has registered with the driver."""
        deadline = time.monotonic() + 120
        while self.driver.ask(scenario="executors")["value"] < len(self.hosts.hosts):
            assert time.monotonic() < deadline, "executors did not register:\n" + self.logs()
            time.sleep(0.5)

    def logs(self):
        out = []
        for name in sorted(os.listdir(self.workdir)):
            if name.endswith(".log"):
                with open(os.path.join(self.workdir, name), errors="replace") as f:
                    out.append(f"--- {name}\n{f.read()[-3000:]}")
        return "\n".join(out) + "\n--- driver\n" + (self.driver.output() if self.driver else "")

    def stop(self):
        if self.driver is not None:
            self.driver.stop()
        for proc in self.daemons:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()

    def executor_pids(self, host):
        """The executor JVMs started by `host`'s worker."""
        needle = f"--hostname\0{self.hosts.address(host)}\0".encode()
        pids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if b"CoarseGrainedExecutorBackend" in cmdline and needle in cmdline:
                pids.append(int(pid))
        return pids
