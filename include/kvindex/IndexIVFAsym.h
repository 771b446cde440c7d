#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kvindex/IVFAsymTrainer.h>
#include <kvindex/KVIndex.h>
#include <kvindex/KVStorage.h>
#include <kvindex/QModel.h>

namespace kvindex {

struct FactoryChain;

/// How a query picks its buckets.
enum class IVFAsymProbe {
    /// SAAP: the top-nprobe outputs of the Q-model on the de-RoPEd query
    qmodel = 0,
    /// baseline: the nprobe centroids of largest <q', c> (q' de-RoPEd)
    centroid = 1,
    /// baseline, the paper's symmetric IVF: the same on the RoPEd query
    centroid_rope = 2,
    /** diagnostic upper bound: the nprobe buckets of largest exact
     * attention mass, found by scoring every key (n_scanned = ntotal). What
     * no classifier can beat on these buckets: the gap between it and
     * qmodel is routing, the gap between it and exact is the partition. */
    oracle = 3,
    /** training-free: the nprobe buckets of largest estimated mass,
     * log n_b + s <q, mu_b> + var_weight s^2/2 sum_j q_j^2 var_bj
     * (s = score scale), from each bucket's mean and per-dimension
     * variance of its keys as stored (post-RoPE, so in the space the
     * scores are taken in; what the query's position does to the
     * de-RoPEd centroids does not matter). var_weight = 0: Jensen's lower
     * bound of log sum_b exp(s <q, k>); 1: the Gaussian's log E exp. */
    moment = 4,
};

/** SAAP's asymmetric partitions ("Inference-time sparse attention with
 * asymmetric indexing", arXiv 2502.08246): keys in k-means buckets, queries
 * routed by a classifier trained to predict where their attention mass is.
 *
 * Keys: each key, de-RoPEd (rotated back by its position with the
 * prefill's RoPE parameters), goes to its nearest centroid (L2, as k-means
 * assigned the training keys); each bucket keeps its keys and values
 * contiguous (one KVStorage per bucket, so a decode-time append costs O(1),
 * where one CSR array would move every later bucket).
 *
 * Queries: the query is de-RoPEd at its position, first_position + ntotal
 * + n_after - 1 (the newest token of the sequence: decode appends, then
 * attends; n_after is the window a wrapper holds after our tokens), and
 * the Q-model's nprobe most probable buckets are read. attend = exact
 * softmax over every key of those buckets (not top-k), one dense pass per
 * bucket, merged by lse; compose with the static part as the paper does:
 * "Sink1,Window511,IVFAsym64". nprobe = C reads every key (exact); nprobe
 * = 0 reads none (a wrapper's static part alone). Selection::n_scanned =
 * the bytes of the classifier's weights or of the C centroids, in stored
 * keys (probe_cost).
 *
 * GQA (group_probe = 1, the paper's batched queries): an attend call whose
 * n queries are g = group_size heads x n / g, head-major (what KVCache
 * sends), picks one bucket set per query position from the summed
 * classifier outputs (centroid probing: summed scores) and reads each of
 * its buckets once for the g heads (dense_attention_group). search and
 * select stay per query.
 *
 * Training: offline (kvllm train, IVFAsymTrainer) into an index whose
 * prefill then only assigns keys (adopt_trained copies the models from a
 * trained index of the same shape); an index with no trained models trains
 * both on its own prompt at prefill (k-means on its keys, the Q-model on
 * its prefill queries with causal targets, min_distance = n_after; our
 * extension, the paper found prompt fine-tuning did not help). The
 * Q-model's rows are a uniform draw of the prompt's queries plus every
 * query of its last 128 positions counted 8 times (the question, which
 * decode queries resemble: IVFAsymTrainingParams::recent_positions),
 * window queries included. Tokens that arrive before any model exists
 * (add_kv on a fresh or reset index, a prompt of fewer than C keys) wait
 * in an unassigned run that every query reads exactly. Self-trained models
 * are dropped by reset; adopted ones stay. Figures: benchmarks/RESULTS.md,
 * "IVFAsym (SAAP)".
 *
 * Per call: SearchParametersTopK::nprobe (IndexTopK.h). Factory strings:
 * "IVFAsym<C>" (Q-model), "IVFAsym<C>_Centroid", "IVFAsym<C>_CentroidRoPE",
 * "IVFAsym<C>_Oracle" (routing by the buckets' exact mass: a ceiling for
 * analysis, it reads every key), "IVFAsym<C>_Moment" (training-free
 * routing by each bucket's key moments, see IVFAsymProbe::moment: our
 * addition, not in the paper; self-training then runs k-means only).
 * Knobs: nprobe, group_probe, var_weight (_Moment only); prefill-time:
 * hidden, train_iterations, min_distance (-1: n_after; the three the Q-model probe's only), seed.
 */
struct IndexIVFAsym : KVIndex {
    int n_centroids = 0;                     ///< C
    IVFAsymProbe probe = IVFAsymProbe::qmodel;
    int nprobe = 4;                          ///< buckets read per query (ell), 0..C
    bool group_probe = false;                ///< one bucket set per GQA group (see above)
    float var_weight = 0.0f;                 ///< moment probe: weight of the variance term

