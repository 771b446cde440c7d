#include <kvindex/index_io.h>

#include <cmath>
#include <cstdio>
#include <memory>

#include <faiss/impl/FaissAssert.h>
#include <faiss/impl/io.h>
#include <faiss/index_io.h>

#include <kvindex/IndexKVFlat.h>
#include <kvindex/IndexLSHSample.h>
#include <kvindex/IndexProxyEvict.h>
#include <kvindex/IndexSinkWindow.h>
#include <kvindex/IndexTopK.h>

#include "checks.h"
#include "faiss_checks.h"
#include "io_buffer.h"

namespace kvindex {

namespace {

constexpr uint32_t fourcc(const char (&s)[5]) {
    return uint32_t(uint8_t(s[0])) | uint32_t(uint8_t(s[1])) << 8 |
            uint32_t(uint8_t(s[2])) << 16 | uint32_t(uint8_t(s[3])) << 24;
}

constexpr uint32_t kMagic = fourcc("KVIX");
constexpr uint32_t kFlat = fourcc("KVFl");
constexpr uint32_t kTopK = fourcc("KVTk");
constexpr uint32_t kSinkWindow = fourcc("KVSw");
constexpr uint32_t kProxyEvict = fourcc("KVPe");
constexpr uint32_t kLSHSample = fourcc("KVLs");
constexpr size_t kHeaderSize = 4 + 4 + 8 + 4;
constexpr int kMaxNesting = 8;

// ---- writing ---------------------------------------------------------------

void write_kvindex_fields(const KVIndex* idx, BufferWriter& w) {
    w.value<int32_t>(idx->d);
    w.value<int32_t>(idx->d_value);
    w.value<int64_t>(idx->ntotal);
    w.value<int64_t>(idx->k);
    w.value<uint8_t>(uint8_t(idx->estimator));
    w.value<uint8_t>(idx->has_rope);
    w.value<double>(idx->rope.theta);
    w.value<uint8_t>(uint8_t(idx->rope.style));
}

void write_storage(const KVStorage& st, BufferWriter& w) {
    w.vector(st.keys);
    w.vector(st.values);
}

void write_record(const KVIndex* idx, BufferWriter& w) {
    if (auto f = dynamic_cast<const IndexKVFlat*>(idx)) {
        w.value(kFlat);
        write_kvindex_fields(idx, w);
        write_storage(f->storage, w);
    } else if (auto t = dynamic_cast<const IndexTopK*>(idx)) {
        w.value(kTopK);
        write_kvindex_fields(idx, w);
        w.string(t->retriever_string);
        w.value<int64_t>(t->max_train_points);
        w.value<int64_t>(t->min_train_points);
        w.value<uint64_t>(t->train_seed);
        write_storage(t->storage, w);
        faiss::VectorIOWriter fw;
        faiss::write_index(t->retriever.get(), &fw);
        w.vector(fw.data);
    } else if (auto s = dynamic_cast<const IndexSinkWindow*>(idx)) {
        w.value(kSinkWindow);
        write_kvindex_fields(idx, w);
        w.value<int64_t>(s->n_sink);
        w.value<int64_t>(s->n_window);
        write_storage(s->sink, w);
        write_storage(s->window, w);
        write_record(s->inner.get(), w);
    } else if (auto h = dynamic_cast<const IndexLSHSample*>(idx)) {
        w.value(kLSHSample);
        write_kvindex_fields(idx, w);
        w.value<int32_t>(h->K);
        w.value<int32_t>(h->L);
        w.value<int32_t>(h->min_hits);
        w.value<int64_t>(h->max_sample);
        w.value<uint64_t>(h->seed);
        w.vector(h->planes);
        w.vector(h->mean);
        w.vector(h->norms);
        w.vector(h->codes);
        write_storage(h->storage, w);
        w.value<int64_t>(h->n_indexed); // the tables are rebuilt from the codes
    } else if (auto e = dynamic_cast<const IndexProxyEvict*>(idx)) {
        w.value(kProxyEvict);
        write_kvindex_fields(idx, w);
        w.value<uint8_t>(uint8_t(e->policy));
        w.value<double>(e->keep_percent);
        w.value<int64_t>(e->budget_tokens);
        w.value<double>(e->protect_percent);
        w.value<double>(e->proxy_keep_percent);
        w.value<double>(e->proxy_window_percent);
        w.value<int64_t>(e->n_sink);
        w.value<uint64_t>(e->seed);
        w.value<uint64_t>(e->stream);
        w.vector(e->positions);
        write_record(e->inner.get(), w);
    } else {
        FAISS_THROW_MSG("write_index: this index type cannot be serialized");
    }
}

// ---- reading ---------------------------------------------------------------

void read_kvindex_fields(KVIndex* idx, BufferReader& r) {
    idx->d = r.value<int32_t>("d");
    idx->d_value = r.value<int32_t>("d_value");
    idx->ntotal = r.value<int64_t>("ntotal");
    idx->k = r.value<int64_t>("k");
    uint8_t est = r.value<uint8_t>("estimator");
    idx->has_rope = r.value<uint8_t>("has_rope") != 0;
    idx->rope.theta = r.value<double>("rope theta");
    uint8_t style = r.value<uint8_t>("rope style");
    FAISS_THROW_IF_NOT_FMT(
            idx->d > 0 && idx->d_value > 0 && idx->d <= (1 << 16) &&
                    idx->d_value <= (1 << 16),
            "read_index: invalid dimensions d=%d d_value=%d",
            idx->d,
            idx->d_value);
    FAISS_THROW_IF_NOT_FMT(idx->ntotal >= 0, "read_index: invalid ntotal %zd", size_t(idx->ntotal));
    FAISS_THROW_IF_NOT_FMT(idx->k > 0, "read_index: invalid k %zd", size_t(idx->k));
    FAISS_THROW_IF_NOT_FMT(est <= 1, "read_index: invalid estimator %d", int(est));
    FAISS_THROW_IF_NOT_FMT(style <= 1, "read_index: invalid RoPE style %d", int(style));
    FAISS_THROW_IF_NOT_FMT(
            std::isfinite(idx->rope.theta) && idx->rope.theta > 0,
            "read_index: invalid RoPE theta %g",
            idx->rope.theta);
    idx->estimator = Estimator(est);
    idx->rope.style = RopeStyle(style);
}

void read_storage(KVStorage& st, const KVIndex* idx, BufferReader& r, const char* what) {
    st.d = idx->d;
    st.d_value = idx->d_value;
    st.keys = r.vector<float>(what);
    st.values = r.vector<float>(what);
    FAISS_THROW_IF_NOT_FMT(
            st.keys.size() % st.d == 0 &&
                    st.values.size() == st.keys.size() / st.d * st.d_value,
            "read_index: %s: %zd key floats and %zd value floats do not make "
            "whole tokens of d=%zd, d_value=%zd",
            what,
            st.keys.size(),
            st.values.size(),
            st.d,
            st.d_value);
    // refuse what add_kv would refuse
    check_finite(st.keys.data(), st.size(), st.d, "read_index: keys");
    check_finite(st.values.data(), st.size(), st.d_value, "read_index: values");
}

std::unique_ptr<KVIndex> read_record(BufferReader& r, int depth) {
    FAISS_THROW_IF_NOT_MSG(depth < kMaxNesting, "read_index: indexes nested too deeply");
    uint32_t type = r.value<uint32_t>("index type");
    if (type == kFlat) {
        auto idx = std::make_unique<IndexKVFlat>();
        read_kvindex_fields(idx.get(), r);
        read_storage(idx->storage, idx.get(), r, "Flat storage");
        FAISS_THROW_IF_NOT_MSG(
                idx->storage.size() == idx->ntotal, "read_index: Flat storage != ntotal");
        return idx;
    }
    if (type == kTopK) {
        auto idx = std::make_unique<IndexTopK>();
        read_kvindex_fields(idx.get(), r);
        idx->retriever_string = r.string("retriever string");
        idx->max_train_points = r.value<int64_t>("max_train_points");
        idx->min_train_points = r.value<int64_t>("min_train_points");
        idx->train_seed = r.value<uint64_t>("train_seed");
        read_storage(idx->storage, idx.get(), r, "TopK storage");
        std::vector<uint8_t> blob = r.vector<uint8_t>("TopK retriever");
        faiss::VectorIOReader fr;
        fr.data = std::move(blob);
        FAISS_THROW_IF_NOT_MSG(
                idx->storage.size() == idx->ntotal && idx->max_train_points > 0 &&
                        idx->min_train_points > 0,
                "read_index: TopK storage or training fields inconsistent");
        try {
            idx->retriever.reset(faiss::read_index(&fr));
        } catch (const std::exception& e) {
            // Faiss's reader also throws std::bad_alloc / length_error
            FAISS_THROW_FMT("read_index: TopK retriever unreadable: %s", e.what());
        }
        const faiss::Index* ret = idx->retriever.get();
        check_faiss_retriever(
                ret, idx->retriever_string, idx->d, ret->is_trained ? idx->ntotal : 0);
        if (!ret->is_trained) {
            idx->rebuild_retriever(); // see IndexTopK::rebuild_retriever
        }
        return idx;
    }
    if (type == kSinkWindow) {
        auto idx = std::make_unique<IndexSinkWindow>();
        read_kvindex_fields(idx.get(), r);
        idx->n_sink = r.value<int64_t>("n_sink");
        idx->n_window = r.value<int64_t>("n_window");
        read_storage(idx->sink, idx.get(), r, "sink tokens");
        read_storage(idx->window, idx.get(), r, "window tokens");
        idx->inner = read_record(r, depth + 1);
        const KVIndex* in = idx->inner.get();
        bool full_sink = idx->sink.size() == idx->n_sink;
        FAISS_THROW_IF_NOT_MSG(
                idx->n_sink >= 0 && idx->n_window >= 0 &&
                        idx->sink.size() <= idx->n_sink &&
                        idx->window.size() <= idx->n_window &&
                        (full_sink || (in->ntotal == 0 && idx->window.size() == 0)) &&
                        (in->ntotal == 0 || idx->window.size() == idx->n_window) &&
                        idx->sink.size() + in->ntotal + idx->window.size() == idx->ntotal &&
                        in->d == idx->d && in->d_value == idx->d_value,
                "read_index: sink/window split inconsistent with ntotal");
        return idx;
    }
    if (type == kLSHSample) {
        auto idx = std::make_unique<IndexLSHSample>();
        read_kvindex_fields(idx.get(), r);
        idx->K = r.value<int32_t>("K");
        idx->L = r.value<int32_t>("L");
        idx->min_hits = r.value<int32_t>("min_hits");
        idx->max_sample = r.value<int64_t>("max_sample");
        idx->seed = r.value<uint64_t>("seed");
        FAISS_THROW_IF_NOT_FMT(
                idx->K >= 1 && idx->K <= 16 && idx->L >= 1 && idx->L <= 4096 &&
                        idx->min_hits >= 0 && idx->min_hits <= idx->L && idx->max_sample >= 0,
                "read_index: invalid LSHSample parameters K=%d L=%d min_hits=%d",
                idx->K, idx->L, idx->min_hits);
        idx->planes = r.vector<float>("hyperplanes");
        idx->mean = r.vector<float>("centring mean");
        idx->norms = r.vector<float>("key norms");
        idx->codes = r.vector<uint16_t>("codes");
        read_storage(idx->storage, idx.get(), r, "LSHSample storage");
        idx_t n_indexed = r.value<int64_t>("n_indexed");
        idx_t n = idx->ntotal;
        bool codes_ok = true;
        for (uint16_t c : idx->codes) {
            codes_ok = codes_ok && c < (1u << idx->K);
        }
        FAISS_THROW_IF_NOT_MSG(
                idx->planes.size() == size_t(idx->K) * idx->L * idx->d &&
                        idx->mean.size() == (n > 0 ? size_t(idx->d) : 0) &&
                        idx->norms.size() == size_t(n) && idx->codes.size() == size_t(n) * idx->L &&
                        idx->storage.size() == n && n_indexed >= 0 && n_indexed <= n &&
                        (n == 0 || n_indexed > 0) && codes_ok,
                "read_index: LSHSample tables inconsistent with its tokens");
        check_finite(idx->planes.data(), 1, idx->planes.size(), "read_index: hyperplanes");
        check_finite(idx->mean.data(), 1, idx->mean.size(), "read_index: centring mean");
        check_finite(idx->norms.data(), 1, idx->norms.size(), "read_index: key norms");
        if (n > 0) {
            idx->build_tables(n_indexed);
        }
        return idx;
    }
    if (type == kProxyEvict) {
        auto idx = std::make_unique<IndexProxyEvict>();
        read_kvindex_fields(idx.get(), r);
        uint8_t policy = r.value<uint8_t>("eviction policy");
        FAISS_THROW_IF_NOT_FMT(policy <= 4, "read_index: invalid eviction policy %d", int(policy));
        idx->policy = EvictPolicy(policy);
        idx->keep_percent = r.value<double>("keep percent");
        idx->budget_tokens = r.value<int64_t>("budget");
        idx->protect_percent = r.value<double>("protect percent");
        idx->proxy_keep_percent = r.value<double>("proxy-keep percent");
        idx->proxy_window_percent = r.value<double>("proxy window percent");
        idx->n_sink = r.value<int64_t>("n_sink");
        idx->seed = r.value<uint64_t>("seed");
        idx->stream = r.value<uint64_t>("stream");
        idx->positions = r.vector<idx_t>("kept positions");
        idx->inner = read_record(r, depth + 1);
        const KVIndex* in = idx->inner.get();
        bool sorted = true;
        for (size_t i = 0; i < idx->positions.size(); i++) {
            sorted = sorted && idx->positions[i] >= 0 && idx->positions[i] < idx->ntotal &&
                    (i == 0 || idx->positions[i] > idx->positions[i - 1]);
        }
        FAISS_THROW_IF_NOT_MSG(
                idx->keep_percent > 0 && idx->keep_percent <= 100 && idx->budget_tokens >= 0 &&
                        idx->n_sink >= 0 && sorted &&
                        idx_t(idx->positions.size()) == in->ntotal && in->d == idx->d &&
                        in->d_value == idx->d_value,
                "read_index: eviction record inconsistent (budget, kept positions)");
        return idx;
    }
    FAISS_THROW_FMT("read_index: unknown index type fourcc 0x%08x", type);
}

} // namespace

void write_index(const KVIndex* index, std::vector<uint8_t>* buffer) {
    FAISS_THROW_IF_NOT_MSG(index && buffer, "write_index: nullptr argument");
    std::vector<uint8_t> payload;
    BufferWriter pw(&payload);
    write_record(index, pw);
    buffer->clear();
    BufferWriter w(buffer);
    w.value(kMagic);
    w.value(kIndexFormatVersion);
    w.value<uint64_t>(payload.size());
    w.value<uint32_t>(crc32(payload.data(), payload.size()));
    w.bytes(payload.data(), payload.size());
}

void write_index(const KVIndex* index, const std::string& fname) {
    std::vector<uint8_t> buf;
    write_index(index, &buf);
    std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(fname.c_str(), "wb"), std::fclose);
    FAISS_THROW_IF_NOT_FMT(f, "write_index: cannot open '%s' for writing", fname.c_str());
    FAISS_THROW_IF_NOT_FMT(
            std::fwrite(buf.data(), 1, buf.size(), f.get()) == buf.size(),
            "write_index: short write to '%s'",
            fname.c_str());
}

