// Writes the seed corpora of the libFuzzer targets, made by the library
// itself (scripts/run_fuzzers.sh runs it):
//
//   kvindex_fuzz_make_seeds DIR
//
//   DIR/read_index/  saved indexes of the conformance strings and of a few
//                    more retriever families (64 tokens, d = 8), plus the
//                    golden files of tests/data/golden
//   DIR/factory/     factory strings, with and without "|params"
//   DIR/trace/       .npy files and trace directories, in fuzz_trace's format
//   DIR/gguf/        tiny GGUF files (v3 and v2) written here, byte by byte

#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <kvindex/IndexTopK.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>
#include <kvindex/trace.h>

#include "conformance_list.h"
#include "fuzz_common.h"

namespace fs = std::filesystem;
using kvindex::idx_t;

namespace {

constexpr int kD = 8;
constexpr int kDValue = 8;

int n_written = 0;

void put(const fs::path& path, const std::vector<uint8_t>& bytes) {
    kvfuzz::write_file(path.string(), bytes.data(), bytes.size());
    n_written++;
}

void put(const fs::path& path, const std::string& s) {
    put(path, std::vector<uint8_t>(s.begin(), s.end()));
}

std::vector<uint8_t> slurp(const fs::path& path) {
    std::ifstream f(path, std::ios::binary);
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

std::string stem_of(const std::string& s) {
    std::string out;
    for (char c : s) {
        out += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
    }
    return out;
}

// ---- read_index and factory ---------------------------------------------------

struct Spec {
    std::string factory;
    std::string knobs;
};

std::vector<Spec> specs() {
    std::vector<Spec> v;
    for (const auto& c : kvtest::kConformance) {
        v.push_back({c.factory, c.knobs});
    }
    // more retriever families the reader validates (faiss_checks.h)
    for (const char* f : {"TopK(SQ8)", "TopK(PQ4x4)", "TopK(IVF4,SQ8)", "TopK(IVF4,PQ4x4)",
                          "TopK(IVF4_HNSW8,Flat)", "TopK(HNSW8_SQ8)", "Sink2,Flat",
                          "Window8,Flat", "ProxyEvict10_H2O", "ProxyEvict20,TopK(HNSW8)"}) {
        v.push_back({f, "k=7"});
    }
    return v;
}

std::unique_ptr<kvindex::KVIndex> build(const Spec& s) {
    auto index = kvindex::index_factory(kD, s.factory, kDValue);
    if (auto topk = dynamic_cast<kvindex::IndexTopK*>(index.get())) {
        // a product quantizer waits for 39 keys per centroid: the seeds are
        // smaller, and must hold trained codebooks for the reader to walk
        topk->min_train_points = std::min<kvindex::idx_t>(topk->min_train_points, 16);
    }
    const idx_t n_prefill = 48, n = 64;
    std::vector<float> keys = kvfuzz::det_floats(n * kD, 11);
    std::vector<float> values = kvfuzz::det_floats(n * kDValue, 12);
    std::vector<float> queries = kvfuzz::det_floats(2 * n_prefill * kD, 13, 1.5f);
    kvindex::PrefillInput in;
    in.n_tokens = n_prefill;
    in.keys = keys.data();
    in.values = values.data();
    in.n_queries = n_prefill;
    in.n_query_heads = 2;
    in.queries = queries.data();
    index->prefill(in);
    for (idx_t i = n_prefill; i < n; i++) {
        index->add_kv(1, keys.data() + i * kD, values.data() + i * kDValue);
    }
    if (!s.knobs.empty()) {
        kvindex::set_index_parameters(index.get(), s.knobs);
    }
    return index;
}

void read_index_and_factory_seeds(const fs::path& out) {
    fs::path ri = out / "read_index", fac = out / "factory";
    int i = 0;
    for (const Spec& s : specs()) {
        char num[8];
        std::snprintf(num, sizeof(num), "%02d_", i++);
        put(fac / (num + stem_of(s.factory)), s.factory);
        if (!s.knobs.empty()) {
            put(fac / (num + stem_of(s.factory) + "_params"), s.factory + "|" + s.knobs);
        }
        try {
            auto index = build(s);
            std::vector<uint8_t> buf;
            kvindex::write_index(index.get(), &buf);
            put(ri / (num + stem_of(s.factory) + ".kvix"), buf);
            // the empty index too: a record with no tokens
            auto empty = kvindex::index_factory(kD, s.factory, kDValue);
            kvindex::write_index(empty.get(), &buf);
            put(ri / (num + stem_of(s.factory) + ".empty.kvix"), buf);
        } catch (const std::exception& e) {
            std::fprintf(stderr, "make_seeds: skipping read_index seed %s: %s\n",
                         s.factory.c_str(), e.what());
        }
    }
    // strings with percentages and several knobs
    for (const char* f : {"TopK(Flat)|k=5%", "TopK(IVF4,Flat)|k=7,nprobe=2",
                          "TopK(HNSW8)|k=7,efSearch=24", "LSHSample6x20|min_hits=3,max_sample=30",
                          "ProxyEvict20|budget=16,protect=10", "Sink4,Window8,TopK(Flat)|k=7"}) {
        put(fac / ("p_" + stem_of(f)), std::string(f));
    }
    // the golden files of every format version
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(KVINDEX_GOLDEN_DIR, ec)) {
        if (e.path().extension() == ".kvix") {
            put(ri / ("golden_" + e.path().filename().string()), slurp(e.path()));
        }
    }
}

// ---- trace --------------------------------------------------------------------

const std::string kTraceSeparator = "#KVFUZZ#"; // as in fuzz_trace.cpp

void trace_seeds(const fs::path& out) {
    fs::path tr = out / "trace";
    fs::path tmp = fs::path(kvfuzz::temp_dir()) / "trace";
    fs::create_directories(tmp);

    // selector 0: one .npy file
    auto npy = [&](const std::string& name, const std::string& dtype,
                   const std::vector<size_t>& shape, const void* data) {
        fs::path p = tmp / (name + ".npy");
        kvindex::write_npy(p.string(), dtype, shape, data);
        std::vector<uint8_t> bytes = slurp(p);
        bytes.insert(bytes.begin(), uint8_t(0));
        put(tr / ("npy_" + name), bytes);
        return bytes;
    };
    std::vector<float> f = kvfuzz::det_floats(24, 21);
    std::vector<uint16_t> h(6);
    for (size_t i = 0; i < h.size(); i++) {
        h[i] = kvindex::float_to_half(f[i]);
    }
    int64_t ints[6] = {0, 1, -1, 42, INT64_MAX, INT64_MIN};
    npy("f4_2x3x4", "<f4", {2, 3, 4}, f.data());
    npy("f2_6", "<f2", {6}, h.data());
    npy("i8_3x2", "<i8", {3, 2}, ints);
    npy("f4_scalar", "<f4", {}, f.data());
    std::vector<uint8_t> v1 = npy("f4_0x5", "<f4", {0, 5}, f.data());
    // the same array as npy version 2.0 (4-byte header length)
    std::vector<uint8_t> v2(v1.begin(), v1.begin() + 9);
    v2[7] = 2;
    uint16_t hl = uint16_t(v1[9] | (v1[10] << 8));
    uint32_t hl4 = hl;
    const uint8_t* p4 = reinterpret_cast<const uint8_t*>(&hl4);
    v2.insert(v2.end(), p4, p4 + 4);
    v2.insert(v2.end(), v1.begin() + 11, v1.end());
    put(tr / "npy_f4_0x5_v2", v2);

    // selector 1: meta.json SEP keys.npy SEP values.npy SEP queries.npy
    for (const char* dtype : {"float32", "float16"}) {
        kvindex::TraceMeta m;
        m.n_layers = 1;
        m.n_q_heads = 2;
        m.n_kv_heads = 1;
        m.head_dim = 4;
        m.n_tokens = 3;
        m.n_ctx = 2;
        m.source = "make_seeds";
        m.dtype = dtype;
        fs::path dir = tmp / (std::string("dir_") + dtype);
        kvindex::TraceLayer t;
        t.keys = kvfuzz::det_floats(12, 31);
        t.values = kvfuzz::det_floats(12, 32);
        t.queries = kvfuzz::det_floats(24, 33);
        kvindex::write_trace_meta(dir.string(), m);
        kvindex::write_trace_layer(dir.string(), m, 0, t);
        std::vector<uint8_t> meta = slurp(dir / "meta.json");
        std::vector<uint8_t> seed = {1};
        seed.insert(seed.end(), meta.begin(), meta.end());
        for (const char* name : {"keys", "values", "queries"}) {
            std::vector<uint8_t> a = slurp(dir / "layer_0" / (std::string(name) + ".npy"));
            seed.insert(seed.end(), kTraceSeparator.begin(), kTraceSeparator.end());
            seed.insert(seed.end(), a.begin(), a.end());
        }
        put(tr / (std::string("dir_") + dtype), seed);
        // meta.json alone, and without its optional dtype
        meta.insert(meta.begin(), uint8_t(1));
        put(tr / (std::string("meta_") + dtype), meta);
    }
    put(tr / "meta_no_dtype",
        std::string("\x01{\"format\": \"kvindex-trace-v1\", \"n_layers\": 2, \"n_q_heads\": 4, "
                    "\"n_kv_heads\": 2, \"head_dim\": 8, \"n_tokens\": 16, \"n_ctx\": 8, "
                    "\"rope_theta\": 500000.0, \"rope_style\": \"interleaved\", "
                    "\"source\": \"x\"}"));
}

// ---- gguf ---------------------------------------------------------------------

struct GgufWriter {
    std::vector<uint8_t> b;

