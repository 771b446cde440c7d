#pragma once

// The one BLAS routine kvindex calls itself (Faiss declares it the same way:
// the Fortran symbol, column-major), and the row-major products built on it.

extern "C" {
int sgemm_(
        const char* transa,
        const char* transb,
        const int* m,
        const int* n,
        const int* k,
        const float* alpha,
        const float* a,
        const int* lda,
        const float* b,
        const int* ldb,
        const float* beta,
        float* c,
        const int* ldc);
}

namespace kvindex {

/** Row-major C = alpha A B^T + beta C: A is m x k (row stride lda), B is
 * n x k (row stride ldb), C is m x n (row stride ldc). Scores of m
 * queries against n keys are gemm_abt(m, n, d, q, d, keys, d, s, n). */
inline void gemm_abt(
        int m,
        int n,
        int k,
        const float* a,
        int lda,
        const float* b,
        int ldb,
        float* c,
        int ldc,
        float alpha = 1.0f,
        float beta = 0.0f) {
    // column-major view: C^T (n x m) = B (k x n, transposed) * A^T (k x m)
    sgemm_("T", "N", &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
}

} // namespace kvindex
