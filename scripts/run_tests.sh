#!/usr/bin/env bash
# Every test: set-up and build, the gtest suites through CTest, the Python
# package's pytest suite (scripts/run_python_tests.sh), the library's tests again under ASan + UBSan (scripts/run_sanitizers.sh), and
# each libFuzzer target for 60 seconds from a fixed seed (scripts/run_fuzzers.sh;
# longer runs with fresh seeds: `bash scripts/run_fuzzers.sh 600`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh build
source scripts/blas_env.sh
# setup.sh installed the model: the tests that need it must run, not skip
KVINDEX_REQUIRE_MODEL=1 ctest --test-dir build --output-on-failure -j "$(nproc)"
# the Python package: pip install into .venv-py, pytest suite, examples
bash scripts/run_python_tests.sh
bash scripts/run_sanitizers.sh build-asan
FUZZ_SEED=1 bash scripts/run_fuzzers.sh 60 build-fuzz
