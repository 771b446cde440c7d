#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>
#include <kvindex/KVStorage.h>

namespace kvindex {

struct FactoryChain;

/** Uniform random sampling with the unbiased estimator: each query reads
 * k tokens (its budget, as for top-k) drawn uniformly without replacement,
 * each included with probability u = k / n, and attention is
 * softmax(s_i - log u) over them (its lse estimates the log partition of
 * all n tokens). The baseline of the sampled tails (vAttention, arXiv
 * 2510.05688, samples uniformly), and the tail of IndexHybrid:
 * select_outside draws the whole sample from the tokens outside the heavy
 * hitters, u = k / (n - excluded).
 *
 * The draw is a function of (seed, stream, the query's bits, ntotal): the
 * same query on the same index reads the same tokens (calls are
 * reproducible and thread-safe), different seeds give independent draws.
 * Factory string: "Uniform". Knobs: k (tokens drawn; all when >= n), seed.
 */
struct IndexUniformSample : KVIndex {
    uint64_t seed = 1234;  ///< with `stream`, seeds every draw
    uint64_t stream = 0;   ///< one stream per (layer, head): set by KVCache
    KVStorage storage;     ///< keys and values of all tokens

    IndexUniformSample(int d, int d_value, KVType kv_type = KVType::f32);
    IndexUniformSample();

    /** The draw of one query: min(m, n - n_excluded) distinct ids among
     * [0, n) minus `excluded`, increasing. Exposed for tests.
     * @param excluded  size n_excluded, increasing ids in [0, n)
     */
    std::vector<idx_t> draw(
            const float* q, idx_t n, idx_t m, const idx_t* excluded, size_t n_excluded) const;

    size_t memory_bytes() const override;

    const char* type_name() const override {
        return "IndexUniformSample";
    }
    std::string factory_string() const override {
        return "Uniform";
    }
    std::vector<ParameterInfo> parameter_info() const override;
    bool set_parameter(const std::string& name, double value) override;
    bool get_parameter(const std::string& name, double* value) const override;
    void set_stream(uint64_t stream) override;
    idx_t top_k_budget() const override {
        return 0; // a sample, not the top-k: recall@k does not apply
    }
    bool samples_uniformly() const override {
        return true;
    }
    void write_fields(BufferWriter& w) const override;
    void read_fields(BufferReader& r, uint32_t version) override;
    void check_invariants() const override;

    /// Registry parser: "Uniform".
    static std::unique_ptr<KVIndex> from_factory(FactoryChain& chain);

   protected:
    void reset_impl() override;
    const KVStorage* token_storage() const override {
        return &storage;
    }
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    void select_one(const float* q, Selection& sel, const faiss::SearchParameters* params)
            const override;
    void select_outside_one(
            const float* q,
            const idx_t* excluded,
            size_t n_excluded,
            Selection& sel,
            const faiss::SearchParameters* params) const override;
};

} // namespace kvindex
