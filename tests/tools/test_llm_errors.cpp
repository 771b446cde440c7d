// kvllm on bad input: every bad setting, file or value gets an error that
// names it, before any expensive work, never a hang, a crash or a silently
// wrong answer. Runs on the tiny model of llm_tiny_model.h (no SmolLM2
// file needed).

#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/KVCache.h>
#include <kvindex/index_io.h>

#include "eval.h"
#include "expect_throw.h"
#include "gguf.h"
#include "llama_model.h"
#include "llm_tiny_model.h"
#include "tokenizer.h"

namespace test_llm_errors {

using namespace kvllm;

namespace {

/// The message of what f throws, "" when it does not throw.
template <class F>
std::string error_of(F&& f) {
    try {
        f();
    } catch (const std::exception& e) {
        return e.what();
    }
    return "";
}

/// The tiny model, loaded once per test.
struct Tiny {
    GgufFile file;
    BpeTokenizer tok;
    LlamaModel llm;
    explicit Tiny(const kvllm_test::GgufContent& c = kvllm_test::tiny_llama())
            : file(kvllm_test::write_temp("tiny_errors.gguf", c.bytes())), tok(file), llm(file) {}
};

/// A document of about n tiny-vocabulary tokens.
std::vector<int> document(const BpeTokenizer& tok, size_t n) {
    std::string text;
    while (text.size() < n) text += " the rather aaaa there";
    return tok.encode(text, false);
}

} // namespace

TEST(KvllmErrors, NeedleRefusesBadSettingsBeforeAnyPrompt) {
    Tiny m;
    NeedleConfig good;
    good.contexts = {600};
    good.depths = {0.5};
    good.indexes = {"Flat"};
    std::ostringstream ok_out;
    run_needle(m.llm, m.tok, good, ok_out);
    EXPECT_NE(ok_out.str().find("passkey accuracy (1 prompts per context)"), std::string::npos) << ok_out.str();

    std::ostringstream out;
    auto run = [&](NeedleConfig c) { run_needle(m.llm, m.tok, c, out); };
    NeedleConfig c = good;
    // too long: was built (at any size: a hang for 99999999999) before the prefill refused it
    for (int64_t context : {int64_t(1025), int64_t(0), int64_t(-100), int64_t(50), int64_t(99999999999)}) {
        c.contexts = {600, context};
        EXPECT_THROW_MSG_AS(std::exception, run(c), "context " + std::to_string(context) + " outside [");
    }
    c = good;
    c.contexts = {};
    EXPECT_THROW_MSG_AS(std::exception, run(c), "needle needs a context, a depth and an index");
    c = good;
    c.depths = {};
    EXPECT_THROW_MSG_AS(std::exception, run(c), "needle needs a context, a depth and an index");
    for (int trials : {0, -3}) {
        c = good;
        c.trials = trials;
        EXPECT_THROW_MSG_AS(std::exception, run(c), "--trials " + std::to_string(trials) + ": need at least 1");
    }
    c = good;
    c.depths = {0.5, std::nan("")};
    EXPECT_THROW_MSG_AS(std::exception, run(c), "needle depth nan outside [0, 1]");
    c = good;
    c.indexes = {"Flat", "TopK(Flat)|k=500%"};
    EXPECT_THROW_MSG_AS(std::exception, run(c), "a percentage must be in (0, 100]");
    c = good;
    c.dense_layers = {0, 99};
    EXPECT_THROW_MSG_AS(std::exception, run(c), "dense layer 99");
    EXPECT_EQ(out.str(), "") << "a prompt ran before the error";
}

TEST(KvllmErrors, E2eChecksEveryContextAndIndexBeforeTheFirstPrefill) {
    Tiny m;
    const std::vector<int> ids = document(m.tok, 600);
    ASSERT_GT(ids.size(), 200u);
    E2eConfig good;
    good.contexts = {100};
    good.n_eval = 16;
    good.indexes = {"Flat"};
    std::ostringstream ok_out;
    run_e2e(m.llm, ids, good, ok_out);
    EXPECT_NE(ok_out.str().find("context 100"), std::string::npos) << ok_out.str();

    std::ostringstream out;
    E2eConfig c = good;
    c.contexts = {100, 50000};
    EXPECT_THROW_MSG_AS(std::exception, run_e2e(m.llm, ids, c, out), "context 50000 with 16 evaluated tokens");
    c = good;
    c.contexts = {};
    EXPECT_THROW_MSG_AS(std::exception, run_e2e(m.llm, ids, c, out), "e2e needs a context and an index");
    c = good;
    c.indexes = {"Flat", "TopK(Flat)|k=500%"};
    EXPECT_THROW_MSG_AS(std::exception, run_e2e(m.llm, ids, c, out), "a percentage must be in (0, 100]");
    c = good;
    c.dense_layers = {0, 99};
    EXPECT_THROW_MSG_AS(std::exception, run_e2e(m.llm, ids, c, out), "dense layer 99");
    c = good;
    c.indexes = {"Flat", "NoSuchIndex"};
    EXPECT_NE(error_of([&] { run_e2e(m.llm, ids, c, out); }), "");
    // --trained of another model's shape, or that no string adopts, was
    // recorded in the JSON as used
    const auto& cfg = m.llm.cfg;
    std::string other = ::testing::TempDir() + "/trained_other_shape.kvc";
    std::string same = ::testing::TempDir() + "/trained_same_shape.kvc";
    kvindex::write_cache(kvindex::KVCache(2, 2, 2, 16, 16, "Flat"), other);
    kvindex::write_cache(
            kvindex::KVCache(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.head_dim, "Flat"),
            same);
    c = good;
    c.trained = other;
    EXPECT_THROW_MSG_AS(std::exception, run_e2e(m.llm, ids, c, out), "--trained: the cache has 2 layers");
    c.trained = same;
    EXPECT_THROW_MSG_AS(std::exception, run_e2e(m.llm, ids, c, out), "no index string has an offline-trained type");
    EXPECT_EQ(out.str(), "") << "a context ran before the error";
}

namespace {

using kvllm_test::GgufContent;
using kvllm_test::kBool;
using kvllm_test::kI32;
using kvllm_test::kU64;

/// What loading a file of this content throws (file, tokenizer, model).
std::string load_error(const GgufContent& c) {
    return error_of([&] { Tiny m(c); });
}

} // namespace

TEST(KvllmErrors, MetadataCountsAreRangeChecked) {
    EXPECT_EQ(load_error(kvllm_test::tiny_llama()), "");
    struct Case {
        const char* key;
        uint32_t type;
        uint64_t bits;
        const char* expected;
    };
    for (const Case& k : std::vector<Case>{
                 // was "vector::_M_default_append"
                 {"llama.block_count", kI32, uint32_t(-1), "llama.block_count = -1 is outside [1, 4096]"},
                 {"llama.block_count", kU64, ~uint64_t(0), "llama.block_count = 18446744073709551615 is outside"},
                 // were cut by int() to 30 and 9
                 {"llama.block_count", kU64, (uint64_t(1) << 32) + 30, "llama.block_count = 4294967326 is outside"},
                 {"llama.attention.head_count", kU64, (uint64_t(1) << 32) + 9,
                  "llama.attention.head_count = 4294967305 is outside [1, 32]"},
                 {"llama.block_count", kI32, 0, "llama.block_count = 0 is outside [1, 4096]"},
                 {"llama.attention.head_count_kv", kI32, 8, "head_count_kv = 8 is outside [1, 4]"},
                 {"llama.context_length", kI32, 0, "llama.context_length = 0 is outside"},
                 {"tokenizer.ggml.eos_token_id", kI32, 100000, "eos_token_id = 100000 is outside [0, "},
         }) {
        GgufContent c = kvllm_test::tiny_llama();
        if (k.type == kU64) {
            c.set_scalar<uint64_t>(k.key, k.type, k.bits);
        } else {
            c.set_scalar<int32_t>(k.key, k.type, int32_t(uint32_t(k.bits)));
        }
        const std::string e = load_error(c);
        EXPECT_NE(e.find(k.expected), std::string::npos) << k.key << ": " << e;
    }
    // a bool where an integer is expected was read as 0 or 1
    GgufContent c = kvllm_test::tiny_llama();
    c.set_scalar<uint8_t>("llama.block_count", kBool, 1);
    EXPECT_NE(load_error(c).find("metadata key llama.block_count is not an integer"), std::string::npos)
            << load_error(c);
}

TEST(KvllmErrors, RepeatedKeysAndTensorsAreRefused) {
    // the second value silently replaced the first
    GgufContent c = kvllm_test::tiny_llama();
    GgufContent::Entry second = c.metadata[1];
    ASSERT_EQ(second.key, "llama.block_count");
    c.metadata.push_back(second);
    EXPECT_NE(load_error(c).find("metadata key llama.block_count appears twice"), std::string::npos)
            << load_error(c);
    c = kvllm_test::tiny_llama();
    c.tensors.push_back(c.tensor("output_norm.weight"));
    EXPECT_NE(load_error(c).find("tensor output_norm.weight appears twice"), std::string::npos) << load_error(c);
}

namespace {

/// Sets element i of an F32 tensor of the content.
void set_weight(GgufContent& c, const std::string& tensor, size_t i, float v) {
    std::memcpy(c.tensor(tensor).data.data() + 4 * i, &v, 4);
}

} // namespace

TEST(KvllmErrors, NonFiniteWeightsAndEpsilonAreRefusedAtLoad) {
    using kvllm_test::kF32;
    const float inf = std::numeric_limits<float>::infinity();
    for (float eps : {std::nanf(""), inf, -1e-5f, 0.0f, 2.0f}) {
        GgufContent c = kvllm_test::tiny_llama();
        c.set_scalar<float>("llama.attention.layer_norm_rms_epsilon", kF32, eps);
        const std::string e = load_error(c);
        EXPECT_NE(e.find("llama.attention.layer_norm_rms_epsilon = "), std::string::npos) << eps << ": " << e;
        EXPECT_NE(e.find("is outside (0, 1]"), std::string::npos) << eps << ": " << e;
    }
    // a NaN output norm made generate print <|endoftext|> (the argmax of NaN logits is 0)
    GgufContent c = kvllm_test::tiny_llama();
    set_weight(c, "output_norm.weight", 3, std::nanf(""));
    EXPECT_NE(load_error(c).find("tensor output_norm.weight has a NaN or infinite weight in element 3"),
              std::string::npos)
            << load_error(c);
    c = kvllm_test::tiny_llama();
    set_weight(c, "blk.1.ffn_up.weight", 32 * 5 + 7, -inf); // row 5 of [48][32]
    EXPECT_NE(load_error(c).find("tensor blk.1.ffn_up.weight has a NaN or infinite weight in row 5"),
              std::string::npos)
            << load_error(c);
}

TEST(KvllmErrors, NonFiniteLogitsAreRefused) {
    // finite weights whose activations overflow: the norm gains at 3e38
    GgufContent c = kvllm_test::tiny_llama();
    for (size_t i = 0; i < 32; i++) set_weight(c, "output_norm.weight", i, 3e38f);
    Tiny m(c);
    const std::vector<int> ids = m.tok.encode(" the rather", false);
    std::vector<float> logits(ids.size() * size_t(m.llm.cfg.n_vocab));
    EXPECT_THROW_MSG_AS(
            std::exception,
            m.llm.prefill(ids.data(), int64_t(ids.size()), logits.data(), 0),
            "the activations overflowed");
    EXPECT_THROW_MSG_AS(
            std::exception,
            generate_text(m.llm, m.tok, ids, 4, "Flat", "Flat"),
            "the activations overflowed");
}

namespace {

struct CliResult {
    int status; ///< exit status, -1 when killed by a signal
    std::string output; ///< stdout and stderr
};

/// Runs `PREFIX kvllm ARGS` in a shell (args quoted for it; a prefix sets
/// the environment or pipes into kvllm).
CliResult kvllm_cli(const std::string& args, const std::string& prefix = "") {
    const std::string cmd = prefix + " " + KVLLM_BINARY + " " + args + " 2>&1";
    FILE* p = popen(cmd.c_str(), "r");
    if (!p) {
        throw std::runtime_error("cannot run " + cmd);
    }
    std::string out;
    char buf[4096];
    for (size_t n; (n = fread(buf, 1, sizeof(buf), p)) > 0;) out.append(buf, n);
    const int st = pclose(p);
    return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

/// The tiny model's file and a short text file, written once.
struct CliFiles {
    std::string model = kvllm_test::tiny_llama_file("tiny_cli.gguf");
    std::string text = write_text("tiny_cli.txt", 3000);
    static std::string write_text(const std::string& name, size_t n) {
        std::string t;
        while (t.size() < n) t += " the rather aaaa there";
        return kvllm_test::write_temp(name, std::vector<uint8_t>(t.begin(), t.end()));
    }
};

const CliFiles& cli_files() {
    static const CliFiles files;
    return files;
}

/// Expects `kvllm CMD --model tiny ARGS` to fail (status 1) with "kvllm CMD: " and fragment.
void expect_cli_error(const std::string& cmd, const std::string& args, const std::string& fragment) {
    const CliResult r = kvllm_cli(cmd + " --model " + cli_files().model + " " + args);
    EXPECT_EQ(r.status, 1) << cmd << " " << args << ": " << r.output;
    EXPECT_NE(r.output.find("kvllm " + cmd + ": "), std::string::npos) << cmd << " " << args << ": " << r.output;
    EXPECT_NE(r.output.find(fragment), std::string::npos) << cmd << " " << args << ": " << r.output;
    EXPECT_EQ(r.output.find("Error in "), std::string::npos) << "a source location: " << r.output;
    EXPECT_EQ(r.output.find("Error: '"), std::string::npos) << "a failed condition: " << r.output;
}

void expect_cli_ok(const std::string& cmd, const std::string& args) {
    const CliResult r = kvllm_cli(cmd + " --model " + cli_files().model + " " + args);
    EXPECT_EQ(r.status, 0) << cmd << " " << args << ": " << r.output;
}

} // namespace

// The cache kvllm train writes for a string without wrappers: its heads
// carry the models' RoPE while empty, which the cache took for heads out
// of step, so the write failed after the training ran.
TEST(KvllmCli, ABareIVFAsymStringTrainsAndIsAdopted) {
    const std::string cache = testing::TempDir() + "tiny_bare_ivfasym.cache";
    expect_cli_ok("train", "--text-file " + cli_files().text +
                          " --context 600 --min-distance 100 --iterations 2 --index IVFAsym4 --out " + cache);
    expect_cli_ok("e2e", "--text-file " + cli_files().text + " --context 600 --index IVFAsym4 --trained " + cache);
    // under another C it is refused, naming the head
    expect_cli_error("e2e", "--text-file " + cli_files().text + " --context 600 --index IVFAsym8 --trained " + cache,
                     "layer 0, KV head 0: adopt_trained: the trained index has d=");
}

// Each of these was silently replaced by a default (or ignored).
TEST(KvllmCli, BadValuesAreRefusedNotDefaulted) {
    const std::string out = testing::TempDir() + "tiny_cli_logits.npy";
    const std::string ids = "--ids '1 2 3' --out " + out;
    expect_cli_ok("logits", ids);
    expect_cli_ok("logits", ids + " --prefill 2 --index Window2,Flat");
    expect_cli_error("logits", ids + " --prefill -5", "--prefill -5 outside [1, 3]"); // was "all prefilled"
    expect_cli_error("logits", ids + " --prefill 0", "--prefill 0 outside [1, 3]");
    expect_cli_error("logits", ids + " --index Bogus", "give --prefill N"); // was ignored
    expect_cli_error("logits", ids + " --gpu", "give --prefill N");
    const CliResult r = kvllm_cli("logits --model '' " + ids); // was the default model
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("kvllm logits: --model: empty path"), std::string::npos) << r.output;

