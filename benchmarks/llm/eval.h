#pragma once

// What kvllm measures: generation, trace capture, teacher-forced fidelity
// (e2e) and passkey retrieval (needle) of any index string against the
// model's own dense attention.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include <kvindex/parameters.h>

#include "llama_model.h"
#include "tokenizer.h"

namespace kvllm {

/// Token ids of a prompt, wrapped in the model's chat template if chat.
std::vector<int> encode_prompt(const BpeTokenizer& tok, const std::string& prompt, bool chat);

struct GenerationResult {
    std::vector<int> tokens;   ///< generated ids (stop token included)
    std::string text;          ///< their text
    double prefill_tokens_per_s = 0;
    double decode_tokens_per_s = 0;
};

/// Dense prefill of prompt[0, n-1), then greedy decode through a KVCache.
GenerationResult generate_text(
        const LlamaModel& llm,
        const BpeTokenizer& tok,
        const std::vector<int>& prompt,
        int max_new,
        const std::string& index_string,
        const std::string& dense_string);

struct TraceSummary {
    int64_t n_tokens = 0;
    int64_t n_ctx = 0;
    std::vector<int> layers;
    double prefill_seconds = 0;
};

/** Writes the kvbench trace of the model reading ids[0, n_tokens): meta.json
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

struct E2eConfig {
    std::vector<int64_t> contexts{2048, 4096, 8192};
    int64_t n_eval = 64;                 ///< teacher-forced tokens at the end of each context
    std::vector<std::string> indexes;
    std::string dense_index = "Flat";
    std::vector<int> dense_layers;       ///< layers built from dense_index; empty: every layer uses the index
    /// cache file of `kvllm train` (read_cache): the sparse layers' indexes
    /// adopt its models before their prefill; every index must adopt something
    std::string trained;
    std::string json_out;
};

/** Teacher-forced fidelity: for each context C the document's first C
 * tokens; dense logits of the last n_eval positions come from one exact
 * prefill; each index is built from the first C - n_eval tokens (all their
 * queries given as prefill queries) and decodes the last n_eval tokens.
 * Prints a table per context: top-1 agreement, mean / max KL(dense||index),
 * perplexity of dense and index on the n_eval - 1 next tokens, decode ms/token. */
void run_e2e(const LlamaModel& llm, const std::vector<int>& ids, const E2eConfig& cfg, std::ostream& out);

struct NeedleConfig {
    std::vector<int64_t> contexts{2048, 4096, 8192};
    std::vector<double> depths{0.1, 0.3, 0.5, 0.7, 0.9};
    int trials = 1;
    uint64_t seed = 1;
    int max_new = 8;
    std::vector<std::string> indexes;
    std::string dense_index = "Flat";
    std::vector<int> dense_layers;       ///< as in E2eConfig
    std::string trained;                 ///< as in E2eConfig
    std::string json_out;
};

/** Passkey retrieval: a 5-digit key at each depth of a generated haystack
 * of about C tokens, asked for at the end; one dense prefill per prompt is
 * shared by every index, each of which then decodes the answer greedily.
 * Correct when the answer's first digits are the key. */
void run_needle(const LlamaModel& llm, const BpeTokenizer& tok, const NeedleConfig& cfg, std::ostream& out);

} // namespace kvllm
