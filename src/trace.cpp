#include <kvindex/trace.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <faiss/impl/FaissAssert.h>
#include <nlohmann/json.hpp>

namespace kvindex {

// ---- float16 ----------------------------------------------------------------

float half_to_float(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) { // inf / nan
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { // subnormal: value = mant * 2^-24
        float f = std::ldexp(float(mant), -24);
        return sign ? -f : f;
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

uint16_t float_to_half(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    uint16_t sign = uint16_t((bits >> 16) & 0x8000);
    uint32_t exp = (bits >> 23) & 0xFF, mant = bits & 0x7FFFFF;
    if (exp == 0xFF) { // inf / nan (nan keeps a payload bit)
        return sign | 0x7C00 | (mant ? 0x200 : 0);
    }
    int e = int(exp) - 127 + 15;
    if (e >= 0x1F) {
        return sign | 0x7C00; // overflow to inf
    }
    if (e <= 0) { // subnormal half (or zero): round mant * 2^(e-1) to nearest even
        if (e < -10) {
            return sign;
        }
        mant |= 0x800000;
        int shift = 14 - e;
        uint32_t half = mant >> shift, rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) {
            half++;
        }
        return sign | uint16_t(half);
    }
    uint32_t half = (uint32_t(e) << 10) | (mant >> 13), rest = mant & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) {
        half++; // may carry into the exponent, up to inf: still correct
    }
    return sign | uint16_t(half);
}

// ---- .npy -------------------------------------------------------------------

namespace {

size_t dtype_size(const std::string& dtype) {
    if (dtype == "<f4") {
        return 4;
    }
    if (dtype == "<f2") {
        return 2;
    }
    if (dtype == "<i8") {
        return 8;
    }
    return 0;
}

std::string shape_string(const std::vector<size_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); i++) {
        s += (i ? ", " : "") + std::to_string(shape[i]);
    }
    return s + "]";
}

/// The value after 'key': in a numpy header dict, up to the next ',' at depth 0.
std::string header_field(const std::string& header, const std::string& key, const std::string& path) {
    size_t k = header.find("'" + key + "'");
    FAISS_THROW_IF_NOT_FMT(
            k != std::string::npos, "%s: npy header has no '%s'", path.c_str(), key.c_str());
    size_t colon = header.find(':', k);
    FAISS_THROW_IF_NOT_FMT(colon != std::string::npos, "%s: malformed npy header", path.c_str());
    size_t i = colon + 1, depth = 0;
    std::string v;
    for (; i < header.size(); i++) {
        char c = header[i];
        if (c == '(') {
            depth++;
        } else if (c == ')') {
            depth--;
        } else if ((c == ',' || c == '}') && depth == 0) {
            break;
        }
        v += c;
    }
    size_t a = v.find_first_not_of(" "), b = v.find_last_not_of(" ");
    return a == std::string::npos ? "" : v.substr(a, b - a + 1);
}

} // namespace

