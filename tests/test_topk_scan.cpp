// The fused top-k scan (kernels.h topk_inner_products) and the retriever
// scans built on it (src/retriever_scan.h) against a double-precision
// reference: every SIMD level, ties broken by the smaller id.

#include <algorithm>
#include <limits>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include <omp.h>

#include <gtest/gtest.h>

#include <faiss/IndexFlatCodes.h>
#include <faiss/IndexHNSW.h>
#include <faiss/IndexIVF.h>
#include <faiss/impl/DistanceComputer.h>
#include <faiss/impl/FaissAssert.h>
#include <faiss/impl/HNSW.h>

#include <kvindex/IndexKVFlat.h>
#include <kvindex/IndexTopK.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/kernels.h>

#include "reference.h"
#include "simd_levels.h"

namespace test_topk_scan {

using namespace kvindex;

namespace {

/// Small integers: every dot product is exact in float and in double, and
/// many of them tie, which exercises the tie rule.
std::vector<float> small_integers(size_t n, size_t d, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int> pick(-2, 2);
    std::vector<float> x(n * d);
    for (float& v : x) {
        v = float(pick(rng));
    }
    return x;
}

double dot_ref(const float* a, const float* b, size_t d) {
    double s = 0;
    for (size_t j = 0; j < d; j++) {
        s += double(a[j]) * b[j];
    }
    return s;
}

const size_t kDims[] = {1, 3, 17, 64, 128, 130};
const size_t kCounts[] = {0, 1, 5, 255, 256, 257, 1000, 3000};

} // namespace

class TopKScanTest : public kvtest::SimdLevelTest {};

TEST_P(TopKScanTest, ExactTopKEqualsReferenceWithTies) {
    for (size_t d : kDims) {
        for (size_t n : kCounts) {
            auto x = small_integers(n, d, 3 + n * 7 + d);
            auto q = small_integers(1, d, 11 + d);
            for (idx_t k : {idx_t(1), idx_t(7), idx_t(100), idx_t(n), idx_t(n + 5)}) {
                if (k == 0) {
                    continue;
                }
                std::vector<float> dist(k);
                std::vector<idx_t> labels(k);
                exact_topk_inner_product(q.data(), x.data(), d, n, k, dist.data(), labels.data());
                auto ref = kvtest::ref_topk(q.data(), x.data(), d, n, k);
                for (idx_t j = 0; j < k; j++) {
                    if (j < idx_t(ref.size())) {
                        ASSERT_EQ(labels[j], ref[j]) << "d=" << d << " n=" << n << " k=" << k
                                                     << " rank " << j;
                        ASSERT_EQ(double(dist[j]), dot_ref(q.data(), x.data() + ref[j] * d, d));
                    } else { // padding, as Faiss pads inner-product results
                        ASSERT_EQ(labels[j], -1);
                        ASSERT_EQ(dist[j], std::numeric_limits<float>::lowest());
                    }
                }
            }
        }
    }
}

TEST_P(TopKScanTest, GaussianScoresMatchReferenceRanks) {
    // real-valued scores: float rounding may swap two scores closer than
    // its error, so the j-th score (not the id) is compared
    for (size_t d : {64, 128}) {
        for (size_t n : {300, 4097}) {
            auto x = kvtest::gaussian(n, d, 5 + n + d);
            auto q = kvtest::gaussian(1, d, 17 + d);
            idx_t k = 50;
            std::vector<float> dist(k);
            std::vector<idx_t> labels(k);
            exact_topk_inner_product(q.data(), x.data(), d, n, k, dist.data(), labels.data());
            auto ref = kvtest::ref_topk(q.data(), x.data(), d, n, k);
            for (idx_t j = 0; j < k; j++) {
                double want = dot_ref(q.data(), x.data() + ref[j] * d, d);
                EXPECT_NEAR(dist[j], want, 1e-5 * (1 + std::abs(want))) << "rank " << j;
                EXPECT_NEAR(
                        dot_ref(q.data(), x.data() + labels[j] * d, d), want,
                        1e-5 * (1 + std::abs(want)));
            }
        }
    }
}

TEST_P(TopKScanTest, IdenticalKeysTieWhereverTheySit) {
    // Gaussian entries: float sums depend on their order, so a key scored
    // in a group of four and the same key among the rows left over would
    // differ in the last bits (and the later copy could win the tie)
    for (size_t d : {17, 64, 128, 130}) {
        for (size_t n : {1, 3, 7, 9, 300}) {
            for (uint64_t seed : {2, 3, 4, 5}) {
                auto key = kvtest::gaussian(1, d, seed);
                auto q = kvtest::gaussian(1, d, seed + 100);
                std::vector<float> x(n * d);
                for (size_t i = 0; i < n; i++) {
                    std::copy(key.begin(), key.end(), x.begin() + i * d);
                }
                idx_t k = idx_t(n);
                std::vector<float> dist(k);
                std::vector<idx_t> labels(k);
                exact_topk_inner_product(q.data(), x.data(), d, n, k, dist.data(), labels.data());
                for (idx_t j = 0; j < k; j++) {
                    ASSERT_EQ(labels[j], j) << "d=" << d << " n=" << n << " seed=" << seed;
                    ASSERT_EQ(dist[j], dist[0]) << "d=" << d << " n=" << n << " rank " << j;
                }
                // and the same score as the key alone
                float alone;
                inner_products_scaled(q.data(), key.data(), d, 1, 1.0f, &alone);
                ASSERT_EQ(dist[0], alone) << "d=" << d << " n=" << n;
            }
        }
    }
}

TEST_P(TopKScanTest, OneHeapFedByManyCallsWithIds) {
    // the IVF use: chunks of rows with arbitrary ids feed one selection
    const size_t d = 33, n = 2000;
    const size_t k = 64;
    auto x = small_integers(n, d, 21);
    auto q = small_integers(1, d, 22);
    std::vector<int64_t> perm(n);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(4));
    std::vector<float> xp(n * d); // row r of xp is row perm[r] of x
    for (size_t r = 0; r < n; r++) {
        std::copy_n(x.data() + perm[r] * d, d, xp.data() + r * d);
    }
    std::vector<float> hs(k);
    std::vector<int64_t> hi(k);
    size_t filled = 0;
    for (size_t begin = 0; begin < n;) {
        size_t len = std::min(n - begin, 1 + begin % 301);
        topk_inner_products(
                q.data(), xp.data() + begin * d, d, len, perm.data() + begin, 0, k, hs.data(),
                hi.data(), &filled);
        begin += len;
    }
    ASSERT_EQ(filled, k);
    topk_heap_sort(hs.data(), hi.data(), filled);
    auto ref = kvtest::ref_topk(q.data(), x.data(), d, n, k);
    for (size_t j = 0; j < k; j++) {
        EXPECT_EQ(hi[j], ref[j]) << "rank " << j;
    }
}

