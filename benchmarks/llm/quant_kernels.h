#pragma once

// Fused dequantize-and-multiply kernels of QuantMatrix (quant_matrix.h):
// one C++ version and one for AVX-512, the latter compiled in a file of
// its own with AVX-512 flags and called only when kvindex's SIMD level is
// avx512 (kvindex/kernels.h), so that tests can compare the two.

#include <cstdint>

namespace kvllm {
namespace quant_kernels {

/** y[t * ldy + i] = <row i of W, x_t> (+ y[t * ldy + i] when accumulate)
 * for i < nrows, t < n, with x_t = x + t * cols.
 * @param type       GgmlType::Q4_1 or GgmlType::Q8_0
 * @param w          nrows rows of row_bytes bytes each, cols / 32 blocks per row
 * @param x          size n * cols
 * @param y          rows t = 0..n-1 of stride ldy, nrows values each
 */
using FusedKernel = void (*)(uint32_t type, const uint8_t* w, uint64_t row_bytes, int64_t nrows,
                             int64_t cols, const float* x, int64_t n, float* y, int64_t ldy,
                             bool accumulate);

void fused_generic(uint32_t type, const uint8_t* w, uint64_t row_bytes, int64_t nrows, int64_t cols,
                   const float* x, int64_t n, float* y, int64_t ldy, bool accumulate);

/// Needs AVX-512F, FMA and F16C, which every CPU at kvindex's avx512 level has.
void fused_avx512(uint32_t type, const uint8_t* w, uint64_t row_bytes, int64_t nrows, int64_t cols,
                  const float* x, int64_t n, float* y, int64_t ldy, bool accumulate);

} // namespace quant_kernels
} // namespace kvllm
