#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include <faiss/Index.h>

#include <kvindex/errors.h>
#include <kvindex/kv_type.h>
#include <kvindex/rope.h>

namespace kvindex {

using idx_t = faiss::Index::idx_t;
struct KVStorage;
struct BufferReader;
struct BufferWriter;

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
    /// what a query reads, in tokens of keys and values: n_scanned key
    /// vectors count half a token each, a selected token its key and value
    /// (kvbench's "touched" over the context; IndexChoose's budget)
    double tokens_read() const {
        return (double(n_scanned) + 2.0 * double(ids.size())) / 2.0;
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

/// One per-call knob that a SearchParametersKV subclass sets.
struct SearchKnob {
    const char* name; ///< as in set_index_parameters ("nprobe", "min_hits", ...)
    double value;
};

/** Search-time parameters common to every KV index. Index types that have
 * knobs of their own subclass this; each index checks with dynamic_cast.
 *
 * A subclass lists the knobs it sets (set_knobs), so that a call setting a
 * knob that no index of the chain reads is refused rather than ignored
 * (KVIndex::reads_search_knob), and can drop one (without_knob), so that an
 * index holding indexes that read different knobs (IndexChoose, IndexHybrid)
 * hands each only its own. A subclass that lists nothing is passed as it is,
 * except to a held index that reads no k while k is set: that one gets the
 * SearchParametersKV part with k = 0.
 */
struct SearchParametersKV : faiss::SearchParameters {
    /// number of keys an index with a top-k budget selects per query;
    /// 0 means "use the index's own default" (KVIndex::k); < 0 is an error
    idx_t k = 0;
    /// select fills Selection::n_scanned (costs an extra coarse search for
    /// IVF; HNSW counts as it searches)
    bool count_scanned = false;

    /// The subclass's knobs set away from "the index's own" value; k
    /// (checked on its own) and count_scanned, which every index takes,
    /// are not listed.
    virtual std::vector<SearchKnob> set_knobs() const {
        return {};
    }
    /// A copy with the knob `name` ("k" or one of set_knobs) back at "the
    /// index's own". A subclass with knobs copies itself for both; the
    /// default copies the SearchParametersKV part (for "k" only).
    virtual std::unique_ptr<SearchParametersKV> without_knob(const std::string& name) const;
};

/** Everything prefill knows, handed to the index in one call. Query-aware
 * indexes (RoarGraph, IVFAsym, eviction) learn from the queries; the others
 * only add the keys and values.
 */
/** The prompt of a whole layer: every KV head's keys and every query
 * head's queries, for an index that decides with the other heads of its
 * layer (IndexProxyEvict's layer_vote). KVCache::prefill sets it; an
 * index prefilled alone has none (PrefillInput::layer = nullptr). A
 * wrapper hands it on unchanged: positions are absolute, so an inner
 * index finds its own range in it. */
struct LayerPrompt {
    int n_kv_heads = 0;
    int n_query_heads = 1;          ///< query heads per KV head (the GQA group)
    idx_t n_tokens = 0;             ///< tokens per KV head
    idx_t first_position = 0;       ///< absolute position of each head's first key
    const float* keys = nullptr;    ///< size n_kv_heads * n_tokens * d, post-RoPE
    idx_t n_queries = 0;            ///< queries per query head (may be 0)
    /// size n_kv_heads * n_query_heads * n_queries * d (head-major: the
    /// query heads of KV head h are h * n_query_heads ...), post-RoPE
    const float* queries = nullptr;
    /// size n_queries, the absolute position of each query; nullptr means
    /// the last n_queries positions of the layer's tokens
    const idx_t* query_positions = nullptr;

    /** Results one head computed over the whole layer, for the layer's
     * other heads to read instead of computing them again (the layer's
     * scores of IndexProxyEvict's layer vote: each head of the layer needs
     * the same sum). Keyed by what determines them; the head that computes
     * an entry holds the mutex meanwhile, so the others wait for it. */
    struct Shared {
        std::mutex mutex;
        std::map<std::string, std::vector<double>> entries;
    };
    /// shared by the layer's heads in one prefill; nullptr: none (each
    /// head computes its own)
    std::shared_ptr<Shared> shared;

    idx_t query_position(idx_t i) const {
        return query_positions ? query_positions[i] : first_position + n_tokens - n_queries + i;
    }
};

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
    /// tokens of the sequence the caller keeps after the last of these
    /// (a sink/window wrapper's window): once this index holds tokens,
    /// the query of a decode step is at position first_position + ntotal
    /// + n_after - 1 (types that undo RoPE need it: IVFAsym)
    idx_t n_after = 0;

    RopeParams rope;               ///< the model's RoPE parameters
    /// the whole layer's prompt, this head's included (KVCache::prefill);
    /// nullptr when the index is prefilled alone
    const LayerPrompt* layer = nullptr;
    /// which of layer->n_kv_heads this head is; -1 with no layer
    int layer_kv_head = -1;

    /// Absolute position of query i < n_queries: query_positions[i], or
    /// the i-th of the prompt's last n_queries positions.
    idx_t query_position(idx_t i) const {
        return query_positions ? query_positions[i] : first_position + n_tokens - n_queries + i;
    }
    /** For a wrapper that hands part of the keys to an inner index: the
     * positions the inner input must carry explicitly (size n_queries),
     * empty when query_positions already says them or there are no
     * queries. */
    std::vector<idx_t> implicit_query_positions() const {
        std::vector<idx_t> pos;
        if (n_queries > 0 && !query_positions) {
            for (idx_t i = 0; i < n_queries; i++) {
                pos.push_back(query_position(i));
            }
        }
        return pos;
    }
};

/// The values a knob takes (ParameterInfo::kind).
enum class ParameterKind {
    integer, ///< integers in [min_value, max_value], or one of also_values
    real,    ///< reals in [min_value, max_value] (ends excluded where *_open)
    flag,    ///< 0 or 1
};

/** A named knob of an index type, set by name with set_index_parameters.
 * The type's parameter_info() describes each of its knobs: the reference
 * (docs/reference.md) is generated from these, and a test checks that the
 * values described are the values set_parameter accepts. Built with the
 * helpers below:
 *
 *   ParameterInfo::integer("M", 2, 512, "out-degree of the projection").prefill()
 */
struct ParameterInfo {
    std::string name;
    /// prefill-time knobs shape what prefill builds (set them before
    /// prefill); the others are read by every search / select / attend
    bool prefill_time = false;
    /// meaning and unit, and what its special values mean, one line (the
    /// range is in the fields below)
    std::string doc;
    /// a count of tokens (k, a sample, a budget): only such a knob may be
    /// given in percent of the context ("k=2%", resolve_percentages)
    bool in_tokens = false;
    ParameterKind kind = ParameterKind::integer;
    double min_value = 0; ///< smallest value accepted
    /// largest value accepted: kNoBound for integers without one (2^53,
    /// the largest a knob's double holds exactly), infinity for reals
    double max_value = kNoBound;
    bool min_open = false; ///< reals: min_value itself refused
    bool max_open = false; ///< reals: max_value itself refused
    /// values accepted outside [min_value, max_value] (-1: "automatic")
    std::vector<double> also_values;
    /// integers: only the odd ones of [min_value, max_value]
    bool odd_only = false;
    /// reported by get_index_parameter, never set (IndexChoose's chosen)
    bool read_only = false;

