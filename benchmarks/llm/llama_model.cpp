#include "llama_model.h"

#ifdef KVINDEX_WITH_GPU
#include <kvindex/gpu/GpuKVCache.h>
#endif

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <kvindex/IndexIVFAsym.h>
#include <kvindex/blas_threads.h>
#include <kvindex/kernels.h>
#include <kvindex/parameters.h>

#include "gguf.h"

namespace kvllm {

namespace {

/// y[i] = x[i] / rms(x) * g[i], per row of width dim.
void rms_norm(const float* x, int64_t n, int dim, const std::vector<float>& g, float eps, float* y) {
#pragma omp parallel for if (n > 16)
    for (int64_t t = 0; t < n; t++) {
        const float* xr = x + t * dim;
        double ss = 0;
        for (int i = 0; i < dim; i++) {
            ss += double(xr[i]) * xr[i];
        }
        float r = float(1.0 / std::sqrt(ss / dim + eps));
        for (int i = 0; i < dim; i++) {
            y[t * dim + i] = xr[i] * r * g[i];
        }
    }
}

/// Rows [n][n_heads * hd] -> head-major [n_heads][n][hd].
void to_head_major(const float* x, int64_t n, int n_heads, int hd, float* out) {
    for (int h = 0; h < n_heads; h++) {
        for (int64_t t = 0; t < n; t++) {
            std::copy_n(x + (t * n_heads + h) * hd, hd, out + (h * n + t) * hd);
        }
    }
}

/// dst = rows [begin, end) of every head of a head-major [heads][n][hd] array.
void copy_head_rows(const std::vector<float>& src, int heads, int hd, int64_t n, int64_t begin,
                    int64_t end, std::vector<float>& dst) {
    dst.resize(size_t(heads) * (end - begin) * hd);
    for (int h = 0; h < heads; h++) {
        std::copy(src.begin() + (h * n + begin) * hd, src.begin() + (h * n + end) * hd,
                  dst.begin() + h * (end - begin) * hd);
    }
}

constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxWidth = int64_t(1) << 20;   ///< embedding and MLP widths
constexpr int64_t kMaxContext = int64_t(1) << 24; ///< training context, in tokens
constexpr int64_t kMaxVocabulary = int64_t(1) << 24;

/// Rows of token_embd.weight, which the tokenizer's tokens (if any) must match.
int vocabulary_size(const GgufFile& f) {
    const GgufTensor& emb = f.tensor("token_embd.weight");
    if (emb.shape.size() != 2 || emb.shape[1] > kMaxVocabulary) {
        std::string shape;
        for (int64_t s : emb.shape) shape += " " + std::to_string(s);
        throw std::runtime_error("GGUF file " + f.path + ": tensor token_embd.weight has shape [" + shape +
                                 " ] where [ embedding_length n_vocab ] is expected (n_vocab <= " +
                                 std::to_string(kMaxVocabulary) + ")");
    }
    const char* key = "tokenizer.ggml.tokens";
    if (f.has(key) && int64_t(f.get_strings(key).size()) != emb.shape[1]) {
        throw std::runtime_error("GGUF file " + f.path + ": " + key + " has " +
                                 std::to_string(f.get_strings(key).size()) + " tokens, token_embd.weight " +
                                 std::to_string(emb.shape[1]) + " rows");
    }
    return int(emb.shape[1]);
}

/// llama.attention.layer_norm_rms_epsilon, in (0, 1] also as a float: a
/// NaN would make every activation NaN, 0 divide a zero row by zero.
float rms_epsilon(const GgufFile& f) {
    const char* key = "llama.attention.layer_norm_rms_epsilon";
    const double eps = f.get_real(key);
    if (!(eps > 0 && eps <= 1) || float(eps) == 0) {
        throw std::runtime_error("GGUF file " + f.path + ": metadata key " + key + " = " + std::to_string(eps) +
                                 " is outside (0, 1]");
    }
    return float(eps);
}

/** Throws when weight `at` (a row of a matrix, an element of a vector) of
 * a tensor is NaN or infinite (at >= 0): every activation after it would
 * be NaN, and the argmax of NaN logits token 0 (generate printed
 * <|endoftext|>), a silently wrong answer. */
void check_finite_weights(const GgufFile& f, const std::string& name, int64_t at, const char* where) {
    if (at >= 0) {
        throw std::runtime_error("GGUF file " + f.path + ": tensor " + name + " has a NaN or infinite weight in " +
                                 where + " " + std::to_string(at));
    }
}

QuantMatrix load_matrix(const GgufFile& f, const std::string& name, int64_t rows, int64_t cols) {
    QuantMatrix m = QuantMatrix::from_gguf(f, name, rows, cols);
    check_finite_weights(f, name, m.first_non_finite_row(), "row");
    return m;
}

std::vector<float> load_vector(const GgufFile& f, const std::string& name, int64_t n) {
    // a norm's gains are stored as F32 (llama.cpp's converter never
    // quantizes them): another type is a file whose bytes mean something
    // else, which would load and answer nonsense
    const uint32_t type = f.tensor(name, {n}).type;
    if (type != uint32_t(GgmlType::F32) && type != uint32_t(GgmlType::F16)) {
        throw std::invalid_argument(f.path + ": tensor '" + name + "' is " + ggml_type_name(type) +
                                    "; a norm's gains must be F32 (or F16)");
    }
    std::vector<float> v = f.dequantize(name, {n});
    auto bad = std::find_if(v.begin(), v.end(), [](float x) { return !std::isfinite(x); });
    check_finite_weights(f, name, bad == v.end() ? -1 : bad - v.begin(), "element");
    return v;
}

void check_tokens(const int* tokens, int64_t n, int n_vocab) {
    for (int64_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= n_vocab) {
            throw std::out_of_range("token " + std::to_string(tokens[i]) + " at " + std::to_string(i) +
                                    " is outside the vocabulary [0, " + std::to_string(n_vocab) + ")");
        }
    }
}

bool is_dense_layer(const std::vector<int>& dense_layers, int l) {
    return std::find(dense_layers.begin(), dense_layers.end(), l) != dense_layers.end();
}

/// set_index_parameters(params) on every index of the sparse layers
/// (the dense layers keep their string as given); "" sets nothing.
void set_sparse_parameters(kvindex::KVCache& cache, const std::string& params) {
    if (params.empty()) {
        return;
    }
    for (int l = 0; l < cache.n_layers; l++) {
        if (!is_dense_layer(cache.dense_layers, l)) {
            for (int h = 0; h < cache.n_kv_heads; h++) {
                kvindex::set_index_parameters(cache.index(l, h), params);
            }
        }
    }
}

/// A decode step's queries, once answered, to the indexes that learn from
/// them (KVCache::add_queries); the GPU cache's indexes do not.
template <class Cache>
void learn_queries(Cache& cache, int layer, const float* q) {
    if constexpr (std::is_same_v<Cache, kvindex::KVCache>) {
        cache.add_queries(layer, 1, q);
    }
}

} // namespace

