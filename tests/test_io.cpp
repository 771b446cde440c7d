// Serialization (index_io.h): round trips to memory and to files must give
// bit-identical search and attend results, keep the search-time knobs, and
// keep working as tokens are appended; truncated, flipped or forged buffers
// must throw faiss::FaissException, never crash.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <omp.h>

#include <faiss/IVFlib.h>
#include <faiss/IndexHNSW.h>
#include <faiss/IndexIVF.h>
#include <faiss/impl/FaissException.h>
#include <faiss/impl/io.h>
#include <faiss/index_io.h>
#include <faiss/invlists/InvertedLists.h>

#include <kvindex/IndexHybrid.h>
#include <kvindex/IndexIVFAsym.h>
#include <kvindex/IndexKVFlat.h>
#include <kvindex/IndexProxyEvict.h>
#include <kvindex/IndexLSHSample.h>
#include <kvindex/IndexRoarGraph.h>
#include <kvindex/KVCache.h>
#include <kvindex/IndexSinkWindow.h>
#include <kvindex/IndexTopK.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/registry.h>
#include <kvindex/parameters.h>

#include "expect_throw.h"
#include "forge.h"
#include "reference.h"

namespace test_io {

using namespace kvindex;

namespace {

const int kDim = 16;
using kvtest::forge_header;
const size_t kHeaderSize = kvtest::kIndexHeaderSize;


struct IOCase {
    const char* factory;
    int d_value;        ///< -1: d
    const char* params; ///< non-default knobs that must survive the round trip
};

const IOCase kCases[] = {
        {"Flat", -1, ""}, // no knobs: k is read by none of these Flat chains
        {"TopK(Flat)", 8, "k=17"},
        {"TopK(IVF16,Flat)", -1, "k=17,nprobe=3"},
        {"TopK(HNSW32)", 8, "k=17,efSearch=48"},
        {"Sink4,Flat", -1, ""},
        {"Window64,Flat", 8, ""},
        {"Sink4,Window64,Flat", -1, ""},
        {"Sink4,Window64,TopK(IVF16,Flat)", 8, "k=17,nprobe=3"},
        {"Sink0,Flat", -1, ""},
};

const idx_t kPrefill = 700; // > 39 * 16: IVF16 trains without Faiss's warning
const idx_t kDecode = 30;   // tokens appended one at a time after prefill
const idx_t kQueries = 20;
const idx_t kSearchK = 10;

/// RoPE parameters that differ from the defaults, so that losing them shows.
RopeParams test_rope() {
    RopeParams r;
    r.theta = 500000.0;
    r.style = RopeStyle::interleaved;
    return r;
}

/// Prefill then decode, with seeded keys and values.
std::unique_ptr<KVIndex> build(const IOCase& c, idx_t n_prefill, idx_t n_decode, uint64_t seed) {
    auto index = index_factory(kDim, c.factory, c.d_value);
    int dv = index->d_value;
    std::vector<float> keys = kvtest::gaussian(n_prefill + n_decode, kDim, seed);
    std::vector<float> values = kvtest::gaussian(n_prefill + n_decode, dv, seed + 1);
    PrefillInput in;
    in.n_tokens = n_prefill;
    in.keys = keys.data();
    in.values = values.data();
    in.rope = test_rope();
    index->prefill(in);
    for (idx_t i = n_prefill; i < n_prefill + n_decode; i++) {
        index->add_kv(1, keys.data() + i * kDim, values.data() + i * dv);
    }
    set_index_parameters(index.get(), c.params);
    return index;
}

/// The TopK index of a chain, or nullptr.
const IndexTopK* find_topk(const KVIndex* index) {
    if (auto w = dynamic_cast<const IndexSinkWindow*>(index)) {
        return find_topk(w->inner.get());
    }
    return dynamic_cast<const IndexTopK*>(index);
}

struct Results {
    std::vector<float> distances;
    std::vector<idx_t> labels;
    std::vector<float> out;
    std::vector<float> lse;
};

Results run_queries(const KVIndex* index, const std::vector<float>& q, idx_t nq) {
    Results r;
    r.distances.resize(nq * kSearchK);
    r.labels.resize(nq * kSearchK);
    index->search(nq, q.data(), kSearchK, r.distances.data(), r.labels.data());
    r.out.resize(nq * index->d_value);
    r.lse.resize(nq);
    index->attend(nq, q.data(), r.out.data(), r.lse.data());
    return r;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// Bit-identical results: the copy must be the same index, not a close one.
void expect_identical(const Results& a, const Results& b, const std::string& what) {
    EXPECT_TRUE(same_bits(a.labels, b.labels)) << what << ": search labels differ";
    EXPECT_TRUE(same_bits(a.distances, b.distances)) << what << ": search distances differ";
    EXPECT_TRUE(same_bits(a.out, b.out)) << what << ": attend outputs differ";
    EXPECT_TRUE(same_bits(a.lse, b.lse)) << what << ": attend lse differ";
}

/// Fields and knobs that must survive the round trip.
void expect_same_fields(const KVIndex* a, const KVIndex* b, const std::string& what) {
    EXPECT_EQ(index_factory_string(a), index_factory_string(b)) << what;
    EXPECT_EQ(a->ntotal, b->ntotal) << what;
    EXPECT_EQ(a->d, b->d) << what;
    EXPECT_EQ(a->d_value, b->d_value) << what;
    EXPECT_EQ(a->k, b->k) << what;
    EXPECT_EQ(a->estimator, b->estimator) << what;
    EXPECT_EQ(a->has_rope, b->has_rope) << what;
    EXPECT_TRUE(a->rope == b->rope) << what;
    auto wa = dynamic_cast<const IndexSinkWindow*>(a);
    auto wb = dynamic_cast<const IndexSinkWindow*>(b);
    ASSERT_EQ(!wa, !wb) << what;
    if (wa) {
        EXPECT_EQ(wa->sink.size(), wb->sink.size()) << what;
        EXPECT_EQ(wa->window.size(), wb->window.size()) << what;
        EXPECT_EQ(wa->window_start(), wb->window_start()) << what;
        expect_same_fields(wa->inner.get(), wb->inner.get(), what + " (inner)");
    }
    const IndexTopK* ta = find_topk(a);
    const IndexTopK* tb = find_topk(b);
    ASSERT_EQ(!ta, !tb) << what;
    if (ta && ta == a) {
        EXPECT_EQ(ta->retriever->is_trained, tb->retriever->is_trained) << what;
        EXPECT_EQ(ta->retriever->ntotal, tb->retriever->ntotal) << what;
        EXPECT_EQ(ta->train_seed, tb->train_seed) << what;
        EXPECT_EQ(ta->min_train_points, tb->min_train_points) << what;
        EXPECT_EQ(ta->max_train_points, tb->max_train_points) << what;
        if (auto ia = faiss::ivflib::try_extract_index_ivf(ta->retriever.get())) {
            auto ib = faiss::ivflib::try_extract_index_ivf(tb->retriever.get());
            ASSERT_TRUE(ib) << what;
            EXPECT_EQ(ia->nprobe, ib->nprobe) << what;
        }
        if (auto ha = dynamic_cast<const faiss::IndexHNSW*>(ta->retriever.get())) {
            auto hb = dynamic_cast<const faiss::IndexHNSW*>(tb->retriever.get());
            ASSERT_TRUE(hb) << what;
            EXPECT_EQ(ha->hnsw.efSearch, hb->hnsw.efSearch) << what;
        }
    }
}

/// The knobs of kCases, checked on the read-back index directly (not only
/// against the original, in case both lost them).
void expect_knobs(const KVIndex* index, const IOCase& c) {
    EXPECT_EQ(index->k, index->reads_search_knob("k") ? 17 : 100) << c.factory;
    EXPECT_TRUE(index->has_rope) << c.factory;
    EXPECT_TRUE(index->rope == test_rope()) << c.factory;
    if (const IndexTopK* t = find_topk(index)) {
        EXPECT_EQ(t->k, 17) << c.factory;
        if (auto ivf = faiss::ivflib::try_extract_index_ivf(t->retriever.get())) {
            EXPECT_EQ(ivf->nprobe, 3u) << c.factory;
        }
        if (auto hnsw = dynamic_cast<const faiss::IndexHNSW*>(t->retriever.get())) {
            EXPECT_EQ(hnsw->hnsw.efSearch, 48) << c.factory;
        }
    }
}

std::vector<uint8_t> read_file_bytes(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

/// Appends the same seeded tokens to two indexes.
void append_same(KVIndex* a, KVIndex* b, idx_t n, uint64_t seed) {
    std::vector<float> keys = kvtest::gaussian(n, kDim, seed);
    std::vector<float> values = kvtest::gaussian(n, a->d_value, seed + 1);
    for (idx_t i = 0; i < n; i++) {
        a->add_kv(1, keys.data() + i * kDim, values.data() + i * a->d_value);
        b->add_kv(1, keys.data() + i * kDim, values.data() + i * b->d_value);
    }
}

/// A read that succeeded must give an index that works: search ids in range,
/// attend runs. Search first, so that bad ids fail here instead of making
/// attend read out of bounds.
void expect_usable(const KVIndex* index, const std::vector<float>& q, const std::string& what) {
    ASSERT_GE(index->ntotal, 0) << what;
    if (index->ntotal == 0) {
        return;
    }
    const idx_t nq = 2;
    std::vector<float> distances(nq * kSearchK);
    std::vector<idx_t> labels(nq * kSearchK);
    index->search(nq, q.data(), kSearchK, distances.data(), labels.data());
    for (idx_t id : labels) {
        ASSERT_TRUE(id >= -1 && id < index->ntotal) << what << ": label " << id;
    }
    std::vector<float> out(nq * index->d_value), lse(nq);
    index->attend(nq, q.data(), out.data(), lse.data());
    std::vector<uint8_t> again;
    write_index(index, &again); // and it can be written back
}

/// copy has index's fields and knobs and answers q as ref (index's answers).
void expect_equal_copy(
        const KVIndex* index,
        const KVIndex* copy,
        const IOCase& c,
        const Results& ref,
        const std::vector<float>& q,
        const char* what) {
    expect_same_fields(index, copy, what);
    expect_knobs(copy, c);
    expect_identical(ref, run_queries(copy, q, kQueries), what);
}

} // namespace

// The frame's CRC-32 (sliced by 8 bytes) is the standard IEEE CRC: the check
// value of "123456789", and a bitwise reference at every length and offset
// around the 8-byte steps.
TEST(IO, Crc32IsTheIeeeCrc) {
    const std::string check = "123456789";
    EXPECT_EQ(crc32(reinterpret_cast<const uint8_t*>(check.data()), check.size()), 0xCBF43926u);
    EXPECT_EQ(crc32(nullptr, 0), 0u);
    auto bitwise = [](const uint8_t* p, size_t n) {
        uint32_t c = 0xFFFFFFFFu;
        for (size_t i = 0; i < n; i++) {
            c ^= p[i];
            for (int k = 0; k < 8; k++) {
                c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            }
        }
        return c ^ 0xFFFFFFFFu;
    };
    std::mt19937 rng(7);
    std::vector<uint8_t> buf(300);
    for (auto& b : buf) {
        b = uint8_t(rng());
    }
    for (size_t off = 0; off < 8; off++) {
        for (size_t n = 0; n + off <= buf.size(); n += (n < 40 ? 1 : 13)) {
            ASSERT_EQ(crc32(buf.data() + off, n), bitwise(buf.data() + off, n)) << off << " " << n;
        }
    }
}

TEST(IO, RoundTripMemoryAndFile) {
    // queries differ from the keys (other seed, other scale)
    std::vector<float> q = kvtest::gaussian(kQueries, kDim, 777, 2.0f);
    for (size_t ci = 0; ci < std::size(kCases); ci++) {
        const IOCase& c = kCases[ci];
        SCOPED_TRACE(c.factory);
        auto index = build(c, kPrefill, kDecode, 100 + ci);
        ASSERT_EQ(index->ntotal, kPrefill + kDecode);
        if (const IndexTopK* t = find_topk(index.get())) {
            ASSERT_TRUE(t->retriever->is_trained); // the retriever itself is serialized
        }
        Results ref = run_queries(index.get(), q, kQueries);

        std::vector<uint8_t> buf;
        write_index(index.get(), &buf);
        auto from_mem = read_index(buf);
        expect_equal_copy(index.get(), from_mem.get(), c, ref, q, "memory");

        std::string path = ::testing::TempDir() + "kvindex_test_io_" + std::to_string(ci) + ".kvix";
        write_index(index.get(), path);
        EXPECT_TRUE(read_file_bytes(path) == buf) << "file and memory formats differ";
        auto from_file = read_index(path);
        std::remove(path.c_str());
        expect_equal_copy(index.get(), from_file.get(), c, ref, q, "file");

        // writing what was read gives the same bytes: nothing is lost or added
        std::vector<uint8_t> buf2;
        write_index(from_mem.get(), &buf2);
        EXPECT_TRUE(buf2 == buf) << "second round trip changed the bytes";
    }
}

TEST(IO, AppendAfterRead) {
    // The decode loop goes on after a reload: appending the same tokens to
    // the original and to the copy keeps them identical (the sink/window
    // split, the retriever and the IVF lists were all restored).
    std::vector<float> q = kvtest::gaussian(kQueries, kDim, 778, 2.0f);
    for (size_t ci = 0; ci < std::size(kCases); ci++) {
        const IOCase& c = kCases[ci];
        SCOPED_TRACE(c.factory);
        // Faiss does not serialize HNSW's level generator: IndexTopK seeds it
        // from the keys held before each add, so the copy draws the same
        // levels. Faiss links a batch of keys in parallel, in an order that
        // depends on the threads: one thread makes the graphs comparable.
        const int saved_threads = omp_get_max_threads();
        const bool hnsw = std::string(c.factory).find("HNSW") != std::string::npos;
        if (hnsw) {
            omp_set_num_threads(1);
        }
        auto index = build(c, kPrefill, kDecode, 200 + ci);
        std::vector<uint8_t> buf;
        write_index(index.get(), &buf);
        auto copy = read_index(buf);
        append_same(index.get(), copy.get(), 70, 300 + ci); // > window: tokens move to inner
        expect_same_fields(index.get(), copy.get(), "after append");
        expect_identical(
                run_queries(index.get(), q, kQueries),
                run_queries(copy.get(), q, kQueries),
                "after append");
        if (hnsw) {
            // the graphs themselves, not only the answers
            std::vector<uint8_t> a, b;
            write_index(index.get(), &a);
            write_index(copy.get(), &b);
            EXPECT_EQ(a, b) << "the original and its copy stored different graphs";
            omp_set_num_threads(saved_threads);
        }
    }
}

TEST(IO, CloneIsADeepIndependentCopy) {
    std::vector<float> q = kvtest::gaussian(kQueries, kDim, 779, 2.0f);
    for (size_t ci = 0; ci < std::size(kCases); ci++) {
        const IOCase& c = kCases[ci];
        SCOPED_TRACE(c.factory);
        auto index = build(c, kPrefill, kDecode, 400 + ci);
        Results ref = run_queries(index.get(), q, kQueries);
        auto copy = clone_index(index.get());
        expect_equal_copy(index.get(), copy.get(), c, ref, q, "clone");
        // growing the copy leaves the original as it was
        std::vector<float> keys = kvtest::gaussian(20, kDim, 500 + ci);
        std::vector<float> values = kvtest::gaussian(20, copy->d_value, 501 + ci);
        copy->add_kv(20, keys.data(), values.data());
        EXPECT_EQ(copy->ntotal, index->ntotal + 20);
        expect_identical(ref, run_queries(index.get(), q, kQueries), "original after the copy grew");
    }
    EXPECT_THROW_MSG(clone_index(nullptr), "clone_index");
}

TEST(IO, TopKTrainingSizesAreCheckedAtWrite) {
    // the fields are public; a value the reader refuses is refused when
    // written, so that no file is saved that does not read back
    auto index = index_factory(kDim, "TopK(IVF16,Flat)");
    auto* t = dynamic_cast<IndexTopK*>(index.get());
    std::vector<uint8_t> buf;
    t->max_train_points = idx_t(1) << 40;
    EXPECT_THROW_MSG(write_index(index.get(), &buf), "training sizes");
    t->max_train_points = 1000;
    t->min_train_points = 0;
    EXPECT_THROW_MSG(write_index(index.get(), &buf), "training sizes");
    t->min_train_points = 100;
    write_index(index.get(), &buf);
    EXPECT_EQ(dynamic_cast<IndexTopK*>(read_index(buf).get())->max_train_points, 1000);
}

TEST(IO, AFieldOutOfRangeIsRefusedAtWrite) {
    // public fields assigned through C++: each value is one read_index
    // refuses, so write_index and write_cache refuse it first
    auto filled = [](const char* s) {
        auto index = index_factory(kDim, s);
        std::vector<float> k = kvtest::gaussian(300, kDim, 81), v = kvtest::gaussian(300, kDim, 82);
        PrefillInput in;
        in.n_tokens = 300;
        in.keys = k.data();
        in.values = v.data();
        in.n_queries = 64;
        in.queries = k.data() + 236 * kDim;
        index->prefill(in);
        return index;
    };
    struct Case {
        const char* factory;
        std::function<void(KVIndex*)> spoil;
        const char* message;
    };
    const Case cases[] = {
            {"Flat", [](KVIndex* x) { x->k = 0; }, "invalid k"},
            {"Flat", [](KVIndex* x) { x->estimator = Estimator(7); }, "invalid estimator 7"},
            {"Flat", [](KVIndex* x) { x->rope.theta = -1; }, "invalid RoPE theta=-1"},
            {"LSHSample4x8",
             [](KVIndex* x) { dynamic_cast<IndexLSHSample*>(x)->min_hits = 99; },
             "min_hits"},
            {"RoarGraph8", [](KVIndex* x) { dynamic_cast<IndexRoarGraph*>(x)->efSearch = 0; },
             "efSearch"},
            {"Hybrid(TopK(Flat),Uniform)",
             [](KVIndex* x) { dynamic_cast<IndexHybrid*>(x)->delta = 2; }, "delta"},
            {"IVFAsym8",
             [](KVIndex* x) { dynamic_cast<IndexIVFAsym*>(x)->var_weight = 3; }, "var_weight=3"},
            {"ProxyEvict20",
             [](KVIndex* x) { dynamic_cast<IndexProxyEvict*>(x)->policy = EvictPolicy(9); },
             "invalid eviction policy 9"},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.factory);
        auto index = filled(c.factory);
        std::vector<uint8_t> buf;
        write_index(index.get(), &buf);
        read_index(buf); // as built, it reads back
        c.spoil(index.get());
        buf.clear();
        EXPECT_THROW_MSG(write_index(index.get(), &buf), c.message);
    }
    // a cache saves its indexes' records: one spoilt head refuses the file
    KVCache cache(1, 1, 1, kDim, kDim, "Flat");
    cache.index(0, 0)->k = -3;
    std::vector<uint8_t> buf;
    EXPECT_THROW_MSG(write_cache(cache, &buf), "invalid k -3");
}

TEST(IO, ATokenCountNearTheTopIsRefused) {
    // a forged count used to be accepted: the next append wrapped it
    // negative, and the index refused every call after
    auto index = index_factory(kDim, "ProxyEvict20_StreamingLLM");
    std::vector<float> k = kvtest::gaussian(40, kDim, 83), v = kvtest::gaussian(40, kDim, 84);
    index->add_kv(40, k.data(), v.data());
    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);
    // header, then the outer record: fourcc, record version, d, d_value, ntotal
    const size_t at = kvtest::kIndexHeaderSize + 4 + 4 + 4 + 4;
    int64_t stored;
    std::memcpy(&stored, buf.data() + at, 8);
    ASSERT_EQ(stored, 40);
    const int64_t forged = std::numeric_limits<int64_t>::max() - 2;
    std::memcpy(buf.data() + at, &forged, 8);
    kvtest::forge_header(buf);
    EXPECT_THROW_MSG(read_index(buf), "invalid ntotal 9223372036854775805");
    // and an append that would carry a count past 2^62 is refused
    index->ntotal = kMaxPosition - 2;
    EXPECT_THROW_MSG(index->add_kv(5, k.data(), v.data()), "more than an index counts");
}

TEST(IO, UntrainedRetriever) {
    // Fewer keys than IVF lists: the retriever is saved untrained, and the
    // copy trains on the same sample as the original when keys arrive.
    const IOCase c = {"TopK(IVF16,Flat)", -1, "k=17,nprobe=3"};
    auto index = build(c, 10, 0, 400);
    ASSERT_FALSE(find_topk(index.get())->retriever->is_trained);
    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);
    auto copy = read_index(buf);
    ASSERT_FALSE(find_topk(copy.get())->retriever->is_trained);
    std::vector<float> q = kvtest::gaussian(kQueries, kDim, 779, 2.0f);
    expect_identical(
            run_queries(index.get(), q, kQueries),
            run_queries(copy.get(), q, kQueries),
            "untrained");

