// Trace files: round trips, float16, numpy's exact .npy bytes, and every
// malformed input refused with a message naming the file or field.

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <kvindex/trace.h>

#include "expect_throw.h"
#include "reference.h"

namespace test_trace {

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

std::string fresh_dir(const std::string& name) {
    std::string dir = ::testing::TempDir() + "/trace_" + name;
    fs::remove_all(dir);
    return dir;
}

/// A fresh directory holding a valid two-layer trace.
std::string write_small_trace(const std::string& name, const std::string& dtype = "float32") {
    std::string dir = fresh_dir(name);
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

/// A .npy file with a hand-written header dict, for malformed cases.
std::string raw_npy(const std::string& dict, const std::string& data, int major = 1) {
    std::string header = dict + std::string(64, ' ') + "\n";
    std::string s = std::string("\x93NUMPY", 6) + char(major) + '\0';
    for (int i = 0; i < (major == 1 ? 2 : 4); i++) {
        s += char((header.size() >> (8 * i)) & 0xFF);
    }
    return s + header + data;
}

/// Rewrites a field of meta.json with a raw JSON value, or removes it.
void set_meta_field(const std::string& path, const std::string& field, const std::string* value) {
    std::string s = read_text(path);
    size_t k = s.find("\"" + field + "\"");
    ASSERT_NE(k, std::string::npos);
    size_t colon = s.find(':', k), end = s.find_first_of(",\n}", colon);
    if (s[colon + 2] == '"') { // a string value: ends after its closing quote
        end = s.find('"', colon + 3) + 1;
    }
    if (value) {
        s = s.substr(0, colon + 1) + " " + *value + s.substr(end);
    } else { // drop the field and its separating comma
        size_t start = s.rfind(s[end] == ',' ? '\n' : ',', k);
        s = s.substr(0, start) + s.substr(s[end] == ',' ? end + 1 : end);
    }
    write_text(path, s);
}

} // namespace

TEST(Trace, RoundTripFloat32) {
    std::string dir = write_small_trace("f32");
    TraceMeta m = read_trace_meta(dir);
    TraceMeta ref = small_meta();
    EXPECT_EQ(m.format, "kvindex-trace-v1");
    EXPECT_EQ(m.n_layers, ref.n_layers);
    EXPECT_EQ(m.n_q_heads, ref.n_q_heads);
    EXPECT_EQ(m.n_kv_heads, ref.n_kv_heads);
    EXPECT_EQ(m.head_dim, ref.head_dim);
    EXPECT_EQ(m.n_tokens, ref.n_tokens);
    EXPECT_EQ(m.n_ctx, ref.n_ctx);
    EXPECT_EQ(m.rope_theta, ref.rope_theta);
    EXPECT_EQ(m.rope_style, RopeStyle::interleaved);
    EXPECT_EQ(m.source, "test");
    EXPECT_EQ(m.dtype, "float32");
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
    ASSERT_EQ(t.queries.size(), e.queries.size());
    for (size_t i = 0; i < e.queries.size(); i++) {
        // exactly the rounded value, and within half precision (2^-11 relative)
        ASSERT_EQ(t.queries[i], half_to_float(float_to_half(e.queries[i])));
        ASSERT_LE(std::abs(t.queries[i] - e.queries[i]),
                  std::ldexp(1.0f, -11) * std::abs(e.queries[i]) + std::ldexp(1.0f, -25));
    }
    // a declared dtype must match the arrays (float16 meta over float32
    // arrays, or the reverse, is refused naming both) ...
    m.dtype = "float32";
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 1), "dtype <f2, but meta.json declares float32");
    // ... and a meta.json without dtype takes each array's own
    std::string meta_path = dir + "/meta.json";
    std::ifstream in(meta_path);
    nlohmann::json j;
    in >> j;
    in.close();
    j.erase("dtype");
    std::ofstream(meta_path) << j.dump();
    TraceMeta undeclared = read_trace_meta(dir);
    EXPECT_TRUE(undeclared.dtype_from_arrays);
    EXPECT_EQ(read_trace_layer(dir, undeclared, 1).keys, t.keys);
}

