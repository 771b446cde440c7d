#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>

/* Serialization. Faiss 1.7.3 cannot write foreign index types, so kvindex
 * has its own format:
 *
 *   "KVIX" | u32 format version | u64 payload size | u32 CRC-32 of payload | payload
 *
 * and the payload is one index record: a fourcc naming the type, the KVIndex
 * fields, then the type's own fields; wrapped indexes are nested records;
 * Faiss sub-indexes are written by Faiss's own io into a length-prefixed
 * blob. Reading checks the checksum before parsing (a flipped byte anywhere
 * is an exception), and every count against the bytes that remain (a
 * truncated or forged file is an exception, never a huge allocation).
 */

namespace kvindex {

constexpr uint32_t kIndexFormatVersion = 1;

void write_index(const KVIndex* index, const std::string& fname);
void write_index(const KVIndex* index, std::vector<uint8_t>* buffer);

std::unique_ptr<KVIndex> read_index(const std::string& fname);
std::unique_ptr<KVIndex> read_index(const uint8_t* data, size_t size);
inline std::unique_ptr<KVIndex> read_index(const std::vector<uint8_t>& buffer) {
    return read_index(buffer.data(), buffer.size());
}

} // namespace kvindex
