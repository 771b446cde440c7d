#include "gguf.h"

#include <cerrno>
#include <cmath>
#include <cstring>
#include <set>
#include <stdexcept>
#include <utility>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <kvindex/trace.h> // half_to_float

#include "model_path.h" // file_problem

namespace kvllm {

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& what) {
    throw std::runtime_error("GGUF file " + path + ": " + what);
}

/// Bounds-checked little-endian cursor over the file bytes.
struct Cursor {
    const MappedFile& b;
    const std::string& path;
    uint64_t pos = 0;

    void need(uint64_t n, const char* what) {
        if (n > b.size() || pos > b.size() - n) {
            fail(path, std::string("truncated while reading ") + what + " at byte " +
                               std::to_string(pos) + " (file has " + std::to_string(b.size()) + ")");
        }
    }
    template <class T>
    T read(const char* what) {
        need(sizeof(T), what);
        T v;
        std::memcpy(&v, b.data() + pos, sizeof(T));
        pos += sizeof(T);
        return v;
    }
    std::string read_string(const char* what) {
        uint64_t n = read<uint64_t>(what);
        need(n, what);
        std::string s(reinterpret_cast<const char*>(b.data() + pos), n);
        pos += n;
        return s;
    }
};

enum : uint32_t {
    kU8 = 0, kI8, kU16, kI16, kU32, kI32, kF32, kBool, kString, kArray, kU64, kI64, kF64
};

/// Reads one scalar of a numeric GGUF type as int64 or double.
void read_number(Cursor& c, uint32_t t, GgufValue& v) {
    switch (t) {
        case kU8: v.kind = GgufValue::integer; v.i = c.read<uint8_t>("u8"); return;
        case kI8: v.kind = GgufValue::integer; v.i = c.read<int8_t>("i8"); return;
        case kU16: v.kind = GgufValue::integer; v.i = c.read<uint16_t>("u16"); return;
        case kI16: v.kind = GgufValue::integer; v.i = c.read<int16_t>("i16"); return;
        case kU32: v.kind = GgufValue::integer; v.i = c.read<uint32_t>("u32"); return;
        case kI32: v.kind = GgufValue::integer; v.i = c.read<int32_t>("i32"); return;
        case kU64:
            v.kind = GgufValue::integer;
            v.is_u64 = true;
            v.i = int64_t(c.read<uint64_t>("u64"));
            return;
        case kI64: v.kind = GgufValue::integer; v.i = c.read<int64_t>("i64"); return;
        case kF32: v.kind = GgufValue::real; v.f = c.read<float>("f32"); return;
        case kF64: v.kind = GgufValue::real; v.f = c.read<double>("f64"); return;
        case kBool: v.kind = GgufValue::boolean; v.i = c.read<uint8_t>("bool") != 0; return;
        default: fail(c.path, "unknown metadata value type " + std::to_string(t));
    }
}

GgufValue read_value(Cursor& c, uint32_t t) {
    GgufValue v;
    if (t == kString) {
        v.kind = GgufValue::string;
        v.s = c.read_string("string value");
        return v;
    }
    if (t != kArray) {
        read_number(c, t, v);
        return v;
    }
    uint32_t et = c.read<uint32_t>("array type");
    uint64_t n = c.read<uint64_t>("array length");
    // every element takes at least one byte: a cheap bound before reserving
    c.need(n, "array elements");
    if (et == kString) {
        v.kind = GgufValue::string_array;
        v.strings.reserve(n);
        for (uint64_t j = 0; j < n; j++) {
            v.strings.push_back(c.read_string("string array element"));
        }
        return v;
    }
    if (et == kArray) {
        fail(c.path, "nested metadata arrays are not supported");
    }
    GgufValue e;
    for (uint64_t j = 0; j < n; j++) {
        read_number(c, et, e);
        if (e.kind == GgufValue::real) {
            v.reals.push_back(e.f);
        } else {
            v.ints.push_back(e.i);
        }
    }
    v.kind = v.reals.empty() ? GgufValue::int_array : GgufValue::real_array;
    return v;
}