TEST_P(TopKScanTest, ScoresRisingAlongTheScanKeepTheBest) {
    // a decode query's scores rise towards recent tokens: nearly every row
    // enters the selection, the worst case of a heap (a scan of many rows
    // then keeps a buffer of 2k and cuts it to k). Rows in threes tie. One
    // call over every row, and a call of a few rows, then the rest onto the
    // same (warm) heap.
    const size_t d = 16, n = 5000;
    std::vector<float> x(n * d, 0.0f), q(d, 0.0f);
    q[0] = 1.0f;
    for (size_t i = 0; i < n; i++) {
        x[i * d] = float(i / 3);
        x[i * d + 1 + i % (d - 1)] = 1.0f; // orthogonal to q
    }
    for (size_t k : {32, 100, 1000}) {
        auto ref = kvtest::ref_topk(q.data(), x.data(), d, n, k);
        for (size_t first : {size_t(0), size_t(50)}) {
            std::vector<float> hs(k);
            std::vector<int64_t> hi(k);
            size_t filled = 0;
            topk_inner_products(q.data(), x.data(), d, first, nullptr, 0, k, hs.data(), hi.data(), &filled);
            topk_inner_products(q.data(), x.data() + first * d, d, n - first, nullptr, int64_t(first), k,
                                hs.data(), hi.data(), &filled);
            ASSERT_EQ(filled, k);
            topk_heap_sort(hs.data(), hi.data(), filled);
            for (size_t j = 0; j < k; j++) {
                ASSERT_EQ(hi[j], ref[j]) << "k=" << k << " first " << first << " rank " << j;
                ASSERT_EQ(double(hs[j]), dot_ref(q.data(), x.data() + ref[j] * d, d));
            }
        }
    }
}

