#pragma once

#include <memory>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>
#include <kvindex/KVStorage.h>

namespace kvindex {

struct FactoryChain;

/** What one query's exact attention says about splitting a budget between
 * its k heaviest tokens (exact) and m tokens drawn uniformly from the
 * rest (IndexHybrid's calibration at prefill).
 *
 * With weights w_i = e^{s_i}, D = sum w, o = sum w v / D and the tail R
 * (the n_R tokens outside the top k), the hybrid's output o^ = N^ / D^ has,
 * to first order (delta method: o^ - o ~ (N^ - o D^) / D, and
 * sum_i w_i (v_i - o) = 0), E|o^ - o|^2 / |o|^2 = A (1/m - 1/n_R) with
 *   A = n_R^2 Var_R[w (v - o)] / (D^2 |o|^2)
 * (the variance over R of the vectors w_i (v_i - o), summed over the
 * dimensions, with n_R - 1 in its denominator: sampling without
 * replacement, exact at every m). With no tail (m = 0) the
 * error is deterministic: |o_T - o| / |o|, o_T the top-k attention.
 */
struct TailStatistics {
    idx_t k = 0;              ///< heavy tokens (the exact top k)
    double n_tail = 0;        ///< n_R, tokens outside them
    double variance_factor = 0; ///< A
    double topk_error = 0;    ///< |o_T - o| / |o|

    /// Predicted relative error sqrt(E|o^ - o|^2) / |o| with m draws
    /// (m = 0: topk_error; m >= n_R: 0).
    double predicted_error(double m) const;
    /// Smallest m with z * predicted_error(m) <= epsilon: the normal
    /// approximation of vAttention's (epsilon, delta) bound, z = the
    /// two-sided 1 - delta quantile.
    double sample_for_error(double epsilon, double z) const;
};

/** TailStatistics of each query (causal: query i attends to keys
 * [0, n_keys[i])) for each heavy size of `ks` (increasing), in double.
 *
 * @param keys     size n * d
 * @param values   size n * dv
 * @param queries  size n_q * d
 * @param n_keys   size n_q
 * @return         size n_q * ks.size(), query-major
 */
std::vector<TailStatistics> tail_statistics(
        const float* keys,
        const float* values,
        idx_t n,
        int d,
        int dv,
        const float* queries,
        idx_t n_q,
        const idx_t* n_keys,
        const std::vector<idx_t>& ks);

/// z with P[|N(0, 1)| <= z] = 1 - delta.
double normal_two_sided_quantile(double delta);

/** Exact heavy hitters plus an unbiased sample of the rest ("hybrid"
 * attention, as vAttention, arXiv 2510.05688, with LSH, uniform or
 * weighted tails).
 *
 * Per query: T = the heavy index's selection (deterministic: a top-k
 * retriever, u = 1), then S = the tail index's sample drawn from the
 * tokens outside T only (KVIndex::select_outside), each with its
 * inclusion probability u_i given T. Attention is softmax over T of s_i
 * merged by lse with softmax over S of s_i - log u_i: the partition
 * sum_T e^{s} + sum_S e^{s} / u and the weighted values are unbiased for
 * the exact ones. With an empty tail it is the heavy index's top-k
 * attention; with an empty T and u = 1 over every token it is exact.
 *
 * Budgets. "k" sets the heavy part's top-k (and every k of the chain);
 * `sample` is the tail's own budget, handed to its selection as its k
 * (a uniform tail draws that many tokens; an LSH tail's sample is set by
 * its (K, L) and ignores it): -1 leaves the tail's k, 0 reads no tail
 * (the hybrid is then its heavy part). Prefill can
 * set both per head from the exact attention of the last n_calibration
 * prompt queries, in one of two modes:
 *  - epsilon > 0 (vAttention's target): heavy k as given, the sample is
 *    the (1 - delta) quantile over the queries of the smallest m whose
 *    output error is within epsilon with probability 1 - delta;
 *  - budget > 0 (a fixed read budget per query, k + sample): the split
 *    (k = max(1, budget * f), f in 0, 1/8, ..., 1: the heavy part keeps
 *    at least the top key) with the lowest mean predicted error; f = 1 is
 *    plain top-k, so a head that is better served by top-k alone gets it.
 *    Any tail takes a budget: with a uniform one the error is predicted
 *    (TailStatistics); with another (LSHSample, Weighted), whose error has
 *    no closed form, each split is set and the same queries attended, and
 *    the split with the lowest measured error against exact attention is
 *    kept (ties: the larger k); an LSH tail's sample is then capped at the
 *    split's m (max_sample, by score).
 * With no knobs (budget = -1, the default, and none of k, sample or
 * epsilon set on the hybrid) the budget is what the hybrid as given reads:
 * the mean over the calibration queries of its selection (heavy k + the
 * tail's own sample), split per head as above. So each head's reads stay
 * those of the string, and a needle head spends them on top-k, a flat one
 * on the tail. Setting k or sample (split_given) keeps that split as
 * given; budget=0 turns the calibration off.
 * calibrated_k and calibrated_sample report the choice.
 *
 * Per-call parameters go to the heavy part (its k, nprobe, efSearch;
 * without the knobs only the tail reads); the tail gets their LSH knobs
 * (SearchParametersLSH: min_hits, max_sample) with `sample` as its k. A
 * knob that neither reads is refused.
 *
 * Each token is kept once where the parts allow it: the estimator reads
 * the heavy part's tokens (TopK, RoarGraph and Flat keep them in order),
 * and a sampling tail (Uniform, Weighted, LSHSample) is lent them
 * (KVIndex::share_tokens) and drops its copy. Only with neither part
 * keeping them does the hybrid keep its own (memory_bytes counts all).
 * The record still holds the tokens and each part's, as before: a read
 * hybrid checks that the copies agree, then keeps one.
 * Factory string: "Hybrid(<heavy>,<tail>)", each one element, e.g.
 * "Hybrid(TopK(Flat),LSHSample10x150)", "Hybrid(TopK(Flat),Uniform)|k=80,sample=80",
 * "Hybrid(TopK(Flat),Weighted)|k=80,sample=80" (IndexWeightedSample: the
 * tail drawn in proportion to its weights, its partition exact).
 * Knobs: k (heavy), sample; prefill-time: epsilon, budget, delta,
 * n_calibration; read-only: calibrated_k, calibrated_sample.
 */
struct IndexHybrid : KVIndex {
    std::unique_ptr<KVIndex> heavy; ///< deterministic top-k selection
    std::unique_ptr<KVIndex> tail;  ///< sampler of the tokens outside heavy's
    /// keys and values of all tokens when neither part keeps them in
    /// order (holds_own_tokens); empty otherwise
    KVStorage storage;