    /// Integers with no upper bound go up to 2^53.
    static constexpr double kNoBound = 9007199254740992.0;

    static ParameterInfo integer(std::string name, double min_value, double max_value, std::string doc);
    static ParameterInfo real(std::string name, double min_value, double max_value, std::string doc);
    static ParameterInfo flag(std::string name, std::string doc);
    /// A value reported by get_index_parameter only.
    static ParameterInfo reported(std::string name, std::string doc);

    ParameterInfo& prefill() {
        prefill_time = true;
        return *this;
    }
    ParameterInfo& tokens() {
        in_tokens = true;
        return *this;
    }
    ParameterInfo& also(double value) {
        also_values.push_back(value);
        return *this;
    }
    ParameterInfo& odd() {
        odd_only = true;
        return *this;
    }
    ParameterInfo& open_min() {
        min_open = true;
        return *this;
    }
    ParameterInfo& open_max() {
        max_open = true;
        return *this;
    }

    /// The accepted values as the reference prints them: "2..512",
    /// ">= 1", "-1, or 50..2000", "(0, 1)", "0 or 1".
    std::string range() const;
    /// Whether the description accepts value (set_parameter is the judge;
    /// a test checks that the two agree).
    bool accepts(double value) const;
};

/** How many calls run on one index, for the thread-safety contract below:
 * >= 0 const calls, or -1 while a write runs. Copies start idle. */
struct AccessCount {
    std::atomic<int64_t> state{0};
    AccessCount() = default;
    AccessCount(const AccessCount&) {}
    AccessCount& operator=(const AccessCount&) {
        return *this;
    }
};

/** Largest |x| accepted in the keys, values and queries given to an index
 * or a KVCache; larger values are refused like NaN and Inf. Below it the
 * scores (d products), squared norms and k-means distances of any d the
 * factory accepts stay finite in float32 (Faiss's k-means aborts the
 * process on overflowed distances); activations are far below it. */
constexpr float kMaxInputMagnitude = 1e12f;

/// Largest token count or position an index accepts (2^62): a sum of two
/// of them stays within idx_t, so counts and positions add without
/// wrapping. Far above any context (and any buffer: 2^56 bytes).
constexpr idx_t kMaxPosition = idx_t(1) << 62;

/** The KV cache of one (layer, KV head) as a Faiss index.
 *
 * Row id = token position. The index owns its keys (dimension d) and values
 * (dimension d_value). Faiss calls keep their meaning: `search` returns the
 * top-k keys by inner product (exact or approximate, per index type),
 * `reset`, `ntotal` and `reconstruct` work as in Faiss. `add` is refused,
 * since a key without its value is useless for attention: use `add_kv`.
 *
 * Attention uses scores s_i = <q, k_i> / sqrt(d).
 *
 * Writing an index type (see the existing ones in index/): the public calls
 * below check their arguments once, answer the empty index, and call the
 * type's core, the protected *_batch or *_one virtuals. A type describes
 * itself through type_name, factory_string, children, the parameter
 * virtuals and the io virtuals, and gets one row in index/registry.cpp.
 *
 * Thread safety. Const calls (search, select, attend, reconstruct,
 * reconstruct_value, write_index) may run concurrently on one index, from
 * any number of threads, and give the same answers as run one by one.
 * Writes (add_kv, add_queries, prefill, reset, set_index_parameter(s)) must not overlap
 * any other call on the same index: a write that finds calls running, or a
 * call that finds a write running, is refused with an exception that says
 * which, and changes nothing. Assigning public fields (k, estimator, ...)
 * and set_stream are writes the check cannot see: do them between calls.
 * The check is one atomic counter per call, not a lock: nothing waits. Why
 * refuse rather than make appends safe under readers: a decode step appends
 * one token and then attends, in that order, so a serving stack never needs
 * the overlap;
 * refusing keeps the storage contiguous (the dense and top-k kernels stream
 * it) and costs no lock on the hot path, while an overlap it did not mean
 * (two requests mapped to one cache) becomes a clear error instead of a
 * read of moved memory. Different indexes (the heads and layers of a
 * KVCache) are independent: write them from as many threads as you like.
 */
struct KVIndex : faiss::Index {
    int d_value;   ///< dimension of the values
    /// default top-k budget, > 0: read by the types that select k keys
    /// (reads_search_knob("k")); every record keeps it
    idx_t k = 100;
    /// how the default attend turns a selection into an output; unbiased
    /// equals topk for deterministic selections (every u_i = 1)
    Estimator estimator = Estimator::unbiased;

