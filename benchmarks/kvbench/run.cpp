#include "run.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <thread>

#include <faiss/impl/FaissAssert.h>
#include <nlohmann/json.hpp>

#include <kvindex/attention.h>
#include <kvindex/IndexIVFAsym.h>
#include <kvindex/KVCache.h>
#include <kvindex/index_factory.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_io.h>
#include <kvindex/kernels.h>
#include <kvindex/parameters.h>
#include <kvindex/trace.h>

namespace kvbench {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// The median of `calls` timings of f (the lower middle one for an even count).
template <class F>
double median_seconds(int calls, F&& f) {
    std::vector<double> t(calls);
    for (double& x : t) {
        auto t0 = Clock::now();
        f();
        x = seconds_since(t0);
    }
    std::nth_element(t.begin(), t.begin() + (calls - 1) / 2, t.end());
    return t[(calls - 1) / 2];
}

/// Whether some index of the chain has the knob `name`.
bool has_parameter(const kvindex::KVIndex* index, const std::string& name) {
    for (const kvindex::ParameterInfo& p : kvindex::index_parameter_info(index)) {
        if (p.name == name) {
            return true;
        }
    }
    return false;
}

/// The name of an item ("k" of "k=5%"); the whole item if it has no '='.
std::string item_name(const std::string& item) {
    return item.substr(0, item.find('='));
}

/** The --params items this index takes: those it has a knob of (k only
 * where a top-k is read, nprobe only with IVF, ...). A name no index of
 * the run has is refused up front; a malformed item is kept, so that the
 * parser names it. */
std::string shared_params_for(const kvindex::KVIndex* index, const std::string& params) {
    std::string out;
    bool first = true;
    for (const std::string& item : kvindex::parameter_items(params)) {
        if (item.find('=') == std::string::npos || item_name(item).empty() ||
            has_parameter(index, item_name(item))) {
            out += (first ? "" : ",") + item; // an empty item stays one
            first = false;
        }
    }
    return out;
}

/** The index of one "STRING|params" argument: the --params items it has
 * first, then the string's own parameters; budgets in percent are of the
 * n_ctx prompt tokens. */
std::unique_ptr<kvindex::KVIndex> make_index(
        int d, const std::string& spec_string, const std::string& params, idx_t n_ctx) {
    kvindex::IndexSpec spec = kvindex::parse_index_spec(spec_string);
    auto index = kvindex::index_factory(d, spec.factory);
    for (const std::string& p : {shared_params_for(index.get(), params), spec.params}) {
        if (!p.empty()) {
            kvindex::set_index_parameters(index.get(), kvindex::resolve_percentages(p, n_ctx, index.get()));
        }
    }
    return index;
}

/// Per-row figures, summarised at the end.
struct Accumulator {
    std::vector<double> rel_err, mass_row, selected_row; ///< one per row
    double mass = 0, recall = 0, selected = 0, touched = 0;
    double attend_s = 0, dense_s = 0;
    idx_t n = 0, n_recall = 0;
};

double p95(std::vector<double> v) {
    if (v.empty()) {
        return 0;
    }
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, size_t(std::ceil(0.95 * v.size())) - 1)];
}

} // namespace

std::vector<idx_t> evaluation_positions(idx_t n_ctx, idx_t n_tokens, idx_t n) {
    idx_t n_eval = n_tokens - n_ctx;
    std::vector<idx_t> pos;
    if (n <= 0 || n >= n_eval) {
        for (idx_t p = n_ctx; p < n_tokens; p++) {
            pos.push_back(p);
        }
        return pos;
    }
    for (idx_t i = 0; i < n; i++) {
        // evenly spread, first and last included
        pos.push_back(n_ctx + (n == 1 ? n_eval - 1 : i * (n_eval - 1) / (n - 1)));
    }
    return pos;
}

std::string machine_description() {
    std::ifstream f("/proc/cpuinfo");
    std::string line, model = "unknown CPU";
    while (std::getline(f, line)) {
        if (line.rfind("model name", 0) == 0) {
            model = line.substr(line.find(':') + 2);
            break;
        }
    }
    return model + ", " + std::to_string(std::thread::hardware_concurrency()) + " cores, SIMD " +
            kvindex::simd_level_name(kvindex::get_simd_level());
}

