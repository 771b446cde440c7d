#include <kvindex/KVCache.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/errors.h>
#include <kvindex/index_factory.h>

#include "checks.h"
#include "parallel.h"

namespace kvindex {

void KVCache::check_shape(
        const char* what,
        int n_layers,
        int n_q_heads,
        int n_kv_heads,
        int d,
        int d_value,
        const std::vector<int>& dense_layers) {
    KVINDEX_CHECK_ARG(
            n_layers > 0 && n_layers <= kMaxLayers && n_q_heads > 0 && n_q_heads <= kMaxHeads &&
                    n_kv_heads > 0 && n_kv_heads <= kMaxHeads,
            "%s: n_layers=%d must be in [1, %d], n_q_heads=%d and n_kv_heads=%d in [1, %d]",
            what,
            n_layers,
            kMaxLayers,
            n_q_heads,
            n_kv_heads,
            kMaxHeads);
    KVINDEX_CHECK_ARG(
            n_q_heads % n_kv_heads == 0,
            "%s: n_q_heads=%d is not a multiple of n_kv_heads=%d (GQA)",
            what,
            n_q_heads,
            n_kv_heads);
    KVINDEX_CHECK_ARG(
            d > 0 && d <= kMaxDimension && (d_value == -1 || (d_value > 0 && d_value <= kMaxDimension)),
            "%s: d=%d and d_value=%d must be in [1, %d] (d_value -1: d)",
            what,
            d,
            d_value,
            kMaxDimension);
    for (int l : dense_layers) {
        KVINDEX_CHECK_ARG(
                l >= 0 && l < n_layers, "%s: dense layer %d out of [0, n_layers=%d)", what, l, n_layers);
    }
}

KVCache::KVCache(
        int n_layers,
        int n_q_heads,
        int n_kv_heads,
        int d,
        int d_value,
        const std::string& index_string,
        const std::string& dense_string,
        const std::vector<int>& dense_layers)
        : n_layers(n_layers),
          n_q_heads(n_q_heads),
          n_kv_heads(n_kv_heads),
          d(d),
          d_value(d_value < 0 ? d : d_value),
          index_string(index_string),
          dense_string(dense_string),
          dense_layers(dense_layers),
          // checked before anything is sized by the shape
          layer_calls((check_shape("KVCache", n_layers, n_q_heads, n_kv_heads, d, d_value, dense_layers),
                       n_layers)) {
    indexes.reserve(size_t(n_layers) * n_kv_heads);
    for (int l = 0; l < n_layers; l++) {
        bool dense = std::find(dense_layers.begin(), dense_layers.end(), l) !=
                dense_layers.end();
        for (int h = 0; h < n_kv_heads; h++) {
            indexes.push_back(
                    index_factory(d, dense ? dense_string : index_string, this->d_value));
            // types that sample (eviction) draw differently in every (layer, head)
            indexes.back()->set_stream(uint64_t(l) * n_kv_heads + h);
        }
    }
}

KVIndex* KVCache::index(int layer, int kv_head) {
    return const_cast<KVIndex*>(std::as_const(*this).index(layer, kv_head));
}

const KVIndex* KVCache::index(int layer, int kv_head) const {
    KVINDEX_CHECK_ARG(
            layer >= 0 && layer < n_layers,
            "KVCache: layer %d out of [0, %d)",
            layer,
            n_layers);
    KVINDEX_CHECK_ARG(
            kv_head >= 0 && kv_head < n_kv_heads,
            "KVCache: KV head %d out of [0, %d)",
            kv_head,
            n_kv_heads);
    return indexes[size_t(layer) * n_kv_heads + kv_head].get();
}

idx_t KVCache::n_tokens(int layer) const {
    return index(layer, 0)->ntotal;
}

namespace {

/** A prefill's hold on the cache's RoPE, taken before any head changes:
 * refused when another layer's prefill fixed, or is fixing, another RoPE.
 * Until commit() it is a claim, which the destructor drops, so that a
 * failed first prefill fixes nothing. */
class RopeClaim {
   public:
    RopeClaim(KVCache& cache, int layer, const RopeParams& rope) : cache_(cache) {
        std::lock_guard<std::mutex> lock(cache_.rope_mutex.mutex);
        bool taken = cache_.has_rope || cache_.rope_claims > 0;
        KVINDEX_CHECK_ARG(
                !taken || rope == cache_.rope,
                "KVCache::prefill: RoPE parameters mismatch: layer %d has theta=%g "
                "style=%s, the cache has theta=%g style=%s (%s)",
                layer,
                rope.theta,
                rope_style_name(rope.style),
                cache_.rope.theta,
                rope_style_name(cache_.rope.style),
                cache_.has_rope ? "fixed by an earlier prefill"
                                : "claimed by a prefill of another layer running now");
        if (!cache_.has_rope) {
            cache_.rope = rope;
            cache_.rope_claims++;
            claimed_ = true;
        }
    }
    RopeClaim(const RopeClaim&) = delete;
    RopeClaim& operator=(const RopeClaim&) = delete;

