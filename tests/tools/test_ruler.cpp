// kvllm ruler: the task generators, checked on their text with a stand-in
// token counter (no model needed): each needle, chain and word list is
// where and what the task says, the same seed gives the same prompts; the
// scoring and the "question" parameter. With the SmolLM2 file installed:
// the prompts' pieces tokenize as their whole text, and a tiny run of every
// task with index Flat agrees with the dense baseline.

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <kvindex/blas_threads.h>

#include "eval.h"
#include "gguf.h"
#include "llama_model.h"
#include "llm_test_model.h"
#include "ruler.h"
#include "tokenizer.h"

namespace test_ruler {

using namespace kvllm;

namespace {

/// A stand-in for the tokenizer: a token per 4 bytes, rounded up.
int64_t count_bytes(const std::string& s) {
    return int64_t(s.size() + 3) / 4;
}

/// 600 sentences in paragraphs of 5, every sentence different; each
/// paragraph ends in a colon (no place for a needle).
std::vector<std::string> test_haystack() {
    std::string text;
    for (int i = 0; i < 600; i++) {
        text += "Sentence " + std::to_string(i) + " says the weather was mild today";
        text += i % 5 == 4 ? ":\n\n" : ". ";
    }
    return haystack_units(text);
}

RulerSample sample(const std::string& task, int64_t context = 1024, uint64_t seed = 1, int64_t index = 0) {
    static const std::vector<std::string> haystack = test_haystack();
    return make_ruler_sample(task, context, seed, index, haystack, count_bytes);
}

int occurrences(const std::string& text, const std::string& what) {
    int n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) n++;
    return n;
}

/// The marked pieces' texts, in prompt order.
std::vector<std::string> marked_texts(const PromptPieces& p) {
    std::vector<std::string> out;
    for (size_t m : p.marked) out.push_back(p.pieces[m]);
    return out;
}

/// Checks the invariants of every prompt: the pieces meet at whitespace
/// after a non-space character, the counts are the counter's, the size is
/// within the context and the question is the last piece.
void expect_well_formed(const RulerSample& s, int64_t context) {
    const PromptPieces& p = s.prompt;
    ASSERT_EQ(p.pieces.size(), p.counts.size());
    ASSERT_GE(p.pieces.size(), 3u);
    for (size_t i = 0; i < p.pieces.size(); i++) {
        const std::string& x = p.pieces[i];
        ASSERT_FALSE(x.empty());
        EXPECT_EQ(p.counts[i], count_bytes(x));
        EXPECT_FALSE(std::isspace((unsigned char)x.back())) << s.task << " piece " << i;
        if (i > 0) EXPECT_TRUE(std::isspace((unsigned char)x.front())) << s.task << " piece " << i;
    }
    EXPECT_LE(p.n_tokens(), context) << s.task;
    EXPECT_GT(p.n_tokens(), context * 9 / 10) << s.task << ": the context is filled";
    EXPECT_EQ(p.question_start(), p.n_tokens() - p.counts.back());
    EXPECT_FALSE(s.expected.empty());
    EXPECT_GT(s.max_new, 0);
}

} // namespace

TEST(Ruler, WordListsAreDistinctLowerCaseAndNoWordIsInsideAnother) {
    std::vector<std::string> all = ruler_nouns();
    all.insert(all.end(), ruler_adjectives().begin(), ruler_adjectives().end());
    // enough nouns for cwe's list at 8k tokens (about 300 uncommon words)
    EXPECT_GE(ruler_nouns().size(), 400u);
    EXPECT_EQ(std::set<std::string>(all.begin(), all.end()).size(), all.size());
    for (const std::string& a : all) {
        for (char c : a) ASSERT_TRUE(c >= 'a' && c <= 'z') << a;
        for (const std::string& b : all) {
            EXPECT_TRUE(a == b || b.find(a) == std::string::npos) << a << " is inside " << b;
        }
    }
}

TEST(Ruler, HaystackUnitsAreSentencesThatMeetAtWhitespace) {
    const std::string text = "First one. Second? Third!\n\nA paragraph\nwith a break. e.g.x stays   \n";
    std::vector<std::string> u = haystack_units(text);
    EXPECT_EQ(u, (std::vector<std::string>{"\nFirst one.", " Second?", " Third!", "\n\nA paragraph\nwith a break.",
                                           " e.g.x stays"}));
    // a long unit without sentence ends (code) ends at a line break
    std::string code;
    for (int i = 0; i < 40; i++) code += "    x = f(" + std::to_string(i) + ")\n";
    u = haystack_units(code);
    EXPECT_GT(u.size(), 1u);
    std::string joined;
    for (const std::string& x : u) {
        EXPECT_LE(x.size(), 300u + 20u);
        joined += x;
    }
    EXPECT_EQ(joined + "\n", code) << "the units are the text, trailing whitespace dropped";
    EXPECT_TRUE(haystack_units(" \n ").empty());
}