RunResult run_kvbench(const RunOptions& opt) {
    kvindex::TraceMeta meta = kvindex::read_trace_meta(opt.trace_dir);
    FAISS_THROW_IF_NOT_MSG(!opt.indexes.empty(), "kvbench run: no --index given");
    std::vector<int> layers = opt.layers;
    if (layers.empty()) {
        // every layer the trace holds: a trace of some layers (kvllm trace
        // --layers 4,8) keeps the model's n_layers and only their directories
        for (int l = 0; l < meta.n_layers; l++) {
            if (std::filesystem::is_directory(opt.trace_dir + "/layer_" + std::to_string(l))) {
                layers.push_back(l);
            }
        }
        FAISS_THROW_IF_NOT_FMT(
                !layers.empty(),
                "kvbench run: %s holds no layer directory (layer_0 .. layer_%d)",
                opt.trace_dir.c_str(),
                meta.n_layers - 1);
    }
    for (size_t i = 0; i < layers.size(); i++) {
        FAISS_THROW_IF_NOT_FMT(
                layers[i] >= 0 && layers[i] < meta.n_layers,
                "kvbench run: layer %d not in the trace (n_layers=%d)",
                layers[i],
                meta.n_layers);
        // a repeated layer would be measured, and averaged, twice
        FAISS_THROW_IF_NOT_FMT(
                std::find(layers.begin(), layers.begin() + i, layers[i]) == layers.begin() + i,
                "kvbench run: layer %d given twice",
                layers[i]);
    }
    FAISS_THROW_IF_NOT_FMT(
            meta.n_tokens > meta.n_ctx,
            "kvbench run: the trace has no evaluation positions (n_tokens=%zd, n_ctx=%zd): "
            "every figure would be of zero queries",
            size_t(meta.n_tokens),
            size_t(meta.n_ctx));
    std::unique_ptr<kvindex::KVCache> trained;
    if (!opt.trained.empty()) {
        trained = kvindex::read_cache(opt.trained);
        FAISS_THROW_IF_NOT_FMT(
                trained->n_layers == meta.n_layers && trained->n_kv_heads == meta.n_kv_heads &&
                        trained->d == meta.head_dim,
                "kvbench run: --trained %s has %d layers x %d KV heads, d=%d; the trace %d x %d, d=%d",
                opt.trained.c_str(),
                trained->n_layers,
                trained->n_kv_heads,
                trained->d,
                meta.n_layers,
                meta.n_kv_heads,
                meta.head_dim);
    }
    // build every index once up front: a bad string or parameter, or a
    // chain --trained cannot serve, fails before any work is done. Only the
    // strings with an offline-trained type in them (IVFAsym) adopt from
    // --trained; the others (the baselines of the same run) run as given.
    std::vector<bool> adopts(opt.indexes.size(), false);
    std::vector<bool> reportable(opt.report.size(), false);
    const std::vector<std::string> shared = kvindex::parameter_items(opt.params);
    std::vector<bool> shared_taken(shared.size(), false);
    std::vector<std::string> taken_params(opt.indexes.size()); // each index's share of --params
    for (size_t ix = 0; ix < opt.indexes.size(); ix++) {
        auto index = make_index(meta.head_dim, opt.indexes[ix], opt.params, meta.n_ctx);
        taken_params[ix] = shared_params_for(index.get(), opt.params);
        adopts[ix] = trained && kvindex::ivf_asym_in_chain(index.get());
        if (adopts[ix]) {
            index->adopt_trained(*trained->index(layers[0], 0));
        }
        for (size_t i = 0; i < opt.report.size(); i++) {
            reportable[i] = reportable[i] || has_parameter(index.get(), opt.report[i]);
        }
        for (size_t i = 0; i < shared.size(); i++) {
            shared_taken[i] = shared_taken[i] || has_parameter(index.get(), item_name(shared[i]));
        }
    }
    // a file or a name that nothing takes would be recorded as if it had
    // been used, or print nothing: a misspelt option
    FAISS_THROW_IF_NOT_FMT(
            !trained || std::find(adopts.begin(), adopts.end(), true) != adopts.end(),
            "kvbench run: --trained %s: no index string has an offline-trained type (IVFAsym) "
            "to adopt it",
            opt.trained.c_str());
    for (size_t i = 0; i < opt.report.size(); i++) {
        FAISS_THROW_IF_NOT_FMT(
                reportable[i],
                "kvbench run: --report %s: no index string has a parameter of that name",
                opt.report[i].c_str());
    }
    for (size_t i = 0; i < shared.size(); i++) {
        // each index takes the --params it has: one that none has does nothing
        FAISS_THROW_IF_NOT_FMT(
                shared_taken[i],
                "kvbench run: --params %s: no index string has a parameter '%s' (k is one "
                "only of the indexes that read a top-k budget)",
                shared[i].c_str(),
                item_name(shared[i]).c_str());
    }
    FAISS_THROW_IF_NOT_FMT(
            opt.max_queries >= 0,
            "kvbench run: --max-queries %lld must be >= 0 (0: every position)",
            (long long)opt.max_queries);
    FAISS_THROW_IF_NOT_FMT(
            opt.timed_calls >= 1 && opt.timed_calls <= 1000,
            "kvbench run: --timed-calls %d must be in [1, 1000]",
            opt.timed_calls);
    int d = meta.head_dim, g = meta.n_q_heads / meta.n_kv_heads;
    idx_t n = meta.n_tokens, n_ctx = meta.n_ctx;
    std::vector<idx_t> positions = evaluation_positions(n_ctx, n, opt.max_queries);

    RunResult res;
    res.trace = opt.trace_dir;
    res.machine = machine_description();
    res.head_dim = d;
    res.trained = opt.trained;
    res.timed_calls = opt.timed_calls;
    res.n_tokens = n;
    std::vector<Accumulator> acc(opt.indexes.size());
    res.results.resize(opt.indexes.size());
    std::vector<double> bytes_sum(opt.indexes.size(), 0.0);
    int n_heads_built = 0;

    for (int l : layers) {
        kvindex::TraceLayer layer = kvindex::read_trace_layer(opt.trace_dir, meta, l);
        for (int h = 0; h < meta.n_kv_heads; h++) {
            const float* keys = layer.keys.data() + size_t(h) * n * d;
            const float* values = layer.values.data() + size_t(h) * n * d;
            // prefill queries of the group: [g, n_ctx, d]
            std::vector<float> prefill_q(size_t(g) * n_ctx * d);
            for (int j = 0; j < g; j++) {
                const float* src = layer.queries.data() + size_t(h * g + j) * n * d;
                std::copy(src, src + n_ctx * d, prefill_q.begin() + size_t(j) * n_ctx * d);
            }
            size_t row0 = res.rows.size();
            for (idx_t p : positions) {
                for (int j = 0; j < g; j++) {
                    res.rows.push_back({l, h * g + j, p});
                }
            }
            n_heads_built++;
            for (size_t ix = 0; ix < opt.indexes.size(); ix++) {
                if (opt.progress) {
                    std::fprintf(stderr, "kvbench: layer %d kv head %d: %s\n", l, h,
                                 opt.indexes[ix].c_str());
                }
                IndexResult& r = res.results[ix];
                Accumulator& a = acc[ix];
                auto index = make_index(d, opt.indexes[ix], opt.params, n_ctx);
                if (adopts[ix]) {
                    // before the prefill: it then only assigns the keys
                    index->adopt_trained(*trained->index(l, h));
                }
                kvindex::PrefillInput in;
                in.n_tokens = n_ctx;
                in.keys = keys;
                in.values = values;
                in.n_queries = n_ctx;
                in.n_query_heads = g;
                in.queries = prefill_q.data();
                in.rope = kvindex::RopeParams{meta.rope_theta, meta.rope_style};
                auto tb = Clock::now();
                index->prefill(in);
                r.build_s += seconds_since(tb);
                for (const std::string& name : opt.report) {
                    if (has_parameter(index.get(), name)) {
                        r.reported.push_back(
                                {l, h, name, kvindex::get_index_parameter(index.get(), name)});
                    }
                }
                // indexes with a top-k retrieval inside get recall@k
                const idx_t top_k = index->top_k_budget();
                kvindex::SearchParametersKV count;
                count.count_scanned = true;

                r.outputs.resize(res.rows.size() * d);
                idx_t cursor = n_ctx;
                size_t row = row0;
                std::vector<float> exact(d), scores(n);
                for (idx_t p : positions) {
                    // decode: tokens up to p (its own key included) arrive first
                    index->add_kv(p + 1 - cursor, keys + cursor * d, values + cursor * d);
                    cursor = p + 1;
                    for (int j = 0; j < g; j++, row++) {
                        const float* q = layer.queries.data() + (size_t(h * g + j) * n + p) * d;
                        float* out = r.outputs.data() + row * d;
                        // each timed after a first call, so that both see
                        // the same (warm) caches whatever ran before
                        index->attend(1, q, out, nullptr);
                        a.attend_s += median_seconds(opt.timed_calls, [&] {
                            index->attend(1, q, out, nullptr);
                        });
                        kvindex::exact_attention(q, keys, values, d, d, p + 1, exact.data());
                        a.dense_s += median_seconds(opt.timed_calls, [&] {
                            kvindex::exact_attention(q, keys, values, d, d, p + 1, exact.data());
                        });

                        double num = 0, den = 0;
                        for (int c = 0; c < d; c++) {
                            num += double(out[c] - exact[c]) * (out[c] - exact[c]);
                            den += double(exact[c]) * exact[c];
                        }
                        a.rel_err.push_back(std::sqrt(num / std::max(den, 1e-300)));

                        // exact attention weights over [0, p], for mass and recall
                        kvindex::inner_products_scaled(
                                q, keys, d, p + 1, 1.0f / std::sqrt(float(d)), scores.data());
                        std::vector<float> w(scores.begin(), scores.begin() + p + 1);
                        kvindex::softmax_inplace(w.data(), nullptr, p + 1);
                        kvindex::Selection sel;
                        index->select(1, q, &sel, &count);
                        double mass = 0;
                        for (idx_t id : sel.ids) {
                            mass += w[id];
                        }
                        a.mass += mass;
                        a.selected += double(sel.size()) / (p + 1);
                        a.mass_row.push_back(mass);
                        a.selected_row.push_back(double(sel.size()) / (p + 1));
                        a.touched += sel.tokens_read() / double(p + 1);
                        if (top_k > 0) {
                            idx_t k = std::min<idx_t>(top_k, p + 1);
                            std::vector<idx_t> ids(k), truth(p + 1);
                            std::vector<float> dis(k);
                            index->search(1, q, k, dis.data(), ids.data());
                            std::iota(truth.begin(), truth.end(), 0);
                            std::partial_sort(truth.begin(), truth.begin() + k, truth.end(),
                                              [&](idx_t x, idx_t y) { return scores[x] > scores[y]; });
                            std::sort(truth.begin(), truth.begin() + k);
                            idx_t hits = 0;
                            for (idx_t id : ids) {
                                hits += std::binary_search(truth.begin(), truth.begin() + k, id);
                            }
                            a.recall += double(hits) / k;
                            a.n_recall++;
                        }
                        a.n++;
                    }
                }
                bytes_sum[ix] += double(index->memory_bytes()) / index->ntotal;
            }
        }
    }
    for (size_t ix = 0; ix < opt.indexes.size(); ix++) {
        IndexResult& r = res.results[ix];
        const Accumulator& a = acc[ix];
        r.index = opt.indexes[ix];
        r.params = taken_params[ix];
        r.n_queries = a.n;
        double nq = std::max<idx_t>(a.n, 1);
        r.rel_err_mean = std::accumulate(a.rel_err.begin(), a.rel_err.end(), 0.0) / nq;
        r.rel_err_p95 = p95(a.rel_err);
        r.mass_mean = a.mass / nq;
        if (a.n_recall > 0) {
            r.recall_at_k = a.recall / a.n_recall;
        }
        r.selected_frac = a.selected / nq;
        r.touched_frac = a.touched / nq;
        r.us_per_query = 1e6 * a.attend_s / nq;
        r.dense_us_per_query = 1e6 * a.dense_s / nq;
        r.speedup_vs_dense = a.attend_s > 0 ? a.dense_s / a.attend_s : 0;
        r.bytes_per_token = bytes_sum[ix] / std::max(n_heads_built, 1);
        for (int l : layers) {
            IndexResult::Layer f;
            f.layer = l;
            idx_t count = 0;
            for (size_t row = 0; row < res.rows.size(); row++) {
                if (res.rows[row][0] == l) {
                    f.rel_err_mean += a.rel_err[row];
                    f.mass_mean += a.mass_row[row];
                    f.selected_frac += a.selected_row[row];
                    count++;
                }
            }
            double c = std::max<idx_t>(count, 1);
            f.rel_err_mean /= c;
            f.mass_mean /= c;
            f.selected_frac /= c;
            r.per_layer.push_back(f);
        }
    }
    return res;
}