    // prefill-time knobs of self-training
    int hidden = 256;                        ///< Q-model width
    int train_iterations = -1;               ///< Adam steps; -1: 10 epochs of the rows, 50..2000
    idx_t min_distance = -1;                 ///< -1: n_after (the window)
    uint64_t seed = 1234;                    ///< with `stream`, seeds self-training; <= 2^53 (a knob)
    uint64_t stream = 0;                     ///< one stream per (layer, head): set by KVCache

    // the trained models
    std::vector<float> centroids;            ///< size C * d (de-RoPEd key space), empty: untrained
    QModel qmodel;                           ///< empty: not trained (centroid probing is used)
    bool adopted = false;                    ///< models adopted from a trained index (kept by reset)
    double train_seconds = 0;                ///< the last self-training at prefill (0 after read_index: not written)

    // the tokens
    idx_t first_position = 0;                ///< position of token 0 (prefill)
    /// tokens a wrapper holds after ours (prefill; tokens_appended_after adds)
    idx_t n_after = 0;
    int group_size = 1;                      ///< query heads per KV head (prefill)
    /// size C + 1: bucket c's tokens; bucket C is the unassigned run
    std::vector<KVStorage> buckets;
    /// size C + 1: token ids of each bucket, ascending
    std::vector<std::vector<idx_t>> bucket_ids;
    std::vector<int32_t> token_bucket;       ///< size ntotal: bucket of each token
    /// moment probe, derived from the buckets (not stored; empty for the
    /// other probes): size C * d each, the sums of each bucket's keys as
    /// stored and of their squares, and the mean and variance they give
    std::vector<double> key_sum, key_sq_sum;
    std::vector<float> bucket_mean, bucket_var;

    IndexIVFAsym(int d, int d_value, int n_centroids, IVFAsymProbe probe, KVType kv_type = KVType::f32);
    IndexIVFAsym();

    bool is_trained_models() const {
        return !centroids.empty();
    }
    /// Position of a decode query: the newest token of the sequence.
    idx_t query_position() const {
        return first_position + ntotal + n_after - 1;
    }

    // Diagnostics of the probe, for tools and tests. Each checks its query
    // (d finite floats, |x| <= kMaxInputMagnitude), position (>= 0) and
    // that the models are trained, as search does at its boundary.

    /** The buckets query q (post-RoPE, at `position`) reads: `nprobe` of
     * them, best first (the unassigned run is not listed); out has nprobe
     * entries. */
    void probe_buckets(const float* q, idx_t position, int nprobe, int32_t* out) const;
    /// Scores of the C buckets for query q (probabilities, <q, c> or
    /// masses); scores has C entries.
    void bucket_scores(const float* q, idx_t position, float* scores) const;
    /** The moment probe's estimate of log sum_{k in b} exp(s <q, k>) for
     * each of the C buckets (-inf for an empty one); with var_weight = 0 a
     * lower bound (Jensen). Needs the moment probe; log_masses has C
     * entries. */
    void moment_log_masses(const float* q, float* log_masses) const;

    /// Selection::n_scanned of one probe, in stored-key equivalents: the
    /// classifier's float weights (one per multiply-add) or the C float
    /// centroids (and variances), by their bytes; ntotal for the oracle;
    /// 0 untrained.
    size_t probe_cost() const;

    /// Copies centroids and Q-model (and their RoPE) from a trained model.
    void set_trained(const std::vector<float>& centroids, const QModel& qmodel, const RopeParams& rope);

    /// Throws what set_trained would throw (tokens held, sizes, NaN/Inf,
    /// the Q-model's shape, RoPE), and changes nothing.
    void check_set_trained(const std::vector<float>& centroids, const QModel& qmodel, const RopeParams& rope)
            const;