    RopeParams rope;        ///< set by the first prefill
    bool has_rope = false;  ///< whether a prefill has fixed `rope`
    /// element type of the stored keys and values (kv_type.h), the same
    /// for every index of a chain; set at construction ("BF16," / "FP16,"
    /// in the factory string). Tokens are given and returned as floats.
    KVType kv_type = KVType::f32;

    explicit KVIndex(int d = 0, int d_value = -1, KVType kv_type = KVType::f32);
    ~KVIndex() override;

    // ---- the API: arguments checked here, once, for every type ----------

    /// Refused with an exception: values are missing (use add_kv).
    void add(idx_t n, const float* x) override;

    /** Appends n tokens: ids ntotal .. ntotal + n - 1. Used by prefill and by
     * every decode step; all index types keep working while tokens arrive.
     *
     * @param keys    size n * d
     * @param values  size n * d_value
     */
    void add_kv(idx_t n, const float* keys, const float* values);

    /** add_kv for a caller that already holds this index's write scope
     * (a WriteScope on it): KVCache::append takes the scope of every head
     * of a layer before any head appends, so that an append refused for a
     * call running on one head leaves every head as it was. Throws if no
     * write scope is held. */
    void add_kv_in_scope(idx_t n, const float* keys, const float* values);

    // ---- taking an append back: KVCache::append's heads as one step ----

    /** add_kv that keeps what undo_add_kv needs to take it back, until the
     * next write of this index (add_kv, prefill, reset, add_queries) or
     * forget_undo(). KVCache::append appends every KV head of a layer this
     * way, and takes back the heads that appended when another head's
     * append throws (an allocation, a retriever that cannot train), so
     * that the layer stays as it was. What is kept is what the append
     * would otherwise discard: the window rows it overwrote, the hash
     * tables a fold replaced, a retriever's untrained state; nothing is
     * copied that the append does not replace. Throws, changing nothing,
     * unless can_undo_add(). */
    void add_kv_undoable(idx_t n, const float* keys, const float* values);

    /// add_kv_undoable for a caller that holds this index's write scope.
    void add_kv_in_scope(idx_t n, const float* keys, const float* values, bool undoable);

    /** Takes back the last add_kv_undoable: the index then answers as it
     * did before that call, holds the same tokens, and an append of the
     * same tokens gives what that append gave. Throws, changing nothing,
     * when there is nothing to take back (no add_kv_undoable since the
     * last write or forget_undo). A failure part-way (an allocation the
     * type needs to restore its state) marks the index failed
     * (failed_write()) and throws. */
    void undo_add_kv();

    /// undo_add_kv for a caller that holds this index's write scope.
    void undo_add_kv_in_scope();

