#pragma once

// kvllm train: SAAP's offline training (IndexIVFAsym, IVFAsymTrainer) on
// the model's own keys and queries over training documents, written as a
// KVCache file (index_io.h) that e2e / needle / kvbench adopt with --trained.

#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "llama_model.h"
#include "tokenizer.h"

namespace kvllm {

struct TrainConfig {
    /// "STRING" or "STRING|params" with an IVFAsym in its chain: C and the
    /// Q-model's width (knob hidden) come from it
    std::string index = "Sink1,Window511,IVFAsym64";
    int64_t context = 8192;        ///< tokens per training prompt (chunk)
    int64_t max_tokens = 0;        ///< tokens used in all, over every chunk; 0: all
    /// Adam steps; -1 (kTrainDefault): the index's train_iterations if > 0, else the trainer's
    int iterations = -1;
    int hidden = -1;               ///< Q-model width; -1: the index's
    int64_t min_distance = 511;    ///< long range (IVFAsymTrainingParams::min_distance)
    int64_t queries_per_prompt = -1; ///< candidate queries per prompt and head; -1: the trainer's
    uint64_t seed = 1234;          ///< (layer, head) s trains with seed + s
    std::string out;               ///< the cache file
    std::string report_json;       ///< "" = none
};

/// The value of TrainConfig's iterations, hidden and queries_per_prompt
/// that leaves them to the index or the trainer.
constexpr int kTrainDefault = -1;

/** Throws naming the first bad setting: a context outside [2,
 * n_ctx_train], one with no long-range query (min_distance), max_tokens
 * < 0, iterations, hidden or queries_per_prompt neither >= 1 nor
 * kTrainDefault, no output file. run_train checks it first; kvllm train
 * also before it reads the training text. */
void check_train_config(const TrainConfig& cfg, int64_t n_ctx_train);

/** A training document: its name (for logs) and token ids. A task prompt
 * (query_tokens > 0: a retrieval prompt with its answer appended) is one
 * training prompt as it is, outside max_tokens, and only its last
 * query_tokens positions (question and answer: the queries that look the
 * needle up) are training queries; the text documents teach the rest. */
struct TrainDocument {
    std::string name;
    std::vector<int> ids;
    int64_t query_tokens = 0;
};

/** The training prompts of documents: each document cut into windows of
 * `context` tokens, a remnant shorter than context / 2 dropped (a short
 * prompt has few long-range queries); with max_tokens > 0, chunks are taken
 * in order until max_tokens, the last one cut to what remains (if that is
 * at least context / 2). Task prompts follow, one chunk each (never cut:
 * longer than context throws). Returns (document, first token, n_tokens). */
struct TrainChunk {
    size_t document;
    int64_t begin;
    int64_t n_tokens;
};
std::vector<TrainChunk> training_chunks(
        const std::vector<TrainDocument>& documents, int64_t context, int64_t max_tokens);

/** n retrieval-shaped training prompts (kvllm train --task-prompts): RULER
 * tasks (ruler.h; `tasks` in turn) at about `context` tokens on `haystack`,
 * each followed by its expected answer, with query_tokens = the question
 * and the answer. Seeded by (seed, i); the evaluation's own prompts (kvllm
 * ruler --seed) differ by seed, and the passkey task is never generated. */
std::vector<TrainDocument> task_training_prompts(
        const BpeTokenizer& tok,
        const std::vector<std::string>& haystack,
        const std::vector<std::string>& tasks,
        int n,
        int64_t context,
        uint64_t seed);

/** Prefills every chunk, feeds one IVFAsymTrainer per (layer, KV head),
 * trains them (in parallel, BLAS at one thread), writes the cache to
 * cfg.out (and the report to cfg.report_json). Progress on stderr, the
 * summary table on `out`. */
void run_train(
        const LlamaModel& llm,
        const std::vector<TrainDocument>& documents,
        const TrainConfig& cfg,
        std::ostream& out);

} // namespace kvllm