LlamaModel::LlamaModel(const GgufFile& f) {
    const std::string arch = f.get_string("general.architecture");
    if (arch != "llama") {
        throw std::runtime_error(f.path + ": architecture \"" + arch + "\" is not llama");
    }
    // far above any Llama's sizes, low enough that int holds every count
    // and no size computed from them overflows
    cfg.n_layers = int(f.get_int("llama.block_count", 1, kMaxLayers));
    cfg.dim = int(f.get_int("llama.embedding_length", 1, kMaxWidth));
    cfg.ffn_dim = int(f.get_int("llama.feed_forward_length", 1, kMaxWidth));
    cfg.n_heads = int(f.get_int("llama.attention.head_count", 1, cfg.dim));
    cfg.n_kv_heads = int(f.get_int("llama.attention.head_count_kv", 1, cfg.n_heads));
    cfg.n_ctx_train = int(f.get_int("llama.context_length", 1, kMaxContext));
    cfg.rms_eps = rms_epsilon(f);
    cfg.rope.theta = f.has("llama.rope.freq_base") ? f.get_real("llama.rope.freq_base") : 10000.0;
    if (cfg.n_heads % cfg.n_kv_heads != 0 || cfg.dim % cfg.n_heads != 0) {
        throw std::runtime_error(f.path + ": " + std::to_string(cfg.n_heads) + " query heads, " +
                                 std::to_string(cfg.n_kv_heads) + " KV heads, width " + std::to_string(cfg.dim) +
                                 ": the KV heads must divide the query heads, the query heads the width");
    }
    cfg.head_dim = cfg.dim / cfg.n_heads;
    if (f.has("llama.rope.dimension_count") && f.get_int("llama.rope.dimension_count") != cfg.head_dim) {
        throw std::runtime_error(f.path + ": partial RoPE (rope.dimension_count != head dim) is not supported");
    }
    kvindex::check_rope_params(cfg.rope, cfg.head_dim);
    cfg.n_vocab = vocabulary_size(f);

    const int64_t D = cfg.dim, F = cfg.ffn_dim, Q = cfg.n_heads * cfg.head_dim,
                  KV = cfg.n_kv_heads * cfg.head_dim, V = cfg.n_vocab;
    token_embd = load_matrix(f, "token_embd.weight", V, D);
    if (f.find_tensor("output.weight")) {
        output = load_matrix(f, "output.weight", V, D);
    }
    out_norm = load_vector(f, "output_norm.weight", D);
    layers.resize(cfg.n_layers);
    for (int l = 0; l < cfg.n_layers; l++) {
        std::string p = "blk." + std::to_string(l) + ".";
        LlamaLayer& w = layers[l];
        w.attn_norm = load_vector(f, p + "attn_norm.weight", D);
        w.wq = load_matrix(f, p + "attn_q.weight", Q, D);
        w.wk = load_matrix(f, p + "attn_k.weight", KV, D);
        w.wv = load_matrix(f, p + "attn_v.weight", KV, D);
        w.wo = load_matrix(f, p + "attn_output.weight", D, Q);
        w.ffn_norm = load_vector(f, p + "ffn_norm.weight", D);
        w.w_gate = load_matrix(f, p + "ffn_gate.weight", F, D);
        w.w_up = load_matrix(f, p + "ffn_up.weight", F, D);
        w.w_down = load_matrix(f, p + "ffn_down.weight", D, F);
    }
}

