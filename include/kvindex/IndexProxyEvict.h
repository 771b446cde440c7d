#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>

namespace kvindex {

struct FactoryChain;

/// Which tokens a one-shot eviction keeps ("NaCl: A General and Effective KV
/// Cache Eviction Framework for LLMs at Inference Time", arXiv 2408.03675,
/// and the baselines that fall out of it).
enum class EvictPolicy {
    nacl,      ///< protected sinks + recent, top by proxy scores, random sample by them
    h2o,       ///< recent half + top by scores of all prompt queries (causal, accumulated)
    tova,      ///< top by the last prompt query's attention
    streaming, ///< StreamingLLM: sinks + most recent tokens, no scores
    random,    ///< uniform sample without replacement
};

const char* evict_policy_name(EvictPolicy p);

/** How a budget of B tokens is split (all counts exact, summing to B). */
struct EvictBudget {
    idx_t n_keep = 0;     ///< B
    idx_t n_sink = 0;     ///< protected first tokens
    idx_t n_recent = 0;   ///< protected last tokens
    idx_t n_top = 0;      ///< kept by score
    idx_t n_random = 0;   ///< sampled (by score for NaCl, uniformly for Random)
    /// scoring queries: the last n_proxy prompt positions (0: all). NaCl:
    /// min(proxy_tokens, n) when proxy_tokens > 0 (counted from the end of
    /// the whole prompt under a wrapper: see IndexProxyEvict), else
    /// round((protect + proxy_window) percent of n), at least 1
    idx_t n_proxy = 0;
};

/** Importance scores F_j = sum_{p in P} softmax(q_p . K / sqrt(d))_j over n
 * keys, summed over the query heads of the GQA group.
 *
 * @param keys       size n * d
 * @param queries    size n_heads * n_q * d (head-major)
 * @param q_pos      size n_q: absolute position of each query
 * @param first_pos  absolute position of keys[0]
 * @param causal     query p attends keys at positions <= p only (H2O);
 *                   otherwise every key (NaCl's proxy scoring)
 * @param scores     output, size n
 */
void proxy_scores(
        const float* keys,
        idx_t n,
        int d,
        const float* queries,
        int n_heads,
        idx_t n_q,
        const idx_t* q_pos,
        idx_t first_pos,
        bool causal,
        double* scores);

/** Computes the importance scores for IndexProxyEvict::choose_kept: the
 * arguments and the result of proxy_scores (host arrays; every one of the
 * n scores must be written), so that a caller may score elsewhere
 * (GpuIndexProxyEvict scores on the device) while the budget, the proxy
 * window and the choice stay the CPU code. */
using ProxyScorer = std::function<void(
        const float* keys,
        idx_t n,
        int d,
        const float* queries,
        int n_heads,
        idx_t n_q,
        const idx_t* q_pos,
        idx_t first_pos,
        bool causal,
        double* scores)>;

/** One-shot eviction at prefill (NaCl and the policies that fall out of it).
 *
 * prefill scores the prompt, keeps exactly the budgeted tokens and hands
 * only those to the inner index (any kvindex index; Flat = exact attention
 * over the kept tokens), so evicted keys and values are never stored.
 * Tokens appended later (generated) are always kept. Ids stay token
 * positions: ntotal counts every position seen, and select / search report
 * positions; reconstruct of an evicted token throws.
 *
 * Budget: keep_percent of the prompt, or budget_tokens when > 0, clamped to
 * the prompt length. NaCl's split defaults follow the paper's Table 4 (10%:
 * protect 1, proxy-keep 2, random 7, proxy window 3; 20%: 2, 6, 12, 18;
 * 30%: 1.5, 10.5, 18, 20); other budgets scale the 20% row.
 *
 * NaCl's proxy window (the queries whose attention scores the prompt), in
 * one of two modes; either way it is the last positions of the prompt, so
 * it contains the protected recent tokens (and the sinks when it is the
 * whole prompt), which are kept anyway but whose queries still score:
 *  - percent (proxy_tokens = 0, the default, the paper's): the last
 *    round((protect + proxy_window) / 100 * n) positions (at least 1, at
 *    most n) of the n tokens this index is given; Table 4's "proxy window
 *    18%" is the share beyond the protected 2%, so 20% at a 20% budget.
 *  - tokens (proxy_tokens = t > 0, question-aware): the last t positions of
 *    the prompt (the question, whose length the caller knows), clamped to
 *    the prompt. "The prompt" ends where the caller's prompt ends: under a
 *    Sink/Window wrapper this index is given the middle of the prompt and
 *    the window's PrefillInput::n_after tokens follow it, so the window is
 *    [end + n_after - t, end + n_after) with end the position after this
 *    index's last token; the question in the wrapper's window then scores
 *    this index's tokens. (The percent mode counts from `end`, as it did.)
 * The scoring queries are the prefill queries whose positions lie in the
 * window (the caller passes them; positions it did not pass do not score;
 * none at all throws). The split (protect, proxy_keep, random) and so the
 * budget arithmetic do not depend on the mode.
 * Only NaCl has a proxy window: H2O scores with every prompt query, TOVA
 * with the last one (under a Sink/Window wrapper: the window's queries
 * too, and the prompt's last query, in the window), StreamingLLM and
 * Random with none. proxy_tokens > 0 on
 * them is refused (set_parameter, read_index), because ignoring it would
 * run the plain baseline under a "question-aware" label.
 *
 * Pooling (pool = w > 1, odd; our addition, from SnapKV, Li et al. 2024):
 * F_j is replaced by max F over [j - w/2, j + w/2] before the top and the
 * random parts are chosen, so that a kept token keeps its neighbours. The
 * question attends to the first digit of a number far more than to the
 * others (SmolLM2 tokenizes digits one by one): without pooling NaCl keeps
 * " 83" of " 8394764" (RESULTS.md, task suite).
 *
 * Layer-wide vote (layer_vote = 1; our addition, as kvpress's TOVA scores):
 * F_j is summed over every query head of the layer, each against its own
 * KV head's keys at position j, instead of over this KV head's group only,
 * so that every KV head of the layer keeps the same positions by score.
 * It needs the layer's prompt (PrefillInput::layer, which KVCache::prefill
 * gives; an index prefilled alone is refused). kvpress's TOVA keeps the
 * pass key's digits at 20% of a SmolLM2 prompt where the same vote per KV
 * head loses them (RESULTS.md, "Side by side with kvpress"). NaCl's random
 * part is still drawn per head (its stream), from the layer's scores.
 *
 * Head-wise budgets (head_budget = 1; AdaKV, Feng et al. 2024, arXiv
 * 2407.11550, as kvpress's AdaKVPress allocates): each KV head scores
 * with its own query heads, and the part kept by score (n_top of every
 * head, H * n_top for the layer's H heads) is shared among the heads by
 * score: each head first keeps its own top head_floor percent of n_top
 * (AdaKV's safeguard), then the layer's remaining picks go to the highest
 * scores of any head. A head whose attention sits on few tokens gives
 * the rest of its share to heads that spread theirs. Scores are sums of
 * softmax rows, so they compare across heads; the protected tokens and
 * NaCl's random part stay per head, so each head keeps between its floor
 * and all of its candidates, and the layer keeps its budget. It needs the
 * layer's prompt (KVCache::prefill) and excludes layer_vote, which gives
 * every head the same scores.
 *
 * Factory string: "ProxyEvict<P>[_H2O|_TOVA|_StreamingLLM|_Random][,<index>]".
 * Knobs (prefill-time): budget, protect, proxy_keep, proxy_window,
 * proxy_tokens, pool, layer_vote, head_budget, head_floor, n_sink, seed
 * ("ProxyEvict20|proxy_tokens=32,pool=7", "ProxyEvict20_TOVA|layer_vote=1",
 * "ProxyEvict20_TOVA|head_budget=1").
 */
struct IndexProxyEvict : KVIndex {
    EvictPolicy policy = EvictPolicy::nacl;
    double keep_percent = 20;  ///< budget, percent of the prompt
    idx_t budget_tokens = 0;   ///< absolute budget when > 0
    /// NaCl split, percent of the prompt length; < 0 means Table 4's value
    double protect_percent = -1;
    double proxy_keep_percent = -1;
    double proxy_window_percent = -1;  ///< proxy queries beyond the protected ones
    /// NaCl: when > 0, the proxy queries are the last proxy_tokens positions
    /// of the prompt (the question) instead of the percent window; 0: percent
    idx_t proxy_tokens = 0;
    /// scored policies (NaCl, H2O, TOVA): the scores are max-pooled over
    /// `pool` consecutive tokens centred on each before anything is kept
    /// (SnapKV's pooling), odd; 0: off
    idx_t pool = 0;
    /// scored policies: 1 scores with every query head of the layer
    /// (PrefillInput::layer), so the layer's KV heads keep the same
    /// positions by score; 0: this KV head's query heads (default)
    bool layer_vote = false;
    /// scored policies: 1 shares the layer's scored budget among its KV
    /// heads by score (AdaKV; PrefillInput::layer); 0: n_top per head
    bool head_budget = false;
    /// head_budget: percent of its n_top a head keeps by its own scores
    /// before the layer's are shared (AdaKV's safeguard), in [0, 100]
    double head_floor_percent = 20;
    idx_t n_sink = 4;          ///< first tokens among the protected ones (NaCl, StreamingLLM)
    uint64_t seed = 1234;      ///< with `stream`, seeds the random part; <= 2^53 (a knob)
    uint64_t stream = 0;       ///< one stream per (layer, head): set by KVCache

