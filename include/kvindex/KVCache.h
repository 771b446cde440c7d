#pragma once

#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>

namespace kvindex {

/// A mutex a copy or move of its owner does not share: the new owner gets
/// a fresh one (owners are copied or moved only while no call runs on them).
struct OwnMutex {
    std::mutex mutex;
    OwnMutex() = default;
    OwnMutex(const OwnMutex&) {}
    OwnMutex& operator=(const OwnMutex&) {
        return *this;
    }
};

/** The KV cache of a model: n_layers x n_kv_heads indexes, built from one
 * factory string (and optionally another for the dense layers, e.g. layer 0).
 *
 * GQA: query head h reads KV head h / (n_q_heads / n_kv_heads), the Llama
 * (repeat_interleave) convention. The heads of a layer run in parallel with
 * OpenMP; an exception in any head is rethrown after the loop.
 *
 * Array layouts are head-major: keys [n_kv_heads, n, d], queries
 * [n_q_heads, n, d], outputs [n_q_heads, n, d_value].
 */
struct KVCache {
    /// shape limits, far above any model's (SmolLM2: 30 layers, 9 / 3 heads)
    static constexpr int kMaxLayers = 1 << 12;
    static constexpr int kMaxHeads = 1 << 12;

    int n_layers;
    int n_q_heads;
    int n_kv_heads;
    int d;        ///< head dimension of queries and keys
    int d_value;  ///< head dimension of values
    std::string index_string;       ///< factory string of the sparse layers
    std::string dense_string;       ///< factory string of the dense layers
    std::vector<int> dense_layers;  ///< layers built from dense_string
    /// size n_layers * n_kv_heads, index (layer, h) at layer * n_kv_heads + h
    std::vector<std::unique_ptr<KVIndex>> indexes;
    /// fixed by the first prefill; every layer must agree. Prefills of
    /// different layers may run at once: read it through fixed_rope()
    RopeParams rope;
    bool has_rope = false; ///< whether a prefill has fixed `rope`
    /// prefills in flight that claimed `rope` before any prefill fixed it
    /// (a second layer's prefill must agree with a claim, and the claim
    /// goes when its prefill fails)
    int rope_claims = 0;
    /// guards rope, has_rope and rope_claims
    mutable OwnMutex rope_mutex;
    /// size n_layers: the calls running on each layer. A write (prefill,
    /// append, add_queries) overlapping another call on its layer is refused
    /// before any head changes, so the heads never differ in length
    mutable std::vector<AccessCount> layer_calls;

    KVCache(int n_layers,
            int n_q_heads,
            int n_kv_heads,
            int d,
            int d_value,
            const std::string& index_string,
            const std::string& dense_string = "Flat",
            const std::vector<int>& dense_layers = {});

    /** Throws unless the shape is one a cache can hold: layers and heads
     * within the limits above, query heads a multiple of KV heads,
     * dimensions within kMaxDimension (d_value -1: d), dense layers among
     * the layers. Messages start with `what`. Run by the constructors of
     * KVCache and GpuKVCache before anything else. */
    static void check_shape(
            const char* what,
            int n_layers,
            int n_q_heads,
            int n_kv_heads,
            int d,
            int d_value,
            const std::vector<int>& dense_layers);

    /// Whether a prefill has fixed the cache's RoPE, and if so which
    /// (copied into *out, which may be nullptr); safe beside prefills.
    bool fixed_rope(RopeParams* out) const;

    int group_size() const {
        return n_q_heads / n_kv_heads;
    }
    /// KV head read by query head h.
    int kv_head_of(int q_head) const {
        return q_head / group_size();
    }
    KVIndex* index(int layer, int kv_head);
    const KVIndex* index(int layer, int kv_head) const;
    idx_t n_tokens(int layer) const;

    /** Prefill of one layer. All input is checked before any head changes;
     * if a head fails inside its index, the layer is left empty. The first
     * prefill fixes the cache's RoPE; prefills of other layers running at
     * the same time must agree with it, or are refused.
     * @param keys       size n_kv_heads * n * d
     * @param values     size n_kv_heads * n * d_value
     * @param queries    size n_q_heads * n_queries * d, or nullptr
     * @param positions  size n_queries, or nullptr (the last n_queries tokens)
     * @param first_position  absolute position of the first key: 0 for a
     *                   whole prompt, the range's start for a cache that
     *                   holds one token range of a sequence (a shard)
     */
    void prefill(
            int layer,
            idx_t n,
            const float* keys,
            const float* values,
            idx_t n_queries,
            const float* queries,
            const idx_t* positions,
            const RopeParams& rope,
            idx_t first_position = 0);

    /// Appends n tokens to every KV head of a layer (same layouts as
    /// prefill), all or nothing. All input is checked, each head's slice as
    /// that head's add_kv checks it (its storage type included: a key an
    /// FP16 head cannot hold), and a call running on the layer in another
    /// thread refused, before any head appends. The heads then append
    /// undoably (KVIndex::add_kv_undoable): when one throws part-way (out of
    /// memory, a retriever that cannot train), the others take their
    /// appends back and the layer is as it was. Where a head's type cannot
    /// (can_undo_add: a TopK over HNSW), such a failure leaves the heads
    /// with different lengths: every later call on the layer is then
    /// refused, naming the head, until reset().
    void append(int layer, idx_t n, const float* keys, const float* values);

