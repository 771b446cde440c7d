#include <kvindex/impl/io.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <kvindex/errors.h>

namespace kvindex {

namespace {

/// CRC-32 (IEEE, reflected) tables for slicing by 8: t[0] is the bytewise
/// table, t[k][b] the CRC of byte b followed by k zero bytes, so that eight
/// bytes fold in with eight independent lookups (~8x the bytewise loop).
using CrcTables = std::array<std::array<uint32_t, 256>, 8>;

CrcTables make_crc_tables() {
    CrcTables t{};
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) {
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        }
        t[0][i] = c;
    }
    for (int k = 1; k < 8; k++) {
        for (uint32_t i = 0; i < 256; i++) {
            t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFF];
        }
    }
    return t;
}

/// Four bytes as a little-endian word, whatever the machine's order.
uint32_t le32(const uint8_t* p) {
    return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

} // namespace

uint32_t crc32(const uint8_t* data, size_t size) {
    static const CrcTables t = make_crc_tables();
    uint32_t c = 0xFFFFFFFFu;
    for (; size >= 8; data += 8, size -= 8) {
        uint32_t lo = le32(data) ^ c, hi = le32(data + 4);
        c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
                t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    }
    for (; size > 0; data++, size--) {
        c = t[0][(c ^ *data) & 0xFF] ^ (c >> 8);
    }
    return c ^ 0xFFFFFFFFu;
}

void write_framed(const FileFrame& frame, const std::vector<uint8_t>& payload, std::vector<uint8_t>* out) {
    std::vector<uint8_t> framed;
    framed.reserve(kFrameHeaderSize + payload.size()); // one allocation
    BufferWriter w(&framed);
    w.value(frame.magic);
    w.value(frame.version);
    w.value<uint64_t>(payload.size());
    w.value<uint32_t>(crc32(payload.data(), payload.size()));
    w.bytes(payload.data(), payload.size());
    *out = std::move(framed);
}

BufferReader read_framed(const FileFrame& frame, const uint8_t* data, size_t size) {
    FAISS_THROW_IF_NOT_FMT(data || size == 0, "%s: nullptr buffer", frame.reader);
    FAISS_THROW_IF_NOT_FMT(
            size >= kFrameHeaderSize,
            "%s: %zd bytes, too short for the %zd-byte header",
            frame.reader,
            size,
            kFrameHeaderSize);
    BufferReader r(data, size);
    r.reader = frame.reader;
    FAISS_THROW_IF_NOT_FMT(
            r.value<uint32_t>("magic") == frame.magic,
            "%s: not a %s (bad magic)",
            frame.reader,
            frame.kind);
    uint32_t version = r.value<uint32_t>("version");
    FAISS_THROW_IF_NOT_FMT(
            version >= 1 && version <= frame.version,
            "%s: %s %u, this build reads versions 1 to %u",
            frame.reader,
            frame.version_name,
            version,
            frame.version);
    uint64_t payload_size = r.value<uint64_t>("payload size");
    uint32_t crc = r.value<uint32_t>("checksum");
    FAISS_THROW_IF_NOT_FMT(
            payload_size == r.remaining(),
            "%s: header announces %zd payload bytes, %zd present (truncated?)",
            frame.reader,
            size_t(payload_size),
            r.remaining());
    FAISS_THROW_IF_NOT_FMT(
            crc32(data + r.pos, r.remaining()) == crc,
            "%s: checksum mismatch (corrupt file)",
            frame.reader);
    BufferReader payload(data + r.pos, r.remaining());
    payload.format_version = version;
    payload.reader = frame.reader;
    return payload;
}

namespace {

/// FileError naming the call, the path and errno's text.
[[noreturn]] void throw_file_error(const char* who, const char* doing, const std::string& fname, int err) {
    throw FileError(
            std::string(who) + ": cannot " + doing + " '" + fname + "': " + std::strerror(err),
            err,
            fname,
            std::string(who) + ": cannot " + doing + ": " + std::strerror(err),
            __PRETTY_FUNCTION__,
            __FILE__,
            __LINE__);
}

} // namespace

AtomicFileWriter::AtomicFileWriter(std::string path, const char* who)
        : path_(std::move(path)), tmp_(path_ + ".tmp.XXXXXX"), who_(who) {
    struct stat st;
    if (::stat(path_.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode)) {
        // a stream (/dev/stdout, a pipe, /dev/full): written in place, its
        // errors reported, never replaced by a regular file
        tmp_.clear();
        fd_ = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC);
        if (fd_ < 0) {
            throw_file_error(who_, "open", path_, errno);
        }
        return;
    }
    fd_ = ::mkstemp(&tmp_[0]);
    if (fd_ < 0) {
        throw_file_error(who_, "create a temporary file beside", path_, errno);
    }
    // mkstemp makes the file 0600; a saved file is as readable as any file
    // the user writes
    mode_t mask = ::umask(0);
    ::umask(mask);
    if (::fchmod(fd_, 0666 & ~mask) != 0) {
        fail("set the permissions of the temporary file for");
    }
}