    std::unique_ptr<KVIndex> inner; ///< the kept tokens, in position order
    std::vector<idx_t> positions;   ///< size inner->ntotal: position of each inner token

    IndexProxyEvict(EvictPolicy policy, double keep_percent, std::unique_ptr<KVIndex> inner);
    IndexProxyEvict();

    /// The exact split for a prompt of n tokens.
    EvictBudget budget_for(idx_t n) const;

    /** The kept positions (sorted) for a prompt, by this index's policy.
     * Deterministic in (seed, stream). Exposed for tests and analysis.
     * Reads the knobs only (never the tokens or the inner index). */
    std::vector<idx_t> choose_kept(const PrefillInput& input) const;

    /** The same with the scores F computed by `scorer` instead of
     * proxy_scores: called at most once, with the prompt's keys and the
     * proxy queries this policy picked (head-major, their positions, the
     * causal flag of H2O), for the policies that score (NaCl, H2O, TOVA)
     * and only when the budget leaves tokens to choose by score. Equal
     * scores give the same kept positions. */
    std::vector<idx_t> choose_kept(const PrefillInput& input, const ProxyScorer& scorer) const;

    size_t memory_bytes() const override;
    /// as its inner index's: the positions are reserved before that is
    /// written, and assigned by a move after it
    bool writes_roll_back() const override;
    bool appends_roll_back() const override {
        return inner && inner->appends_roll_back();
    }
    /// as its inner index's (appends are never evicted)
    bool can_undo_add() const override {
        return inner && inner->can_undo_add();
    }