struct BlockFormat {
    int64_t block; ///< elements per block
    uint64_t bytes; ///< bytes per block
};

BlockFormat block_format(uint32_t type) {
    switch (GgmlType(type)) {
        case GgmlType::F32: return {1, 4};
        case GgmlType::F16: return {1, 2};
        case GgmlType::Q4_0: return {32, 18};
        case GgmlType::Q4_1: return {32, 20};
        case GgmlType::Q8_0: return {32, 34};
    }
    throw std::runtime_error("unsupported ggml tensor type " + ggml_type_name(type));
}

uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

} // namespace

std::string ggml_type_name(uint32_t type) {
    switch (type) {
        case 0: return "F32";
        case 1: return "F16";
        case 2: return "Q4_0";
        case 3: return "Q4_1";
        case 8: return "Q8_0";
        default: return "type" + std::to_string(type);
    }
}

int64_t GgufTensor::n_elements() const {
    int64_t n = 1;
    for (int64_t s : shape) {
        n *= s;
    }
    return n;
}

uint64_t ggml_row_bytes(uint32_t type, int64_t n) {
    BlockFormat f = block_format(type);
    if (n < 0 || n % f.block != 0) {
        throw std::runtime_error(std::to_string(n) + " elements are not a whole number of " +
                                 ggml_type_name(type) + " blocks of " + std::to_string(f.block));
    }
    return uint64_t(n / f.block) * f.bytes;
}

void dequantize_row(uint32_t type, const uint8_t* src, float* dst, int64_t n) {
    BlockFormat f = block_format(type);
    int64_t nb = n / f.block;
    switch (GgmlType(type)) {
        case GgmlType::F32:
            std::memcpy(dst, src, n * sizeof(float));
            return;
        case GgmlType::F16:
            for (int64_t i = 0; i < n; i++) {
                dst[i] = kvindex::half_to_float(load_u16(src + 2 * i));
            }
            return;
        default:
            break;
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* p = src + b * f.bytes;
        float* y = dst + b * 32;
        float d = kvindex::half_to_float(load_u16(p));
        switch (GgmlType(type)) {
            case GgmlType::Q4_0: // x = d * (q - 8); low nibbles are 0..15, high nibbles 16..31
                for (int j = 0; j < 16; j++) {
                    y[j] = d * float((p[2 + j] & 0x0f) - 8);
                    y[j + 16] = d * float((p[2 + j] >> 4) - 8);
                }
                break;
            case GgmlType::Q4_1: { // x = d * q + m
                float m = kvindex::half_to_float(load_u16(p + 2));
                for (int j = 0; j < 16; j++) {
                    y[j] = d * float(p[4 + j] & 0x0f) + m;
                    y[j + 16] = d * float(p[4 + j] >> 4) + m;
                }
                break;
            }
            case GgmlType::Q8_0: // x = d * q, q signed
                for (int j = 0; j < 32; j++) {
                    y[j] = d * float(int8_t(p[2 + j]));
                }
                break;
            default:
                break;
        }
    }
}

bool row_is_finite(uint32_t type, const uint8_t* src, int64_t n) {
    auto finite_half = [](uint16_t h) { return (h & 0x7c00) != 0x7c00; }; // exponent all ones: inf, NaN
    BlockFormat f = block_format(type);
    switch (GgmlType(type)) {
        case GgmlType::F32:
            for (int64_t i = 0; i < n; i++) {
                float v;
                std::memcpy(&v, src + 4 * i, 4);
                if (!std::isfinite(v)) return false;
            }
            return true;
        case GgmlType::F16:
            for (int64_t i = 0; i < n; i++) {
                if (!finite_half(load_u16(src + 2 * i))) return false;
            }
            return true;
        default:
            break;
    }
    const int n_scales = GgmlType(type) == GgmlType::Q4_1 ? 2 : 1; // d, and Q4_1's m
    for (int64_t b = 0; b < n / f.block; b++) {
        for (int s = 0; s < n_scales; s++) {
            if (!finite_half(load_u16(src + b * f.bytes + 2 * s))) return false;
        }
    }
    return true;
}