    std::vector<float> keys = kvtest::gaussian(100, kDim, 401);
    std::vector<float> values = kvtest::gaussian(100, kDim, 402);
    index->add_kv(100, keys.data(), values.data());
    copy->add_kv(100, keys.data(), values.data());
    ASSERT_TRUE(find_topk(copy.get())->retriever->is_trained);
    expect_same_fields(index.get(), copy.get(), "trained after read");
    expect_knobs(copy.get(), c);
    expect_identical(
            run_queries(index.get(), q, kQueries),
            run_queries(copy.get(), q, kQueries),
            "trained");
}

TEST(IO, EmptyIndex) {
    for (const IOCase& c : kCases) {
        SCOPED_TRACE(c.factory);
        auto index = index_factory(kDim, c.factory, c.d_value);
        std::vector<uint8_t> buf;
        write_index(index.get(), &buf);
        auto copy = read_index(buf);
        EXPECT_EQ(index_factory_string(copy.get()), c.factory);
        EXPECT_EQ(copy->ntotal, 0);
        EXPECT_EQ(copy->d_value, index->d_value);
        EXPECT_FALSE(copy->has_rope);
        std::vector<float> q = kvtest::gaussian(1, kDim, 5), out(copy->d_value);
        EXPECT_THROW_MSG(copy->attend(1, q.data(), out.data(), nullptr), "empty");
    }
}

