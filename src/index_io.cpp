#include <kvindex/index_io.h>

#include <cmath>
#include <memory>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/impl/io.h>
#include <kvindex/registry.h>

#include "checks.h"
#include "faiss_checks.h"

namespace kvindex {

namespace {

const FileFrame kIndexFrame{fourcc("KVIX"), kIndexFormatVersion, "read_index", "kvindex file", "format version"};
constexpr int kMaxNesting = 8;

/// The fields every record has, before its type's own.
void write_kvindex_fields(const KVIndex* idx, BufferWriter& w) {
    w.value<int32_t>(idx->d);
    w.value<int32_t>(idx->d_value);
    w.value<int64_t>(idx->ntotal);
    w.value<int64_t>(idx->k);
    w.value<uint8_t>(uint8_t(idx->estimator));
    w.value<uint8_t>(idx->has_rope);
    w.value<double>(idx->rope.theta);
    w.value<uint8_t>(uint8_t(idx->rope.style));
    w.value<uint8_t>(uint8_t(idx->kv_type)); // format >= 3
}

void read_kvindex_fields(KVIndex* idx, BufferReader& r) {
    idx->d = r.value<int32_t>("d");
    idx->d_value = r.value<int32_t>("d_value");
    idx->ntotal = r.value<int64_t>("ntotal");
    idx->k = r.value<int64_t>("k");
    uint8_t est = r.value<uint8_t>("estimator");
    idx->has_rope = r.value<uint8_t>("has_rope") != 0;
    idx->rope.theta = r.value<double>("rope theta");
    uint8_t style = r.value<uint8_t>("rope style");
    // formats 1 and 2 stored float32 only
    uint8_t kv_type = r.format_version >= 3 ? r.value<uint8_t>("storage type") : 0;
    // enum classes with a fixed underlying type hold any raw value: the
    // checks below name it
    idx->estimator = Estimator(est);
    idx->kv_type = KVType(kv_type);
    idx->rope.style = RopeStyle(style);
    // checked now: the type's fields are sized by d, d_value and ntotal
    idx->check_fields("read_index");
}

} // namespace

void write_index_record(const KVIndex* index, BufferWriter& w) {
    FAISS_THROW_IF_NOT_MSG(index, "write_index: index is nullptr");
    if (std::unique_ptr<KVIndex> twin = index->io_twin()) {
        write_index_record(twin.get(), w); // e.g. a GPU index: its CPU twin's record
        return;
    }
    // what read_index_record checks, so that no record is saved that does
    // not read back (e.g. a field assigned out of range through C++)
    index->check_children();
    index->check_invariants();
    IndexTypeInfo t = index_type_of(index);
    w.value(t.fourcc);
    w.value(t.record_version);
    write_kvindex_fields(index, w);
    index->write_fields(w);
}

std::unique_ptr<KVIndex> read_index_record(BufferReader& r) {
    FAISS_THROW_IF_NOT_MSG(r.depth < kMaxNesting, "read_index: indexes nested too deeply");
    uint32_t tag = r.value<uint32_t>("index type");
    IndexTypeInfo t;
    FAISS_THROW_IF_NOT_FMT(
            find_index_type(tag, &t), "read_index: unknown index type fourcc 0x%08x", tag);
    // format 1 had one version for everything: its records are version 1
    uint32_t version = r.format_version >= 2 ? r.value<uint32_t>("record version") : 1;
    FAISS_THROW_IF_NOT_FMT(
            version >= 1 && version <= t.record_version,
            "read_index: %s record version %u, this build reads versions 1 to %u",
            t.name.c_str(),
            version,
            t.record_version);
    std::unique_ptr<KVIndex> index = t.make_empty();
    // a registered row is user code: its constructor must make its own type
    FAISS_THROW_IF_NOT_FMT(
            index && t.name == index->type_name(),
            "read_index: the registry row '%s' made %s, not an empty %s",
            t.name.c_str(),
            index ? index->type_name() : "nullptr",
            t.name.c_str());
    read_kvindex_fields(index.get(), r);
    r.depth++;
    index->read_fields(r, version);
    r.depth--;
    index->check_invariants();
    index->record_children_stamps(); // as if it had written them itself
    return index;
}

void write_index(const KVIndex* index, std::vector<uint8_t>* buffer, IndexFileLayout* layout) {
    FAISS_THROW_IF_NOT_MSG(index && buffer, "write_index: nullptr argument");
    ReadScope scope(*index, "write_index");
    std::vector<uint8_t> payload;
    BufferWriter pw(&payload);
    write_index_record(index, pw);
    if (layout) {
        auto framed = [](const std::vector<std::pair<size_t, size_t>>& ranges) {
            std::vector<std::pair<size_t, size_t>> out;
            for (auto [begin, end] : ranges) {
                out.emplace_back(begin + kFrameHeaderSize, end + kFrameHeaderSize);
            }
            return out;
        };
        layout->faiss_ranges = framed(pw.foreign_ranges);
        layout->array_ranges = framed(pw.array_ranges);
        layout->faiss_array_ranges.clear();
        for (auto [begin, end] : pw.foreign_ranges) {
            std::vector<std::pair<size_t, size_t>> inside;
            check_faiss_blob(payload.data() + begin, end - begin, index->d, &inside);
            for (auto [b, e] : inside) {
                layout->faiss_array_ranges.emplace_back(
                        kFrameHeaderSize + begin + b, kFrameHeaderSize + begin + e);
            }
        }
    }
    write_framed(kIndexFrame, payload, buffer);
}

void write_index(const KVIndex* index, std::vector<uint8_t>* buffer) {
    write_index(index, buffer, nullptr);
}

void write_index(const KVIndex* index, const std::string& fname) {
    std::vector<uint8_t> buf;
    write_index(index, &buf);
    write_file(fname, buf, "write_index");
}

namespace {

std::unique_ptr<KVIndex> parse_index(const uint8_t* data, size_t size) {
    BufferReader pr = read_framed(kIndexFrame, data, size);
    std::unique_ptr<KVIndex> index = read_index_record(pr);
    FAISS_THROW_IF_NOT_FMT(
            pr.remaining() == 0,
            "read_index: %zd trailing bytes after the index",
            pr.remaining());
    return index;
}

} // namespace

std::unique_ptr<KVIndex> read_index(const uint8_t* data, size_t size) {
    return read_data("read_index", "buffer of " + std::to_string(size) + " bytes", [&] {
        return parse_index(data, size);
    });
}

std::unique_ptr<KVIndex> clone_index(const KVIndex* index) {
    check_not_null(index, "clone_index: index");
    std::vector<uint8_t> buf;
    write_index(index, &buf);
    return read_index(buf);
}

std::unique_ptr<KVIndex> read_index(const std::string& fname) {
    std::vector<uint8_t> buf = read_file(fname, "read_index");
    return read_data("read_index", "'" + fname + "'", [&] { return parse_index(buf.data(), buf.size()); });
}

} // namespace kvindex
