#!/usr/bin/env bash
# The library's and the tools' tests under ThreadSanitizer, OpenMP included: clang with
# LLVM's OpenMP runtime and its Archer tool, which tells TSan what OpenMP's
# barriers and tasks order (GCC's libgomp is not instrumented, and TSan
# reports every parallel region through it). Faiss's static library is not
# instrumented: its own memory accesses are not checked, its OpenMP runs on
# the same runtime. Any report fails the run. Not part of the README test
# command (~20 more minutes on 2 cores); run it after changes to
# anything parallel. Usage: bash scripts/run_tsan.sh [build-dir] [gtest filter
# of kvindex_tests]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${1:-build-tsan}"
FILTER="${2:--Golden.*:FaissBlob.*:Trace*:AllLevels/*:KVType.*}"
SAN="-fsanitize=thread -fno-omit-frame-pointer"

bash scripts/install_packages.sh clang libclang-rt-dev libomp-dev
ARCHER="$(ls /usr/lib/llvm-*/lib/libarcher.so 2>/dev/null | sort -V | tail -1)"
if [[ -z "$ARCHER" ]]; then
  echo "run_tsan: libarcher.so not found (package libomp-dev)" >&2
  exit 1
fi

cmake --no-warn-unused-cli -S . -B "$BUILD_DIR" \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
  "-DCMAKE_CXX_FLAGS=$SAN" "-DCMAKE_EXE_LINKER_FLAGS=$SAN" \
  -DKVINDEX_ENABLE_GPU=OFF -DKVINDEX_ENABLE_PYTHON=OFF >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target kvindex_tests kvtools_tests kvllm kvbench

# Two threads at least, so that every parallel region really runs in
# parallel; the suites left out by default run no parallel code (kernels,
# files, golden bytes).
export OMP_TOOL_LIBRARIES="$ARCHER"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
export TSAN_OPTIONS="halt_on_error=1:abort_on_error=0:report_signal_unsafe=0:ignore_noninstrumented_modules=1:${TSAN_OPTIONS:-}"
"$BUILD_DIR/tests/kvindex_tests" --gtest_brief=1 "--gtest_filter=$FILTER"
"$BUILD_DIR/tests/tools/kvtools_tests" --gtest_brief=1