NpyArray read_npy(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    FAISS_THROW_IF_NOT_FMT(f.good(), "%s: cannot open", path.c_str());
    f.seekg(0, std::ios::end);
    size_t file_size = size_t(f.tellg());
    f.seekg(0);
    char magic[8];
    FAISS_THROW_IF_NOT_FMT(
            file_size >= 10 && f.read(magic, 8) && std::memcmp(magic, "\x93NUMPY", 6) == 0,
            "%s: not a .npy file (bad magic)",
            path.c_str());
    int major = magic[6];
    FAISS_THROW_IF_NOT_FMT(
            major >= 1 && major <= 3, "%s: npy version %d not supported", path.c_str(), major);
    size_t header_len = 0;
    if (major == 1) {
        uint8_t b[2];
        f.read(reinterpret_cast<char*>(b), 2);
        header_len = b[0] | (size_t(b[1]) << 8);
    } else {
        uint8_t b[4];
        f.read(reinterpret_cast<char*>(b), 4);
        header_len = b[0] | (size_t(b[1]) << 8) | (size_t(b[2]) << 16) | (size_t(b[3]) << 24);
    }
    size_t data_start = (major == 1 ? 10 : 12) + header_len;
    FAISS_THROW_IF_NOT_FMT(f.good() && data_start <= file_size, "%s: truncated npy header", path.c_str());
    std::string header(header_len, ' ');
    f.read(&header[0], header_len);
    FAISS_THROW_IF_NOT_FMT(
            header.find('{') != std::string::npos && header.find('}') != std::string::npos,
            "%s: npy header is not a dict",
            path.c_str());
    NpyArray a;
    std::string descr = header_field(header, "descr", path);
    FAISS_THROW_IF_NOT_FMT(
            descr.size() >= 2 && descr.front() == '\'' && descr.back() == '\'',
            "%s: malformed dtype %s",
            path.c_str(),
            descr.c_str());
    a.dtype = descr.substr(1, descr.size() - 2);
    FAISS_THROW_IF_NOT_FMT(
            dtype_size(a.dtype) > 0,
            "%s: dtype '%s' not supported (little-endian <f4, <f2, <i8 only)",
            path.c_str(),
            a.dtype.c_str());
    FAISS_THROW_IF_NOT_FMT(
            header_field(header, "fortran_order", path) == "False",
            "%s: Fortran order not supported (C order only)",
            path.c_str());
    std::string shape = header_field(header, "shape", path);
    FAISS_THROW_IF_NOT_FMT(
            shape.size() >= 2 && shape.front() == '(' && shape.back() == ')',
            "%s: malformed shape %s",
            path.c_str(),
            shape.c_str());
    std::stringstream ss(shape.substr(1, shape.size() - 2));
    size_t count = 1;
    for (std::string item; std::getline(ss, item, ',');) {
        size_t p = item.find_first_not_of(" ");
        if (p == std::string::npos) {
            continue; // the trailing comma of a 1-tuple
        }
        item = item.substr(p);
        FAISS_THROW_IF_NOT_FMT(
                !item.empty() && item.size() <= 15 &&
                        item.find_first_not_of("0123456789 ") == std::string::npos,
                "%s: malformed shape %s",
                path.c_str(),
                shape.c_str());
        size_t dim = std::stoull(item);
        a.shape.push_back(dim);
        count = dim == 0 ? 0 : count;
        FAISS_THROW_IF_NOT_FMT(
                dim == 0 || count <= file_size / dim,
                "%s: shape %s larger than the file",
                path.c_str(),
                shape.c_str());
        count *= dim;
    }
    size_t bytes = count * dtype_size(a.dtype);
    FAISS_THROW_IF_NOT_FMT(
            bytes == file_size - data_start,
            "%s: shape %s of %s needs %zd data bytes, the file has %zd (truncated?)",
            path.c_str(),
            shape_string(a.shape).c_str(),
            a.dtype.c_str(),
            bytes,
            file_size - data_start);
    a.data.resize(bytes);
    f.seekg(data_start);
    f.read(reinterpret_cast<char*>(a.data.data()), bytes);
    FAISS_THROW_IF_NOT_FMT(f.good() || bytes == 0, "%s: read error", path.c_str());
    return a;
}

void write_npy(
        const std::string& path,
        const std::string& dtype,
        const std::vector<size_t>& shape,
        const void* data) {
    size_t es = dtype_size(dtype);
    FAISS_THROW_IF_NOT_FMT(es > 0, "write_npy: dtype '%s' not supported", dtype.c_str());
    std::string dims;
    size_t count = 1;
    for (size_t s : shape) {
        dims += std::to_string(s) + ", ";
        count *= s;
    }
    if (shape.size() > 1) {
        dims.resize(dims.size() - 2); // numpy: "(2, 3)", but "(5,)" for 1-D
    } else if (shape.size() == 1) {
        dims.resize(dims.size() - 1);
    }
    std::string header = "{'descr': '" + dtype + "', 'fortran_order': False, 'shape': (" + dims + "), }";
    // pad with spaces and a newline so that the data starts at a multiple of 64
    size_t total = 10 + header.size() + 1;
    header += std::string((64 - total % 64) % 64, ' ') + "\n";
    std::ofstream f(path, std::ios::binary);
    FAISS_THROW_IF_NOT_FMT(f.good(), "%s: cannot open for writing", path.c_str());
    uint16_t len = uint16_t(header.size());
    f.write("\x93NUMPY\x01\x00", 8);
    f.put(char(len & 0xFF));
    f.put(char(len >> 8));
    f.write(header.data(), header.size());
    f.write(static_cast<const char*>(data), std::streamsize(count * es));
    FAISS_THROW_IF_NOT_FMT(f.good(), "%s: write error", path.c_str());
}