    /// Frees what the last add_kv_undoable kept; it can no longer be taken back.
    void forget_undo() noexcept;

    /// The tokens undo_add_kv would take back, -1 when there is no append
    /// to take back.
    idx_t undoable_tokens() const noexcept {
        return undo_n_;
    }

    /** Whether add_kv_undoable can take back an append of this index: true
     * for the types whose every part can (a composite asks its children).
     * False by default, and for a TopK over a Faiss HNSW graph, whose
     * appends relink older nodes inside Faiss: KVCache::append then leaves
     * a layer whose head failed part-way out of step, to reset(). */
    virtual bool can_undo_add() const {
        return false;
    }

    /** Throws what add_kv(n, keys, values) would throw before writing
     * anything (a child out of step, a failed write, wrong dimensions,
     * NaN/Inf, a value the storage type cannot hold, a count past 2^62),
     * and changes nothing. A caller that appends to several indexes as
     * one step (KVCache::append: every KV head of a layer) checks each
     * first, so that bad input for one head leaves all of them as they
     * were. The messages start as add_kv's ("add_kv: keys: ...").
     *
     * @param keys    size n * d
     * @param values  size n * d_value
     */
    void check_add_kv(idx_t n, const float* keys, const float* values) const;

    /// The same, the messages starting with `what`, `keys_what` (the
    /// keys' problems) and `values_what`.
    void check_add_kv(
            idx_t n,
            const float* keys,
            const float* values,
            const char* what,
            const char* keys_what,
            const char* values_what) const;

    /** Adds the prompt with everything prefill knows: the default adds the
     * keys and values, query-aware indexes learn from the queries
     * (prefill_impl). May be called on an empty index only. The input's
     * RoPE (rope.h) needs an even d: a RoPE head's pairs (add_kv takes
     * any d).
     */
    void prefill(const PrefillInput& input);

    /** Queries of decode steps, given after their tokens were added (a
     * decode step appends its token, attends, then hands its queries
     * here). An index that learns from the queries it serves keeps them
     * (IndexRoarGraph: the recent ones as anchors, so that the next
     * queries start where these found their keys); the default hands them
     * to the children, and a leaf without such use ignores them. A write,
     * like add_kv: the search is const and runs in parallel, so what a
     * search found cannot be kept by the search itself.
     *
     * @param queries  size n * d: any number of query heads' queries of the
     *                 GQA group, in any order
     */
    void add_queries(idx_t n, const float* queries);

    /// Removes every token (a new sequence); the knobs stay.
    void reset() final;

    /** Top-k keys by inner product (exact or approximate, per type), as
     * faiss::Index::search: distances = <q, k_i> unscaled, labels = token
     * positions, padded with (lowest float, -1) when fewer than k are found.
     *
     * @param q          queries, size n * d
     * @param distances  output, size n * k
     * @param labels     output, size n * k
     */
    void search(
            idx_t n,
            const float* q,
            idx_t k,
            float* distances,
            idx_t* labels,
            const faiss::SearchParameters* params = nullptr) const final;

    /** The tokens attention should read for each query, with inclusion
     * probabilities.
     *
     * @param q    queries, size n * d
     * @param sel  output, size n
     */
    void select(
            idx_t n,
            const float* q,
            Selection* sel,
            const faiss::SearchParameters* params = nullptr) const;

    /** A sample of the tokens outside `excluded`, for the tail of a hybrid
     * estimator (IndexHybrid: exact heavy hitters + a sampled tail). Every
     * id of `sel` is outside `excluded`, and its inclusion probability is
     * the probability of drawing it given that the excluded ids are out,
     * so that sum_{i in sel} e^{s_i} / u_i is unbiased for the sum over the
     * tokens outside `excluded`. Samplers that can spend their budget on
     * the complement (IndexUniformSample) do; the default selects and then
     * drops the excluded ids, which keeps every u_i right for a sampler
     * whose draw does not depend on the excluded set (LSH: the tables are
     * fixed before the query).
     *
     * @param q         one query, size d
     * @param excluded  size n_excluded, distinct ids in [0, ntotal), increasing
     * @param sel       output: the sample, ids increasing
     */
    void select_outside(
            const float* q,
            const idx_t* excluded,
            size_t n_excluded,
            Selection& sel,
            const faiss::SearchParameters* params = nullptr) const;

    /** Attention output per query: by default select + estimate,
     * out_i = softmax_{j in S}(s_j - log u_j) v_j, lse_i = log sum_{j in S} e^{s_j} / u_j.
     *
     * @param q    queries, size n * d
     * @param out  output, size n * d_value
     * @param lse  log-sum-exp of the scores per query, size n (may be nullptr)
     */
    void attend(
            idx_t n,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params = nullptr) const;

    /// Key of token `key` (size d); throws for an id out of range.
    void reconstruct(idx_t key, float* recons) const final;

    /// Value of token `key` (size d_value); throws for an id out of range.
    void reconstruct_value(idx_t key, float* value) const;

