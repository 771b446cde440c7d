#!/usr/bin/env bash
# Every test, from a fresh clone (CI runs exactly this: .ci/run):
#
#   setup      packages, the Python environment .venv (scripts/setup.sh)
#   build      Release build with Ninja: library, tests, tools, GPU code
#              (libraries and tests in unity batches: KVINDEX_UNITY_BUILD;
#              the CUDA code to unoptimised PTX only, cicc -O0: no GPU here
#              runs it, and NVVM's optimiser took 3/4 of the CUDA compile;
#              scripts/build_device.sh builds sm_90 for a GPU machine)
#   ctest      every gtest, the tools' and the model's tests, the docs
#              staleness check and the installed-package consumer
#   hf-wheels  waits for torch, transformers, accelerate and ray, which
#              install into .venv in the background from the build phase on
#   python     the Python package (linking the library built above), its
#              pytest suite (torch and transformers tests included) and
#              examples (scripts/run_python_tests.sh)
#   san-build  one clang build with ASan + UBSan + libFuzzer coverage of the
#              library for both the sanitizer tests and the fuzzers (the
#              tests' own code uninstrumented: build_sanitizers.sh)
#   sanitizers the library's tests and the allocation-fault tests under
#              ASan + UBSan, 4 gtest shards per core each, a core's worth
#              at a time (scripts/run_sanitizers.sh)
#   fuzz       each libFuzzer target 12 s from a fixed seed, one per core
#              (scripts/run_fuzzers.sh)
#
# and prints a table of the phases' seconds. `--quick` (after a build, the
# inner loop): an incremental Release build, ctest and pytest only, without
# the transformers model's tests (test_hf.py).
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
if [ "${1:-}" = "--quick" ]; then
  QUICK=1
fi

PHASES=()
START=$(date +%s)
print_table() {
  local rc=$?
  echo
  printf '%-12s %8s\n' phase seconds
  for p in "${PHASES[@]}"; do
    printf '%-12s %8s\n' ${p}
  done
  printf '%-12s %8s\n' total "$(( $(date +%s) - START ))"
  [ "$rc" -eq 0 ] || echo "run_tests: FAILED (exit $rc)" >&2
}
trap print_table EXIT
# phase NAME COMMAND...: runs it, records its seconds (a failure ends the run)
phase() {
  local name=$1 t0
  shift
  t0=$(date +%s)
  echo "==== run_tests: $name"
  "$@"
  PHASES+=("$name $(( $(date +%s) - t0 ))")
}

# a full disk fails the build with ninja's own words deep in its log: say it
# first (a clean clone grows to ~6.5 GB: the venv 6.1, the two builds 0.6)
FREE_KB=$(df -Pk . | awk 'NR == 2 {print $4}')
if [ "${FREE_KB:-0}" -lt $((7 * 1024 * 1024)) ]; then
  echo "run_tests: warning: $((FREE_KB / 1024)) MiB free on $(df -P . | awk 'NR == 2 {print $6}'); a clean run needs about 6.5 GB" >&2
fi
if [ "$QUICK" = 0 ]; then
  phase setup bash scripts/setup.sh --no-build
fi
# the Python tests' PyTorch and transformers wheels (~6 GB, mostly network
# and disk) install while the C++ builds; the python phase waits for them
HF_LOG=$(mktemp)
.venv/bin/pip install -q --disable-pip-version-check --no-compile \
  -r python_bindings/tests/requirements-hf.txt >"$HF_LOG" 2>&1 &
HF_PID=$!
KVINDEX_CMAKE_ARGS="-DKVINDEX_UNITY_BUILD=ON -DCMAKE_CUDA_ARCHITECTURES=90-virtual -DCMAKE_CUDA_FLAGS=-Xcicc=-O0" phase build bash scripts/setup.sh build
source scripts/blas_env.sh
# setup.sh installed the model: the tests that need it must run, not skip
KVINDEX_REQUIRE_MODEL=1 phase ctest ctest --test-dir build --output-on-failure -j "$(nproc)"
wait_hf() {
  if ! wait "$HF_PID"; then
    cat "$HF_LOG" >&2
    echo "run_tests: installing python_bindings/tests/requirements-hf.txt failed" >&2
    return 1
  fi
}
phase hf-wheels wait_hf
if [ "$QUICK" = 1 ]; then
  # the inner loop leaves out the transformers model's tests (test_hf.py,
  # ~90 s of SmolLM2 generations); the whole command runs them
  phase python bash scripts/run_python_tests.sh --ignore=python_bindings/tests/test_hf.py
  exit 0
fi
# the torch, transformers and Ray tests must run, not skip
KVINDEX_REQUIRE_HF=1 KVINDEX_REQUIRE_RAY=1 phase python bash scripts/run_python_tests.sh
phase san-build bash scripts/build_sanitizers.sh build-san
phase sanitizers bash scripts/run_sanitizers.sh build-san
FUZZ_SEED=1 phase fuzz bash scripts/run_fuzzers.sh 12 build-san
