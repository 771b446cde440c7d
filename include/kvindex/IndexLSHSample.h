#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>
#include <kvindex/KVStorage.h>

namespace kvindex {

struct FactoryChain;

/// Search-time knobs of IndexLSHSample; < 0 keeps the index's own setting.
struct SearchParametersLSH : SearchParametersKV {
    int min_hits = -1;       ///< tables a key must collide in to be sampled
    idx_t max_sample = -1;   ///< cap on the sample size (0: none)
};

/** Probability that a key collides with the query in at least min_hits of
 * L tables of K SimHash bits, for an angle theta between them:
 * p = 1 - theta/pi, P = p^K, u = P[Binomial(L, P) >= min_hits]
 * (= 1 - (1-P)^L - L P (1-P)^(L-1) for min_hits = 2, as in MagicPIG).
 */
double lsh_inclusion_probability(double theta, int K, int L, int min_hits);

/** MagicPIG's LSH sampling with the unbiased attention estimator ("MagicPIG:
 * LSH Sampling for Efficient LLM Generation", arXiv 2410.16179).
 *
 * Keys are centred by the mean of the keys hashed at the first add (kept
 * fixed afterwards, so existing codes stay valid) and hashed by SimHash: K
 * sign bits per table, L tables, from one seeded Gaussian matrix. A query is
 * hashed raw; the keys that share its bucket in at least min_hits tables
 * form the sample, each with its exact inclusion probability u_i (from the
 * angle between the query and the centred key), and attention is
 * softmax(s_i - log u_i) over the sample: its lse is an unbiased-style
 * estimate of the log partition of all tokens. Compose with the static part:
 * "Sink4,Window64,LSHSample10x150" (MagicPIG's setting).
 *
 * Tables are CSR per table: 2^K + 1 bucket offsets and the token ids sorted
 * by bucket, in 16-bit ids while they fit, 32-bit after. Tokens appended
 * after the last build are kept in a short tail, checked code by code, and
 * folded into the tables when the tail reaches 1/8 of them.
 * Factory string: "LSHSample<K>x<L>". Knobs: k, min_hits, max_sample.
 */
struct IndexLSHSample : KVIndex {
    int K = 10;            ///< bits per table, 1..16
    int L = 150;           ///< tables
    int min_hits = 2;      ///< collisions needed (0: every token, u = 1)
    idx_t max_sample = 0;  ///< keep at most this many sampled keys, by score (0: all)
    uint64_t seed = 1234;  ///< seed of the hyperplanes

    std::vector<float> planes;   ///< size K * L * d: hyperplane r at planes[r * d]
    std::vector<float> mean;     ///< size d: the centring mean (empty before the first add)
    std::vector<float> norms;    ///< size ntotal: |k_i - mean|
    std::vector<uint16_t> codes; ///< size ntotal * L: code of token i in table l at i * L + l
    KVStorage storage;           ///< keys and values

    idx_t n_indexed = 0;               ///< tokens in the CSR tables; the rest are the tail
    std::vector<uint32_t> offsets;     ///< size L * (2^K + 1)
    std::vector<uint16_t> ids16;       ///< size L * n_indexed when n_indexed <= 65536
    std::vector<uint32_t> ids32;       ///< size L * n_indexed otherwise

    IndexLSHSample(int d, int d_value, int K, int L, KVType kv_type = KVType::f32);
    IndexLSHSample();

    /// Draws the hyperplanes from `seed` (empty index only).
    void set_seed(uint64_t seed);

    /// The K * L sign bits of (x - center) (center may be nullptr), as L codes.
    void hash(const float* x, const float* center, uint16_t* out_codes) const;

    size_t memory_bytes() const override;
    /// Bytes of the hash tables and codes alone (excluding keys and values).
    size_t table_bytes() const;

    /// Rebuilds the CSR tables over the first n tokens (default: all; the
    /// rest stay in the tail).
    void build_tables(idx_t n = -1);

    const char* type_name() const override {
        return "IndexLSHSample";
    }
    std::string factory_string() const override {
        return "LSHSample" + std::to_string(K) + "x" + std::to_string(L);
    }
    std::vector<ParameterInfo> parameter_info() const override;
    bool set_parameter(const std::string& name, double value) override;
    bool get_parameter(const std::string& name, double* value) const override;
    void write_fields(BufferWriter& w) const override;
    void read_fields(BufferReader& r, uint32_t version) override;
    void check_invariants() const override;

    /// Registry parser: "LSHSample<K>x<L>".
    static std::unique_ptr<KVIndex> from_factory(FactoryChain& chain);

   protected:
    void reset_impl() override;
    const KVStorage* token_storage() const override {
        return &storage;
    }
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    // search_one is the default: the sample ranked by inner product
    void select_one(const float* q, Selection& sel, const faiss::SearchParameters* params)
            const override;
    /// fused: hash, count collisions, then the unbiased estimator
    float attend_one(const float* q, float* out, const faiss::SearchParameters* params)
            const override;

   private:
    /// min_hits and max_sample for one call: params override the fields.
    void knobs(const faiss::SearchParameters* params, int* hits, idx_t* cap) const;

    /** The sample of one query: ids and inclusion probabilities in sel, and
     * <q, k_i> of each sampled key in dots (computed for u anyway, reused by
     * attend and search). count is a zeroed per-thread counter array. */
    void sample_one(
            const float* q,
            int hits,
            idx_t cap,
            Selection& sel,
            std::vector<float>& dots,
            std::vector<uint8_t>& count) const;
};

} // namespace kvindex
