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
 * n_sink + j of this index is token j of the inner index. Once full, the
 * window is a ring: a new token takes the slot of the one that left, so
 * that an append costs one token whatever n_window (not a move of the
 * whole window).
 * Factory string: "Sink<n>,Window<m>,<index>" (either count may be left out).
 */
struct IndexSinkWindow : KVIndex {
    idx_t n_sink = 0;               ///< first tokens kept exact
    idx_t n_window = 0;             ///< most recent tokens kept exact
    std::unique_ptr<KVIndex> inner; ///< tokens n_sink .. ntotal - n_window - 1
    KVStorage sink;                 ///< min(ntotal, n_sink) tokens
    /// the tokens after sink not yet in inner (<= n_window), in slots: the
    /// oldest at slot window_head, then in order, wrapping to slot 0
    KVStorage window;
    /// slot of the oldest window token (0 until the window is full)
    idx_t window_head = 0;

    IndexSinkWindow(idx_t n_sink, idx_t n_window, std::unique_ptr<KVIndex> inner);
    IndexSinkWindow();

    size_t memory_bytes() const override;
    /// as its inner index's: its own rows are reserved before that is written
    bool writes_roll_back() const override;
    bool appends_roll_back() const override {
        return inner && inner->appends_roll_back();
    }
    /// as its inner index's: it keeps the window rows an append moves out
    bool can_undo_add() const override;

    /// Position of the first window token (= n_sink + inner->ntotal).
    idx_t window_start() const;
    /// Slot in `window` of its j-th oldest token (j < window.size()).
    idx_t window_slot(idx_t j) const {
        idx_t s = window_head + j;
        return s < window.size() ? s : s - window.size();
    }

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

   private:
    /// The window's j0..j0+n-1 oldest tokens as floats (sizes n * d, n * d_value).
    void window_to_float(idx_t j0, idx_t n, std::vector<float>* k, std::vector<float>* v) const;
    /// m <= n_window new tokens enter the window: appended while it fills,
    /// then each in the slot of the oldest (which has left for the inner index).
    void push_window(idx_t m, const float* keys, const float* values);

    /// What the last add_kv kept for undo_add_kv (keeping_undo()): the
    /// sink's and window's sizes and head before it, whether it appended
    /// to the inner index, and the rows that left the window for the inner
    /// index, as floats (the stored values, exactly), oldest first.
    struct Undo {
        idx_t sink_size = 0, window_size = 0, window_head = 0;
        bool inner_added = false;
        idx_t n_left = 0;                 ///< rows that left the window
        std::vector<float> keys, values;  ///< size >= n_left * d, n_left * d_value
    };
    Undo undo;

   protected:
    void prefill_impl(const PrefillInput& input) override;
    void reset_impl() override;
    void reconstruct_impl(idx_t key, float* recons) const override;
    void reconstruct_value_impl(idx_t key, float* value) const override;
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    void undo_add_kv_impl(idx_t n) override;
    void forget_undo_impl() noexcept override;
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
