#!/usr/bin/env bash
# The library's tests under AddressSanitizer (leaks included) and
# UndefinedBehaviorSanitizer: any report fails the run. Part of the README
# test command (scripts/run_tests.sh), after setup.sh has installed the
# packages. Usage: bash scripts/run_sanitizers.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${1:-build-asan}"
SAN="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"

cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DKVINDEX_BUILD_BENCHMARKS=OFF -DKVINDEX_ENABLE_GPU=OFF \
  "-DCMAKE_CXX_FLAGS=$SAN" "-DCMAKE_EXE_LINKER_FLAGS=$SAN" >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target kvindex_tests kvindex_fault_tests

# halt at the first report; UBSan prints its stack
export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
"$BUILD_DIR/tests/kvindex_tests" --gtest_brief=1
# every allocation of every write failed in turn: nothing may leak on the way
# out, but for Faiss's own builders (see the suppressions file)
LSAN_OPTIONS="suppressions=$PWD/tests/lsan_faiss_throw.supp:print_suppressions=0" \
  "$BUILD_DIR/tests/kvindex_fault_tests" --gtest_brief=1