TEST_P(TopKScanTest, ScoresBufferedWithIdsAndASampleThatMisses) {
    // a fresh selection over a short scan ranks a buffer of every score
    // from a strided sample's threshold: with an ids array (out of order,
    // so ties go to the smaller id, not the earlier row), and with rows
    // where the sample sees only the best (every fifth row scores high: the
    // threshold leaves fewer than k rows, and every row is ranked)
    const size_t d = 8, n = 3000;
    auto x = small_integers(n, d, 41);
    auto q = small_integers(1, d, 43);
    std::vector<int64_t> ids(n);
    for (size_t i = 0; i < n; i++) {
        ids[i] = int64_t((i * 7919) % n); // a permutation
    }
    for (int layout = 0; layout < 2; layout++) {
        if (layout == 1) { // rows 0, 5, 10, ... far above the others
            for (size_t i = 0; i < n; i += 5) {
                for (size_t j = 0; j < d; j++) {
                    x[i * d + j] = q[j] * 4;
                }
            }
        }
        std::vector<double> score(n);
        for (size_t i = 0; i < n; i++) {
            score[i] = dot_ref(q.data(), x.data() + i * d, d);
        }
        for (size_t k : {size_t(32), size_t(100), size_t(700)}) {
            std::vector<float> hs(k);
            std::vector<int64_t> hi(k);
            size_t filled = 0;
            topk_inner_products(q.data(), x.data(), d, n, ids.data(), 0, k, hs.data(), hi.data(), &filled);
            ASSERT_EQ(filled, k);
            topk_heap_sort(hs.data(), hi.data(), filled);
            // reference: rows ranked by (score desc, id asc) in double
            std::vector<size_t> order(n);
            std::iota(order.begin(), order.end(), size_t(0));
            std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
                return score[a] > score[b] || (score[a] == score[b] && ids[a] < ids[b]);
            });
            for (size_t j = 0; j < k; j++) {
                ASSERT_EQ(hi[j], ids[order[j]]) << "layout " << layout << " k=" << k << " rank " << j;
                ASSERT_EQ(double(hs[j]), score[order[j]]);
            }
        }
    }
}

KVTEST_AT_EVERY_SIMD_LEVEL(TopKScanTest);

TEST(RetrieverScan, TopKFlatEqualsReference) {
    const int d = 16;
    const idx_t n = 1500, k = 40;
    auto keys = small_integers(n, d, 31);
    auto index = index_factory(d, "TopK(Flat)");
    index->add_kv(n, keys.data(), keys.data());
    for (int t = 0; t < 5; t++) {
        auto q = small_integers(1, d, 40 + t);
        std::vector<float> dist(k);
        std::vector<idx_t> labels(k);
        index->search(1, q.data(), k, dist.data(), labels.data());
        auto ref = kvtest::ref_topk(q.data(), keys.data(), d, n, k);
        EXPECT_EQ(labels, ref);
    }
}

TEST(RetrieverScan, IvfFlatScanEqualsFaissSearch) {
    // kvindex scans the probed lists itself; Faiss's own search of the same
    // retriever is the independent reference (same lists, same keys)
    const int d = 32;
    const idx_t n = 4000, k = 30;
    auto keys = kvtest::gaussian(n, d, 51);
    auto index = index_factory(d, "TopK(IVF16,Flat)");
    index->add_kv(n, keys.data(), keys.data());
    auto topk = dynamic_cast<IndexTopK*>(index.get());
    ASSERT_NE(topk, nullptr);
    auto ivf = dynamic_cast<faiss::IndexIVF*>(topk->retriever.get());
    ASSERT_NE(ivf, nullptr);
    ASSERT_TRUE(ivf->is_trained);
    const idx_t nq = 20;
    auto q = kvtest::gaussian(nq, d, 52);
    for (size_t nprobe : {1, 3, 8, 16}) {
        SearchParametersTopK params;
        params.nprobe = nprobe;
        std::vector<float> dist(nq * k), fdist(nq * k);
        std::vector<idx_t> labels(nq * k), flabels(nq * k);
        index->search(nq, q.data(), k, dist.data(), labels.data(), &params);
        faiss::SearchParametersIVF fparams;
        fparams.nprobe = nprobe;
        ivf->search(nq, q.data(), k, fdist.data(), flabels.data(), &fparams);
        for (idx_t i = 0; i < nq * k; i++) {
            // Faiss breaks ties its own way: scores rank by rank, ids as sets
            EXPECT_NEAR(dist[i], fdist[i], 1e-5f * (1 + std::abs(fdist[i]))) << "nprobe=" << nprobe;
            EXPECT_EQ(labels[i] < 0, flabels[i] < 0);
        }
        std::vector<idx_t> a(labels), b(flabels);
        std::sort(a.begin(), a.end());
        std::sort(b.begin(), b.end());
        EXPECT_EQ(a, b) << "nprobe=" << nprobe;
    }
}

