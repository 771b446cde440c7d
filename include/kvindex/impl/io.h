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

/** A file written whole or not at all. The bytes go to a temporary file
 * beside `path`; commit() flushes it to the disk (fsync) and renames it
 * over `path`. A writer destroyed before commit(), an error on the way
 * included, removes its temporary file: `path` keeps what it held. Errors
 * are FileError ("<who>: cannot write '<path>': No space left on device").
 * Every file kvindex and its tools save goes through one. A target that
 * exists and is neither a regular file nor a directory (/dev/stdout, a
 * pipe, /dev/full) is a stream: written in place, its errors reported,
 * never replaced. */
class AtomicFileWriter {
   public:
    AtomicFileWriter(std::string path, const char* who);
    ~AtomicFileWriter();
    AtomicFileWriter(const AtomicFileWriter&) = delete;
    AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

    void write(const void* data, size_t n);
    void write(const std::string& s) {
        write(s.data(), s.size());
    }
    /// Flushes, syncs and renames over the target; the writer is done.
    void commit();

   private:
    std::string path_, tmp_;
    const char* who_;
    int fd_ = -1;
    [[noreturn]] void fail(const char* doing);
    /// Unlinks the temporary file (none for a stream).
    void remove_temporary() noexcept;
};

/// Writes buf to fname, whole or not at all (AtomicFileWriter); `writer`
/// ("write_index") prefixes the errors.
void write_file(const std::string& fname, const std::vector<uint8_t>& buf, const char* writer);
/// The same for text (the tools' JSON and TSV outputs).
void write_file(const std::string& fname, const std::string& text, const char* writer);

/** The bytes of fname; `reader` ("read_index") prefixes the errors. A FIFO,
 * a device or a directory is refused (FileError) without reading: it could
 * block forever or never end; a regular file is read up to the size it had
 * when opened. */
std::vector<uint8_t> read_file(const std::string& fname, const char* reader);

/** A regular file opened for reading, as read_file does (a FIFO, a device,
 * a directory or a missing file is a FileError, without blocking), for a
 * reader that streams: the descriptor, closed by the destructor, and the
 * size the file had when opened. */
class RegularFile {
   public:
    RegularFile(const std::string& fname, const char* reader);
    ~RegularFile();
    RegularFile(const RegularFile&) = delete;
    RegularFile& operator=(const RegularFile&) = delete;

    size_t size() const {
        return size_;
    }
    /// Reads up to n bytes at the current offset; returns how many (fewer
    /// only at the end of the file).
    size_t read(void* data, size_t n);
    /// Moves to byte `offset`.
    void seek(size_t offset);

   private:
    std::string fname_;
    const char* reader_;
    int fd_ = -1;
    size_t size_ = 0;
};

/// Appends little-endian plain values to a byte vector.
struct BufferWriter {
    std::vector<uint8_t>* out;
    /// byte ranges [begin, end) of *out that another library's serializer
    /// wrote (Faiss sub-indexes, see foreign): their format is its own
    std::vector<std::pair<size_t, size_t>> foreign_ranges;
    /// byte ranges [begin, end) of the elements of each array (vector(),
    /// string(), foreign() and bytes()) of at least kArrayBytes bytes: a
    /// reader takes each in one checked read, so a file cut anywhere inside
    /// one fails the same way (tests that cut files use it)
    std::vector<std::pair<size_t, size_t>> array_ranges;
    static constexpr size_t kArrayBytes = 64;

    explicit BufferWriter(std::vector<uint8_t>* out) : out(out) {}

    void bytes(const void* p, size_t n) {
        if (n == 0) {
            return;
        }
        const uint8_t* b = static_cast<const uint8_t*>(p);
        if (n >= kArrayBytes) {
            array_ranges.emplace_back(out->size(), out->size() + n);
        }
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