    const char* type_name() const override {
        return "IndexProxyEvict";
    }
    std::string factory_string() const override;
    std::vector<const KVIndex*> children() const override {
        return {inner.get()};
    }
    std::vector<ParameterInfo> parameter_info() const override;
    bool set_parameter(const std::string& name, double value) override;
    bool get_parameter(const std::string& name, double* value) const override;
    /// Keeps the stream for the random part, and hands it on.
    void set_stream(uint64_t stream) override;
    void write_fields(BufferWriter& w) const override;
    void read_fields(BufferReader& r, uint32_t version) override;
    void check_invariants() const override;
    void check_children_in_step() const override;

    /// Registry parser: "ProxyEvict<P>[_Policy]", then the inner chain (Flat
    /// when nothing follows).
    static std::unique_ptr<KVIndex> from_factory(FactoryChain& chain);

   protected:
    void prefill_impl(const PrefillInput& input) override;
    void reset_impl() override;
    void reconstruct_impl(idx_t key, float* recons) const override;
    void reconstruct_value_impl(idx_t key, float* value) const override;
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    void undo_add_kv_impl(idx_t n) override;
    // batched: the inner index answers, ids map back to positions
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

   private:
    /// Inner id of a position, or -1 if it was evicted.
    idx_t inner_id(idx_t position) const;
    /// proxy_tokens and pool against the policy (the fields are public,
    /// records may be forged); `where` starts the message
    void check_scoring_knobs(const char* where) const;

    /// Whether the policy reads knob `name`: the knobs of other modes are not
    /// listed, set or read (set_index_parameters hands them to the rest of
    /// the chain, and names them unknown if no index has them).
    bool policy_reads(const std::string& name) const;
};

} // namespace kvindex