    /// Bytes of memory the index holds (keys, values, structures).
    virtual size_t memory_bytes() const = 0;

    /// The top-k budget for one call: params->k if set, else this->k.
    idx_t effective_k(const faiss::SearchParameters* params) const;

    /// The attention scale 1 / sqrt(d).
    float score_scale() const;

    // ---- self-description: factory, io, parameters and tools use these --

    /// Name of the concrete type, the key of its registry row ("IndexKVFlat").
    virtual const char* type_name() const = 0;

    /** The canonical factory chain of this index (index_factory.h), without
     * the storage-type prefix: a wrapper appends its inner index's chain.
     * index_factory_string(index) = kv_type_prefix(kv_type) +
     * factory_string() is the whole string, and
     * index_factory(d, index_factory_string(index)) builds the same
     * structure, empty. */
    virtual std::string factory_string() const = 0;

    /// The indexes this one holds (wrappers, eviction: the inner index),
    /// outermost first; empty for a leaf type.
    virtual std::vector<const KVIndex*> children() const;
    std::vector<KVIndex*> mutable_children();

    /// Every index this one holds, in use or not: children(), and the
    /// indexes a type keeps dormant (IndexChoose's unchosen candidates).
    /// For walks that must reach them all, as setting parameters back
    /// after a refused item does.
    virtual std::vector<const KVIndex*> held_indexes() const {
        return children();
    }

    /** `bytes` read by a retrieval, in stored-key equivalents (the unit of
     * Selection::n_scanned), rounded up: a structure of float32 rows
     * (centroids, hyperplanes, anchors) counts twice a row's number of
     * stored keys under BF16 / FP16, a code or an id list its share. */
    size_t key_equivalents(size_t bytes) const;

    /** Whether a search of this index reads the per-call knob `name`, "k"
     * (the top-k budget) or one of a SearchParametersKV subclass
     * (SearchKnob::name), itself or through an index it hands the call
     * to. check_params refuses a call that sets a knob it does not read,
     * and "k" is a parameter (parameter_info) only of an index that reads
     * it, so that "LSHSample8x75|k=5" is refused, not ignored. The
     * default: whether any held index reads it (none for a leaf); a type
     * reading a knob itself says so. */
    virtual bool reads_search_knob(const std::string& name) const;

    /** `params` as `reader`, an index the caller hands the call to, takes
     * them: params itself when the reader reads each knob it sets, else a
     * copy (held in `copy`) without the others. For holders whose indexes
     * read different knobs (IndexChoose's candidates, IndexHybrid's heavy
     * part and tail, KVCache's dense and sparse layers), so that a knob is
     * refused only when none of them reads it. */
    static const faiss::SearchParameters* params_for(
            const KVIndex& reader,
            const faiss::SearchParameters* params,
            std::unique_ptr<SearchParametersKV>& copy);

    /** `params` as `reader`, one of `peers` that are all handed the same
     * params (the layers of a cache: k of the sparse layers also reaches a
     * dense Flat), takes them: without the knobs the reader does not read
     * but a peer does; a knob no peer reads is kept, for the reader to
     * refuse naming it. */
    static const faiss::SearchParameters* params_among(
            const KVIndex& reader,
            const std::vector<const KVIndex*>& peers,
            const faiss::SearchParameters* params,
            std::unique_ptr<SearchParametersKV>& copy);

    /// This type's own knobs (k where reads_search_knob("k")); the chain
    /// walk of set_index_parameters visits the children too.
    virtual std::vector<ParameterInfo> parameter_info() const;

    /** Sets one of this type's own knobs. Returns false when `name` is not
     * one of them; throws naming the knob when the value is out of range.
     * set_index_parameter (parameters.h) sets a knob on a whole chain. */
    virtual bool set_parameter(const std::string& name, double value);

    /// Reads one of this type's own knobs; false when it has no such knob.
    virtual bool get_parameter(const std::string& name, double* value) const;

    /** n more tokens of the sequence now follow this index's tokens, held
     * elsewhere (a later shard of an IndexKVShards): a type that places the
     * decode query by its position (IVFAsym: first_position + ntotal +
     * n_after - 1) moves it by n. This index only: the caller walks the
     * children. Default: nothing. */
    virtual void tokens_appended_after(idx_t /*n*/) noexcept {}

    /** One random stream per (layer, KV head), set by KVCache, so that
     * types drawing random numbers at prefill differ across heads. The
     * default hands it to the children; a type that samples keeps it. */
    virtual void set_stream(uint64_t stream);

    /** Takes the offline-trained parts (IVFAsym: centroids and Q-model) of
     * `trained`, an index built from the same factory string and trained
     * elsewhere (kvllm train, IVFAsymTrainer), so that the next prefill
     * starts from them. Returns how many indexes of this chain adopted
     * something (0: nothing in it is trained offline). The default pairs
     * each child with trained's child at the same place; throws when the
     * chains' types or child counts differ (a leaf trained nothing offline,
     * such as TopK, adopts nothing whatever its retriever). Runs
     * check_adopt_trained first: what it refuses changes nothing. */
    virtual int adopt_trained(const KVIndex& trained);

