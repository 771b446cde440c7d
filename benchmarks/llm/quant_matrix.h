#pragma once

// A weight matrix kept in its GGUF block format. SmolLM2-135M in Q4_1 is
// 96 MB this way and 540 MB dequantized to float32: a decode step that
// reads the float copy is bound by memory bandwidth, while the quantized
// bytes stay in a large L3. Products dequantize on the fly (fused kernels,
// quant_kernels.h) when few input rows share the weights, and dequantize
// chunks of rows for BLAS when many do (prefill).

#include <cstdint>
#include <string>
#include <vector>

namespace kvllm {

struct GgufFile;

/** W [rows][cols], row-major, each row stored as ggml blocks (gguf.h):
 * Q4_1 is 20 bytes per 32 weights, Q8_0 34 bytes per 32; F32, F16 and Q4_0
 * are accepted too (through the BLAS path only, see matmul). */
struct QuantMatrix {
    uint32_t type = 0;         ///< ggml type id (GgmlType)
    int64_t rows = 0;          ///< output features
    int64_t cols = 0;          ///< input features, a whole number of blocks
    uint64_t row_bytes = 0;    ///< bytes of one stored row
    std::vector<uint8_t> data; ///< size rows * row_bytes

    QuantMatrix() = default;

    /** Copies rows * row_bytes bytes of blocks from src. Throws when cols is
     * not a whole number of the type's blocks, the type is not one gguf.h
     * reads, or a size is not positive. */
    QuantMatrix(uint32_t type, int64_t rows, int64_t cols, const uint8_t* src);

    /** The 2-D tensor `name` of a GGUF file as a [rows][cols] matrix: its
     * ggml shape must be {cols, rows} (ggml lists the contiguous dimension
     * first). Throws naming the file and the tensor otherwise. */
    static QuantMatrix from_gguf(const GgufFile& file, const std::string& name, int64_t rows, int64_t cols);

    bool empty() const {
        return rows == 0;
    }

    /// True when products with few input rows have a fused kernel (Q4_1, Q8_0).
    bool has_fused_kernel() const;

    /** Products with at most this many input rows use the fused kernel of
     * the SIMD level in use (kvindex/kernels.h); more, or a type without
     * one, go through dequantized chunks of rows and sgemm. 0 when the
     * type has no fused kernel. */
    int64_t max_fused_rows() const;

    /** out[i][j] = W[r0 + i][j], float32.
     * @param out  size nrows * cols
     * Throws std::out_of_range unless 0 <= r0 <= r0 + nrows <= rows. */
    void dequantize_rows(int64_t r0, int64_t nrows, float* out) const;

    /// The first row holding a NaN or infinite weight, -1 when none does
    /// (row_is_finite: reads the scales of quantized blocks only).
    int64_t first_non_finite_row() const;

    /** Y = X W^T, or Y += X W^T when accumulate; row-major throughout.
     * The output rows of W are split into chunks across OpenMP threads,
     * each calling a one-thread BLAS where BLAS is used.
     * @param x  size n * cols
     * @param y  size n * rows
     */
    void matmul(const float* x, int64_t n, float* y, bool accumulate = false) const;
};

} // namespace kvllm
