#pragma once

#include <memory>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>

namespace kvindex {

struct FactoryChain;

/** Token-range shards, as context-parallel decoding splits a KV cache:
 * tokens [s * T, (s + 1) * T) live in shard s, an index of its own built
 * from one chain (any factory string). The shards answer every call
 * independently and their answers merge:
 *
 *  - attend: each shard's (out, lse) over its tokens, merged by
 *    log-sum-exp (merge_attention, the estimator layer's merge, as
 *    Sink,Window merges its parts). Exact shards merge to exact attention;
 *    a sampled estimator stays unbiased per shard, so the merge does too.
 *  - search: the shards' top-k, merged (ties to the lower position).
 *  - select: the union of the shards' selections.
 *
 * Budgets are per shard: "Shards4096(TopK(Flat))|k=64" reads 64 keys of
 * every shard, as each machine of a context-parallel decode selects its
 * own. Appends go to the last shard; a new shard opens when it holds T.
 * At prefill, each shard learns from the prompt's queries that can see
 * its tokens (at positions from its first on; shard 0 from all of them).
 * A shard opened by an append is prefilled with its first tokens (the
 * RoPE and positions of the prompt's shards) and no queries: query-aware
 * chains learn from the prompt's queries only in the prompt's shards.
 * Every shard knows its tokens' positions, and the tokens after them
 * (tokens_appended_after), so that a chain that undoes RoPE (IVFAsym)
 * places keys and the decode query right in every shard.
 *
 * Shard 0 draws from the stream set_stream gives this index, so that a
 * context of at most T tokens answers as the chain alone, bit for bit; the
 * other shards draw from streams derived from it.
 *
 * Factory string: "Shards<T>(<chain>)", e.g. "Shards4096(Sink4,Window64,LSHSample10x150)".
 */
struct IndexKVShards : KVIndex {
    idx_t shard_tokens = 0; ///< T: tokens per shard (the last holds 1 .. T)
    /// the chain every shard is built from, holding no tokens: the knobs set
    /// on this index reach it, and a shard opens as its copy
    std::unique_ptr<KVIndex> empty_shard;
    /// size ceil(ntotal / T); shard s holds tokens s * T .. min(ntotal, (s + 1) * T) - 1
    std::vector<std::unique_ptr<KVIndex>> shards;
    uint64_t stream = 0;      ///< set_stream's; shard 0 draws from it
    idx_t first_position = 0; ///< absolute position of token 0 (prefill's)
    idx_t n_after = 0;        ///< prefill's n_after: tokens the caller keeps after these

    IndexKVShards(idx_t shard_tokens, std::unique_ptr<KVIndex> empty_shard);
    IndexKVShards();

    size_t memory_bytes() const override;
    /// as its chain's: an append builds the shards it opens aside, and
    /// writes the last shard only then
    bool writes_roll_back() const override;
    bool appends_roll_back() const override {
        return empty_shard && empty_shard->appends_roll_back();
    }
    /// as its chain's: the shards an append opened are dropped, the last
    /// shard's part taken back
    bool can_undo_add() const override;
    bool needs_contiguous_positions() const override;
    void tokens_appended_after(idx_t n) noexcept override {
        n_after += n;
    }
    void set_stream(uint64_t stream) override;
    /// the random stream of shard s
    uint64_t shard_stream(size_t s) const;

    /// Offline-trained models (IVFAsym) go to the empty shard, from the
    /// first shard of `trained` (an IndexKVShards of the same T and
    /// chain): every shard opened after starts from them.
    int adopt_trained(const KVIndex& trained) override;
    void check_adopt_trained(const KVIndex& trained) const override;

    const char* type_name() const override {
        return "IndexKVShards";
    }
    std::string factory_string() const override;
    /// the empty shard, then the shards in order
    std::vector<const KVIndex*> children() const override;
    void write_fields(BufferWriter& w) const override;
    void read_fields(BufferReader& r, uint32_t version) override;
    void check_invariants() const override;
    void check_children_in_step() const override;

    /// Registry parser: "Shards<T>(<chain>)".
    static std::unique_ptr<KVIndex> from_factory(FactoryChain& chain);

   private:
    /// what the last add_kv kept for undo_add_kv: the shards it opened,
    /// the tokens it gave the shard that was last before it
    size_t undo_opened = 0;
    idx_t undo_to_last = 0;
    /** The indexes of the shards an append's decode query moves past
     * (tokens_appended_after), where the chain reads positions: every
     * index of the shards before the last into `full`, and, when the last
     * shard takes tokens of the append (last_takes), its indexes into
     * `last`, else into `full` too. */
    void followers(bool last_takes, std::vector<KVIndex*>& full, std::vector<KVIndex*>& last);
    /// Shard s, empty: a copy of empty_shard on its stream.
    std::unique_ptr<KVIndex> open_shard(size_t s) const;
    /// Gives the new shard s its first m tokens, followed by `after` more
    /// of the sequence: a prefill without queries once this index was
    /// prefilled (positions, RoPE), else add_kv.
    void fill_shard(KVIndex& shard, size_t s, idx_t m, idx_t after, const float* keys,
                    const float* values) const;

   protected:
    void prefill_impl(const PrefillInput& input) override;
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    void undo_add_kv_impl(idx_t n) override;
    void add_queries_impl(idx_t n, const float* queries) override;
    void reset_impl() override;
    void reconstruct_impl(idx_t key, float* recons) const override;
    void reconstruct_value_impl(idx_t key, float* value) const override;
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
};

} // namespace kvindex
