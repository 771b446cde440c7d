// The built-in index types: one row each. Adding a type = its header, its
// .cpp, one row here and its strings in tests/conformance_list.h.

#include <kvindex/registry.h>

#include <mutex>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/IndexHybrid.h>
#include <kvindex/IndexChoose.h>
#include <kvindex/IndexIVFAsym.h>
#include <kvindex/IndexKVFlat.h>
#include <kvindex/IndexKVShards.h>
#include <kvindex/IndexLSHSample.h>
#include <kvindex/IndexProxyEvict.h>
#include <kvindex/IndexRoarGraph.h>
#include <kvindex/IndexSinkWindow.h>
#include <kvindex/IndexTopK.h>
#include <kvindex/IndexUniformSample.h>
#include <kvindex/IndexWeightedSample.h>

namespace kvindex {

namespace {

template <class T>
std::unique_ptr<KVIndex> make_empty() {
    return std::make_unique<T>();
}

// The factory tries the parsers in this order; wrappers first, so that their
// elements are never taken for something else.
std::vector<IndexTypeInfo> builtin_types() {
    return {
            {"IndexSinkWindow", fourcc("KVSw"), 2, "Sink<n>,Window<m>,<index>",
             "first n and last m tokens exact, the rest by the inner index, merged by lse",
             IndexSinkWindow::from_factory, make_empty<IndexSinkWindow>, {"Sink4,Window64,Flat"}},
            {"IndexProxyEvict", fourcc("KVPe"), 5,
             "ProxyEvict<P>[_H2O|_TOVA|_StreamingLLM|_Random][,<index>]",
             "one-shot eviction at prefill (NaCl and its baselines), then any index over the kept tokens",
             IndexProxyEvict::from_factory, make_empty<IndexProxyEvict>,
             {"ProxyEvict20", "ProxyEvict20_H2O", "ProxyEvict20_TOVA", "ProxyEvict20_StreamingLLM", "ProxyEvict20_Random", "ProxyEvict20,TopK(Flat)"}},
            {"IndexChoose", fourcc("KVCh"), 2, "Choose(<chain>;<chain>[;...]), Auto",
             "per-head choice at prefill between 2 to 8 candidate chains, by their error on held-back prefill queries, within a read budget; Auto: among the fast families",
             IndexChoose::from_factory, make_empty<IndexChoose>,
             {"Choose(TopK(Flat);Sink4,Window64,LSHSample10x150)", "Auto"}},
            {"IndexKVShards", fourcc("KVSh"), 1, "Shards<T>(<chain>)",
             "token-range shards of T tokens, each any chain: attend merges the shards' (out, lse), search their top-k; budgets are per shard",
             IndexKVShards::from_factory, make_empty<IndexKVShards>, {"Shards4096(Flat)"}},
            {"IndexKVFlat", fourcc("KVFl"), 1, "Flat",
             "exact attention, one fused pass over keys and values (the dense baseline)",
             IndexKVFlat::from_factory, make_empty<IndexKVFlat>, {"Flat"}},
            {"IndexTopK", fourcc("KVTk"), 1, "TopK(<faiss string>)",
             "top-k keys from any Faiss retriever, softmax over them",
             IndexTopK::from_factory, make_empty<IndexTopK>,
             {"TopK(Flat)", "TopK(IVF64,Flat)", "TopK(HNSW32)"}},
            {"IndexLSHSample", fourcc("KVLs"), 1, "LSHSample<K>x<L>",
             "MagicPIG: SimHash tables, keys sampled with their inclusion probability, unbiased estimator",
             IndexLSHSample::from_factory, make_empty<IndexLSHSample>, {"LSHSample10x150"}},
            {"IndexRoarGraph", fourcc("KVRg"), 6, "RoarGraph<M>",
             "RetrievalAttention: a graph built from the prefill queries' exact neighbours, beam search, top-k attention",
             IndexRoarGraph::from_factory, make_empty<IndexRoarGraph>, {"RoarGraph32"}},
            {"IndexIVFAsym", fourcc("KVIa"), 3, "IVFAsym<C>[_Centroid|_CentroidRoPE|_Oracle|_Moment]",
             "SAAP: keys in k-means buckets (de-RoPEd), queries routed by a trained classifier, exact attention over the probed buckets",
             IndexIVFAsym::from_factory, make_empty<IndexIVFAsym>,
             {"IVFAsym64", "IVFAsym64_Centroid", "IVFAsym64_CentroidRoPE", "IVFAsym64_Oracle", "IVFAsym64_Moment"}},
            {"IndexHybrid", fourcc("KVHy"), 2, "Hybrid(<heavy>,<tail>)",
             "exact heavy hitters (a top-k index) + an unbiased sample of the other tokens (LSH, uniform or weighted), merged by lse",
             IndexHybrid::from_factory, make_empty<IndexHybrid>,
             {"Hybrid(TopK(Flat),Uniform)", "Hybrid(TopK(Flat),LSHSample8x75)"}},
            {"IndexUniformSample", fourcc("KVUs"), 1, "Uniform",
             "n tokens drawn uniformly per query, unbiased estimator (the sampled-tail baseline)",
             IndexUniformSample::from_factory, make_empty<IndexUniformSample>, {"Uniform"}},
            {"IndexWeightedSample", fourcc("KVWs"), 1, "Weighted",
             "every key scored, k values read: the heaviest (u = 1) and a sample of the rest in proportion to their weights; exact partition, unbiased output",
             IndexWeightedSample::from_factory, make_empty<IndexWeightedSample>, {"Weighted"}},
    };
}

struct Registry {
    std::mutex mutex;
    std::vector<IndexTypeInfo> rows = builtin_types();
};

Registry& registry() {
    static Registry r;
    return r;
}

} // namespace

std::vector<IndexTypeInfo> index_types() {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    return r.rows;
}

IndexTypeInfo index_type(const std::string& name) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const IndexTypeInfo& t : r.rows) {
        if (t.name == name) {
            return t;
        }
    }
    FAISS_THROW_FMT("index type '%s' is not registered (registry.h)", name.c_str());
}

