// Trace files: round trips, float16, and every malformed case named.

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/trace.h>

#include "expect_throw.h"
#include "reference.h"

using namespace kvindex;
namespace fs = std::filesystem;

namespace {

TraceMeta small_meta(const std::string& dtype = "float32") {
    TraceMeta m;
    m.n_layers = 2;
    m.n_q_heads = 4;
    m.n_kv_heads = 2;
    m.head_dim = 8;
    m.n_tokens = 12;
    m.n_ctx = 9;
    m.rope_theta = 500000;
    m.rope_style = RopeStyle::interleaved;
    m.source = "test";
    m.dtype = dtype;
    return m;
}

TraceLayer small_layer(const TraceMeta& m, uint64_t seed) {
    TraceLayer t;
    size_t kv = size_t(m.n_kv_heads) * m.n_tokens * m.head_dim;
    t.keys = kvtest::gaussian(1, kv, seed);
    t.values = kvtest::gaussian(1, kv, seed + 1);
    t.queries = kvtest::gaussian(1, kv * (m.n_q_heads / m.n_kv_heads), seed + 2);
    return t;
}

/// A fresh directory holding a valid two-layer trace.
std::string write_small_trace(const std::string& name, const std::string& dtype = "float32") {
    std::string dir = ::testing::TempDir() + "/trace_" + name;
    fs::remove_all(dir);
    TraceMeta m = small_meta(dtype);
    write_trace_meta(dir, m);
    for (int l = 0; l < m.n_layers; l++) {
        write_trace_layer(dir, m, l, small_layer(m, 10 * l + 1));
    }
    return dir;
}

std::string read_text(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
}

void write_text(const std::string& path, const std::string& s) {
    std::ofstream(path, std::ios::binary) << s;
}

/// Rewrites a field of meta.json with a raw JSON value.
void set_meta_field(const std::string& dir, const std::string& field, const std::string& value) {
    std::string s = read_text(dir + "/meta.json");
    size_t k = s.find("\"" + field + "\"");
    ASSERT_NE(k, std::string::npos);
    size_t colon = s.find(':', k), end = s.find_first_of(",\n}", colon);
    if (s[colon + 2] == '"') { // a string value: ends after its closing quote
        end = s.find('"', colon + 3) + 1;
    }
    s = s.substr(0, colon + 1) + " " + value + s.substr(end);
    write_text(dir + "/meta.json", s);
}

} // namespace

TEST(Trace, RoundTripFloat32) {
    std::string dir = write_small_trace("f32");
    TraceMeta m = read_trace_meta(dir);
    TraceMeta ref = small_meta();
    EXPECT_EQ(m.n_layers, ref.n_layers);
    EXPECT_EQ(m.n_q_heads, ref.n_q_heads);
    EXPECT_EQ(m.n_ctx, ref.n_ctx);
    EXPECT_EQ(m.rope_theta, ref.rope_theta);
    EXPECT_EQ(m.rope_style, RopeStyle::interleaved);
    EXPECT_EQ(m.source, "test");
    for (int l = 0; l < 2; l++) {
        TraceLayer t = read_trace_layer(dir, m, l), e = small_layer(ref, 10 * l + 1);
        EXPECT_EQ(t.keys, e.keys);
        EXPECT_EQ(t.values, e.values);
        EXPECT_EQ(t.queries, e.queries);
    }
}

TEST(Trace, RoundTripFloat16) {
    std::string dir = write_small_trace("f16", "float16");
    TraceMeta m = read_trace_meta(dir);
    EXPECT_EQ(m.dtype, "float16");
    EXPECT_EQ(read_npy(dir + "/layer_1/keys.npy").dtype, "<f2");
    TraceLayer t = read_trace_layer(dir, m, 1), e = small_layer(small_meta(), 11);
    for (size_t i = 0; i < e.keys.size(); i++) {
        ASSERT_EQ(t.keys[i], half_to_float(float_to_half(e.keys[i])));
        ASSERT_NEAR(t.keys[i], e.keys[i], 1e-3 * std::max(1.0f, std::abs(e.keys[i])));
    }
}

