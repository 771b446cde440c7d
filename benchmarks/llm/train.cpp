#include "train.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <fstream>
#include <memory>
#include <stdexcept>

#include <omp.h>

#include <nlohmann/json.hpp>

#include <kvindex/IVFAsymTrainer.h>
#include <kvindex/IndexIVFAsym.h>
#include <kvindex/KVCache.h>
#include <kvindex/blas_threads.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>

#include "eval.h"
#include "ruler.h"

namespace kvllm {

namespace {

using Clock = std::chrono::steady_clock;

/// for (i in [0, n)) f(i) over OpenMP threads; the first exception is
/// rethrown after the loop (an exception must not leave a parallel region)
template <class F>
void parallel_for_each(int64_t n, F&& f) {
    std::exception_ptr error;
#pragma omp parallel for schedule(dynamic)
    for (int64_t i = 0; i < n; i++) {
        try {
            f(i);
        } catch (...) {
#pragma omp critical(kvllm_train_error)
            if (!error) {
                error = std::current_exception();
            }
        }
    }
    if (error) {
        std::rethrow_exception(error);
    }
}

/// The held-out loss of the model kept: the curve's lowest
/// (QModelTrainParams::keep_best), NaN if none was measured.
double final_held_out(const kvindex::IVFAsymTrainingReport& r) {
    double best = std::nan("");
    for (const kvindex::QModelLossPoint& p : r.curve) {
        if (!std::isnan(p.held_out_loss) && (std::isnan(best) || p.held_out_loss < best)) {
            best = p.held_out_loss;
        }
    }
    return best;
}

/// What the trainers of every head share, from the index string and the options.
kvindex::IVFAsymTrainingParams training_params(int head_dim, const TrainConfig& cfg) {
    std::unique_ptr<kvindex::KVIndex> probe = kvindex::index_factory(head_dim, cfg.index);
    const kvindex::IndexIVFAsym* asym = kvindex::ivf_asym_in_chain(probe.get());
    if (!asym) {
        throw std::invalid_argument("--index '" + cfg.index +
                                    "' has no IVFAsym in its chain: nothing to train "
                                    "(e.g. \"Sink1,Window511,IVFAsym64\")");
    }
    kvindex::IVFAsymTrainingParams p;
    p.n_centroids = asym->n_centroids;
    p.hidden = cfg.hidden != kTrainDefault ? cfg.hidden : asym->hidden;
    p.min_distance = cfg.min_distance;
    if (cfg.queries_per_prompt != kTrainDefault) {
        p.queries_per_prompt = cfg.queries_per_prompt;
    }
    if (cfg.iterations != kTrainDefault) {
        p.adam.iterations = cfg.iterations;
    } else if (asym->train_iterations > 0) {
        p.adam.iterations = asym->train_iterations;
    }
    return p;
}

} // namespace

void check_train_config(const TrainConfig& cfg, int64_t n_ctx_train) {
    if (cfg.context > n_ctx_train) {
        throw std::invalid_argument("--context " + std::to_string(cfg.context) + " exceeds the model's " +
                                    std::to_string(n_ctx_train) + " tokens");
    }
    // a query at position p is long range when p - min_distance > n_sink (1)
    if (cfg.min_distance < 0 || cfg.context <= cfg.min_distance + 2) {
        throw std::invalid_argument("--context " + std::to_string(cfg.context) + " with --min-distance " +
                                    std::to_string(cfg.min_distance) +
                                    ": no query of a prompt would be long range (need context > min "
                                    "distance + 2)");
    }
    if (cfg.max_tokens < 0) {
        throw std::invalid_argument("--max-tokens " + std::to_string(cfg.max_tokens) + " must be >= 0 (0: all)");
    }
    // the others were taken as "the default" for any value <= 0
    const std::pair<const char*, int64_t> counts[] = {
            {"--iterations", cfg.iterations}, {"--hidden", cfg.hidden}, {"--queries-per-prompt", cfg.queries_per_prompt}};
    for (const auto& [name, v] : counts) {
        if (v < 1 && v != kTrainDefault) {
            throw std::invalid_argument(std::string(name) + " " + std::to_string(v) + " must be >= 1 (" +
                                        std::to_string(kTrainDefault) + ": the default)");
        }
    }
    if (cfg.out.empty()) {
        throw std::invalid_argument("--out is required");
    }
}

std::vector<TrainChunk> training_chunks(
        const std::vector<TrainDocument>& documents, int64_t context, int64_t max_tokens) {
    if (context < 2) {
        throw std::invalid_argument("--context " + std::to_string(context) + ": need at least 2 tokens");
    }
    const int64_t min_len = (context + 1) / 2;
    std::vector<TrainChunk> chunks;
    int64_t left = max_tokens > 0 ? max_tokens : INT64_MAX;
    for (size_t doc = 0; doc < documents.size() && left >= min_len; doc++) {
        if (documents[doc].query_tokens > 0) {
            continue;
        }
        const int64_t n = int64_t(documents[doc].ids.size());
        for (int64_t b = 0; b < n && left >= min_len; b += context) {
            int64_t len = std::min({context, n - b, left});
            if (len < min_len) {
                break; // the document's remnant (or the budget's) is too short
            }
            chunks.push_back({doc, b, len});
            left -= len;
        }
    }
    for (size_t doc = 0; doc < documents.size(); doc++) {
        const TrainDocument& t = documents[doc];
        const int64_t n = int64_t(t.ids.size());
        if (t.query_tokens <= 0) {
            continue;
        }
        if (n > context || t.query_tokens > n) {
            throw std::invalid_argument("task prompt " + t.name + ": " + std::to_string(n) + " tokens (" +
                                        std::to_string(t.query_tokens) + " queried) does not fit --context " +
                                        std::to_string(context));
        }
        chunks.push_back({doc, 0, n});
    }
    return chunks;
}

std::vector<TrainDocument> task_training_prompts(
        const BpeTokenizer& tok,
        const std::vector<std::string>& haystack,
        const std::vector<std::string>& tasks,
        int n,
        int64_t context,
        uint64_t seed) {
    if (n > 0 && tasks.empty()) {
        throw std::invalid_argument("--task-prompts: no task given");
    }
    for (const std::string& t : tasks) {
        if (t == "passkey") {
            throw std::invalid_argument("--task-tasks: passkey is an evaluation task, never trained on");
        }
    }
    const TokenCounter count = token_counter(tok);
    std::vector<TrainDocument> out;
    for (int i = 0; i < n; i++) {
        const std::string& task = tasks[size_t(i) % tasks.size()];
        // room for the answer: the longest expected lists are a few numbers
        const RulerSample s = make_ruler_sample(task, context - 64, seed, i, haystack, count);
        std::string answer;
        for (const std::string& e : s.expected) {
            answer += (answer.empty() ? " " : ", ") + e;
        }
        TrainDocument d{task + "#" + std::to_string(i), encode_pieces(tok, s.prompt)};
        const int64_t question = int64_t(d.ids.size()) - s.prompt.question_start();
        const std::vector<int> a = tok.encode(answer + ".", false);
        d.ids.insert(d.ids.end(), a.begin(), a.end());
        d.query_tokens = question + int64_t(a.size());
        if (int64_t(d.ids.size()) > context) {
            throw std::invalid_argument("task prompt " + d.name + " with its answer exceeds --context " +
                                        std::to_string(context));
        }
        out.push_back(std::move(d));
    }
    return out;
}

void run_train(
        const LlamaModel& llm,
        const std::vector<TrainDocument>& documents,
        const TrainConfig& cfg,
        std::ostream& out) {
    const LlamaConfig& mc = llm.cfg;
    const int L = mc.n_layers, KVH = mc.n_kv_heads, hd = mc.head_dim, g = mc.n_heads / mc.n_kv_heads;
    const int64_t n_heads = int64_t(L) * KVH;
    check_train_config(cfg, mc.n_ctx_train);
    const kvindex::IVFAsymTrainingParams base = training_params(hd, cfg);
    const std::string factory = kvindex::parse_index_spec(cfg.index).factory;
    std::vector<TrainChunk> chunks = training_chunks(documents, cfg.context, cfg.max_tokens);
    if (chunks.empty()) {
        throw std::invalid_argument("no training prompt: every document is shorter than --context / 2 = " +
                                    std::to_string((cfg.context + 1) / 2) + " tokens");
    }
    int64_t total_tokens = 0;
    for (const TrainChunk& c : chunks) {
        total_tokens += c.n_tokens;
    }
    std::fprintf(stderr,
                 "kvllm train: %s, C=%d hidden=%d, %zu prompts of <= %lld tokens (%lld tokens), "
                 "%lld heads, %d threads\n",
                 factory.c_str(), base.n_centroids, base.hidden, chunks.size(), (long long)cfg.context,
                 (long long)total_tokens, (long long)n_heads, omp_get_max_threads());

    // the trainers are single-threaded: they run in parallel, BLAS at one
    // thread inside each (DESIGN.md §5: BLAS threads would fight OpenMP's)
    kvindex::ScopedBlasThreads one_blas_thread(1);
    std::vector<std::unique_ptr<kvindex::IVFAsymTrainer>> trainers;
    for (int64_t s = 0; s < n_heads; s++) {
        kvindex::IVFAsymTrainingParams p = base;
        p.seed = cfg.seed + uint64_t(s);
        p.adam.seed = cfg.seed + uint64_t(s);
        trainers.push_back(std::make_unique<kvindex::IVFAsymTrainer>(hd, p));
    }

    const auto t_start = Clock::now();
    double prefill_s = 0, add_s = 0;
    for (size_t ci = 0; ci < chunks.size(); ci++) {
        const TrainChunk& c = chunks[ci];
        const int64_t n = c.n_tokens;
        PrefillRecord rec;
        auto t0 = Clock::now();
        llm.prefill(documents[c.document].ids.data() + c.begin, n, nullptr, 0, &rec, 0);
        double p_s = seconds_since(t0);
        t0 = Clock::now();
        const int64_t nq = documents[c.document].query_tokens > 0 ? documents[c.document].query_tokens : n;
        parallel_for_each(n_heads, [&](int64_t s) {
            const int l = int(s / KVH), h = int(s % KVH);
            kvindex::PrefillInput in;
            in.n_tokens = n;
            in.keys = rec.keys[l].data() + size_t(h) * n * hd;
            in.values = rec.values[l].data() + size_t(h) * n * hd;
            in.n_queries = nq;
            in.n_query_heads = g;
            // the query heads of KV head h are g consecutive heads, each
            // of n rows; a task prompt's are its last nq rows of each
            const float* heads = rec.queries[l].data() + size_t(h) * g * n * hd;
            std::vector<float> last;
            if (nq < n) {
                last.resize(size_t(g) * nq * hd);
                for (int j = 0; j < g; j++) {
                    std::copy_n(heads + (size_t(j) * n + (n - nq)) * hd, size_t(nq) * hd,
                                last.data() + size_t(j) * nq * hd);
                }
            }
            in.queries = nq < n ? last.data() : heads;
            in.query_positions = nullptr; // the last n_queries tokens
            in.first_position = 0;
            in.rope = mc.rope;
            trainers[s]->add_prompt(in);
        });
        double a_s = seconds_since(t0);
        prefill_s += p_s;
        add_s += a_s;
        std::fprintf(stderr, "  prompt %zu/%zu: %s tokens [%lld, %lld): prefill %.1f s, add_prompt %.1f s\n",
                     ci + 1, chunks.size(), documents[c.document].name.c_str(), (long long)c.begin,
                     (long long)(c.begin + n), p_s, a_s);
    }

    const auto t_train = Clock::now();
    parallel_for_each(n_heads, [&](int64_t s) {
        kvindex::IVFAsymTrainer& t = *trainers[s];
        const kvindex::IVFAsymTrainingReport& r = t.train();
        char loss[96] = "no Q-model: too few long-range rows";
        if (t.qmodel_trained()) {
            std::snprintf(loss, sizeof(loss), "held-out KL %.4f -> %.4f", r.initial_held_out_loss,
                          final_held_out(r));
        }
        std::fprintf(stderr,
                     "  layer %2lld head %d: %lld rows, %s (k-means %.1f s, targets %.1f s, Q-model "
                     "%.1f s; %.0f s elapsed)\n",
                     (long long)(s / KVH), int(s % KVH), (long long)r.n_train, loss, r.kmeans_seconds,
                     r.targets_seconds, r.qmodel_seconds, seconds_since(t_train));
    });
    const double train_s = seconds_since(t_train);

    // an empty cache holding the models; its indexes adopt them at prefill
    kvindex::KVCache cache(L, mc.n_heads, KVH, hd, hd, factory);
    for (int64_t s = 0; s < n_heads; s++) {
        const kvindex::IVFAsymTrainer& t = *trainers[s];
        kvindex::ivf_asym_in_chain(cache.index(int(s / KVH), int(s % KVH)))
                ->set_trained(t.centroids, t.qmodel, t.rope);
    }
    kvindex::write_cache(cache, cfg.out);
    const double total_s = seconds_since(t_start);

    char line[256];
    std::snprintf(line, sizeof(line), "%5s %4s %7s %7s %13s %13s\n", "layer", "head", "rows", "held",
                  "initial_KL", "final_KL");
    out << line;
    nlohmann::json heads = nlohmann::json::array();
    double sum_init = 0, sum_final = 0;
    int n_final = 0;
    for (int64_t s = 0; s < n_heads; s++) {
        const kvindex::IVFAsymTrainer& t = *trainers[s];
        const kvindex::IVFAsymTrainingReport& r = t.report;
        const double fin = final_held_out(r);
        if (t.qmodel_trained()) {
            std::snprintf(line, sizeof(line), "%5lld %4d %7lld %7lld %13.4f %13.4f\n", (long long)(s / KVH),
                          int(s % KVH), (long long)r.n_train, (long long)r.n_held, r.initial_held_out_loss, fin);
        } else { // centroid probing at inference
            std::snprintf(line, sizeof(line), "%5lld %4d %7lld %7lld %13s %13s\n", (long long)(s / KVH),
                          int(s % KVH), (long long)r.n_train, (long long)r.n_held, "-", "no Q-model");
        }
        out << line;
        if (t.qmodel_trained() && std::isfinite(fin)) {
            sum_init += r.initial_held_out_loss;
            sum_final += fin;
            n_final++;
        }
        nlohmann::json curve = nlohmann::json::array();
        for (const kvindex::QModelLossPoint& p : r.curve) {
            // NaN (no held-out rows) is written as null
            curve.push_back({{"iteration", p.iteration}, {"train", p.train_loss}, {"held_out", p.held_out_loss}});
        }
        heads.push_back({{"layer", s / KVH}, {"head", s % KVH}, {"n_prompts", r.n_prompts},
                         {"n_keys", r.n_keys}, {"n_candidates", r.n_candidates},
                         {"n_long_range", r.n_long_range}, {"n_train", r.n_train}, {"n_held", r.n_held},
                         {"kmeans_seconds", r.kmeans_seconds}, {"targets_seconds", r.targets_seconds},
                         {"qmodel_seconds", r.qmodel_seconds}, {"qmodel_trained", t.qmodel_trained()},
                         {"initial_held_out_loss", r.initial_held_out_loss},
                         {"final_held_out_loss", fin}, {"curve", curve}});
    }
    if (n_final > 0) {
        std::snprintf(line, sizeof(line), "%-27s %13.4f %13.4f  (%d heads with a Q-model)\n",
                      "mean over heads", sum_init / n_final, sum_final / n_final, n_final);
        out << line;
    }
    std::snprintf(line, sizeof(line),
                  "wrote %s: %zu prompts, %lld tokens; prefill %.1f s, add_prompt %.1f s, training %.1f s, "
                  "total %.1f s\n",
                  cfg.out.c_str(), chunks.size(), (long long)total_tokens, prefill_s, add_s, train_s, total_s);
    out << line;

    if (!cfg.report_json.empty()) {
        nlohmann::json files = nlohmann::json::array();
        for (const TrainDocument& d : documents) {
            files.push_back({{"name", d.name}, {"tokens", d.ids.size()}});
        }
        nlohmann::json j = {
                {"index", cfg.index}, {"factory", factory}, {"n_centroids", base.n_centroids},
                {"hidden", base.hidden}, {"iterations", base.adam.iterations},
                {"min_distance", base.min_distance}, {"queries_per_prompt", base.queries_per_prompt},
                {"seed", cfg.seed}, {"context", cfg.context}, {"max_tokens", cfg.max_tokens},
                {"files", files}, {"n_prompts", chunks.size()}, {"tokens", total_tokens},
                {"threads", omp_get_max_threads()}, {"prefill_seconds", prefill_s},
                {"add_prompt_seconds", add_s}, {"train_seconds", train_s}, {"total_seconds", total_s},
                {"out", cfg.out}, {"heads", heads}};
        write_json(cfg.report_json, j);
    }
}

} // namespace kvllm
