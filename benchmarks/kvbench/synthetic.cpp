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
        case HeadKind::ood:
            return "ood";
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
    if (cfg.preset == "ood") {
        return HeadKind::ood;
    }
    FAISS_THROW_IF_NOT_FMT(
            cfg.preset == "mixed",
            "unknown preset '%s' (needle, local, flat, aggregate, mixed, ood)",
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

// ---- preset "ood": a geometry nothing was tuned on ------------------------

OodOptions ood_options(const SyntheticConfig& cfg) {
    const bool ood = cfg.preset == "ood";
    FAISS_THROW_IF_NOT_FMT(
            ood || (cfg.ood_needles < 0 && cfg.ood_question < 0 && cfg.ood_topic_tokens < 0),
            "gen: --needles, --question and --topic-tokens apply to --preset ood only (preset '%s')",
            cfg.preset.c_str());
    OodOptions o;
    o.needles = cfg.ood_needles >= 0 ? cfg.ood_needles : 4;
    o.question = cfg.ood_question >= 0 ? cfg.ood_question : 64;
    o.topic_tokens = cfg.ood_topic_tokens >= 0 ? cfg.ood_topic_tokens : 2048;
    if (!ood) {
        return o;
    }
    const int64_t n_ctx = cfg.n_tokens - cfg.n_eval;
    FAISS_THROW_IF_NOT_FMT(
            o.needles >= 1 && o.needles <= 64, "gen: --needles=%d must be in [1, 64]", o.needles);
    FAISS_THROW_IF_NOT_FMT(
            o.question >= 1 && o.question + o.needles + 1 <= n_ctx,
            "gen: --question=%lld must be >= 1 and leave %d needles before it in the %lld-token prompt",
            (long long)o.question,
            o.needles,
            (long long)n_ctx);
    FAISS_THROW_IF_NOT_FMT(
            o.topic_tokens >= 1, "gen: --topic-tokens=%lld must be >= 1", (long long)o.topic_tokens);
    return o;
}

namespace {

/// Stream of an ood head: apart from the other presets' (which stay as they were).
uint64_t ood_stream(const SyntheticConfig& cfg, int layer_no, int h) {
    return cfg.seed * 1000003u + layer_no * 1009u + h + 0x6f6f64000000ull;
}

/// The needles of query head g of KV head h: distinct positions in the
/// prompt before the question, drawn from the head's own stream.
std::vector<idx_t> draw_ood_needles(const SyntheticConfig& cfg, const OodOptions& o, int layer_no, int qh) {
    std::mt19937_64 gen(ood_stream(cfg, layer_no, 100000 + qh));
    const idx_t bulk = cfg.n_tokens - cfg.n_eval - o.question; // positions 1 .. bulk - 1
    std::uniform_int_distribution<idx_t> pick(1, bulk - 1);
    std::vector<idx_t> needles;
    while (idx_t(needles.size()) < o.needles) {
        idx_t x = pick(gen);
        if (std::find(needles.begin(), needles.end(), x) == needles.end()) {
            needles.push_back(x);
        }
    }
    std::sort(needles.begin(), needles.end());
    return needles;
}

/** One KV head of the ood preset. The scales are drawn per head from the
 * seed (key offset 4-12, key rank 8-32, noise 0.2-0.5, topic norm 2-6), so
 * that no constant of the other presets carries over:
 *  - keys: offset + the topic of their segment (a random walk of centres,
 *    one per topic_tokens tokens) + a low-rank part rotated by RoPE + noise;
 *    token 0 carries a sink direction;
 *  - prompt queries before the question attend their own topic;
 *  - question queries (the prompt's last `question` positions and every
 *    evaluation position) share a question direction and point at the
 *    query head's needles, each of which carries a direction of its own,
 *    with gains 15-16.5: attention splits among them.
 */
void generate_ood_head(
        const SyntheticConfig& cfg,
        const kvindex::TraceMeta& meta,
        int layer_no,
        int h,
        kvindex::TraceLayer& layer) {
    const OodOptions o = ood_options(cfg);
    const int d = cfg.head_dim;
    const idx_t n = cfg.n_tokens;
    Rng rng(ood_stream(cfg, layer_no, h));
    std::uniform_real_distribution<float> unit(0.0f, 1.0f);
    kvindex::RopeParams rope{meta.rope_theta, meta.rope_style};
    const float offset_norm = 4.0f + 8.0f * unit(rng.gen);
    const int rank = 8 + int(24 * unit(rng.gen));
    const float noise = 0.2f + 0.3f * unit(rng.gen);
    const float topic_norm = 2.0f + 4.0f * unit(rng.gen);

    auto offset = rng.vec(d);
    scale_to(offset, offset_norm);
    auto basis = rng.vec(size_t(rank) * d, 1.0f / std::sqrt(float(rank)));
    auto value_basis = rng.vec(size_t(rank) * d, 1.0f / std::sqrt(float(rank)));
    auto value_offset = rng.vec(d, 0.5f);
    auto sink_dir = rng.vec(d);
    scale_to(sink_dir, 1.0f);
    auto question_dir = rng.vec(d);
    scale_to(question_dir, 1.0f);
    // topics: a random walk of centres, each step keeping 0.6 of the last
    const idx_t n_topics = (n + o.topic_tokens - 1) / o.topic_tokens;
    std::vector<float> topics(size_t(n_topics) * d), topic_values(size_t(n_topics) * d);
    for (idx_t s = 0; s < n_topics; s++) {
        auto fresh = rng.vec(d);
        auto fresh_value = rng.vec(d, 0.5f);
        for (int j = 0; j < d; j++) {
            topics[s * d + j] = s == 0 ? fresh[j] : 0.6f * topics[(s - 1) * d + j] + 0.8f * fresh[j];
            topic_values[s * d + j] = fresh_value[j];
        }
        std::vector<float> c(topics.begin() + s * d, topics.begin() + (s + 1) * d);
        scale_to(c, topic_norm);
        std::copy(c.begin(), c.end(), topics.begin() + s * d);
    }

    std::vector<float> structured(size_t(n) * d);
    std::vector<int64_t> pos(n);
    for (idx_t t = 0; t < n; t++) {
        pos[t] = t;
        float* st = structured.data() + t * d;
        for (int r = 0; r < rank; r++) {
            float z = rng();
            for (int j = 0; j < d; j++) {
                st[j] += z * basis[r * d + j];
            }
        }
    }
    kvindex::apply_rope(n, d, structured.data(), pos.data(), rope);
    float* keys = layer.keys.data() + size_t(h) * n * d;
    float* values = layer.values.data() + size_t(h) * n * d;
    for (idx_t t = 0; t < n; t++) {
        const idx_t s = t / o.topic_tokens;
        for (int j = 0; j < d; j++) {
            keys[t * d + j] = offset[j] + topics[s * d + j] + structured[t * d + j] + noise * rng();
        }
        for (int r = 0; r < rank; r++) {
            float w = rng();
            for (int j = 0; j < d; j++) {
                values[t * d + j] += w * value_basis[r * d + j];
            }
        }
        for (int j = 0; j < d; j++) {
            values[t * d + j] += value_offset[j] + topic_values[s * d + j] + 0.3f * rng();
        }
    }
    for (int j = 0; j < d; j++) {
        keys[j] += kSinkNorm * sink_dir[j];
    }
    // each query head's needles carry a direction of their own (norm 16),
    // which its question queries point at with gains 15-16.5: a needle scores
    // about its gain, the other keys about N(0, 1.2^2) per needle (the
    // direction's overlap with their own parts, over 16), so the needles
    // share most of the mass, the strongest a few times the weakest
    constexpr float kNeedleNorm = 16.0f;
    std::vector<std::vector<idx_t>> needles(cfg.group);
    std::vector<std::vector<float>> needle_dirs(cfg.group), gains(cfg.group);
    std::vector<float> unit_offset = offset;
    scale_to(unit_offset, 1.0f);
    for (int g = 0; g < cfg.group; g++) {
        needles[g] = draw_ood_needles(cfg, o, layer_no, h * cfg.group + g);
        for (idx_t x : needles[g]) {
            // orthogonal to the head's other needle directions (Gram-Schmidt):
            // pointing at one needle adds nothing to another's score
            auto u = rng.vec(d);
            std::vector<const float*> away = {unit_offset.data()}; // and from the shared offset
            for (size_t i = 0; i * d < needle_dirs[g].size(); i++) {
                away.push_back(needle_dirs[g].data() + i * d);
            }
            for (size_t i = 0; i < away.size() && int(i) < d - 1; i++) {
                const float* v = away[i];
                double dot = 0;
                for (int j = 0; j < d; j++) {
                    dot += double(u[j]) * v[j];
                }
                for (int j = 0; j < d; j++) {
                    u[j] -= float(dot) * v[j];
                }
            }
            scale_to(u, 1.0f);
            for (int j = 0; j < d; j++) {
                keys[x * d + j] += kNeedleNorm * u[j];
            }
            needle_dirs[g].insert(needle_dirs[g].end(), u.begin(), u.end());
            gains[g].push_back(15.0f + 1.5f * unit(rng.gen));
        }
    }

    const idx_t question_start = meta.n_ctx - o.question;
    const float sink_gain = kSinkScore * std::sqrt(float(d)) / kSinkNorm;
    const float topic_gain = 4.0f; // score of a key of the query's own topic, about
    for (int g = 0; g < cfg.group; g++) {
        const int qh = h * cfg.group + g;
        float* q = layer.queries.data() + size_t(qh) * n * d;
        for (idx_t t = 0; t < n; t++) {
            float* qt = q + t * d;
            for (int j = 0; j < d; j++) {
                qt[j] = -kQueryAway * offset[j] + sink_gain * sink_dir[j] + 0.3f * rng();
            }
            if (t >= question_start) {
                for (int j = 0; j < d; j++) {
                    qt[j] += 4.0f * question_dir[j];
                }
                for (size_t i = 0; i < needles[g].size(); i++) {
                    const float* u = needle_dirs[g].data() + i * d;
                    for (int j = 0; j < d; j++) {
                        qt[j] += gains[g][i] * std::sqrt(float(d)) * u[j] / kNeedleNorm;
                    }
                }
            } else {
                const float* c = topics.data() + (t / o.topic_tokens) * d;
                for (int j = 0; j < d; j++) {
                    qt[j] += topic_gain * std::sqrt(float(d)) * c[j] / (topic_norm * topic_norm);
                }
            }
        }
    }
}

} // namespace

std::vector<int64_t> ood_needles(const SyntheticConfig& cfg, int layer, int q_head) {
    FAISS_THROW_IF_NOT_FMT(cfg.preset == "ood", "ood_needles: preset '%s' is not ood", cfg.preset.c_str());
    return draw_ood_needles(cfg, ood_options(cfg), layer, q_head);
}

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
    ood_options(cfg);     // and the ood options
    kvindex::TraceMeta meta;
    meta.n_layers = cfg.n_layers;
    meta.n_kv_heads = cfg.n_kv_heads;
    meta.n_q_heads = cfg.n_kv_heads * cfg.group;
    meta.head_dim = cfg.head_dim;
    meta.n_tokens = cfg.n_tokens;
    meta.n_ctx = cfg.n_tokens - cfg.n_eval;
    meta.source = "kvbench gen --preset " + cfg.preset + " --seed " + std::to_string(cfg.seed);
    if (cfg.preset == "ood") {
        const OodOptions o = ood_options(cfg);
        meta.source += " --needles " + std::to_string(o.needles) + " --question " + std::to_string(o.question) +
                " --topic-tokens " + std::to_string(o.topic_tokens);
    }
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
        if (cfg.preset == "ood") {
            generate_ood_head(cfg, meta, layer_no, h, layer);
        } else {
            generate_kv_head(cfg, meta, layer_no, h, layer);
        }
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
