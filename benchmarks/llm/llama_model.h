#pragma once

// A Llama-architecture model (SmolLM2) read from GGUF, run on the CPU.
// The weight matrices stay in their GGUF block format (QuantMatrix): decode
// multiplies them with fused dequantizing kernels, prefill dequantizes
// chunks of rows for BLAS. Prefill is exact causal attention over the whole
// prompt; decode attention goes through a kvindex::KVCache, so any index
// string can stand in for the model's attention.

#include <cstdint>
#include <vector>

#include <kvindex/KVCache.h>
#include <kvindex/rope.h>

#include "quant_matrix.h"

namespace kvllm {

struct GgufFile;

struct LlamaConfig {
    int n_layers = 0;
    int dim = 0;        ///< embedding width
    int ffn_dim = 0;    ///< hidden width of the SwiGLU MLP
    int n_heads = 0;    ///< query heads
    int n_kv_heads = 0; ///< key/value heads (GQA)
    int head_dim = 0;
    int n_vocab = 0;
    int n_ctx_train = 0;
    float rms_eps = 1e-5f;
    /// llama.cpp stores Q and K rows permuted so that RoPE rotates adjacent
    /// pairs ("normal" mode): interleaved style, theta from the file
    kvindex::RopeParams rope{10000.0, kvindex::RopeStyle::interleaved};
};

/// Weights of one block: matrices [out][in] in their file's block format,
/// norm gains dequantized.
struct LlamaLayer {
    std::vector<float> attn_norm; ///< size dim
    QuantMatrix wq;               ///< n_heads * head_dim x dim
    QuantMatrix wk;               ///< n_kv_heads * head_dim x dim
    QuantMatrix wv;               ///< n_kv_heads * head_dim x dim
    QuantMatrix wo;               ///< dim x n_heads * head_dim
    std::vector<float> ffn_norm;  ///< size dim
    QuantMatrix w_gate;           ///< ffn_dim x dim
    QuantMatrix w_up;             ///< ffn_dim x dim
    QuantMatrix w_down;           ///< dim x ffn_dim
};

/** Per-layer attention inputs recorded by a prefill, post-RoPE, head-major
 * (the kvindex layouts): what a KVCache is built from and what a trace holds. */
struct PrefillRecord {
    int64_t n_tokens = 0;
    int64_t query_begin = 0;  ///< queries are kept for positions [query_begin, n_tokens)
    std::vector<std::vector<float>> keys;    ///< [layer] size n_kv_heads * n_tokens * head_dim
    std::vector<std::vector<float>> values;  ///< [layer] size n_kv_heads * n_tokens * head_dim
    std::vector<std::vector<float>> queries; ///< [layer] size n_heads * (n_tokens - query_begin) * head_dim
};

struct LlamaModel {
    LlamaConfig cfg;
    QuantMatrix token_embd;      ///< n_vocab x dim; an embedding is one dequantized row
    QuantMatrix output;          ///< n_vocab x dim, empty when tied to token_embd
    std::vector<float> out_norm; ///< size dim
    std::vector<LlamaLayer> layers;

    /// Copies every matrix in its block format and dequantizes the norm
    /// gains; throws naming a missing tensor or a shape that disagrees with
    /// the metadata.
    explicit LlamaModel(const GgufFile& file);

    /** Exact causal forward of tokens at positions [0, n).
     * @param logits        size (n - logits_from) * n_vocab: the logits of
     *                      positions [logits_from, n); may be nullptr
     * @param record        if not nullptr, receives keys, values and the
     *                      queries of positions [query_begin, n)
     */
    void prefill(
            const int* tokens,
            int64_t n,
            float* logits,
            int64_t logits_from,
            PrefillRecord* record = nullptr,
            int64_t query_begin = 0) const;

    /** A KVCache for this model built from a prefill record: every layer's
     * indexes get the prompt's keys, values and recorded queries.
     * @param params  set_index_parameters() string applied to the indexes
     *                of the sparse layers before their prefill ("" = none)
     * @param trained if not nullptr, a cache of offline-trained models
     *                (kvllm train, read_cache): the sparse layers' indexes
     *                adopt them before their prefill (KVCache::adopt_trained);
     *                throws when nothing in index_string adopts anything */
    kvindex::KVCache make_cache(
            const PrefillRecord& record,
            const std::string& index_string,
            const std::string& dense_string = "Flat",
            const std::vector<int>& dense_layers = {},
            const std::string& params = "",
            const kvindex::KVCache* trained = nullptr) const;

    /** Throws what make_cache would for these arguments before its first
     * prefill (an unknown index string or parameter, a dense layer outside
     * the model), building only empty indexes: the runs check every index
     * before their first, expensive, prefill. */
    void check_cache_args(
            const std::string& index_string,
            const std::string& dense_string,
            const std::vector<int>& dense_layers,
            const std::string& params) const;

    /** Decodes n known tokens at positions [cache.n_tokens(0), + n), exactly
     * as n single-token steps would (token t's key is appended before its
     * query attends, and attention sees only earlier tokens); linear layers
     * run batched.
     * @param logits  size n * n_vocab, or nullptr
     * Cache: kvindex::KVCache, or kvindex::GpuKVCache in a build with the
     * GPU types (KVINDEX_WITH_GPU): the same calls, every KV head of a
     * layer in one launch.
     */
    template <class Cache>
    void decode(const int* tokens, int64_t n, Cache& cache, float* logits) const;

    /** The prefix [0, n_prefix) of a record (causal: its keys and values
     * are those of a prefill of the prefix alone), with the queries of its
     * last n_queries positions. */
    PrefillRecord prefix(const PrefillRecord& record, int64_t n_prefix, int64_t n_queries) const;

    /// Greedy generation after a prefilled cache: feeds `last` and returns up
    /// to max_new tokens, stopping after a token in stop_ids.
    template <class Cache>
    std::vector<int> generate(
            int last,
            int max_new,
            Cache& cache,
            const std::vector<int>& stop_ids) const;

   private:
    /// The KVCache of make_cache before any model, parameter or token.
    kvindex::KVCache empty_cache(
            const std::string& index_string,
            const std::string& dense_string,
            const std::vector<int>& dense_layers) const;
    void embed(const int* tokens, int64_t n, float* x) const;
    void mlp_block(const LlamaLayer& w, int64_t n, float* x) const;
    void compute_logits(const float* x, int64_t n, float* logits) const;
    /// q [n][n_heads*hd], k and v [n][n_kv*hd] of normalized inputs, RoPE applied.
    void qkv(const LlamaLayer& w, const float* h, int64_t n, int64_t pos0,
             float* q, float* k, float* v) const;
};

} // namespace kvllm
