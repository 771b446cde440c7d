#!/usr/bin/env bash
# The Python package's tests: builds and installs python_bindings/ into the
# virtual environment .venv-py (reused; the CMake build dir
# python_bindings/build/ makes a reinstall incremental), runs the pytest
# suite, then both examples at small sizes so that they cannot rot.
# Needs the system packages of scripts/setup.sh (Faiss, OpenBLAS, pybind11,
# Python headers). Usage: bash scripts/run_python_tests.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-py
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# keep the environment out of git status
[ -f "$VENV/.gitignore" ] || echo '*' > "$VENV/.gitignore"
PY="$VENV/bin/python"

"$PY" -m pip install -q --disable-pip-version-check -r python_bindings/tests/requirements.txt
"$PY" -m pip install -q --disable-pip-version-check ./python_bindings

# run from outside the source tree, so that `import kvindex` is the installed
# package, not python_bindings/kvindex (which has no compiled module)
"$PY" -m pytest -q -p no:cacheprovider python_bindings/tests "$@"

echo "== examples/decode_loop.py (synthetic trace, small)"
"$PY" python_bindings/examples/decode_loop.py --synthetic --n-tokens 600 --n-ctx 560 --steps 8
echo "== examples/ann_pipeline.py (small)"
"$PY" python_bindings/examples/ann_pipeline.py --n 4000 --nq 50 --d 64 --k 10
echo "== examples/trace_to_kvbench.py: a trace written from Python, replayed by kvbench"
TRACE_DIR="$(mktemp -d)"
trap 'rm -rf "$TRACE_DIR"' EXIT
"$PY" python_bindings/examples/trace_to_kvbench.py "$TRACE_DIR/trace" --tokens 600 --n-ctx 560
if [ -x build/benchmarks/kvbench ]; then
  build/benchmarks/kvbench run --trace "$TRACE_DIR/trace" --index Flat --index "TopK(Flat)|k=32" --max-queries 8
else
  echo "(build/benchmarks/kvbench not built: replay skipped)"
fi