    /** Throws what adopt_trained(trained) would throw, and changes nothing:
     * chains of other types or child counts, another d or C, a trained
     * index without models, this index holding tokens. KVCache runs it on
     * every head before any head adopts. The default checks this type and
     * child count against trained's, then each child against its pair. */
    virtual void check_adopt_trained(const KVIndex& trained) const;

    /// The k of the top-k retrieval inside this index (what recall@k
    /// measures), 0 when it has none. Default: the first child's.
    virtual idx_t top_k_budget() const;

    /// Whether the type takes a key's position from its row (key j at
    /// first_position + j, the next appended at first_position + ntotal):
    /// IVFAsym undoes RoPE with it. Eviction, which hands its inner index
    /// a non-contiguous subset of the tokens, refuses such a type.
    virtual bool needs_contiguous_positions() const {
        return false;
    }

    /// Whether this index's RoPE came with models it adopted (IVFAsym after
    /// adopt_trained), not with tokens: a failed prefill, which fixes no
    /// RoPE anywhere in the chain, keeps it, so that the models' RoPE still
    /// binds the next prefill.
    virtual bool rope_fixed_by_models() const {
        return false;
    }

    /// Whether every selection of this index has inclusion 1 (a top-k or a
    /// fixed set, not a sample): the heavy part of IndexHybrid must. The
    /// default: whether every index it holds does (true for a leaf); the
    /// samplers say false.
    virtual bool selects_deterministically() const;

    /** Whether a write of this index (add_kv, prefill, reset) that throws
     * part-way, an allocation that fails say, leaves the index as it was
     * before the call: the strong guarantee, which the type keeps by
     * allocating all it needs before it changes anything. Where a type
     * does not (the default), such a throw marks the index failed
     * (failed_write()): every later call but reset() then throws naming
     * the write, and a reset() that succeeds makes it usable again, empty.
     * Either way nothing answers from a half-written index.
     * tests/test_allocation_faults.cpp fails each allocation of each write
     * of every type in turn and checks whichever the type says. */
    virtual bool writes_roll_back() const {
        return false;
    }

    /** Whether an add_kv that throws part-way leaves the index as it was:
     * writes_roll_back() by default; more types than that, since an append
     * can take back what its first part did (undo_add_kv): IndexHybrid
     * takes its heavy part's append back when its tail's throws. */
    virtual bool appends_roll_back() const {
        return writes_roll_back();
    }

    /// The write that threw part-way and left this index inconsistent, as
    /// "add_kv: <its message>", or nullptr; see writes_roll_back().
    const char* failed_write() const noexcept {
        return failed_write_[0] ? failed_write_ : nullptr;
    }

    /// Whether select draws its budget k uniformly at random among the
    /// tokens (u = k / n): the (epsilon, delta) tail budgets of IndexHybrid
    /// assume it. False by default.
    virtual bool samples_uniformly() const {
        return false;
    }

    /** io of a type stored as another type's record: that index, which
     * write_index then writes in this one's place (a GPU index returns its
     * CPU twin, so that its files read on any machine, as the CPU type).
     * nullptr (the default): the type writes its own record. */
    virtual std::unique_ptr<KVIndex> io_twin() const;

    /** io (index_io.h): the fields of this type, after the KVIndex fields
     * that the io writes for every type. A child index is written with
     * write_index_record, where the type wants it. */
    virtual void write_fields(BufferWriter& w) const = 0;

    /** Reads what write_fields wrote in record version `version` (1 up to
     * the version of the type's registry row: every version ever written
     * must stay readable). Called on an empty index whose KVIndex fields
     * are already read. */
    virtual void read_fields(BufferReader& r, uint32_t version) = 0;

    /** Throws naming the first inconsistency between the fields (sizes,
     * ranges, children): called after read_fields, so that a forged file
     * is refused before any search can read out of bounds. The base checks
     * the KVIndex fields (check_fields) and that children share d and
     * d_value. */
    virtual void check_invariants() const;

    /** The KVIndex fields' ranges: dimensions, ntotal, k, estimator, RoPE,
     * metric and storage type; throws naming `what`. check_invariants runs
     * it, and the reader before the type's own fields, which they size. */
    void check_fields(const char* what) const;

    /** Throws when an inner index holds other tokens than this index put
     * there: a write (add_kv, reset, ...) through a reference to a child,
     * from children(), mutable_children() or a public field, which the
     * wrapper cannot see. O(1) (a count per child); check_children runs
     * it first in every call of the public API and write_index, so that
     * such a write is an error naming the child, never an answer with ids
     * out of range. Types with inner indexes override it. */
    virtual void check_children_in_step() const {}