TEST(TraceHalf, KnownBitPatterns) {
    const float inf = std::numeric_limits<float>::infinity();
    EXPECT_EQ(float_to_half(1.0f), 0x3C00);
    EXPECT_EQ(float_to_half(-2.0f), 0xC000);
    EXPECT_EQ(float_to_half(65504.0f), 0x7BFF);
    EXPECT_EQ(float_to_half(0.0f), 0x0000);
    EXPECT_EQ(float_to_half(-0.0f), 0x8000);
    EXPECT_EQ(float_to_half(inf), 0x7C00);
    EXPECT_EQ(float_to_half(-inf), 0xFC00);
    EXPECT_EQ(float_to_half(1e6f), 0x7C00);   // overflow to inf
    EXPECT_EQ(float_to_half(65520.0f), 0x7C00); // halfway to 2^16 rounds (to even) to inf
    EXPECT_EQ(float_to_half(65519.0f), 0x7BFF);
    uint16_t nan = float_to_half(std::numeric_limits<float>::quiet_NaN());
    EXPECT_EQ(nan & 0x7C00, 0x7C00);
    EXPECT_NE(nan & 0x03FF, 0);
    EXPECT_TRUE(std::isnan(half_to_float(0x7E00)));
    // a signalling half nan comes back quiet (float bit 22), payload and sign kept
    float snan = half_to_float(0xFC01);
    uint32_t snan_bits;
    std::memcpy(&snan_bits, &snan, 4);
    EXPECT_EQ(snan_bits, 0xFFC02000u);
    EXPECT_EQ(half_to_float(0x7C00), inf);
    EXPECT_EQ(half_to_float(0xFC00), -inf);
    EXPECT_EQ(half_to_float(0x3C00), 1.0f);
    EXPECT_EQ(half_to_float(0xC000), -2.0f);
    EXPECT_EQ(half_to_float(0x7BFF), 65504.0f);
    EXPECT_EQ(half_to_float(0x3555), 0.333251953125f);

    // subnormals: 0x0001 = 2^-24, 0x03FF the largest, 0x0400 the smallest normal
    EXPECT_EQ(float_to_half(std::ldexp(1.0f, -24)), 0x0001);
    EXPECT_EQ(half_to_float(0x0001), std::ldexp(1.0f, -24));
    EXPECT_EQ(half_to_float(0x8001), -std::ldexp(1.0f, -24));
    EXPECT_EQ(half_to_float(0x03FF), 1023 * std::ldexp(1.0f, -24));
    EXPECT_EQ(float_to_half(std::ldexp(1.0f, -14)), 0x0400);
    EXPECT_EQ(float_to_half(std::ldexp(1.0f, -25)), 0x0000); // tie: to even (0)
    EXPECT_EQ(float_to_half(std::ldexp(1.5f, -25)), 0x0001);
    EXPECT_EQ(float_to_half(std::ldexp(3.0f, -25)), 0x0002); // 1.5 units: tie to even (2)
    EXPECT_EQ(float_to_half(std::ldexp(5.0f, -25)), 0x0002); // 2.5 units: tie to even (2)
    EXPECT_EQ(float_to_half(std::ldexp(1.0f, -26)), 0x0000);

    // normals, ties to even: 1 + 2^-11 is halfway between 0x3C00 and 0x3C01
    EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
    EXPECT_EQ(float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
    EXPECT_EQ(float_to_half(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3C01);
    EXPECT_EQ(float_to_half(1.0f - std::ldexp(1.0f, -11)), 0x3BFF);
    EXPECT_EQ(float_to_half(1.0f - std::ldexp(1.0f, -12)), 0x3C00); // tie, odd 0x3BFF: up a binade

    // every half round-trips exactly
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = half_to_float(uint16_t(h));
        if (!std::isnan(f)) {
            ASSERT_EQ(float_to_half(f), h) << h;
        }
    }
}

TEST(TraceNpy, HeaderIsNumpys) {
    std::string path = ::testing::TempDir() + "/trace_header.npy";
    float x[6] = {0, 1, 2, 3, 4, 5};
    write_npy(path, "<f4", {2, 3}, x);
    std::string s = read_text(path);
    // np.save(np.zeros((2, 3), '<f4')): header length 0x76 = 118, data at 128
    std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
    std::string expected = std::string("\x93NUMPY\x01\x00\x76\x00", 10) + dict +
            std::string(128 - 10 - dict.size() - 1, ' ') + "\n";
    ASSERT_EQ(s.size(), 128u + 24);
    EXPECT_EQ(s.substr(0, 128), expected);
    NpyArray a = read_npy(path);
    EXPECT_EQ(a.dtype, "<f4");
    EXPECT_EQ(a.shape, (std::vector<size_t>{2, 3}));
    EXPECT_EQ(std::memcmp(a.data.data(), x, 24), 0);

    // numpy pads with 1 to 64 spaces, never 0: here the dict, plus 20 spaces
    // of room for shape[0] to grow, plus '\n' fill exactly 128 - 64 bytes, so
    // numpy (checked against 2.4) writes 64 more spaces: header length 0xB6
    std::vector<size_t> shape(14, 1);
    shape[0] = 3;
    shape[13] = 100;
    std::vector<float> y(300, 0.5f);
    write_npy(path, "<f4", shape, y.data());
    dict = "{'descr': '<f4', 'fortran_order': False, 'shape': "
           "(3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 100), }";
    expected = std::string("\x93NUMPY\x01\x00\xB6\x00", 10) + dict + std::string(20 + 64, ' ') + "\n";
    ASSERT_EQ(expected.size(), 192u);
    EXPECT_EQ(read_text(path).substr(0, 192), expected);
    EXPECT_EQ(read_npy(path).shape, shape);

    // 1-D and 0-D shapes as Python writes them
    int64_t ids[5] = {1, 2, 3, 4, 5};
    write_npy(path, "<i8", {5}, ids);
    EXPECT_NE(read_text(path).find("'shape': (5,), }"), std::string::npos);
    EXPECT_EQ(read_npy(path).shape, (std::vector<size_t>{5}));
    write_npy(path, "<f4", {}, x);
    EXPECT_NE(read_text(path).find("'shape': (), }"), std::string::npos);
    EXPECT_EQ(read_npy(path).data.size(), 4u);
    EXPECT_THROW_MSG(write_npy(path, "<f8", {1}, x), "<f8");
}

TEST(TraceNpy, Versions2And3) {
    std::string path = ::testing::TempDir() + "/trace_v2.npy";
    uint16_t h[2] = {0x3C00, 0xC000};
    for (int major : {2, 3}) {
        write_text(path, raw_npy("{'descr': '<f2', 'fortran_order': False, 'shape': (2,), }",
                                 std::string(reinterpret_cast<char*>(h), 4), major));
        NpyArray a = read_npy(path);
        EXPECT_EQ(a.dtype, "<f2");
        EXPECT_EQ(a.shape, (std::vector<size_t>{2}));
        EXPECT_EQ(std::memcmp(a.data.data(), h, 4), 0);
    }
    std::string s = read_text(path);
    s[6] = 4;
    write_text(path, s);
    EXPECT_THROW_MSG(read_npy(path), "trace_v2.npy: npy version 4.0 not supported");
}

TEST(TraceNpy, MalformedHeaders) {
    std::string path = ::testing::TempDir() + "/trace_bad.npy";
    std::string data(24, '\0');
    struct Case {
        const char* dict;
        const char* named;
    } cases[] = {
            {"{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", "big-endian"},
            {"{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", "fortran_order True"},
            {"{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }", "dtype '<f8'"},
            {"{'descr': '|u1', 'fortran_order': False, 'shape': (24,), }", "dtype '|u1'"},
            {"['descr', '<f4']", "not a dict"},
            {"{'descr': '<f4', 'fortran_order': False}", "missing key"},
            {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}", "unknown key"},
            {"{'descr': '<f4', 'descr': '<f4', 'shape': (2, 3), }", "repeated key"},
            {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }", "not a dict"},
            {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), } x", "text after"},
            {"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,), }", "not a dict"},
            // a corrupt shape must be refused before anything is allocated
            {"{'descr': '<f4', 'fortran_order': False, 'shape': (999999999999999999, "
             "999999999999999999, 8), }", "larger than the file"},
            {"{'descr': '<f4', 'fortran_order': False, 'shape': (0, 99999999999999999999), }",
             "at most 18 digits"},
            {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4), }", "truncated"},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.dict);
        write_text(path, raw_npy(c.dict, data));
        EXPECT_THROW_MSG(read_npy(path), "trace_bad.npy: ");
        EXPECT_THROW_MSG(read_npy(path), c.named);
    }
    std::string good = raw_npy("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", data);
    write_text(path, good);
    EXPECT_NO_THROW(read_npy(path));
    write_text(path, "garbage" + good);
    EXPECT_THROW_MSG(read_npy(path), "trace_bad.npy: not a .npy file (bad magic)");
    write_text(path, good.substr(0, 9));
    EXPECT_THROW_MSG(read_npy(path), "bad magic");
    write_text(path, good.substr(0, 40));
    EXPECT_THROW_MSG(read_npy(path), "trace_bad.npy: truncated npy header");
    EXPECT_THROW_MSG(read_npy(path + ".missing"), "read_npy: cannot open '" + path + ".missing': No such file");
}

