#!/usr/bin/env bash
# Builds what runs on a GPU machine that has only the CUDA driver and
# PyTorch (no Faiss, OpenBLAS or OpenMP runtime, no network): the GPU tests
# as one self-contained executable (static Faiss, OpenBLAS with its Fortran
# runtime, libgomp, libstdc++, libgcc and the CUDA runtime) and the
# benchmarks' kernel library (libkvindex_gpu_capi.so, CUDA and C++ runtimes
# inside). Needs the CUDA toolkit here. Output: build-device/dist/ and its
# archive build-device/dist.tar.xz (rewritten on every build, so that the
# archive that travels is never an older build's), then
#   build-device/dist/kvindex_gpu_tests
#   python3 benchmarks/gpu/bench_decode.py --lib build-device/dist/libkvindex_gpu_capi.so
# on the GPU machine (scripts/run_device.sh runs both).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR="${1:-build-device}"
bash scripts/install_packages.sh build-essential cmake libfaiss-dev libopenblas-dev \
     libgtest-dev nlohmann-json3-dev libgfortran-12-dev
export PATH="$PATH:/usr/local/cuda/bin"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DKVINDEX_ENABLE_GPU=ON \
      -DKVINDEX_GPU_STANDALONE=ON -DKVINDEX_BUILD_BENCHMARKS=OFF >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target kvindex_gpu_tests kvindex_gpu_capi
mkdir -p "$BUILD_DIR/dist"
cp "$BUILD_DIR/tests/gpu/kvindex_gpu_tests" "$BUILD_DIR/gpu/libkvindex_gpu_capi.so" "$BUILD_DIR/dist/"
strip "$BUILD_DIR/dist/kvindex_gpu_tests" "$BUILD_DIR/dist/libkvindex_gpu_capi.so"
tar cJf "$BUILD_DIR/dist.tar.xz" -C "$BUILD_DIR" dist
# what they still load: the C library and the kernel's loader, nothing else
for f in "$BUILD_DIR"/dist/*; do
  echo "$f:"; ldd "$f" | sed 's/^/  /'
done
