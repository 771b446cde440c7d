#!/usr/bin/env bash
# The main job: set-up and build, then the demo comparison on a synthetic
# head (kvbench replaces it when it lands). Extra arguments go to kvdemo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh build
./build/benchmarks/kvdemo "$@"
