#include <kvindex/trace.h>

#include <array>
#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/errors.h>
#include <kvindex/impl/io.h>
#include <kvindex/kv_type.h>
#include <nlohmann/json.hpp>

/* Like FAISS_THROW_IF_NOT_FMT, but without the condition's source text in
 * the message: it would name fields and files the problem is not about
 * (and let tests that look for a name pass for the wrong reason). A file
 * that fails is InvalidData; arrays given to a writer are InvalidArgument
 * (KVINDEX_CHECK_ARG, errors.h). */
#define TRACE_CHECK(COND, ...)                                  \
    do {                                                        \
        if (!(COND)) {                                          \
            KVINDEX_THROW_FMT(::kvindex::InvalidData, __VA_ARGS__); \
        }                                                       \
    } while (false)

namespace kvindex {

namespace fs = std::filesystem;

// ---- float16 ----------------------------------------------------------------

float half_to_float(uint16_t h) {
    if ((h & 0x7fffu) > 0x7c00u) {
        h |= 0x0200u; // nan made quiet, as the F16C instruction does
    }
    return to_float(f16_t{h});
}

uint16_t float_to_half(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    uint16_t sign = uint16_t((bits >> 16) & 0x8000);
    uint32_t exp = (bits >> 23) & 0xFF, mant = bits & 0x7FFFFF;
    if (exp == 0xFF) { // inf, or a quiet nan whatever the payload
        return sign | 0x7C00 | (mant ? 0x200 : 0);
    }
    int e = int(exp) - 127 + 15; // biased half exponent
    if (e >= 0x1F) {
        return sign | 0x7C00; // overflow to inf
    }
    uint32_t h, rest, mid;
    if (e <= 0) { // half subnormal or zero: (1.mant) * 2^(e-1) in units of 2^-24
        if (e < -10) {
            return sign; // below half the smallest subnormal
        }
        int shift = 14 - e;
        mant |= 0x800000;
        h = mant >> shift;
        rest = mant & ((1u << shift) - 1);
        mid = 1u << (shift - 1);
    } else {
        h = (uint32_t(e) << 10) | (mant >> 13);
        rest = mant & 0x1FFF;
        mid = 0x1000;
    }
    if (rest > mid || (rest == mid && (h & 1))) {
        h++; // to nearest even; a carry into the exponent (up to inf) is right
    }
    return sign | uint16_t(h);
}

// ---- .npy -------------------------------------------------------------------

namespace {

size_t dtype_size(const std::string& dtype) {
    return dtype == "<f4" ? 4 : dtype == "<f2" ? 2 : dtype == "<i8" ? 8 : 0;
}

std::string shape_string(const std::vector<size_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); i++) {
        s += (i ? ", " : "") + std::to_string(shape[i]);
    }
    return s + "]";
}

/// Parses the Python dict literal of a .npy header, e.g.
/// {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
struct NpyHeaderParser {
    const std::string& path;
    const std::string& s;
    size_t i = 0;

    [[noreturn]] void fail(const char* what) const {
        FAISS_THROW_FMT("%s: npy header is not a dict of descr, fortran_order and shape "
                        "(%s at header offset %zd)", path.c_str(), what, i);
    }
    void skip_space() {
        while (i < s.size() && (s[i] == ' ' || s[i] == '\t' || s[i] == '\r' || s[i] == '\n')) {
            i++;
        }
    }
    bool accept(char c) {
        skip_space();
        return i < s.size() && s[i] == c ? (i++, true) : false;
    }
    void expect(char c, const char* what) {
        if (!accept(c)) {
            fail(what);
        }
    }
    std::string string_literal() {
        char q = accept('\'') ? '\'' : accept('"') ? '"' : 0;
        size_t end = q ? s.find(q, i) : std::string::npos;
        if (end == std::string::npos) {
            fail("expected a string");
        }
        std::string v = s.substr(i, end - i);
        i = end + 1;
        return v;
    }
    bool boolean() {
        skip_space();
        for (std::string w : {"True", "False"}) {
            if (s.compare(i, w.size(), w) == 0) {
                i += w.size();
                return w == "True";
            }
        }
        fail("expected True or False");
    }
    std::vector<size_t> tuple() {
        std::vector<size_t> v;
        expect('(', "expected a tuple");
        while (!accept(')')) {
            size_t start = i;
            while (i < s.size() && isdigit((unsigned char)s[i]) && i - start < 18) {
                i++; // at most 18 digits: no overflow; the size check comes later
            }
            if (i == start || (i < s.size() && isdigit((unsigned char)s[i]))) {
                fail("expected a dimension of at most 18 digits");
            }
            v.push_back(std::stoull(s.substr(start, i - start)));
            if (!accept(',')) {
                expect(')', "expected ',' or ')' in the shape");
                break;
            }
        }
        return v;
    }
};

} // namespace

