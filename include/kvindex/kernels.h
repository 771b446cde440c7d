#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <kvindex/kv_type.h>

/* The hot loops of attention, written once (src/kernels_body.h) and compiled
 * for several instruction sets. The widest one the CPU supports is chosen at
 * the first call; KVINDEX_SIMD=generic|avx2|avx512 in the environment or
 * set_simd_level() overrides it (tests compare every level with a reference).
 *
 * Stored rows (keys, values) may be float32, bfloat16 or fp16 (kv_type.h):
 * the kernels taking KVRows read them in their type and widen each element
 * to float on the fly (exactly); queries, weights, scores and outputs are
 * float32, and all arithmetic is float32. The float* overloads read float32
 * rows, as the KVRows ones do for KVRows(x, d).
 */

namespace kvindex {

/// avx2 means AVX2 + FMA + F16C; avx512 means AVX-512 F + DQ.
enum class SimdLevel { generic = 0, avx2 = 1, avx512 = 2 };

const char* simd_level_name(SimdLevel level);
/// Levels this CPU can run, generic first.
std::vector<SimdLevel> available_simd_levels();
/// The level in use.
SimdLevel get_simd_level();
/// Throws if the CPU cannot run `level`.
void set_simd_level(SimdLevel level);

/// s[i] = scale * <q, x_i> for rows x_i = x + i * d, i < n.
void inner_products_scaled(
        const float* q, const float* x, size_t d, size_t n, float scale, float* s);

/** s[b * ld + i] = <q_b, x_i> for g queries q_b = q + b * d and n rows
 * x_i = x + i * d (ld >= n), by tiles of rows scored against every query.
 * A score's bits depend only on its query and row, not on g, n or the
 * row's place in the call (they may differ from inner_products_scaled's in
 * the last bits): IndexLSHSample hashes a key alone and in a block of keys
 * to the same codes. */
void inner_products_multi(
        const float* q, size_t g, const float* x, size_t d, size_t n, float* s, size_t ld);

/// s[i] = scale * <q, x_{ids[i]}>, gathered rows of x (stride d).
void inner_products_by_ids(
        const float* q,
        const float* x,
        size_t d,
        const int64_t* ids,
        size_t n,
        float scale,
        float* s);

/** s[i] = scale * <q, c_{ids[i]}>, gathered rows of 8-bit codes (stride
 * d), each code read as the float 0..255 (KeyCodes8 scores keys by it). */
void inner_products_by_ids(
        const float* q,
        const uint8_t* codes,
        size_t d,
        const int64_t* ids,
        size_t n,
        float scale,
        float* s);

/** In place s[i] <- exp(s[i] - bias[i] - m) / Z with m the max, Z the sum;
 * bias may be nullptr (0). Returns log sum_i exp(s[i] - bias[i]),
 * -infinity when n == 0. A score of -inf is a masked token (weight 0); when
 * every score is -inf the weights are 0 and the result -inf, as for n == 0.
 * A NaN or +inf score makes the result NaN (the kernels do not check:
 * the callers in attention.h refuse a non-finite result).
 */
float softmax_inplace(float* s, const float* bias, size_t n);

/** One pass of the capped inclusion rule u_i = min(1, c w_i) (sampling in
 * proportion to the weights, IndexWeightedSample): over the w[i] > 0,
 * counts those with w_i c >= 1 (*sure) and all of them (*positive), and
 * returns the sum, in double, of the others' weights. c = 0 sums every
 * positive weight. The order of the sum is the kernel's own (its last bits
 * differ across instruction sets). Any output pointer may be nullptr.
 */
double inclusion_pass(const float* w, size_t n, double c, size_t* sure, size_t* positive);

/// out[j] (+)= sum_i w[i] * v_i[j] over rows v_i = v + i * dv. Overwrites out.
void weighted_sum(const float* w, const float* v, size_t dv, size_t n, float* out);

/// out[j] = sum_i w[i] * v_{ids[i]}[j], gathered rows of v (stride dv).
void weighted_sum_by_ids(
        const float* w,
        const float* v,
        size_t dv,
        const int64_t* ids,
        size_t n,
        float* out);

/** Fused dense attention of one query over n contiguous tokens, one pass
 * over keys and values (online softmax in blocks). out (size dv) gets the
 * output; returns the log-sum-exp of the scaled scores (-inf when n == 0).
 */
float dense_attention(
        const float* q,
        const float* keys,
        const float* values,
        size_t d,
        size_t dv,
        size_t n,
        float scale,
        float* out);

/** Fused dense attention of g queries over the same n contiguous tokens,
 * one pass over keys and values for all of them (the query heads of a GQA
 * group, or a batch): each key and value row is read from memory once,
 * not g times. Query c gets what dense_attention(q + c * d, ...) gives, up
 * to float rounding (the sums run in another order: relative differences
 * ~1e-6).
 *
 * @param q       queries, size g * d (row c = query c)
 * @param keys    size n * d
 * @param values  size n * dv
 * @param out     output, size g * dv (row c = output of query c)
 * @param lse     output, size g: log-sum-exp of the scaled scores of each
 *                query (-inf when n == 0, with out = 0)
 */
void dense_attention_group(
        const float* q,
        size_t g,
        const float* keys,
        const float* values,
        size_t d,
        size_t dv,
        size_t n,
        float scale,
        float* out,
        float* lse);

/** Running top-k by inner product, the selection fused into the scan (one
 * read of each row). Rows x_i = x + i * d, i < n, carry the ids ids[i], or
 * id0 + i when ids is nullptr. The heap (heap_scores, heap_ids: size k;
 * *heap_size entries in use, 0 before the first call) keeps the k best
 * rows of all the calls made with it, best = larger score, ties to the
 * smaller id; it is a min-heap (the worst kept at index 0), so several
 * calls (e.g. the probed lists of an IVF) can feed one selection.
 * topk_heap_sort orders it at the end. Scores are unscaled <q, x_i>.
 */
void topk_inner_products(
        const float* q,
        const float* x,
        size_t d,
        size_t n,
        const int64_t* ids,
        int64_t id0,
        size_t k,
        float* heap_scores,
        int64_t* heap_ids,
        size_t* heap_size);

// ---- the same kernels over rows stored in any KVType ---------------------
// (x.dim is the row length: d for keys, dv for values)

void inner_products_scaled(const float* q, KVRows x, size_t n, float scale, float* s);

void inner_products_by_ids(
        const float* q, KVRows x, const int64_t* ids, size_t n, float scale, float* s);

void weighted_sum(const float* w, KVRows v, size_t n, float* out);

void weighted_sum_by_ids(const float* w, KVRows v, const int64_t* ids, size_t n, float* out);

/// keys and values must have the same type (one storage holds both).
float dense_attention(
        const float* q, KVRows keys, KVRows values, size_t n, float scale, float* out);

/// keys and values must have the same type.
void dense_attention_group(
        const float* q,
        size_t g,
        KVRows keys,
        KVRows values,
        size_t n,
        float scale,
        float* out,
        float* lse);

void topk_inner_products(
        const float* q,
        KVRows x,
        size_t n,
        const int64_t* ids,
        int64_t id0,
        size_t k,
        float* heap_scores,
        int64_t* heap_ids,
        size_t* heap_size);

/// Orders the heap of topk_inner_products best first, in place.
void topk_heap_sort(float* heap_scores, int64_t* heap_ids, size_t heap_size);

} // namespace kvindex
