#pragma once

// An independent double-precision reference for the tests: plain loops, no
// kvindex kernel, no SIMD, no max-subtraction tricks beyond what exactness
// in double needs.

#include <cstdint>
#include <random>
#include <vector>

namespace kvtest {

using idx_t = int64_t;

/// Seeded Gaussian matrix of n rows of dimension d, times `scale`, plus `offset`.
std::vector<float> gaussian(size_t n, size_t d, uint64_t seed, float scale = 1.0f, float offset = 0.0f);

/// <q, k_i> in double for each of the n keys (stride d).
std::vector<double> ref_scores(const float* q, const float* keys, size_t d, idx_t n);

/// Exact top-k by inner product: ids sorted by decreasing <q, k_i> (ties by id).
std::vector<idx_t> ref_topk(const float* q, const float* keys, size_t d, idx_t n, idx_t k);

/** Reference attention over the tokens `ids` of (keys, values), with
 * importance weights exp(s_i) / u_i (u = nullptr means 1), s_i = <q,k_i>/sqrt(d).
 * Returns lse = log sum_i exp(s_i) / u_i and writes out (size dv), in double.
 */
double ref_attention(
        const float* q,
        const float* keys,
        const float* values,
        size_t d,
        size_t dv,
        const std::vector<idx_t>& ids,
        const std::vector<double>* u,
        std::vector<double>& out);

/// ref_attention over all n tokens.
double ref_attention_all(
        const float* q,
        const float* keys,
        const float* values,
        size_t d,
        size_t dv,
        idx_t n,
        std::vector<double>& out);

/// max_i |a_i - b_i| / max(1, max_i |b_i|): the error measure of the tests.
double rel_max_err(const float* a, const std::vector<double>& b);

} // namespace kvtest
