// IndexKVFlat and IndexTopK against the double reference.

#include <algorithm>
#include <cmath>
#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <faiss/IVFlib.h>
#include <faiss/IndexIVFPQ.h>
#include <faiss/IndexPQ.h>
#include <faiss/IndexIVF.h>
#include <faiss/impl/FaissAssert.h>

#include <kvindex/IndexIVFAsym.h>
#include <kvindex/IndexKVFlat.h>
#include <kvindex/IndexTopK.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/QModel.h>
#include <kvindex/parameters.h>

#include "expect_throw.h"
#include "reference.h"

namespace test_indexes {

using namespace kvindex;
using kvtest::gaussian;

namespace {

constexpr int kD = 32;
constexpr int kDv = 24;

struct Data {
    idx_t n, nq;
    std::vector<float> keys, values, queries;
    Data(idx_t n, idx_t nq, uint64_t seed)
            : n(n), nq(nq),
              // keys share an offset, queries do not: out of distribution as in LLMs
              keys(gaussian(n, kD, seed, 1.0f, 0.5f)),
              values(gaussian(n, kDv, seed + 1)),
              queries(gaussian(nq, kD, seed + 2, 1.5f)) {}
};

/// attend of `index` vs ref_attention over ids_of(query i), per query.
template <class IdsOf>
void expect_attention(const KVIndex& index, const Data& data, IdsOf ids_of, double tol,
                      const faiss::SearchParameters* params = nullptr) {
    std::vector<float> out(data.nq * kDv), lse(data.nq);
    index.attend(data.nq, data.queries.data(), out.data(), lse.data(), params);
    for (idx_t i = 0; i < data.nq; i++) {
        std::vector<double> ref;
        double ref_lse = kvtest::ref_attention(
                data.queries.data() + i * kD, data.keys.data(), data.values.data(),
                kD, kDv, ids_of(i), nullptr, ref);
        EXPECT_NEAR(lse[i], ref_lse, tol * std::max(1.0, std::abs(ref_lse))) << "query " << i;
        EXPECT_LT(kvtest::rel_max_err(out.data() + i * kDv, ref), tol) << "query " << i;
    }
}

std::vector<idx_t> all_ids(idx_t n) {
    std::vector<idx_t> ids(n);
    for (idx_t i = 0; i < n; i++) {
        ids[i] = i;
    }
    return ids;
}

} // namespace

TEST(IndexKVFlat, SearchIsExactTopK) {
    Data data(1000, 20, 1);
    IndexKVFlat index(kD, kDv);
    index.add_kv(data.n, data.keys.data(), data.values.data());
    idx_t k = 15;
    std::vector<float> dis(data.nq * k);
    std::vector<idx_t> ids(data.nq * k);
    index.search(data.nq, data.queries.data(), k, dis.data(), ids.data());
    for (idx_t i = 0; i < data.nq; i++) {
        auto ref = kvtest::ref_topk(data.queries.data() + i * kD, data.keys.data(), kD, data.n, k);
        // compare as sets: float ties may order near-equal scores differently
        std::set<idx_t> got(ids.begin() + i * k, ids.begin() + (i + 1) * k);
        EXPECT_EQ(got, std::set<idx_t>(ref.begin(), ref.end()));
        for (idx_t j = 1; j < k; j++) {
            EXPECT_GE(dis[i * k + j - 1], dis[i * k + j]);
        }
    }
}

TEST(IndexKVFlat, AttendIsExact) {
    Data data(3000, 10, 2);
    IndexKVFlat index(kD, kDv);
    index.add_kv(data.n, data.keys.data(), data.values.data());
    expect_attention(index, data, [&](idx_t) { return all_ids(data.n); }, 1e-5);
    // reconstruct returns what was added
    std::vector<float> k(kD), v(kDv);
    index.reconstruct(1234, k.data());
    index.reconstruct_value(1234, v.data());
    EXPECT_TRUE(std::equal(k.begin(), k.end(), data.keys.begin() + 1234 * kD));
    EXPECT_TRUE(std::equal(v.begin(), v.end(), data.values.begin() + 1234 * kDv));
}

TEST(IndexTopK, FlatWithKAtLeastNIsExact) {
    Data data(500, 10, 3);
    auto index = index_factory(kD, "TopK(Flat)", kDv);
    index->add_kv(data.n, data.keys.data(), data.values.data());
    for (idx_t k : {data.n, data.n + 1, 10 * data.n}) {
        SearchParametersKV params;
        params.k = k;
        expect_attention(*index, data, [&](idx_t) { return all_ids(data.n); }, 1e-5, &params);
    }
}

TEST(IndexTopK, FlatIsSoftmaxOverTheExactTopK) {
    Data data(2000, 15, 4);
    auto index = index_factory(kD, "TopK(Flat)", kDv);
    index->add_kv(data.n, data.keys.data(), data.values.data());
    index->k = 40;
    expect_attention(*index, data, [&](idx_t i) {
        return kvtest::ref_topk(data.queries.data() + i * kD, data.keys.data(), kD, data.n, 40);
    }, 1e-5);
}

TEST(IndexTopK, IVFWithAllListsProbedEqualsFlat) {
    Data data(4000, 20, 5);
    auto flat = index_factory(kD, "TopK(Flat)", kDv);
    auto ivf = index_factory(kD, "TopK(IVF32,Flat)", kDv);
    for (auto* idx : {flat.get(), ivf.get()}) {
        idx->add_kv(data.n, data.keys.data(), data.values.data());
    }
    SearchParametersTopK params;
    params.k = 50;
    params.nprobe = 32;
    SearchParametersKV flat_params; // nprobe is not a knob of a Flat retriever
    flat_params.k = 50;
    idx_t k = 50;
    std::vector<float> d1(data.nq * k), d2(data.nq * k);
    std::vector<idx_t> i1(data.nq * k), i2(data.nq * k);
    flat->search(data.nq, data.queries.data(), k, d1.data(), i1.data(), &flat_params);
    ivf->search(data.nq, data.queries.data(), k, d2.data(), i2.data(), &params);
    for (idx_t i = 0; i < data.nq * k; i++) {
        EXPECT_NEAR(d1[i], d2[i], 1e-4);
    }
    std::vector<float> o1(data.nq * kDv), o2(data.nq * kDv), l1(data.nq), l2(data.nq);
    flat->attend(data.nq, data.queries.data(), o1.data(), l1.data(), &flat_params);
    ivf->attend(data.nq, data.queries.data(), o2.data(), l2.data(), &params);
    for (idx_t i = 0; i < data.nq * kDv; i++) {
        EXPECT_NEAR(o1[i], o2[i], 1e-5);
    }
    // with few lists probed the answer differs (the test can fail)
    params.nprobe = 1;
    ivf->attend(data.nq, data.queries.data(), o2.data(), l2.data(), &params);
    double diff = 0;
    for (idx_t i = 0; i < data.nq * kDv; i++) {
        diff = std::max(diff, double(std::abs(o1[i] - o2[i])));
    }
    EXPECT_GT(diff, 1e-3);
}

TEST(IndexTopK, IVFTrainsOnARandomSampleNotAPrefix) {
    // first half of the document near +c, second half near -c: a prefix
    // sample would put both centroids near +c
    idx_t n = 2000;
    std::vector<float> keys = gaussian(n, kD, 6, 0.1f);
    for (idx_t i = 0; i < n; i++) {
        keys[i * kD] += i < n / 2 ? 10.0f : -10.0f;
    }
    std::vector<float> values = gaussian(n, kDv, 7);
    auto index = index_factory(kD, "TopK(IVF2,Flat)", kDv);
    auto* topk = dynamic_cast<IndexTopK*>(index.get());
    topk->max_train_points = 200; // the sample covers 10% of the keys
    index->add_kv(n, keys.data(), values.data());
    auto* ivf = faiss::ivflib::extract_index_ivf(topk->retriever.get());
    std::vector<float> c(2 * kD);
    ivf->quantizer->reconstruct_n(0, 2, c.data());
    // inner-product IVF normalises its centroids: one near +e0, one near -e0
    EXPECT_GT(std::max(c[0], c[kD]), 0.5f);
    EXPECT_LT(std::min(c[0], c[kD]), -0.5f);
}

TEST(IndexTopK, UntrainedRetrieverScansExactlyThenTrains) {
    Data data(300, 5, 8);
    auto index = index_factory(kD, "TopK(IVF64,Flat)", kDv);
    auto* topk = dynamic_cast<IndexTopK*>(index.get());
    index->k = 10;
    // decode-style: one token at a time
    for (idx_t i = 0; i < data.n; i++) {
        index->add_kv(1, data.keys.data() + i * kD, data.values.data() + i * kDv);
        if (i + 1 == 50) {
            EXPECT_FALSE(topk->retriever->is_trained);
            Data head = data;
            head.n = 50;
            expect_attention(*index, head, [&](idx_t q) {
                return kvtest::ref_topk(data.queries.data() + q * kD, data.keys.data(), kD, 50, 10);
            }, 1e-5);
        }
    }
    EXPECT_TRUE(topk->retriever->is_trained);
    EXPECT_EQ(topk->retriever->ntotal, data.n);
    SearchParametersTopK params;
    params.nprobe = 64;
    expect_attention(*index, data, [&](idx_t q) {
        return kvtest::ref_topk(data.queries.data() + q * kD, data.keys.data(), kD, data.n, 10);
    }, 1e-5, &params);
}

TEST(IndexTopK, ProductQuantizersWaitForTheirCentroidsKeys) {
    // PQ trains 2^nbits centroids per sub-quantizer. Training began at 1 key
    // (PQ8: Faiss's k-means threw, every decode append failed), then at
    // 2^nbits keys (Faiss warned for each sub-quantizer and spent a minute
    // on TopK(PQ128) at 1,024 keys). It now waits for Faiss's floor, 39 keys
    // per centroid, and scans exactly until then.
    for (const char* s : {"TopK(PQ8)", "TopK(IVF4,PQ4)"}) {
        auto index = index_factory(kD, s, kDv);
        EXPECT_EQ(dynamic_cast<IndexTopK*>(index.get())->min_train_points, 39 * 256) << s;
    }
    // one that cannot train in reasonable time is refused, naming the way out
    EXPECT_THROW_MSG(index_factory(128, "TopK(PQ128)"), "at most 105 sub-quantizers");
    EXPECT_THROW_MSG(index_factory(kD, "TopK(PQ2x12)"), "or SQ8");
    EXPECT_NO_THROW(index_factory(128, "TopK(PQ64)"));
    Data data(700, 5, 12);
    for (const char* s : {"TopK(PQ4x4)", "TopK(IVF4,PQ4x4)"}) {
        SCOPED_TRACE(s);
        auto index = index_factory(kD, s, kDv);
        auto* topk = dynamic_cast<IndexTopK*>(index.get());
        const idx_t need = 39 * 16;
        EXPECT_EQ(topk->min_train_points, need);
        index->k = 10;
        index->add_kv(100, data.keys.data(), data.values.data());
        EXPECT_FALSE(topk->retriever->is_trained);
        for (idx_t i = 100; i < data.n; i++) {
            index->add_kv(1, data.keys.data() + i * kD, data.values.data() + i * kDv);
            EXPECT_EQ(topk->retriever->is_trained, i + 1 >= need) << "at " << i + 1 << " keys";
        }
        EXPECT_EQ(index->ntotal, data.n);
        EXPECT_EQ(topk->retriever->ntotal, data.n);
    }
}

// Faiss's factory turns on polysemous training for PQ codes: a simulated
// annealing of the codebook's order (99 s for one head of 4000 keys at
// d = 32, IVF16,PQ8) that only the Hamming pre-filter uses, which top-k
// never does. Off in every retriever IndexTopK builds, rebuilt ones too.
TEST(IndexTopK, ProductQuantizersSkipPolysemousTraining) {
    auto polysemous = [](const faiss::Index* r) {
        if (auto pq = dynamic_cast<const faiss::IndexPQ*>(r)) {
            return pq->do_polysemous_training;
        }
        auto ivfpq = dynamic_cast<const faiss::IndexIVFPQ*>(r);
        EXPECT_NE(ivfpq, nullptr);
        return ivfpq && ivfpq->do_polysemous_training;
    };
    Data data(700, 1, 14); // PQ of 4 bits trains at 39 * 16 keys
    for (const char* s : {"TopK(PQ8x4)", "TopK(IVF4,PQ8x4)"}) {
        SCOPED_TRACE(s);
        auto index = index_factory(kD, s, kDv);
        auto* topk = dynamic_cast<IndexTopK*>(index.get());
        EXPECT_FALSE(polysemous(topk->retriever.get()));
        index->add_kv(data.n, data.keys.data(), data.values.data());
        EXPECT_TRUE(topk->retriever->is_trained);
        index->reset(); // a new sequence trains a fresh retriever
        EXPECT_FALSE(polysemous(topk->retriever.get()));
    }
}

// A flat retriever is never searched (the fused kernel scans the storage):
// it holds no copy of the keys, so TopK(Flat) costs what Flat costs, and
// a read copy drops the copy its record carries.
TEST(IndexTopK, AFlatRetrieverHoldsNoCopyOfTheKeys) {
    Data data(3000, 4, 15);
    for (std::string type : {"", "BF16,"}) {
        SCOPED_TRACE(type);
        auto topk = index_factory(kD, type + "TopK(Flat)", kDv);
        auto flat = index_factory(kD, type + "Flat", kDv);
        topk->add_kv(data.n, data.keys.data(), data.values.data());
        flat->add_kv(data.n, data.keys.data(), data.values.data());
        EXPECT_LT(topk->memory_bytes(), flat->memory_bytes() + 4096);
        auto copy = clone_index(topk.get());
        EXPECT_EQ(dynamic_cast<IndexTopK&>(*copy).retriever->ntotal, 0);
        EXPECT_LT(copy->memory_bytes(), flat->memory_bytes() + 4096);
        if (type.empty()) { // the copy answers from its storage alone
            copy->k = 25;
            expect_attention(*copy, data, [&](idx_t q) {
                return kvtest::ref_topk(data.queries.data() + q * kD, data.keys.data(), kD, data.n, 25);
            }, 1e-5);
        }
    }
}

TEST(IndexTopK, PerCallKnobsAreCheckedBeforeTheRetrieverTrains) {
    Data data(60, 2, 13);
    auto ivf = index_factory(kD, "TopK(IVF16,Flat)", kDv);
    auto hnsw = index_factory(kD, "TopK(HNSW8)", kDv);
    ivf->add_kv(5, data.keys.data(), data.values.data()); // untrained: 5 < 16 keys
    hnsw->add_kv(5, data.keys.data(), data.values.data());
    ASSERT_FALSE(dynamic_cast<IndexTopK*>(ivf.get())->retriever->is_trained);
    std::vector<float> dis(4);
    std::vector<idx_t> ids(4);
    SearchParametersTopK p;
    p.nprobe = 1000;
    EXPECT_THROW_MSG(ivf->search(1, data.queries.data(), 4, dis.data(), ids.data(), &p), "nprobe=1000");
    p.nprobe = 0;
    p.efSearch = 50;
    EXPECT_THROW_MSG(ivf->search(1, data.queries.data(), 4, dis.data(), ids.data(), &p), "efSearch=50 does not apply");
    p.efSearch = 0;
    p.nprobe = 2;
    EXPECT_THROW_MSG(hnsw->search(1, data.queries.data(), 4, dis.data(), ids.data(), &p), "nprobe=2 does not apply");
    // the other retrievers refuse the knob they do not have, as TopK does
    auto graph = index_factory(kD, "RoarGraph8", kDv);
    auto buckets = index_factory(kD, "IVFAsym4_Centroid", kDv);
    graph->add_kv(60, data.keys.data(), data.values.data());
    buckets->add_kv(60, data.keys.data(), data.values.data());
    EXPECT_THROW_MSG(graph->search(1, data.queries.data(), 4, dis.data(), ids.data(), &p), "nprobe=2 does not apply");
    p.nprobe = 0;
    p.efSearch = 50;
    EXPECT_THROW_MSG(buckets->search(1, data.queries.data(), 4, dis.data(), ids.data(), &p), "efSearch=50 does not apply");
    graph->search(1, data.queries.data(), 4, dis.data(), ids.data(), &p);
    p.efSearch = 0;
    p.nprobe = 2;
    buckets->search(1, data.queries.data(), 4, dis.data(), ids.data(), &p);
}

TEST(IndexTopK, APerCallBeamDoesNotReachConcurrentSearches) {
    // the beam of a per-call efSearch is set on the shared HNSW for that
    // call: plain searches running beside it read it (and raced on it)
    Data data(3000, 8, 14);
    auto index = index_factory(kD, "TopK(HNSW8)|efSearch=64", kDv);
    index->add_kv(data.n, data.keys.data(), data.values.data());
    const idx_t k = 20, nq = 8;
    std::vector<float> dis(nq * k);
    std::vector<idx_t> want(nq * k);
    index->search(nq, data.queries.data(), k, dis.data(), want.data());
    SearchParametersTopK narrow;
    narrow.efSearch = 1; // a much worse beam, were it to leak
    std::atomic<bool> stop{false};
    std::thread narrowing([&] {
        std::vector<float> d2(nq * k);
        std::vector<idx_t> i2(nq * k);
        while (!stop) {
            index->search(nq, data.queries.data(), k, d2.data(), i2.data(), &narrow);
        }
    });
    int differing = 0;
    std::vector<idx_t> got(nq * k);
    for (int it = 0; it < 300; it++) {
        index->search(nq, data.queries.data(), k, dis.data(), got.data());
        differing += got != want;
    }
    stop = true;
    narrowing.join();
    EXPECT_EQ(differing, 0);
}

TEST(IndexTopK, AppendsKeepSearchExactWithAllListsProbed) {
    Data data(3000, 10, 9);
    auto index = index_factory(kD, "TopK(IVF16,Flat)", kDv);
    idx_t n0 = 2000;
    index->add_kv(n0, data.keys.data(), data.values.data());
    for (idx_t i = n0; i < data.n; i++) {
        index->add_kv(1, data.keys.data() + i * kD, data.values.data() + i * kDv);
    }
    set_index_parameters(index.get(), "k=25,nprobe=16");
    expect_attention(*index, data, [&](idx_t q) {
        return kvtest::ref_topk(data.queries.data() + q * kD, data.keys.data(), kD, data.n, 25);
    }, 1e-5);
}

TEST(IndexTopK, HNSWRecallGrowsWithEfSearch) {
    Data data(5000, 50, 10);
    auto index = index_factory(kD, "TopK(HNSW16)", kDv);
    index->add_kv(data.n, data.keys.data(), data.values.data());
    idx_t k = 20;
    auto recall = [&](int ef) {
        SearchParametersTopK params;
        params.efSearch = ef;
        std::vector<float> dis(data.nq * k);
        std::vector<idx_t> ids(data.nq * k);
        index->search(data.nq, data.queries.data(), k, dis.data(), ids.data(), &params);
        double hits = 0;
        for (idx_t i = 0; i < data.nq; i++) {
            auto ref = kvtest::ref_topk(data.queries.data() + i * kD, data.keys.data(), kD, data.n, k);
            std::set<idx_t> truth(ref.begin(), ref.end());
            for (idx_t j = 0; j < k; j++) {
                hits += truth.count(ids[i * k + j]);
            }
        }
        return hits / (data.nq * k);
    };
    double low = recall(20), high = recall(400);
    // the per-call knob must act like the persistent one
    set_index_parameter(index.get(), "efSearch", 400);
    EXPECT_EQ(recall(0), high);
    EXPECT_GT(high, low);
    EXPECT_GT(high, 0.9); // a large beam on 5000 keys finds nearly all
}

// Selection::n_scanned is in stored keys: under BF16 a stored key is 2d
// bytes, so the float32 centroids and lists an IVF retriever reads count
// twice their number, an 8-bit code a quarter of a float32 key, and the
// float32 hyperplanes of LSHSample and centroids of IVFAsym twice theirs.
TEST(ReadCounts, FloatStructuresAndCodesCountTheirBytesInStoredKeys) {
    Data data(4000, 6, 91);
    SearchParametersTopK p;
    p.count_scanned = true;
    p.nprobe = 3;
    for (std::string s :
         {"TopK(IVF16,Flat)", "BF16,TopK(IVF16,Flat)", "FP16,TopK(IVF16,SQ8)", "TopK(IVF16,PQ8x4)"}) {
        SCOPED_TRACE(s);
        auto index = index_factory(kD, s, kDv);
        index->add_kv(data.n, data.keys.data(), data.values.data());
        auto topk = dynamic_cast<const IndexTopK*>(index.get());
        ASSERT_NE(topk, nullptr);
        auto ivf = faiss::ivflib::extract_index_ivf(topk->retriever.get());
        ASSERT_TRUE(ivf->is_trained);
        std::vector<Selection> sel(data.nq);
        index->select(data.nq, data.queries.data(), sel.data(), &p);
        bool pq = s.find("PQ8") != std::string::npos;
        size_t code = s.find("SQ8") != std::string::npos ? kD : pq ? 4 : kD * sizeof(float);
        // a PQ8x4's query table is built from its codebook: 16 centroids of
        // d / 8 floats in each of the 8 sub-spaces
        size_t table = pq ? 16 * kD * sizeof(float) : 0;
        size_t key = kD * (s.find("16,") == 2 ? 2 : 4);
        for (idx_t i = 0; i < data.nq; i++) {
            std::vector<float> cd(3);
            std::vector<idx_t> lists(3);
            ivf->quantizer->search(1, data.queries.data() + i * kD, 3, cd.data(), lists.data());
            size_t codes = 0;
            for (idx_t l : lists) {
                codes += ivf->invlists->list_size(l);
            }
            size_t bytes = 16 * kD * sizeof(float) + table + codes * code;
            EXPECT_EQ(sel[i].n_scanned, (bytes + key - 1) / key) << "query " << i;
        }
    }
    // a flat PQ8x4: every code, and the codebook its query table is built from
    {
        auto index = index_factory(kD, "TopK(PQ8x4)", kDv);
        index->add_kv(data.n, data.keys.data(), data.values.data());
        SearchParametersKV counted;
        counted.count_scanned = true;
        Selection sel;
        index->select(1, data.queries.data(), &sel, &counted);
        size_t bytes = size_t(data.n) * 4 + 16 * kD * sizeof(float);
        size_t key = kD * sizeof(float);
        EXPECT_EQ(sel.n_scanned, (bytes + key - 1) / key);
    }
    // the hyperplanes alone: K * L float rows, as stored keys
    for (std::string type : {"", "BF16,"}) {
        auto lsh = index_factory(kD, type + "LSHSample6x20", kDv);
        lsh->add_kv(data.n, data.keys.data(), data.values.data());
        Selection sel;
        lsh->select(1, data.queries.data(), &sel);
        EXPECT_GE(sel.n_scanned, size_t(6 * 20) * (type.empty() ? 1 : 2)) << type;
        EXPECT_LT(sel.n_scanned, size_t(data.n) / 4) << type;
    }
    // IVFAsym's 4 float centroids, under each storage type
    for (std::string type : {"", "BF16,", "FP16,"}) {
        auto index = index_factory(kD, type + "IVFAsym4_Centroid", kDv);
        auto ivf_asym = dynamic_cast<IndexIVFAsym*>(index.get());
        ASSERT_NE(ivf_asym, nullptr);
        ivf_asym->set_trained(gaussian(4, kD, 92), QModel(), RopeParams());
        EXPECT_EQ(ivf_asym->probe_cost(), size_t(4) * (type.empty() ? 1 : 2)) << type;
    }
}

}  // namespace test_indexes
