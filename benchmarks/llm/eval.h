#pragma once

// What kvllm measures: generation, trace capture, teacher-forced fidelity
// (e2e) and passkey retrieval (needle) of any index string against the
// model's own dense attention.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include <kvindex/parameters.h>

#include "llama_model.h"
#include "tokenizer.h"

#ifdef KVINDEX_WITH_GPU
#include <kvindex/gpu/GpuKVCache.h>
#endif

namespace kvllm {

/// seconds from t0 to now, on the steady clock
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/** Whether two generations give the same answer: the shorter one (its stop
 * token aside) is where the longer one starts, so that a decode that
 * stops right after the answer agrees with one that keeps going. */
bool same_answer(const std::vector<int>& a, const std::vector<int>& b, const BpeTokenizer& tok);

/// Token ids of a prompt, wrapped in the model's chat template if chat.
std::vector<int> encode_prompt(const BpeTokenizer& tok, const std::string& prompt, bool chat);

struct GenerationResult {
    std::vector<int> tokens;   ///< generated ids (stop token included)
    std::string text;          ///< their text
    double prefill_tokens_per_s = 0;
    double decode_tokens_per_s = 0;
};

/** Calls f(cache) with `cpu`, or with its GPU twin (GpuKVCache::from_cpu:
 * every KV head of a layer in one launch) when `gpu` is set; a build
 * without the GPU types refuses `gpu` by name. */
template <class F>
void with_decode_cache(kvindex::KVCache& cpu, bool gpu, F&& f) {
    if (!gpu) {
        f(cpu);
        return;
    }
#ifdef KVINDEX_WITH_GPU
    std::unique_ptr<kvindex::GpuKVCache> twin = kvindex::GpuKVCache::from_cpu(cpu);
    f(*twin);
#else
    throw std::invalid_argument(
            "--gpu: this build has no GPU types (configure with KVINDEX_ENABLE_GPU=ON "
            "and a CUDA toolkit)");
#endif
}

/// Dense prefill of prompt[0, n-1), then greedy decode of up to max_new
/// (>= 1) tokens through a KVCache (its GPU twin when `gpu`: with_decode_cache).
GenerationResult generate_text(
        const LlamaModel& llm,
        const BpeTokenizer& tok,
        const std::vector<int>& prompt,
        int max_new,
        const std::string& index_string,
        const std::string& dense_string,
        bool gpu = false);

struct TraceSummary {
    int64_t n_tokens = 0;
    int64_t n_ctx = 0;
    std::vector<int> layers;
    double prefill_seconds = 0;
};

/// write_model_trace's n_ctx for n_tokens - 64 (at least 1).
constexpr int64_t kDefaultTraceNctx = -1;

/** Writes the kvbench trace of the model reading ids[0, n_tokens) with
 * its first n_ctx tokens as the prefill (in [1, n_tokens], or
 * kDefaultTraceNctx): meta.json
 * with the model's shape, rope_theta and rope_style, and layer_<l>/ for
 * each requested layer (all if empty). meta.n_layers is the model's, so
 * layer numbers keep their meaning; replay a subset with kvbench --layers. */
TraceSummary write_model_trace(
        const LlamaModel& llm,
        const std::vector<int>& ids,
        int64_t n_tokens,
        int64_t n_ctx,
        std::vector<int> layers,
        const std::string& dtype,
        const std::string& source,
        const std::string& out_dir);

// An index under test is "STRING" or "STRING|params" (kvindex::IndexSpec),
// where "k=5%" means 5% of the context's tokens (resolve_percentages).

/// Whether a passkey answer gives the key: its first number (after spaces
/// and colons) is the key's digits exactly, not a longer number.
bool needle_answer_is(const std::string& answer, const std::string& key);

/// `index` ("STRING" or "STRING|params") with its percentages resolved
/// against a prompt of n tokens; throws for a percentage on a knob that is
/// not a count of tokens.
std::string resolve_index_percentages(const LlamaModel& llm, const std::string& index, int64_t n);

/// What every evaluation of indexes on the model takes (e2e, needle, ruler).
struct IndexRunConfig {
    std::vector<std::string> indexes;    ///< the indexes under test
    std::string dense_index = "Flat";
    std::vector<int> dense_layers;       ///< layers built from dense_index; empty: every layer uses the index
    /// cache file of `kvllm train` (read_cache) of the model's shape: the
    /// sparse layers' indexes with IVFAsym adopt its models before their
    /// prefill (the others, baselines, run as given); one string at least
    /// must adopt
    std::string trained;
    std::string json_out;                ///< where the JSON results go; "" for none
};

struct E2eConfig : IndexRunConfig {
    std::vector<int64_t> contexts{2048, 4096, 8192};
    int64_t n_eval = 64;                 ///< teacher-forced tokens at the end of each context
};

/** Teacher-forced fidelity: for each context C the document's first C
 * tokens; dense logits of the last n_eval positions come from one exact
 * prefill; each index is built from the first C - n_eval tokens (all their
 * queries given as prefill queries) and decodes the last n_eval tokens.
 * Prints a table per context: top-1 agreement, mean / max KL(dense||index),
 * perplexity of dense and index on the n_eval - 1 next tokens, decode ms/token.
 * Every context and index is checked before the first prefill. */
void run_e2e(const LlamaModel& llm, const std::vector<int>& ids, const E2eConfig& cfg, std::ostream& out);

/// Writes j to path (indented); throws when the file cannot be written.
void write_json(const std::string& path, const nlohmann::json& j);

/** params with the value "question" of any parameter replaced by
 * n_question_tokens, e.g. "proxy_tokens=question" -> "proxy_tokens=37":
 * a knob sized by each prompt's question (the needle and ruler prompts know
 * where theirs starts). Other items pass unchanged, for
 * set_index_parameters to check. */
std::string resolve_question(const std::string& params, int64_t n_question_tokens);

/// Token count of a piece of text: the tokenizer's, or a stand-in in tests.
using TokenCounter = std::function<int64_t(const std::string&)>;

/// The tokenizer's count (no special tokens).
TokenCounter token_counter(const BpeTokenizer& tok);

/** A generated prompt as pieces of text, each counted when added. Every
 * piece after the first starts with whitespace and the one before it ends
 * with a non-space character: the GPT-2 pre-tokenizer always splits there,
 * so the prompt's tokens are the pieces' tokens end to end, and a piece's
 * token position is the sum of the counts before it. The last piece is the
 * question, ending in the answer prefix the model continues. */
struct PromptPieces {
    std::vector<std::string> pieces;
    std::vector<int64_t> counts;  ///< tokens of each piece
    std::vector<size_t> marked;   ///< pieces the task hid (needles, assignments), in prompt order