// ---- meta.json --------------------------------------------------------------

void TraceMeta::check() const {
    FAISS_THROW_IF_NOT_FMT(
            format == "kvindex-trace-v1", "meta.json: format '%s' is not kvindex-trace-v1",
            format.c_str());
    FAISS_THROW_IF_NOT_FMT(
            n_layers > 0 && n_q_heads > 0 && n_kv_heads > 0 && head_dim > 0 && n_tokens > 0,
            "meta.json: n_layers=%d, n_q_heads=%d, n_kv_heads=%d, head_dim=%d, n_tokens=%zd "
            "must all be > 0",
            n_layers, n_q_heads, n_kv_heads, head_dim, size_t(n_tokens));
    FAISS_THROW_IF_NOT_FMT(
            n_q_heads % n_kv_heads == 0,
            "meta.json: n_q_heads=%d is not a multiple of n_kv_heads=%d",
            n_q_heads, n_kv_heads);
    FAISS_THROW_IF_NOT_FMT(
            n_ctx >= 1 && n_ctx <= n_tokens,
            "meta.json: n_ctx=%zd must be in [1, n_tokens=%zd]",
            size_t(n_ctx), size_t(n_tokens));
    FAISS_THROW_IF_NOT_FMT(
            std::isfinite(rope_theta) && rope_theta > 0,
            "meta.json: rope_theta=%g must be finite and > 0", rope_theta);
    FAISS_THROW_IF_NOT_FMT(
            dtype == "float32" || dtype == "float16",
            "meta.json: dtype '%s' is not float32 or float16", dtype.c_str());
}

namespace {

std::string meta_path(const std::string& dir) {
    return dir + "/meta.json";
}

template <class T>
T field(const nlohmann::json& j, const char* name, const std::string& path) {
    FAISS_THROW_IF_NOT_FMT(j.contains(name), "%s: field '%s' missing", path.c_str(), name);
    try {
        return j.at(name).get<T>();
    } catch (const std::exception&) {
        FAISS_THROW_FMT("%s: field '%s' has the wrong type", path.c_str(), name);
    }
}

std::string layer_file(const std::string& dir, int layer, const char* name) {
    return dir + "/layer_" + std::to_string(layer) + "/" + name + ".npy";
}

/// Reads one array of a layer as float32, checking shape and finiteness.
std::vector<float> read_layer_array(
        const std::string& path, const std::vector<size_t>& expected) {
    NpyArray a = read_npy(path);
    FAISS_THROW_IF_NOT_FMT(
            a.dtype == "<f4" || a.dtype == "<f2",
            "%s: dtype %s, expected float32 (<f4) or float16 (<f2)",
            path.c_str(), a.dtype.c_str());
    FAISS_THROW_IF_NOT_FMT(
            a.shape == expected,
            "%s: shape %s, expected %s",
            path.c_str(), shape_string(a.shape).c_str(), shape_string(expected).c_str());
    size_t n = expected[0] * expected[1] * expected[2];
    std::vector<float> out(n);
    if (a.dtype == "<f4") {
        std::memcpy(out.data(), a.data.data(), n * 4);
    } else {
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            std::memcpy(&h, a.data.data() + 2 * i, 2);
            out[i] = half_to_float(h);
        }
    }
    for (size_t i = 0; i < n; i++) {
        FAISS_THROW_IF_NOT_FMT(
                std::isfinite(out[i]),
                "%s: non-finite value %g at flat index %zd",
                path.c_str(), double(out[i]), i);
    }
    return out;
}

void write_layer_array(
        const std::string& path,
        const TraceMeta& meta,
        const std::vector<size_t>& shape,
        const std::vector<float>& x) {
    FAISS_THROW_IF_NOT_FMT(
            x.size() == shape[0] * shape[1] * shape[2],
            "%s: %zd values for shape %s",
            path.c_str(), x.size(), shape_string(shape).c_str());
    if (meta.dtype == "float32") {
        write_npy(path, "<f4", shape, x.data());
        return;
    }
    std::vector<uint16_t> h(x.size());
    for (size_t i = 0; i < x.size(); i++) {
        h[i] = float_to_half(x[i]);
    }
    write_npy(path, "<f2", shape, h.data());
}

} // namespace

