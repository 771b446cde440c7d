#include <kvindex/impl/io.h>

#include <array>
#include <cstdio>
#include <memory>

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

void write_file(const std::string& fname, const std::vector<uint8_t>& buf, const char* writer) {
    std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(fname.c_str(), "wb"), std::fclose);
    FAISS_THROW_IF_NOT_FMT(f, "%s: cannot open '%s' for writing", writer, fname.c_str());
    FAISS_THROW_IF_NOT_FMT(
            std::fwrite(buf.data(), 1, buf.size(), f.get()) == buf.size(),
            "%s: short write to '%s'",
            writer,
            fname.c_str());
    // a full disk can show only at close
    FAISS_THROW_IF_NOT_FMT(
            std::fclose(f.release()) == 0, "%s: error closing '%s'", writer, fname.c_str());
}

std::vector<uint8_t> read_file(const std::string& fname, const char* reader) {
    std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(fname.c_str(), "rb"), std::fclose);
    FAISS_THROW_IF_NOT_FMT(f, "%s: cannot open '%s'", reader, fname.c_str());
    std::vector<uint8_t> buf;
    uint8_t chunk[1 << 16];
    size_t got;
    while ((got = std::fread(chunk, 1, sizeof(chunk), f.get())) > 0) {
        buf.insert(buf.end(), chunk, chunk + got);
    }
    FAISS_THROW_IF_NOT_FMT(!std::ferror(f.get()), "%s: error reading '%s'", reader, fname.c_str());
    return buf;
}

} // namespace kvindex