NpyArray read_npy(const std::string& path) {
    RegularFile f(path, "read_npy");
    const size_t file_size = f.size();
    uint8_t pre[12] = {};
    f.read(pre, std::min<size_t>(12, file_size));
    TRACE_CHECK(file_size >= 10 && std::memcmp(pre, "\x93NUMPY", 6) == 0,
                "%s: not a .npy file (bad magic)", path.c_str());
    int major = pre[6], minor = pre[7];
    TRACE_CHECK(major >= 1 && major <= 3 && minor == 0,
                "%s: npy version %d.%d not supported (1.0, 2.0, 3.0)", path.c_str(), major, minor);
    // the header length takes 2 bytes in version 1.0, 4 in 2.0 and 3.0
    size_t prefix = major == 1 ? 10 : 12;
    size_t header_len = pre[8] | (size_t(pre[9]) << 8);
    if (major > 1) {
        header_len |= (size_t(pre[10]) << 16) | (size_t(pre[11]) << 24);
    }
    TRACE_CHECK(file_size >= prefix && header_len <= file_size - prefix,
                "%s: truncated npy header (%zd bytes announced, file has %zd)",
                path.c_str(), header_len, file_size);
    std::string header(header_len, '\0');
    f.seek(prefix);
    TRACE_CHECK(f.read(&header[0], header_len) == header_len, "%s: truncated npy header", path.c_str());

    NpyArray a;
    NpyHeaderParser p{path, header};
    bool seen[3] = {false, false, false}, fortran = false;
    p.expect('{', "expected '{'");
    while (!p.accept('}')) {
        std::string key = p.string_literal();
        p.expect(':', "expected ':'");
        int k = key == "descr" ? 0 : key == "fortran_order" ? 1 : key == "shape" ? 2 : -1;
        if (k < 0 || seen[k]) {
            p.fail(k < 0 ? "unknown key" : "repeated key");
        }
        seen[k] = true;
        if (k == 0) {
            a.dtype = p.string_literal();
        } else if (k == 1) {
            fortran = p.boolean();
        } else {
            a.shape = p.tuple();
        }
        if (!p.accept(',')) {
            p.expect('}', "expected ',' or '}'");
            break;
        }
    }
    p.skip_space();
    if (p.i != header.size() || !(seen[0] && seen[1] && seen[2])) {
        p.fail(p.i != header.size() ? "text after the dict" : "missing key");
    }
    TRACE_CHECK(a.dtype.empty() || a.dtype[0] != '>',
                "%s: dtype '%s' is big-endian, only little-endian is supported",
                path.c_str(), a.dtype.c_str());
    size_t es = dtype_size(a.dtype);
    TRACE_CHECK(es > 0, "%s: dtype '%s' not supported (<f4, <f2, <i8 only)",
                path.c_str(), a.dtype.c_str());
    TRACE_CHECK(!fortran, "%s: fortran_order True not supported (C order only)", path.c_str());
    // the element count is bounded by the file size at every step, so a
    // corrupt shape can neither overflow nor cause a huge allocation
    size_t data_bytes = file_size - prefix - header_len, count = 1;
    for (size_t dim : a.shape) {
        TRACE_CHECK(dim == 0 || count <= data_bytes / dim,
                    "%s: shape %s is larger than the file (%zd data bytes)",
                    path.c_str(), shape_string(a.shape).c_str(), data_bytes);
        count *= dim;
    }
    TRACE_CHECK(count * es <= data_bytes,
                "%s: shape %s of %s needs %zd data bytes, the file has %zd (truncated?)",
                path.c_str(), shape_string(a.shape).c_str(), a.dtype.c_str(), count * es,
                data_bytes);
    TRACE_CHECK(count * es == data_bytes,
                "%s: %zd bytes after the %zd data bytes of shape %s of %s (not one .npy array)",
                path.c_str(), data_bytes - count * es, count * es, shape_string(a.shape).c_str(),
                a.dtype.c_str());
    a.data.resize(data_bytes);
    TRACE_CHECK(f.read(a.data.data(), data_bytes) == data_bytes, "%s: shorter than when opened", path.c_str());
    return a;
}

