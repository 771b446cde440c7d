#pragma once

// GGUF files written by the tests: a byte-level writer, and a tiny Llama
// model (2 layers, width 32, F32 weights) with a byte-level BPE vocabulary
// of its own. Every kvllm path runs on it in milliseconds without the
// SmolLM2 file, and a test can break one metadata value or weight and check
// the error it gets.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "tokenizer.h"

namespace kvllm_test {

/// Little-endian bytes of a GGUF file.
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

/// A tensor of F32 values (ggml type 0).
inline TinyTensor f32_tensor(const std::string& name, const std::vector<uint64_t>& shape,
                             const std::vector<float>& values) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(values.data());
    return {name, 0, shape, std::vector<uint8_t>(p, p + values.size() * sizeof(float))};
}

/// GGUF metadata value types.
enum GgufType : uint32_t { kI32 = 5, kU32 = 4, kF32 = 6, kBool = 7, kString = 8, kArray = 9, kU64 = 10, kF64 = 12 };

/** What a GGUF file holds: metadata entries in file order (add() may
 * repeat a key, as a corrupt file would) and tensors. */
struct GgufContent {
    struct Entry {
        std::string key;
        uint32_t type;
        std::vector<uint8_t> value; ///< the value's bytes as the file has them
    };
    std::vector<Entry> metadata;
    std::vector<TinyTensor> tensors;

