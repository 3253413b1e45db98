#!/usr/bin/env bash
# Runs tests against hvdmx's C++ core built with a sanitizer, in a scratch copy of
# this checkout (its files as git lists them: tracked, and untracked but not
# ignored), so the normal build in hvdmx/ is left alone.
#
#   bash tests/sanitize.sh address     # AddressSanitizer, the whole suite (tests/run_all.sh)
#   bash tests/sanitize.sh undefined   # UndefinedBehaviorSanitizer, the whole suite
#   bash tests/sanitize.sh thread      # ThreadSanitizer, the tests that run whole runtimes
#                                      # and the comms one rank per thread in one process
#                                      # (no MPI)
#
# Exits non-zero if a test failed or the sanitizer reported anything, and prints the
# reports' summaries; the reports stay in the directory it names. Run `make test`
# once first: this uses its .venv (and the programs it installs for the suite).
#
# Why ThreadSanitizer runs only the in-process tests: MXNet and MPICH are not
# built with it, so it cannot see how they order memory between threads (MXNet's
# engine hands an op's arrays and callbacks from thread to thread). Under mpiexec
# it reports those hand-offs as races; in the in-process tests every thread and
# every lock is ours.
#
# Environment (all optional):
#   CXX                     compiler that knows where its sanitizer runtimes are
#                           (default: g++)
#   HVDMX_TEST_TIMEOUT      seconds one test may take, per rank (default here: 400;
#                           instrumented code runs slower)
#   HVDMX_TEST_RUN_TIMEOUT  seconds one pytest run may take (default here: 3000)
set -uo pipefail

mode=${1:-}
case $mode in
  address) lib=libasan.so options=ASAN_OPTIONS report=asan ;;
  undefined) lib=libubsan.so options=UBSAN_OPTIONS report=ubsan ;;
  thread) lib=libtsan.so options=TSAN_OPTIONS report=tsan ;;
  *)
    echo "usage: bash tests/sanitize.sh address|undefined|thread" >&2
    exit 2
    ;;
esac

root=$(cd "$(dirname "$0")/.." && pwd)
if [[ ! -x $root/.venv/bin/python ]]; then
  echo "tests/sanitize.sh: $root/.venv does not exist; run 'make test' first" >&2
  exit 2
fi
cxx=${CXX:-g++}
runtime=$("$cxx" -print-file-name="$lib")
libstdcxx=$("$cxx" -print-file-name=libstdc++.so.6)
if [[ $runtime != /* || $libstdcxx != /* ]]; then
  echo "tests/sanitize.sh: $cxx has no $lib or libstdc++.so.6" \
    "(-print-file-name did not find it); install the compiler's sanitizer runtime" >&2
  exit 2
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/hvdmx-$mode.XXXXXX")
# mktemp makes it 0700; the scratch copy must be readable by the unprivileged
# user that tests/test_testhosts.py runs the harness as.
chmod 755 "$work"
src=$work/src
reports=$work/reports
mkdir -p "$src" "$reports"
echo "== tests/sanitize.sh $mode: scratch copy and reports in $work"
(cd "$root" && git ls-files -z --cached --others --exclude-standard) |
  (cd "$root" && tar --null -T - -cf -) | tar -C "$src" -xf - || exit 1
ln -s "$root/.venv" "$src/.venv"

cd "$src" || exit 1
sanitize="-fsanitize=$mode -fno-omit-frame-pointer -g"
echo "== building hvdmx._core with $sanitize"
CFLAGS="$sanitize" CXXFLAGS="$sanitize" LDFLAGS="-fsanitize=$mode" \
  .venv/bin/python setup.py -q build_ext --inplace --force >"$work/build.log" 2>&1 || {
  tail -n 40 "$work/build.log"
  exit 1
}

# The sanitizer's runtime goes before every other library (AddressSanitizer and
# ThreadSanitizer require it), and libstdc++ with it: Python itself does not
# link libstdc++, and their __cxa_throw interceptor must find the real one when
# it starts.
export LD_PRELOAD="$runtime $libstdcxx"
export HVDMX_TEST_TIMEOUT=${HVDMX_TEST_TIMEOUT:-400}
export HVDMX_TEST_RUN_TIMEOUT=${HVDMX_TEST_RUN_TIMEOUT:-3000}
export OMP_NUM_THREADS=1 MXNET_CPU_WORKER_NTHREADS=1
if [[ $mode == address ]]; then
  # No leak check: Python and MXNet keep memory until exit on purpose.
  value="detect_leaks=0:log_path=$reports/$report"
  run=(bash tests/run_all.sh)
elif [[ $mode == undefined ]]; then
  value="print_stacktrace=1:log_path=$reports/$report"
  run=(bash tests/run_all.sh)
else
  # The mpich wheel's UCX hooks madvise; its hook crashes in a thread that
  # ThreadSanitizer is tearing down. A fixed address layout (setarch -R) keeps
  # ThreadSanitizer's shadow memory clear of the libraries.
  export UCX_MEM_EVENTS=no UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_MALLOC_HOOKS=no
  value="report_signal_unsafe=0:log_path=$reports/$report"
  run=(setarch "$(uname -m)" -R .venv/bin/python -m pytest -q -p no:cacheprovider
    --timeout="$HVDMX_TEST_TIMEOUT" tests/test_negotiation_local.py tests/test_ring_local.py
    tests/test_shm_local.py tests/test_comm_local.py tests/test_tcp_comm.py
    tests/test_tcp_handshake.py tests/test_host_tree.py tests/test_peer_input.py)
fi

# The sanitizer's options hold from here on: the check below is a process under
# it too (with AddressSanitizer's default leak check, Python's own memory at exit
# would fill the log).
export "$options=$value"
# The tests must load the instrumented build, not another hvdmx on the path.
core=$(.venv/bin/python -c 'from hvdmx import _core; print(_core.__file__)')
if [[ $core != "$src"/hvdmx/* ]]; then
  echo "tests/sanitize.sh: 'import hvdmx' from $src loads ${core:-nothing}, not the build" \
    "there; is PYTHONPATH set?" >&2
  exit 1
fi

"${run[@]}"
rc=$?
unset LD_PRELOAD

found=$(find "$reports" -type f | wc -l)
if ((found > 0)); then
  echo "tests/sanitize.sh $mode: $found process(es) reported errors (in $reports):"
  grep -h '^SUMMARY' "$reports"/* | sort | uniq -c
  exit 1
fi
if ((rc != 0)); then
  echo "tests/sanitize.sh $mode: tests failed (exit $rc), no sanitizer reports"
  exit "$rc"
fi
echo "tests/sanitize.sh $mode: tests passed, no sanitizer reports"