void write_npy(
        const std::string& path,
        const std::string& dtype,
        const std::vector<size_t>& shape,
        const void* data) {
    size_t es = dtype_size(dtype);
    KVINDEX_CHECK_ARG(es > 0, "%s: dtype '%s' not supported (<f4, <f2, <i8 only)",
                      path.c_str(), dtype.c_str());
    // byte for byte what numpy.save writes: the repr of the dict ("(5,)" for
    // 1-D), room for shape[0] to grow to 21 digits, then 1 to 64 spaces and
    // '\n' so that the data starts at a multiple of 64 bytes
    std::string dims;
    size_t count = 1;
    for (size_t i = 0; i < shape.size(); i++) {
        dims += (i ? ", " : "") + std::to_string(shape[i]);
        count *= shape[i];
    }
    dims += shape.size() == 1 ? "," : "";
    std::string header =
            "{'descr': '" + dtype + "', 'fortran_order': False, 'shape': (" + dims + "), }";
    if (!shape.empty()) {
        header += std::string(21 - std::to_string(shape[0]).size(), ' ');
    }
    header += std::string(64 - (10 + header.size() + 1) % 64, ' ') + "\n";
    KVINDEX_CHECK_ARG(header.size() <= 0xFFFF, "%s: npy header of %zd bytes does not fit version 1.0",
                      path.c_str(), header.size());
    const uint8_t prefix[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, uint8_t(header.size() & 0xFF),
                                uint8_t(header.size() >> 8)};
    AtomicFileWriter f(path, "write_npy");
    f.write(prefix, sizeof(prefix));
    f.write(header);
    f.write(data, count * es);
    f.commit();
}

// ---- meta.json and layers ---------------------------------------------------