TEST(TraceMeta, Malformed) {
    std::string dir = write_small_trace("meta");
    std::string path = dir + "/meta.json";
    std::string good = read_text(path);
    EXPECT_THROW_MSG(read_trace_meta(dir + "/nope"), "nope/meta.json': No such file");
    for (const char* field : {"format", "n_layers", "n_q_heads", "n_kv_heads", "head_dim",
                              "n_tokens", "n_ctx", "rope_theta", "rope_style", "source"}) {
        SCOPED_TRACE(field);
        write_text(path, good);
        set_meta_field(path, field, nullptr);
        EXPECT_THROW_MSG(read_trace_meta(dir), "meta.json: field '" + std::string(field) + "' missing");
    }
    // dtype is optional (DESIGN §4 does not list it): float32 by default
    write_text(path, good);
    set_meta_field(path, "dtype", nullptr);
    EXPECT_EQ(read_trace_meta(dir).dtype, "float32");
    struct Case {
        const char* field;
        std::string value;
        const char* named;
    } cases[] = {
            // mistyped
            {"n_layers", "true", "field 'n_layers' must be an integer"},
            {"head_dim", "8.5", "field 'head_dim' must be an integer"},
            {"head_dim", "\"eight\"", "field 'head_dim' must be an integer"},
            {"n_tokens", "\"12\"", "field 'n_tokens' must be an integer"},
            {"n_q_heads", "4294967296", "field 'n_q_heads' must be an integer of at most"},
            {"n_ctx", "18446744073709551615", "field 'n_ctx' must be an integer"},
            {"rope_theta", "\"1e4\"", "field 'rope_theta' must be a number"},
            {"source", "5", "field 'source' must be a string"},
            {"dtype", "null", "field 'dtype' must be a string"},
            {"format", "[1]", "field 'format' must be a string"},
            // inconsistent
            {"n_ctx", "13", "n_ctx=13 must be in [1, n_tokens=12]"},
            {"n_ctx", "0", "n_ctx=0"},
            {"n_q_heads", "3", "n_q_heads=3 is not a multiple of n_kv_heads=2"},
            {"n_kv_heads", "0", "n_kv_heads=0 must be > 0"},
            {"n_tokens", "-1", "n_tokens=-1 must be > 0"},
            {"rope_style", "\"spiral\"", "field 'rope_style' is 'spiral'"},
            {"dtype", "\"int8\"", "dtype 'int8'"},
            {"format", "\"other\"", "format 'other'"},
            {"rope_theta", "-1", "rope_theta=-1"},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(std::string(c.field) + " = " + c.value);
        write_text(path, good);
        set_meta_field(path, c.field, &c.value);
        EXPECT_THROW_MSG(read_trace_meta(dir), "meta.json: ");
        EXPECT_THROW_MSG(read_trace_meta(dir), c.named);
    }
    write_text(path, "[1, 2]");
    EXPECT_THROW_MSG(read_trace_meta(dir), "meta.json: not a JSON object");
    write_text(path, "{not json");
    EXPECT_THROW_MSG(read_trace_meta(dir), "meta.json: not valid JSON");
    // what follows the object is not ignored
    for (const char* tail : {" garbage", "{\"n_ctx\": 5}", ","}) {
        SCOPED_TRACE(tail);
        write_text(path, good + tail);
        EXPECT_THROW_MSG(read_trace_meta(dir), "meta.json: not valid JSON");
    }
    write_text(path, good + "\n  \n"); // trailing whitespace is fine
    EXPECT_NO_THROW(read_trace_meta(dir));
    // integral rope_theta and unknown extra fields are fine
    write_text(path, good);
    std::string theta = "10000", extra = "\"interleaved\", \"model_revision\": \"abc\"";
    set_meta_field(path, "rope_theta", &theta);
    set_meta_field(path, "rope_style", &extra);
    EXPECT_EQ(read_trace_meta(dir).rope_theta, 10000.0);
}