TEST(Trace, HalfConversions) {
    EXPECT_EQ(float_to_half(1.0f), 0x3C00);
    EXPECT_EQ(float_to_half(-2.0f), 0xC000);
    EXPECT_EQ(float_to_half(65504.0f), 0x7BFF);
    EXPECT_EQ(float_to_half(1e6f), 0x7C00); // overflow -> inf
    EXPECT_EQ(float_to_half(std::numeric_limits<float>::infinity()), 0x7C00);
    EXPECT_TRUE(std::isnan(half_to_float(float_to_half(NAN))));
    EXPECT_EQ(float_to_half(std::ldexp(1.0f, -24)), 0x0001); // smallest subnormal
    EXPECT_EQ(half_to_float(0x0001), std::ldexp(1.0f, -24));
    EXPECT_EQ(half_to_float(0x3555), 0.333251953125f);
    // ties round to even: 1 + 2^-11 is halfway between 0x3C00 and 0x3C01
    EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
    EXPECT_EQ(float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
    // every half round-trips exactly
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = half_to_float(uint16_t(h));
        if (!std::isnan(f)) {
            ASSERT_EQ(float_to_half(f), h) << h;
        }
    }
}

TEST(Trace, NpyHeaderIsNumpys) {
    std::string path = ::testing::TempDir() + "/h.npy";
    float x[6] = {0, 1, 2, 3, 4, 5};
    write_npy(path, "<f4", {2, 3}, x);
    std::string s = read_text(path);
    std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
    std::string expected = std::string("\x93NUMPY\x01\x00\x76\x00", 10) + dict +
            std::string(128 - 10 - dict.size() - 1, ' ') + "\n";
    ASSERT_EQ(s.size(), 128u + 24);
    EXPECT_EQ(s.substr(0, 128), expected);
    NpyArray a = read_npy(path);
    EXPECT_EQ(a.shape, (std::vector<size_t>{2, 3}));
    EXPECT_EQ(std::memcmp(a.data.data(), x, 24), 0);
}

TEST(Trace, MalformedMeta) {
    std::string dir = write_small_trace("meta");
    std::string good = read_text(dir + "/meta.json");
    EXPECT_THROW_MSG(read_trace_meta(dir + "/nope"), "meta.json");
    struct Case {
        const char* field;
        const char* value;
        const char* named;
    } cases[] = {
            {"n_ctx", "13", "n_ctx"},
            {"n_ctx", "0", "n_ctx"},
            {"n_q_heads", "3", "n_q_heads"},
            {"rope_style", "\"spiral\"", "rope_style"},
            {"dtype", "\"int8\"", "dtype"},
            {"head_dim", "\"eight\"", "head_dim"},
            {"format", "\"other\"", "format"},
            {"rope_theta", "-1", "rope_theta"},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.field);
        write_text(dir + "/meta.json", good);
        set_meta_field(dir, c.field, c.value);
        EXPECT_THROW_MSG(read_trace_meta(dir), c.named);
    }
    write_text(dir + "/meta.json", "{\"format\": \"kvindex-trace-v1\"}");
    EXPECT_THROW_MSG(read_trace_meta(dir), "n_layers");
    write_text(dir + "/meta.json", "{not json");
    EXPECT_THROW_MSG(read_trace_meta(dir), "JSON");
}

TEST(Trace, MalformedLayerFiles) {
    std::string dir = write_small_trace("layers");
    TraceMeta m = read_trace_meta(dir);
    std::string keys = dir + "/layer_0/keys.npy";
    std::string good = read_text(keys);
    auto restore = [&] { write_text(keys, good); };

    EXPECT_THROW_MSG(read_trace_layer(dir, m, 2), "layer 2");
    fs::remove(dir + "/layer_1/values.npy");
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 1), "layer_1/values.npy");

    std::vector<float> wrong(2 * 10 * 8, 0.5f);
    write_npy(keys, "<f4", {2, 10, 8}, wrong.data());
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "keys.npy: shape [2, 10, 8], expected [2, 12, 8]");
    std::vector<int64_t> ints(2 * 12 * 8, 1);
    write_npy(keys, "<i8", {2, 12, 8}, ints.data());
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "keys.npy: dtype <i8");

    std::string s = good;
    s.replace(s.find("<f4"), 3, ">f4");
    write_text(keys, s);
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "keys.npy");
    s = good;
    s.replace(s.find("False"), 5, "True ");
    write_text(keys, s);
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "Fortran");
    write_text(keys, good.substr(0, good.size() - 5));
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "truncated");
    write_text(keys, "garbage" + good);
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "magic");
    s = good;
    s.replace(s.find("(2, 12, 8)"), 10, "(9999999999");
    write_text(keys, s);
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "keys.npy");

    for (float bad : {NAN, INFINITY}) {
        s = good;
        std::memcpy(&s[s.size() - 4 * 7], &bad, 4);
        write_text(keys, s);
        EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "keys.npy: non-finite");
    }
    restore();
    EXPECT_NO_THROW(read_trace_layer(dir, m, 0));
}
