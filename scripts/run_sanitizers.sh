#!/usr/bin/env bash
# The library's tests under AddressSanitizer (leaks included) and
# UndefinedBehaviorSanitizer: any report fails the run. Part of the test
# command (scripts/run_tests.sh). Each binary runs as one gtest shard per
# core, at once. Usage: bash scripts/run_sanitizers.sh [build-dir]
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
SHARDS=$(nproc)
failed=()
for binary in kvindex_tests kvindex_fault_tests; do
  pids=()
  for ((i = 0; i < SHARDS; i++)); do
    GTEST_TOTAL_SHARDS=$SHARDS GTEST_SHARD_INDEX=$i \
      "$BUILD_DIR/tests/$binary" --gtest_brief=1 >"$LOGS/$binary.$i.log" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < SHARDS; i++)); do
    if wait "${pids[$i]}"; then
      echo "run_sanitizers: $binary shard $i/$SHARDS: $(grep -E '^\[  PASSED  \]' "$LOGS/$binary.$i.log" | tail -n 1)"
    else
      failed+=("$binary shard $i")
      echo "---- $binary shard $i/$SHARDS failed; last lines of $LOGS/$binary.$i.log" >&2
      grep -v '^WARNING clustering' "$LOGS/$binary.$i.log" | tail -n 60 >&2
    fi
  done
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "run_sanitizers: failed: ${failed[*]}" >&2
  exit 1
fi
