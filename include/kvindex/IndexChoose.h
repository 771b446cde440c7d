#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>

namespace kvindex {

struct FactoryChain;

/** A per-head choice between candidate indexes, made at prefill from a
 * direct error estimate.
 *
 * Heads differ: on some attention is flat (spread over many tokens: LSH
 * sampling wins), on others sparse (a few heavy hitters: top-k wins). At
 * prefill this index holds back up to `n_holdout` of the prefill queries,
 * prefills every candidate with the same tokens and the other queries, and
 * measures each candidate on the held-back ones. The holdout is at most
 * half of the later half of the queries by position, the queries at the
 * last position excepted: the candidates keep three quarters of the
 * queries, the last one always (the eviction policies score the prompt
 * with the last queries). With `recent_holdout` (the default) they are the
 * latest of that half, the positions just before the last: decode queries
 * continue the prompt's end (a question), and on heads whose decode
 * queries resemble only the prompt's last positions a sample of the later
 * half chose a candidate that fails them. Without it they are a seeded
 * sample (per seed and stream) of that half. The error of
 * a candidate is the mean,
 * over the held-back queries and every query head of the GQA group, of the
 * relative L2 error ||o_c - o|| / ||o|| of its attend output against exact
 * attention (float kernel, max subtracted; the absolute error when ||o|| = 0).
 * The candidate with the lowest mean error is kept (ties: the earlier one),
 * among those within `budget` when it is set (below);
 * the others are emptied (reset, then copied through the io so that the
 * memory of their tokens is given back) and lie dormant with their knobs
 * (and adopted models) until the next prefill. At most two candidates hold
 * the prompt at any time during prefill. After prefill every call (add_kv,
 * search, select, select_outside, attend, reconstruct) goes to the chosen
 * index, batched as it came.
 *
 * The held-back queries attend to every prompt token this index holds,
 * also the few after their own position (the reference and the candidates
 * see the same set, and held-back queries are late in the prompt, so the
 * look-ahead is small). Only the outputs are compared, not the lse.
 * The chosen index keeps what it learnt from the remaining queries: it is
 * not prefilled again with the held-back ones.
 *
 * No measurement (candidate 0 is taken, `errors`, `reads` and the holdout
 * stay empty, and `budget` is not checked): a prefill of no tokens, or with
 * fewer than 5 queries (nothing to hold back); add_kv on an index that had
 * no prefill.
 * A candidate that refuses the prefill (a query-aware one without the
 * queries it needs) makes the whole prefill refused, as it would alone;
 * the index is then left empty.
 *
 * A read budget. With `budget` > 0 (tokens, or "budget=2%" of the
 * prompt) the same held-back queries also measure what each candidate
 * reads: the mean over them of (n_scanned + 2 * selected) / 2 of its
 * select (retrieval structures, codes and graph lists in key vectors, and
 * the selected keys and values), in tokens of keys and values, as kvbench's
 * "touched" counts it. A candidate reading more than `budget` is passed
 * over; when every candidate does, the one reading least is kept (ties:
 * the lower error). A ProxyEvict or Hybrid candidate also has a knob named
 * budget (the tokens it keeps, or its k + sample): "|budget=2%" sets it
 * on them too, so that they are sized to it.
 *
 * Factory string: "Choose(<chain>;<chain>[;<chain>...])", 2 to 8
 * candidates, each a whole chain of the factory grammar built with the
 * storage type of the enclosing string, e.g.
 * "Choose(TopK(Flat);Sink4,Window64,LSHSample10x150)". A candidate's
 * string cannot carry "|params" (the '|' ends the factory string): set
 * per-candidate knobs on `candidates[i]`.
 *
 * "Auto" is Choose over a fixed list of the fast families
 * (IndexChoose::kAutoCandidates) for a user who does not know the field:
 * "Auto|budget=2%" keeps, per head, the one of lowest error on held-back
 * prefill queries among those reading at most 2% of the prompt's keys
 * and values. Its factory_string() is the Choose(...) it stands for.
 *
 * Per-call parameters: a knob is refused only when no candidate reads it
 * (a decode loop hands one SearchParameters to every head, whatever each
 * chose); the chosen candidate gets the knobs it reads.
 *
 * Parameters. A knob set on the chain reaches every candidate that has it:
 * children() are all candidates before a choice and the chosen one after,
 * when set_parameter hands the knob to the dormant candidates too (so that
 * it holds after reset; a prefill-time knob of theirs is then refused, as
 * the chosen index's are) and parameter_info lists theirs. Reading a knob
 * of the candidates ("k") reads the chosen one's (else the first dormant
 * candidate's that has it), or the first candidate's before a choice.
 * Own knobs: n_holdout, recent_holdout, seed (prefill-time; "seed" also
 * reaches candidates that have one), budget (prefill-time, in tokens; also
 * reaches candidates that have one), chosen (read-only: the chosen
 * candidate's number, -1 before a choice).
 */
struct IndexChoose : KVIndex {
    /// largest number of candidates
    static constexpr int kMaxCandidates = 8;
    /// largest n_holdout
    static constexpr idx_t kMaxHoldout = 4096;
    /// the candidates "Auto" stands for, separated by ';' (Choose's grammar)
    static const char* const kAutoCandidates;

