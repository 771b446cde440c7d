#pragma once

// A reader for GGUF files (the llama.cpp model format, version 2 and 3):
// metadata, tensor directory, and dequantization of the tensor types a
// small quantized model uses (F32, F16, Q4_0, Q4_1, Q8_0).

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kvllm {

/// ggml tensor types this reader can dequantize (values are ggml's ids).
enum class GgmlType : uint32_t {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q8_0 = 8,
};

/// Name of a ggml type id ("Q4_1"), or "type<N>" for one we do not read.
std::string ggml_type_name(uint32_t type);

/** One metadata value. Scalars are widened to int64 / double; arrays of
 * strings and of numbers are kept as vectors. */
struct GgufValue {
    enum Kind { integer, real, boolean, string, string_array, int_array, real_array } kind;
    bool is_u64 = false; ///< an integer read as uint64: i holds its bits (a value above 2^63 is negative)
    int64_t i = 0;
    double f = 0;
    std::string s;
    std::vector<std::string> strings;
    std::vector<int64_t> ints;
    std::vector<double> reals;
};

struct GgufTensor {
    std::string name;
    uint32_t type = 0;
    std::vector<int64_t> shape; ///< ggml order: shape[0] is the contiguous dimension
    uint64_t offset = 0;        ///< from the start of the data section
    uint64_t n_bytes = 0;

    int64_t n_elements() const;
};

/** A file mapped read-only into memory (POSIX mmap): a page is read when it
 * is first touched, so a command that needs only the metadata (kvllm
 * tokenize) reads a few MB of a 98 MB model. As with llama.cpp's mapping,
 * the file must not be truncated while it is mapped. */
class MappedFile {
   public:
    /// Throws std::runtime_error naming the path when it is not a regular
    /// file or cannot be mapped.
    explicit MappedFile(const std::string& path);
    ~MappedFile();
    MappedFile(MappedFile&& other) noexcept;
    MappedFile(const MappedFile&) = delete;
    MappedFile& operator=(const MappedFile&) = delete;

    const uint8_t* data() const {
        return data_;
    }
    size_t size() const {
        return size_;
    }

   private:
    const uint8_t* data_ = nullptr; ///< size_ bytes; null for an empty file
    size_t size_ = 0;
};

/** A GGUF file mapped into memory. The constructor checks the whole
 * structure (magic, version, counts, string lengths, tensor extents and
 * types, no key or tensor name twice) and throws a message naming the file
 * and the problem. */
struct GgufFile {
    std::string path;
    uint32_t version = 0;
    std::map<std::string, GgufValue> metadata;
    std::vector<GgufTensor> tensors;
    MappedFile bytes;           ///< the whole file
    uint64_t data_offset = 0;   ///< start of the tensor data section in bytes

    explicit GgufFile(const std::string& path);

    bool has(const std::string& key) const {
        return metadata.count(key) != 0;
    }
    /// Throws naming the key when absent or of another kind (a boolean is
    /// not an integer).
    int64_t get_int(const std::string& key) const;
    /// The same, also throwing naming the key and value when outside [min, max].
    int64_t get_int(const std::string& key, int64_t min, int64_t max) const;
    double get_real(const std::string& key) const; ///< accepts integers too
    const std::string& get_string(const std::string& key) const;
    const std::vector<std::string>& get_strings(const std::string& key) const;
    const std::vector<int64_t>& get_ints(const std::string& key) const;

    const GgufTensor* find_tensor(const std::string& name) const;
    /// Throws naming the tensor when absent.
    const GgufTensor& tensor(const std::string& name) const;
    /// The same, also throwing when the tensor's ggml shape is not `shape`.
    const GgufTensor& tensor(const std::string& name, const std::vector<int64_t>& shape) const;

    /** Dequantized copy of a tensor, size n_elements(), in ggml order.
     * If `shape` is not empty the tensor's shape must equal it. */
    std::vector<float> dequantize(const std::string& name, const std::vector<int64_t>& shape = {}) const;
};

/// Bytes that n elements of a type occupy; throws for an unsupported type
/// or when n is not a multiple of the block size.
uint64_t ggml_row_bytes(uint32_t type, int64_t n);

/// Dequantizes n elements (a multiple of the type's block size).
void dequantize_row(uint32_t type, const uint8_t* src, float* dst, int64_t n);

/** Whether the n elements at src (a multiple of the type's block size)
 * dequantize to finite values, without dequantizing them: a quantized
 * weight is d * q (+ m) with |q| <= 128, finite when the block's half
 * scales are, so only those are read. */
bool row_is_finite(uint32_t type, const uint8_t* src, int64_t n);

} // namespace kvllm