MappedFile::MappedFile(const std::string& path) {
    // a directory or a pipe has no size to map
    const std::string problem = file_problem(path);
    if (!problem.empty()) {
        fail(path, problem);
    }
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        fail(path, std::string("cannot open: ") + std::strerror(errno));
    }
    struct stat st;
    if (::fstat(fd, &st) != 0 || st.st_size < 0) {
        const int err = errno;
        ::close(fd);
        fail(path, std::string("cannot tell its size: ") + std::strerror(err));
    }
    size_ = size_t(st.st_size);
    if (size_ > 0) {
        void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
        const int err = errno;
        ::close(fd); // the mapping keeps the file
        if (p == MAP_FAILED) {
            fail(path, std::string("cannot map: ") + std::strerror(err));
        }
        data_ = static_cast<const uint8_t*>(p);
    } else {
        ::close(fd);
    }
}

MappedFile::~MappedFile() {
    if (data_) {
        ::munmap(const_cast<uint8_t*>(data_), size_);
    }
}

MappedFile::MappedFile(MappedFile&& other) noexcept
        : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

GgufFile::GgufFile(const std::string& path_in) : path(path_in), bytes(path_in) {
    Cursor c{bytes, path};
    uint32_t magic = c.read<uint32_t>("magic");
    if (std::memcmp(&magic, "GGUF", 4) != 0) {
        fail(path, "not a GGUF file (bad magic)");
    }
    version = c.read<uint32_t>("version");
    if (version != 2 && version != 3) {
        fail(path, "unsupported GGUF version " + std::to_string(version) + " (2 and 3 are read)");
    }
    uint64_t n_tensors = c.read<uint64_t>("tensor count");
    uint64_t n_kv = c.read<uint64_t>("metadata count");
    // each entry takes at least one byte: bounds the counts by the file size
    c.need(n_kv, "metadata entries");
    for (uint64_t i = 0; i < n_kv; i++) {
        std::string key = c.read_string("metadata key");
        uint32_t t = c.read<uint32_t>("metadata type");
        // a second value would silently replace the first
        if (!metadata.emplace(key, read_value(c, t)).second) {
            fail(path, "metadata key " + key + " appears twice");
        }
    }
    c.need(n_tensors, "tensor directory");
    std::set<std::string> names;
    for (uint64_t i = 0; i < n_tensors; i++) {
        GgufTensor t;
        t.name = c.read_string("tensor name");
        if (!names.insert(t.name).second) {
            fail(path, "tensor " + t.name + " appears twice"); // find_tensor would see the first only
        }
        uint32_t n_dims = c.read<uint32_t>("tensor rank");
        if (n_dims == 0 || n_dims > 4) {
            fail(path, "tensor " + t.name + " has rank " + std::to_string(n_dims) + " (1..4 allowed)");
        }
        // every dimension and their product in [1, 2^40], so that no size
        // computed from the shape can overflow
        const uint64_t max_elements = uint64_t(1) << 40;
        uint64_t n_elements = 1;
        for (uint32_t j = 0; j < n_dims; j++) {
            uint64_t s = c.read<uint64_t>("tensor shape");
            if (s == 0 || s > max_elements / n_elements) {
                fail(path, "tensor " + t.name + " has dimension " + std::to_string(s) +
                                   " (at most 2^40 elements in all)");
            }
            n_elements *= s;
            t.shape.push_back(int64_t(s));
        }
        t.type = c.read<uint32_t>("tensor type");
        t.offset = c.read<uint64_t>("tensor offset");
        tensors.push_back(std::move(t));
    }
    uint64_t alignment = has("general.alignment") ? uint64_t(get_int("general.alignment", 1, 1 << 30)) : 32;
    if ((alignment & (alignment - 1)) != 0) {
        fail(path, "general.alignment " + std::to_string(alignment) + " is not a power of two");
    }
    data_offset = (c.pos + alignment - 1) / alignment * alignment;
    for (GgufTensor& t : tensors) {
        try {
            t.n_bytes = ggml_row_bytes(t.type, t.shape[0]) * uint64_t(t.n_elements() / t.shape[0]);
        } catch (const std::exception& e) {
            fail(path, "tensor " + t.name + ": " + e.what());
        }
        if (data_offset > bytes.size() || t.offset > bytes.size() - data_offset ||
            t.n_bytes > bytes.size() - data_offset - t.offset) {
            fail(path, "tensor " + t.name + " extends past the end of the file (truncated?)");
        }
    }
}