void LlamaModel::embed(const int* tokens, int64_t n, float* x) const {
    check_tokens(tokens, n, cfg.n_vocab);
    for (int64_t t = 0; t < n; t++) {
        token_embd.dequantize_rows(tokens[t], 1, x + t * cfg.dim);
    }
}

void LlamaModel::qkv(const LlamaLayer& w, const float* h, int64_t n, int64_t pos0,
                     float* q, float* k, float* v) const {
    const int hd = cfg.head_dim;
    w.wq.matmul(h, n, q);
    w.wk.matmul(h, n, k);
    w.wv.matmul(h, n, v);
    // rows are [n][heads][hd]: one position per head vector
    std::vector<int64_t> pos(size_t(n) * cfg.n_heads);
    for (int64_t t = 0; t < n; t++) {
        std::fill_n(pos.begin() + t * cfg.n_heads, cfg.n_heads, pos0 + t);
    }
    kvindex::apply_rope(n * cfg.n_heads, hd, q, pos.data(), cfg.rope);
    for (int64_t t = 0; t < n; t++) {
        std::fill_n(pos.begin() + t * cfg.n_kv_heads, cfg.n_kv_heads, pos0 + t);
    }
    kvindex::apply_rope(n * cfg.n_kv_heads, hd, k, pos.data(), cfg.rope);
}