TEST(Ruler, NiahSingleHasItsNeedleOnceAtItsDepth) {
    for (int64_t index = 0; index < 8; index++) {
        RulerSample s = sample("niah_single", 1024, 1, index);
        expect_well_formed(s, 1024);
        const PromptPieces& p = s.prompt;
        ASSERT_EQ(p.marked.size(), 1u);
        ASSERT_EQ(s.expected.size(), 1u);
        const std::string& value = s.expected[0];
        EXPECT_EQ(value.size(), 7u);
        const std::string& needle = p.pieces[p.marked[0]];
        // " One of the special magic numbers for <key> is: <value>."
        const std::string head = " One of the special magic numbers for ";
        ASSERT_EQ(needle.compare(0, head.size(), head), 0) << needle;
        ASSERT_EQ(needle.substr(needle.size() - value.size() - 1), value + ".");
        const std::string key = needle.substr(head.size(), needle.find(" is: ") - head.size());
        const std::string text = p.text();
        EXPECT_EQ(occurrences(text, needle), 1);
        EXPECT_EQ(occurrences(text, value), 1);
        // the intro, then `at` haystack units, then the needle: at the
        // sentence end nearest to its depth
        const int64_t n_units = int64_t(p.pieces.size()) - 3, at = int64_t(p.marked[0]) - 1;
        auto sentence_end = [&](int64_t k) { // after unit k - 1, the piece k or k + 1 after the needle
            if (k == 0 || k == n_units) return true;
            const char c = p.pieces[k + (k - 1 >= at)].back();
            return c == '.' || c == '?' || c == '!';
        };
        ASSERT_TRUE(sentence_end(at)) << p.pieces[at];
        const double want = s.depth_drawn * double(n_units);
        for (int64_t k = 0; k <= n_units; k++) {
            if (sentence_end(k)) EXPECT_GE(std::fabs(double(k) - want), std::fabs(double(at) - want)) << k;
        }
        size_t offset = 0;
        for (size_t i = 0; i < p.marked[0]; i++) offset += p.pieces[i].size();
        EXPECT_EQ(text.find(needle), offset);
        // the haystack's units are alike: the needle's token is at about its depth
        EXPECT_NEAR(double(p.token_of(p.marked[0])) / double(p.question_start()), s.depth_drawn, 0.1);
        EXPECT_EQ(p.pieces.back(), "\nWhat is the special magic number for " + key +
                                           " mentioned in the provided text? The special magic number for " + key +
                                           " mentioned in the provided text is");
    }
}

TEST(Ruler, NiahMultikeyHasFourDistinctKeysAndAsksForOne) {
    for (int64_t index = 0; index < 8; index++) {
        RulerSample s = sample("niah_multikey", 1024, 3, index);
        expect_well_formed(s, 1024);
        std::vector<std::string> needles = marked_texts(s.prompt);
        ASSERT_EQ(needles.size(), 4u);
        std::set<std::string> keys, values;
        std::string asked_value;
        const std::string question = s.prompt.pieces.back();
        for (const std::string& n : needles) {
            const size_t k0 = n.find(" for ") + 5, k1 = n.find(" is: ");
            const std::string key = n.substr(k0, k1 - k0), value = n.substr(k1 + 5, 7);
            keys.insert(key);
            values.insert(value);
            EXPECT_EQ(occurrences(s.prompt.text(), n), 1);
            if (question.find(" for " + key + " mentioned") != std::string::npos) asked_value = value;
        }
        EXPECT_EQ(keys.size(), 4u);
        EXPECT_EQ(values.size(), 4u);
        EXPECT_EQ(s.expected, std::vector<std::string>{asked_value}) << "the asked key is one of the four";
        // marked are in prompt order
        EXPECT_TRUE(std::is_sorted(s.prompt.marked.begin(), s.prompt.marked.end()));
    }
}