namespace {
const GgufValue& lookup(const GgufFile& f, const std::string& key, GgufValue::Kind kind, const char* kind_name) {
    auto it = f.metadata.find(key);
    if (it == f.metadata.end()) {
        fail(f.path, "missing metadata key " + key);
    }
    if (it->second.kind != kind) {
        fail(f.path, "metadata key " + key + " is not " + kind_name);
    }
    return it->second;
}
} // namespace

int64_t GgufFile::get_int(const std::string& key) const {
    return lookup(*this, key, GgufValue::integer, "an integer").i;
}

int64_t GgufFile::get_int(const std::string& key, int64_t min, int64_t max) const {
    const GgufValue& v = lookup(*this, key, GgufValue::integer, "an integer");
    // a u64 above 2^63 reads as negative: outside any range, printed as it is
    if ((v.is_u64 && v.i < 0) || v.i < min || v.i > max) {
        const std::string value = v.is_u64 ? std::to_string(uint64_t(v.i)) : std::to_string(v.i);
        fail(path, "metadata key " + key + " = " + value + " is outside [" + std::to_string(min) + ", " +
                           std::to_string(max) + "]");
    }
    return v.i;
}

double GgufFile::get_real(const std::string& key) const {
    auto it = metadata.find(key);
    if (it != metadata.end() && it->second.kind == GgufValue::integer) {
        return double(it->second.i);
    }
    return lookup(*this, key, GgufValue::real, "a number").f;
}

const std::string& GgufFile::get_string(const std::string& key) const {
    return lookup(*this, key, GgufValue::string, "a string").s;
}

const std::vector<std::string>& GgufFile::get_strings(const std::string& key) const {
    return lookup(*this, key, GgufValue::string_array, "a string array").strings;
}

const std::vector<int64_t>& GgufFile::get_ints(const std::string& key) const {
    return lookup(*this, key, GgufValue::int_array, "an integer array").ints;
}

const GgufTensor* GgufFile::find_tensor(const std::string& name) const {
    for (const GgufTensor& t : tensors) {
        if (t.name == name) {
            return &t;
        }
    }
    return nullptr;
}

const GgufTensor& GgufFile::tensor(const std::string& name) const {
    const GgufTensor* t = find_tensor(name);
    if (!t) {
        fail(path, "missing tensor " + name);
    }
    return *t;
}

const GgufTensor& GgufFile::tensor(const std::string& name, const std::vector<int64_t>& shape) const {
    const GgufTensor& t = tensor(name);
    if (shape != t.shape) {
        std::string want, got;
        for (int64_t s : shape) want += " " + std::to_string(s);
        for (int64_t s : t.shape) got += " " + std::to_string(s);
        fail(path, "tensor " + name + " has shape [" + got + " ] where [" + want + " ] is expected");
    }
    return t;
}

std::vector<float> GgufFile::dequantize(const std::string& name, const std::vector<int64_t>& shape) const {
    const GgufTensor& t = shape.empty() ? tensor(name) : tensor(name, shape);
    std::vector<float> out(size_t(t.n_elements()));
    dequantize_row(t.type, bytes.data() + data_offset + t.offset, out.data(), t.n_elements());
    return out;
}

} // namespace kvllm