void print_table(const RunResult& res) {
    std::printf("trace: %s\nmachine: %s\n", res.trace.c_str(), res.machine.c_str());
    std::printf("timing: median of %d call%s per query (after a warm-up call)\n", res.timed_calls,
                res.timed_calls == 1 ? "" : "s");
    // the index column as wide as the longest string, so the columns align
    int w = 36;
    for (const auto& r : res.results) {
        w = std::max(w, int(r.index.size()));
    }
    std::printf("%-*s %6s %9s %9s %7s %7s %8s %8s %9s %9s %8s %8s %9s\n", w, "index", "n",
                "rel_err", "err_p95", "mass", "recall", "selected", "touched", "us/query",
                "dense_us", "speedup", "build_s", "bytes/tok");
    for (const auto& r : res.results) {
        char recall[16] = "-";
        if (r.recall_at_k) {
            std::snprintf(recall, sizeof(recall), "%.3f", *r.recall_at_k);
        }
        std::printf("%-*s %6zd %9.2e %9.2e %7.4f %7s %7.2f%% %7.2f%% %9.1f %9.1f %8.2f %8.2f %9.0f\n",
                    w, r.index.c_str(), size_t(r.n_queries), r.rel_err_mean, r.rel_err_p95,
                    r.mass_mean, recall, 100 * r.selected_frac, 100 * r.touched_frac,
                    r.us_per_query, r.dense_us_per_query, r.speedup_vs_dense, r.build_s,
                    r.bytes_per_token);
    }
    if (!res.results.empty() && res.results[0].per_layer.size() > 1) {
        // per layer: flat and sparse heads behave differently
        std::printf("\nrel_err (selected) by layer\n%-*s", w, "index");
        for (const auto& f : res.results[0].per_layer) {
            std::printf(" %16s", ("layer " + std::to_string(f.layer)).c_str());
        }
        std::printf("\n");
        for (const auto& r : res.results) {
            std::printf("%-*s", w, r.index.c_str());
            for (const auto& f : r.per_layer) {
                std::printf("  %.3f (%5.2f%%)", f.rel_err_mean, 100 * f.selected_frac);
            }
            std::printf("\n");
        }
    }
    for (const auto& r : res.results) {
        // -1 is "not set by this prefill" (no calibration, no choice)
        if (std::all_of(r.reported.begin(), r.reported.end(),
                        [](const IndexResult::Reported& x) { return x.value == -1; })) {
            continue;
        }
        std::printf("\n%s, per (layer, KV head):", r.index.c_str());
        for (const auto& x : r.reported) {
            std::printf(" L%d/h%d %s=%g", x.layer, x.kv_head, x.name.c_str(), x.value);
        }
        std::printf("\n");
    }
}