namespace {

/// A small serialized index for the corruption tests: every byte of it is
/// tried, so it must stay a few KB.
std::vector<uint8_t> small_buffer(const char* factory, idx_t n, size_t* faiss_blob_size) {
    auto index = index_factory(kDim, factory);
    std::vector<float> keys = kvtest::gaussian(n, kDim, 900);
    std::vector<float> values = kvtest::gaussian(n, kDim, 901);
    PrefillInput in;
    in.n_tokens = n;
    in.keys = keys.data();
    in.values = values.data();
    index->prefill(in);
    *faiss_blob_size = 0;
    if (const IndexTopK* t = find_topk(index.get())) {
        EXPECT_TRUE(t->retriever->is_trained);
        faiss::VectorIOWriter w;
        faiss::write_index(t->retriever.get(), &w);
        *faiss_blob_size = w.data.size();
    }
    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);
    return buf;
}

struct SmallCase {
    const char* factory;
    idx_t n;
};
// IVF4 gets 34 keys after the static 6: enough lists to train.
const SmallCase kSmall[] = {
        {"Sink2,Window4,TopK(IVF4,Flat)", 40},
        {"Flat", 10},
        {"Sink2,Window4,Flat", 12},
};

} // namespace

TEST(IO, TruncatedThrows) {
    for (const SmallCase& c : kSmall) {
        SCOPED_TRACE(c.factory);
        size_t blob;
        std::vector<uint8_t> buf = small_buffer(c.factory, c.n, &blob);
        ASSERT_NO_THROW(read_index(buf));
        for (size_t len = 0; len < buf.size(); len++) {
            // copy the prefix so that a read past its end is a real overrun
            std::vector<uint8_t> prefix(buf.begin(), buf.begin() + len);
            EXPECT_THROW(read_index(prefix.data(), len), faiss::FaissException) << "prefix " << len;
        }
    }
}

