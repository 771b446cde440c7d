#!/usr/bin/env bash
# One instrumented build for the sanitizer tests and the fuzzers: clang,
# AddressSanitizer (leaks included), UndefinedBehaviorSanitizer and
# libFuzzer's edge coverage over the whole library,
# -O1 with line tables only (all a report's stack needs). It builds the
# library's tests (kvindex_tests, kvindex_fault_tests), whose own code (the
# float64 references, the loops over cases) is not instrumented
# (KVINDEX_TESTS_UNINSTRUMENTED: ASan still checks every access the library
# makes), and the fuzz targets of tests/fuzz with their seed writer. A
# one-shot build: the library and tests in unity batches (KVINDEX_UNITY_BUILD).
# Used by run_sanitizers.sh and run_fuzzers.sh. Usage: bash scripts/build_sanitizers.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${1:-build-san}"
bash scripts/install_packages.sh clang libclang-rt-dev libomp-dev cmake ninja-build \
  libfaiss-dev libopenblas-dev nlohmann-json3-dev libgtest-dev

# libFuzzer's coverage without trace-cmp: -fsanitize=fuzzer-no-link would
# add it, a call at every comparison, and the sanitizer tests ran 1.7x
# longer with it (63 s against 37 s of user time for the same 35 tests);
# the fuzzers keep their edge counters and their dictionaries, and reach
# 0-9 % fewer edges in 12 s (benchmarks/RESULTS.md, "The test command")
COV="-fsanitize-coverage=inline-8bit-counters,indirect-calls,pc-table"
SAN="-fsanitize=address,undefined $COV -fno-sanitize-recover=all -fno-omit-frame-pointer"
# (re)configure when the build is new or its flags are not these
if ! grep -qxF "CMAKE_CXX_FLAGS:STRING=$SAN" "$BUILD_DIR/CMakeCache.txt" 2>/dev/null; then
  cmake -G Ninja --no-warn-unused-cli -S . -B "$BUILD_DIR" \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" \
    "-DCMAKE_CXX_FLAGS=$SAN" \
    -DKVINDEX_BUILD_FUZZERS=ON -DKVINDEX_BUILD_TESTS=ON -DKVINDEX_BUILD_BENCHMARKS=OFF \
    -DKVINDEX_TESTS_UNINSTRUMENTED=ON \
    -DKVINDEX_UNITY_BUILD=ON \
    -DKVINDEX_ENABLE_GPU=OFF -DKVINDEX_ENABLE_PYTHON=OFF >/dev/null
fi
cmake --build "$BUILD_DIR" -j "$(nproc)" --target kvindex_tests kvindex_fault_tests \
  fuzz_read_index fuzz_factory fuzz_trace fuzz_gguf kvindex_fuzz_make_seeds
