#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang, AddressSanitizer
# (leak detection on) and UndefinedBehaviorSanitizer, writes their seed
# corpora with the library itself, and runs each target for a fixed time.
# Exits non-zero when any target finds a crash, a sanitizer report, a leak,
# an OOM or a timeout; the input that did it is in BUILD_DIR/artifacts/.
#
# Usage: bash scripts/run_fuzzers.sh [seconds-per-target] [build-dir]
#        (defaults: 60, build-san, the build scripts/build_sanitizers.sh
#        shares with the sanitizer tests); the targets run one per core
# FUZZ_SEED=n fixes libFuzzer's mutation sequence (the test command uses 1, so
# a commit's result does not hang on the luck of one run); unset or 0 draws a
# new seed each run, which is what long exploratory runs want.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS="${1:-60}"
BUILD_DIR="${2:-build-san}"
start=$(date +%s)
bash scripts/build_sanitizers.sh "$BUILD_DIR"
echo "run_fuzzers: build took $(( $(date +%s) - start )) s"
TARGETS=(fuzz_read_index fuzz_factory fuzz_trace fuzz_gguf)

# one target per core at a time (each is single-threaded); counted before
# OMP_NUM_THREADS=1 below, which nproc would report instead
JOBS=$(nproc)
# One thread everywhere: reproducible runs, and no OpenMP / BLAS pools per input.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
export ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"

CORPUS="$BUILD_DIR/corpus"
ARTIFACTS="$BUILD_DIR/artifacts"
LOGS="$BUILD_DIR/fuzz_logs"
mkdir -p "$CORPUS" "$ARTIFACTS" "$LOGS"
# seeds are added to the corpus (which keeps what earlier runs found)
"$BUILD_DIR/tests/fuzz/kvindex_fuzz_make_seeds" "$CORPUS" 2>"$LOGS/make_seeds.log"

# target -> max input length (bytes) and dictionary
declare -A MAX_LEN=([fuzz_read_index]=32768 [fuzz_factory]=256 [fuzz_trace]=4096 [fuzz_gguf]=4096)
declare -A DICT=([fuzz_factory]=tests/fuzz/factory.dict [fuzz_trace]=tests/fuzz/trace.dict)

failed=()
summary=()
run_target() { # target -> exit status; its log in $LOGS
  local t=$1 corpus="$CORPUS/${1#fuzz_}" log="$LOGS/$1.log"
  local args=(-max_total_time="$SECS" -rss_limit_mb=2048 -timeout=30 -max_len="${MAX_LEN[$t]}"
              -print_final_stats=1 -artifact_prefix="$ARTIFACTS/$t-" -seed="${FUZZ_SEED:-0}")
  [ -n "${DICT[$t]:-}" ] && args+=(-dict="${DICT[$t]}")
  "$BUILD_DIR/tests/fuzz/$t" "${args[@]}" "$corpus" >"$log" 2>&1
}
for ((b = 0; b < ${#TARGETS[@]}; b += JOBS)); do
  batch=("${TARGETS[@]:b:JOBS}")
  pids=()
  t0=$(date +%s)
  for t in "${batch[@]}"; do
    echo "run_fuzzers: $t for $SECS s (log: $LOGS/$t.log)"
    run_target "$t" &
    pids+=($!)
  done
  for ((i = 0; i < ${#batch[@]}; i++)); do
    t=${batch[$i]}
    rc=0
    wait "${pids[$i]}" || rc=$?
    secs=$(( $(date +%s) - t0 ))
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$LOGS/$t.log" | tail -n 1)
    if [ "$rc" -eq 0 ]; then
      summary+=("$t: ${execs:-?} executions in $secs s, no crash")
    else
      failed+=("$t")
      summary+=("$t: FAILED (exit $rc) after ${execs:-?} executions in $secs s; see $LOGS/$t.log and $ARTIFACTS/")
      echo "---- $t: last lines of $LOGS/$t.log" >&2
      tail -n 60 "$LOGS/$t.log" >&2
    fi
  done
done

echo "run_fuzzers: summary (total $(( $(date +%s) - start )) s)"
printf '  %s\n' "${summary[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "run_fuzzers: ${#failed[@]} target(s) failed: ${failed[*]}" >&2
  echo "run_fuzzers: reproduce with $BUILD_DIR/tests/fuzz/<target> $ARTIFACTS/<target>-crash-..." >&2
  exit 1
fi