IndexTypeInfo index_type_of(const KVIndex* index) {
    FAISS_THROW_IF_NOT_MSG(index, "index_type_of: index is nullptr");
    return index_type(index->type_name());
}

bool find_index_type(uint32_t tag, IndexTypeInfo* row) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const IndexTypeInfo& t : r.rows) {
        if (t.fourcc == tag) {
            *row = t;
            return true;
        }
    }
    return false;
}

void register_index_type(const IndexTypeInfo& row) {
    FAISS_THROW_IF_NOT_FMT(
            !row.name.empty() && row.fourcc != 0 && row.record_version >= 1 && row.make_empty,
            "register_index_type: row '%s' needs a name, a fourcc, a record version and "
            "an empty constructor",
            row.name.c_str());
    // read_index builds every record of the type with it: one that makes
    // nothing, or another type, is refused now rather than at the first
    // read (called outside the lock: it is user code)
    std::unique_ptr<KVIndex> empty = row.make_empty();
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const IndexTypeInfo& t : r.rows) {
        FAISS_THROW_IF_NOT_FMT(
                t.name != row.name && t.fourcc != row.fourcc,
                "register_index_type: '%s' (fourcc 0x%08x) clashes with registered '%s'",
                row.name.c_str(),
                row.fourcc,
                t.name.c_str());
    }
    FAISS_THROW_IF_NOT_FMT(
            empty && row.name == empty->type_name(),
            "register_index_type: row '%s': its empty constructor makes %s",
            row.name.c_str(),
            empty ? empty->type_name() : "nullptr");
    r.rows.push_back(row);
}

} // namespace kvindex