    /** What every call of the public API and write_index run first:
     * check_children_in_step (the token counts), then the children's
     * token stamps against those recorded at this index's last write, so
     * that a child reset and refilled to the same count, or replaced by
     * another index, is refused as well. Throws naming the child. */
    void check_children() const;

    /** Changes with every write of this index's tokens (add_kv, prefill,
     * reset), and differs between indexes: one process-wide counter.
     * A wrapper records its children's stamps after each of its writes
     * (check_children). A copy keeps the stamp: it holds the same tokens. */
    uint64_t token_stamp() const {
        return token_stamp_;
    }

    /// Keys and values of all tokens in order, where this index keeps them
    /// so (token_storage()); nullptr for types that keep them elsewhere.
    const KVStorage* stored_tokens() const {
        return token_storage();
    }

    /** Makes this index read its tokens from `tokens` instead of its own
     * copy, which it drops: for a parent that holds the same tokens in the
     * same order (IndexHybrid lends its heavy part's to its tail, so that
     * the hybrid keeps each token once). `tokens` must hold this index's
     * ntotal tokens, of its dimensions and type, and outlive it; the owner
     * appends first, and add_kv here then only checks that `tokens` has
     * grown by n. Throws when `tokens` differs from this index's tokens.
     * Returns false, changing nothing, for types that keep their own
     * (the default). A written record holds the tokens as before; a read
     * index holds its own copy until it is lent them again. */
    virtual bool share_tokens(const KVStorage* tokens);

   protected:
    // ---- the type's core: arguments checked, n > 0 ---------------------

    /// Appends already validated tokens; add_kv checks, then calls this.
    /// Where keeping_undo(), it keeps what undo_add_kv_impl needs.
    virtual void add_kv_impl(idx_t n, const float* keys, const float* values) = 0;

    /** Takes back the n tokens of the last add_kv_impl, which ran while
     * keeping_undo() (ntotal still counts them; the caller subtracts n).
     * Types with can_undo_add() override it; the default throws. */
    virtual void undo_add_kv_impl(idx_t n);

    /// Frees what add_kv_impl kept for an undo (the default: nothing).
    virtual void forget_undo_impl() noexcept {}

    /// Whether the add_kv_impl running now must keep what takes it back.
    bool keeping_undo() const {
        return undoable_add_;
    }

    /// Appends to a child as this index's own append runs: undoably when
    /// this one's is (keeping_undo()), so that undo_add_kv_impl can take
    /// the child's part back with child.undo_add_kv().
    void add_kv_to(KVIndex& child, idx_t n, const float* keys, const float* values) const;

    /// prefill's core; query-aware types override it (calling check_prefill
    /// first). The default checks and appends the tokens.
    virtual void prefill_impl(const PrefillInput& input);

    /// add_queries' core (n > 0, queries finite): the default hands them to
    /// every child.
    virtual void add_queries_impl(idx_t n, const float* queries);

    /// reset's core: drop every token, keep the knobs.
    virtual void reset_impl() = 0;

    /// reconstruct's cores, for an id in [0, ntotal). The defaults read
    /// token_storage().
    virtual void reconstruct_impl(idx_t key, float* recons) const;
    virtual void reconstruct_value_impl(idx_t key, float* value) const;

    /** Batch cores, called on a non-empty index. The defaults run the
     * per-query cores below in parallel over the queries (OpenMP, BLAS held
     * to one thread, the first exception rethrown after the loop); a type
     * overrides a batch core when its work batches (a Faiss retriever's
     * search, an inner index). attend_batch always gets an lse array. */
    virtual void search_batch(
            idx_t n,
            const float* q,
            idx_t k,
            float* distances,
            idx_t* labels,
            const faiss::SearchParameters* params) const;
    virtual void select_batch(
            idx_t n,
            const float* q,
            Selection* sel,
            const faiss::SearchParameters* params) const;
    virtual void attend_batch(
            idx_t n,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params) const;

    /// select_outside's core, for a valid, sorted excluded list on a
    /// non-empty index (see select_outside for the default).
    virtual void select_outside_one(
            const float* q,
            const idx_t* excluded,
            size_t n_excluded,
            Selection& sel,
            const faiss::SearchParameters* params) const;

    /** Per-query cores. select_one has no default: a type defines it or
     * select_batch. search_one defaults to the exact top-k by inner product
     * among select_one's tokens; attend_one to the index's estimator over
     * select_one's tokens, read from token_storage(). */
    virtual void select_one(const float* q, Selection& sel, const faiss::SearchParameters* params)
            const;
    virtual void search_one(
            const float* q,
            idx_t k,
            float* distances,
            idx_t* labels,
            const faiss::SearchParameters* params) const;
    /// Returns the lse; out has size d_value.
    virtual float attend_one(const float* q, float* out, const faiss::SearchParameters* params)
            const;