TEST(IO, RandomByteFlipsThrow) {
    // The checksum covers the payload and the header fields are checked, so
    // a flipped byte must never give an index; if one ever did, it must at
    // least be usable.
    std::mt19937_64 rng(2024);
    std::vector<float> q = kvtest::gaussian(2, kDim, 31, 2.0f);
    size_t blob;
    std::vector<uint8_t> buf = small_buffer(kSmall[0].factory, kSmall[0].n, &blob);
    int n_read = 0;
    for (int trial = 0; trial < 3000; trial++) {
        size_t pos = std::uniform_int_distribution<size_t>(0, buf.size() - 1)(rng);
        uint8_t x = uint8_t(std::uniform_int_distribution<int>(1, 255)(rng));
        buf[pos] ^= x;
        std::unique_ptr<KVIndex> index;
        try {
            index = read_index(buf);
        } catch (const faiss::FaissException&) {
        }
        if (index) {
            n_read++;
            expect_usable(index.get(), q, "flip at " + std::to_string(pos));
        }
        buf[pos] ^= x;
    }
    EXPECT_EQ(n_read, 0) << "CRC-32 detects every single-byte error";
}

TEST(IO, ForgedByteFlips) {
    // Flips with the checksum recomputed: the parser itself must reject what
    // is inconsistent and whatever it accepts must be usable. Only the bytes
    // kvindex parses are flipped; the trailing Faiss blob is Faiss's format.
    std::mt19937_64 rng(2025);
    std::vector<float> q = kvtest::gaussian(2, kDim, 32, 2.0f);
    for (const SmallCase& c : kSmall) {
        SCOPED_TRACE(c.factory);
        size_t blob;
        std::vector<uint8_t> buf = small_buffer(c.factory, c.n, &blob);
        size_t end = buf.size() - blob; // kvindex bytes: [kHeaderSize, end)
        int n_thrown = 0;
        for (int trial = 0; trial < 1000; trial++) {
            std::vector<uint8_t> forged = buf;
            size_t pos = std::uniform_int_distribution<size_t>(kHeaderSize, end - 1)(rng);
            forged[pos] ^= uint8_t(std::uniform_int_distribution<int>(1, 255)(rng));
            forge_header(forged);
            std::unique_ptr<KVIndex> index;
            try {
                index = read_index(forged);
            } catch (const faiss::FaissException&) {
                n_thrown++;
                continue;
            }
            expect_usable(index.get(), q, "forged flip at " + std::to_string(pos));
            if (testing::Test::HasFailure()) {
                break; // one report is enough
            }
        }
        // most bytes are keys and values, whose flips read back fine
        EXPECT_GT(n_thrown, 0);
    }
}