    /** append that the layer can take back (undo_append) until its next
     * write: a caller that appends one step to several caches (a cache
     * spread over processes, RayKVCache) takes back the ones that
     * appended when another refuses. What the heads keep for it is freed
     * by their next write. Throws, changing nothing, unless
     * can_undo_append(layer). */
    void append_undoable(int layer, idx_t n, const float* keys, const float* values);

    /** Takes back the layer's last append_undoable: the layer then answers
     * as before it. Throws, changing nothing, when there is none (another
     * write came after it, or none was made). A head whose undo fails part-
     * way is marked failed, and the layer refused until reset(). */
    void undo_append(int layer);

    /// Whether every head of the layer can take an append back (KVIndex::can_undo_add).
    bool can_undo_append(int layer) const;

    /// Throws what append(layer, n, keys, values) would throw for its input
    /// (the layer, the arrays, each head's slice as that head's add_kv
    /// checks it), changing nothing: a caller that appends the tokens in
    /// parts (a decode step of n tokens, one by one) checks them whole first.
    void check_append(int layer, idx_t n, const float* keys, const float* values) const;

    /** Removes every token of every layer: a new sequence, or a layer that
     * a failed append left out of step. Each index keeps what
     * KVIndex::reset keeps (its knobs), the cache keeps its RoPE. Refused
     * before any head changes while another call runs on any layer; if a
     * head's reset throws (out of memory), call it again. */
    void reset();

    /** Removes every token of one layer, as reset() does for all: a caller
     * that prefilled one layer over several caches (RayKVCache's shards)
     * empties the ones that took it when another refused it. Refused
     * before any head changes while another call runs on the layer; if a
     * head's reset throws, call it again. */
    void reset_layer(int layer);

    /** Attention of n queries per query head of one layer. Each KV head
     * gets the queries of its whole GQA group in one attend call (g * n
     * queries), so that an index that batches reads its tokens once per
     * group; the KV heads run in parallel. A decode loop hands one
     * `params` to every layer: a knob a layer's index does not read but
     * another layer's does (k of the sparse string, on a dense Flat layer)
     * is dropped for it; one that no layer reads is refused.
     * @param q    size n_q_heads * n * d
     * @param out  size n_q_heads * n * d_value
     * @param lse  size n_q_heads * n, or nullptr
     */
    void attend(
            int layer,
            idx_t n,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params = nullptr) const;

    /** Hands n queries per query head of one layer, already answered by
     * attend (same layout), to the indexes that learn from them
     * (KVIndex::add_queries): each KV head gets its group's g * n queries.
     * @param q    size n_q_heads * n * d
     */
    void add_queries(int layer, idx_t n, const float* q);

    /** Takes the offline-trained models of `trained` (a cache read with
     * read_cache, e.g. what `kvllm train` wrote) into the indexes of every
     * sparse layer (those not in dense_layers), before their prefill:
     * index(l, h)->adopt_trained(*trained.index(l, h)) (KVIndex.h). The
     * dense layers keep their own string and adopt nothing. Throws naming
     * the mismatch when n_layers, n_kv_heads or d differ, or naming the
     * layer and head when a chain differs from trained's or a head holds
     * tokens; every head is checked before any adopts, so that a refusal
     * changes nothing. Holds every layer, as reset. Returns how many
     * indexes adopted something (0: nothing in the string is trained
     * offline).
     */
    int adopt_trained(const KVCache& trained);

    size_t memory_bytes() const;

    /** Throws naming the first layer whose KV heads hold different numbers
     * of tokens, or an index holding tokens whose RoPE is not the cache's
     * (an empty one may carry its adopted models' RoPE): what a write
     * through index(l, h), or a head that failed inside append, leaves.
     * write_cache and read_cache check the whole cache; prefill, append,
     * attend and add_queries check their layer first (O(n_kv_heads)). */
    void check_invariants() const;

   private:
    void check_layer_in_step(int layer, const char* what) const;
    /// A write scope on every KV head of the layer (KVIndex: thread safety),
    /// taken in order; throws, naming the head, if one refuses.
    std::vector<std::unique_ptr<WriteScope>> hold_heads(int layer, const char* what);
    /** Takes back the last undoable append of the heads h with which[h]
     * (size n_kv_heads), whose scopes the caller holds, each whatever
     * another's undo throws; returns the first error (that head is marked
     * failed), or null. */
    std::exception_ptr undo_heads(int layer, const std::vector<char>& which);
    /// append and append_undoable (keep: the heads keep what undo_append needs).
    void append_heads(int layer, idx_t n, const float* keys, const float* values, bool keep);
    /// check_append's checks, for a caller that holds the layer.
    void check_append_input(int layer, idx_t n, const float* keys, const float* values) const;
    /// Throws unless keys / values of n tokens per KV head are present and finite.
    void check_tokens(idx_t n, const float* keys, const float* values, const char* what) const;
};

} // namespace kvindex