void LlamaModel::mlp_block(const LlamaLayer& w, int64_t n, float* x) const {
    const int D = cfg.dim, F = cfg.ffn_dim;
    std::vector<float> h(size_t(n) * D), gate(size_t(n) * F), up(size_t(n) * F);
    rms_norm(x, n, D, w.ffn_norm, cfg.rms_eps, h.data());
    w.w_gate.matmul(h.data(), n, gate.data());
    w.w_up.matmul(h.data(), n, up.data());
    for (size_t i = 0; i < gate.size(); i++) {
        float g = gate[i];
        gate[i] = g / (1.0f + std::exp(-g)) * up[i]; // silu(gate) * up
    }
    w.w_down.matmul(gate.data(), n, x, true);
}

void LlamaModel::compute_logits(const float* x, int64_t n, float* logits) const {
    std::vector<float> h(size_t(n) * cfg.dim);
    rms_norm(x, n, cfg.dim, out_norm, cfg.rms_eps, h.data());
    (output.empty() ? token_embd : output).matmul(h.data(), n, logits);
    // finite weights can still overflow; the argmax of NaN logits is token 0
    const int64_t V = cfg.n_vocab;
    for (int64_t i = 0; i < n * V; i++) {
        if (!std::isfinite(logits[i])) {
            throw std::runtime_error("the logit of token " + std::to_string(i % V) + " at row " +
                                     std::to_string(i / V) + " is " + std::to_string(logits[i]) +
                                     ": the activations overflowed");
        }
    }
}

void LlamaModel::prefill(
        const int* tokens,
        int64_t n,
        float* logits,
        int64_t logits_from,
        PrefillRecord* record,
        int64_t query_begin) const {
    if (n <= 0) {
        throw std::invalid_argument("prefill of " + std::to_string(n) + " tokens: need at least one");
    }
    if (logits && (logits_from < 0 || logits_from >= n)) {
        throw std::invalid_argument("logits_from " + std::to_string(logits_from) + " outside [0, " +
                                    std::to_string(n) + ")");
    }
    if (query_begin < 0 || query_begin > n) {
        throw std::invalid_argument("query_begin " + std::to_string(query_begin) + " outside [0, " +
                                    std::to_string(n) + "]");
    }
    const int D = cfg.dim, hd = cfg.head_dim, H = cfg.n_heads, KVH = cfg.n_kv_heads;
    const int group = H / KVH;
    const float scale = 1.0f / std::sqrt(float(hd));
    std::vector<float> x(size_t(n) * D), h(size_t(n) * D), q(size_t(n) * H * hd),
            k(size_t(n) * KVH * hd), v(size_t(n) * KVH * hd), att(size_t(n) * H * hd);
    embed(tokens, n, x.data());
    if (record) {
        record->n_tokens = n;
        record->query_begin = query_begin;
        record->keys.assign(cfg.n_layers, {});
        record->values.assign(cfg.n_layers, {});
        record->queries.assign(cfg.n_layers, {});
    }
    // Causal attention in blocks of query rows: S = Q K^T over the keys up
    // to the block's last row, a masked softmax per row, then O = P V.
    // Heads run in parallel, each with its own score block.
    const int64_t block = 256;
    for (int l = 0; l < cfg.n_layers; l++) {
        const LlamaLayer& w = layers[l];
        rms_norm(x.data(), n, D, w.attn_norm, cfg.rms_eps, h.data());
        qkv(w, h.data(), n, 0, q.data(), k.data(), v.data());
#pragma omp parallel for schedule(dynamic)
        for (int head = 0; head < H; head++) {
            const int g = head / group;
            std::vector<float> s(size_t(std::min(n, block)) * n);
            for (int64_t r0 = 0; r0 < n; r0 += block) {
                const int64_t rows = std::min(block, n - r0), cols = r0 + rows;
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(rows), int(cols), hd, scale,
                            q.data() + r0 * H * hd + head * hd, H * hd, k.data() + g * hd, KVH * hd,
                            0.0f, s.data(), int(cols));
                for (int64_t i = 0; i < rows; i++) {
                    float* row = s.data() + i * cols;
                    const int64_t valid = r0 + i + 1;
                    kvindex::softmax_inplace(row, nullptr, size_t(valid));
                    std::fill(row + valid, row + cols, 0.0f);
                }
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(rows), hd, int(cols), 1.0f,
                            s.data(), int(cols), v.data() + g * hd, KVH * hd, 0.0f,
                            att.data() + r0 * H * hd + head * hd, H * hd);
            }
        }
        if (record) {
            record->keys[l].resize(size_t(n) * KVH * hd);
            record->values[l].resize(size_t(n) * KVH * hd);
            to_head_major(k.data(), n, KVH, hd, record->keys[l].data());
            to_head_major(v.data(), n, KVH, hd, record->values[l].data());
            const int64_t nq = n - query_begin;
            record->queries[l].resize(size_t(nq) * H * hd);
            to_head_major(q.data() + query_begin * H * hd, nq, H, hd, record->queries[l].data());
        }
        w.wo.matmul(att.data(), n, x.data(), true);
        mlp_block(w, n, x.data());
    }
    if (logits) {
        compute_logits(x.data() + logits_from * D, n - logits_from, logits);
    }
}

