#pragma once

#include <memory>

#include <kvindex/KVIndex.h>
#include <kvindex/KVStorage.h>

namespace kvindex {

struct FactoryChain;

/** Exact attention over every token: the dense baseline.
 *
 * search is exact top-k by inner product; select returns every token;
 * attend runs the fused dense kernel, one pass over keys and values for
 * up to kAttendChunk queries at once (dense_attention_group): a GQA group
 * handed over in one attend call reads its KV head once, not once per
 * query head. A query's output does not depend on how many queries share
 * its call (attend(n) equals n calls of attend(1), bit for bit).
 * Factory string: "Flat".
 */
struct IndexKVFlat : KVIndex {
    KVStorage storage; ///< keys and values of all tokens

    /// Queries attended by one pass over the keys and values; the chunks
    /// of a larger batch run in parallel.
    static constexpr idx_t kAttendChunk = 8;

    explicit IndexKVFlat(int d = 0, int d_value = -1, KVType kv_type = KVType::f32);

    size_t memory_bytes() const override;
    /// its only write is one KVStorage append, which allocates first
    bool writes_roll_back() const override {
        return true;
    }
    bool can_undo_add() const override {
        return true;
    }

    const char* type_name() const override {
        return "IndexKVFlat";
    }
    std::string factory_string() const override {
        return "Flat";
    }
    void write_fields(BufferWriter& w) const override;
    void read_fields(BufferReader& r, uint32_t version) override;
    void check_invariants() const override;

    /// Registry parser: "Flat".
    static std::unique_ptr<KVIndex> from_factory(FactoryChain& chain);

   protected:
    void reset_impl() override;
    const KVStorage* token_storage() const override {
        return &storage;
    }
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    void undo_add_kv_impl(idx_t n) override;
    void search_one(
            const float* q,
            idx_t k,
            float* distances,
            idx_t* labels,
            const faiss::SearchParameters* params) const override;
    void select_one(const float* q, Selection& sel, const faiss::SearchParameters* params)
            const override;
    float attend_one(const float* q, float* out, const faiss::SearchParameters* params)
            const override;
    void attend_batch(
            idx_t n,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params) const override;
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

/// The same over rows stored in any KVType.
void exact_topk_inner_product(
        const float* q, KVRows x, idx_t n, idx_t k, float* distances, idx_t* labels);

} // namespace kvindex
