#pragma once

// Host side of the eviction scoring kernels (kernels/proxy_scores.cuh):
// IndexProxyEvict's proxy_scores on the device, for GpuIndexProxyEvict and
// the benchmarks' C interface (capi.cu). Every pointer is device memory.
// Scratch comes from a Workspace, as in decode_attention.h: run the call
// once on Workspace::sizing() to learn its bytes (which depend on the
// shapes only, never on the device), then on that much memory.

#include <cstdint>

#include <cuda_runtime_api.h>

#include "decode_attention.h"

namespace kvindex {
namespace gpu {

/** Importance scores F_j = sum over the R = n_heads * n_q query rows r of
 * softmax_r(q_r . K / sqrt(d))_j, in float32 on the CUDA cores (two tiled
 * passes: each row's log-sum-exp over its visible keys, then the column
 * sums), partial sums merged in double.
 *
 * @param keys       [n][d] float32, 16-byte aligned
 * @param n          keys, 0 <= n < 2^31 - 64
 * @param d          head dimension, a positive multiple of 4
 * @param queries    [n_heads * n_q][d] float32 (head-major: row h * n_q + i
 *                   is head h's query i), 16-byte aligned
 * @param q_pos      [n_q] int64 absolute position of query i (may be
 *                   nullptr when causal is false: it is not read)
 * @param first_pos  absolute position of keys[0], >= 0
 * @param causal     row r (position p = q_pos[r % n_q]) sees the keys j
 *                   with first_pos + j <= p only, and contributes nothing
 *                   when it sees none (H2O); false: every key (NaCl, TOVA)
 * @param scores     [n] float32 output (every element written)
 */
void proxy_scores(
        const float* keys,
        int64_t n,
        int d,
        const float* queries,
        int n_heads,
        int64_t n_q,
        const int64_t* q_pos,
        int64_t first_pos,
        bool causal,
        float* scores,
        Workspace& ws,
        cudaStream_t stream);

} // namespace gpu
} // namespace kvindex
