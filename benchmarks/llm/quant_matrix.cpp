#include "quant_matrix.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include <kvindex/kernels.h>

#include "gguf.h"
#include "quant_kernels.h"

namespace kvllm {

namespace {

/** Chunks of output rows for the threads: at most 128 rows each (a BLAS
 * call's share of W stays in L2), and a multiple of the thread count so
 * that a static schedule is balanced. Fixed 128-row chunks gave one of two
 * threads 384 of SmolLM2's 576 rows and the other 192. */
int64_t n_row_chunks(int64_t rows) {
    const int64_t threads = std::max(1, omp_get_max_threads());
    const int64_t max_rows = 128;
    const int64_t per_thread = (rows + threads * max_rows - 1) / (threads * max_rows);
    return std::min(rows, threads * per_thread);
}

bool avx512() {
    return kvindex::get_simd_level() == kvindex::SimdLevel::avx512;
}

} // namespace

QuantMatrix::QuantMatrix(uint32_t type_in, int64_t rows_in, int64_t cols_in, const uint8_t* src)
        : type(type_in), rows(rows_in), cols(cols_in) {
    if (rows <= 0 || cols <= 0) {
        throw std::invalid_argument("quantized matrix of " + std::to_string(rows) + " x " +
                                    std::to_string(cols) + ": sizes must be positive");
    }
    row_bytes = ggml_row_bytes(type, cols); // throws for an unknown type or partial blocks
    data.assign(src, src + size_t(rows) * row_bytes);
}

QuantMatrix QuantMatrix::from_gguf(const GgufFile& f, const std::string& name, int64_t rows, int64_t cols) {
    // ggml lists the contiguous dimension first
    const GgufTensor& t = f.tensor(name, {cols, rows});
    try {
        return QuantMatrix(t.type, rows, cols, f.bytes.data() + f.data_offset + t.offset);
    } catch (const std::exception& e) {
        throw std::runtime_error("GGUF file " + f.path + ": tensor " + name + ": " + e.what());
    }
}

bool QuantMatrix::has_fused_kernel() const {
    return GgmlType(type) == GgmlType::Q4_1 || GgmlType(type) == GgmlType::Q8_0;
}

int64_t QuantMatrix::max_fused_rows() const {
    if (!has_fused_kernel()) {
        return 0;
    }
    // Measured on SmolLM2's matrices, one thread: the AVX-512 kernel beats
    // sgemm on dequantized rows up to about 64 input rows when OpenBLAS
    // runs its SkylakeX kernels, and at every size tried (up to 256) with
    // the SSE3 fallback that OpenBLAS 0.3.21 picks on CPUs it does not
    // know. The portable kernel only wins while reading 4.5x fewer bytes
    // than float rows matters more than its arithmetic: one or two rows.
    return avx512() ? 64 : 2;
}

void QuantMatrix::dequantize_rows(int64_t r0, int64_t nrows, float* out) const {
    if (r0 < 0 || nrows < 0 || r0 > rows - nrows) {
        throw std::out_of_range("rows [" + std::to_string(r0) + ", +" + std::to_string(nrows) +
                                ") of a matrix of " + std::to_string(rows));
    }
    // rows are contiguous: one call over all their blocks
    dequantize_row(type, data.data() + r0 * row_bytes, out, nrows * cols);
}

int64_t QuantMatrix::first_non_finite_row() const {
    for (int64_t r = 0; r < rows; r++) {
        if (!row_is_finite(type, data.data() + r * row_bytes, cols)) {
            return r;
        }
    }
    return -1;
}

void QuantMatrix::matmul(const float* x, int64_t n, float* y, bool accumulate) const {
    if (n < 0) {
        throw std::invalid_argument("matmul with " + std::to_string(n) + " input rows");
    }
    if (n == 0 || rows == 0) {
        return;
    }
    const bool fused = n <= max_fused_rows();
    const quant_kernels::FusedKernel kernel =
            avx512() ? quant_kernels::fused_avx512 : quant_kernels::fused_generic;
    const int64_t n_chunks = n_row_chunks(rows);
    const float beta = accumulate ? 1.0f : 0.0f;
    std::exception_ptr error; // exceptions must not leave an OpenMP region
    // Each thread calls a one-thread BLAS: mixing OpenBLAS's own threads
    // with OpenMP regions made them spin against each other (decode 2.7 vs
    // 14 tokens/s).
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < n_chunks; c++) {
        const int64_t r0 = c * rows / n_chunks, nr = (c + 1) * rows / n_chunks - r0;
        try {
            if (fused) {
                kernel(type, data.data() + r0 * row_bytes, row_bytes, nr, cols, x, n, y + r0, rows,
                       accumulate);
            } else {
                // Many input rows share each weight: dequantizing the chunk
                // once costs little next to the GEMM, which BLAS does best.
                thread_local std::vector<float> w; // at most 128 * cols, kept between calls
                w.resize(size_t(nr * cols));
                dequantize_rows(r0, nr, w.data());
                if (n == 1) {
                    cblas_sgemv(CblasRowMajor, CblasNoTrans, int(nr), int(cols), 1.0f, w.data(),
                                int(cols), x, 1, beta, y + r0, 1);
                } else {
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(nr), int(cols), 1.0f,
                                x, int(cols), w.data(), int(cols), beta, y + r0, int(rows));
                }
            }
        } catch (...) {
#pragma omp critical(kvllm_quant_matrix_error)
            if (!error) {
                error = std::current_exception();
            }
        }
    }
    if (error) {
        std::rethrow_exception(error);
    }
}

} // namespace kvllm
