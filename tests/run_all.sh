#!/usr/bin/env bash
# Runs the whole test suite: the single-process tests, then tests/parallel under
# mpiexec -n 1, 2, 3 and 4 (HVDMX_TEST_RANKS; the run on one rank starts beside
# the single-process tests' last shard) and under hvdmxrun --no-mpi. Exits
# non-zero if anything failed, hung or crashed, and ends with one line for CI:
# "N passed, N failed" (all runs added up; a multi-rank test counts once, as
# failed if it failed on any rank).
#
# Under mpiexec every rank runs pytest; rank 0 prints to the terminal and the other
# ranks write to a log in a temporary directory, printed when a run fails.
#
# Environment (all optional):
#   PYTHON                  interpreter with hvdmx installed  (default: .venv/bin/python)
#   MPIEXEC                 launcher  (default: mpiexec beside PYTHON, else on PATH)
#   MPIEXEC_FLAGS           extra launcher flags  (default: none)
#   HVDMX_TEST_TIMEOUT      seconds one test may take, per rank  (default: 120)
#   HVDMX_TEST_RUN_TIMEOUT  seconds one pytest run (one mpiexec) may take  (default: 1200)
#   HVDMX_TEST_RANKS        rank counts to run tests/parallel with  (default: "1 2 3 4");
#                           the tests hold at any count, e.g. "5 8" (slower: oversubscribed)
#   HVDMX_TEST_NOMPI_RANKS  ranks of the run of tests/parallel under hvdmxrun --no-mpi
#                           (default: 2; empty: no such run)
#   HVDMX_TEST_KEEP_LOGS    1: keep the logs and JUnit reports (each test's time) also
#                           when everything passed (their directory is printed at the end)
set -uo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
if [[ -z ${MPIEXEC:-} ]]; then
  MPIEXEC=$(dirname "$PYTHON")/mpiexec
  [[ -x $MPIEXEC ]] || MPIEXEC=mpiexec
fi
read -r -a mpiexec_flags <<<"${MPIEXEC_FLAGS:-}"
test_timeout=${HVDMX_TEST_TIMEOUT:-120}
run_timeout=${HVDMX_TEST_RUN_TIMEOUT:-1200}
read -r -a rank_counts <<<"${HVDMX_TEST_RANKS:-1 2 3 4}"
nompi_ranks=${HVDMX_TEST_NOMPI_RANKS-2}
if [[ -n $nompi_ranks && ! $nompi_ranks =~ ^[1-9][0-9]*$ ]]; then
  echo "hvdmx tests: HVDMX_TEST_NOMPI_RANKS='$nompi_ranks' must be a rank count (a whole" \
    "number >= 1), or empty for no run without MPI" >&2
  exit 2
fi
# An empty list (only spaces) is checked as the word "none", and fails.
for n in "${rank_counts[@]:-none}"; do
  if [[ ! $n =~ ^[1-9][0-9]*$ ]]; then
    echo "hvdmx tests: HVDMX_TEST_RANKS='${HVDMX_TEST_RANKS:-}' must list rank counts (whole" \
      "numbers >= 1) separated by spaces, e.g. '1 2 3 4' or '5 8'" >&2
    exit 2
  fi
done

# One engine worker thread and one OpenMP thread per rank: up to 4 ranks share
# the machine, and the results must not depend on thread scheduling.
export OMP_NUM_THREADS=1 MXNET_CPU_WORKER_NTHREADS=1 MXNET_ENGINE_TYPE=ThreadedEnginePerDevice

# Bytecode is written and read again: every test process (hundreds of them,
# ranks and subprocesses) would otherwise compile hvdmx's modules anew, and
# each rank of tests/parallel would rewrite its test files' asserts anew (issue 50).
unset PYTHONDONTWRITEBYTECODE

logs=$(mktemp -d "${TMPDIR:-/tmp}/hvdmx-tests.XXXXXX")
status=0
runs=()

# Records a run's label, rank count, exit code and duration (from $started to
# ENDED, by default now). Any exit code but 0 fails the suite, pytest's 5 (no
# tests collected) too: a run that collected nothing tested nothing.
# Usage: finish_run LABEL N RC [ENDED]
finish_run() {
  local label=$1 nranks=$2 rc=$3 ended=${4:-$SECONDS}
  runs+=("$label:$nranks:$rc:$((ended - started))")
  if ((rc != 0)); then
    status=1
    if ((rc == 124 || rc == 137)); then
      echo "hvdmx tests: $label exceeded ${run_timeout}s and was killed" >&2
    fi
  fi
}

# Runs tests/parallel on N ranks under a launcher and records the run as LABEL:
# tests/run_parallel.py, which starts the job again after the test a failure
# stopped it at, so that a failing test hides no other (see that file).
# Usage: run_parallel LABEL N LAUNCHER-WORDS... (the launcher takes a command).
run_parallel() {
  local label=$1 n=$2
  shift 2
  echo "== $*: pytest tests/parallel"
  started=$SECONDS
  "$PYTHON" tests/run_parallel.py --label "$label" --ranks "$n" --logs "$logs" \
    --python "$PYTHON" --test-timeout "$test_timeout" --run-timeout "$run_timeout" -- "$@"
  finish_run "$label" "$n" $?
}

