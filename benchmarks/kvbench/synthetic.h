#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <kvindex/trace.h>

namespace kvbench {

/** What kind of attention a synthetic query head produces.
 *   needle: each query points at one of a few salient earlier tokens (sparse)
 *   local:  queries and keys share a high-frequency RoPE component, so
 *           attention peaks on recent tokens and decays with distance
 *   flat:   queries carry no key structure: near-uniform attention
 *   aggregate: queries lean weakly on one key direction w, and the values
 *           carry w.k: attention is broad but graded, and the output
 *           depends on the whole tail (counting, averaging). Top-k keeps
 *           the extreme keys and overshoots: the case where it is biased.
 *   ood:    a geometry nothing was tuned on (preset "ood"): topics that
 *           drift along the prompt, prompt queries that attend their own
 *           topic, and a question (the prompt's last positions and every
 *           evaluation position) whose queries resemble no other prompt
 *           query and point at several needles at once.
 */
enum class HeadKind { needle, local, flat, aggregate, ood };
const char* head_kind_name(HeadKind kind);

struct SyntheticConfig {
    std::string preset = "mixed"; ///< needle | local | flat | aggregate | mixed
    uint64_t seed = 1;
    int64_t n_tokens = 16384;
    int head_dim = 128;
    int n_kv_heads = 2;
    int group = 2;      ///< query heads per KV head
    int n_layers = 2;
    int64_t n_eval = 256; ///< evaluation positions at the end: n_ctx = n_tokens - n_eval
    std::string dtype = "float32";
    // preset "ood" only (-1: its default; another preset refuses them)
    int ood_needles = -1;          ///< needles each question query points at (default 4)
    int64_t ood_question = -1;     ///< question tokens at the end of the prompt (default 64)
    int64_t ood_topic_tokens = -1; ///< tokens per topic segment (default 2048)
};

/// The "ood" preset's options, defaults filled in (throws for another preset
/// given them, or values out of range).
struct OodOptions {
    int needles;
    int64_t question;
    int64_t topic_tokens;
};
OodOptions ood_options(const SyntheticConfig& cfg);

/// The needle positions query head q_head of a layer points at, under
/// preset "ood" (ground truth, for tests and analysis), increasing.
std::vector<int64_t> ood_needles(const SyntheticConfig& cfg, int layer, int q_head);

/// Kind of query head h of layer l under a preset (mixed cycles the kinds).
HeadKind head_kind(const SyntheticConfig& cfg, int layer, int q_head);

/// The trace metadata of a configuration (checks the configuration).
kvindex::TraceMeta synthetic_meta(const SyntheticConfig& cfg);

/// One layer, generated in memory; deterministic in (cfg, layer).
kvindex::TraceLayer synthetic_layer(const SyntheticConfig& cfg, int layer);

/// The scaling benchmarks' head (bench_scaling, bench_peers): one KV head of
/// the mixed preset, d = head_dim, n context tokens, then n_queries
/// evaluation positions whose queries take the group's three heads (needle,
/// local, flat) in turn.
struct ScalingHead {
    kvindex::TraceLayer layer;          ///< keys and values of n + n_queries tokens
    std::vector<const float*> queries;  ///< n_queries pointers into layer.queries
};
ScalingHead scaling_head(int64_t n, int n_queries, int head_dim);

/** The options of a scaling tool, checked before any work: at least
 * min_queries queries (bench_recall: 3, one per head kind), and every
 * context length at least top_k tokens (the recall is of the exact top_k).
 * Throws std::invalid_argument naming the option (run_tool names the tool). */
void check_scaling_options(
        const std::vector<int64_t>& lengths, int n_queries, int min_queries, int top_k);

/// Generates and writes the trace; deterministic in cfg (seed included).
kvindex::TraceMeta write_synthetic_trace(const std::string& dir, const SyntheticConfig& cfg);

/// Mean normalised attention entropy H / log(p + 1) of each (layer, query
/// head) over up to `n_positions` evaluation positions: 0 = one token, 1 = uniform.
std::vector<double> attention_entropy_profile(
        const std::string& dir, const kvindex::TraceMeta& meta, int n_positions);

} // namespace kvbench
