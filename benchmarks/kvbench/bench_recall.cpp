// Recall vs keys touched: each retriever built from the prompt (prefill with
// the prompt's queries, as a decode loop would), then a sweep of its search
// knob, on the scaling benchmarks' synthetic head (mixed preset, d = 128).
//
//   ./build/benchmarks/bench_recall [--tokens 131072] [--queries 30] [--json FILE] [--overlap] [--walk-floor]
//       [--append 4096 [--learn] [--eval-next]]
//       [--index "RoarGraph32@efSearch=100,200,400" --index "TopK(HNSW16)@efSearch=..."]
//
// An index is STRING[@knob=v1,v2,...]: built once, then measured at each
// value of the knob. Per point: recall@100 of the exact top-100 (search),
// keys read per query (Selection::n_scanned, what the retrieval scored,
// plus the size of the selection: a sampler's keys are read by the
// estimator; a retriever's top-k, already scored, count twice, k/n more)
// as a fraction of the context, µs per attend (one query, one thread) and the
// speed-up over the dense kernel timed in the same run; per index: build
// seconds (prefill, all threads) and bytes per token.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include <kvindex/IndexRoarGraph.h>
#include <kvindex/attention.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>
#include <kvindex/kernels.h>
#include <kvindex/parameters.h>

#include "synthetic.h"
#include "blas_kernels.h"
#include "subcommand_options.h"

using namespace kvindex;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::vector<std::string> split(const std::string& s, char sep) {
    std::vector<std::string> out;
    std::stringstream ss(s);
    for (std::string item; std::getline(ss, item, sep);) {
        out.push_back(item);
    }
    return out;
}

/// Exact top-k ids (sorted by id) of q over the first n keys.
std::vector<idx_t> exact_topk_ids(const float* q, const float* keys, int d, idx_t n, int k) {
    std::vector<float> s(n);
    inner_products_scaled(q, keys, d, n, 1.0f, s.data());
    std::vector<idx_t> ids(n);
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                      [&](idx_t a, idx_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); });
    ids.resize(k);
    std::sort(ids.begin(), ids.end());
    return ids;
}

/** The first m tokens of a scaling head as prefill takes them, with the
 * queries of the group's heads copied head-major into `queries`. */
PrefillInput prompt_of(const TraceLayer& layer, size_t n_tokens, int64_t m, int group, int d,
                       std::vector<float>& queries) {
    queries.resize(size_t(group) * m * d);
    for (int h = 0; h < group; h++) {
        std::copy(layer.queries.begin() + size_t(h) * n_tokens * d,
                  layer.queries.begin() + (size_t(h) * n_tokens + m) * d,
                  queries.begin() + size_t(h) * m * d);
    }
    PrefillInput in;
    in.n_tokens = m;
    in.keys = layer.keys.data();
    in.values = layer.values.data();
    in.n_queries = m;
    in.n_query_heads = group;
    in.queries = queries.data();
    return in;
}

/** Decode-time appends: prefill n tokens, append n_append one at a time,
 * and at checkpoints measure recall@k of the evaluation queries over the
 * keys held, the share of the appended keys in their top-k that is found,
 * and the keys scanned; beside it, the same index prefilled with all
 * n + n_append tokens at once. learn: after each token, the group's
 * queries at its position go to add_queries, as a decode step's would.
 * eval_next: the evaluation queries of a checkpoint are those of the
 * n_queries positions after the tokens held (the next decode steps'),
 * instead of those after all n + n_append. */
