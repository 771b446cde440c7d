#pragma once

// Host side of MagicPIG's LSH sampling on the device (kernels/lsh_sample.cuh):
// the query's SimHash codes, the collision count over CSR hash tables held
// in device memory, the inclusion probabilities and the unbiased estimator
// merged with the static part. Every pointer is device memory unless said
// otherwise. Shared by GpuIndexLSHSample and the benchmarks' C interface
// (capi.cu). The Workspace protocol is decode_attention.h's: run a call on
// Workspace::sizing() to count its bytes (nothing is launched), then on that
// many bytes; the sizes depend on the arguments only, not on the device.

#include <cstdint>

#include <cuda_runtime_api.h>

#include "decode_attention.h"

namespace kvindex {
namespace gpu {

/** One CSR level of the hash tables of every head, as
 * IndexLSHSample::build_tables lays it out: per table, 2^K + 1 bucket
 * starts into the inner ids of the level sorted by bucket. */
struct LSHLevel {
    const uint32_t* offsets = nullptr; ///< head h at + h * offsets_head_stride: [L][2^K + 1]
    int64_t offsets_head_stride = 0;   ///< elements between heads
    const int32_t* ids = nullptr;      ///< head h at + h * ids_head_stride: [L][n_per_table]
    int64_t ids_head_stride = 0;       ///< elements between heads
    int64_t n_per_table = 0;           ///< tokens in the level (0: empty, pointers unused)
};

/** What the sampler reads for n_heads heads that hold the same number of
 * tokens. The middle of each head (the tokens neither sink nor window) is
 * the sampled "inner" part: inner token i is token row first_inner + i,
 * i < n_inner. The main level holds inner tokens [0, main.n_per_table),
 * the recent level the next recent.n_per_table, and the last n_tail =
 * n_inner - main - recent tokens are compared code by code (tail_codes). */
struct LSHTables {
    int K = 0;     ///< bits per table, 1..16
    int L = 0;     ///< tables, 1..4096
    const float* planes = nullptr;    ///< head h at + h * planes_head_stride: [K * L][d]
    int64_t planes_head_stride = 0;   ///< 0: the heads share one set (MagicPIG)
    const float* mean = nullptr;      ///< head h at + h * mean_head_stride: [d] centring mean
    int64_t mean_head_stride = 0;
    const float* norms = nullptr;     ///< head h at + h * norms_head_stride: [n_inner] |k_i - mean|
    int64_t norms_head_stride = 0;
    int64_t first_inner = 0;          ///< token row of inner token 0 (the sink's size)
    int64_t n_inner = 0;              ///< inner tokens per head
    LSHLevel main;                    ///< inner tokens [0, main.n_per_table)
    LSHLevel recent;                  ///< the next recent.n_per_table inner tokens
    const uint16_t* tail_codes = nullptr; ///< head h at + h * tail_head_stride: [n_tail][L]
    int64_t tail_head_stride = 0;

    int64_t tail_begin() const {
        return main.n_per_table + recent.n_per_table;
    }
    int64_t n_tail() const {
        return n_inner - tail_begin();
    }
};

/** MagicPIG's attention: for each query row, the first n_sink and last
 * n_window tokens of its head exactly, plus the inner tokens that collide
 * with it in at least min_hits of the L tables, weighted by 1 / u
 * (softmax(s_i - log u_i), u_i the inclusion probability, read from a
 * table of log2 u over the angle built once per (K, L, min_hits) from
 * lsh_inclusion: lsh_log2_inclusion_table), merged by lse; the lse
 * estimates the log partition of
 * every token. min_hits = 0 is exact attention over every token. The
 * middle of kv must be [n_sink, n_tokens - n_window) = [first_inner,
 * first_inner + n_inner) whenever n_inner > 0.
 *
 * @param q    [n_heads][rows_per_head][d] float32
 * @param out  [n_heads][rows_per_head][d] float32
 * @param lse  [n_heads][rows_per_head] float32, natural log
 */
void lsh_attention(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        int64_t n_sink,
        int64_t n_window,
        const LSHTables& tables,
        int min_hits,
        float* out,
        float* lse,
        Workspace& ws,
        cudaStream_t stream);

/** The sample of each row (min_hits >= 1): the inner tokens colliding in
 * at least min_hits tables, as token rows, in no particular order, with
 * <q, k_t> and u_t when asked.
 *
 * @param ids     [n_rows][tables.n_inner] int32 token rows
 * @param lens    [n_rows] int32 sample sizes
 * @param scores  [n_rows][tables.n_inner] float32 <q, k_t> (unscaled), or nullptr
 * @param u       [n_rows][tables.n_inner] float32 inclusion probabilities, or nullptr
 */
void lsh_select(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        const LSHTables& tables,
        int min_hits,
        int32_t* ids,
        int32_t* lens,
        float* scores,
        float* u,
        Workspace& ws,
        cudaStream_t stream);

/** Whether the collision count of min_hits 1 and 2 runs with its bitsets
 * in shared memory, split by token range over blocks
 * (lsh_range_walk_kernel, the default), or with global bitsets
 * (lsh_walk_kernel, what min_hits >= 3 always runs): the same sample
 * either way, in another order. For the test that compares the two and
 * for benchmarks; process-wide. */
void set_lsh_shared_walk(bool enabled);

/** u[i] = the device's inclusion probability for cosine c[i], for the
 * tests: c, u are n floats. from_table = false: the binomial tail in float
 * (lsh_inclusion: select's u); true: the table of log2 u over p that the
 * attention's importance weights read (lsh_log2_inclusion_table). */
void lsh_inclusion_eval(const float* c, int64_t n, int K, int L, int min_hits, float* u,
                        cudaStream_t stream, bool from_table = false);

} // namespace gpu
} // namespace kvindex
