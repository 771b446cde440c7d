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

    std::vector<SearchKnob> set_knobs() const override;
    std::unique_ptr<SearchParametersKV> without_knob(const std::string& name) const override;
};

/** Probability that a key collides with the query in at least min_hits of
 * L tables of K SimHash bits, for an angle theta between them:
 * p = 1 - theta/pi, P = p^K, u = P[Binomial(L, P) >= min_hits]
 * (= 1 - (1-P)^L - L P (1-P)^(L-1) for min_hits = 2, as in MagicPIG).
 */
double lsh_inclusion_probability(double theta, int K, int L, int min_hits);

/** lsh_inclusion_probability as a function of c = cos(theta), tabulated
 * once per (K, L, min_hits) so that a query pays no acos, pow, exp or log
 * per sampled key: one sqrt, one table cell and a cubic polynomial.
 *
 * Layout: two halves of the angle, each smooth in its own variable (which
 * removes the square-root singularities of acos at c = +-1):
 *  - c >= 0: s = sqrt((1 - c) / 2) = sin(theta/2) in [0, 1/sqrt(2)], the
 *    table holds log u;
 *  - c <  0: r = sqrt((1 + c) / 2) = cos(theta/2) in (0, 1/sqrt(2)], the
 *    table holds log u - m K log r (u ~ C(L, m) (2r/pi)^(mK) as r -> 0, so
 *    this is smooth up to theta = pi), and m K log r is added back with a
 *    polynomial logarithm (|error| < 1e-12 per unit of m K).
 * Each half is N cells with a cubic through 4 equispaced exact values per
 * cell (continuous at the nodes). N doubles from 32 until the largest
 * error of log u at 3 check points per cell is below kBuildTarget (N is
 * capped at 2^16; max_log_error() reports what was reached).
 *
 * Error bound: |log u_table - log max(u, kMinInclusion)| <= kMaxLogError
 * (1e-7) for every c in [-1, 1], i.e. the relative error of u (and of the
 * estimator's weights 1/u) is below 1.0000001e-7 wherever u >= kMinInclusion.
 * Tiny u: below kMinInclusion = 1e-30 (theta near pi, large K * min_hits)
 * the table returns exactly kMinInclusion, the same floor the exact path
 * applied, so weights 1/u stay finite. The bound is the one verified by
 * tests/test_lsh_speed_paths.cpp over K in [1, 16], L up to 300 and
 * min_hits 1..3; for larger K * min_hits the build keeps refining until its
 * check points meet kBuildTarget. min_hits = 0 is u = 1 (no table needed).
 */
class LSHInclusionTable {
   public:
    static constexpr double kMinInclusion = 1e-30;
    static constexpr double kMaxLogError = 1e-7;
    static constexpr double kBuildTarget = 1e-8;

    /// Builds the table (costs some thousands of exact evaluations).
    LSHInclusionTable(int K, int L, int min_hits);

    /// The table of (K, L, min_hits), built once per process and shared.
    static std::shared_ptr<const LSHInclusionTable> get(int K, int L, int min_hits);

    /// log u for cos(theta) = c (clamped to [-1, 1]); >= log(kMinInclusion).
    double log_inclusion(double c) const;
    /** out[t] = float(log_inclusion(c[t])) for t < n (c, out: size n): eight
     * lanes at a time where the CPU runs SimdLevel::avx512, the same
     * arithmetic (with fused multiply-adds: within a float's rounding of
     * the scalar value), one value at a time elsewhere. */
    void log_inclusion(const double* c, size_t n, float* out) const;
    /// u = exp(log_inclusion(c)).
    double inclusion(double c) const;

    int K() const {
        return K_;
    }
    int L() const {
        return L_;
    }
    int min_hits() const {
        return m_;
    }
    /// cells per half
    int cells() const {
        return n_;
    }
    /// largest |error of log u| measured at the build's check points
    double max_log_error() const {
        return max_err_;
    }