TEST(IO, HeaderErrors) {
    size_t blob;
    const std::vector<uint8_t> buf = small_buffer("Flat", 10, &blob);

    std::vector<uint8_t> b = buf;
    b[0] ^= 0x20;
    EXPECT_THROW_MSG(read_index(b), "magic");

    for (uint32_t version : {0u, kIndexFormatVersion + 1, 0xFFFFFFFFu}) {
        b = buf;
        std::memcpy(b.data() + 4, &version, 4);
        EXPECT_THROW_MSG(read_index(b), "version " + std::to_string(version));
    }

    b = buf;
    b[kHeaderSize + 3] ^= 1; // payload byte, checksum left as it was
    EXPECT_THROW_MSG(read_index(b), "checksum");

    b = buf;
    b.push_back(0); // one byte more than the header announces
    EXPECT_THROW_MSG(read_index(b), "payload");

    b = buf;
    b.push_back(0);
    forge_header(b); // ... even when the header agrees
    EXPECT_THROW_MSG(read_index(b), "trailing");

    b = buf;
    b[kHeaderSize] = 'X'; // type fourcc
    forge_header(b);
    EXPECT_THROW_MSG(read_index(b), "fourcc");

    EXPECT_THROW_MSG(read_index(nullptr, 10), "nullptr");
    EXPECT_THROW_MSG(read_index(buf.data(), 5), "header");
}