void run_appends(const std::string& spec, int64_t n, int64_t n_append, int n_queries, int d, int k,
                 bool learn, bool eval_next) {
    const int group = 3;
    kvbench::ScalingHead head = kvbench::scaling_head(n + n_append, n_queries, d);
    const TraceLayer& layer = head.layer;
    size_t n_tokens = size_t(n + n_append) + n_queries;
    auto prefill = [&](KVIndex* index, int64_t m) {
        std::vector<float> queries;
        index->prefill(prompt_of(layer, n_tokens, m, group, d, queries));
    };
    auto measure = [&](const KVIndex* index, const char* what, int64_t appended, double seconds,
                       double learn_us) {
        idx_t held = index->ntotal;
        double recall = 0, scanned = 0;
        int64_t app_true = 0, app_found = 0;
        SearchParametersKV counting;
        counting.count_scanned = true;
        for (int i = 0; i < n_queries; i++) {
            // query heads in turn, as scaling_head takes them
            const float* q = eval_next
                    ? layer.queries.data() + (size_t(i % group) * n_tokens + size_t(held) + i) * d
                    : head.queries[i];
            std::vector<idx_t> truth = exact_topk_ids(q, layer.keys.data(), d, held, k);
            std::vector<float> dis(k);
            std::vector<idx_t> ids(k);
            index->search(1, q, k, dis.data(), ids.data());
            std::sort(ids.begin(), ids.end());
            for (idx_t id : truth) {
                bool hit = std::binary_search(ids.begin(), ids.end(), id);
                recall += hit;
                if (id >= n) {
                    app_true++;
                    app_found += hit;
                }
            }
            Selection sel;
            index->select(1, q, &sel, &counting);
            scanned += double(sel.n_scanned + sel.size());
        }
        std::printf("%-28s %-22s %9zd %9zd %8.3f %8.3f (%5zd) %8.2f%% %10.1f %10.1f\n", spec.c_str(),
                    what, size_t(held), size_t(appended), recall / (double(k) * n_queries),
                    app_true ? double(app_found) / app_true : 0.0, size_t(app_true),
                    100 * scanned / (double(held) * n_queries), seconds, learn_us);
        std::fflush(stdout);
    };
    // learn_us: add_queries' time per query learnt, since the last checkpoint
    std::printf("%-28s %-22s %9s %9s %8s %16s %9s %10s %10s\n", "index", "build", "keys",
                "appended", "recall", "appended_found", "read%", "seconds", "learn_us");
    auto index = index_factory(d, spec);
    auto t0 = Clock::now();
    prefill(index.get(), n);
    measure(index.get(), "prefill n", 0, seconds_since(t0), 0);
    int64_t done = 0;
    std::vector<float> step_queries(size_t(group) * d);
    for (int64_t stop : {n_append / 4, n_append / 2, n_append}) {
        auto ta = Clock::now();
        double learn_seconds = 0;
        int64_t from = done;
        for (; done < stop; done++) {
            index->add_kv(1, layer.keys.data() + (n + done) * d, layer.values.data() + (n + done) * d);
            if (learn) {
                for (int h = 0; h < group; h++) {
                    const float* q = layer.queries.data() + (size_t(h) * n_tokens + size_t(n + done)) * d;
                    std::copy(q, q + d, step_queries.begin() + size_t(h) * d);
                }
                auto tl = Clock::now();
                index->add_queries(group, step_queries.data());
                learn_seconds += seconds_since(tl);
            }
        }
        double learnt = double(done - from) * group;
        measure(index.get(), learn ? "then appended, learnt" : "then appended", done,
                seconds_since(ta), learnt > 0 && learn ? 1e6 * learn_seconds / learnt : 0);
    }
    auto whole = index_factory(d, spec);
    t0 = Clock::now();
    prefill(whole.get(), n + n_append);
    measure(whole.get(), "prefill n + appended", 0, seconds_since(t0), 0);
}

/** How alike the exact top-k of successive queries of each head kind are
 * (queries i and i + 3 are the same query head, three positions apart: the
 * query heads take turns), and how many of each top-k are among the last `recent` keys: why a
 * retriever that starts from what earlier queries found (seeds, anchors,
 * a window) helps one kind and not another. */
void print_overlap(const std::vector<std::vector<idx_t>>& truth, idx_t n, int k, idx_t recent) {
    const char* kinds[3] = {"needle", "local", "flat"};
    for (int c = 0; c < 3; c++) {
        double shared = 0, in_recent = 0;
        int pairs = 0, queries = 0;
        for (size_t i = size_t(c); i < truth.size(); i += 3, queries++) {
            for (idx_t id : truth[i]) {
                in_recent += id >= n - recent;
            }
            if (i + 3 < truth.size()) {
                for (idx_t id : truth[i]) {
                    shared += std::binary_search(truth[i + 3].begin(), truth[i + 3].end(), id);
                }
                pairs++;
            }
        }
        std::printf("%-6s heads: top-%d shared with the next query of the head %.1f, in the last %zd keys %.1f\n",
                    kinds[c], k, pairs ? shared / pairs : 0.0, size_t(recent), queries ? in_recent / queries : 0.0);
    }
}

