#pragma once

// A saved index's header rewritten to agree with a changed payload (its size
// and CRC-32), so that a reader has to catch the change by parsing: the one
// implementation the io tests (forge.h) and the fuzzers (fuzz/fuzz_common.h)
// share. The CRC is written here, independently of src/io.cpp.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kvtest {

/// magic, format version, payload size, CRC-32 of the payload (index_io.h)
constexpr size_t kIndexHeaderSize = 4 + 4 + 8 + 4;

/// CRC-32 (IEEE, as zlib), a byte at a time from a table made here bit by
/// bit (the library folds eight bytes at once with tables of its own).
inline uint32_t crc32_ref(const uint8_t* p, size_t n) {
    static const std::array<uint32_t, 256> table = [] {
        std::array<uint32_t, 256> t{};
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t c = i;
            for (int b = 0; b < 8; b++) {
                c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
            }
            t[i] = c;
        }
        return t;
    }();
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c = table[(c ^ p[i]) & 0xFFu] ^ (c >> 8);
    }
    return ~c;
}

/// Rewrites the payload size and the checksum of the header to match the
/// payload that follows it; a buffer shorter than a header is left as it is.
inline void forge_header(std::vector<uint8_t>& buf) {
    if (buf.size() < kIndexHeaderSize) {
        return;
    }
    uint64_t payload = buf.size() - kIndexHeaderSize;
    std::memcpy(buf.data() + 8, &payload, 8);
    uint32_t crc = crc32_ref(buf.data() + kIndexHeaderSize, payload);
    std::memcpy(buf.data() + 16, &crc, 4);
}

} // namespace kvtest