    /// The estimator over n selections of token_storage(), in parallel: for
    /// types whose selection is batched.
    void estimate_batch(idx_t n, const float* q, const Selection* sel, float* out, float* lse)
            const;

    /// Keys and values of all tokens in order (of type kv_type), for the
    /// default cores and reconstruct; types that keep tokens elsewhere
    /// return nullptr.
    virtual const KVStorage* token_storage() const {
        return nullptr;
    }

    /// Checks a prefill input, keys and values included; throws naming the
    /// problem. The caller records `rope` once the tokens are in.
    void check_prefill(const PrefillInput& input) const;

    /// Checks the queries of a call (n >= 0, q present and finite).
    void check_query_args(idx_t n, const float* q, const char* what) const;

    /// Throws for search parameters this index would not read: an
    /// IDSelector (not supported), a Faiss subclass (SearchParametersIVF:
    /// its knobs would be ignored), SearchParametersKV::k < 0, or a knob
    /// (k included) that no index of this chain reads (reads_search_knob).
    void check_params(const faiss::SearchParameters* params) const;


   private:
    friend class ReadScope;
    friend class WriteScope;
    friend std::unique_ptr<KVIndex> read_index_record(BufferReader& r);
    mutable AccessCount access_; ///< calls running now (thread-safety contract)

    uint64_t token_stamp_; ///< see token_stamp()
    /// see failed_write(): a fixed array, so that marking the index after
    /// an allocation failure needs no allocation
    char failed_write_[192] = {};
    /// tokens of the last add_kv_undoable that undo_add_kv can take back,
    /// -1 for none (see add_kv_undoable)
    idx_t undo_n_ = -1;
    /// true while an add_kv_undoable's core runs (keeping_undo())
    bool undoable_add_ = false;
    /// the children's token_stamp() after this index's last write, in the
    /// order of children(); empty until the first write (or read)
    std::vector<uint64_t> children_stamps_;

    /// A new token_stamp_ (construction, each write of the tokens).
    void stamp_tokens() noexcept;
    /// Records children_stamps_ after a write of this index.
    void record_children_stamps();
    /// Runs the core of add_kv, prefill or reset (`what`), then stamps
    /// this index and records its children's stamps, also when the core
    /// throws: it may have written part, and what it wrote into the
    /// children is this index's own doing. A throw marks the index failed
    /// unless its writes roll back (writes_roll_back); a success clears
    /// the mark (only reset() runs on a failed index).
    void write_tokens(const char* what, const std::function<void()>& core);
    /// Marks the index failed by the write `what`, which threw `why`.
    void mark_failed(const char* what, const char* why) noexcept;
    /// After a core threw: the mark (unless its writes roll back), the stamps.
    void after_failed_write(const char* what, const char* why) noexcept;
    /// reset's core; after a failed write, an index without RoPE also
    /// clears its children's (unfix_rope_below).
    void reset_after(bool failed);
    /// A new stamp and the children's, after a write (done or thrown).
    void stamp_after_write() noexcept;
    /// Clears has_rope and rope in every index below this one, but for a
    /// RoPE adopted models brought (rope_fixed_by_models).
    void unfix_rope_below();
};

/** Marks a const call running on `index` for its lifetime; throws, naming
 * `what`, if a write is running on it (see KVIndex, thread safety). The
 * second form guards any object by its own counter (a KVCache layer);
 * `where` names it in the message. */
class ReadScope {
   public:
    ReadScope(const KVIndex& index, const char* what);
    ReadScope(AccessCount& calls, const char* what, const char* where);
    ~ReadScope();
    ReadScope(const ReadScope&) = delete;
    ReadScope& operator=(const ReadScope&) = delete;

   private:
    AccessCount& calls_;
};

/** Marks a write running on `index` for its lifetime; throws, naming
 * `what`, if any other call is running on it. */
class WriteScope {
   public:
    WriteScope(KVIndex& index, const char* what);
    /// `where` names the index in the refusal (default "this index")
    WriteScope(KVIndex& index, const char* what, const char* where);
    WriteScope(AccessCount& calls, const char* what, const char* where);
    ~WriteScope();
    WriteScope(const WriteScope&) = delete;
    WriteScope& operator=(const WriteScope&) = delete;

   private:
    AccessCount& calls_;
};

/** A Scope (ReadScope or WriteScope) on each of `calls` for its lifetime,
 * taken in order: a call on every layer of a KVCache (reset,
 * adopt_trained, memory_bytes) holds them all before it touches any head.
 * Throws as the first one that refuses; those already taken are released. */
template <class Scope>
class ScopeEach {
   public:
    ScopeEach(std::vector<AccessCount>& calls, const char* what, const char* where) {
        for (AccessCount& c : calls) {
            scopes_.push_back(std::make_unique<Scope>(c, what, where));
        }
    }

   private:
    std::vector<std::unique_ptr<Scope>> scopes_;
};

} // namespace kvindex