PrefillRecord LlamaModel::prefix(const PrefillRecord& rec, int64_t n_prefix, int64_t n_queries) const {
    if (n_prefix < 1 || n_prefix > rec.n_tokens || n_queries < 0 || n_queries > n_prefix ||
        n_prefix - n_queries < rec.query_begin) {
        throw std::invalid_argument("prefix of " + std::to_string(n_prefix) + " tokens with " +
                                    std::to_string(n_queries) + " queries is not inside the record (" +
                                    std::to_string(rec.n_tokens) + " tokens, queries from " +
                                    std::to_string(rec.query_begin) + ")");
    }
    PrefillRecord out;
    out.n_tokens = n_prefix;
    out.query_begin = n_prefix - n_queries;
    const size_t L = rec.keys.size();
    out.keys.resize(L);
    out.values.resize(L);
    out.queries.resize(L);
    for (size_t l = 0; l < L; l++) {
        const int hd = cfg.head_dim;
        copy_head_rows(rec.keys[l], cfg.n_kv_heads, hd, rec.n_tokens, 0, n_prefix, out.keys[l]);
        copy_head_rows(rec.values[l], cfg.n_kv_heads, hd, rec.n_tokens, 0, n_prefix, out.values[l]);
        copy_head_rows(rec.queries[l], cfg.n_heads, hd, rec.n_tokens - rec.query_begin,
                       out.query_begin - rec.query_begin, n_prefix - rec.query_begin, out.queries[l]);
    }
    return out;
}

kvindex::KVCache LlamaModel::empty_cache(
        const std::string& index_string,
        const std::string& dense_string,
        const std::vector<int>& dense_layers) const {
    return kvindex::KVCache(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.head_dim,
                            index_string, dense_string, dense_layers);
}

void LlamaModel::check_cache_args(
        const std::string& index_string,
        const std::string& dense_string,
        const std::vector<int>& dense_layers,
        const std::string& params) const {
    kvindex::KVCache cache = empty_cache(index_string, dense_string, dense_layers);
    set_sparse_parameters(cache, params);
}

