#!/usr/bin/env bash
# Every test, from a fresh clone (CI runs exactly this: .ci/run), in two
# lanes that share the cores. The main lane:
#
#   setup      packages, the Python environment .venv (scripts/setup.sh)
#   build      Release build with Ninja: library, tests, tools, GPU code
#              (the libraries in unity batches: KVINDEX_UNITY_BUILD; the
#              CUDA code to unoptimised PTX only, cicc -O0: no GPU here
#              runs it, and NVVM's optimiser took 3/4 of the CUDA compile;
#              scripts/build_device.sh builds sm_90 for a GPU machine)
#   ctest      every gtest, the tools' and the model's tests, the docs
#              staleness check and the installed-package consumer
#   hf-wheels  waits for torch, transformers, accelerate and ray, which
#              install into .venv in the background from the build phase on
#   python     the Python package (linking the library built above), its
#              pytest suite (torch and transformers tests included) and
#              examples (scripts/run_python_tests.sh)
#
# The sanitizer lane, started after setup at the lowest CPU priority
# (nice 19), so that it takes only the cores the main lane leaves idle
# (pytest keeps about one of two busy); its output is printed when it ends:
#
#   san-build  one clang build with ASan + UBSan + libFuzzer coverage of the
#              library for both the sanitizer tests and the fuzzers (the
#              tests' own code uninstrumented: build_sanitizers.sh)
#   sanitizers the library's tests and the allocation-fault tests under
#              ASan + UBSan, 4 gtest shards per core each, a core's worth
#              at a time (scripts/run_sanitizers.sh)
#   fuzz       each libFuzzer target 12 s from a fixed seed, one per core
#              (scripts/run_fuzzers.sh)
#
# and prints a table of the phases' seconds (a lane's phases add up to its
# time; the total is the wall time). `--quick` (after a build, the inner
# loop): an incremental Release build, ctest and pytest only, without the
# transformers model's tests (test_hf.py).
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
if [ "${1:-}" = "--quick" ]; then
  QUICK=1
fi

START=$(date +%s)
# every phase's "name seconds", both lanes (the sanitizer lane is a subshell)
PHASE_FILE=$(mktemp)
SAN_PID=
SAN_LOG=
print_table() {
  local rc=$?
  # a failed main lane takes the sanitizer lane (and what it runs) down
  [ -n "$SAN_PID" ] && kill_tree "$SAN_PID"
  echo
  printf '%-12s %8s\n' phase seconds
  while read -r name secs; do
    printf '%-12s %8s\n' "$name" "$secs"
  done <"$PHASE_FILE"
  printf '%-12s %8s\n' total "$(( $(date +%s) - START ))"
  rm -f "$PHASE_FILE"
  [ "$rc" -eq 0 ] || echo "run_tests: FAILED (exit $rc)" >&2
}
kill_tree() { # pid: it and every descendant
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    kill_tree "$child"
  done
  kill "$1" 2>/dev/null || true
}
trap print_table EXIT
# phase NAME COMMAND...: runs it, records its seconds (a failure ends the lane)
phase() {
  local name=$1 t0
  shift
  t0=$(date +%s)
  echo "==== run_tests: $name"
  "$@"
  echo "$name $(( $(date +%s) - t0 ))" >>"$PHASE_FILE"
}

# a full disk fails the build with ninja's own words deep in its log: say it
# first (a clean clone grows to ~6.5 GB: the venv 6.1, the two builds 0.6)
FREE_KB=$(df -Pk . | awk 'NR == 2 {print $4}')
if [ "${FREE_KB:-0}" -lt $((7 * 1024 * 1024)) ]; then
  echo "run_tests: warning: $((FREE_KB / 1024)) MiB free on $(df -P . | awk 'NR == 2 {print $6}'); a clean run needs about 6.5 GB" >&2
fi
if [ "$QUICK" = 0 ]; then
  phase setup bash scripts/setup.sh --no-build
  # the sanitizer lane (see the top): its clang packages first, so that its
  # apt never runs beside the main lane's
  bash scripts/install_packages.sh clang libclang-rt-dev libomp-dev
  SAN_LOG=$(mktemp)
  (
    trap - EXIT
    renice -n 19 "$BASHPID" >/dev/null
    phase san-build bash scripts/build_sanitizers.sh build-san
    phase sanitizers bash scripts/run_sanitizers.sh build-san
    FUZZ_SEED=1 phase fuzz bash scripts/run_fuzzers.sh 12 build-san
  ) >"$SAN_LOG" 2>&1 &
  SAN_PID=$!
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
wait_sanitizer_lane() {
  local rc=0
  wait "$SAN_PID" || rc=$?
  SAN_PID=
  echo "==== run_tests: the sanitizer lane's output"
  cat "$SAN_LOG"
  rm -f "$SAN_LOG"
  if [ "$rc" -ne 0 ]; then
    echo "run_tests: the sanitizer lane failed (exit $rc)" >&2
    return "$rc"
  fi
}
phase san-wait wait_sanitizer_lane