TEST(Ruler, NiahMultivalueHasOneKeyWithFourValuesAllExpected) {
    RulerSample s = sample("niah_multivalue", 1024, 5, 2);
    expect_well_formed(s, 1024);
    std::vector<std::string> needles = marked_texts(s.prompt);
    ASSERT_EQ(needles.size(), 4u);
    std::set<std::string> keys;
    std::vector<std::string> values;
    for (const std::string& n : needles) {
        const size_t k0 = n.find(" for ") + 5, k1 = n.find(" is: ");
        keys.insert(n.substr(k0, k1 - k0));
        values.push_back(n.substr(k1 + 5, 7));
    }
    EXPECT_EQ(keys.size(), 1u);
    std::vector<std::string> expected = s.expected;
    std::sort(expected.begin(), expected.end());
    std::sort(values.begin(), values.end());
    EXPECT_EQ(expected, values);
    EXPECT_EQ(std::set<std::string>(values.begin(), values.end()).size(), 4u);
    EXPECT_NE(s.prompt.pieces.back().find("What are all the special magic numbers for " + *keys.begin()),
              std::string::npos);
}

TEST(Ruler, VtChainHasItsHopsAndTheDistractorAnotherValue) {
    for (int64_t index = 0; index < 8; index++) {
        RulerSample s = sample("vt", 1024, 1, index);
        expect_well_formed(s, 1024);
        std::vector<std::string> statements = marked_texts(s.prompt);
        ASSERT_EQ(statements.size(), 10u);
        // follow the assignments: name -> value (through the chains)
        std::map<std::string, std::string> value_of;
        std::set<std::string> names;
        for (const std::string& st : statements) {
            // " VAR ABCDE = 12345." or " VAR ABCDE = VAR FGHIJ."
            ASSERT_EQ(st.compare(0, 5, " VAR "), 0) << st;
            const std::string name = st.substr(5, 5);
            const std::string rhs = st.substr(13, st.size() - 14);
            ASSERT_EQ(st.substr(10, 3), " = ") << st;
            EXPECT_TRUE(names.insert(name).second) << "each variable assigned once: " << name;
            if (rhs.compare(0, 4, "VAR ") == 0) {
                ASSERT_TRUE(value_of.count(rhs.substr(4))) << "a hop refers to an earlier variable: " << st;
                value_of[name] = value_of[rhs.substr(4)];
            } else {
                value_of[name] = rhs;
            }
        }
        std::map<std::string, std::vector<std::string>> by_value;
        for (const std::string& st : statements) by_value[value_of[st.substr(5, 5)]].push_back(st.substr(5, 5));
        ASSERT_EQ(by_value.size(), 2u) << "the chain and a distractor with another value";
        const std::string question = s.prompt.pieces.back();
        std::string asked;
        for (const auto& [value, chain] : by_value) {
            EXPECT_EQ(chain.size(), 5u) << "4 hops";
            if (question.find("assigned the value " + value + " in the text") != std::string::npos) {
                asked = value;
                EXPECT_EQ(s.expected, chain);
            }
        }
        ASSERT_FALSE(asked.empty());
        EXPECT_NE(question.find("5 variables are assigned the value " + asked + ", they are:"), std::string::npos);
    }
}

TEST(Ruler, CweCommonWordsAreTheTenMostFrequent) {
    for (int64_t context : {int64_t(512), int64_t(2048), int64_t(6000)}) {
        RulerSample s = sample("cwe", context, 2, 0);
        expect_well_formed(s, context);
        // parse the list "\n<i>. <word>" independently of the pieces
        std::string text = s.prompt.text();
        const size_t begin = text.find("\n1. "), end = text.find("\nWhat are the 10 most common words");
        ASSERT_NE(begin, std::string::npos);
        ASSERT_NE(end, std::string::npos);
        std::istringstream list(text.substr(begin, end - begin));
        std::map<std::string, int> freq;
        std::string number, word;
        int n = 0;
        while (list >> number >> word) {
            ASSERT_EQ(number, std::to_string(++n) + ".") << "numbered from 1 in order";
            freq[word]++;
        }
        std::vector<std::pair<int, std::string>> ranked;
        for (const auto& [w, f] : freq) ranked.push_back({f, w});
        std::sort(ranked.rbegin(), ranked.rend());
        ASSERT_GT(ranked.size(), 10u);
        std::set<std::string> top;
        for (int i = 0; i < 10; i++) top.insert(ranked[i].second);
        EXPECT_EQ(top, std::set<std::string>(s.expected.begin(), s.expected.end())) << context;
        EXPECT_GT(ranked[9].first, ranked[10].first) << "strictly more frequent than any other word";
        EXPECT_EQ(ranked[0].first, ranked[9].first) << "the 10 equally often";
        if (context == 6000) EXPECT_EQ(ranked[0].first, 30) << "RULER's frequencies at long contexts";
        if (context == 6000) EXPECT_EQ(ranked[10].first, 3);
    }
}

