#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <kvindex/KVCache.h>
#include <kvindex/KVIndex.h>

/* Serialization. Faiss 1.7.3 cannot write foreign index types, so kvindex
 * has its own format:
 *
 *   "KVIX" | u32 format version | u64 payload size | u32 CRC-32 of payload | payload
 *
 * and the payload is one index record:
 *
 *   u32 fourcc of the type | u32 record version | KVIndex fields | the type's fields
 *
 * KVIndex fields: i32 d, i32 d_value, i64 ntotal, i64 k, u8 estimator,
 * u8 has_rope, f64 RoPE theta, u8 RoPE style, and from format 3 on u8
 * storage type (KVType; the keys and values of the type's fields are in it).
 *
 * The fourcc and the record version come from the type's registry row
 * (registry.h); the type writes its own fields (KVIndex::write_fields),
 * its inner indexes as nested records. Faiss sub-indexes are written by
 * Faiss's own io into a length-prefixed blob. Reading checks the checksum
 * before parsing (a flipped byte anywhere is an exception), every count
 * against the bytes that remain (a truncated or forged file is an
 * exception, never a huge allocation), and each record's invariants
 * (KVIndex::check_invariants).
 *
 * Versions: a record's version belongs to its type, so a type that gains a
 * field raises its own version and keeps reading the older ones. Format
 * version 1 (before per-record versions) is read as records of version 1.
 * tests/data/golden holds files of every version ever written.
 */

namespace kvindex {

struct BufferReader;
struct BufferWriter;

/// Format version of the container this build writes; it reads 1 .. this.
/// Format 3: the KVIndex fields of every record end with the storage type
/// (kv_type.h); formats 1 and 2 are read as float32 storage.
constexpr uint32_t kIndexFormatVersion = 3;

void write_index(const KVIndex* index, const std::string& fname);
void write_index(const KVIndex* index, std::vector<uint8_t>* buffer);

/** Where write_index put what: byte ranges [begin, end) of the buffer,
 * for tests and fuzzers that corrupt files. */
struct IndexFileLayout {
    /// written by Faiss's own io (the sub-indexes of TopK): their content
    /// is Faiss's format, read by Faiss's reader; every other byte is
    /// kvindex's to validate
    std::vector<std::pair<size_t, size_t>> faiss_ranges;
    /// the elements of each array of 64 bytes or more (keys, values,
    /// lists, Faiss blobs), which the reader takes in one checked read
    std::vector<std::pair<size_t, size_t>> array_ranges;
    /// inside faiss_ranges, the arrays of 64 bytes or more of each Faiss
    /// blob (codes, inverted lists, graph links), which Faiss reads whole
    /// and kvindex's validation checks element by element
    std::vector<std::pair<size_t, size_t>> faiss_array_ranges;
};

/// write_index to memory, also saying where it put what.
void write_index(const KVIndex* index, std::vector<uint8_t>* buffer, IndexFileLayout* layout);

std::unique_ptr<KVIndex> read_index(const std::string& fname);
std::unique_ptr<KVIndex> read_index(const uint8_t* data, size_t size);
inline std::unique_ptr<KVIndex> read_index(const std::vector<uint8_t>& buffer) {
    return read_index(buffer.data(), buffer.size());
}

/** A deep copy of any index (its tokens, trained models, knobs and random
 * streams), made through the io: the record knows its own type, so every
 * registered type copies without a clone method of its own (Faiss's
 * clone_index needs one branch per type). */
std::unique_ptr<KVIndex> clone_index(const KVIndex* index);

/// One index record (the payload grammar above), for types that hold
/// inner indexes: they write and read them where their fields say.
void write_index_record(const KVIndex* index, BufferWriter& w);
std::unique_ptr<KVIndex> read_index_record(BufferReader& r);

/* A whole KVCache (KVCache.h) in one file, e.g. the offline-trained
 * models of every (layer, KV head) that `kvllm train` writes:
 *
 *   "KVCC" | u32 cache format version | u64 payload size | u32 CRC-32 of payload | payload
 *
 * payload: i32 n_layers, n_q_heads, n_kv_heads, d, d_value | string
 * index_string | string dense_string | vector<i32> dense_layers | u8
 * has_rope, f64 RoPE theta, u8 RoPE style | u32 format version of the index
 * records (kIndexFormatVersion when written) | u64 record count | that many
 * index records (the payload grammar above), layer-major: (layer, head) at
 * layer * n_kv_heads + head.
 *
 * The indexes are read, not rebuilt (their tokens and trained models are
 * in the records). Reading checks the checksum, the shape against the
 * limits and itself (n_q_heads a multiple of n_kv_heads, dense layers in
 * range), the record count, and that every record has the cache's d and
 * d_value and is the type its layer's string builds.
 */

/// Format version of the cache container this build writes (it reads 1 .. this).
constexpr uint32_t kCacheFormatVersion = 1;

void write_cache(const KVCache& cache, const std::string& fname);
void write_cache(const KVCache& cache, std::vector<uint8_t>* buffer);

std::unique_ptr<KVCache> read_cache(const std::string& fname);
std::unique_ptr<KVCache> read_cache(const uint8_t* data, size_t size);
inline std::unique_ptr<KVCache> read_cache(const std::vector<uint8_t>& buffer) {
    return read_cache(buffer.data(), buffer.size());
}

} // namespace kvindex