TEST(TraceMeta, Check) {
    EXPECT_NO_THROW(small_meta().check());
    TraceMeta m = small_meta();
    m.head_dim = 0;
    EXPECT_THROW_MSG(m.check(), "head_dim=0");
    m = small_meta();
    m.rope_theta = std::numeric_limits<double>::infinity();
    EXPECT_THROW_MSG(m.check(), "rope_theta=inf");
    // sizes whose product wraps: the writer accepted the shape and no data
    m = small_meta();
    m.n_tokens = idx_t(1) << 62;
    m.n_ctx = 1;
    m.head_dim = 4;
    EXPECT_THROW_MSG(m.check(), "more than an array holds");
    m = small_meta();
    m.dtype = "bfloat16";
    EXPECT_THROW_MSG(m.check(), "dtype 'bfloat16'");
    std::string dir = fresh_dir("check");
    EXPECT_THROW_MSG(write_trace_meta(dir, m), "dtype 'bfloat16'");
    EXPECT_FALSE(fs::exists(dir));
}

TEST(TraceLayer, MalformedFiles) {
    std::string dir = write_small_trace("layers");
    TraceMeta m = read_trace_meta(dir);
    std::string keys = dir + "/layer_0/keys.npy";
    std::string good = read_text(keys);

    EXPECT_THROW_MSG(read_trace_layer(dir, m, 2), "layer 2 out of [0, n_layers=2)");
    EXPECT_THROW_MSG(read_trace_layer(dir, m, -1), "layer -1");
    TraceMeta bad = m;
    bad.n_ctx = 20;
    EXPECT_THROW_MSG(read_trace_layer(dir, bad, 0), "n_ctx=20");
    fs::remove(dir + "/layer_1/values.npy");
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 1), "layer_1/values.npy': No such file");

    std::vector<float> wrong(2 * 10 * 8, 0.5f);
    write_npy(keys, "<f4", {2, 10, 8}, wrong.data());
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "layer_0/keys.npy: shape [2, 10, 8], expected [2, 12, 8]");
    write_npy(keys, "<f4", {2, 12, 8, 1}, small_layer(m, 1).keys.data());
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "keys.npy: shape [2, 12, 8, 1], expected");
    std::vector<int64_t> ints(2 * 12 * 8, 1);
    write_npy(keys, "<i8", {2, 12, 8}, ints.data());
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "keys.npy: dtype <i8, expected float32");

    std::string s = good;
    s.replace(s.find("<f4"), 3, ">f4");
    write_text(keys, s);
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "keys.npy: dtype '>f4' is big-endian");
    s = good;
    s.replace(s.find("False"), 5, "True ");
    write_text(keys, s);
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "keys.npy: fortran_order True");
    write_text(keys, good.substr(0, good.size() - 5));
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "keys.npy: shape [2, 12, 8] of <f4 needs 768");
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "truncated");
    write_text(keys, good + "xxxx"); // not truncated: too long
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "keys.npy: 4 bytes after the 768 data bytes of shape [2, 12, 8]");
    write_text(keys, "garbage" + good);
    EXPECT_THROW_MSG(read_trace_layer(dir, m, 0), "keys.npy: not a .npy file (bad magic)");

    // flat index 109 = head 1, token 1, dim 5
    for (float v : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
        s = good;
        std::memcpy(&s[128 + 4 * 109], &v, 4);
        write_text(keys, s);
        EXPECT_THROW_MSG(read_trace_layer(dir, m, 0),
                         "keys.npy: non-finite value " + std::string(std::isnan(v) ? "nan" : "-inf") +
                                 " at index 109 (head 1, token 1, dim 5)");
    }
    write_text(keys, good);
    EXPECT_NO_THROW(read_trace_layer(dir, m, 0));

    // float16 files are checked the same way: 0x7C00 is +inf
    std::string dir16 = write_small_trace("layers16", "float16");
    std::string q16 = dir16 + "/layer_1/queries.npy";
    s = read_text(q16);
    s[s.size() - 2] = 0x00;
    s[s.size() - 1] = 0x7C;
    write_text(q16, s);
    EXPECT_THROW_MSG(read_trace_layer(dir16, read_trace_meta(dir16), 1),
                     "layer_1/queries.npy: non-finite value inf at index 383 (head 3, token 11, dim 7)");
}