namespace {

__attribute__((format(printf, 1, 2))) std::string strfmt(const char* fmt, ...) {
    char buf[256];
    va_list args;
    va_start(args, fmt);
    vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    return buf;
}

/// The first inconsistent field of m, described; empty when m is consistent.
/// The arrays of a layer, in the order of TraceLayer's fields.
constexpr const char* kLayerArrays[3] = {"keys", "values", "queries"};

std::string meta_problem(const TraceMeta& m) {
    if (m.format != "kvindex-trace-v1") {
        return strfmt("format '%s' is not 'kvindex-trace-v1'", m.format.c_str());
    }
    const std::pair<const char*, int64_t> positive[] = {
            {"n_layers", m.n_layers}, {"n_q_heads", m.n_q_heads}, {"n_kv_heads", m.n_kv_heads},
            {"head_dim", m.head_dim}, {"n_tokens", m.n_tokens}};
    for (const auto& [name, v] : positive) {
        if (v <= 0) {
            return strfmt("%s=%lld must be > 0", name, (long long)v);
        }
    }
    // an array's element count (query heads x tokens x head_dim, the
    // largest) must not wrap: the writer would otherwise accept a shape
    // and no data, and save arrays its reader refuses
    constexpr uint64_t kMaxElements = uint64_t(1) << 54; // 2^56 bytes of float32
    const uint64_t heads = uint64_t(std::max(m.n_q_heads, m.n_kv_heads));
    if (uint64_t(m.n_tokens) > kMaxElements / heads / uint64_t(m.head_dim)) {
        return strfmt("n_tokens=%lld x %llu heads x head_dim=%d values are more than an array "
                      "holds (2^54)",
                      (long long)m.n_tokens, (unsigned long long)heads, m.head_dim);
    }
    if (m.n_q_heads % m.n_kv_heads != 0) {
        return strfmt("n_q_heads=%d is not a multiple of n_kv_heads=%d", m.n_q_heads, m.n_kv_heads);
    }
    if (m.n_ctx < 1 || m.n_ctx > m.n_tokens) {
        return strfmt("n_ctx=%lld must be in [1, n_tokens=%lld]",
                      (long long)m.n_ctx, (long long)m.n_tokens);
    }
    if (!std::isfinite(m.rope_theta) || m.rope_theta <= 0) {
        return strfmt("rope_theta=%g must be finite and > 0", m.rope_theta);
    }
    if (m.rope_style != RopeStyle::half && m.rope_style != RopeStyle::interleaved) {
        return strfmt("rope_style %d is not half or interleaved", int(m.rope_style));
    }
    if (m.dtype != "float32" && m.dtype != "float16") {
        return strfmt("dtype '%s' is not float32 or float16", m.dtype.c_str());
    }
    return "";
}

/// A required field. Types are checked here: nlohmann's get<int>() would
/// silently accept 8.5 or true.
const nlohmann::json& meta_field(const nlohmann::json& j, const char* name, const std::string& path) {
    TRACE_CHECK(j.contains(name), "%s: field '%s' missing", path.c_str(), name);
    return j.at(name);
}

std::string string_field(const nlohmann::json& j, const char* name, const std::string& path) {
    const nlohmann::json& v = meta_field(j, name, path);
    TRACE_CHECK(v.is_string(), "%s: field '%s' must be a string, got %s",
                path.c_str(), name, v.dump().c_str());
    return v.get<std::string>();
}

int64_t int_field(const nlohmann::json& j, const char* name, const std::string& path, int64_t max) {
    const nlohmann::json& v = meta_field(j, name, path);
    bool ok = v.is_number_integer() &&
            (v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t(max)
                                    : v.get<int64_t>() >= -max && v.get<int64_t>() <= max);
    TRACE_CHECK(ok, "%s: field '%s' must be an integer of at most %lld, got %s",
                path.c_str(), name, (long long)max, v.dump().c_str());
    return v.get<int64_t>();
}

std::string layer_file(const std::string& dir, int layer, const char* name) {
    return dir + "/layer_" + std::to_string(layer) + "/" + name + ".npy";
}

void check_meta_and_layer(const std::string& dir, const TraceMeta& meta, int layer) {
    std::string problem = meta_problem(meta);
    TRACE_CHECK(problem.empty(), "%s: trace meta: %s", dir.c_str(), problem.c_str());
    TRACE_CHECK(layer >= 0 && layer < meta.n_layers, "%s: layer %d out of [0, n_layers=%d)",
                dir.c_str(), layer, meta.n_layers);
}

/// Throws naming the file and the position of the first NaN / Inf.
/// Throws E (InvalidData for a file read, InvalidArgument for arrays given
/// to a writer) naming the first non-finite value of x.
template <class E>
void check_finite(const std::string& path, const std::vector<size_t>& shape, const float* x) {
    size_t n = shape[0] * shape[1] * shape[2];
    for (size_t i = 0; i < n; i++) {
        if (!std::isfinite(x[i])) {
            KVINDEX_THROW_FMT(
                    E, "%s: non-finite value %g at index %zd (head %zd, token %zd, dim %zd)",
                    path.c_str(), double(x[i]), i, i / shape[2] / shape[1], i / shape[2] % shape[1],
                    i % shape[2]);
        }
    }
}

/// Reads one array of a layer as float32, checking dtype, shape and finiteness.
std::vector<float> read_layer_array(
        const std::string& path, const std::vector<size_t>& shape, const TraceMeta& meta) {
    NpyArray a = read_npy(path);
    TRACE_CHECK(a.dtype == "<f4" || a.dtype == "<f2",
                "%s: dtype %s, expected float32 (<f4) or float16 (<f2)",
                path.c_str(), a.dtype.c_str());
    const char* declared = meta.dtype == "float32" ? "<f4" : "<f2";
    TRACE_CHECK(meta.dtype_from_arrays || a.dtype == declared,
                "%s: dtype %s, but meta.json declares %s (%s)",
                path.c_str(), a.dtype.c_str(), meta.dtype.c_str(), declared);
    TRACE_CHECK(a.shape == shape, "%s: shape %s, expected %s", path.c_str(),
                shape_string(a.shape).c_str(), shape_string(shape).c_str());
    std::vector<float> out(shape[0] * shape[1] * shape[2]);
    if (a.dtype == "<f4") {
        std::memcpy(out.data(), a.data.data(), out.size() * 4);
    } else {
        for (size_t i = 0; i < out.size(); i++) {
            uint16_t h;
            std::memcpy(&h, a.data.data() + 2 * i, 2);
            out[i] = half_to_float(h);
        }
    }
    check_finite<InvalidData>(path, shape, out.data());
    return out;
}

/// One array of a layer in meta.dtype, as raw bytes; refuses what would
/// not read back (NaN, Inf, float16 overflow).
std::vector<uint8_t> encode_layer_array(
        const std::string& path,
        const TraceMeta& meta,
        const std::vector<size_t>& shape,
        const std::vector<float>& x) {
    KVINDEX_CHECK_ARG(x.size() == shape[0] * shape[1] * shape[2], "%s: %zd values given for shape %s",
                      path.c_str(), x.size(), shape_string(shape).c_str());
    check_finite<InvalidArgument>(path, shape, x.data());
    std::vector<uint8_t> bytes(x.size() * (meta.dtype == "float32" ? 4 : 2));
    if (meta.dtype == "float32") {
        std::memcpy(bytes.data(), x.data(), bytes.size());
        return bytes;
    }
    for (size_t i = 0; i < x.size(); i++) {
        uint16_t h = float_to_half(x[i]);
        KVINDEX_CHECK_ARG((h & 0x7C00) != 0x7C00, "%s: value %g at index %zd overflows float16 (max 65504)",
                          path.c_str(), double(x[i]), i);
        std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
    return bytes;
}

void make_dirs(const std::string& dir) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) {
        throw FileError(dir + ": cannot create directory: " + ec.message(), ec.value(), dir,
                        "cannot create directory: " + ec.message(), __PRETTY_FUNCTION__, __FILE__, __LINE__);
    }
}

} // namespace