# The single-process tests run as two pytest processes at once, because
# most of their time is spent starting processes (MPI jobs, MXNet imports,
# test hosts) rather than computing, and one of them alone keeps about one of
# the two cores busy. Shard "a" holds the files that make test hosts (which
# must not overlap) or whose jobs are the longest, balanced by the times of a
# whole run; "b" everything else, so a new file lands there. Shard b's output
# is printed when it ends.
shard_a=(tests/test_many_hosts.py tests/test_elastic_jobs.py tests/test_testhosts.py tests/test_tcp_transport.py
  tests/test_timeline.py tests/test_tcp_comm.py tests/test_shm_process_exit.py tests/test_one_mpi.py
  tests/test_horovod_programs.py tests/test_as_horovod.py tests/test_spark.py
  tests/test_peer_input_tcp.py tests/test_mpi_operator.py)
ignore_a=()
for file in "${shard_a[@]}"; do ignore_a+=(--ignore="$file"); done
echo "== single process: pytest tests (without tests/parallel), two shards at once"
started=$SECONDS
serial_started=$started
# Shard b notes its exit code and when it ended, for its line of the summary.
{
  timeout -k 10 "$run_timeout" "$PYTHON" -m pytest -q --timeout="$test_timeout" \
    -p no:cacheprovider --ignore=tests/parallel "${ignore_a[@]}" --junitxml="$logs/serial-b.rank0.xml" tests \
    >"$logs/serial-b.log" 2>&1
  echo "$? $SECONDS" >"$logs/serial-b.end"
} &
shard_b=$!
timeout -k 10 "$run_timeout" "$PYTHON" -m pytest -q --timeout="$test_timeout" \
  -p no:cacheprovider --junitxml="$logs/serial-a.rank0.xml" "${shard_a[@]}"
finish_run serial-a 1 $?

# A run on one rank keeps one core busy: while shard b still runs, it takes the
# core that shard a has left (about half a minute earlier here) instead of
# running after both.
ran_early=
if [[ " ${rank_counts[*]} " == *" 1 "* ]] && kill -0 "$shard_b" 2>/dev/null; then
  run_parallel n1 1 "$MPIEXEC" "${mpiexec_flags[@]}" -n 1
  ran_early=1
fi
wait "$shard_b"
rc=124 ended=$SECONDS  # no note: the shard was killed before it could write one
[[ -s $logs/serial-b.end ]] && read -r rc ended <"$logs/serial-b.end"
echo "== single process, shard b (the other files)"
cat "$logs/serial-b.log"
started=$serial_started
finish_run serial-b 1 "$rc" "$ended"

for n in "${rank_counts[@]}"; do
  [[ $n == 1 && -n $ran_early ]] && continue
  run_parallel "n$n" "$n" "$MPIEXEC" "${mpiexec_flags[@]}" -n "$n"
done

# The same suite in a job that hvdmxrun starts without MPI (--no-mpi): hvd.init
# over the launcher's rendezvous, TCP and shared memory only (docs/running.md).
if [[ -n $nompi_ranks ]]; then
  run_parallel "nompi$nompi_ranks" "$nompi_ranks" "$(dirname "$PYTHON")/hvdmxrun" --no-mpi \
    -np "$nompi_ranks"
fi

if ((status != 0)); then
  printf '\nhvdmx tests: FAILED; JUnit reports and the logs of ranks > 0 are in %s\n' "$logs"
elif [[ ${HVDMX_TEST_KEEP_LOGS:-} == 1 ]]; then
  printf '\nhvdmx tests: JUnit reports and the logs of ranks > 0 are in %s\n' "$logs"
fi

# Adds up the results. A multi-rank run's are tests/run_parallel.py's
# LABEL.results.json; a single-process run's its JUnit report, where a test is
# failed if it failed or errored. A run that ended badly without a failing
# test on record counts as one failure.
# Each run's line ends with its time; then the whole suite's time; the last
# line printed is the total.
"$PYTHON" - "$logs" "$SECONDS" "${runs[@]}" <<'EOF'
import json
import os
import sys
import xml.etree.ElementTree as ET

logs, elapsed = sys.argv[1], int(sys.argv[2])
runs = [run.split(":") for run in sys.argv[3:]]
total = {"passed": 0, "failed": 0, "skipped": 0}
notes = {5: " (no tests collected)", 124: " (timed out)", 137: " (killed)"}


def junit_counts(label):
    counts = dict.fromkeys(total, 0)
    try:
        cases = list(ET.parse(os.path.join(logs, f"{label}.rank0.xml")).getroot()
                     .iter("testcase"))
    except (OSError, ET.ParseError):  # none, or cut off by a kill while writing it
        cases = []
    for case in cases:
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


for label, nranks, rc, seconds in runs:
    rc = int(rc)
    try:
        with open(os.path.join(logs, f"{label}.results.json")) as f:
            results = json.load(f)
    except FileNotFoundError:
        results = dict(junit_counts(label), unfinished=0, not_run=0, stops=[],
                       failed_tests=[])
    counts = {k: results[k] for k in total}
    if rc != 0 and counts["failed"] == 0:
        counts["failed"] = 1
    line = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "skipped"))
    if results["unfinished"]:
        line += f", {results['unfinished']} not reported by every rank"
    if results["not_run"]:
        line += f", {results['not_run']} not run"
    print(f"{label:>7}: {line}; exit {rc}{notes.get(rc, '')}; {seconds}s")
    for note in results["stops"]:
        print(f"{'':>9}{note}")
    for nodeid in results["failed_tests"]:
        print(f"{'':>9}FAILED {nodeid}")
    for k in total:
        total[k] += counts[k]
print(f"{'all':>7}: {elapsed}s (serial-a and serial-b side by side, n1 beside serial-b once "
      "serial-a has ended, then each other run)")
print(f"{total['passed']} passed, {total['failed']} failed")
EOF
(($? == 0)) || status=1

[[ ${HVDMX_TEST_KEEP_LOGS:-} == 1 ]] || ((status != 0)) || rm -rf "$logs"
exit "$status"
