#include <kvindex/IndexKVFlat.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/attention.h>
#include <kvindex/kernels.h>

#include "checks.h"
#include "parallel.h"

namespace kvindex {

void exact_topk_inner_product(
        const float* q,
        const float* x,
        size_t d,
        idx_t n,
        idx_t k,
        float* distances,
        idx_t* labels) {
    std::vector<float> s(n);
    inner_products_scaled(q, x, d, n, 1.0f, s.data());
    idx_t kk = std::min(k, n);
    std::vector<idx_t> ids(n);
    std::iota(ids.begin(), ids.end(), 0);
    // larger score first; ties by smaller id, so results are deterministic
    auto better = [&](idx_t a, idx_t b) {
        return s[a] > s[b] || (s[a] == s[b] && a < b);
    };
    std::partial_sort(ids.begin(), ids.begin() + kk, ids.end(), better);
    for (idx_t j = 0; j < kk; j++) {
        distances[j] = s[ids[j]];
        labels[j] = ids[j];
    }
    // padding as Faiss does for inner product: lowest float, label -1
    for (idx_t j = kk; j < k; j++) {
        distances[j] = std::numeric_limits<float>::lowest();
        labels[j] = -1;
    }
}

IndexKVFlat::IndexKVFlat(int d, int d_value)
        : KVIndex(d, d_value), storage(d, this->d_value) {}

void IndexKVFlat::add_kv_impl(idx_t n, const float* keys, const float* values) {
    storage.append(n, keys, values);
}

void IndexKVFlat::search(
        idx_t n,
        const float* q,
        idx_t k,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters* params) const {
    check_search_args(n, q, k, params);
    parallel_for(n, [&](idx_t i) {
        exact_topk_inner_product(
                q + i * d,
                storage.keys.data(),
                d,
                ntotal,
                k,
                distances + i * k,
                labels + i * k);
    });
}

void IndexKVFlat::select(
        idx_t n,
        const float* q,
        Selection* sel,
        const faiss::SearchParameters* params) const {
    check_query_args(n, q, "select: queries");
    check_params(params);
    for (idx_t i = 0; i < n; i++) {
        sel[i].set_all(ntotal);
    }
}

void IndexKVFlat::attend(
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    check_attend_args(n, q, out);
    check_params(params);
    parallel_for(n, [&](idx_t i) {
        float l = exact_attention(
                q + i * d,
                storage.keys.data(),
                storage.values.data(),
                d,
                d_value,
                ntotal,
                out + i * d_value);
        if (lse) {
            lse[i] = l;
        }
    });
}

void IndexKVFlat::reset() {
    storage.clear();
    ntotal = 0;
}

size_t IndexKVFlat::memory_bytes() const {
    return storage.memory_bytes();
}

} // namespace kvindex