TEST(Ruler, PasskeyIsNeedlesTaskAtARandomDepth) {
    RulerSample s = sample("passkey", 1024, 1, 4);
    expect_well_formed(s, 1024);
    ASSERT_EQ(s.prompt.marked.size(), 1u);
    const std::string key = s.expected.at(0);
    EXPECT_EQ(s.prompt.pieces[s.prompt.marked[0]],
              " The pass key is " + key + ". Remember it. " + key + " is the pass key.");
    EXPECT_EQ(s.prompt.pieces.back(), " What is the pass key? The pass key is");
    // the same prompt as needle's at that depth
    PromptPieces p = needle_prompt(count_bytes, 1024, s.depth_drawn, key);
    EXPECT_EQ(p.pieces, s.prompt.pieces);
}

TEST(Ruler, SameSeedSamePromptsOtherSeedOthers) {
    for (const std::string& task : ruler_task_names()) {
        RulerSample a = sample(task, 1024, 7, 3), b = sample(task, 1024, 7, 3);
        EXPECT_EQ(a.prompt.pieces, b.prompt.pieces) << task;
        EXPECT_EQ(a.expected, b.expected) << task;
        EXPECT_NE(a.prompt.text(), sample(task, 1024, 8, 3).prompt.text()) << task << ": another seed";
        EXPECT_NE(a.prompt.text(), sample(task, 1024, 7, 4).prompt.text()) << task << ": another sample";
    }
}

// The reference answer (what --likelihood reads) is a right answer: it holds
// every expected string, in order, as the question's last words go on.
TEST(Ruler, ReferenceIsARightAnswerListingTheExpectedStrings) {
    for (const std::string& task : ruler_task_names()) {
        for (int64_t i = 0; i < 3; i++) {
            RulerSample s = sample(task, 1024, 1, i);
            ASSERT_FALSE(s.reference.empty()) << task;
            EXPECT_EQ(s.reference.front(), ' ') << task << ": continues the question's last word";
            EXPECT_EQ(s.reference.back(), '.') << task;
            EXPECT_EQ(ruler_score(s.reference, s.expected), 1.0) << task << ": " << s.reference;
            size_t at = 0;
            for (const std::string& e : s.expected) {
                // vt's names stand as "VAR NAME" in the prompt, and so in the answer
                const std::string as_written = task == "vt" ? "VAR " + e : e;
                at = s.reference.find(as_written, at);
                ASSERT_NE(at, std::string::npos) << task << ": " << as_written << " in order in " << s.reference;
                EXPECT_NE(s.prompt.text().find(as_written), std::string::npos) << task << ": " << as_written;
            }
        }
    }
    EXPECT_EQ(sample("vt").reference.substr(0, 5), " VAR ");
}

// reference_items point at each expected string as the reference writes it.
TEST(Ruler, ReferenceItemsAreWhereTheExpectedStringsBegin) {
    for (const std::string& task : ruler_task_names()) {
        for (int64_t i = 0; i < 3; i++) {
            RulerSample s = sample(task, 1024, 1, i);
            ASSERT_EQ(s.reference_items.size(), s.expected.size()) << task;
            for (size_t e = 0; e < s.expected.size(); e++) {
                EXPECT_EQ(s.reference.substr(s.reference_items[e], s.expected[e].size()), s.expected[e]) << task;
                if (e) EXPECT_GT(s.reference_items[e], s.reference_items[e - 1]) << task;
            }
        }
    }
}

TEST(Ruler, ScoreIsTheFractionOfExpectedStringsFound) {
    EXPECT_EQ(ruler_score(" 1234567.", {"1234567"}), 1.0);
    EXPECT_EQ(ruler_score(" 123456", {"1234567"}), 0.0);
    EXPECT_EQ(ruler_score("1111111, 2222222 and 4444444", {"1111111", "2222222", "3333333", "4444444"}), 0.75);
    EXPECT_EQ(ruler_score(" Apple, CHERRY", {"apple", "banana", "cherry", "plum"}), 0.5) << "ignores case";
    EXPECT_EQ(ruler_score("", {"x"}), 0.0);
    EXPECT_THROW(ruler_score("x", {}), std::invalid_argument);
    // a string counts where it stands alone, not inside a longer number or word
    EXPECT_EQ(ruler_score(" 83947640.", {"8394764"}), 0.0) << "a wrong, longer number";
    EXPECT_EQ(ruler_score(" 18394764.", {"8394764"}), 0.0);
    EXPECT_EQ(ruler_score("The words that appear most", {"pear"}), 0.0);
    EXPECT_EQ(ruler_score(" shrimpy, pear", {"shrimp", "pear"}), 0.5);
    EXPECT_EQ(ruler_score(" 8394764 (not 83947640)", {"8394764"}), 1.0) << "any stand-alone match";
    EXPECT_EQ(ruler_score("VAR ABCDE,VAR FGHIJ", {"abcde", "fghij"}), 1.0);
    EXPECT_EQ(ruler_score("x8394764y", {"8394764"}), 1.0) << "letters do not join digits";
}

