"""Runs tests/parallel on N ranks under a launcher, for tests/run_all.sh, so
that a failure hides nothing (issue 59).

A test that fails on one rank aborts the whole job (tests/parallel/conftest.py):
the other ranks would otherwise wait for a collective that will not come. The
tests after it would then go unrun, and the run's count would say nothing of
the tests before it. So every rank writes what it runs as it goes
(tests/parallel/progress.py), and when the job ends badly this program starts
it again with the test after the one it stopped at, until the last test has
run, the restarts (--max-restarts) are spent or the run's time is up. It
prints where each job stopped, the tail of the other ranks' logs, and at the
end writes LOGS/LABEL.results.json, which run_all.sh's summary reads:

    {"passed": P, "failed": F, "skipped": S, "unfinished": U, "not_run": R,
     "collected": N, "failed_tests": [...], "stops": ["stopped at test K of N ..."]}

A test counts as passed (or skipped) when every rank reported it so, failed
when any rank failed it or it was the test running when a job died (a hang
the timeout ended, a crash), unfinished when some ranks never reported it.
The exit status is the first failed job's (0 if none failed).

    python tests/run_parallel.py --label n2 --ranks 2 --logs DIR -- mpiexec -n 2
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every rank runs pytest: rank 0 prints to the terminal, the others write to
# a log, which is printed when the job fails; each writes a JUnit report of
# its own (each test's time) beside its progress file.
RANK_WRAPPER = r'''
rank=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${HVDMX_RANK:-0}}}}
logs=$1; label=$2; prefix=$3; shift 3
if [[ $rank == 0 ]]; then
  exec "$@" --junitxml="$prefix.rank$rank.xml"
fi
exec "$@" --junitxml="$prefix.rank$rank.xml" >>"$logs/$label.rank$rank.log" 2>&1
'''


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="the run's name in the summary (n2)")
    parser.add_argument("--ranks", type=int, required=True, help="the job's rank count")
    parser.add_argument("--logs", required=True, help="directory for logs and results")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the ranks")
    parser.add_argument("--tests", default="tests/parallel", help="the tests to run")
    parser.add_argument("--test-timeout", type=float, default=120,
                        help="seconds one test may take, per rank")
    parser.add_argument("--run-timeout", type=float, default=1200,
                        help="seconds all of this run's jobs may take together")
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="jobs started again after a failure, at most")
    parser.add_argument("launcher", nargs="+", help="the launcher's words (after --)")
    return parser.parse_args(argv)


def read_progress(prefix, ranks):
    """({rank: [(event, nodeid), ...]}) of one job's progress files."""
    events = {}
    for rank in range(ranks):
        try:
            with open(f"{prefix}.rank{rank}.progress") as f:
                lines = [line.rstrip("\n").split("\t", 1) for line in f]
        except FileNotFoundError:
            continue
        events[rank] = [tuple(line) for line in lines if len(line) == 2]
    return events


def run_job(args, prefix, resume_after, deadline):
    """Runs one job; returns its exit code (124 if it ran out of time)."""
    env = dict(os.environ, HVDMX_TEST_PROGRESS=prefix)
    env.pop("HVDMX_TEST_RESUME_AFTER", None)
    if resume_after:
        env["HVDMX_TEST_RESUME_AFTER"] = resume_after
    command = list(args.launcher) + [
        "bash", "-c", RANK_WRAPPER, "rank-wrapper", args.logs, args.label, prefix,
        args.python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
        f"--timeout={args.test_timeout:g}", "--timeout-method=thread", "--hypothesis-seed=0",
        args.tests]
    # The launcher and its ranks in a group of their own, ended together.
    job = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        return job.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGTERM)
        try:
            job.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        return 124