/** The fewest keys a beam walk over g can score and still end holding the
 * exact top-k (`truth`, per query): a walk stops only once every member of
 * its final beam is expanded, and expanding a node scores each of its
 * neighbours not yet scored, so it has scored the top-k and the union of
 * their neighbour lists, whatever its seeds. Printed per head kind as a
 * fraction of the context, for the whole top-k (a bound) and for the
 * cheapest `keep` of them (a walk ending at recall keep/k), found greedily:
 * dropping, one at a time, the member whose list adds the most keys no
 * other member's list holds. Greedy may miss the cheapest subset, so that
 * second figure estimates the floor from above, and it leaves out the
 * lists of the other k - keep keys such a walk returns. */
void print_walk_floor(const IndexRoarGraph& g, const std::vector<std::vector<idx_t>>& truth,
                      idx_t n, int keep) {
    const char* kinds[3] = {"needle", "local", "flat"};
    double all[3] = {0, 0, 0}, part[3] = {0, 0, 0};
    int queries[3] = {0, 0, 0};
    std::vector<int> count(size_t(g.ntotal), 0); // members whose list (or self) holds a key
    for (size_t i = 0; i < truth.size(); i++) {
        std::vector<idx_t> members(truth[i].begin(), truth[i].end());
        auto covered = [&](idx_t v, int delta) {
            count[size_t(v)] += delta;
            const int32_t* nb = g.neighbors_of(v);
            for (int j = 0; j < g.degrees[size_t(v)]; j++) {
                count[size_t(nb[j])] += delta;
            }
        };
        for (idx_t v : members) {
            covered(v, 1);
        }
        auto union_size = [&]() {
            return std::count_if(count.begin(), count.end(), [](int c) { return c > 0; });
        };
        size_t c = i % 3;
        all[c] += double(union_size());
        while (int(members.size()) > keep) {
            // the member whose removal uncovers the most keys (a key stays
            // scored if another member is it or lists it)
            size_t best = 0;
            long best_gain = -1;
            for (size_t m = 0; m < members.size(); m++) {
                idx_t v = members[m];
                long gain = count[size_t(v)] == 1;
                const int32_t* nb = g.neighbors_of(v);
                for (int j = 0; j < g.degrees[size_t(v)]; j++) {
                    gain += count[size_t(nb[j])] == 1;
                }
                if (gain > best_gain) {
                    best_gain = gain;
                    best = m;
                }
            }
            covered(members[best], -1);
            members.erase(members.begin() + long(best));
        }
        part[c] += double(union_size());
        for (idx_t v : members) {
            covered(v, -1);
        }
        queries[c]++;
    }
    for (int c = 0; c < 3; c++) {
        std::printf("%-6s heads: a walk ending with the exact top-%zu scores >= %.2f%% of the keys; "
                    "with the cheapest %d of them (greedy) %.2f%%\n",
                    kinds[c], truth.empty() ? size_t(0) : truth[0].size(),
                    queries[c] ? 100 * all[c] / (double(n) * queries[c]) : 0.0, keep,
                    queries[c] ? 100 * part[c] / (double(n) * queries[c]) : 0.0);
    }
}

struct Point {
    std::string index, knob;
    double kind_recall[3] = {0, 0, 0}; ///< needle, local, flat query heads
    double kind_scanned[3] = {0, 0, 0}; ///< keys read by each kind, over the context
    double value = 0, recall = 0, scanned = 0, us = 0, speedup = 0, build_s = 0, bytes = 0;
};

} // namespace