    template <class T>
    void raw(T v) {
        const uint8_t* p = reinterpret_cast<const uint8_t*>(&v);
        b.insert(b.end(), p, p + sizeof(T));
    }
    void str(const std::string& s) {
        raw<uint64_t>(s.size());
        b.insert(b.end(), s.begin(), s.end());
    }
    void align(size_t a) {
        while (b.size() % a) {
            b.push_back(0);
        }
    }
};

enum : uint32_t {
    kU8 = 0, kI8, kU16, kI16, kU32, kI32, kF32, kBool, kString, kArray, kU64, kI64, kF64
};

struct TensorSeed {
    std::string name;
    uint32_t type;
    std::vector<uint64_t> shape;
    std::vector<uint8_t> data;
};

std::vector<uint8_t> gguf_file(uint32_t version, bool with_tensors) {
    std::vector<TensorSeed> tensors;
    if (with_tensors) {
        std::vector<float> x = kvfuzz::det_floats(16, 41);
        std::vector<uint8_t> f32(64);
        std::memcpy(f32.data(), x.data(), 64);
        std::vector<uint8_t> f16;
        for (int i = 0; i < 16; i++) {
            uint16_t v = kvindex::float_to_half(x[i]);
            f16.push_back(uint8_t(v));
            f16.push_back(uint8_t(v >> 8));
        }
        auto block = [](size_t header, size_t body, uint8_t seed) {
            std::vector<uint8_t> v;
            uint16_t d = kvindex::float_to_half(0.125f), m = kvindex::float_to_half(-0.5f);
            v.push_back(uint8_t(d));
            v.push_back(uint8_t(d >> 8));
            if (header == 4) {
                v.push_back(uint8_t(m));
                v.push_back(uint8_t(m >> 8));
            }
            for (size_t i = 0; i < body; i++) {
                v.push_back(uint8_t(seed + 37 * i));
            }
            return v;
        };
        std::vector<uint8_t> q41 = block(4, 16, 1), q41b = block(4, 16, 2);
        q41.insert(q41.end(), q41b.begin(), q41b.end());
        std::vector<uint8_t> q80 = block(2, 32, 3), q80b = block(2, 32, 4);
        q80.insert(q80.end(), q80b.begin(), q80b.end());
        tensors = {{"token_embd.weight", 0, {8, 2}, f32},
                   {"output_norm.weight", 1, {16}, f16},
                   {"blk.0.attn_q.weight", 2, {32}, block(2, 16, 5)},
                   {"blk.0.attn_k.weight", 3, {32, 2}, q41},
                   {"blk.0.ffn_up.weight", 8, {64}, q80}};
    }
    GgufWriter w;
    w.b = {'G', 'G', 'U', 'F'};
    w.raw<uint32_t>(version);
    w.raw<uint64_t>(tensors.size());
    w.raw<uint64_t>(17); // metadata count, as written below
    w.str("general.architecture"); w.raw<uint32_t>(kString); w.str("llama");
    w.str("general.alignment"); w.raw<uint32_t>(kU32); w.raw<uint32_t>(32);
    w.str("llama.context_length"); w.raw<uint32_t>(kU32); w.raw<uint32_t>(2048);
    w.str("llama.rope.freq_base"); w.raw<uint32_t>(kF32); w.raw<float>(10000.0f);
    w.str("llama.block_count"); w.raw<uint32_t>(kU64); w.raw<uint64_t>(1);
    w.str("k.u8"); w.raw<uint32_t>(kU8); w.raw<uint8_t>(200);
    w.str("k.i8"); w.raw<uint32_t>(kI8); w.raw<int8_t>(-5);
    w.str("k.u16"); w.raw<uint32_t>(kU16); w.raw<uint16_t>(60000);
    w.str("k.i16"); w.raw<uint32_t>(kI16); w.raw<int16_t>(-300);
    w.str("k.i32"); w.raw<uint32_t>(kI32); w.raw<int32_t>(-70000);
    w.str("k.i64"); w.raw<uint32_t>(kI64); w.raw<int64_t>(-(int64_t(1) << 40));
    w.str("k.f64"); w.raw<uint32_t>(kF64); w.raw<double>(0.5);
    w.str("k.bool"); w.raw<uint32_t>(kBool); w.raw<uint8_t>(1);
    w.str("tokenizer.ggml.tokens"); w.raw<uint32_t>(kArray); w.raw<uint32_t>(kString);
    w.raw<uint64_t>(3); w.str("<s>"); w.str("a"); w.str("b");
    w.str("tokenizer.ggml.token_type"); w.raw<uint32_t>(kArray); w.raw<uint32_t>(kI32);
    w.raw<uint64_t>(3); w.raw<int32_t>(3); w.raw<int32_t>(1); w.raw<int32_t>(1);
    w.str("tokenizer.ggml.scores"); w.raw<uint32_t>(kArray); w.raw<uint32_t>(kF32);
    w.raw<uint64_t>(3); w.raw<float>(0.0f); w.raw<float>(-1.0f); w.raw<float>(-2.0f);
    w.str("tokenizer.ggml.merges"); w.raw<uint32_t>(kArray); w.raw<uint32_t>(kString);
    w.raw<uint64_t>(1); w.str("a b");
    uint64_t offset = 0;
    std::vector<uint64_t> offsets;
    for (const TensorSeed& t : tensors) {
        w.str(t.name);
        w.raw<uint32_t>(uint32_t(t.shape.size()));
        for (uint64_t s : t.shape) {
            w.raw<uint64_t>(s);
        }
        w.raw<uint32_t>(t.type);
        w.raw<uint64_t>(offset);
        offsets.push_back(offset);
        offset = (offset + t.data.size() + 31) / 32 * 32;
    }
    w.align(32);
    size_t data_start = w.b.size();
    for (size_t i = 0; i < tensors.size(); i++) {
        w.b.resize(data_start + offsets[i]);
        w.b.insert(w.b.end(), tensors[i].data.begin(), tensors[i].data.end());
    }
    return w.b;
}

void gguf_seeds(const fs::path& out) {
    put(out / "gguf" / "v3", gguf_file(3, true));
    put(out / "gguf" / "v2", gguf_file(2, true));
    put(out / "gguf" / "v3_no_tensors", gguf_file(3, false));
}

} // namespace

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    kvfuzz::single_thread(); // HNSW graphs reproducible
    fs::path out = argv[1];
    for (const char* sub : {"read_index", "factory", "trace", "gguf"}) {
        fs::create_directories(out / sub);
    }
    try {
        read_index_and_factory_seeds(out);
        trace_seeds(out);
        gguf_seeds(out);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "make_seeds: %s\n", e.what());
        return 1;
    }
    std::printf("make_seeds: wrote %d seeds into %s\n", n_written, out.string().c_str());
    return 0;
}