void TraceMeta::check() const {
    std::string problem = meta_problem(*this);
    KVINDEX_CHECK_ARG(problem.empty(), "trace meta: %s", problem.c_str());
}

TraceMeta read_trace_meta(const std::string& dir) {
    std::string path = dir + "/meta.json";
    // a regular file, read whole (not a FIFO that would block): a missing
    // one says the directory is not a trace
    const std::vector<uint8_t> text = read_file(path, "read_trace_meta");
    nlohmann::json j;
    try {
        // parse the whole file: `f >> j` would stop after the first value
        // and ignore what follows it ("{...} garbage", a second object)
        j = nlohmann::json::parse(text.begin(), text.end());
    } catch (const std::exception& e) {
        KVINDEX_THROW_FMT(InvalidData, "%s: not valid JSON: %s", path.c_str(), e.what());
    }
    TRACE_CHECK(j.is_object(), "%s: not a JSON object", path.c_str());
    TraceMeta m;
    m.format = string_field(j, "format", path);
    m.n_layers = int(int_field(j, "n_layers", path, INT_MAX));
    m.n_q_heads = int(int_field(j, "n_q_heads", path, INT_MAX));
    m.n_kv_heads = int(int_field(j, "n_kv_heads", path, INT_MAX));
    m.head_dim = int(int_field(j, "head_dim", path, INT_MAX));
    m.n_tokens = int_field(j, "n_tokens", path, INT64_MAX);
    m.n_ctx = int_field(j, "n_ctx", path, INT64_MAX);
    const nlohmann::json& theta = meta_field(j, "rope_theta", path);
    TRACE_CHECK(theta.is_number(), "%s: field 'rope_theta' must be a number, got %s",
                path.c_str(), theta.dump().c_str());
    m.rope_theta = theta.get<double>();
    std::string style = string_field(j, "rope_style", path);
    TRACE_CHECK(style == "half" || style == "interleaved",
                "%s: field 'rope_style' is '%s', not 'half' or 'interleaved'",
                path.c_str(), style.c_str());
    m.rope_style = style == "half" ? RopeStyle::half : RopeStyle::interleaved;
    m.source = string_field(j, "source", path);
    // dtype is optional: a trace written elsewhere may omit it, and each
    // .npy then says its own; a declared one must match every array
    m.dtype_from_arrays = !j.contains("dtype");
    m.dtype = m.dtype_from_arrays ? "float32" : string_field(j, "dtype", path);
    std::string problem = meta_problem(m);
    TRACE_CHECK(problem.empty(), "%s: %s", path.c_str(), problem.c_str());
    return m;
}