   private:
    int K_, L_, m_;
    int n_ = 0;
    double inv_h_ = 0;      ///< cells per unit of s (or r)
    double mk_ = 0;         ///< m * K
    double log_floor_ = 0;  ///< log(kMinInclusion)
    double max_err_ = 0;
    /// 4 coefficients per cell, size 8 * n_: the n_ cells of c >= 0 (in
    /// s = sin(theta / 2)), then the n_ cells of c < 0 (in r = cos(theta / 2))
    std::vector<double> coef_;
};

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
 * by bucket, each kept as its 16-bit gap from the one before (table_words).
 * Tokens appended after the last build are kept in a tail, folded into the
 * tables when it reaches 1/8 of them; a fold merges the tail into each
 * bucket, so only the tail keeps its tokens' codes (L * 2 bytes a token: as
 * much as the tables themselves). The tail has CSR tables of its own
 * (recent_*), rebuilt when more than max(256, tail / 16) tokens arrived
 * after them; only those last tokens are checked code by code.
 *
 * Per query the work is proportional to the buckets the query falls in:
 * for min_hits <= 2 (MagicPIG's setting) the walk of the L buckets marks
 * two per-thread bitsets (hit once, hit twice), whose words give the sample
 * in id order (scanning and clearing them is ntotal / 64 words, ~1/4000 of
 * the key bytes); for larger min_hits collisions are counted in a uint8
 * (uint16 when min_hits > 254) scratch reset through the list of touched
 * ids, and the sample is radix-sorted. The key
 * and value rows are prefetched ahead of the gathered dot products and
 * weighted sum; u comes from an LSHInclusionTable (no acos / binomial per
 * key), and attend feeds log u straight to the softmax.
 * Factory string: "LSHSample<K>x<L>". Knobs: min_hits, max_sample (no k:
 * the sample size is set by K and L).
 */
struct IndexLSHSample : KVIndex {
    int K = 10;            ///< bits per table, 1..16
    int L = 150;           ///< tables
    int min_hits = 2;      ///< collisions needed (0: every token, u = 1)
    idx_t max_sample = 0;  ///< keep at most this many sampled keys, by score (0: all)
    uint64_t seed = 1234;  ///< seed of the hyperplanes

    std::vector<float> planes;   ///< size K * L * d: hyperplane r at planes[r * d]
    std::vector<float> mean;     ///< size d: the centring mean (empty before the first add)
    /// size K * L once a key is hashed: planes · mean, projected once (not
    /// once per key); derived from planes and mean, not written by io
    std::vector<float> mean_projection;
    std::vector<float> norms;    ///< size ntotal: |k_i - mean|
    /// size (ntotal - n_indexed) * L: the codes of the tokens not in the
    /// main tables, token n_indexed + i's code in table l at i * L + l (the
    /// tables hold the others': all_codes())
    std::vector<uint16_t> codes;
    KVStorage storage;           ///< keys and values (empty while shared)
    /// the tokens lent by a parent (share_tokens: IndexHybrid's heavy
    /// part's), read instead of `storage`; nullptr: its own
    const KVStorage* shared_tokens = nullptr;

    idx_t n_indexed = 0;               ///< tokens in the CSR tables; the rest are the tail
    /// size L * (2^K + 1): table l's bucket b is table_words
    /// [table_begin[l] + offsets[l * (2^K + 1) + b], ... + b + 1])
    std::vector<uint32_t> offsets;
    std::vector<size_t> table_begin;   ///< size L + 1 (tables non-empty): table l's first word
    /** The main tables' ids, bucket after bucket, ascending in each, as
     * 16-bit gaps (impl/gap_codes.h): half the bytes of the 32-bit ids a
     * table of more than 2^16 tokens would need. Size table_begin[L]: L *
     * n_indexed words, plus 2 per gap of 2^16 or more (rare while a table
     * has fewer than 2^16 buckets). */
    std::vector<uint16_t, HugePageAllocator<uint16_t>> table_words;
    /// tokens [n_indexed, n_recent) are in the tail's tables, the rest are scanned
    idx_t n_recent = 0;
    std::vector<uint32_t> recent_offsets; ///< size L * (2^K + 1) when n_recent > n_indexed
    std::vector<uint32_t> recent_ids;     ///< size L * (n_recent - n_indexed), absolute ids

    IndexLSHSample(int d, int d_value, int K, int L, KVType kv_type = KVType::f32);
    IndexLSHSample();

    /// Draws the hyperplanes from `seed` (empty index only).
    void set_seed(uint64_t seed);

    /// The K * L sign bits of (x - center) (center may be nullptr), as L codes.
    void hash(const float* x, const float* center, uint16_t* out_codes) const;

    /// The same from the center's projection (size K * L, planes · center,
    /// or nullptr): the bits of planes · x - center_projection.
    void hash_projected(const float* x, const float* center_projection, uint16_t* out_codes) const;

    /** What sampling for a query of codes qc (size L, from hash) reads
     * besides the rows of its sample, in stored-key equivalents
     * (Selection::n_scanned): the K * L float hyperplanes, the query's
     * bucket in every table of both levels (bounds and ids), the codes of
     * the tokens in neither level, and the norms of the `sampled` keys. */
    size_t sample_reads(const uint16_t* qc, size_t sampled) const;

    /// `storage`, or the tokens lent
    const KVStorage& tokens() const {
        return shared_tokens ? *shared_tokens : storage;
    }
    bool share_tokens(const KVStorage* lent) override;
    /// add_kv restores every array's size when it throws; the tables are
    /// built aside and swapped in
    bool writes_roll_back() const override {
        return true;
    }
    /// the arrays shrink back; tables an append rebuilt are kept until
    /// forget_undo (they were built aside anyway)
    bool can_undo_add() const override {
        return true;
    }

    /// its own storage and tables: lent tokens are counted by their owner
    size_t memory_bytes() const override;
    /// Bytes of the hash tables and codes alone (excluding keys and values).
    size_t table_bytes() const;

    /// Folds the tail's first tokens into the CSR tables, so that they hold
    /// the first n tokens (default: all; n >= n_indexed; the rest stay in
    /// the tail), and drops their codes.
    void build_tables(idx_t n = -1);

    /// The L codes of token i, one in no main table (i >= n_indexed).
    uint16_t* tail_codes(idx_t i) {
        return codes.data() + size_t(i - n_indexed) * L;
    }
    const uint16_t* tail_codes(idx_t i) const {
        return codes.data() + size_t(i - n_indexed) * L;
    }
    /// Every token's codes, size ntotal * L (token i's at i * L), those of
    /// the tokens in the tables read back from them.
    std::vector<uint16_t> all_codes() const;
    /** The main tables with plain ids, as the GPU mirror reads them:
     * offsets of size L * (2^K + 1), table l's bucket b holding
     * ids[l * n_indexed + offsets[l * (2^K + 1) + b], ... + b + 1]); ids of
     * size L * n_indexed. */
    void plain_tables(std::vector<uint32_t>& plain_offsets, std::vector<int32_t>& ids) const;

    const char* type_name() const override {
        return "IndexLSHSample";
    }
    std::string factory_string() const override {
        return "LSHSample" + std::to_string(K) + "x" + std::to_string(L);
    }
    /// min_hits and max_sample (SearchParametersLSH)
    bool reads_search_knob(const std::string& name) const override;
    std::vector<ParameterInfo> parameter_info() const override;
    bool selects_deterministically() const override {
        return false; // a sample: inclusion u <= 1
    }
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
        return &tokens();
    }
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    void undo_add_kv_impl(idx_t n) override;
    void forget_undo_impl() noexcept override;
    // search_one is the default: the sample ranked by inner product
    void select_one(const float* q, Selection& sel, const faiss::SearchParameters* params)
            const override;
    /// fused: hash, count collisions, then the unbiased estimator
    float attend_one(const float* q, float* out, const faiss::SearchParameters* params)
            const override;

   private:
    /** What the last add_kv kept for undo_add_kv (keeping_undo()): the
     * sizes of the arrays it grew, and the tables it replaced (swapped out
     * by build_tables / build_recent_tables, which free them otherwise). */
    struct Undo {
        bool had_mean = false, had_projection = false;
        size_t n_codes = 0, n_norms = 0;
        bool main_saved = false; ///< offsets .. n_indexed below hold the old main tables
        std::vector<uint32_t> offsets;
        std::vector<size_t> table_begin;
        std::vector<uint16_t, HugePageAllocator<uint16_t>> table_words;
        std::vector<uint16_t> codes;
        idx_t n_indexed = 0;
        bool recent_saved = false; ///< the old tail tables
        std::vector<uint32_t> recent_offsets, recent_ids;
        idx_t n_recent = 0;
    };
    Undo undo;
    /// Keeps the tail tables being replaced (held by old_offsets, old_ids)
    /// for the append's undo, once per append (keeping_undo()).
    void keep_recent_for_undo(std::vector<uint32_t>& old_offsets, std::vector<uint32_t>& old_ids);
    /// min_hits and max_sample for one call: params override the fields.
    void knobs(const faiss::SearchParameters* params, int* hits, idx_t* cap) const;

    /** The sample of one query, ids ascending: ids in sel, <q, k_i> of each
     * sampled key in dots (computed for u anyway, reused by attend) and
     * log u_i in log_u; sel.inclusion is left empty (select fills it).
     * sel.n_scanned is counted only when count_reads (select reports it;
     * attend has no use for it). */
    void sample_one(
            const float* q,
            int hits,
            idx_t cap,
            bool count_reads,
            Selection& sel,
            std::vector<float>& dots,
            std::vector<float>& log_u) const;

    /// Rebuilds the tail's tables over [n_indexed, ntotal).
    void build_recent_tables();
    /// add_kv's work after the tokens are stored: the mean (first call),
    /// the n keys' codes and norms, then the tables if they are due.
    void hash_new_keys(idx_t n, const float* keys);

    /// The inclusion table of (K, L, hits): the one held if it matches.
    std::shared_ptr<const LSHInclusionTable> table_for(int hits) const;
    /// Fetches the table of (K, L, min_hits) into `table` (non-const paths).
    void refresh_table();

    std::shared_ptr<const LSHInclusionTable> table; ///< of (K, L, min_hits), or null
};

} // namespace kvindex