// kvllm needle's check: the answer's first number is the key, exactly.
TEST(Needle, AnswerIsTheKeysDigitsExactly) {
    EXPECT_TRUE(needle_answer_is(" 75030.", "75030"));
    EXPECT_TRUE(needle_answer_is(": 75030 is the pass key", "75030"));
    EXPECT_FALSE(needle_answer_is(" 750307. Remember", "75030")) << "a longer number";
    EXPECT_FALSE(needle_answer_is(" 7503", "75030"));
    EXPECT_FALSE(needle_answer_is(" The key is 75030", "75030")) << "the first number only, first";
    EXPECT_FALSE(needle_answer_is("", "75030"));
}

// The depth a sample reports is where its needle stands among the tokens
// before the question, not the depth drawn before the needle was put at a
// sentence end.
TEST(Ruler, DepthIsWhereTheNeedleStands) {
    for (const std::string task : {"niah_single", "passkey"}) {
        for (int64_t i = 0; i < 6; i++) {
            RulerSample s = sample(task, 1024, 1, i);
            ASSERT_FALSE(s.prompt.marked.empty());
            EXPECT_DOUBLE_EQ(s.depth, double(s.prompt.token_of(s.prompt.marked[0])) /
                                              double(s.prompt.question_start()))
                    << task << " " << i;
            EXPECT_GT(s.depth, 0.0);
            EXPECT_LT(s.depth, 1.0);
        }
    }
}

TEST(Ruler, QuestionParameterIsTheQuestionLength) {
    EXPECT_EQ(resolve_question("proxy_tokens=question", 37), "proxy_tokens=37");
    EXPECT_EQ(resolve_question("budget=5%,proxy_tokens=question,seed=3", 12), "budget=5%,proxy_tokens=12,seed=3");
    EXPECT_EQ(resolve_question("a=question,b=question", 5), "a=5,b=5") << "any parameter";
    EXPECT_EQ(resolve_question("", 5), "");
    // anything else is left for set_index_parameters to judge
    EXPECT_EQ(resolve_question("k=questions,x=y", 5), "k=questions,x=y");
    EXPECT_EQ(resolve_question("k=2,,proxy_tokens=question,", 5), "k=2,,proxy_tokens=5,");
    EXPECT_THROW(resolve_question("proxy_tokens=question", 0), std::invalid_argument);
    // then percentages, as needle and ruler do
    EXPECT_EQ(kvindex::resolve_percentages(resolve_question("k=50%,proxy_tokens=question", 9), 100),
              "k=50,proxy_tokens=9");
}

TEST(Ruler, BadTasksContextsAndCountsGetClearErrors) {
    auto error_of = [](auto&& fn) -> std::string {
        try {
            fn();
        } catch (const std::invalid_argument& e) {
            return e.what();
        }
        return "";
    };
    std::string e = error_of([] { sample("niah_double"); });
    EXPECT_NE(e.find("unknown ruler task 'niah_double' (tasks: niah_single, "), std::string::npos) << e;
    for (const std::string& task : ruler_task_names()) {
        e = error_of([&] { sample(task, 60); });
        EXPECT_NE(e.find("context 60 is too small for task " + task + ": it needs at least"), std::string::npos)
                << e;
    }
    e = error_of([] { make_ruler_sample("vt", 1024, 1, 0, {}, count_bytes); });
    EXPECT_NE(e.find("task vt needs haystack text"), std::string::npos) << e;
    EXPECT_NO_THROW(make_ruler_sample("cwe", 1024, 1, 0, {}, count_bytes)) << "cwe needs no haystack";

    RulerConfig c;
    c.indexes = {"Flat"};
    EXPECT_NO_THROW(check_ruler_config(c, 8192));
    c.samples = 0;
    EXPECT_NE(error_of([&] { check_ruler_config(c, 8192); }).find("--samples 0"), std::string::npos);
    c.samples = 1;
    c.tasks = {"vt", "nope"};
    EXPECT_NE(error_of([&] { check_ruler_config(c, 8192); }).find("unknown ruler task 'nope'"), std::string::npos);
    c.tasks = {"vt"};
    c.contexts = {2048, 16384};
    EXPECT_NE(error_of([&] { check_ruler_config(c, 8192); }).find("context 16384 outside [1, 8192]"),
              std::string::npos);
    // --likelihood reads the reference after the prompt: the context leaves room for it
    c.contexts = {8192};
    EXPECT_NO_THROW(check_ruler_config(c, 8192));
    c.likelihood = true;
    EXPECT_NE(error_of([&] { check_ruler_config(c, 8192); })
                      .find("context 8192 outside [1, 8128] (the model's training context less 64 tokens for "
                            "--likelihood's reference answer)"),
              std::string::npos);
    c.contexts = {8192 - kReferenceRoom};
    EXPECT_NO_THROW(check_ruler_config(c, 8192));
}