    /// the candidate indexes, in the order of the factory string; all held
    /// all the time (the unchosen ones empty)
    std::vector<std::unique_ptr<KVIndex>> candidates;
    /// index into candidates of the chosen one, -1 before a choice
    int chosen = -1;
    /// size candidates.size(): mean held-back error of each candidate at
    /// the last prefill; empty when no measurement was made
    std::vector<double> errors;
    /// size candidates.size() when `budget` > 0 at the last measurement
    /// (else empty): mean tokens (keys and values) each candidate read per
    /// held-back query
    std::vector<double> reads;
    /// absolute positions of the held-back queries of the last prefill,
    /// non-decreasing (empty when no measurement was made)
    std::vector<idx_t> holdout_positions;

    /// prefill queries held back to measure errors, 1..kMaxHoldout (fewer
    /// when the prompt has fewer than 4 * n_holdout queries)
    idx_t n_holdout = 32;
    /// tokens (keys and values) a candidate may read per query, measured
    /// on the held-back queries; 0: no limit (a knob, prefill-time)
    idx_t budget = 0;
    /// true: the held-back queries are the latest ones (the positions just
    /// before the last: the question a decode continues); false: a seeded
    /// sample of the later half (a knob, prefill-time; records before
    /// version 2 were made with false)
    bool recent_holdout = true;
    uint64_t seed = 1234;  ///< with `stream`, seeds the holdout sample; <= 2^53 (a knob)
    uint64_t stream = 0;   ///< one stream per (layer, head): set by KVCache

    explicit IndexChoose(std::vector<std::unique_ptr<KVIndex>> candidates);
    IndexChoose();

    /** Which prefill queries a prefill of `input` holds back: indices into
     * the input's queries, sorted by position; empty when no measurement
     * would be made. Deterministic in (seed, stream, n_holdout and the
     * query positions). Exposed for tests and analysis. */
    std::vector<idx_t> choose_holdout(const PrefillInput& input) const;

    /// The chosen candidate's factory string ("" before a choice).
    std::string chosen_string() const;

    /// The candidates' factory strings, in order.
    std::vector<std::string> candidate_strings() const;

    /// The chosen index, nullptr before a choice.
    const KVIndex* chosen_index() const;

    size_t memory_bytes() const override;
    /// as the candidate that takes appends (the chosen one, else the first)
    bool can_undo_add() const override;
    /// as that candidate's: an append is its append (chosen is set after it)
    bool appends_roll_back() const override;

    const char* type_name() const override {
        return "IndexChoose";
    }
    std::string factory_string() const override;
    /// Every candidate before a choice, the chosen one after.
    std::vector<const KVIndex*> children() const override;
    /// Every candidate, chosen or not.
    std::vector<const KVIndex*> held_indexes() const override;
    std::vector<ParameterInfo> parameter_info() const override;
    bool set_parameter(const std::string& name, double value) override;
    bool get_parameter(const std::string& name, double* value) const override;
    /// Keeps the stream for the holdout sample, and hands it to every candidate.
    void set_stream(uint64_t stream) override;
    /// Pairs the candidates by position, chosen or not.
    int adopt_trained(const KVIndex& trained) override;
    void check_adopt_trained(const KVIndex& trained) const override;
    void write_fields(BufferWriter& w) const override;
    void read_fields(BufferReader& r, uint32_t version) override;
    void check_invariants() const override;
    void check_children_in_step() const override;

    /** The candidate a measurement keeps: the lowest error among those
     * reading at most `budget` tokens (every one when budget is 0 or
     * `reads` empty), else the one reading least; ties: the earlier. */
    static int choice(const std::vector<double>& errors, const std::vector<double>& reads, idx_t budget);

    /// Registry parser: "Choose(<chain>;<chain>[;...])" and "Auto".
    static std::unique_ptr<KVIndex> from_factory(FactoryChain& chain);

   protected:
    void prefill_impl(const PrefillInput& input) override;
    void reset_impl() override;
    void reconstruct_impl(idx_t key, float* recons) const override;
    void reconstruct_value_impl(idx_t key, float* value) const override;
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    void undo_add_kv_impl(idx_t n) override;
    // batched: the chosen index answers all the queries
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
    void select_outside_one(
            const float* q,
            const idx_t* excluded,
            size_t n_excluded,
            Selection& sel,
            const faiss::SearchParameters* params) const override;

   private:
    /// `chosen` before the last add_kv (undo_add_kv restores it)
    int chosen_before_add = -1;
    /// Mean held-back error of one prefilled candidate.
    double holdout_error(
            const KVIndex& candidate,
            const float* held_queries,
            const float* exact,
            idx_t n_held) const;
    /// Mean tokens (keys and values) one prefilled candidate reads per
    /// held-back query.
    double holdout_reads(const KVIndex& candidate, const float* held_queries, idx_t n_held) const;
};

} // namespace kvindex
