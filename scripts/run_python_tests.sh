#!/usr/bin/env bash
# The Python package's tests: installs python_bindings/ into the project's
# virtual environment .venv (scripts/setup.sh made it), linking the library
# the C++ build already compiled (installed into <build>/install), runs the
# pytest suite, then the examples at small sizes so that they cannot rot.
# Usage: bash scripts/run_python_tests.sh [pytest args...]
#   KVINDEX_BUILD_DIR: the C++ build to link (default build; without one,
#   pip compiles the library itself)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
BUILD_DIR="${KVINDEX_BUILD_DIR:-build}"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

"${PIP[@]}" -r python_bindings/tests/requirements.txt
pip_args=()
if [ -f "$BUILD_DIR/CMakeCache.txt" ]; then
  cmake --install "$BUILD_DIR" --prefix "$BUILD_DIR/install" >/dev/null
  # the build backend from the venv (requirements.txt), not a fresh
  # isolated one per install; the library from the install above
  pip_args+=(--no-build-isolation
             -C "cmake.define.kvindex_DIR=$PWD/$BUILD_DIR/install/lib/cmake/kvindex")
fi
"${PIP[@]}" "${pip_args[@]}" ./python_bindings

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
if [ -x "$BUILD_DIR/benchmarks/kvbench" ]; then
  "$BUILD_DIR/benchmarks/kvbench" run --trace "$TRACE_DIR/trace" --index Flat --index "TopK(Flat)|k=32" --max-queries 8
else
  echo "($BUILD_DIR/benchmarks/kvbench not built: replay skipped)"
fi
