#pragma once

#include <kvindex/KVIndex.h>
#include <kvindex/KVStorage.h>

namespace kvindex {

/** Exact attention over every token: the dense baseline.
 *
 * search is exact top-k by inner product; select returns every token;
 * attend runs the fused dense kernel, one pass over keys and values.
 */
struct IndexKVFlat : KVIndex {
    KVStorage storage; ///< keys and values of all tokens

    explicit IndexKVFlat(int d = 0, int d_value = -1);

    void search(
            idx_t n,
            const float* q,
            idx_t k,
            float* distances,
            idx_t* labels,
            const faiss::SearchParameters* params = nullptr) const override;
    void select(
            idx_t n,
            const float* q,
            Selection* sel,
            const faiss::SearchParameters* params = nullptr) const override;
    void attend(
            idx_t n,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params = nullptr) const override;

    void reset() override;
    size_t memory_bytes() const override;

   protected:
    const KVStorage* token_storage() const override {
        return &storage;
    }
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
};

/** Exact top-k by inner product over contiguous rows, for one query:
 * the k best (score, id) pairs in decreasing score order, padded with
 * (-inf, -1) when k > n. Shared by the indexes that scan their keys.
 */
void exact_topk_inner_product(
        const float* q,
        const float* x,
        size_t d,
        idx_t n,
        idx_t k,
        float* distances,
        idx_t* labels);

} // namespace kvindex
