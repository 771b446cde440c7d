#include "synthetic.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>
#include <stdexcept>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/rope.h>

namespace kvbench {

using kvindex::idx_t;

const char* head_kind_name(HeadKind kind) {
    switch (kind) {
        case HeadKind::needle:
            return "needle";
        case HeadKind::local:
            return "local";
        case HeadKind::aggregate:
            return "aggregate";
        default:
            return "flat";
    }
}

HeadKind head_kind(const SyntheticConfig& cfg, int layer, int q_head) {
    if (cfg.preset == "needle") {
        return HeadKind::needle;
    }
    if (cfg.preset == "local") {
        return HeadKind::local;
    }
    if (cfg.preset == "flat") {
        return HeadKind::flat;
    }
    if (cfg.preset == "aggregate") {
        return HeadKind::aggregate;
    }
    FAISS_THROW_IF_NOT_FMT(
            cfg.preset == "mixed",
            "unknown preset '%s' (needle, local, flat, aggregate, mixed)",
            cfg.preset.c_str());
    return HeadKind((q_head + layer) % 3);
}

namespace {

// Scales of the geometry (d = 128 in comments). Scores are q.k / sqrt(d).
constexpr float kOffsetNorm = 8.0f;   // shared key offset: keys form one cone
constexpr float kQueryAway = 0.5f;    // queries sit on the far side of it
constexpr int kRank = 16;             // low-rank structure of keys
constexpr float kKeyNoise = 0.3f;
constexpr float kNeedleGain = 12.0f;  // needle score ~ 12 vs ~N(0,1) for others
constexpr int kNeedles = 32;          // salient tokens per head
constexpr float kLocalNorm = 10.0f;   // shared high-frequency component
constexpr float kLocalGain = 1.5f;
constexpr float kSinkNorm = 10.0f;    // token 0 carries the sink direction
constexpr float kSinkScore = 2.5f;    // its score above the others, any d
constexpr float kAggregateGain = 1.5f; // score std along w: broad but graded
constexpr float kAggregateValue = 1.0f; // how much of w.k the values carry

struct Rng {
    std::mt19937_64 gen;
    std::normal_distribution<float> g{0.0f, 1.0f};
    explicit Rng(uint64_t seed) : gen(seed) {}
    float operator()() {
        return g(gen);
    }
    std::vector<float> vec(size_t n, float scale = 1.0f) {
        std::vector<float> v(n);
        for (auto& x : v) {
            x = scale * g(gen);
        }
        return v;
    }
};

float norm(const float* x, int d) {
    double s = 0;
    for (int j = 0; j < d; j++) {
        s += double(x[j]) * x[j];
    }
    return float(std::sqrt(s));
}

void scale_to(std::vector<float>& x, float target) {
    float n = norm(x.data(), int(x.size()));
    for (auto& v : x) {
        v *= target / n;
    }
}

/// One KV head and its group of query heads, written into `layer`.
void generate_kv_head(
        const SyntheticConfig& cfg,
        const kvindex::TraceMeta& meta,
        int layer_no,
        int h,
        kvindex::TraceLayer& layer) {
    int d = cfg.head_dim;
    idx_t n = cfg.n_tokens;
    // one stream per (layer, KV head): adding layers does not change others
    Rng rng(cfg.seed * 1000003u + layer_no * 1009u + h);
    kvindex::RopeParams rope{meta.rope_theta, meta.rope_style};

    auto offset = rng.vec(d);
    scale_to(offset, kOffsetNorm);
    auto basis = rng.vec(size_t(kRank) * d, 1.0f / std::sqrt(float(kRank)));
    auto value_offset = rng.vec(d, 0.5f);
    auto value_basis = rng.vec(size_t(kRank) * d, 1.0f / std::sqrt(float(kRank)));
    auto sink_dir = rng.vec(d);
    scale_to(sink_dir, 1.0f);
    // local component: energy only in the fast-rotating RoPE pairs, so the
    // score it adds falls off within a few hundred tokens
    std::vector<float> local(d, 0.0f);
    for (int j = 0; j < d / 8; j++) {
        int a = rope.style == kvindex::RopeStyle::half ? j : 2 * j;
        int b = rope.style == kvindex::RopeStyle::half ? j + d / 2 : 2 * j + 1;
        local[a] = rng();
        local[b] = rng();
    }
    scale_to(local, kLocalNorm);

    // keys: structured part rotated by position, then the shared offset
    std::vector<float> structured(size_t(n) * d); // post-RoPE U z_t
    std::vector<int64_t> pos(n);
    for (idx_t t = 0; t < n; t++) {
        pos[t] = t;
        float* s = structured.data() + t * d;
        for (int r = 0; r < kRank; r++) {
            float z = rng();
            for (int j = 0; j < d; j++) {
                s[j] += z * basis[r * d + j];
            }
        }
    }
    kvindex::apply_rope(n, d, structured.data(), pos.data(), rope);
    std::vector<float> local_rot(size_t(n) * d);
    for (idx_t t = 0; t < n; t++) {
        std::copy(local.begin(), local.end(), local_rot.begin() + t * d);
    }
    kvindex::apply_rope(n, d, local_rot.data(), pos.data(), rope);

    float* keys = layer.keys.data() + size_t(h) * n * d;
    float* values = layer.values.data() + size_t(h) * n * d;
    for (idx_t t = 0; t < n; t++) {
        for (int j = 0; j < d; j++) {
            keys[t * d + j] = offset[j] + structured[t * d + j] +
                    local_rot[t * d + j] + kKeyNoise * rng();
        }
        for (int r = 0; r < kRank; r++) {
            float w = rng();
            for (int j = 0; j < d; j++) {
                values[t * d + j] += w * value_basis[r * d + j];
            }
        }
        for (int j = 0; j < d; j++) {
            values[t * d + j] += value_offset[j] + 0.3f * rng();
        }
    }
    for (int j = 0; j < d; j++) {
        keys[j] += kSinkNorm * sink_dir[j];
    }
    // aggregation heads: a key direction w the queries lean on, and values
    // that carry w.k along a value direction
    // (drawn only for this preset, so the other presets' streams are unchanged)
    std::vector<float> agg_dir, agg_value;
    if (cfg.preset == "aggregate") {
        agg_dir = rng.vec(d);
        agg_value = rng.vec(d);
        scale_to(agg_dir, 1.0f);
        scale_to(agg_value, 1.0f);
        for (idx_t t = 0; t < n; t++) {
            double proj = 0;
            for (int j = 0; j < d; j++) {
                proj += double(agg_dir[j]) * structured[t * d + j];
            }
            for (int j = 0; j < d; j++) {
                values[t * d + j] += float(kAggregateValue * proj) * agg_value[j];
            }
        }
    }

    // salient tokens of the needle heads: spread over the prompt
    std::vector<idx_t> needles(kNeedles);
    std::uniform_int_distribution<idx_t> pick(1, std::max<idx_t>(1, meta.n_ctx - 1));
    for (auto& x : needles) {
        x = pick(rng.gen);
    }
    const float sink_gain = kSinkScore * std::sqrt(float(d)) / kSinkNorm;
    for (int g = 0; g < cfg.group; g++) {
        int qh = h * cfg.group + g;
        HeadKind kind = head_kind(cfg, layer_no, qh);
        float* q = layer.queries.data() + size_t(qh) * n * d;
        for (idx_t t = 0; t < n; t++) {
            float* qt = q + t * d;
            for (int j = 0; j < d; j++) {
                qt[j] = -kQueryAway * offset[j] + sink_gain * sink_dir[j] + 0.3f * rng();
            }
            if (kind == HeadKind::needle) {
                // the latest needle before t (or the first), by direction only
                idx_t target = needles[0];
                for (idx_t x : needles) {
                    if (x < t && (target >= t || x > target)) {
                        target = x;
                    }
                }
                const float* s = structured.data() + target * d;
                float sn = norm(s, d);
                for (int j = 0; j < d; j++) {
                    qt[j] += kNeedleGain * std::sqrt(float(d)) * s[j] / (sn * sn);
                }
            } else if (kind == HeadKind::aggregate) {
                for (int j = 0; j < d; j++) {
                    qt[j] += kAggregateGain * std::sqrt(float(d)) * agg_dir[j];
                }
            } else if (kind == HeadKind::local) {
                for (int j = 0; j < d; j++) {
                    qt[j] += kLocalGain * local_rot[t * d + j];
                }
            }
        }
    }
}

} // namespace

kvindex::TraceMeta synthetic_meta(const SyntheticConfig& cfg) {
    FAISS_THROW_IF_NOT_FMT(
            cfg.n_tokens > cfg.n_eval && cfg.n_eval >= 1,
            "gen: need 1 <= eval=%zd < tokens=%zd",
            size_t(cfg.n_eval),
            size_t(cfg.n_tokens));
    FAISS_THROW_IF_NOT_FMT(
            cfg.head_dim >= 8 && cfg.head_dim % 8 == 0,
            "gen: head-dim=%d must be a multiple of 8",
            cfg.head_dim);
    FAISS_THROW_IF_NOT_MSG(
            cfg.n_kv_heads >= 1 && cfg.group >= 1 && cfg.n_layers >= 1,
            "gen: kv-heads, group and layers must be >= 1");
    // n_q_heads is an int: the product must fit before it is formed
    FAISS_THROW_IF_NOT_FMT(
            int64_t(cfg.n_kv_heads) * cfg.group <= 65536,
            "gen: kv-heads x group = %lld query heads, more than 65536",
            (long long)cfg.n_kv_heads * cfg.group);
    FAISS_THROW_IF_NOT_FMT(cfg.n_layers <= 4096, "gen: layers=%d, more than 4096", cfg.n_layers);
    head_kind(cfg, 0, 0); // checks the preset name
    kvindex::TraceMeta meta;
    meta.n_layers = cfg.n_layers;
    meta.n_kv_heads = cfg.n_kv_heads;
    meta.n_q_heads = cfg.n_kv_heads * cfg.group;
    meta.head_dim = cfg.head_dim;
    meta.n_tokens = cfg.n_tokens;
    meta.n_ctx = cfg.n_tokens - cfg.n_eval;
    meta.source = "kvbench gen --preset " + cfg.preset + " --seed " + std::to_string(cfg.seed);
    meta.dtype = cfg.dtype;
    meta.check();
    return meta;
}

kvindex::TraceLayer synthetic_layer(const SyntheticConfig& cfg, int layer_no) {
    kvindex::TraceMeta meta = synthetic_meta(cfg);
    size_t kv = size_t(cfg.n_kv_heads) * cfg.n_tokens * cfg.head_dim;
    kvindex::TraceLayer layer;
    layer.keys.assign(kv, 0.0f);
    layer.values.assign(kv, 0.0f);
    layer.queries.assign(kv * cfg.group, 0.0f);
    for (int h = 0; h < cfg.n_kv_heads; h++) {
        generate_kv_head(cfg, meta, layer_no, h, layer);
    }
    return layer;
}

kvindex::TraceMeta write_synthetic_trace(const std::string& dir, const SyntheticConfig& cfg) {
    kvindex::TraceMeta meta = synthetic_meta(cfg);
    // keys, values and queries of every layer, checked against the disk
    // before the first byte: a trace that cannot fit is refused, not
    // written until the disk is full
    const double elem = cfg.dtype == "float16" ? 2 : 4;
    const double bytes = double(cfg.n_layers) * double(cfg.n_tokens) * cfg.head_dim *
            (2.0 * cfg.n_kv_heads + double(meta.n_q_heads)) * elem;
    std::filesystem::path parent = std::filesystem::absolute(dir).parent_path();
    std::error_code ec;
    const std::filesystem::space_info space = std::filesystem::space(parent, ec);
    FAISS_THROW_IF_NOT_FMT(
            ec || bytes <= double(space.available),
            "gen: the trace would take %.1f GB, and %s has %.1f GB free (fewer layers or tokens)",
            bytes / 1e9,
            parent.c_str(),
            double(space.available) / 1e9);
    write_trace_meta(dir, meta);
    for (int l = 0; l < cfg.n_layers; l++) {
        kvindex::write_trace_layer(dir, meta, l, synthetic_layer(cfg, l));
    }
    return meta;
}

std::vector<double> attention_entropy_profile(
        const std::string& dir, const kvindex::TraceMeta& meta, int n_positions) {
    std::vector<double> profile;
    int d = meta.head_dim, g = meta.n_q_heads / meta.n_kv_heads;
    idx_t n = meta.n_tokens, n_eval = n - meta.n_ctx;
    int m = int(std::min<idx_t>(n_positions, n_eval));
    for (int l = 0; l < meta.n_layers; l++) {
        kvindex::TraceLayer layer = kvindex::read_trace_layer(dir, meta, l);
        for (int qh = 0; qh < meta.n_q_heads; qh++) {
            const float* keys = layer.keys.data() + size_t(qh / g) * n * d;
            double mean = 0;
            for (int i = 0; i < m; i++) {
                idx_t p = meta.n_ctx + (m == 1 ? 0 : i * (n_eval - 1) / (m - 1));
                const float* q = layer.queries.data() + (size_t(qh) * n + p) * d;
                std::vector<double> s(p + 1);
                double mx = -INFINITY;
                for (idx_t t = 0; t <= p; t++) {
                    double acc = 0;
                    for (int j = 0; j < d; j++) {
                        acc += double(q[j]) * keys[t * d + j];
                    }
                    s[t] = acc / std::sqrt(double(d));
                    mx = std::max(mx, s[t]);
                }
                double z = 0, h = 0;
                for (auto& x : s) {
                    x = std::exp(x - mx);
                    z += x;
                }
                for (double x : s) {
                    double w = x / z;
                    h -= w > 0 ? w * std::log(w) : 0;
                }
                mean += h / std::log(double(p + 1)) / m;
            }
            profile.push_back(mean);
        }
    }
    return profile;
}

void check_scaling_options(
        const std::vector<int64_t>& lengths, int n_queries, int min_queries, int top_k) {
    if (n_queries < min_queries) {
        throw std::invalid_argument("--queries " + std::to_string(n_queries) +
                                    " must be >= " + std::to_string(min_queries));
    }
    for (int64_t n : lengths) {
        if (n < top_k) {
            throw std::invalid_argument("--tokens " + std::to_string(n) +
                                        " must be >= " + std::to_string(top_k) +
                                        " (the recall is of the exact top-" + std::to_string(top_k) + ")");
        }
    }
}

ScalingHead scaling_head(int64_t n, int n_queries, int head_dim) {
    SyntheticConfig cfg;
    cfg.n_tokens = n + n_queries;
    cfg.head_dim = head_dim;
    cfg.n_kv_heads = 1;
    cfg.group = 3;
    cfg.n_layers = 1;
    cfg.n_eval = n_queries;
    ScalingHead head;
    head.layer = synthetic_layer(cfg, 0);
    for (int i = 0; i < n_queries; i++) {
        size_t row = size_t(i % 3) * size_t(cfg.n_tokens) + size_t(n + i);
        head.queries.push_back(head.layer.queries.data() + row * head_dim);
    }
    return head;
}

} // namespace kvbench