    const std::string trace = " --text-file " + cli_files().text + " --out " + testing::TempDir() + "tiny_trace";
    expect_cli_ok("trace", trace + " --tokens 200 --n-ctx -1");
    expect_cli_error("trace", trace + " --tokens 200 --n-ctx -5", "n_ctx=-5 must be in [1, n_tokens=200]");

    // budgets in percent of the prompt, as every tool takes them
    expect_cli_ok("logits", ids + " --prefill 2 --index 'TopK(Flat)|k=50%'");
    expect_cli_ok("generate", "--prompt 'the rather' --max-new 2 --index 'TopK(Flat)|k=50%'");
    expect_cli_error("generate", "--prompt 'the rather' --max-new 2 --index 'TopK(Flat)|nprobe=5%'",
                     "nprobe");
    expect_cli_error("generate", "--prompt 'the rather' --max-new -1", "--max-new -1: need at least 1");
    expect_cli_error("generate", "--prompt 'the rather' --max-new 0", "--max-new 0: need at least 1");
    // past the model's context (it ran on, 181 s for nonsense)
    expect_cli_error("generate", "--prompt 'the rather' --max-new 100000", "exceed the model's context of");
    std::string many; // 1025 ids: one past the tiny model's context_length of 1024
    for (int i = 0; i < 1025; i++) many += "1 ";
    expect_cli_error("logits", "--out " + out + " --ids '" + many + "'", "more than the model's context of 1024");