TEST(TraceLayer, WriteChecks) {
    TraceMeta m = small_meta("float16");
    std::string dir = fresh_dir("write");
    TraceLayer t = small_layer(m, 3);
    t.values.pop_back();
    EXPECT_THROW_MSG(write_trace_layer(dir, m, 0, t), "layer_0/values.npy: 191 values given for shape [2, 12, 8]");
    t = small_layer(m, 3);
    t.queries[7] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_THROW_MSG(write_trace_layer(dir, m, 0, t), "layer_0/queries.npy: non-finite value nan at index 7");
    t = small_layer(m, 3);
    t.keys[5] = 1e5f;
    EXPECT_THROW_MSG(write_trace_layer(dir, m, 0, t), "layer_0/keys.npy: value 100000 at index 5 overflows float16");
    // the same checks, writing nothing: a writer of many layers runs them first
    EXPECT_THROW_MSG(check_trace_layer(m, t, "layer 0"), "layer 0['keys']: value 100000 at index 5 overflows float16");
    EXPECT_NO_THROW(check_trace_layer(m, small_layer(m, 3), "layer 0"));
    EXPECT_THROW_MSG(write_trace_layer(dir, m, 2, small_layer(m, 3)), "layer 2");
    // nothing was written by the failed calls
    EXPECT_FALSE(fs::exists(dir + "/layer_0"));
    m.dtype = "float32";
    EXPECT_NO_THROW(write_trace_layer(dir, m, 0, t)); // 1e5 is fine in float32
    EXPECT_EQ(read_npy(dir + "/layer_0/keys.npy").dtype, "<f4");
}

}  // namespace test_trace