void write_json(const RunResult& res, const std::string& path) {
    nlohmann::json j;
    j["trace"] = res.trace;
    j["machine"] = res.machine;
    j["n_tokens"] = res.n_tokens;
    j["trained"] = res.trained;
    j["timed_calls"] = res.timed_calls;
    j["results"] = nlohmann::json::array();
    for (const auto& r : res.results) {
        nlohmann::json x;
        x["index"] = r.index;
        x["params"] = r.params;
        x["n_queries"] = r.n_queries;
        x["rel_err_mean"] = r.rel_err_mean;
        x["rel_err_p95"] = r.rel_err_p95;
        x["mass_mean"] = r.mass_mean;
        x["recall_at_k"] = r.recall_at_k ? nlohmann::json(*r.recall_at_k) : nlohmann::json(nullptr);
        x["selected_frac"] = r.selected_frac;
        x["touched_frac"] = r.touched_frac;
        x["us_per_query"] = r.us_per_query;
        x["dense_us_per_query"] = r.dense_us_per_query;
        x["speedup_vs_dense"] = r.speedup_vs_dense;
        x["build_s"] = r.build_s;
        x["bytes_per_token"] = r.bytes_per_token;
        x["per_layer"] = nlohmann::json::array();
        for (const auto& f : r.per_layer) {
            x["per_layer"].push_back({{"layer", f.layer}, {"rel_err_mean", f.rel_err_mean},
                                      {"mass_mean", f.mass_mean}, {"selected_frac", f.selected_frac}});
        }
        x["reported"] = nlohmann::json::array();
        for (const auto& rep : r.reported) {
            x["reported"].push_back({{"layer", rep.layer}, {"kv_head", rep.kv_head},
                                     {"name", rep.name}, {"value", rep.value}});
        }
        j["results"].push_back(x);
    }
    kvindex::write_file(path, j.dump(2) + "\n", "kvbench"); // whole or not at all
}

void write_dump(const RunResult& res, const std::string& dir) {
    std::filesystem::create_directories(dir);
    std::vector<int64_t> rows;
    for (const auto& r : res.rows) {
        rows.insert(rows.end(), r.begin(), r.end());
    }
    kvindex::write_npy(dir + "/rows.npy", "<i8", {res.rows.size(), 3}, rows.data());
    for (size_t i = 0; i < res.results.size(); i++) {
        kvindex::write_npy(dir + "/" + std::to_string(i) + ".npy", "<f4",
                           {res.rows.size(), size_t(res.head_dim)}, res.results[i].outputs.data());
    }
}

} // namespace kvbench