int run_bench(int argc, char** argv) {
    kvtools::use_widest_blas_kernels(argv);
    int64_t n;
    int n_queries;
    std::vector<std::string> specs;
    std::string json;
    int64_t n_append;
    bool overlap = false, learn = false, eval_next = false, walk_floor = false;
    boost::program_options::options_description opts("bench_recall");
    opts.add_options()
            ("tokens", boost::program_options::value(&n)->default_value(131072), "context length")
            ("queries", boost::program_options::value(&n_queries)->default_value(30), "evaluation queries")
            ("index", boost::program_options::value(&specs), "STRING[@knob=v1,v2,...] (repeatable)")
            ("json", boost::program_options::value(&json), "write the points as JSON")
            ("append", boost::program_options::value(&n_append)->default_value(0),
             "instead: prefill, append this many tokens one by one, recall at checkpoints")
            ("learn", boost::program_options::bool_switch(&learn),
             "with --append: each appended token's queries go to add_queries after it")
            ("eval-next", boost::program_options::bool_switch(&eval_next),
             "with --append: a checkpoint's evaluation queries are the next positions' (default: "
             "those after all appended tokens)")
            ("overlap", boost::program_options::bool_switch(&overlap),
             "also print how alike successive queries' exact top-k are, per head kind")
            ("walk-floor", boost::program_options::bool_switch(&walk_floor),
             "for each RoarGraph: the fewest keys a beam walk over its graph scores to end "
             "with the exact top-k (or 95 of it), per head kind");
    boost::program_options::variables_map vm;
    if (!kvtools::parse_options(argc, argv, opts, vm)) {
        return 0;
    }
    const int d = 128, k = 100, group = 3;
    // the recall per head kind divides by its queries: one of each at least
    kvbench::check_scaling_options({n}, n_queries, 3, k);
    if (n_append < 0) {
        throw std::invalid_argument("--append " + std::to_string(n_append) + " must be >= 0");
    }
    // options of the other mode would be dropped without a word
    if (n_append > 0 && (!json.empty() || overlap || walk_floor)) {
        throw std::invalid_argument("--json, --overlap and --walk-floor do not apply with --append");
    }
    if (n_append == 0 && (learn || eval_next)) {
        throw std::invalid_argument("--learn and --eval-next apply only with --append");
    }
    long nlist = std::max(1L, long(std::ceil(n / 1000.0)));
    if (specs.empty()) {
        specs = {"RoarGraph32@efSearch=100,150,200,300,500",
                 "TopK(HNSW16)@efSearch=100,200,400,800,1600",
                 "TopK(IVF" + std::to_string(nlist) + ",Flat)@nprobe=4,8,16,32,64",
                 "LSHSample10x150", "LSHSample8x75"};
    }
    if (n_append > 0) {
        for (const std::string& spec : specs) {
            run_appends(spec, n, n_append, n_queries, d, k, learn, eval_next);
        }
        return 0;
    }
    kvbench::ScalingHead head = kvbench::scaling_head(n, n_queries, d);
    const TraceLayer& layer = head.layer;
    size_t n_tokens = size_t(n) + n_queries;
    std::vector<float> prompt_queries;
    PrefillInput in = prompt_of(layer, n_tokens, n, group, d, prompt_queries);
    // exact reference: top-100 and dense timing
    std::vector<std::vector<idx_t>> truth(n_queries);
    std::vector<float> out(d);
    double dense_s = 0;
    for (int i = 0; i < n_queries; i++) {
        auto t0 = Clock::now();
        exact_attention(head.queries[i], layer.keys.data(), layer.values.data(), d, d, n, out.data());
        dense_s += seconds_since(t0);
        truth[i] = exact_topk_ids(head.queries[i], layer.keys.data(), d, n, k);
    }
    double dense_us = 1e6 * dense_s / n_queries;
    std::printf("tokens %zd, %d queries, dense %.1f us/query\n", size_t(n), n_queries, dense_us);
    if (overlap) {
        print_overlap(truth, n, k, 512);
    }
    std::printf("%-28s %-14s %8s %20s %9s %20s %10s %9s %8s %10s\n", "index", "knob", "recall",
                "needle/local/flat", "read%", "read% n/l/f", "us/query", "speedup", "build_s", "bytes/tok");
    std::vector<Point> points;
    for (const std::string& spec : specs) {
        size_t at = spec.find('@');
        // "STRING[|params][@knob=v1,v2,...]": params set before prefill
        IndexSpec parsed = parse_index_spec(spec.substr(0, at));
        std::string factory = parsed.factory;
        std::string knob;
        std::vector<std::string> values = {""};
        if (at != std::string::npos) {
            std::string sweep = spec.substr(at + 1);
            size_t eq = sweep.find('=');
            if (eq == std::string::npos || eq == 0 || eq + 1 == sweep.size()) {
                throw std::invalid_argument(
                        "bad sweep '@" + sweep + "' in '" + spec + "' (expected @knob=v1,v2,...)");
            }
            knob = sweep.substr(0, eq);
            values = split(sweep.substr(eq + 1), ',');
        }
        auto index = index_factory(d, factory);
        // budgets in percent ("k=2%") are of the prompt, as in every tool
        if (!parsed.params.empty()) {
            set_index_parameters(index.get(), resolve_percentages(parsed.params, in.n_tokens, index.get()));
        }
        auto tb = Clock::now();
        index->prefill(in);
        double build_s = seconds_since(tb);
        if (walk_floor) {
            if (auto g = dynamic_cast<const IndexRoarGraph*>(index.get())) {
                std::printf("%s:\n", parsed.str().c_str());
                print_walk_floor(*g, truth, n, k * 95 / 100);
            }
        }
        for (const std::string& v : values) {
            if (!knob.empty()) {
                set_index_parameters(index.get(), resolve_percentages(knob + "=" + v, in.n_tokens, index.get()));
            }
            SearchParametersKV counting;
            counting.count_scanned = true;
            double attend_s = 0, recall = 0;
            double kind_recall[3] = {0, 0, 0}; // queries take needle, local, flat in turn
            double kind_scanned[3] = {0, 0, 0};
            for (int i = 0; i < n_queries; i++) {
                auto t0 = Clock::now();
                index->attend(1, head.queries[i], out.data(), nullptr);
                attend_s += seconds_since(t0);
                std::vector<float> dis(k);
                std::vector<idx_t> ids(k);
                index->search(1, head.queries[i], k, dis.data(), ids.data());
                for (idx_t id : ids) {
                    bool hit = std::binary_search(truth[i].begin(), truth[i].end(), id);
                    recall += hit;
                    kind_recall[i % 3] += hit;
                }
                Selection sel;
                index->select(1, head.queries[i], &sel, &counting);
                // keys read: the retrieval's, plus the selection's that it
                // did not score (a sampler's keys; counted once for the others)
                kind_scanned[i % 3] += double(sel.n_scanned + sel.size());
            }
            Point p;
            p.index = parsed.str();
            p.knob = knob.empty() ? "" : knob + "=" + v;
            p.value = knob.empty() ? 0 : std::stod(v);
            p.recall = recall / (double(k) * n_queries);
            for (int c = 0; c < 3; c++) {
                p.kind_recall[c] = kind_recall[c] / (double(k) * ((n_queries + 2 - c) / 3));
                p.kind_scanned[c] = kind_scanned[c] / (double(n) * ((n_queries + 2 - c) / 3));
            }
            p.scanned = (kind_scanned[0] + kind_scanned[1] + kind_scanned[2]) / (double(n) * n_queries);
            p.us = 1e6 * attend_s / n_queries;
            p.speedup = dense_us / p.us;
            p.build_s = build_s;
            p.bytes = double(index->memory_bytes()) / n;
            points.push_back(p);
            std::printf("%-28s %-14s %8.3f %6.3f/%6.3f/%6.3f %8.2f%% %6.2f/%6.2f/%6.2f %10.1f %9.2f %8.2f %10.0f\n",
                        p.index.c_str(), p.knob.c_str(), p.recall, p.kind_recall[0],
                        p.kind_recall[1], p.kind_recall[2], 100 * p.scanned, 100 * p.kind_scanned[0],
                        100 * p.kind_scanned[1], 100 * p.kind_scanned[2], p.us, p.speedup, build_s, p.bytes);
            std::fflush(stdout);
        }
    }
    if (!json.empty()) {
        std::ostringstream f;
        f << "{\"tokens\": " << n << ", \"queries\": " << n_queries << ", \"dense_us\": " << dense_us
          << ", \"points\": [\n";
        for (size_t i = 0; i < points.size(); i++) {
            const Point& p = points[i];
            f << "  {\"index\": \"" << p.index << "\", \"knob\": \"" << p.knob
              << "\", \"recall\": " << p.recall << ", \"recall_needle\": " << p.kind_recall[0]
              << ", \"recall_local\": " << p.kind_recall[1]
              << ", \"recall_flat\": " << p.kind_recall[2] << ", \"scanned\": " << p.scanned
              << ", \"scanned_needle\": " << p.kind_scanned[0] << ", \"scanned_local\": " << p.kind_scanned[1]
              << ", \"scanned_flat\": " << p.kind_scanned[2]
              << ", \"us\": " << p.us << ", \"speedup\": " << p.speedup
              << ", \"build_s\": " << p.build_s << ", \"bytes_per_token\": " << p.bytes << "}"
              << (i + 1 < points.size() ? ",\n" : "\n");
        }
        f << "]}\n";
        kvindex::write_file(json, f.str(), "bench_recall"); // whole or not at all
    }
    return 0;
}

int main(int argc, char** argv) {
    return kvtools::run_tool("bench_recall", [&] { return run_bench(argc, argv); });
}