    void add(const std::string& key, uint32_t type, std::vector<uint8_t> value) {
        metadata.push_back({key, type, std::move(value)});
    }
    /// Replaces the value of key, or adds it.
    void set(const std::string& key, uint32_t type, std::vector<uint8_t> value) {
        for (Entry& e : metadata) {
            if (e.key == key) {
                e = {key, type, std::move(value)};
                return;
            }
        }
        add(key, type, std::move(value));
    }
    template <class T>
    void set_scalar(const std::string& key, uint32_t type, T v) {
        GgufWriter w;
        w.put(v);
        set(key, type, w.b);
    }
    void set_string(const std::string& key, const std::string& s) {
        GgufWriter w;
        w.str(s);
        set(key, kString, w.b);
    }
    void set_strings(const std::string& key, const std::vector<std::string>& v) {
        GgufWriter w;
        w.put<uint32_t>(kString);
        w.put<uint64_t>(v.size());
        for (const std::string& s : v) w.str(s);
        set(key, kArray, w.b);
    }
    void set_i32s(const std::string& key, const std::vector<int32_t>& v) {
        GgufWriter w;
        w.put<uint32_t>(kI32);
        w.put<uint64_t>(v.size());
        for (int32_t x : v) w.put(x);
        set(key, kArray, w.b);
    }
    TinyTensor& tensor(const std::string& name) {
        for (TinyTensor& t : tensors) {
            if (t.name == name) return t;
        }
        throw std::logic_error("test model has no tensor " + name);
    }
    /// Bytes of a GGUF v3 file, tensors aligned to 32 bytes.
    std::vector<uint8_t> bytes() const {
        GgufWriter w;
        w.b.insert(w.b.end(), {'G', 'G', 'U', 'F'});
        w.put<uint32_t>(3);
        w.put<uint64_t>(tensors.size());
        w.put<uint64_t>(metadata.size());
        for (const Entry& e : metadata) {
            w.str(e.key);
            w.put(e.type);
            w.b.insert(w.b.end(), e.value.begin(), e.value.end());
        }
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
};

/// A file in the temporary directory, named after the running test too:
/// ctest runs the tests in parallel processes, which must not rewrite a
/// file another one is reading.
inline std::string write_temp(const std::string& name, const std::vector<uint8_t>& bytes) {
    const testing::TestInfo* test = testing::UnitTest::GetInstance()->current_test_info();
    std::string prefix = test ? std::string(test->test_suite_name()) + "." + test->name() + "." : "";
    std::replace(prefix.begin(), prefix.end(), '/', '_'); // parameterized names
    const std::string path = testing::TempDir() + prefix + name;
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return path;
}

/// The tiny model's merges, in rank order: chains ("a a", "aa a", "aa aa"),
/// pairs that compete for a symbol ("t h" / "h e" / "th e"), and "b b",
/// whose result is not a token (encoding falls back to its bytes).
inline std::vector<std::string> tiny_merges() {
    return {"a a", "Ġ t", "t h", "h e", "th e", "aa aa", "aa a", "Ġt he", "Ġ a", "b b", "e r",
            "Ġa aa", "aaaa aaaa", "aaa a", "Ġthe r"};
}

/// The tiny vocabulary: the 256 byte symbols, every merge's result but
/// "bb", and the chat control tokens.
inline std::vector<std::string> tiny_vocab() {
    std::vector<std::string> v;
    for (int b = 0; b < 256; b++) v.push_back(kvllm::byte_symbol(uint8_t(b)));
    for (const std::string& m : tiny_merges()) {
        std::string joined = m.substr(0, m.find(' ')) + m.substr(m.find(' ') + 1);
        if (joined != "bb" && std::find(v.begin(), v.end(), joined) == v.end()) v.push_back(joined);
    }
    for (const char* s : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) v.push_back(s);
    return v;
}

/** A Llama with 2 layers, width 32, 4 query and 2 KV heads of 8, MLP
 * width 48, context 1024, seeded random F32 weights; `vocab` sizes the
 * embedding. Control tokens are those of the form "<|...|>". */
inline GgufContent tiny_llama(const std::vector<std::string>& vocab = tiny_vocab(), uint32_t seed = 1) {
    const uint64_t D = 32, F = 48, H = 4, KV = 2, hd = D / H, L = 2, V = vocab.size();
    GgufContent c;
    c.set_string("general.architecture", "llama");
    c.set_scalar<uint32_t>("llama.block_count", kU32, L);
    c.set_scalar<uint32_t>("llama.embedding_length", kU32, D);
    c.set_scalar<uint32_t>("llama.feed_forward_length", kU32, F);
    c.set_scalar<uint32_t>("llama.attention.head_count", kU32, H);
    c.set_scalar<uint32_t>("llama.attention.head_count_kv", kU32, KV);
    c.set_scalar<uint32_t>("llama.context_length", kU32, 1024);
    c.set_scalar<float>("llama.attention.layer_norm_rms_epsilon", kF32, 1e-5f);
    c.set_scalar<float>("llama.rope.freq_base", kF32, 10000.0f);
    c.set_string("tokenizer.ggml.model", "gpt2");
    c.set_string("tokenizer.ggml.pre", "smollm");
    c.set_strings("tokenizer.ggml.tokens", vocab);
    std::vector<int32_t> types;
    for (const std::string& t : vocab) types.push_back(t.rfind("<|", 0) == 0 ? 3 : 1);
    c.set_i32s("tokenizer.ggml.token_type", types);
    c.set_strings("tokenizer.ggml.merges", tiny_merges());
    c.set_scalar<uint32_t>("tokenizer.ggml.eos_token_id", kU32, uint32_t(V - 1));

    std::mt19937 rng(seed);
    auto random = [&](std::vector<uint64_t> shape, float scale, float mean = 0) {
        std::normal_distribution<float> g(mean, scale);
        uint64_t n = 1;
        for (uint64_t s : shape) n *= s;
        std::vector<float> v(n);
        for (float& x : v) x = g(rng);
        return v;
    };
    auto add = [&](const std::string& name, std::vector<uint64_t> shape, float scale, float mean = 0) {
        c.tensors.push_back(f32_tensor(name, shape, random(shape, scale, mean)));
    };
    add("token_embd.weight", {D, V}, 1.0f);
    add("output_norm.weight", {D}, 0.1f, 1.0f);
    for (uint64_t l = 0; l < L; l++) {
        const std::string p = "blk." + std::to_string(l) + ".";
        add(p + "attn_norm.weight", {D}, 0.1f, 1.0f);
        add(p + "attn_q.weight", {D, H * hd}, 0.3f);
        add(p + "attn_k.weight", {D, KV * hd}, 0.3f);
        add(p + "attn_v.weight", {D, KV * hd}, 0.3f);
        add(p + "attn_output.weight", {H * hd, D}, 0.2f);
        add(p + "ffn_norm.weight", {D}, 0.1f, 1.0f);
        add(p + "ffn_gate.weight", {D, F}, 0.2f);
        add(p + "ffn_up.weight", {D, F}, 0.2f);
        add(p + "ffn_down.weight", {F, D}, 0.2f);
    }
    return c;
}

/// tiny_llama() written to a temporary file; returns its path.
inline std::string tiny_llama_file(const std::string& name, const GgufContent& c = tiny_llama()) {
    return write_temp(name, c.bytes());
}

} // namespace kvllm_test