// With the tokenizer: the pieces of every task tokenize as the whole text
// (the model reads the tokens a plain encode would give), and the prompt
// fills its context.
TEST(RulerSmolLM2, PiecesTokenizeAsTheWholeText) {
    KVLLM_MODEL_OR_SKIP(path);
    GgufFile file(path);
    BpeTokenizer tok(file);
    const TokenCounter count = token_counter(tok);
    std::string text;
    for (int i = 0; i < 300; i++) {
        text += "Item " + std::to_string(i) + " (see `x.y`) isn't the same as " + std::to_string(i * 7) +
                "... really?\n\n    code = [1, 2]\n";
    }
    const std::vector<std::string> haystack = haystack_units(text);
    for (const std::string& task : ruler_task_names()) {
        RulerSample s = make_ruler_sample(task, 1024, 1, 0, haystack, count);
        std::vector<int> ids = encode_pieces(tok, s.prompt);
        EXPECT_EQ(ids, tok.encode(s.prompt.text(), false)) << task;
        EXPECT_LE(int64_t(tok.encode(s.reference, false).size()), kReferenceRoom) << task << ": " << s.reference;
        EXPECT_LE(int64_t(ids.size()), 1024) << task;
        EXPECT_GT(int64_t(ids.size()), 900) << task;
    }
}

// tokens_at: the token of the reference that holds each expected string's
// first character, against decodes of the whole prefixes.
TEST(RulerSmolLM2, ReferenceItemTokensHoldEachItemsFirstCharacter) {
    KVLLM_MODEL_OR_SKIP(path);
    GgufFile file(path);
    BpeTokenizer tok(file);
    for (const std::string& task : ruler_task_names()) {
        const RulerSample s = sample(task, 1024, 1, 0);
        const std::vector<int> ids = tok.encode(s.reference, false);
        const std::vector<int64_t> at = tokens_at(tok, ids, s.reference_items);
        ASSERT_EQ(at.size(), s.expected.size()) << task;
        for (size_t e = 0; e < at.size(); e++) {
            ASSERT_GE(at[e], 0) << task;
            ASSERT_LT(at[e], int64_t(ids.size())) << task;
            const std::vector<int> before(ids.begin(), ids.begin() + at[e]);
            const std::vector<int> through(ids.begin(), ids.begin() + at[e] + 1);
            EXPECT_LE(tok.decode(before).size(), s.reference_items[e]) << task << " item " << e;
            EXPECT_GT(tok.decode(through).size(), s.reference_items[e]) << task << " item " << e;
        }
    }
    const RulerSample s = sample("passkey", 1024, 1, 0);
    EXPECT_THROW(tokens_at(tok, tok.encode(s.reference, false), {s.reference.size()}), std::invalid_argument);
}