    const std::string train = " --text-file " + cli_files().text + " --context 600 --min-distance 100 --out " +
                              testing::TempDir() + "tiny_train.cache";
    expect_cli_error("train", train + " --iterations -5", "--iterations -5 must be >= 1 (-1: the default)");
    expect_cli_error("train", train + " --iterations 0", "--iterations 0 must be >= 1");
    expect_cli_error("train", train + " --hidden -7", "--hidden -7 must be >= 1");
    expect_cli_error("train", train + " --queries-per-prompt -3", "--queries-per-prompt -3 must be >= 1");
    expect_cli_error("train", train + " --max-tokens -1", "--max-tokens -1 must be >= 0 (0: all)");

    expect_cli_error("e2e", "--text-file " + cli_files().text + " --context '' --index Flat",
                     "e2e needs a context and an index");
    expect_cli_error("needle", "--context '' --index Flat", "needle needs a context");
    expect_cli_error("needle", "--depths '' --index Flat", "needle needs a context, a depth");
}

namespace {

/// What loading a file of this content as a model (no tokenizer) throws.
std::string model_error(const GgufContent& c) {
    return error_of([&] {
        GgufFile f(kvllm_test::write_temp("tiny_model_error.gguf", c.bytes()));
        LlamaModel m(f);
    });
}

} // namespace

TEST(KvllmErrors, FilesThatAreNotRegularFilesAreNamed) {
    const std::string dir = testing::TempDir() + "kvllm_a_dir";
    const std::string fifo = testing::TempDir() + "kvllm_a_fifo";
    std::filesystem::create_directories(dir);
    std::filesystem::remove(fifo);
    ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
    // a directory or pipe was read as a file of size -1: std::bad_alloc
    EXPECT_THROW_MSG_AS(std::exception, GgufFile f(dir), "GGUF file " + dir + ": is a directory");
    EXPECT_THROW_MSG_AS(
            std::exception,
            GgufFile f(fifo),
            "GGUF file " + fifo + ": is not a regular file"); // without blocking in open
    EXPECT_THROW_MSG_AS(std::exception, GgufFile f(dir + "/missing.gguf"), "missing.gguf: does not exist");

    const CliResult as_model = kvllm_cli("tokenize --model " + dir + " --text-file " + cli_files().text);
    EXPECT_EQ(as_model.status, 1);
    EXPECT_NE(as_model.output.find("kvllm tokenize: GGUF file " + dir + ": is a directory"), std::string::npos)
            << as_model.output;
    const CliResult as_env = kvllm_cli("tokenize --text-file " + cli_files().text, "KVINDEX_GGUF=" + dir);
    EXPECT_NE(as_env.output.find("kvllm tokenize: GGUF file " + dir + ": is a directory"), std::string::npos)
            << as_env.output;
    const CliResult piped = kvllm_cli("tokenize --model /dev/stdin --text-file " + cli_files().text, "echo x |");
    EXPECT_EQ(piped.status, 1);
    EXPECT_NE(piped.output.find("GGUF file /dev/stdin: is not a regular file"), std::string::npos) << piped.output;
    // a directory as the text read as empty: exit status 0
    expect_cli_error("tokenize", "--text-file " + dir, dir + " is a directory");
    expect_cli_error("e2e", "--text-file " + dir + " --index Flat", dir + " is a directory");
}

TEST(KvllmErrors, BadTokenIdsAreNamed) {
    expect_cli_ok("detokenize", "--ids '1 2 3'");
    // were "stoi"
    expect_cli_error("detokenize", "--ids '1 abc'", "--ids: element 2, \"abc\", is not a token id");
    expect_cli_error("detokenize", "--ids '99999999999'",
                     "--ids: element 1, \"99999999999\", is not a token id (out of range)");
    expect_cli_error("detokenize", "--ids '1 2x'", "element 2, \"2x\"");
    expect_cli_error("detokenize", "--ids '1 -1'", "token id -1 outside [0, ");
}

TEST(KvllmErrors, AByteWithoutATokenIsNamedWithItsOffset) {
    std::vector<std::string> vocab = kvllm_test::tiny_vocab();
    for (uint8_t b : {uint8_t(0x04), uint8_t(0xff)}) {
        vocab.erase(std::find(vocab.begin(), vocab.end(), byte_symbol(b)));
    }
    Tiny m(kvllm_test::tiny_llama(vocab));
    EXPECT_EQ(m.tok.decode(m.tok.encode("the rather", false)), "the rather");
    // was "byte symbol Ą is not in the vocabulary"
    EXPECT_THROW_MSG_AS(
            std::exception,
            m.tok.encode("the rather \x04!", false),
            "byte 0x04 at offset 11 of the text has no token");
    EXPECT_THROW_MSG_AS(
            std::exception,
            m.tok.encode("<|im_start|>ab\xff", true),
            "byte 0xff at offset 14 of the text has no token");
}

TEST(KvllmErrors, VocabularyAndEmbeddingMustAgree) {
    EXPECT_EQ(model_error(kvllm_test::tiny_llama()), "");
    std::vector<std::string> vocab = kvllm_test::tiny_vocab();
    GgufContent c = kvllm_test::tiny_llama(vocab);
    vocab.pop_back();
    c.set_strings("tokenizer.ggml.tokens", vocab);
    EXPECT_NE(model_error(c).find("tokenizer.ggml.tokens has " + std::to_string(vocab.size()) +
                                  " tokens, token_embd.weight " + std::to_string(vocab.size() + 1) + " rows"),
              std::string::npos)
            << model_error(c);
    // was "expected [ 32 0 ]"
    c = kvllm_test::tiny_llama();
    kvllm_test::TinyTensor& emb = c.tensor("token_embd.weight");
    emb.shape = {emb.shape[0] * emb.shape[1]};
    EXPECT_NE(model_error(c).find("token_embd.weight has shape [ " + std::to_string(emb.shape[0]) +
                                  " ] where [ embedding_length n_vocab ] is expected"),
              std::string::npos)
            << model_error(c);
}

TEST(KvllmErrors, ANormStoredAsAQuantizedTypeIsRefused) {
    // the probe changed a norm's type from F32 to Q8_0: the model loaded and
    // answered nonsense; a norm's gains are F32 (or F16) in every converter
    GgufContent c = kvllm_test::tiny_llama();
    c.tensor("blk.0.attn_norm.weight").type = 8; // Q8_0, the bytes left as they were
    EXPECT_NE(model_error(c).find("tensor 'blk.0.attn_norm.weight' is Q8_0; a norm's gains must be F32"),
              std::string::npos)
            << model_error(c);
}

}  // namespace test_llm_errors