namespace {

/// Stands in for an HNSW's storage and counts every distance Faiss's own
/// search computes through it, every layer's.
struct CountingStorage : faiss::Index {
    const faiss::Index* real;
    mutable size_t computed = 0;
    struct Counted : faiss::DistanceComputer {
        std::unique_ptr<faiss::DistanceComputer> inner;
        size_t* computed;
        void set_query(const float* x) override {
            inner->set_query(x);
        }
        float operator()(idx_t i) override {
            ++*computed;
            return (*inner)(i);
        }
        float symmetric_dis(idx_t i, idx_t j) override {
            ++*computed;
            return inner->symmetric_dis(i, j);
        }
    };
    explicit CountingStorage(const faiss::Index* real) : faiss::Index(real->d, real->metric_type), real(real) {
        ntotal = real->ntotal;
    }
    void add(idx_t, const float*) override {
        FAISS_THROW_MSG("CountingStorage: read only");
    }
    void search(idx_t, const float*, idx_t, float*, idx_t*, const faiss::SearchParameters*) const override {
        FAISS_THROW_MSG("CountingStorage: distances only");
    }
    void reset() override {
        FAISS_THROW_MSG("CountingStorage: read only");
    }
    faiss::DistanceComputer* get_distance_computer() const override {
        auto c = new Counted();
        c->inner.reset(real->get_distance_computer());
        c->computed = &computed;
        return c;
    }
};

} // namespace

// The HNSW graph scores the index's own stored keys (in their type, no
// float copy) with kvindex's kernels (Debian's Faiss scores float rows with
// a scalar loop): its distances, in the graph's build and search, are the
// inner products with the keys as stored, and stay so for a read copy.
TEST(RetrieverScan, HnswDistancesAreTheInnerProductsWithTheStoredKeys) {
    const int d = 40; // not a multiple of the vector width
    const idx_t n = 500;
    auto keys = kvtest::gaussian(n, d, 63);
    auto q = kvtest::gaussian(1, d, 64);
    for (const char* s : {"TopK(HNSW8)", "BF16,TopK(HNSW8)", "FP16,TopK(HNSW8)"}) {
        SCOPED_TRACE(s);
        auto index = index_factory(d, s);
        index->add_kv(n, keys.data(), keys.data());
        auto copy = clone_index(index.get());
        for (const KVIndex* x : {index.get(), copy.get()}) {
            const auto& topk = dynamic_cast<const IndexTopK&>(*x);
            auto hnsw = dynamic_cast<faiss::IndexHNSW*>(topk.retriever.get());
            ASSERT_NE(hnsw, nullptr);
            EXPECT_EQ(dynamic_cast<faiss::IndexFlatCodes*>(hnsw->storage), nullptr)
                    << "the graph keeps a copy of the keys";
            std::vector<float> stored(n * d); // as the storage holds them
            for (idx_t i = 0; i < n; i++) {
                topk.storage.key(i, stored.data() + i * d);
            }
            std::unique_ptr<faiss::DistanceComputer> dis(hnsw->storage->get_distance_computer());
            dis->set_query(q.data());
            for (idx_t i = 0; i < n; i += 7) {
                double ref = 0, ij = 0;
                for (int c = 0; c < d; c++) {
                    ref += double(q[c]) * stored[i * d + c];
                    ij += double(stored[i * d + c]) * stored[((i + 1) % n) * d + c];
                }
                EXPECT_NEAR((*dis)(i), ref, 1e-5 * (1 + std::abs(ref))) << i;
                EXPECT_NEAR(dis->symmetric_dis(i, (i + 1) % n), ij, 1e-5 * (1 + std::abs(ij))) << i;
            }
        }
    }
}