AtomicFileWriter::~AtomicFileWriter() {
    if (fd_ >= 0) { // not committed: the target keeps what it held
        ::close(fd_);
        remove_temporary();
    }
}

void AtomicFileWriter::remove_temporary() noexcept {
    if (!tmp_.empty()) { // a stream has none
        ::unlink(tmp_.c_str());
    }
}

void AtomicFileWriter::fail(const char* doing) {
    int err = errno;
    if (fd_ >= 0) {
        ::close(fd_);
        fd_ = -1;
    }
    remove_temporary();
    throw_file_error(who_, doing, path_, err);
}

void AtomicFileWriter::write(const void* data, size_t n) {
    FAISS_THROW_IF_NOT_FMT(fd_ >= 0, "%s: '%s' is already committed", who_, path_.c_str());
    const char* p = static_cast<const char*>(data);
    for (size_t done = 0; done < n;) {
        ssize_t w = ::write(fd_, p + done, n - done);
        if (w < 0 && errno == EINTR) {
            continue;
        }
        if (w <= 0) {
            if (w == 0) {
                errno = ENOSPC;
            }
            fail("write");
        }
        done += size_t(w);
    }
}

void AtomicFileWriter::commit() {
    FAISS_THROW_IF_NOT_FMT(fd_ >= 0, "%s: '%s' is already committed", who_, path_.c_str());
    const bool stream = tmp_.empty(); // written in place: nothing to sync or rename
    if (!stream && ::fsync(fd_) != 0) {
        fail("flush to disk");
    }
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) {
        int err = errno ? errno : EIO;
        remove_temporary();
        throw_file_error(who_, "close", path_, err);
    }
    if (!stream && ::rename(tmp_.c_str(), path_.c_str()) != 0) {
        int err = errno;
        remove_temporary();
        throw_file_error(who_, "rename the temporary file over", path_, err);
    }
}

void write_file(const std::string& fname, const std::vector<uint8_t>& buf, const char* writer) {
    AtomicFileWriter out(fname, writer);
    out.write(buf.data(), buf.size());
    out.commit();
}

void write_file(const std::string& fname, const std::string& text, const char* writer) {
    AtomicFileWriter out(fname, writer);
    out.write(text);
    out.commit();
}

RegularFile::RegularFile(const std::string& fname, const char* reader) : fname_(fname), reader_(reader) {
    // O_NONBLOCK: opening a FIFO must not wait for a writer; it is then
    // refused as not a regular file
    fd_ = ::open(fname.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd_ < 0) {
        throw_file_error(reader, "open", fname, errno);
    }
    struct stat st;
    if (::fstat(fd_, &st) != 0) {
        int err = errno;
        ::close(fd_);
        throw_file_error(reader, "stat", fname, err);
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd_);
        throw FileError(
                std::string(reader) + ": '" + fname + "' is not a regular file (a FIFO, a device or a directory)",
                EINVAL,
                fname,
                std::string(reader) + ": not a regular file (a FIFO, a device or a directory)",
                __PRETTY_FUNCTION__,
                __FILE__,
                __LINE__);
    }
    size_ = size_t(st.st_size);
}

RegularFile::~RegularFile() {
    ::close(fd_);
}

size_t RegularFile::read(void* data, size_t n) {
    char* p = static_cast<char*>(data);
    size_t done = 0;
    while (done < n) {
        ssize_t r = ::read(fd_, p + done, n - done);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r < 0) {
            throw_file_error(reader_, "read", fname_, errno);
        }
        if (r == 0) {
            break;
        }
        done += size_t(r);
    }
    return done;
}

void RegularFile::seek(size_t offset) {
    if (::lseek(fd_, off_t(offset), SEEK_SET) < 0) {
        throw_file_error(reader_, "seek in", fname_, errno);
    }
}

std::vector<uint8_t> read_file(const std::string& fname, const char* reader) {
    RegularFile in(fname, reader);
    // the size bounds the read: a file growing meanwhile is read as it was,
    // one that shrank is read as it is (the parser says what is missing)
    std::vector<uint8_t> buf(in.size());
    buf.resize(in.read(buf.data(), buf.size()));
    return buf;
}

} // namespace kvindex
