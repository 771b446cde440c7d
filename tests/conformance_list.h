#pragma once

// The one list of index strings every registry type is tested through: the
// conformance suite (test_conformance.cpp) runs each of its cases over every
// string, and tests/data/golden holds one saved index per string. A new index
// type joins by adding its strings here (and its golden files: see
// test_golden.cpp). Every registry row must appear in at least one string.

#include <cctype>
#include <cstddef>
#include <ostream>
#include <string>

namespace kvtest {

struct ConformanceCase {
    /// canonical factory string
    const char* factory;
    /// non-default search-time knobs (set_index_parameters, after prefill)
    /// that must survive io; "" for a chain without any (k is a knob only
    /// where some index reads it)
    const char* knobs;
    /// parameters, set before prefill, that give the index its full budget
    /// (every token read, u = 1): attention is then exact. nullptr for a
    /// type that has no such setting.
    const char* exact_params;
};

// Sizes are small on purpose: every truncation of a saved index is tried.
inline const ConformanceCase kConformance[] = {
        {"Flat", "", ""},
        {"TopK(Flat)", "k=7", "k=1000000"},
        {"TopK(IVF4,Flat)", "k=7,nprobe=3", "k=1000000"},
        {"TopK(HNSW8)", "k=7,efSearch=24", "k=1000000"},
        {"LSHSample6x20", "min_hits=3", "min_hits=0"},
        {"Sink0,Flat", "", ""},
        {"Sink4,Window8,Flat", "", ""},
        {"Window8,TopK(IVF4,Flat)", "k=7,nprobe=2", "k=1000000"},
        {"Sink2,Window8,LSHSample6x20", "max_sample=30", "min_hits=0"},
        {"ProxyEvict20", "", "budget=1000000"},
        {"ProxyEvict30_H2O,TopK(Flat)", "k=7", "budget=1000000,k=1000000"},
        {"ProxyEvict25_TOVA,TopK(HNSW8)", "k=7,efSearch=20", "budget=1000000,k=1000000"},
        {"ProxyEvict40_StreamingLLM,Sink2,Window4,TopK(IVF4,Flat)", "k=7,nprobe=2",
         "budget=1000000,k=1000000"},
        {"ProxyEvict50_Random,LSHSample6x20", "min_hits=2", "budget=1000000,min_hits=0"},
        {"ProxyEvict20,Sink4,Window64,LSHSample8x50", "max_sample=30", "budget=1000000,min_hits=0"},
        // keys and values stored as bfloat16 / fp16 (kv_type.h), every type
        {"BF16,Flat", "", ""},
        {"FP16,Flat", "", ""},
        {"BF16,TopK(IVF4,Flat)", "k=7,nprobe=3", "k=1000000"},
        {"FP16,TopK(HNSW8)", "k=7,efSearch=24", "k=1000000"},
        {"BF16,LSHSample6x20", "min_hits=3", "min_hits=0"},
        {"FP16,Sink4,Window8,Flat", "", ""},
        {"BF16,Sink2,Window8,LSHSample6x20", "max_sample=30", "min_hits=0"},
        {"FP16,ProxyEvict30_H2O,TopK(Flat)", "k=7", "budget=1000000,k=1000000"},
        {"BF16,ProxyEvict40_StreamingLLM,Sink2,Window4,TopK(IVF4,Flat)", "k=7,nprobe=2",
         "budget=1000000,k=1000000"},
        // the attention-aware graph (RetrievalAttention / RoarGraph)
        {"RoarGraph8", "k=7,efSearch=24", "k=1000000"},
        {"Sink2,Window8,RoarGraph6", "k=7,efSearch=12", "k=1000000"},
        // walked on the stored keys (the others walk on codes, the default)
        {"FP16,RoarGraph8", "k=7,efSearch=20,walk_bits=0", "k=1000000"},
        // SAAP's asymmetric partitions, self-trained at prefill
        {"IVFAsym4", "nprobe=2", "nprobe=4"},
        {"Sink2,Window8,IVFAsym4_Centroid", "nprobe=3,group_probe=1", "nprobe=4"},
        {"BF16,IVFAsym4_CentroidRoPE", "nprobe=1", "nprobe=4"},
        // exact heavy hitters + a sampled tail; the uniform sampler alone
        {"Uniform", "k=7,seed=3", "k=1000000"},
        {"Hybrid(TopK(Flat),Uniform)", "k=7,sample=6", "k=1000000"},
        {"Sink2,Window8,Hybrid(TopK(IVF4,Flat),LSHSample6x20)", "k=7,nprobe=3,min_hits=3",
         "k=1000000,nprobe=4"},
        {"BF16,Hybrid(TopK(Flat),Uniform)", "k=7,sample=4", "sample=1000000"},
        // a per-head choice between candidate chains, made at prefill
        {"Choose(TopK(Flat);LSHSample6x20)", "k=7,min_hits=3", "k=1000000,min_hits=0"},
        {"Sink2,Window8,Choose(Flat;TopK(IVF4,Flat))", "k=7,nprobe=3", "k=1000000"},
        {"BF16,Choose(LSHSample6x20;Sink4,Window8,TopK(Flat))", "k=7,max_sample=30",
         "k=1000000,min_hits=0"},
        // SAAP's buckets routed by their exact attention mass (the routing ceiling)
        {"Sink2,Window8,IVFAsym4_Oracle", "nprobe=2", "nprobe=4"},
        // SAAP's buckets routed, without training, by their keys' moments
        {"Sink2,Window8,IVFAsym4_Moment", "nprobe=2,var_weight=0.5", "nprobe=4"},
        // every key scored, values read for a sample in proportion to the weights
        {"Weighted", "k=7,seed=5", "k=1000000"},
        {"Sink2,Window8,Hybrid(TopK(Flat),Weighted)", "k=7,sample=5", "k=1000000"},
        // the graph walked on 8-bit codes of its bfloat16 keys (the default, set)
        {"BF16,RoarGraph8", "k=7,efSearch=20,walk_bits=8", "k=1000000"},
        // token-range shards (context parallelism), their answers merged
        {"Shards64(Flat)", "", ""},
        {"Shards64(Sink2,Window8,LSHSample6x20)", "max_sample=30", "min_hits=0"},
        {"BF16,Shards96(IVFAsym4)", "nprobe=2", "nprobe=4"},
};

/// A factory string as an identifier: letters and digits kept, every other
/// character '_' (test names, golden file names).
inline std::string factory_identifier(const char* factory) {
    std::string s;
    for (const char* p = factory; *p; p++) {
        s += std::isalnum(static_cast<unsigned char>(*p)) ? *p : '_';
    }
    return s;
}

/// The gtest name of case i of a suite over kConformance: "<i>_<identifier>".
inline std::string conformance_test_name(size_t i, const ConformanceCase& c) {
    return std::to_string(i) + "_" + factory_identifier(c.factory);
}

/// gtest and ctest print a case as its string.
inline void PrintTo(const ConformanceCase& c, std::ostream* os) {
    *os << c.factory;
}

} // namespace kvtest