void write_trace_meta(const std::string& dir, const TraceMeta& m) {
    m.check();
    make_dirs(dir);
    nlohmann::json j = {
            {"format", m.format},       {"n_layers", m.n_layers},
            {"n_q_heads", m.n_q_heads}, {"n_kv_heads", m.n_kv_heads},
            {"head_dim", m.head_dim},   {"n_tokens", m.n_tokens},
            {"n_ctx", m.n_ctx},         {"rope_theta", m.rope_theta},
            {"rope_style", rope_style_name(m.rope_style)},
            {"source", m.source},       {"dtype", m.dtype}};
    AtomicFileWriter f(dir + "/meta.json", "write_trace_meta");
    f.write(j.dump(2) + "\n");
    f.commit();
}

TraceLayer read_trace_layer(const std::string& dir, const TraceMeta& meta, int layer) {
    check_meta_and_layer(dir, meta, layer);
    size_t n = meta.n_tokens, d = meta.head_dim;
    size_t kv = meta.n_kv_heads, q = meta.n_q_heads;
    TraceLayer t;
    t.keys = read_layer_array(layer_file(dir, layer, "keys"), {kv, n, d}, meta);
    t.values = read_layer_array(layer_file(dir, layer, "values"), {kv, n, d}, meta);
    t.queries = read_layer_array(layer_file(dir, layer, "queries"), {q, n, d}, meta);
    return t;
}

namespace {

/// The three arrays of a layer encoded in meta.dtype (keys, values,
/// queries), each checked; `path_of(name)` names an array in messages.
template <class PathOf>
std::array<std::vector<uint8_t>, 3> encode_layer(
        const TraceMeta& meta, const TraceLayer& t, PathOf&& path_of) {
    size_t n = meta.n_tokens, d = meta.head_dim;
    size_t kv = meta.n_kv_heads, q = meta.n_q_heads;
    const std::vector<float>* arrays[3] = {&t.keys, &t.values, &t.queries};
    std::vector<size_t> shapes[3] = {{kv, n, d}, {kv, n, d}, {q, n, d}};
    std::array<std::vector<uint8_t>, 3> bytes;
    for (int i = 0; i < 3; i++) {
        bytes[i] = encode_layer_array(path_of(kLayerArrays[i]), meta, shapes[i], *arrays[i]);
    }
    return bytes;
}

} // namespace

void check_trace_layer(const TraceMeta& meta, const TraceLayer& t, const std::string& what) {
    std::string problem = meta_problem(meta);
    KVINDEX_CHECK_ARG(problem.empty(), "%s: trace meta: %s", what.c_str(), problem.c_str());
    encode_layer(meta, t, [&](const char* name) { return what + "['" + name + "']"; });
}

void write_trace_layer(
        const std::string& dir, const TraceMeta& meta, int layer, const TraceLayer& t) {
    check_meta_and_layer(dir, meta, layer);
    // every array is checked before any file is written: no half-written layer
    auto bytes = encode_layer(meta, t, [&](const char* name) { return layer_file(dir, layer, name); });
    make_dirs(dir + "/layer_" + std::to_string(layer));
    size_t n = meta.n_tokens, d = meta.head_dim;
    size_t kv = meta.n_kv_heads, q = meta.n_q_heads;
    std::vector<size_t> shapes[3] = {{kv, n, d}, {kv, n, d}, {q, n, d}};
    for (int i = 0; i < 3; i++) {
        write_npy(layer_file(dir, layer, kLayerArrays[i]), meta.dtype == "float32" ? "<f4" : "<f2",
                  shapes[i], bytes[i].data());
    }
}

} // namespace kvindex