    /// The prefill succeeded: the cache's RoPE is fixed.
    void commit() {
        std::lock_guard<std::mutex> lock(cache_.rope_mutex.mutex);
        cache_.has_rope = true;
        drop_locked();
    }

    ~RopeClaim() {
        if (claimed_) {
            std::lock_guard<std::mutex> lock(cache_.rope_mutex.mutex);
            drop_locked();
        }
    }

   private:
    void drop_locked() {
        if (claimed_) {
            cache_.rope_claims--;
            claimed_ = false;
        }
    }
    KVCache& cache_;
    bool claimed_ = false;
};

/// Clears has_rope in `index` and every index it holds, but for a RoPE
/// adopted models brought (KVIndex::rope_fixed_by_models).
void forget_rope(KVIndex* index) {
    if (!index->rope_fixed_by_models()) { // adopted models keep theirs
        index->has_rope = false;
    }
    for (KVIndex* c : index->mutable_children()) {
        forget_rope(c);
    }
}

} // namespace

bool KVCache::fixed_rope(RopeParams* out) const {
    std::lock_guard<std::mutex> lock(rope_mutex.mutex);
    if (has_rope && out) {
        *out = rope;
    }
    return has_rope;
}

void KVCache::check_layer_in_step(int layer, const char* what) const {
    const idx_t n = n_tokens(layer);
    RopeParams cache_rope;
    const bool cache_has_rope = fixed_rope(&cache_rope);
    for (int h = 0; h < n_kv_heads; h++) {
        const KVIndex* x = index(layer, h);
        FAISS_THROW_IF_NOT_FMT(
                x->ntotal == n,
                "%s: layer %d: KV head %d holds %zd tokens, head 0 %zd (written through index(), or a "
                "head failed inside append; reset() empties the cache)",
                what,
                layer,
                h,
                size_t(x->ntotal),
                size_t(n));
        // an empty head may carry the RoPE of models it adopted (a bare
        // IVFAsym<C>): that binds at its prefill, which refuses another;
        // tokens must have been stored under the cache's RoPE
        FAISS_THROW_IF_NOT_FMT(
                x->ntotal == 0 || !x->has_rope || (cache_has_rope && x->rope == cache_rope),
                "%s: layer %d: KV head %d has RoPE theta=%g that the cache does not (has_rope=%d, "
                "theta=%g)",
                what,
                layer,
                h,
                x->rope.theta,
                int(cache_has_rope),
                cache_rope.theta);
    }
}

void KVCache::check_invariants() const {
    for (int l = 0; l < n_layers; l++) {
        check_layer_in_step(l, "KVCache");
    }
}

void KVCache::prefill(
        int layer,
        idx_t n,
        const float* keys,
        const float* values,
        idx_t n_queries,
        const float* queries,
        const idx_t* positions,
        const RopeParams& rope,
        idx_t first_position) {
    index(layer, 0); // checks the layer
    WriteScope scope(layer_calls[layer], "KVCache::prefill", "this layer of the cache");
    check_rope_params(rope, d);
    RopeClaim claim(*this, layer, rope);
    // Check everything before touching any head, so that bad input leaves
    // the layer as it was.
    KVINDEX_CHECK_ARG(n >= 0, "KVCache::prefill: n=%zd must be >= 0", size_t(n));
    KVINDEX_CHECK_ARG(
            first_position >= 0 && first_position <= kMaxPosition - n,
            "KVCache::prefill: first_position=%lld outside [0, 2^62 - n]",
            (long long)first_position);
    for (int h = 0; h < n_kv_heads; h++) {
        FAISS_THROW_IF_NOT_FMT(
                index(layer, h)->ntotal == 0,
                "KVCache::prefill: layer %d already holds tokens (use append)",
                layer);
    }
    check_tokens(n, keys, values, "KVCache::prefill");
    if (n_queries > 0) {
        check_not_null(queries, "KVCache::prefill: queries");
        check_input_size(n_queries, size_t(n_q_heads) * d, "KVCache::prefill: queries");
        check_input(queries, n_q_heads * n_queries, d, "KVCache::prefill: queries");
    }
    int g = group_size();
    LayerPrompt whole;
    whole.n_kv_heads = n_kv_heads;
    whole.n_query_heads = g;
    whole.n_tokens = n;
    whole.first_position = first_position;
    whole.keys = keys;
    whole.n_queries = n_queries;
    whole.queries = n_queries > 0 ? queries : nullptr;
    whole.query_positions = positions;
    whole.shared = std::make_shared<LayerPrompt::Shared>();
    try {
        parallel_for(n_kv_heads, [&](idx_t h) {
            PrefillInput in;
            in.layer = &whole;
            in.layer_kv_head = int(h);
            in.n_tokens = n;
            in.keys = keys + h * n * d;
            in.values = values + h * n * d_value;
            in.n_queries = n_queries;
            in.n_query_heads = g;
            // the query heads of KV head h are g consecutive heads
            in.queries = queries ? queries + h * g * n_queries * d : nullptr;
            in.query_positions = positions;
            in.first_position = first_position;
            in.rope = rope;
            index(layer, int(h))->prefill(in);
        });
    } catch (...) {
        // a head failed inside (e.g. its retriever could not train, or a
        // value its storage type cannot hold): the layer goes back to
        // empty rather than half-filled, and a first prefill fixes no RoPE
        // (reset keeps it: the other heads would be out of step with the
        // cache, and a later prefill with another RoPE refused)
        const bool keep_rope = fixed_rope(nullptr);
        for (int h = 0; h < n_kv_heads; h++) {
            index(layer, h)->reset();
            if (!keep_rope) {
                forget_rope(index(layer, h));
            }
        }
        throw;
    }
    claim.commit();
}

void KVCache::check_tokens(idx_t n, const float* keys, const float* values, const char* what)
        const {
    check_head_tokens(n, n_kv_heads, d, d_value, keys, values, what);
}

void KVCache::check_append(int layer, idx_t n, const float* keys, const float* values) const {
    index(layer, 0);
    ReadScope scope(layer_calls[layer], "KVCache::check_append", "this layer of the cache");
    check_layer_in_step(layer, "KVCache::append");
    check_append_input(layer, n, keys, values);
}

void KVCache::check_append_input(int layer, idx_t n, const float* keys, const float* values) const {
    KVINDEX_CHECK_ARG(n >= 0, "KVCache::append: n=%zd must be >= 0", size_t(n));
    // bad input is refused before any head appends: the layer's arrays,
    // then each head's slice as that head's add_kv checks it (finite, and
    // within its storage type: a value an FP16 head cannot hold in head 2
    // would otherwise be refused after heads 0 and 1 took the token, and
    // the layer be out of step for good)
    check_head_arrays(n, n_kv_heads, d, d_value, keys, values, "KVCache::append");
    for (int h = 0; h < n_kv_heads; h++) {
        const KVIndex* head = index(layer, h);
        const float* k = keys + h * n * d;
        const float* v = values + h * n * d_value;
        try {
            head->check_add_kv(n, k, v);
        } catch (const faiss::FaissException&) {
            // again, naming the head: the names cost more than the checks,
            // so a decode step's append builds them only for an error
            std::string what = "KVCache::append: layer " + std::to_string(layer) +
                    ", KV head " + std::to_string(h);
            head->check_add_kv(n, k, v, what.c_str(), (what + ": keys").c_str(),
                               (what + ": values").c_str());
            throw;
        }
    }
}

void KVCache::append(int layer, idx_t n, const float* keys, const float* values) {
    append_heads(layer, n, keys, values, false);
}

void KVCache::append_undoable(int layer, idx_t n, const float* keys, const float* values) {
    append_heads(layer, n, keys, values, true);
}

bool KVCache::can_undo_append(int layer) const {
    index(layer, 0);
    for (int h = 0; h < n_kv_heads; h++) {
        if (!index(layer, h)->can_undo_add()) {
            return false;
        }
    }
    return true;
}

void KVCache::append_heads(int layer, idx_t n, const float* keys, const float* values, bool keep) {
    const char* what = keep ? "KVCache::append_undoable" : "KVCache::append";
    index(layer, 0);
    WriteScope scope(layer_calls[layer], what, "this layer of the cache");
    check_layer_in_step(layer, what);
    check_append_input(layer, n, keys, values);
    // Each head appends so that it can take its append back (where its type
    // can: can_undo_add): a head that throws part-way (an allocation, a
    // retriever that cannot train) leaves itself as it was
    // (appends_roll_back) or marked failed, and the heads that appended take
    // theirs back, so that the layer is as it was
    const bool undoable = can_undo_append(layer);
    FAISS_THROW_IF_NOT_FMT(
            undoable || !keep,
            "%s: layer %d holds indexes that cannot take an append back (%s; can_undo_add)",
            what,
            layer,
            index(layer, 0)->factory_string().c_str());
    // every head held before any appends: a call running on one head (its
    // index() used directly) refuses the append while no head has changed
    auto heads = hold_heads(layer, what);
    std::vector<char> appended(n_kv_heads, 0);
    try {
        parallel_for(n_kv_heads, [&](idx_t h) {
            index(layer, int(h))->add_kv_in_scope(n, keys + h * n * d, values + h * n * d_value, undoable);
            appended[h] = 1;
        });
    } catch (...) {
        if (undoable) {
            // a head whose undo fails is marked failed (undo_add_kv): the
            // layer is refused, naming it, until reset()
            undo_heads(layer, appended);
        }
        throw;
    }
    if (undoable && !keep) {
        for (int h = 0; h < n_kv_heads; h++) {
            index(layer, h)->forget_undo(); // what the heads kept is freed
        }
    }
}

std::vector<std::unique_ptr<WriteScope>> KVCache::hold_heads(int layer, const char* what) {
    std::vector<std::unique_ptr<WriteScope>> heads;
    heads.reserve(n_kv_heads);
    for (int h = 0; h < n_kv_heads; h++) {
        try {
            heads.push_back(std::make_unique<WriteScope>(*index(layer, h), what, "a KV head"));
        } catch (const CallRefused& e) {
            // the names cost more than the scopes: built for a refusal only
            KVINDEX_THROW_FMT(CallRefused, "layer %d, KV head %d: %s", layer, h, bare_error_message(e).c_str());
        }
    }
    return heads;
}

void KVCache::undo_append(int layer) {
    index(layer, 0);
    WriteScope scope(layer_calls[layer], "KVCache::undo_append", "this layer of the cache");
    const idx_t n = index(layer, 0)->undoable_tokens();
    for (int h = 0; h < n_kv_heads; h++) {
        FAISS_THROW_IF_NOT_FMT(
                n >= 0 && index(layer, h)->undoable_tokens() == n,
                "KVCache::undo_append: layer %d has no append to take back (only the last "
                "append_undoable, before any other write of the layer)",
                layer);
    }
    auto heads = hold_heads(layer, "KVCache::undo_append");
    if (std::exception_ptr first = undo_heads(layer, std::vector<char>(n_kv_heads, 1))) {
        std::rethrow_exception(first);
    }
}

std::exception_ptr KVCache::undo_heads(int layer, const std::vector<char>& which) {
    std::exception_ptr first;
    for (int h = 0; h < n_kv_heads; h++) {
        if (!which[h]) {
            continue;
        }
        try {
            index(layer, h)->undo_add_kv_in_scope();
        } catch (...) {
            if (!first) {
                first = std::current_exception(); // the head is marked failed
            }
        }
    }
    return first;
}

void KVCache::reset() {
    // every layer held first, so that no call runs on a layer while its
    // heads empty one by one
    ScopeEach<WriteScope> holding(layer_calls, "KVCache::reset", "a layer of the cache");
    for (auto& head : indexes) {
        head->reset();
    }
}

void KVCache::reset_layer(int layer) {
    index(layer, 0);
    WriteScope scope(layer_calls[layer], "KVCache::reset_layer", "this layer of the cache");
    for (int h = 0; h < n_kv_heads; h++) {
        index(layer, h)->reset();
    }
}

void KVCache::attend(
        int layer,
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    index(layer, 0);
    ReadScope scope(layer_calls[layer], "KVCache::attend", "this layer of the cache");
    check_layer_in_step(layer, "KVCache::attend");
    KVINDEX_CHECK_ARG(n >= 0, "KVCache::attend: n=%zd must be >= 0", size_t(n));
    if (n > 0) {
        check_input_size(n, size_t(n_q_heads) * std::max(d, d_value), "KVCache::attend");
        check_not_null(q, "KVCache::attend: queries");
        check_not_null(out, "KVCache::attend: out");
    }
    // One call per KV head with the g * n queries of its group: the query
    // heads of KV head h are g consecutive heads, so their queries, outputs
    // and lse are contiguous ([g, n, d] is [g * n, d]), and an index that
    // batches (Flat: one pass over its keys and values) reads its tokens
    // once per group instead of once per query head.
    idx_t g = group_size();
    // one params for every layer: each head drops what only another layer reads
    std::vector<const KVIndex*> layers;
    if (params) {
        for (int l = 0; l < n_layers; l++) {
            layers.push_back(index(l, 0));
        }
    }
    parallel_for(n_kv_heads, [&](idx_t h) {
        std::unique_ptr<SearchParametersKV> copy;
        const KVIndex* head = index(layer, int(h));
        head->attend(
                g * n,
                q + h * g * n * d,
                out + h * g * n * d_value,
                lse ? lse + h * g * n : nullptr,
                KVIndex::params_among(*head, layers, params, copy));
    });
}

void KVCache::add_queries(int layer, idx_t n, const float* q) {
    index(layer, 0);
    WriteScope scope(layer_calls[layer], "KVCache::add_queries", "this layer of the cache");
    check_layer_in_step(layer, "KVCache::add_queries");
    KVINDEX_CHECK_ARG(n >= 0, "KVCache::add_queries: n=%zd must be >= 0", size_t(n));
    if (n == 0) {
        return;
    }
    check_not_null(q, "KVCache::add_queries: queries");
    check_input_size(n, size_t(n_q_heads) * d, "KVCache::add_queries: queries");
    // checked before any head learns, as append does
    check_input(q, idx_t(n_q_heads) * n, size_t(d), "KVCache::add_queries: queries");
    idx_t g = group_size(); // the group's queries are contiguous, as in attend
    parallel_for(n_kv_heads, [&](idx_t h) {
        index(layer, int(h))->add_queries(g * n, q + h * g * n * d);
    });
}

int KVCache::adopt_trained(const KVCache& trained) {
    KVINDEX_CHECK_ARG(
            trained.n_layers == n_layers && trained.n_kv_heads == n_kv_heads &&
                    trained.d == d,
            "KVCache::adopt_trained: the trained cache has %d layers x %d KV heads, d=%d; "
            "this one %d layers x %d KV heads, d=%d",
            trained.n_layers,
            trained.n_kv_heads,
            trained.d,
            n_layers,
            n_kv_heads,
            d);
    // every layer held, as by reset: no call runs on a layer while its
    // heads take their models one by one
    ScopeEach<WriteScope> holding(layer_calls, "KVCache::adopt_trained", "a layer of the cache");
    std::vector<int> sparse;
    for (int l = 0; l < n_layers; l++) {
        if (std::find(dense_layers.begin(), dense_layers.end(), l) == dense_layers.end()) {
            sparse.push_back(l);
        }
    }
    // every head checked before any adopts: a mismatch in a later head
    // (another C, a layer already prefilled) would otherwise leave the
    // earlier heads with the new models and the rest with their own
    for (int l : sparse) {
        for (int h = 0; h < n_kv_heads; h++) {
            try {
                index(l, h)->check_adopt_trained(*trained.index(l, h));
            } catch (const faiss::FaissException& e) {
                KVINDEX_THROW_FMT(
                        InvalidArgument,
                        "KVCache::adopt_trained: layer %d, KV head %d: %s",
                        l,
                        h,
                        bare_error_message(e).c_str());
            }
        }
    }
    int adopted = 0;
    for (int l : sparse) {
        for (int h = 0; h < n_kv_heads; h++) {
            adopted += index(l, h)->adopt_trained(*trained.index(l, h));
        }
    }
    return adopted;
}

size_t KVCache::memory_bytes() const {
    size_t total = 0;
    for (auto& idx : indexes) {
        total += idx->memory_bytes();
    }
    return total;
}

} // namespace kvindex
