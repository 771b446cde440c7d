#pragma once

// The byte streams of kvindex's serialization (index_io.h). Public so that an
// index type defined outside the core (GPU, Python, a user's own) can write
// and read its fields: KVIndex::write_fields / read_fields receive these.

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <faiss/impl/FaissAssert.h>

namespace kvindex {

/// CRC-32 (IEEE 802.3, as zlib) of a byte range.
uint32_t crc32(const uint8_t* data, size_t size);

struct BufferReader;

/** The frame of every kvindex file (index_io.h: an index, a cache):
 * magic | u32 format version | u64 payload size | u32 CRC-32 of the payload
 * | payload. The names make the errors say which file and reader failed. */
struct FileFrame {
    uint32_t magic;
    uint32_t version;          ///< the version this build writes; it reads 1 .. version
    const char* reader;        ///< prefix of read errors ("read_index")
    const char* kind;          ///< what the magic names ("kvindex file")
    const char* version_name;  ///< how errors call the version ("format version")
};

/// Bytes of the frame before the payload.
constexpr size_t kFrameHeaderSize = 4 + 4 + 8 + 4;

/// out = the frame of `payload` (replaces its contents; one allocation).
void write_framed(const FileFrame& frame, const std::vector<uint8_t>& payload, std::vector<uint8_t>* out);

/** Checks a framed buffer (size, magic, version in 1 .. frame.version,
 * payload size, checksum), throwing with frame.reader's prefix, and
 * returns a reader over its payload whose format_version is the version
 * read. */
BufferReader read_framed(const FileFrame& frame, const uint8_t* data, size_t size);

/// Writes buf to fname; `writer` ("write_index") prefixes the errors.
void write_file(const std::string& fname, const std::vector<uint8_t>& buf, const char* writer);

/// The bytes of fname; `reader` ("read_index") prefixes the errors.
std::vector<uint8_t> read_file(const std::string& fname, const char* reader);

/// Appends little-endian plain values to a byte vector.
struct BufferWriter {
    std::vector<uint8_t>* out;
    /// byte ranges [begin, end) of *out that another library's serializer
    /// wrote (Faiss sub-indexes, see foreign): their format is its own
    std::vector<std::pair<size_t, size_t>> foreign_ranges;

    explicit BufferWriter(std::vector<uint8_t>* out) : out(out) {}

    void bytes(const void* p, size_t n) {
        if (n == 0) {
            return;
        }
        const uint8_t* b = static_cast<const uint8_t*>(p);
        out->insert(out->end(), b, b + n);
    }
    template <class T>
    void value(T x) {
        static_assert(std::is_trivially_copyable<T>::value, "plain values only");
        bytes(&x, sizeof(T));
    }
    /// u64 element count, then the elements.
    template <class T>
    void vector(const std::vector<T>& v) {
        static_assert(std::is_trivially_copyable<T>::value, "plain values only");
        value<uint64_t>(v.size());
        bytes(v.data(), v.size() * sizeof(T));
    }
    void string(const std::string& s) {
        value<uint64_t>(s.size());
        bytes(s.data(), s.size());
    }
    /// A blob another library serialized (a Faiss index), written as
    /// vector() does; its range is recorded in foreign_ranges.
    void foreign(const std::vector<uint8_t>& blob) {
        value<uint64_t>(blob.size());
        size_t begin = out->size();
        bytes(blob.data(), blob.size());
        foreign_ranges.emplace_back(begin, out->size());
    }
};

/** Reads what BufferWriter wrote; every read is checked against the bytes
 * that remain, so a truncated or forged buffer is an exception and a count
 * can never ask for more memory than the buffer holds.
 */
struct BufferReader {
    const uint8_t* data;
    size_t size;
    size_t pos = 0;
    /// container format version of the file being read (index_io.h):
    /// format 1 has no per-record version, every record reads as version 1
    uint32_t format_version = 0;
    /// index records open around the current position (nesting limit)
    int depth = 0;
    /// prefix of its errors: the reading function (read_framed sets it)
    const char* reader = "read_index";

    BufferReader(const uint8_t* data, size_t size) : data(data), size(size) {}

    size_t remaining() const {
        return size - pos;
    }
    void bytes(void* p, size_t n, const char* what) {
        need(n, what);
        if (n > 0) {
            std::memcpy(p, data + pos, n);
        }
        pos += n;
    }
    /// Moves past n bytes, checked as bytes() is: for data a validator
    /// only needs to count (a Faiss blob's codes).
    void skip(size_t n, const char* what) {
        need(n, what);
        pos += n;
    }
    template <class T>
    T value(const char* what) {
        T x;
        bytes(&x, sizeof(T), what);
        return x;
    }
    template <class T>
    std::vector<T> vector(const char* what) {
        uint64_t n = value<uint64_t>(what);
        FAISS_THROW_IF_NOT_FMT(
                n <= remaining() / sizeof(T),
                "%s: %s claims %llu elements, only %zd bytes left",
                reader,
                what,
                (unsigned long long)n,
                remaining());
        std::vector<T> v(n);
        bytes(v.data(), n * sizeof(T), what);
        return v;
    }
    std::string string(const char* what) {
        std::vector<char> v = vector<char>(what);
        return std::string(v.begin(), v.end());
    }

   private:
    void need(size_t n, const char* what) const {
        FAISS_THROW_IF_NOT_FMT(
                n <= remaining(),
                "%s: truncated while reading %s (%zd bytes needed, %zd left)",
                reader,
                what,
                n,
                remaining());
    }
};

} // namespace kvindex