kvindex::KVCache LlamaModel::make_cache(
        const PrefillRecord& rec,
        const std::string& index_string,
        const std::string& dense_string,
        const std::vector<int>& dense_layers,
        const std::string& params,
        const kvindex::KVCache* trained) const {
    if (int(rec.keys.size()) != cfg.n_layers) {
        throw std::invalid_argument("prefill record has " + std::to_string(rec.keys.size()) +
                                    " layers, the model " + std::to_string(cfg.n_layers));
    }
    kvindex::KVCache cache = empty_cache(index_string, dense_string, dense_layers);
    // before the prefills: an index with offline models only assigns keys.
    // Strings with nothing trained offline in them (the baselines of the
    // same run: Flat, TopK, ...) are built as given; the cache's own first
    // sparse index says which kind this string is.
    if (trained) {
        for (int l = 0; l < cfg.n_layers; l++) {
            if (!is_dense_layer(dense_layers, l)) {
                if (kvindex::ivf_asym_in_chain(cache.index(l, 0))) {
                    cache.adopt_trained(*trained);
                }
                break;
            }
        }
    }
    set_sparse_parameters(cache, params);
    const int64_t nq = rec.n_tokens - rec.query_begin;
    std::vector<kvindex::idx_t> positions(static_cast<size_t>(nq));
    for (int64_t i = 0; i < nq; i++) {
        positions[i] = rec.query_begin + i;
    }
    for (int l = 0; l < cfg.n_layers; l++) {
        cache.prefill(l, rec.n_tokens, rec.keys[l].data(), rec.values[l].data(), nq,
                      nq > 0 ? rec.queries[l].data() : nullptr, nq > 0 ? positions.data() : nullptr,
                      cfg.rope);
    }
    return cache;
}

template <class Cache>
void LlamaModel::decode(const int* tokens, int64_t n, Cache& cache, float* logits) const {
    if (n <= 0) {
        return;
    }
    if (cache.n_layers != cfg.n_layers || cache.n_q_heads != cfg.n_heads ||
        cache.n_kv_heads != cfg.n_kv_heads || cache.d != cfg.head_dim) {
        throw std::invalid_argument("KV cache shape does not match the model");
    }
    const int D = cfg.dim, hd = cfg.head_dim, H = cfg.n_heads, KVH = cfg.n_kv_heads;
    const int64_t pos0 = cache.n_tokens(0);
    std::vector<float> x(size_t(n) * D), h(size_t(n) * D), q(size_t(n) * H * hd),
            k(size_t(n) * KVH * hd), v(size_t(n) * KVH * hd), att(size_t(n) * H * hd);
    embed(tokens, n, x.data());
    for (int l = 0; l < cfg.n_layers; l++) {
        const LlamaLayer& w = layers[l];
        rms_norm(x.data(), n, D, w.attn_norm, cfg.rms_eps, h.data());
        qkv(w, h.data(), n, pos0, q.data(), k.data(), v.data());
        // one token at a time: a row [heads][hd] is already head-major for n = 1
        for (int64_t t = 0; t < n; t++) {
            cache.append(l, 1, k.data() + t * KVH * hd, v.data() + t * KVH * hd);
            cache.attend(l, 1, q.data() + t * H * hd, att.data() + t * H * hd, nullptr);
            learn_queries(cache, l, q.data() + t * H * hd);
        }
        w.wo.matmul(att.data(), n, x.data(), true);
        mlp_block(w, n, x.data());
    }
    if (logits) {
        compute_logits(x.data(), n, logits);
    }
}

template <class Cache>
std::vector<int> LlamaModel::generate(
        int last,
        int max_new,
        Cache& cache,
        const std::vector<int>& stop_ids) const {
    std::vector<int> out;
    std::vector<float> logits(cfg.n_vocab);
    int tok = last;
    for (int i = 0; i < max_new; i++) {
        decode(&tok, 1, cache, logits.data());
        tok = int(std::max_element(logits.begin(), logits.end()) - logits.begin());
        out.push_back(tok);
        if (std::find(stop_ids.begin(), stop_ids.end(), tok) != stop_ids.end()) {
            break;
        }
    }
    return out;
}

// the caches decode runs on: the CPU one, and the GPU one where it is built
template void LlamaModel::decode(const int*, int64_t, kvindex::KVCache&, float*) const;
template std::vector<int> LlamaModel::generate(
        int, int, kvindex::KVCache&, const std::vector<int>&) const;
#ifdef KVINDEX_WITH_GPU
template void LlamaModel::decode(const int*, int64_t, kvindex::GpuKVCache&, float*) const;
template std::vector<int> LlamaModel::generate(
        int, int, kvindex::GpuKVCache&, const std::vector<int>&) const;
#endif

} // namespace kvllm
