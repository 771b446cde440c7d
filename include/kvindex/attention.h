#pragma once

#include <cstddef>

#include <kvindex/KVIndex.h>
#include <kvindex/kv_type.h>

/* The attention-estimator layer: it turns what an index selected into an
 * attention output and a log-sum-exp (lse). Scores are s_i = <q, k_i> / sqrt(d);
 * all sums run in log space with the maximum subtracted, so finite scores of
 * any magnitude are safe. An empty set gives out = 0 and lse = -inf, which
 * merges as "nothing"; attention_from_scores reads a score of -inf as a
 * masked token, and a set of masked tokens as empty.
 * These functions read the caller's rows unchecked; a result that is not
 * finite (NaN or Inf in the query or the rows, or scores that overflow
 * float) is refused with an exception rather than returned.
 */

namespace kvindex {

const char* estimator_name(Estimator e);

/** Attention of one query over a set of tokens, by one estimator.
 *
 * @param keys    rows of size d, indexed by sel.ids
 * @param values  rows of size dv, indexed by sel.ids
 * @param out     output, size dv
 * @return        the lse of the set (-inf when sel is empty)
 */
float estimate_attention(
        Estimator estimator,
        const float* q,
        const float* keys,
        const float* values,
        size_t d,
        size_t dv,
        const Selection& sel,
        float* out);

/** The estimator once the scores are known: out = sum_i softmax(s - log_u)_i
 * v_{ids[i]}, returning the lse. s (size n, scaled scores) is overwritten by
 * the weights; log_u may be nullptr (all u = 1). For index types that have
 * computed the scores already (LSHSample needs them for u).
 */
float attention_from_scores(
        float* s,
        const float* log_u,
        const float* values,
        size_t dv,
        const idx_t* ids,
        size_t n,
        float* out);

/// Exact attention of one query over n contiguous tokens (fused kernel).
float exact_attention(
        const float* q,
        const float* keys,
        const float* values,
        size_t d,
        size_t dv,
        size_t n,
        float* out);

// The same over rows stored in any KVType (KVRows: float32, bf16, fp16);
// the float* versions above read float32 rows of dimensions d and dv.

float estimate_attention(
        Estimator estimator,
        const float* q,
        KVRows keys,
        KVRows values,
        const Selection& sel,
        float* out);

float attention_from_scores(
        float* s, const float* log_u, KVRows values, const idx_t* ids, size_t n, float* out);

float exact_attention(const float* q, KVRows keys, KVRows values, size_t n, float* out);

/** Merges partial results over disjoint sets:
 * out = sum_j e^{lse_j - m} out_j / sum_j e^{lse_j - m}, m = max_j lse_j,
 * lse = m + log sum_j e^{lse_j - m}. Parts with lse = -inf contribute
 * nothing; if every part is empty, out = 0 and lse = -inf.
 *
 * @param outs  n_parts pointers, each to dv floats
 * @param lses  size n_parts
 * @param out   size dv (may alias outs[0])
 */
float merge_attention(
        size_t n_parts, const float* const* outs, const float* lses, size_t dv, float* out);

/** Mean over n outputs of the relative L2 error ||out_i - exact_i|| /
 * ||exact_i|| (the absolute error where exact_i = 0), in double: how
 * IndexChoose and IndexHybrid's budget split judge an estimate.
 * @param out    size n * dv
 * @param exact  size n * dv
 */
double mean_relative_error(const float* out, const float* exact, size_t n, size_t dv);

} // namespace kvindex