TEST(IO, FileErrors) {
    const std::string missing = ::testing::TempDir() + "kvindex_no_such_dir/index.kvix";
    EXPECT_THROW_MSG(read_index(missing), missing);
    auto index = index_factory(kDim, "Flat");
    EXPECT_THROW_MSG(write_index(index.get(), missing), missing);
    // a directory opens but cannot be read
    EXPECT_THROW(read_index(::testing::TempDir()), faiss::FaissException);
}

namespace {

IndexTopK* mutable_topk(KVIndex* index) {
    return const_cast<IndexTopK*>(find_topk(index));
}

std::unique_ptr<KVIndex> topk_with(const char* factory, idx_t n) {
    auto index = index_factory(kDim, factory);
    std::vector<float> keys = kvtest::gaussian(n, kDim, 71), values = kvtest::gaussian(n, kDim, 72);
    index->add_kv(n, keys.data(), values.data());
    return index;
}

} // namespace

// A file whose checksum was recomputed after editing the Faiss retriever
// must still be refused when an id or a neighbour points outside the index:
// a search would otherwise read keys out of bounds.
TEST(IO, ForgedRetrieverStructureIsRefused) {
    {
        auto index = topk_with("TopK(IVF4,Flat)", 200);
        auto* ivf = faiss::ivflib::extract_index_ivf(mutable_topk(index.get())->retriever.get());
        auto* lists = dynamic_cast<faiss::ArrayInvertedLists*>(ivf->invlists);
        ASSERT_TRUE(lists);
        size_t l = 0;
        while (lists->ids[l].empty()) {
            l++;
        }
        lists->ids[l][0] = 200 + 5;
        std::vector<uint8_t> buf;
        write_index(index.get(), &buf);
        EXPECT_THROW_MSG(read_index(buf), "out of");
    }
    {
        // an id repeated (and so another missing): the count still agrees,
        // and the token would be selected, and weighed, twice
        auto index = topk_with("TopK(IVF4,Flat)", 200);
        auto* ivf = faiss::ivflib::extract_index_ivf(mutable_topk(index.get())->retriever.get());
        auto* lists = dynamic_cast<faiss::ArrayInvertedLists*>(ivf->invlists);
        size_t l = 0;
        while (lists->ids[l].size() < 2) {
            l++;
        }
        lists->ids[l][1] = lists->ids[l][0];
        std::vector<uint8_t> buf;
        write_index(index.get(), &buf);
        EXPECT_THROW_MSG(read_index(buf), "a second time");
    }
    {
        auto index = topk_with("TopK(HNSW8)", 200);
        auto* hnsw = dynamic_cast<faiss::IndexHNSW*>(mutable_topk(index.get())->retriever.get());
        hnsw->hnsw.neighbors[3] = 200 + 3;
        std::vector<uint8_t> buf;
        write_index(index.get(), &buf);
        EXPECT_THROW_MSG(read_index(buf), "neighbour");
    }
    {
        // a retriever string edited to another type than the stored retriever
        auto index = topk_with("TopK(IVF4,Flat)", 100);
        mutable_topk(index.get())->retriever_string = "HNSW8";
        std::vector<uint8_t> buf;
        write_index(index.get(), &buf);
        EXPECT_THROW_MSG(read_index(buf), "retriever is not");
    }
}

