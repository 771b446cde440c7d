#!/usr/bin/env bash
# The main job: set-up and build, generate the default synthetic trace if it
# is absent, then kvbench over every index type with default parameters.
# Extra arguments go to `kvbench run` (e.g. --json out.json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh build
source scripts/blas_env.sh
TRACE=data/default
if [ ! -f "$TRACE/meta.json" ]; then
  ./build/benchmarks/kvbench gen --out "$TRACE" --preset mixed --seed 1
fi
./build/benchmarks/kvbench run --trace "$TRACE" --max-queries 32 \
  --index Flat \
  --index "TopK(Flat)" \
  --index "TopK(IVF128,Flat)" \
  --index "TopK(HNSW16)" \
  --index "Sink4,Window64,TopK(IVF128,Flat)" \
  --index "Sink4,Window64,LSHSample10x150" \
  --index "RoarGraph32" \
  --index "RoarGraph32|walk_bits=8" \
  --index "Sink128,Window512,RoarGraph32" \
  --index "Sink1,Window63,IVFAsym64" \
  --index ProxyEvict20 \
  --index Uniform \
  --index Weighted \
  --index "Hybrid(TopK(Flat),Uniform)|budget=1%" \
  --index "Hybrid(TopK(Flat),LSHSample10x150)" \
  --index "Choose(TopK(Flat);Sink4,Window64,LSHSample10x150)" \
  --index "BF16,Flat" \
  "$@"
