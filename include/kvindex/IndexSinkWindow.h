#pragma once

#include <memory>

#include <kvindex/KVIndex.h>
#include <kvindex/KVStorage.h>

namespace kvindex {

struct FactoryChain;

/** The static part every sparse-attention method keeps: the first n_sink
 * tokens (attention sinks) and the n_window most recent tokens are attended
 * exactly; the tokens between them live in the inner index, whose estimate is
 * merged with the exact part by log-sum-exp.
 *
 * The split stays disjoint as tokens are appended: a new token enters the
 * window, and the oldest window token moves into the inner index. Token
 * n_sink + j of this index is token j of the inner index.
 * Factory string: "Sink<n>,Window<m>,<index>" (either count may be left out).
 */
struct IndexSinkWindow : KVIndex {
    idx_t n_sink = 0;               ///< first tokens kept exact
    idx_t n_window = 0;             ///< most recent tokens kept exact
    std::unique_ptr<KVIndex> inner; ///< tokens n_sink .. ntotal - n_window - 1
    KVStorage sink;                 ///< min(ntotal, n_sink) tokens
    KVStorage window;               ///< the tokens after sink not yet in inner (<= n_window)

    IndexSinkWindow(idx_t n_sink, idx_t n_window, std::unique_ptr<KVIndex> inner);
    IndexSinkWindow();

    size_t memory_bytes() const override;

    /// Position of the first window token (= n_sink + inner->ntotal).
    idx_t window_start() const;

    const char* type_name() const override {
        return "IndexSinkWindow";
    }
    std::string factory_string() const override;
    std::vector<const KVIndex*> children() const override {
        return {inner.get()};
    }
    void write_fields(BufferWriter& w) const override;
    void read_fields(BufferReader& r, uint32_t version) override;
    void check_invariants() const override;
    void check_children_in_step() const override;

    /// Registry parser: "Sink<n>" and / or "Window<m>", then the inner chain.
    static std::unique_ptr<KVIndex> from_factory(FactoryChain& chain);

   protected:
    void prefill_impl(const PrefillInput& input) override;
    void reset_impl() override;
    void reconstruct_impl(idx_t key, float* recons) const override;
    void reconstruct_value_impl(idx_t key, float* value) const override;
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    // batched: the inner index answers all the queries, then the merge
    void search_batch(
            idx_t n,
            const float* q,
            idx_t k,
            float* distances,
            idx_t* labels,
            const faiss::SearchParameters* params) const override;
    void select_batch(
            idx_t n,
            const float* q,
            Selection* sel,
            const faiss::SearchParameters* params) const override;
    void attend_batch(
            idx_t n,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params) const override;
};

} // namespace kvindex