std::unique_ptr<KVIndex> read_index(const uint8_t* data, size_t size) {
    FAISS_THROW_IF_NOT_MSG(data || size == 0, "read_index: nullptr buffer");
    BufferReader r(data, size);
    FAISS_THROW_IF_NOT_FMT(
            size >= kHeaderSize,
            "read_index: %zd bytes, too short for the %zd-byte header",
            size,
            kHeaderSize);
    FAISS_THROW_IF_NOT_MSG(
            r.value<uint32_t>("magic") == kMagic,
            "read_index: not a kvindex file (bad magic)");
    uint32_t version = r.value<uint32_t>("version");
    FAISS_THROW_IF_NOT_FMT(
            version == kIndexFormatVersion,
            "read_index: format version %u, this build reads %u",
            version,
            kIndexFormatVersion);
    uint64_t payload_size = r.value<uint64_t>("payload size");
    uint32_t crc = r.value<uint32_t>("checksum");
    FAISS_THROW_IF_NOT_FMT(
            payload_size == r.remaining(),
            "read_index: header announces %zd payload bytes, %zd present (truncated?)",
            size_t(payload_size),
            r.remaining());
    FAISS_THROW_IF_NOT_MSG(
            crc32(data + r.pos, r.remaining()) == crc,
            "read_index: checksum mismatch (corrupt file)");
    BufferReader pr(data + r.pos, r.remaining());
    std::unique_ptr<KVIndex> index = read_record(pr, 0);
    FAISS_THROW_IF_NOT_FMT(
            pr.remaining() == 0,
            "read_index: %zd trailing bytes after the index",
            pr.remaining());
    return index;
}

std::unique_ptr<KVIndex> read_index(const std::string& fname) {
    std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(fname.c_str(), "rb"), std::fclose);
    FAISS_THROW_IF_NOT_FMT(f, "read_index: cannot open '%s'", fname.c_str());
    std::vector<uint8_t> buf;
    uint8_t chunk[1 << 16];
    size_t got;
    while ((got = std::fread(chunk, 1, sizeof(chunk), f.get())) > 0) {
        buf.insert(buf.end(), chunk, chunk + got);
    }
    FAISS_THROW_IF_NOT_FMT(!std::ferror(f.get()), "read_index: error reading '%s'", fname.c_str());
    return read_index(buf);
}

} // namespace kvindex