// A tiny run of every task: the JSON has its fields, and Flat decodes
// exactly as the dense baseline (same cache contents, same arithmetic).
TEST(RulerSmolLM2, TinyRunOfEveryTaskWithFlatAgreesWithDense) {
    KVLLM_MODEL_OR_SKIP(path);
    // as kvllm runs: OpenMP around one-thread BLAS calls (kvllm.cpp)
    kvindex::ScopedBlasThreads one_blas_thread(1);
    GgufFile file(path);
    BpeTokenizer tok(file);
    LlamaModel llm(file);
    std::string text;
    for (int i = 0; i < 200; i++) text += " The river number " + std::to_string(i) + " flows to the sea.";
    RulerConfig c;
    c.contexts = {320}; // about the least that every task fits in
    c.samples = 1;
    c.max_new = 6;
    c.indexes = {"Flat"};
    c.likelihood = true;
    c.json_out = testing::TempDir() + "ruler_tiny.json";
    std::ostringstream out;
    run_ruler(llm, tok, haystack_units(text), c, out);
    std::ifstream in(c.json_out);
    nlohmann::json j = nlohmann::json::parse(in);
    ASSERT_EQ(j["cases"].size(), ruler_task_names().size());
    for (const nlohmann::json& cs : j["cases"]) {
        EXPECT_LE(cs["tokens"].get<int64_t>(), 320);
        EXPECT_LT(cs["question_token"].get<int64_t>(), cs["tokens"].get<int64_t>());
        ASSERT_EQ(cs["indexes"].size(), 1u);
        EXPECT_EQ(cs["indexes"][0]["answer"], cs["dense"]["answer"]) << cs["task"];
        EXPECT_TRUE(cs["indexes"][0]["agree"].get<bool>());
        // the reference read teacher-forced: Flat's likelihood is dense's
        EXPECT_GT(cs["reference"]["tokens"].get<int64_t>(), 0) << cs["task"];
        EXPECT_LT(cs["dense"]["reference_log_prob"].get<double>(), 0.0) << cs["task"];
        EXPECT_EQ(cs["indexes"][0]["reference_log_prob"], cs["dense"]["reference_log_prob"]) << cs["task"];
        EXPECT_EQ(cs["indexes"][0]["reference_kl"].get<double>(), 0.0) << cs["task"];
        EXPECT_EQ(cs["indexes"][0]["reference_top1"].get<double>(), 1.0) << cs["task"];
        EXPECT_EQ(cs["indexes"][0]["reference_accuracy"], cs["dense"]["reference_accuracy"]) << cs["task"];
        EXPECT_EQ(cs["indexes"][0]["reference_item_accuracy"], cs["dense"]["reference_item_accuracy"])
                << cs["task"];
        for (const char* k : {"task", "context", "sample", "needle_tokens", "expected", "prefill_s", "depth"}) {
            EXPECT_TRUE(cs.contains(k)) << k;
        }
    }
    ASSERT_EQ(j["summary"].size(), ruler_task_names().size() + 1) << "a row per task and \"all\"";
    for (const nlohmann::json& r : j["summary"]) {
        EXPECT_EQ(r["index"], "Flat");
        EXPECT_EQ(r["context"], 320);
        EXPECT_EQ(r["agreement"].get<double>(), 1.0) << r["task"];
        EXPECT_EQ(r["score"], r["dense"]);
        if (r["dense"].get<double>() > 0) EXPECT_EQ(r["relative"].get<double>(), 1.0);
        else EXPECT_TRUE(r["relative"].is_null());
        const nlohmann::json& ref = r["reference"];
        EXPECT_EQ(ref["log_prob"], ref["log_prob_dense"]) << r["task"];
        EXPECT_EQ(ref["delta"].get<double>(), 0.0) << r["task"];
        EXPECT_EQ(ref["relative"].get<double>(), 1.0) << r["task"];
        EXPECT_EQ(ref["relative_per_token"].get<double>(), 1.0) << r["task"];
        EXPECT_GT(ref["tokens"].get<double>(), 0.0) << r["task"];
        EXPECT_EQ(ref["kl"].get<double>(), 0.0) << r["task"];
        EXPECT_EQ(ref["accuracy"], ref["accuracy_dense"]) << r["task"];
        if (ref["accuracy_dense"].get<double>() > 0) EXPECT_EQ(ref["accuracy_relative"].get<double>(), 1.0);
        else EXPECT_TRUE(ref["accuracy_relative"].is_null());
        EXPECT_EQ(ref["item_accuracy"], ref["item_accuracy_dense"]) << r["task"];
        if (ref["item_accuracy_dense"].get<double>() > 0) EXPECT_EQ(ref["item_accuracy_relative"].get<double>(), 1.0);
        else EXPECT_TRUE(ref["item_accuracy_relative"].is_null());
    }
    EXPECT_TRUE(j["config"]["likelihood"].get<bool>());
    EXPECT_NE(out.str().find("reference answers read teacher-forced"), std::string::npos);
    EXPECT_EQ(j["summary"].back()["task"], "all");
    EXPECT_EQ(j["config"]["tasks"], ruler_task_names());
    EXPECT_EQ(j["config"]["seed"], 1);
    EXPECT_EQ(j["config"]["max_new"], 6);
    EXPECT_NE(out.str().find("niah_single"), std::string::npos);
}