    void add(std::string piece, const TokenCounter& count, bool mark = false);
    int64_t n_tokens() const;
    /// Token position of the first token of pieces[i].
    int64_t token_of(size_t i) const;
    /// Token position where the question (the last piece) starts.
    int64_t question_start() const {
        return token_of(pieces.size() - 1);
    }
    std::string text() const;
};

/// The prompt's ids: each piece encoded on its own, end to end; throws if
/// a piece's tokens disagree with its count (counted by another counter).
std::vector<int> encode_pieces(const BpeTokenizer& tok, const PromptPieces& prompt);

/** The passkey prompt (Mohtashami & Jaggi's landmark-attention task): a
 * 5-digit key at `depth` in [0, 1] of a haystack of repeated filler
 * sentences, about target_tokens long, asked for at the end; marked[0] is
 * the needle. */
PromptPieces needle_prompt(const TokenCounter& count, int64_t target_tokens, double depth, const std::string& key);

/// The indexes under test of needle and ruler, built alike for every prompt.
struct IndexSet {
    std::vector<kvindex::IndexSpec> specs;
    std::string dense_index;         ///< string of dense_layers
    std::vector<int> dense_layers;
    std::unique_ptr<kvindex::KVCache> trained; ///< --trained (read_cache), or nullptr

    IndexSet(const std::vector<std::string>& indexes, const std::string& dense_index,
             const std::vector<int>& dense_layers, const std::string& trained_path);
    /// The indexes of an evaluation's configuration.
    explicit IndexSet(const IndexRunConfig& cfg)
            : IndexSet(cfg.indexes, cfg.dense_index, cfg.dense_layers, cfg.trained) {}