    size_t memory_bytes() const override;
    /// add_kv appends to the buckets with its room made first and undoes
    /// them on a throw; a prefill that throws resets
    bool writes_roll_back() const override {
        return true;
    }
    /// an append's tokens are the last rows of their buckets
    bool can_undo_add() const override {
        return true;
    }

    const char* type_name() const override {
        return "IndexIVFAsym";
    }
    std::string factory_string() const override;
    bool needs_contiguous_positions() const override {
        return true; // keys and queries are de-RoPEd at their positions
    }
    /// the decode query moves on: n_after grows (checked below 2^62 by the
    /// caller's own count)
    void tokens_appended_after(idx_t n) noexcept override {
        n_after += n;
    }
    /// adopted models carry the RoPE they were trained under
    bool rope_fixed_by_models() const override {
        return adopted;
    }
    /// nprobe, the buckets read (SearchParametersTopK)
    bool reads_search_knob(const std::string& name) const override;
    std::vector<ParameterInfo> parameter_info() const override;
    bool set_parameter(const std::string& name, double value) override;
    bool get_parameter(const std::string& name, double* value) const override;
    void set_stream(uint64_t stream) override;
    int adopt_trained(const KVIndex& trained) override;
    void check_adopt_trained(const KVIndex& trained) const override;
    void write_fields(BufferWriter& w) const override;
    void read_fields(BufferReader& r, uint32_t version) override;
    void check_invariants() const override;

    /// Registry parser: "IVFAsym<C>[_Centroid|_CentroidRoPE|_Oracle|_Moment]".
    static std::unique_ptr<KVIndex> from_factory(FactoryChain& chain);

   protected:
    void prefill_impl(const PrefillInput& input) override;
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    void undo_add_kv_impl(idx_t n) override;
    void reset_impl() override;
    void reconstruct_impl(idx_t key, float* recons) const override;
    void reconstruct_value_impl(idx_t key, float* value) const override;
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

   private:
    int nprobe_for(const faiss::SearchParameters* params) const;
    /// The diagnostics' check of one query at `position` ("<what>: ...").
    void check_probe_query(const float* q, idx_t position, const char* what) const;
    /** bucket_scores and moment_log_masses without the checks: the search
     * path, whose queries were checked once at the boundary. */
    void bucket_scores_unchecked(const float* q, idx_t position, float* scores) const;
    void moment_log_masses_unchecked(const float* q, float* log_masses) const;
    /// Buckets to read for q: the probed ones, then the unassigned run if it holds tokens.
    std::vector<int32_t> buckets_to_read(const float* q, int nprobe) const;
    /** The same from the C bucket scores of a query or the sum over a GQA
     * group's (nullptr: no probing, only the unassigned run). */
    std::vector<int32_t> buckets_of_scores(const float* scores, int nprobe) const;
    /// The oracle's scores: each bucket's share of q's exact attention mass.
    void oracle_bucket_masses(const float* q, float* masses) const;
    /// Where token `key` sits in its bucket.
    idx_t offset_in_bucket(idx_t key) const;
    /// Sizes the moment arrays for n_centroids buckets (zeros) if they are not.
    void size_moments();
    /** Adds keys [from, from + n) of bucket b (as stored) to its sums and
     * refreshes its mean and variance; from = 0 and n = size restarts it.
     * The arrays are sized (size_moments); `scratch` holds d floats, so
     * that it allocates nothing. */
    void add_moments(int32_t b, idx_t from, idx_t n, float* scratch);
    /// The moment probe's scores: the softmax over buckets of moment_log_masses.
    void moment_bucket_masses(const float* q, float* masses) const;
    /// Appends tokens at positions first_position + ntotal + i to their buckets.
    void assign_tokens(idx_t n, const float* keys, const float* values);
    /// Self-training at prefill; false when the prompt is too small.
    bool self_train(const PrefillInput& in);
    void clear_tokens();

    /// Whether the probe reads knob `name`: the knobs of other modes are not
    /// listed, set or read (set_index_parameters hands them to the rest of
    /// the chain, and names them unknown if no index has them).
    bool probe_reads(const std::string& name) const;
};

/// The IndexIVFAsym in a chain (the index itself or a child, outermost
/// first), nullptr when there is none: for tools that train it.
IndexIVFAsym* ivf_asym_in_chain(KVIndex* index);
const IndexIVFAsym* ivf_asym_in_chain(const KVIndex* index);

} // namespace kvindex
