// write_cache / read_cache: a whole KVCache in one file (grammar in index_io.h).

#include <kvindex/index_io.h>

#include <cmath>
#include <memory>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/KVCache.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>
#include <kvindex/registry.h>

namespace kvindex {

namespace {

// not the index file's "KVIX": a cache handed to read_index (or an index to
// read_cache) is refused by its magic, not half-parsed
const FileFrame kCacheFrame{fourcc("KVCC"), kCacheFormatVersion, "read_cache", "kvindex cache file",
                             "cache format version"};
/// shape limits: far above any model, low enough that n_layers * n_kv_heads
/// cannot overflow and a forged count is caught before anything is built
constexpr int kMaxLayers = KVCache::kMaxLayers;
constexpr int kMaxHeads = KVCache::kMaxHeads;
/// a lower bound on the bytes of one index record (fourcc, version and the
/// KVIndex fields), to refuse a record count the payload cannot hold
constexpr size_t kMinRecordBytes = 32;

void write_payload(const KVCache& c, BufferWriter& w) {
    FAISS_THROW_IF_NOT_FMT(
            c.indexes.size() == size_t(c.n_layers) * c.n_kv_heads,
            "write_cache: the cache holds %zd indexes, its shape %d layers x %d KV heads",
            c.indexes.size(),
            c.n_layers,
            c.n_kv_heads);
    // every layer held for the whole write, as attend holds one: an append
    // running meanwhile is refused before any head takes its token (guarding
    // the heads alone let one head take it and the other refuse it)
    std::vector<std::unique_ptr<ReadScope>> layers;
    for (AccessCount& calls : c.layer_calls) {
        layers.push_back(std::make_unique<ReadScope>(calls, "write_cache", "this layer of the cache"));
    }
    c.check_invariants(); // else the file would not read back
    w.value<int32_t>(c.n_layers);
    w.value<int32_t>(c.n_q_heads);
    w.value<int32_t>(c.n_kv_heads);
    w.value<int32_t>(c.d);
    w.value<int32_t>(c.d_value);
    w.string(c.index_string);
    w.string(c.dense_string);
    w.vector(std::vector<int32_t>(c.dense_layers.begin(), c.dense_layers.end()));
    RopeParams rope; // the default when none is fixed, as before
    w.value<uint8_t>(c.fixed_rope(&rope));
    w.value<double>(rope.theta);
    w.value<uint8_t>(uint8_t(rope.style));
    w.value<uint32_t>(kIndexFormatVersion);
    w.value<uint64_t>(c.indexes.size());
    for (const auto& index : c.indexes) {
        FAISS_THROW_IF_NOT_MSG(index, "write_cache: the cache holds a nullptr index");
        ReadScope scope(*index, "write_cache");
        write_index_record(index.get(), w);
    }
}

std::unique_ptr<KVCache> read_payload(BufferReader& r) {
    int n_layers = r.value<int32_t>("n_layers");
    int n_q_heads = r.value<int32_t>("n_q_heads");
    int n_kv_heads = r.value<int32_t>("n_kv_heads");
    int d = r.value<int32_t>("d");
    int d_value = r.value<int32_t>("d_value");
    FAISS_THROW_IF_NOT_FMT(
            n_layers > 0 && n_layers <= kMaxLayers,
            "read_cache: n_layers=%d outside [1, %d]",
            n_layers,
            kMaxLayers);
    FAISS_THROW_IF_NOT_FMT(
            n_kv_heads > 0 && n_kv_heads <= kMaxHeads && n_q_heads > 0 &&
                    n_q_heads <= kMaxHeads,
            "read_cache: n_q_heads=%d, n_kv_heads=%d outside [1, %d]",
            n_q_heads,
            n_kv_heads,
            kMaxHeads);
    FAISS_THROW_IF_NOT_FMT(
            n_q_heads % n_kv_heads == 0,
            "read_cache: n_q_heads=%d is not a multiple of n_kv_heads=%d",
            n_q_heads,
            n_kv_heads);
    FAISS_THROW_IF_NOT_FMT(
            d > 0 && d <= kMaxDimension && d_value > 0 && d_value <= kMaxDimension,
            "read_cache: dimensions d=%d, d_value=%d outside [1, %d]",
            d,
            d_value,
            kMaxDimension);
    std::string index_string = r.string("index string");
    std::string dense_string = r.string("dense string");
    std::vector<int32_t> dense_layers = r.vector<int32_t>("dense layers");
    for (int32_t l : dense_layers) {
        FAISS_THROW_IF_NOT_FMT(
                l >= 0 && l < n_layers,
                "read_cache: dense layer %d outside [0, n_layers=%d)",
                l,
                n_layers);
    }
    bool has_rope = r.value<uint8_t>("has_rope") != 0;
    RopeParams rope;
    rope.theta = r.value<double>("rope theta");
    uint8_t style = r.value<uint8_t>("rope style");
    FAISS_THROW_IF_NOT_FMT(
            std::isfinite(rope.theta) && rope.theta > 0,
            "read_cache: invalid RoPE theta %g",
            rope.theta);
    FAISS_THROW_IF_NOT_FMT(style <= 1, "read_cache: invalid RoPE style %d", int(style));
    rope.style = RopeStyle(style);
    uint32_t index_format = r.value<uint32_t>("index format version");
    FAISS_THROW_IF_NOT_FMT(
            index_format >= 1 && index_format <= kIndexFormatVersion,
            "read_cache: index records of format version %u, this build reads 1 to %u",
            index_format,
            kIndexFormatVersion);
    uint64_t count = r.value<uint64_t>("index count");
    const size_t expected = size_t(n_layers) * n_kv_heads;
    FAISS_THROW_IF_NOT_FMT(
            count == expected,
            "read_cache: %zd index records, the shape needs %d layers x %d KV heads = %zd",
            size_t(count),
            n_layers,
            n_kv_heads,
            expected);
    // before building anything sized by the shape
    FAISS_THROW_IF_NOT_FMT(
            count <= r.remaining() / kMinRecordBytes,
            "read_cache: %zd index records cannot fit in the %zd bytes left (truncated?)",
            size_t(count),
            r.remaining());

    // the constructor checks the strings (they must parse); its indexes
    // then give the type each record must have, and are replaced
    auto cache = std::make_unique<KVCache>(
            n_layers,
            n_q_heads,
            n_kv_heads,
            d,
            d_value,
            index_string,
            dense_string,
            std::vector<int>(dense_layers.begin(), dense_layers.end()));
    cache->has_rope = has_rope;
    cache->rope = rope;
    r.format_version = index_format;
    for (int l = 0; l < n_layers; l++) {
        for (int h = 0; h < n_kv_heads; h++) {
            std::unique_ptr<KVIndex> index = read_index_record(r);
            FAISS_THROW_IF_NOT_FMT(
                    index->d == d && index->d_value == d_value,
                    "read_cache: index (layer %d, head %d) has d=%d d_value=%d, the cache "
                    "d=%d d_value=%d",
                    l,
                    h,
                    index->d,
                    index->d_value,
                    d,
                    d_value);
            std::unique_ptr<KVIndex>& slot = cache->indexes[size_t(l) * n_kv_heads + h];
            std::string got = index_factory_string(index.get());
            std::string want = index_factory_string(slot.get());
            FAISS_THROW_IF_NOT_FMT(
                    got == want,
                    "read_cache: index (layer %d, head %d) is '%s', its layer's string "
                    "builds '%s'",
                    l,
                    h,
                    got.c_str(),
                    want.c_str());
            slot = std::move(index);
        }
    }
    cache->check_invariants();
    return cache;
}

} // namespace

void write_cache(const KVCache& cache, std::vector<uint8_t>* buffer) {
    FAISS_THROW_IF_NOT_MSG(buffer, "write_cache: nullptr buffer");
    std::vector<uint8_t> payload;
    BufferWriter pw(&payload);
    write_payload(cache, pw);
    write_framed(kCacheFrame, payload, buffer);
}

void write_cache(const KVCache& cache, const std::string& fname) {
    std::vector<uint8_t> buf;
    write_cache(cache, &buf);
    write_file(fname, buf, "write_cache");
}

namespace {

std::unique_ptr<KVCache> parse_cache(const uint8_t* data, size_t size) {
    if (data && size >= kFrameHeaderSize) { // an index file is named, not just refused
        BufferReader head(data, size);
        FAISS_THROW_IF_NOT_MSG(
                head.value<uint32_t>("magic") != fourcc("KVIX"),
                "read_cache: this is a kvindex index file, not a cache (use read_index)");
    }
    BufferReader pr = read_framed(kCacheFrame, data, size);
    std::unique_ptr<KVCache> cache = read_payload(pr);
    FAISS_THROW_IF_NOT_FMT(
            pr.remaining() == 0,
            "read_cache: %zd trailing bytes after the last index",
            pr.remaining());
    return cache;
}

} // namespace

std::unique_ptr<KVCache> read_cache(const uint8_t* data, size_t size) {
    return read_data("read_cache", "buffer of " + std::to_string(size) + " bytes", [&] {
        return parse_cache(data, size);
    });
}

std::unique_ptr<KVCache> read_cache(const std::string& fname) {
    std::vector<uint8_t> buf = read_file(fname, "read_cache");
    return read_data("read_cache", "'" + fname + "'", [&] { return parse_cache(buf.data(), buf.size()); });
}

} // namespace kvindex
