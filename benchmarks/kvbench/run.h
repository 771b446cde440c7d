#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>

namespace kvbench {

using kvindex::idx_t;

struct RunOptions {
    std::string trace_dir;
    /// "STRING" or "STRING|params" (parameters.h), in table order
    std::vector<std::string> indexes;
    /// set on every index that has them, before its own parameters
    /// ("k=100,nprobe=8": k on the indexes reading a top-k budget, nprobe on
    /// the IVF ones); each must be a parameter of some index; "k=5%" is 5%
    /// of the trace's n_ctx prompt tokens
    std::string params;
    std::vector<int> layers;          ///< empty: every layer
    /// cache file of `kvllm train` (read_cache) for the trace's model: each
    /// (layer, KV head) index with an offline-trained type (IVFAsym) adopts
    /// its models before its prefill, the others (baselines) run as given;
    /// at least one index string must adopt
    std::string trained;
    idx_t max_queries = 0;            ///< evaluation positions per (layer, q head); 0: all
    /// knobs read from every (layer, KV head) index after its prefill, where
    /// its chain has them: what a per-head choice decided ("chosen",
    /// "calibrated_sample")
    std::vector<std::string> report;
    bool progress = true;             ///< progress lines on stderr
    /// timed calls per query (after one untimed warm-up) for the index's
    /// attend and for dense attention; each query counts their median, so
    /// that a pause of the process on a busy machine moves no figure
    int timed_calls = 3;
};

/// The figures of one index string over every evaluated (layer, q head, position).
struct IndexResult {
    std::string index;
    std::string params; ///< the --params items this index took (those it has)
    idx_t n_queries = 0;
    double rel_err_mean = 0, rel_err_p95 = 0;
    double mass_mean = 0;              ///< exact attention mass of the selected set
    std::optional<double> recall_at_k; ///< of the exact top-k, for top-k indexes
    double selected_frac = 0;          ///< selected tokens / tokens attended
    double touched_frac = 0;           ///< vectors read / 2 (p + 1): 1 = dense
    double us_per_query = 0;
    double dense_us_per_query = 0;
    double speedup_vs_dense = 0;
    double build_s = 0;                ///< prefill seconds, summed over heads
    double bytes_per_token = 0;        ///< index memory / tokens, mean over heads
    std::vector<float> outputs;        ///< [n_rows, head_dim], rows as RunResult::rows

    /// The figures of one layer (over its heads and positions).
    struct Layer {
        int layer = 0;
        double rel_err_mean = 0, mass_mean = 0, selected_frac = 0;
    };
    std::vector<Layer> per_layer;      ///< in the order of RunOptions::layers

    /// A knob of RunOptions::report, read after the prefill of one head.
    struct Reported {
        int layer = 0, kv_head = 0;
        std::string name;
        double value = 0;
    };
    std::vector<Reported> reported;
};

struct RunResult {
    std::string trace;
    std::string machine;
    int head_dim = 0;
    idx_t n_tokens = 0; ///< context length of the trace
    std::string trained; ///< RunOptions::trained
    int timed_calls = 1; ///< RunOptions::timed_calls
    std::vector<std::array<int64_t, 3>> rows; ///< (layer, q head, position)
    std::vector<IndexResult> results;
};

/// Replays the trace through every index and exact attention (trace.h).
RunResult run_kvbench(const RunOptions& options);

/// Evaluation positions: n spread evenly over [n_ctx, n_tokens), all if n <= 0.
std::vector<idx_t> evaluation_positions(idx_t n_ctx, idx_t n_tokens, idx_t n);

void print_table(const RunResult& result);
void write_json(const RunResult& result, const std::string& path);
/// rows.npy (int64 [n_rows, 3]) and <i>.npy (float32 [n_rows, d]) per index.
void write_dump(const RunResult& result, const std::string& dir);

/// "CPU model, N cores" from /proc/cpuinfo.
std::string machine_description();

} // namespace kvbench
