#!/usr/bin/env bash
# On the GPU machine: the GPU tests (then a compute-sanitizer memcheck pass
# over a fast subset) and the decode benchmark, from build-device/dist
# (scripts/build_device.sh). Logs and JSON go to $OUT (default /tmp/kvindex-device).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kvindex-device}"
mkdir -p "$OUT"
DIST="${DIST:-build-device/dist}"
status=0
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1; head -15 "$OUT/nvidia-smi.txt"
# one test per process under a time limit, so that a hang costs one test,
# not the lease; everything in one log
: > "$OUT/gpu_tests.log"
tests=$("$DIST/kvindex_gpu_tests" --gtest_list_tests | awk '/^[^ ]/{suite=$1} /^  /{print suite $1}')
for t in $tests; do
  start=$(date +%s%N)
  timeout "${TEST_TIMEOUT:-60}" "$DIST/kvindex_gpu_tests" --gtest_filter="$t" >> "$OUT/gpu_tests.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  printf '%-55s rc=%-3s %7d ms\n' "$t" "$rc" $(( ($(date +%s%N) - start) / 1000000 )) | tee -a "$OUT/gpu_tests_summary.txt"
done
grep -E "Failure|error:|Expected|Which is|actual" "$OUT/gpu_tests.log" | head -40
if [ "${BENCH:-1}" = 1 ]; then
  PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/gpu/bench_decode.py --lib "$DIST/libkvindex_gpu_capi.so" \
    --json "$OUT/bench_decode.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_decode.log" || status=1
fi
if [ "${SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null; then
  timeout "${SANITIZER_TIMEOUT:-90}" compute-sanitizer --tool memcheck --error-exitcode 3 "$DIST/kvindex_gpu_tests" \
    --gtest_filter='GpuFlat.GqaGroup*:GpuFlat.SearchEquals*:GpuFlat.Empty*:GpuTopK.Ties*:GpuTopK.BudgetCovering*:GpuTopK.PerCall*:GpuKVCache.DeviceArrays*:GpuKVCache.BadInput*' \
    > "$OUT/memcheck.log" 2>&1 || status=1
  tail -5 "$OUT/memcheck.log"
fi
exit $status
