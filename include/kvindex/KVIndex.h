#pragma once

#include <cstdint>
#include <numeric>
#include <vector>

#include <faiss/Index.h>

#include <kvindex/rope.h>

namespace kvindex {

using idx_t = faiss::Index::idx_t;
struct KVStorage;

/// How a selection becomes an attention output (see attention.h).
enum class Estimator {
    /// softmax over the selected set, inclusion probabilities ignored
    /// (exact attention when the set is everything; TopK otherwise)
    topk = 0,
    /// importance weighted: softmax of s_i - log u_i over the set; lse
    /// estimates the log partition of all tokens (MagicPIG)
    unbiased = 1,
};

/** The token ids an attention step should read, with the probability with
 * which each one was included. Deterministic selections (top-k, static
 * tokens, eviction) have probability 1; samplers (LSH) report their u_i so
 * that the unbiased estimator can weight by exp(s_i) / u_i.
 */
struct Selection {
    std::vector<idx_t> ids;         ///< size n_selected, token positions
    std::vector<float> inclusion;   ///< size n_selected, in (0, 1]
    /// vectors the retrieval read to make this selection, in key-vector
    /// equivalents (keys scanned, centroids, graph nodes); the selected keys
    /// and values the estimator then reads are not included
    size_t n_scanned = 0;

    size_t size() const {
        return ids.size();
    }
    void clear() {
        ids.clear();
        inclusion.clear();
        n_scanned = 0;
    }
    /// Every token 0 .. n - 1, deterministically (u = 1), nothing scanned.
    void set_all(idx_t n) {
        ids.resize(n);
        std::iota(ids.begin(), ids.end(), idx_t(0));
        inclusion.assign(n, 1.0f);
        n_scanned = 0;
    }
    void push_back(idx_t id, float u = 1.0f) {
        ids.push_back(id);
        inclusion.push_back(u);
    }
};

/// Search-time parameters common to every KV index. Index types that have
/// knobs of their own subclass this; each index checks with dynamic_cast.
struct SearchParametersKV : faiss::SearchParameters {
    /// number of keys an index with a top-k budget selects per query;
    /// 0 means "use the index's own default" (KVIndex::k); < 0 is an error
    idx_t k = 0;
    /// select fills Selection::n_scanned (costs an extra coarse search for
    /// IVF; exact for HNSW only when one thread searches the index at a time)
    bool count_scanned = false;
};

/** Everything prefill knows, handed to the index in one call. Query-aware
 * indexes (RoarGraph, IVFAsym, eviction) learn from the queries; the others
 * only add the keys and values.
 */
struct PrefillInput {
    idx_t n_tokens = 0;            ///< number of prompt tokens
    const float* keys = nullptr;   ///< size n_tokens * d, post-RoPE
    const float* values = nullptr; ///< size n_tokens * d_value

    idx_t n_queries = 0;           ///< prefill queries per query head (may be 0)
    int n_query_heads = 1;         ///< query heads sharing this KV head (GQA group)
    /// size n_query_heads * n_queries * d (head-major), post-RoPE
    const float* queries = nullptr;
    /// size n_queries, the absolute token position of each query; nullptr
    /// means the last n_queries positions of the prompt
    const idx_t* query_positions = nullptr;
    /// absolute position of keys[0]: 0 for a whole prompt, n_sink for the
    /// inner index of a sink/window wrapper
    idx_t first_position = 0;

    RopeParams rope;               ///< the model's RoPE parameters
};

/** The KV cache of one (layer, KV head) as a Faiss index.
 *
 * Row id = token position. The index owns its keys (dimension d) and values
 * (dimension d_value). Faiss calls keep their meaning: `search` returns the
 * top-k keys by inner product (exact or approximate, per index type),
 * `reset`, `ntotal` and `reconstruct` work as in Faiss. `add` is refused,
 * since a key without its value is useless for attention: use `add_kv`.
 *
 * Attention uses scores s_i = <q, k_i> / sqrt(d).
 */
struct KVIndex : faiss::Index {
    int d_value;   ///< dimension of the values
    idx_t k = 100; ///< default top-k budget (index types with a budget), > 0
    /// how the default attend turns a selection into an output; unbiased
    /// equals topk for deterministic selections (every u_i = 1)
    Estimator estimator = Estimator::unbiased;

    RopeParams rope;        ///< set by the first prefill
    bool has_rope = false;  ///< whether a prefill has fixed `rope`

    explicit KVIndex(int d = 0, int d_value = -1);
    ~KVIndex() override;

    /// Refused with an exception: values are missing (use add_kv).
    void add(idx_t n, const float* x) override;

    /** Appends n tokens: ids ntotal .. ntotal + n - 1. Used by prefill and by
     * every decode step; all index types keep working while tokens arrive.
     *
     * @param keys    size n * d
     * @param values  size n * d_value
     */
    void add_kv(idx_t n, const float* keys, const float* values);

    /** Adds the prompt with everything prefill knows. The default adds the
     * keys and values; query-aware indexes override to learn from queries.
     * May be called on an empty index only.
     */
    virtual void prefill(const PrefillInput& input);

    /// Key of token `key` (size d); throws for an id out of range.
    void reconstruct(idx_t key, float* recons) const override;

    /// Value of token `key` (size d_value); throws for an id out of range.
    virtual void reconstruct_value(idx_t key, float* value) const;

    /** The tokens attention should read for each query, with inclusion
     * probabilities.
     *
     * @param q    queries, size n * d
     * @param sel  output, size n
     */
    virtual void select(
            idx_t n,
            const float* q,
            Selection* sel,
            const faiss::SearchParameters* params = nullptr) const = 0;

    /** Attention output per query: select + estimate by default,
     * out_i = softmax_{j in S}(s_j - log u_j) v_j, lse_i = log sum_{j in S} e^{s_j} / u_j.
     * Index types override this with fused kernels.
     *
     * @param q    queries, size n * d
     * @param out  output, size n * d_value
     * @param lse  log-sum-exp of the scores per query, size n (may be nullptr)
     */
    virtual void attend(
            idx_t n,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params = nullptr) const;

    /// Bytes of memory the index holds (keys, values, structures).
    virtual size_t memory_bytes() const = 0;

    /// The top-k budget for one call: params->k if set, else this->k.
    idx_t effective_k(const faiss::SearchParameters* params) const;

    /// The attention scale 1 / sqrt(d).
    float score_scale() const;

   protected:
    /// Keys and values of all tokens in order, for the default attend;
    /// index types that keep tokens elsewhere return nullptr and override attend.
    virtual const KVStorage* token_storage() const {
        return nullptr;
    }

    /// Appends already validated tokens; add_kv checks, then calls this.
    virtual void add_kv_impl(idx_t n, const float* keys, const float* values) = 0;

    /// Checks a prefill input, keys and values included; throws naming the
    /// problem. The caller records `rope` once the tokens are in.
    void check_prefill(const PrefillInput& input) const;

    /// Checks the arguments of search / select (n >= 0, q present and finite).
    void check_query_args(idx_t n, const float* q, const char* what) const;

    /// Throws for search parameters no kvindex type accepts: an IDSelector
    /// (not supported) or SearchParametersKV::k < 0.
    void check_params(const faiss::SearchParameters* params) const;

    /// check_query_args and check_params for search, plus k > 0.
    void check_search_args(
            idx_t n, const float* q, idx_t k, const faiss::SearchParameters* params) const;

    /// check_query_args for attend, plus a non-empty index and an output.
    void check_attend_args(idx_t n, const float* q, const float* out) const;
};

} // namespace kvindex
