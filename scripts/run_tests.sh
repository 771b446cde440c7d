#!/usr/bin/env bash
# Every test: set-up and build, then the gtest suite through CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh build
ctest --test-dir build --output-on-failure -j "$(nproc)"
