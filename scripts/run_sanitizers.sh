#!/usr/bin/env bash
# The library's tests under AddressSanitizer (leaks included) and
# UndefinedBehaviorSanitizer: any report fails the run. Part of the test
# command (scripts/run_tests.sh). Both binaries run as gtest shards, four
# per core, a core's worth at a time (with one shard per core the slow tests
# fell unevenly: 291 s against 197 s in one run). Usage:
# bash scripts/run_sanitizers.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${1:-build-san}"
bash scripts/build_sanitizers.sh "$BUILD_DIR"

# halt at the first report; UBSan prints its stack. OpenBLAS's own threads
# would spin in sched_yield beside the slow instrumented code: one thread
# (BLAS is not instrumented, and kvindex's parallel loops keep theirs).
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
export OPENBLAS_NUM_THREADS=1
# the shards run at once: OpenMP threads sleep at barriers instead of
# spinning on the cores the other shard needs
export OMP_WAIT_POLICY=passive
# every allocation of every write failed in turn: nothing may leak on the way
# out, but for Faiss's own builders (see the suppressions file)
export LSAN_OPTIONS="suppressions=$PWD/tests/lsan_faiss_throw.supp:print_suppressions=0"
LOGS="$BUILD_DIR/sanitizer_logs"
mkdir -p "$LOGS"
JOBS=$(nproc)
SHARDS=$((4 * JOBS))
# one shard: its log, and its exit status in a file (xargs would only say
# that some shard failed)
run_shard() {
  local binary=$1 i=$2 rc=0
  GTEST_TOTAL_SHARDS=$SHARDS GTEST_SHARD_INDEX=$i \
    "$BUILD_DIR/tests/$binary" --gtest_brief=1 >"$LOGS/$binary.$i.log" 2>&1 || rc=$?
  echo "$rc" >"$LOGS/$binary.$i.rc"
}
export -f run_shard
export BUILD_DIR LOGS SHARDS
rm -f "$LOGS"/*.rc
for binary in kvindex_tests kvindex_fault_tests; do
  for ((i = 0; i < SHARDS; i++)); do
    echo "$binary $i"
  done
done | xargs -P "$JOBS" -n 2 bash -c 'run_shard "$@"' _
failed=()
for binary in kvindex_tests kvindex_fault_tests; do
  passed=0
  skipped=0
  for ((i = 0; i < SHARDS; i++)); do
    log="$LOGS/$binary.$i.log"
    if [ "$(cat "$LOGS/$binary.$i.rc" 2>/dev/null)" = 0 ]; then
      # (a shard without a SKIPPED line: grep finds nothing, not an error)
      n=$(grep -E '^\[  PASSED  \]' "$log" | tail -n 1 | grep -oE '[0-9]+' | head -n 1 || true)
      passed=$((passed + ${n:-0}))
      n=$(grep -E '^\[  SKIPPED \]' "$log" | tail -n 1 | grep -oE '[0-9]+' | head -n 1 || true)
      skipped=$((skipped + ${n:-0}))
    else
      failed+=("$binary shard $i")
      echo "---- $binary shard $i/$SHARDS failed; last lines of $log" >&2
      grep -v '^WARNING clustering' "$log" | tail -n 60 >&2
    fi
  done
  echo "run_sanitizers: $binary: $passed tests passed, $skipped skipped, in $SHARDS shards"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "run_sanitizers: failed: ${failed[*]}" >&2
  exit 1
fi