class Tally:
    """The outcome of every test on every rank, over all of a run's jobs."""

    def __init__(self, ranks):
        self.ranks = ranks
        self.order = []  # the collected tests, in their order (the first job's)
        self.outcomes = {}  # nodeid -> {rank: outcome}
        self.died_in = set()  # tests that were running when a job died
        self.stops = []

    def add_job(self, events):
        """Takes one job's events; returns where it stopped: the index of the
        first test any rank failed, else of the first test a rank began and
        never ended (the one it hung or died in), else of the last test any
        rank began (None if it began none)."""
        if not self.order:
            first = events.get(0) or next(iter(events.values()), [])
            self.order = [nodeid for event, nodeid in first if event == "item"]
        index = {nodeid: i for i, nodeid in enumerate(self.order)}
        failed, cut_short = [], []
        last_started = -1
        job = {}
        for rank, lines in events.items():
            running = None
            for event, nodeid in lines:
                if nodeid not in index:
                    continue
                if event == "start":
                    last_started = max(last_started, index[nodeid])
                    running = index[nodeid]
                elif event in ("passed", "failed", "skipped"):
                    job.setdefault(nodeid, {})[rank] = event
                    running = None
                    if event == "failed":
                        failed.append(index[nodeid])
            if running is not None:
                cut_short.append(running)
        stop = min(failed or cut_short or [last_started])
        stop = None if stop < 0 else stop
        for nodeid, by_rank in job.items():
            # Tests after the stop that some rank ran run again in the next job.
            if stop is None or index[nodeid] <= stop:
                self.outcomes.setdefault(nodeid, {}).update(by_rank)
        return stop

    def counts(self):
        counts = dict.fromkeys(("passed", "failed", "skipped", "unfinished", "not_run"), 0)
        failed_tests = []
        for nodeid in self.order:
            by_rank = self.outcomes.get(nodeid, {})
            outcomes = set(by_rank.values())
            if "failed" in outcomes or nodeid in self.died_in:
                counts["failed"] += 1
                failed_tests.append(nodeid)
            elif not by_rank:
                counts["not_run"] += 1
            elif len(by_rank) < self.ranks:
                counts["unfinished"] += 1
            elif outcomes == {"skipped"}:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
        return dict(counts, collected=len(self.order), failed_tests=failed_tests,
                    stops=self.stops)


def print_rank_logs(args):
    for rank in range(1, args.ranks):
        path = os.path.join(args.logs, f"{args.label}.rank{rank}.log")
        print(f"---- {' '.join(args.launcher)}, rank {rank}: {path}")
        try:
            with open(path, errors="replace") as f:
                print("".join(f.readlines()[-60:]), end="")
        except FileNotFoundError:
            print("(no log)")


def main(argv=None):
    args = parse_args(argv)
    deadline = time.monotonic() + args.run_timeout
    tally = Tally(args.ranks)
    first_failure = 0
    resume_after = None
    for job_number in range(args.max_restarts + 1):
        prefix = os.path.join(args.logs, f"{args.label}.job{job_number}")
        rc = run_job(args, prefix, resume_after, deadline)
        stop = tally.add_job(read_progress(prefix, args.ranks))
        if rc == 0:
            break
        first_failure = first_failure or rc
        print_rank_logs(args)
        if stop is None:
            break  # it ran no test: nothing to resume after
        nodeid = tally.order[stop]
        if not set(tally.outcomes.get(nodeid, {}).values()) & {"failed"}:
            tally.died_in.add(nodeid)  # a hang the timeout ended, or a crash
        note = f"stopped at test {stop + 1} of {len(tally.order)} ({nodeid}; exit {rc})"
        tally.stops.append(note)
        left = len(tally.order) - stop - 1
        if left == 0:
            break
        if job_number == args.max_restarts or time.monotonic() >= deadline:
            tally.stops.append(f"{left} tests not run: "
                               + ("the restarts are spent" if job_number == args.max_restarts
                                  else "the run's time is up"))
            break
        print(f"== {args.label}: {note}; the job starts again with the {left} after it",
              flush=True)
        resume_after = nodeid
    with open(os.path.join(args.logs, f"{args.label}.results.json"), "w") as f:
        json.dump(tally.counts(), f, indent=1)
    return first_failure


if __name__ == "__main__":
    sys.exit(main())
