#pragma once

#include <memory>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>

/* Factory strings, a comma-separated chain like Faiss's:
 *
 *   spec    := [ type "," ] chain [ "|" params ]   params: set_index_parameters syntax
 *   type    := "BF16" | "FP16"             keys and values of every index of the chain
 *                                          stored as bfloat16 / fp16 (kv_type.h);
 *                                          float32 when omitted
 *   chain   := [ "Sink" N "," ] [ "Window" N "," ] body
 *   body    := evict [ "," chain ] | inner
 *   evict   := "ProxyEvict" P [ "_H2O" | "_TOVA" | "_StreamingLLM" | "_Random" ]
 *                                          keep P percent at prefill (IndexProxyEvict),
 *                                          attention by the chain over the kept tokens
 *                                          (Flat when omitted)
 *   inner   := "Flat"                      exact attention (IndexKVFlat)
 *            | "TopK(" faiss-string ")"    top-k attention, Faiss retriever (IndexTopK)
 *            | "LSHSample" K "x" L         LSH sampling + unbiased estimator (IndexLSHSample)
 *            | "RoarGraph" M               graph from the prefill queries, top-k (IndexRoarGraph)
 *            | "IVFAsym" C [ "_Centroid" | "_CentroidRoPE" | "_Oracle" | "_Moment" ]
 *                                          C k-means buckets of de-RoPEd keys, queries routed by
 *                                          the trained Q-model (SAAP) or, as baselines, by the
 *                                          nearest centroid of the de-RoPEd / RoPEd query;
 *                                          exact attention over the probed buckets (IndexIVFAsym)
 *            | "Uniform"                   k tokens drawn uniformly, unbiased estimator
 *                                          (IndexUniformSample)
 *            | "Weighted"                  every key scored, k values read: u = min(1, c e^s),
 *                                          systematic sample (IndexWeightedSample)
 *            | "Hybrid(" inner "," inner ")"
 *                                          exact top-k of the first + an unbiased sample of
 *                                          the other tokens by the second (IndexHybrid)
 *            | "Choose(" chain ";" chain [ ";" chain ... ] ")"
 *                                          2 to 8 candidate chains (';' at depth 0); per head,
 *                                          prefill keeps the one of lowest error on held-back
 *                                          prefill queries (IndexChoose)
 *
 * Sink / Window (either or both, any order) wrap the rest of the chain in an
 * IndexSinkWindow. The Faiss string inside TopK(...) is one that
 * faiss::index_factory builds with the inner-product metric and that kvindex
 * can write and read back: Flat, SQ, PQ, IVF with Flat, SQ or PQ lists over
 * a Flat or HNSW quantizer, HNSW over Flat or SQ ("Flat", "IVF256,Flat",
 * "HNSW32", "IVF64,SQ8", ...; "PCA16,Flat" or "NSG32" are refused). Examples: "Flat", "TopK(HNSW32)",
 * "Sink4,Window64,TopK(IVF1024,Flat)", "ProxyEvict20", "ProxyEvict10_H2O",
 * "ProxyEvict20,TopK(HNSW32)", "TopK(IVF256,Flat)|k=50,nprobe=16",
 * "BF16,Flat", "FP16,Sink4,Window64,TopK(HNSW32)", "Sink1,Window63,IVFAsym64|nprobe=2",
 * "Hybrid(TopK(Flat),LSHSample10x150)|k=80", "Choose(TopK(Flat);LSHSample10x150)".
 *
 * Each element is parsed by the type that owns it, found through the
 * registry (registry.h): the list above is what the built-in rows accept.
 * The storage type is the chain's (FactoryChain::kv_type): every parser
 * gives it to the index it builds; a type that ignores it is refused.
 * index_factory_string prints the canonical string of an index (without
 * parameters, the storage prefix included):
 * index_factory_string(index_factory(d, s)) == s for canonical s (Sink
 * before Window, zero counts omitted, no prefix for float32).
 */

namespace kvindex {

/// Largest head dimension (keys or values) the factory and the reader accept.
constexpr int kMaxDimension = 1 << 16;

/** Builds an index; throws naming the part of the string it cannot parse.
 * "STRING|params" also sets the parameters (set_index_parameters); values
 * in percent ("k=5%") need a context length: see resolve_percentages in
 * parameters.h.
 * @param d_value  value dimension, -1 for d
 */
std::unique_ptr<KVIndex> index_factory(int d, const std::string& description, int d_value = -1);

/// The factory string of an index: kv_type_prefix(index->kv_type) +
/// index->factory_string().
std::string index_factory_string(const KVIndex* index);

/** A factory string being parsed: its elements (split at the commas outside
 * parentheses) and a cursor. The driver offers the element at the cursor to
 * each registry row's parser in turn; the parser that owns it consumes it
 * (take) and, if it wraps an index, builds the rest of the chain with
 * build_rest. What is left when the outermost parser returns is an error.
 */
struct FactoryChain {
    int d;       ///< key dimension of the index being built
    int d_value; ///< value dimension
    /// storage type of every index of the chain (the "BF16," / "FP16,"
    /// prefix); parsers pass it to the indexes they build
    KVType kv_type = KVType::f32;

    FactoryChain(int d, int d_value, const std::string& description,
                 KVType kv_type = KVType::f32);

    /// The whole string, for error messages.
    const std::string& description() const {
        return description_;
    }
    /// Whether every element has been consumed.
    bool at_end() const {
        return pos_ >= elements_.size();
    }
    /// How many elements have been consumed.
    size_t position() const {
        return pos_;
    }
    /// The element at the cursor; throws when at_end.
    const std::string& peek() const;
    /// Consumes the element at the cursor and returns it.
    std::string take();
    /** The index described by the elements after the ones consumed (the
     * inner index of a wrapper); `owner` names the wrapper in the error
     * when nothing follows it. */
    std::unique_ptr<KVIndex> build_rest(const std::string& owner);

    /// Builds the index at the cursor through the registry (one element
    /// or a wrapper and its chain); throws naming an unknown element.
    std::unique_ptr<KVIndex> parse_next();

    /** A whole chain nested in an element of this one ("Choose(A;B)",
     * "Shards<T>(A)"), of this chain's dimensions and storage type;
     * throws when something follows its index. */
    std::unique_ptr<KVIndex> parse_nested(const std::string& chain) const;

   private:
    std::string description_;
    std::vector<std::string> elements_;
    size_t pos_ = 0;
};

/// If s is `prefix` followed by a decimal count (at most 12 digits),
/// stores it and returns true: the common shape of factory elements.
bool parse_factory_count(const std::string& s, const char* prefix, idx_t* count);

} // namespace kvindex