TEST(RetrieverScan, HnswSearchEqualsFaissAndCountsEachQuery) {
    // kvindex walks the HNSW graph itself to count each query's distances;
    // Faiss's own search of the same retriever is the reference for the
    // results, and for the count, every distance that search computes
    // through its storage (the upper layers' greedy steps too, which
    // Faiss's HNSWStats leaves out), as stored keys: a float row is one, an
    // 8-bit code of d a quarter. Before, every query of a batch got the
    // batch's average, and concurrent searches of other indexes mixed into
    // the counter.
    const int d = 32;
    const idx_t n = 3000, k = 20, nq = 12;
    auto keys = kvtest::gaussian(n, d, 61);
    auto q = kvtest::gaussian(nq, d, 62);
    std::vector<std::unique_ptr<KVIndex>> indexes;
    for (const char* s : {"TopK(HNSW16)", "TopK(HNSW8,SQ8)"}) {
        indexes.push_back(index_factory(d, s));
        indexes.back()->add_kv(n, keys.data(), keys.data());
    }
    std::vector<std::vector<size_t>> expected(indexes.size());
    for (size_t x = 0; x < indexes.size(); x++) {
        auto topk = dynamic_cast<IndexTopK*>(indexes[x].get());
        auto hnsw = dynamic_cast<faiss::IndexHNSW*>(topk->retriever.get());
        ASSERT_NE(hnsw, nullptr);
        SCOPED_TRACE(topk->retriever_string);
        for (int ef : {0, 64}) {
            SearchParametersTopK params;
            params.k = k;
            params.efSearch = ef;
            params.count_scanned = true;
            std::vector<Selection> sel(nq);
            indexes[x]->select(nq, q.data(), sel.data(), &params);
            std::vector<float> dist(nq * k), fdist(k);
            std::vector<idx_t> labels(nq * k), flabels(k);
            indexes[x]->search(nq, q.data(), k, dist.data(), labels.data(), &params);
            int own_ef = hnsw->hnsw.efSearch;
            hnsw->hnsw.efSearch = ef > 0 ? ef : own_ef;
            std::vector<size_t> counts;
            size_t row_bytes = hnsw->storage->sa_code_size(), key_bytes = d * sizeof(float);
            size_t above_base = 0;
            for (idx_t i = 0; i < nq; i++) {
                int threads = omp_get_max_threads();
                omp_set_num_threads(1);
                faiss::hnsw_stats.reset();
                faiss::Index* real = hnsw->storage;
                CountingStorage counting(real);
                hnsw->storage = &counting;
                hnsw->search(1, q.data() + i * d, k, fdist.data(), flabels.data());
                hnsw->storage = real;
                size_t faiss_count = (counting.computed * row_bytes + key_bytes - 1) / key_bytes;
                above_base += counting.computed > faiss::hnsw_stats.n3 + faiss::hnsw_stats.ndis;
                omp_set_num_threads(threads);
                for (idx_t j = 0; j < k; j++) {
                    EXPECT_EQ(dist[i * k + j], fdist[j]) << "query " << i << " rank " << j;
                    EXPECT_EQ(labels[i * k + j], flabels[j]) << "query " << i << " rank " << j;
                }
                std::vector<idx_t> ids = sel[i].ids, fids = flabels;
                std::sort(ids.begin(), ids.end());
                std::sort(fids.begin(), fids.end());
                EXPECT_EQ(ids, fids) << "query " << i;
                EXPECT_EQ(sel[i].n_scanned, faiss_count) << "query " << i << " efSearch " << ef;
                counts.push_back(sel[i].n_scanned);
            }
            hnsw->hnsw.efSearch = own_ef;
            EXPECT_GT(above_base, 0u) << "the upper layers' distances count too";
            EXPECT_GT(*std::max_element(counts.begin(), counts.end()),
                      *std::min_element(counts.begin(), counts.end()))
                    << "the queries should differ, or the test shows nothing";
            if (ef == 0) {
                expected[x] = counts;
            }
        }
    }
    // two threads selecting on different indexes at once count what each
    // counts alone
    std::vector<std::thread> threads;
    std::vector<int> wrong(indexes.size(), 0);
    for (size_t x = 0; x < indexes.size(); x++) {
        threads.emplace_back([&, x]() {
            SearchParametersTopK params;
            params.k = k;
            params.count_scanned = true;
            for (int round = 0; round < 30; round++) {
                std::vector<Selection> sel(nq);
                indexes[x]->select(nq, q.data(), sel.data(), &params);
                for (idx_t i = 0; i < nq; i++) {
                    wrong[x] += sel[i].n_scanned != expected[x][i];
                }
            }
        });
    }
    for (auto& t : threads) {
        t.join();
    }
    EXPECT_EQ(wrong, std::vector<int>(indexes.size(), 0));
}

}  // namespace test_topk_scan