// reset starts a new sequence: the retriever trains on the new keys
// (centroids of the old document would serve the new one badly).
TEST(IO, ResetRetrainsTheRetriever) {
    auto index = topk_with("TopK(IVF4,Flat)", 400);
    set_index_parameters(index.get(), "nprobe=3");
    auto* topk = mutable_topk(index.get());
    std::vector<float> before(4 * kDim), after(4 * kDim);
    faiss::ivflib::extract_index_ivf(topk->retriever.get())->quantizer->reconstruct_n(0, 4, before.data());
    index->reset();
    EXPECT_FALSE(topk->retriever->is_trained);
    EXPECT_EQ(faiss::ivflib::extract_index_ivf(topk->retriever.get())->nprobe, 3u); // knob kept
    std::vector<float> keys = kvtest::gaussian(400, kDim, 91, 1.0f, 3.0f), values = kvtest::gaussian(400, kDim, 92);
    index->add_kv(400, keys.data(), values.data());
    ASSERT_TRUE(topk->retriever->is_trained);
    faiss::ivflib::extract_index_ivf(topk->retriever.get())->quantizer->reconstruct_n(0, 4, after.data());
    EXPECT_NE(before, after);
}

// Records carry their type's version (index_io.h): one newer than this build
// reads is refused naming the type, and format 1 (no per-record versions) is
// read as version 1 (tests/data/golden holds such files).
TEST(IO, RecordVersionTooNew) {
    size_t blob;
    std::vector<uint8_t> buf = small_buffer("Sink2,Window4,Flat", 12, &blob);
    const size_t version_at = kHeaderSize + 4; // after the outer record's fourcc
    uint32_t v;
    std::memcpy(&v, buf.data() + version_at, 4);
    const uint32_t current = index_type("IndexSinkWindow").record_version;
    EXPECT_EQ(v, current);
    for (uint32_t bad : {0u, current + 1, 99u}) {
        std::vector<uint8_t> b = buf;
        std::memcpy(b.data() + version_at, &bad, 4);
        forge_header(b);
        EXPECT_THROW_MSG(read_index(b), "IndexSinkWindow record version " + std::to_string(bad));
    }
}

}  // namespace test_io
