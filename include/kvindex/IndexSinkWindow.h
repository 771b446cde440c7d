#pragma once

#include <memory>

#include <kvindex/KVIndex.h>
#include <kvindex/KVStorage.h>

namespace kvindex {

/** The static part every sparse-attention method keeps: the first n_sink
 * tokens (attention sinks) and the n_window most recent tokens are attended
 * exactly; the tokens between them live in the inner index, whose estimate is
 * merged with the exact part by log-sum-exp.
 *
 * The split stays disjoint as tokens are appended: a new token enters the
 * window, and the oldest window token moves into the inner index. Token
 * n_sink + j of this index is token j of the inner index.
 */
struct IndexSinkWindow : KVIndex {
    idx_t n_sink = 0;               ///< first tokens kept exact
    idx_t n_window = 0;             ///< most recent tokens kept exact
    std::unique_ptr<KVIndex> inner; ///< tokens n_sink .. ntotal - n_window - 1
    KVStorage sink;                 ///< min(ntotal, n_sink) tokens
    KVStorage window;               ///< the tokens after sink not yet in inner (<= n_window)

    IndexSinkWindow(idx_t n_sink, idx_t n_window, std::unique_ptr<KVIndex> inner);
    IndexSinkWindow();

    void prefill(const PrefillInput& input) override;

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
    void reconstruct(idx_t key, float* recons) const override;
    void reconstruct_value(idx_t key, float* value) const override;
    size_t memory_bytes() const override;

    /// Position of the first window token (= n_sink + inner->ntotal).
    idx_t window_start() const;

   protected:
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
};

} // namespace kvindex