    /// the tail's budget (its k); -1: the tail's own k, 0: no tail
    idx_t sample = -1;
    double epsilon = 0;         ///< relative error target of the tail (0: off)
    /// tokens per query split at prefill; 0: off; -1 (default): what the
    /// hybrid as given reads, unless split_given or epsilon > 0
    idx_t budget = -1;
    double delta = 0.05;        ///< failure probability of the target
    idx_t n_calibration = 64;   ///< last prompt positions whose queries set the budget
    /// heavy k and tail sample chosen at the last prefill (-1: none chosen;
    /// also when the heavy part as prefilled has no top-k, a Choose that
    /// chose Flat; epsilon or budget with a heavy type without k is refused)
    idx_t calibrated_k = -1;
    idx_t calibrated_sample = -1;
    /// k or sample was set on this hybrid: the default budget (-1) leaves
    /// that split alone
    bool split_given = false;

    IndexHybrid(std::unique_ptr<KVIndex> heavy, std::unique_ptr<KVIndex> tail);
    IndexHybrid();

    /// The tokens the estimator reads: the heavy part's, else the tail's,
    /// else `storage`.
    const KVStorage& tokens() const;
    /// Whether `storage` holds the tokens (neither part keeps them in order).
    bool holds_own_tokens() const;

    size_t memory_bytes() const override;

    const char* type_name() const override {
        return "IndexHybrid";
    }
    std::string factory_string() const override {
        return "Hybrid(" + heavy->factory_string() + "," + tail->factory_string() + ")";
    }
    std::vector<const KVIndex*> children() const override {
        return {heavy.get(), tail.get()};
    }
    /// the heavy part's knobs, and the tail's LSH knobs (the only ones it
    /// is handed)
    bool reads_search_knob(const std::string& name) const override;
    std::vector<ParameterInfo> parameter_info() const override;
    bool selects_deterministically() const override {
        return false; // a sample: inclusion u <= 1
    }
    bool set_parameter(const std::string& name, double value) override;
    bool get_parameter(const std::string& name, double* value) const override;
    idx_t top_k_budget() const override {
        return heavy->top_k_budget();
    }
    void write_fields(BufferWriter& w) const override;
    void read_fields(BufferReader& r, uint32_t version) override;
    void check_invariants() const override;
    void check_children_in_step() const override;

    /// Registry parser: "Hybrid(<heavy>,<tail>)".
    static std::unique_ptr<KVIndex> from_factory(FactoryChain& chain);

   private:
    /// Throws when the heavy part samples (selects_deterministically).
    void check_heavy_is_deterministic() const;
    /// Lends the heavy part's tokens to the tail, where both can.
    void lend_tokens();

    /// both parts can
    bool can_undo_add() const override;
    /// where the heavy part can take its append back, both parts' appends
    /// roll back, and the tokens are theirs (not holds_own_tokens)
    bool appends_roll_back() const override;

   protected:
    void prefill_impl(const PrefillInput& input) override;
    void reset_impl() override;
    const KVStorage* token_storage() const override {
        return &tokens();
    }
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    void undo_add_kv_impl(idx_t n) override;
    /// the heavy index's top-k
    void search_batch(
            idx_t n,
            const float* q,
            idx_t k,
            float* distances,
            idx_t* labels,
            const faiss::SearchParameters* params) const override;
    /// heavy selection batched, then each query's tail
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

   private:
    /// Whether prefill splits the default budget (-1): no k, sample or
    /// epsilon given, and a heavy part with a top-k.
    bool splits_by_default() const;
    /// Sets k and sample from the prompt's last queries (epsilon or budget
    /// > 0, or splits_by_default); when it throws, they are as they were.
    void calibrate(const PrefillInput& input);
    /// calibrate's work, which may leave a split it was measuring when it throws
    void calibrate_split(const PrefillInput& input);
    /** budget with a tail whose error has no closed form (not
     * samples_uniformly: LSH, weighted): each split k = max(1, total * f),
     * f in 1, 7/8, ..., 0, is set and the n_rows queries (size n_rows * d)
     * attended; the split with the lowest mean relative error against
     * exact attention is kept (ties: the larger k). */
    void measure_split(const float* queries, idx_t n_rows, idx_t total);
    /// Heavy k and tail budget m (sample; an LSH tail's max_sample), as calibrated.
    void set_split(idx_t k_heavy, idx_t m);
};

} // namespace kvindex
