#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>
#include <kvindex/KVStorage.h>

namespace kvindex {

/** What the samplers that read a per-query random sample of their own
 * tokens share (IndexUniformSample, IndexWeightedSample): the tokens, the
 * seed and the per-head stream of their draws, the "seed" knob and the
 * record (seed, stream, tokens). A sampler adds its draw
 * (select_outside_one; select_one is that draw with nothing excluded) and
 * its factory element.
 */
struct IndexSampleBase : KVIndex {
    uint64_t seed = 1234;  ///< with `stream`, seeds every draw; <= 2^53 (a knob)
    uint64_t stream = 0;   ///< one stream per (layer, head): set by KVCache
    KVStorage storage;     ///< keys and values of all tokens (empty while shared)
    /// the tokens lent by a parent (share_tokens: IndexHybrid's heavy
    /// part's), read instead of `storage`; nullptr: its own
    const KVStorage* shared_tokens = nullptr;

    IndexSampleBase(int d, int d_value, KVType kv_type);
    IndexSampleBase();

    /// `storage`, or the tokens lent
    const KVStorage& tokens() const {
        return shared_tokens ? *shared_tokens : storage;
    }
    bool share_tokens(const KVStorage* lent) override;
    /// its only write is one KVStorage append, which allocates first
    bool writes_roll_back() const override {
        return true;
    }
    bool can_undo_add() const override {
        return true;
    }

    /// its own storage only: lent tokens are counted by their owner
    size_t memory_bytes() const override;
    std::vector<ParameterInfo> parameter_info() const override;
    bool selects_deterministically() const override {
        return false; // a sample: inclusion u <= 1
    }
    bool reads_search_knob(const std::string& name) const override {
        return name == "k"; // the size of the draw
    }
    bool set_parameter(const std::string& name, double value) override;
    bool get_parameter(const std::string& name, double* value) const override;
    void set_stream(uint64_t stream) override;
    idx_t top_k_budget() const override {
        return 0; // a sample, not the top-k: recall@k does not apply
    }
    void write_fields(BufferWriter& w) const override;
    void read_fields(BufferReader& r, uint32_t version) override;
    void check_invariants() const override;

   protected:
    /// The first state of the random generator for the draw of query q
    /// over n tokens: a function of (seed, stream, the query's bits, n).
    uint64_t draw_state(const float* q, idx_t n) const;

    /// The draw over every token: select_outside_one with nothing excluded.
    void select_one(const float* q, Selection& sel, const faiss::SearchParameters* params)
            const override;

    void reset_impl() override;
    const KVStorage* token_storage() const override {
        return &tokens();
    }
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    void undo_add_kv_impl(idx_t n) override;
};

} // namespace kvindex
