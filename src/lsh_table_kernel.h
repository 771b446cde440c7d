#pragma once

#include <cstddef>

namespace kvindex {

/** What the batched evaluation of an LSHInclusionTable reads: the cubic
 * of each cell, near half (c >= 0, cells [0, n)) then far half (c < 0,
 * cells [n, 2n)), as LSHInclusionTable::log_inclusion(double) evaluates it
 * one value at a time. */
struct LSHTableView {
    const double* coef; ///< size 8 * n: 4 coefficients per cell, 2n cells
    int n;              ///< cells per half
    double inv_h;       ///< cells per unit of s = sin(theta / 2) (or r = cos)
    double mk;          ///< min_hits * K: the far half's slope in log r
    double log_floor;   ///< log of the smallest inclusion returned
};

/// out[t] = float(log u(c[t])), 8 lanes of double at a time: the same
/// arithmetic as the scalar lookup. Needs AVX-512F/DQ (SimdLevel::avx512).
void lsh_log_inclusion_avx512(const LSHTableView& tab, const double* c, size_t n, float* out);

} // namespace kvindex