// The reference read teacher-forced (answer_prompt with a reference):
// dense's log-likelihood is the one an exact prefill of prompt + reference
// gives; Flat (dense's cache) fits it exactly; a top-4 cache does not.
TEST(RulerSmolLM2, ReferenceLikelihoodIsThatOfAPrefillOfPromptAndReference) {
    KVLLM_MODEL_OR_SKIP(path);
    kvindex::ScopedBlasThreads one_blas_thread(1);
    GgufFile file(path);
    BpeTokenizer tok(file);
    LlamaModel llm(file);
    const RulerSample s = make_ruler_sample("passkey", 300, 1, 0, {}, token_counter(tok));
    const std::vector<int> prompt = encode_pieces(tok, s.prompt);
    const std::vector<int> reference = tok.encode(s.reference, false);
    const IndexSet set({"Flat", "TopK(Flat)|k=4"}, "Flat", {}, "");
    const PromptAnswers a =
            answer_prompt(llm, tok, prompt, s.prompt.question_start(), 2, set, false, reference);

    // independent: one causal prefill of prompt + reference; the rows of
    // positions n - 1 .. n + m - 2 predict the m reference tokens
    const int64_t n = int64_t(prompt.size()), m = int64_t(reference.size());
    const int V = llm.cfg.n_vocab;
    std::vector<int> all = prompt;
    all.insert(all.end(), reference.begin(), reference.end());
    std::vector<float> logits(size_t(m) * V);
    llm.prefill(all.data(), n + m - 1, logits.data(), n - 1, nullptr, 0);
    double expected = 0;
    // token accuracy: positions whose best logit is the reference's token;
    // a position whose two best logits lie within rounding of each other
    // may go either way in the decode path
    int64_t correct = 0, near_ties = 0;
    std::vector<uint8_t> near_tie(static_cast<size_t>(m)); // per position, for the check by position below
    for (int64_t t = 0; t < m; t++) {
        const float* row = logits.data() + t * V;
        const float* best = std::max_element(row, row + V);
        const double top = *best;
        double z = 0;
        for (int i = 0; i < V; i++) z += std::exp(double(row[i]) - top);
        expected += double(row[reference[t]]) - top - std::log(z);
        correct += best - row == reference[t];
        float second = -std::numeric_limits<float>::infinity();
        for (int i = 0; i < V; i++) {
            if (row + i != best) second = std::max(second, row[i]);
        }
        near_tie[t] = *best - second < 1e-3f * (1.0f + std::abs(*best));
        near_ties += near_tie[t];
    }
    const ReferenceFit& dense = a.dense.reference;
    EXPECT_EQ(dense.n_tokens, m);
    EXPECT_NEAR(dense.log_prob, expected, 1e-3 * std::abs(expected) + 1e-3);
    EXPECT_EQ(dense.kl_mean, 0.0);
    EXPECT_EQ(dense.top1, 1.0);
    EXPECT_NEAR(dense.accuracy * double(m), double(correct), double(near_ties))
            << correct << " of " << m << " reference tokens predicted by the prefill";
    ASSERT_EQ(dense.correct.size(), size_t(m));
    for (int64_t t = 0; t < m; t++) {
        // position by position where no near tie can flip the best token
        const float* row = logits.data() + t * V;
        if (!near_tie[t]) {
            EXPECT_EQ(dense.correct[t], std::max_element(row, row + V) - row == reference[t] ? 1 : 0)
                    << "position " << t;
        }
    }
    ASSERT_EQ(a.indexes.size(), 2u);
    const ReferenceFit& flat = a.indexes[0].reference;
    EXPECT_EQ(flat.log_prob, dense.log_prob);
    EXPECT_EQ(flat.kl_mean, 0.0);
    EXPECT_EQ(flat.top1, 1.0);
    EXPECT_EQ(flat.accuracy, dense.accuracy);
    const ReferenceFit& top4 = a.indexes[1].reference;
    EXPECT_EQ(top4.n_tokens, m);
    EXPECT_GT(top4.kl_mean, 0.0) << "4 keys of ~300 change the distributions";
    EXPECT_NE(top4.log_prob, dense.log_prob);
    EXPECT_LE(top4.log_prob, 0.0);
    // its accuracy counts its own predictions: those it shares with dense
    // (top1) bound how many of dense's correct ones it keeps
    EXPECT_GE(top4.accuracy, 0.0);
    EXPECT_LE(top4.accuracy, 1.0);
    EXPECT_LE(dense.accuracy - top4.accuracy, 1.0 - top4.top1 + 1e-12);
}

}  // namespace test_ruler
