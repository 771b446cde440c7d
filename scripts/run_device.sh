#!/usr/bin/env bash
# On the GPU machine: the GPU tests, the benchmarks, then a compute-sanitizer
# memcheck pass over a fast subset of the tests, from build-device/dist
# (scripts/build_device.sh). Logs and JSON go to $OUT (default /tmp/kvindex-device).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kvindex-device}"
mkdir -p "$OUT"
DIST="${DIST:-build-device/dist}"
status=0
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1; head -15 "$OUT/nvidia-smi.txt"
# one test per process under a time limit, so that a hang costs one test,
# not the lease; TEST_JOBS processes at a time (the tests share the GPU and
# time nothing); TESTS: a gtest filter of the tests to run (default all);
# each test's output in its own log, then one log in list order
mkdir -p "$OUT/tests"
: > "$OUT/gpu_tests_summary.txt"
tests=$("$DIST/kvindex_gpu_tests" --gtest_list_tests --gtest_filter="${TESTS:-*}" |
        awk '/^[^ ]/{suite=$1} /^  /{print suite $1}')
run_one() {
  local t=$1 start rc
  start=$(date +%s%N)
  timeout "${TEST_TIMEOUT:-60}" "$DIST/kvindex_gpu_tests" --gtest_filter="$t" > "$OUT/tests/$t.log" 2>&1
  rc=$?
  printf '%-60s rc=%-3s %7d ms\n' "$t" "$rc" $(( ($(date +%s%N) - start) / 1000000 ))
}
export -f run_one
export DIST OUT TEST_TIMEOUT
printf '%s\n' $tests | xargs -P "${TEST_JOBS:-4}" -I{} bash -c 'run_one "$@"' _ {} \
  | tee -a "$OUT/gpu_tests_summary.txt"
for t in $tests; do cat "$OUT/tests/$t.log"; done > "$OUT/gpu_tests.log"
rm -rf "$OUT/tests"
grep -vq "rc=0 " "$OUT/gpu_tests_summary.txt" && status=1
echo "GPU tests: $(grep -c 'rc=0 ' "$OUT/gpu_tests_summary.txt") of $(printf '%s\n' $tests | wc -l) passed"
grep -E "Failure|error:|Expected|Which is|actual" "$OUT/gpu_tests.log" | head -40
# the benchmarks: BENCHES names which (decode: dense / top-k / SDPA; ivf:
# GpuIndexIVFAsym; lsh: GpuIndexLSHSample; evict: proxy scores), each
# under its own time limit; BENCH=0 runs none
if [ "${BENCH:-1}" = 1 ]; then
  for b in ${BENCHES:-decode ivf lsh evict}; do
    extra="ARGS_$b" # per benchmark: ARGS_ivf="--tokens 131072", ...
    PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-200}" python3 "benchmarks/gpu/bench_$b.py" \
      --lib "$DIST/libkvindex_gpu_capi.so" --json "$OUT/bench_$b.json" ${BENCH_ARGS:-} ${!extra:-} 2>&1 \
      | tee "$OUT/bench_$b.log" || status=1
  done
fi
# memcheck over the fast tests of every kernel family
memcheck_default='GpuFlat.GqaGroup*:GpuFlat.SearchEquals*:GpuFlat.Empty*:GpuTopK.Ties*:GpuTopK.BudgetCovering*:GpuTopK.PerCall*:GpuKVCache.DeviceArrays*:GpuKVCache.BadInput*'
memcheck_default+=':GpuIVFAsym.AllBuckets*:GpuIVFAsym.RoundTrips*:GpuLSH.SmallContextsAndReset:GpuLSH.KernelLayerHeads*:GpuLSH.MinHitsZero*:GpuProxyScores.RowsThatSeeNoKey*:GpuEvict.KnobsAreTheCpuPolicys'
if [ "${SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  timeout "${SANITIZER_TIMEOUT:-90}" compute-sanitizer --tool memcheck --error-exitcode 3 "$DIST/kvindex_gpu_tests" \
    --gtest_filter="${MEMCHECK_FILTER:-$memcheck_default}" \
    > "$OUT/memcheck.log" 2>&1 || status=1
  tail -5 "$OUT/memcheck.log"
fi
exit $status