TraceMeta read_trace_meta(const std::string& dir) {
    std::string path = meta_path(dir);
    std::ifstream f(path);
    FAISS_THROW_IF_NOT_FMT(f.good(), "%s: cannot open (not a trace directory?)", path.c_str());
    nlohmann::json j;
    try {
        f >> j;
    } catch (const std::exception& e) {
        FAISS_THROW_FMT("%s: not valid JSON: %s", path.c_str(), e.what());
    }
    FAISS_THROW_IF_NOT_FMT(j.is_object(), "%s: not a JSON object", path.c_str());
    TraceMeta m;
    m.format = field<std::string>(j, "format", path);
    m.n_layers = field<int>(j, "n_layers", path);
    m.n_q_heads = field<int>(j, "n_q_heads", path);
    m.n_kv_heads = field<int>(j, "n_kv_heads", path);
    m.head_dim = field<int>(j, "head_dim", path);
    m.n_tokens = field<int64_t>(j, "n_tokens", path);
    m.n_ctx = field<int64_t>(j, "n_ctx", path);
    m.rope_theta = field<double>(j, "rope_theta", path);
    try {
        m.rope_style = rope_style_from_name(field<std::string>(j, "rope_style", path));
    } catch (const faiss::FaissException& e) {
        FAISS_THROW_FMT("%s: field 'rope_style': %s", path.c_str(), e.what());
    }
    m.source = j.contains("source") ? field<std::string>(j, "source", path) : "";
    m.dtype = j.contains("dtype") ? field<std::string>(j, "dtype", path) : "float32";
    try {
        m.check();
    } catch (const faiss::FaissException& e) {
        FAISS_THROW_FMT("%s: %s", path.c_str(), e.what());
    }
    return m;
}

void write_trace_meta(const std::string& dir, const TraceMeta& m) {
    m.check();
    std::filesystem::create_directories(dir);
    nlohmann::json j = {
            {"format", m.format},         {"n_layers", m.n_layers},
            {"n_q_heads", m.n_q_heads},   {"n_kv_heads", m.n_kv_heads},
            {"head_dim", m.head_dim},     {"n_tokens", m.n_tokens},
            {"n_ctx", m.n_ctx},           {"rope_theta", m.rope_theta},
            {"rope_style", rope_style_name(m.rope_style)},
            {"source", m.source},         {"dtype", m.dtype}};
    std::ofstream f(meta_path(dir));
    FAISS_THROW_IF_NOT_FMT(f.good(), "%s: cannot open for writing", meta_path(dir).c_str());
    f << j.dump(2) << "\n";
}

TraceLayer read_trace_layer(const std::string& dir, const TraceMeta& meta, int layer) {
    FAISS_THROW_IF_NOT_FMT(
            layer >= 0 && layer < meta.n_layers,
            "%s: layer %d out of [0, n_layers=%d)",
            dir.c_str(), layer, meta.n_layers);
    size_t n = meta.n_tokens, d = meta.head_dim;
    TraceLayer t;
    t.keys = read_layer_array(layer_file(dir, layer, "keys"), {size_t(meta.n_kv_heads), n, d});
    t.values = read_layer_array(layer_file(dir, layer, "values"), {size_t(meta.n_kv_heads), n, d});
    t.queries = read_layer_array(layer_file(dir, layer, "queries"), {size_t(meta.n_q_heads), n, d});
    return t;
}

void write_trace_layer(
        const std::string& dir, const TraceMeta& meta, int layer, const TraceLayer& t) {
    meta.check();
    FAISS_THROW_IF_NOT_FMT(
            layer >= 0 && layer < meta.n_layers,
            "%s: layer %d out of [0, n_layers=%d)",
            dir.c_str(), layer, meta.n_layers);
    std::filesystem::create_directories(dir + "/layer_" + std::to_string(layer));
    size_t n = meta.n_tokens, d = meta.head_dim;
    write_layer_array(layer_file(dir, layer, "keys"), meta, {size_t(meta.n_kv_heads), n, d}, t.keys);
    write_layer_array(layer_file(dir, layer, "values"), meta, {size_t(meta.n_kv_heads), n, d}, t.values);
    write_layer_array(layer_file(dir, layer, "queries"), meta, {size_t(meta.n_q_heads), n, d}, t.queries);
}

} // namespace kvindex