    /** Throws what building each index's cache would (LlamaModel::
     * check_cache_args) for prompts of n_prefilled tokens (percentages of
     * them; "question" as one token), before a run's first prefill. */
    void check(const LlamaModel& llm, const std::vector<int64_t>& n_prefilled) const;
};

/** A reference answer read teacher-forced after the prompt: how likely the
 * model finds it, and how far each position's next-token distribution is
 * from dense's. Measures fidelity where the greedy answers cannot: a model
 * that rarely answers a task still assigns its right answer a likelihood,
 * and sparse attention should not change it. */
struct ReferenceFit {
    int64_t n_tokens = 0;  ///< tokens of the reference
    double log_prob = 0;   ///< sum over them of log p(token | prompt, the reference before it)
    double kl_mean = 0;    ///< mean over the positions of KL(dense || this); 0 for dense
    double top1 = 1;       ///< share of the positions where this and dense predict the same token
    /// share of the positions whose most likely next token is the
    /// reference's own (teacher-forced token accuracy): an accuracy that a
    /// model which rarely answers a task still has, so it can be compared
    /// with dense's
    double accuracy = 0;
    std::vector<uint8_t> correct; ///< size n_tokens: 1 where this predicts the reference's token
};

struct Answer {
    std::string params;      ///< the parameters as set (percentages and "question" resolved)
    std::vector<int> tokens; ///< generated ids (stop token included)
    std::string text;
    ReferenceFit reference;  ///< when answer_prompt read a reference
};

struct PromptAnswers {
    double prefill_s = 0;
    Answer dense;                ///< the dense baseline (Flat everywhere), when asked for
    std::vector<Answer> indexes; ///< one per spec
};

/** Greedy answers to one prompt: one dense prefill of prompt[0, n - 1)
 * shared by the dense baseline (if asked for) and every index, each of
 * which then decodes up to max_new tokens from a cache built from it.
 * Percentages of the parameters are of the n - 1 prefilled tokens;
 * "question" is the n - 1 - question_start question tokens among them (the
 * prompt's last token is decoded, not prefilled).
 * With a non-empty `reference` (token ids), dense and every index also
 * decode prompt.back() + reference[0, m - 1) from a fresh cache of the same
 * prefill, and their Answer::reference gets the fit of the m reference
 * tokens (dense's is computed even without the dense baseline). */
PromptAnswers answer_prompt(
        const LlamaModel& llm,
        const BpeTokenizer& tok,
        const std::vector<int>& prompt,
        int64_t question_start,
        int max_new,
        const IndexSet& set,
        bool dense_baseline,
        const std::vector<int>& reference = {});

struct NeedleConfig : IndexRunConfig {
    std::vector<int64_t> contexts{2048, 4096, 8192};
    std::vector<double> depths{0.1, 0.3, 0.5, 0.7, 0.9};
    int trials = 1;
    uint64_t seed = 1;
    int max_new = 8;
};

/** Throws naming the first bad setting: no context, depth or index; trials
 * or max_new below 1; a depth outside [0, 1]; a context below the shortest
 * passkey prompt or above n_ctx_train. run_needle checks it before any prompt. */
void check_needle_config(const NeedleConfig& cfg, const TokenCounter& count, int64_t n_ctx_train);

/** Passkey retrieval: a 5-digit key at each depth of a generated haystack
 * of about C tokens, asked for at the end; one dense prefill per prompt is
 * shared by every index, each of which then decodes the answer greedily.
 * Correct when the answer's first digits are the key. */
void run_needle(const LlamaModel& llm, const BpeTokenizer& tok, const NeedleConfig& cfg, std::ostream& out);

} // namespace kvllm
