#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kvindex/IndexSampleBase.h>

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
struct IndexUniformSample : IndexSampleBase {
    IndexUniformSample(int d, int d_value, KVType kv_type = KVType::f32);
    IndexUniformSample();

    /** The draw of one query: min(m, n - n_excluded) distinct ids among
     * [0, n) minus `excluded`, increasing. Exposed for tests.
     * @param excluded  size n_excluded, increasing ids in [0, n)
     */
    std::vector<idx_t> draw(
            const float* q, idx_t n, idx_t m, const idx_t* excluded, size_t n_excluded) const;

    const char* type_name() const override {
        return "IndexUniformSample";
    }
    std::string factory_string() const override {
        return "Uniform";
    }
    bool samples_uniformly() const override {
        return true;
    }
    /// Registry parser: "Uniform".
    static std::unique_ptr<KVIndex> from_factory(FactoryChain& chain);

   protected:
    void select_outside_one(
            const float* q,
            const idx_t* excluded,
            size_t n_excluded,
            Selection& sel,
            const faiss::SearchParameters* params) const override;
};

} // namespace kvindex
