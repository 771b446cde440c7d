#pragma once

// RULER-style tasks (Hsieh et al. 2024, "RULER: What's the Real Context
// Size of Your Long-Context Language Models?", arXiv 2404.06654), adapted
// to a 135M model: plain completion prompts (no chat template) that end in
// an answer prefix, generated locally and deterministically from a seed.
//
//   niah_single      one "special magic number" (7 digits) for a key at a random depth
//   niah_multikey    4 needles with distinct keys at random depths, one asked for
//   niah_multivalue  4 needles with one key and distinct values, all asked for
//   vt               variable tracking: a chain of 4 assignment hops from a
//                    5-digit value and a distractor chain from another value
//   cwe              common words extraction: a numbered list where 10 words
//                    appear much more often than the others (the list is the context)
//   passkey          needle's task (needle_prompt) at a random depth
//
// The haystack of the niah and vt tasks is consecutive sentences of
// natural text (the Python documentation the set-up converts to
// data/train/*.txt) from a random offset; passkey keeps its repeated
// filler. A sample scores the fraction of its expected strings found in
// the generated text (RULER's string-match recall).

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "eval.h"
#include "llama_model.h"
#include "tokenizer.h"

namespace kvllm {

/// Every task, in the default order of --tasks.
const std::vector<std::string>& ruler_task_names();

/// Whether a task draws its context from the haystack text.
bool ruler_task_needs_haystack(const std::string& task);

/// The built-in word lists: nouns (cwe's words, the keys' nouns) and
/// adjectives (the keys' first halves); lower case, no word inside another.
const std::vector<std::string>& ruler_nouns();
const std::vector<std::string>& ruler_adjectives();

/** Cuts text into haystack units: sentences, ending at . ? ! or a blank
 * line (or a line break once a unit is long, for code). Each unit starts
 * with whitespace and ends with a non-space character, as PromptPieces
 * require, so the needles can go between any two. */
std::vector<std::string> haystack_units(const std::string& text);

/// data/train/*.txt (find_installed); throws saying how to make them when
/// there are none.
std::vector<std::string> default_haystack_files();

struct RulerSample {
    std::string task;
    PromptPieces prompt;               ///< the question is the last piece
    std::vector<std::string> expected; ///< strings the answer should contain
    /// niah_single, passkey: where the needle stands, a fraction of the
    /// tokens before the question; else -1
    double depth = -1;
    double depth_drawn = -1;           ///< the depth drawn, which placing the needle rounds
    int max_new = 0;                   ///< tokens to generate by default
    /// a right answer as the question's last words go on (" 12345.", " VAR
    /// ABCDE, VAR FGHIJ, ..."): every expected string, in order
    std::string reference;
    /// size expected.size(): where in `reference` each expected string
    /// begins (the item an answer must retrieve from the prompt)
    std::vector<size_t> reference_items;
};

/** Sample `index` of `task` at about target_tokens tokens (as counted by
 * `count`; never more): a pure function of (task, target_tokens, seed,
 * index, haystack, count). Throws std::invalid_argument for an unknown
 * task, a context too small for it, or a haystack task without haystack. */
RulerSample make_ruler_sample(
        const std::string& task,
        int64_t target_tokens,
        uint64_t seed,
        int64_t index,
        const std::vector<std::string>& haystack,
        const TokenCounter& count);

/// For each character offset of `text` (ascending), the index of the token
/// of `ids` (the encoding of `text`) that holds it, the tokens decoded one
/// by one. Throws std::invalid_argument for an offset past the text.
std::vector<int64_t> tokens_at(const BpeTokenizer& tok, const std::vector<int>& ids, const std::vector<size_t>& offsets);

/// Fraction of `expected` found in `answer`, ignoring ASCII case.
double ruler_score(const std::string& answer, const std::vector<std::string>& expected);

struct RulerConfig : IndexRunConfig {
    std::vector<int64_t> contexts{2048, 4096, 8192};
    int samples = 20;                    ///< prompts per (task, context)
    std::vector<std::string> tasks = ruler_task_names();
    uint64_t seed = 1;
    int max_new = 0;                     ///< tokens to generate; 0: each task's own
    std::vector<std::string> haystack_files; ///< recorded in the JSON
    /// also read each sample's reference teacher-forced (answer_prompt's
    /// ReferenceFit) with dense and every index
    bool likelihood = false;
};

/// Tokens a context leaves for the reference answer under --likelihood
/// (the longest, vt's five names, is ~36 tokens).
constexpr int64_t kReferenceRoom = 64;

/// Throws std::invalid_argument naming an unknown task, a context outside
/// [1, max_context] (`why` says what bounds it) or samples < 1.
void check_ruler_prompts(
        const std::vector<std::string>& tasks,
        const std::vector<int64_t>& contexts,
        int samples,
        int64_t max_context,
        const std::string& why);

/// Throws std::invalid_argument naming what is wrong with cfg (unknown
/// task, context outside [1, n_ctx_train] (n_ctx_train - kReferenceRoom
/// with likelihood), samples < 1, max_new < 0).
void check_ruler_config(const RulerConfig& cfg, int64_t n_ctx_train);

/** Runs every (context, task, sample): one dense prefill per prompt, then
 * the dense baseline (Flat everywhere) and each index decode greedily.
 * Prints one line per (prompt, index), then per task and context the
 * dense score and each index's score, score relative to dense and
 * agreement (the fraction of prompts where its generated tokens equal
 * dense's); task "all" averages the tasks. With cfg.likelihood, a second
 * table: per task and context, the reference's log-likelihood under dense
 * and under each index, their difference (its mean over the samples, with
 * the standard error, and exp of it: the likelihood relative to dense;
 * and per token of the answer: exp(delta / tokens)),
 * mean KL(dense || index) and top-1 agreement over the reference
 * positions. */
void run_ruler(
        const LlamaModel& llm,
        const BpeTokenizer& tok,
        const std::vector<std::string>& haystack,
        const RulerConfig& cfg,
        std::ostream& out);

} // namespace kvllm
