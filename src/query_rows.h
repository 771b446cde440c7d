#pragma once

#include <cstring>
#include <vector>

#include <kvindex/KVIndex.h>

namespace kvindex {

/** The queries at `rows` (each < n_queries) of every one of n_heads query
 * heads, from head-major queries (size n_heads * n_queries * d), packed
 * head-major in the order of `rows`: size n_heads * rows.size() * d. How a
 * prefill hands a subset of its queries on (a holdout, the scoring window,
 * a shard's range). */
inline std::vector<float> gather_query_rows(
        const float* queries,
        int n_heads,
        idx_t n_queries,
        const std::vector<idx_t>& rows,
        int d) {
    std::vector<float> q(size_t(n_heads) * rows.size() * d);
    for (int h = 0; h < n_heads; h++) {
        for (size_t i = 0; i < rows.size(); i++) {
            std::memcpy(q.data() + (h * rows.size() + i) * d,
                        queries + (size_t(h) * n_queries + rows[i]) * d,
                        sizeof(float) * d);
        }
    }
    return q;
}

} // namespace kvindex
