// IndexLSHSample's fast paths: the tabulated inclusion probability against
// the exact formula, and the bucket walk (two table levels plus the last
// tokens scanned) against a brute-force count.

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include <faiss/impl/FaissException.h>
#include <gtest/gtest.h>

#include <kvindex/IndexLSHSample.h>

#include "reference.h"
#include "simd_levels.h"

namespace test_lsh_speed_paths {

using namespace kvindex;

TEST(LSHSpeedPaths, InclusionTableMatchesExactWithinStatedBound) {
    // angles: a uniform grid, plus points crowding both ends (where acos is
    // singular and u tiny)
    std::vector<double> thetas;
    for (int i = 0; i <= 1500; i++) {
        thetas.push_back(M_PI * i / 1500.0);
    }
    for (double e = 1e-9; e < 0.1; e *= 1.7) {
        thetas.push_back(e);
        thetas.push_back(M_PI - e);
    }
    const double floor = LSHInclusionTable::kMinInclusion;
    for (int K : {1, 2, 3, 5, 8, 10, 12, 16}) {
        for (int L : {1, 2, 10, 75, 150, 300}) {
            for (int m = 1; m <= 3 && m <= L; m++) {
                auto tab = LSHInclusionTable::get(K, L, m);
                ASSERT_LE(tab->max_log_error(), LSHInclusionTable::kBuildTarget)
                        << "K=" << K << " L=" << L << " m=" << m << " cells " << tab->cells();
                double worst = 0;
                for (double theta : thetas) {
                    double c = std::cos(theta);
                    // the exact value at the angle the table is given
                    double th = std::acos(std::max(-1.0, std::min(1.0, c)));
                    double u = std::max(lsh_inclusion_probability(th, K, L, m), floor);
                    double got = tab->inclusion(c);
                    ASSERT_GE(got, floor * (1 - 1e-12));
                    ASSERT_LE(got, 1.0);
                    // |log got - log u| bounds the relative error of u and of 1/u
                    double err = std::fabs(std::log(got) - std::log(u));
                    worst = std::max(worst, err);
                    ASSERT_LE(err, LSHInclusionTable::kMaxLogError)
                            << "K=" << K << " L=" << L << " m=" << m << " theta=" << th
                            << " u=" << u << " table=" << got;
                }
                EXPECT_LE(worst, LSHInclusionTable::kMaxLogError);
            }
        }
    }
    // exact ends: theta = 0 always collides, theta = pi never (floored)
    auto tab = LSHInclusionTable::get(10, 150, 2);
    EXPECT_EQ(tab->inclusion(1.0), 1.0);
    EXPECT_NEAR(tab->inclusion(-1.0), LSHInclusionTable::kMinInclusion, 1e-40);
    EXPECT_EQ(tab->inclusion(2.0), 1.0); // clamped
    EXPECT_THROW(LSHInclusionTable(17, 10, 2), faiss::FaissException);
    EXPECT_THROW(LSHInclusionTable(4, 10, 11), faiss::FaissException);
}

class LSHTableBatch : public kvtest::SimdLevelTest {};

// The batched lookup the attend uses (8 double lanes at the avx512 level)
// against the exact formula within the table's bound plus a float's
// rounding of log u, and within one float step of the scalar lookup.
TEST_P(LSHTableBatch, MatchesExactAndScalarLookup) {
    std::vector<double> c;
    for (int i = 0; i <= 4000; i++) {
        c.push_back(std::cos(M_PI * i / 4000.0));
    }
    for (double e = 1e-300; e < 0.1; e *= 7.3) { // both ends, r and s tiny
        c.push_back(1 - e);
        c.push_back(-1 + e);
    }
    for (double x : {-1.0, -0.0, 0.0, 1.0, -1.5, 1.5, -1e-300, 1e-300}) {
        c.push_back(x);
    }
    const double floor = LSHInclusionTable::kMinInclusion;
    for (auto [K, L, m] : {std::tuple{10, 150, 2}, {8, 75, 1}, {16, 300, 3}, {3, 10, 2}}) {
        auto tab = LSHInclusionTable::get(K, L, m);
        // every length up to 17 (the lanes' remainders), then the grid
        for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(8), size_t(9), size_t(17), c.size()}) {
            std::vector<float> got(n + 1, 123.0f);
            tab->log_inclusion(c.data(), n, got.data());
            EXPECT_EQ(got[n], 123.0f) << "wrote past n=" << n;
            for (size_t t = 0; t < n; t++) {
                double cc = std::max(-1.0, std::min(1.0, c[t]));
                double u = std::max(lsh_inclusion_probability(std::acos(cc), K, L, m), floor);
                double exact = std::log(u);
                ASSERT_LE(std::fabs(got[t] - exact),
                          LSHInclusionTable::kMaxLogError + std::fabs(exact) * 0x1p-23 + 1e-30)
                        << "K=" << K << " L=" << L << " m=" << m << " c=" << c[t];
                float scalar = float(tab->log_inclusion(c[t]));
                ASSERT_LE(std::fabs(got[t] - scalar), std::fabs(scalar) * 0x1p-23 + 1e-30)
                        << "K=" << K << " L=" << L << " m=" << m << " c=" << c[t];
                ASSERT_LE(got[t], 0.0f);
                ASSERT_GE(got[t], float(std::log(floor)) * (1 + 0x1p-23));
            }
        }
    }
}

KVTEST_AT_EVERY_SIMD_LEVEL(LSHTableBatch);

TEST(LSHSpeedPaths, BlockedHashingGivesTheCodesOfOneKeyAtATime) {
    // add_kv hashes blocks of keys against tiles of hyperplanes; each
    // key's codes must be, bit for bit, those of hashing it alone: shapes
    // whose planes span many tiles and end in a partial one, and a last
    // block of keys not full
    struct Shape {
        int d, K, L;
    };
    for (Shape sh : {Shape{128, 10, 150}, Shape{40, 7, 33}, Shape{3, 16, 700}}) {
        SCOPED_TRACE(::testing::Message() << "d=" << sh.d << " K=" << sh.K << " L=" << sh.L);
        const idx_t n = 21;
        auto keys = kvtest::gaussian(n, sh.d, 75, 1.0f, 0.2f);
        IndexLSHSample h(sh.d, sh.d, sh.K, sh.L);
        h.add_kv(n, keys.data(), keys.data());
        std::vector<uint16_t> one(size_t(n) * sh.L);
        for (idx_t t = 0; t < n; t++) {
            h.hash_projected(keys.data() + t * sh.d, h.mean_projection.data(), one.data() + t * sh.L);
        }
        EXPECT_EQ(h.all_codes(), one);
    }
}

TEST(LSHSpeedPaths, SelectionIsSortedAndEqualsBruteForceAcrossTailLevels) {
    const int d = 16;
    idx_t n = 6000;
    auto keys = kvtest::gaussian(n, d, 71, 1.0f, 0.6f), values = kvtest::gaussian(n, d, 72);
    auto queries = kvtest::gaussian(6, d, 73, 2.0f, -0.3f);
    for (int hits : {1, 2, 3}) {
        IndexLSHSample h(d, d, 5, 24);
        h.min_hits = hits;
        h.add_kv(2000, keys.data(), values.data());
        bool saw_recent = false, saw_raw = false;
        for (idx_t i = 2000; i < n; i += 37) { // decode-like appends
            idx_t b = std::min<idx_t>(37, n - i);
            h.add_kv(b, keys.data() + i * d, values.data() + i * d);
            h.check_invariants();
            saw_recent = saw_recent || h.n_recent > h.n_indexed;
            saw_raw = saw_raw || h.n_recent < h.ntotal;
            if ((i / 37) % 20 != 0) {
                continue;
            }
            // every key hashed again as add_kv hashed it: the brute force
            // does not read the tables, nor the codes read back from them
            std::vector<uint16_t> codes(size_t(h.ntotal) * h.L);
            for (idx_t t = 0; t < h.ntotal; t++) {
                h.hash_projected(keys.data() + t * d, h.mean_projection.data(), codes.data() + t * h.L);
            }
            ASSERT_EQ(h.all_codes(), codes) << "ntotal " << h.ntotal;
            for (int qi = 0; qi < 6; qi++) {
                const float* q = queries.data() + qi * d;
                std::vector<uint16_t> qc(h.L);
                h.hash(q, nullptr, qc.data());
                std::vector<idx_t> brute;
                for (idx_t t = 0; t < h.ntotal; t++) {
                    int c = 0;
                    for (int l = 0; l < h.L; l++) {
                        c += codes[t * h.L + l] == qc[l];
                    }
                    if (c >= hits) {
                        brute.push_back(t);
                    }
                }
                Selection sel;
                h.select(1, q, &sel);
                ASSERT_EQ(sel.ids, brute) << "hits " << hits << " ntotal " << h.ntotal;
                ASSERT_EQ(sel.inclusion.size(), sel.ids.size());
                // u from the table equals the exact formula on the centred key
                double qq = 0, qm = 0;
                for (int j = 0; j < d; j++) {
                    qq += double(q[j]) * q[j];
                    qm += double(q[j]) * h.mean[j];
                }
                for (size_t t = 0; t < sel.size(); t++) {
                    const float* k = keys.data() + sel.ids[t] * d;
                    double dot = 0, kk = 0;
                    for (int j = 0; j < d; j++) {
                        dot += double(q[j]) * (k[j] - h.mean[j]);
                        kk += double(k[j] - h.mean[j]) * (k[j] - h.mean[j]);
                    }
                    double c = dot / std::sqrt(qq * kk);
                    double u = std::max(
                            lsh_inclusion_probability(std::acos(std::max(-1.0, std::min(1.0, c))), h.K, h.L, hits),
                            LSHInclusionTable::kMinInclusion);
                    // float scores and norms dominate the table's 1e-7
                    EXPECT_NEAR(sel.inclusion[t] / u, 1.0, 2e-3) << "id " << sel.ids[t];
                }
            }
        }
        EXPECT_TRUE(saw_recent);
        EXPECT_TRUE(saw_raw);
    }
}

TEST(LSHSpeedPaths, AttendMatchesReferenceOnTheSampleWithTailsAndManyHits) {
    // min_hits above 254 takes the 16-bit counters
    const int d = 8;
    idx_t n = 700;
    auto keys = kvtest::gaussian(n, d, 81, 1.0f, 0.2f), values = kvtest::gaussian(n, d, 82);
    auto q = kvtest::gaussian(3, d, 83, 1.5f);
    for (int hits : {2, 200, 255}) {
        IndexLSHSample h(d, d, 1, 400);
        h.min_hits = hits;
        h.add_kv(600, keys.data(), values.data());
        h.add_kv(n - 600, keys.data() + 600 * d, values.data() + 600 * d);
        std::vector<Selection> sel(3);
        h.select(3, q.data(), sel.data());
        std::vector<float> out(3 * d), lse(3);
        h.attend(3, q.data(), out.data(), lse.data());
        for (int i = 0; i < 3; i++) {
            if (sel[i].size() == 0) {
                EXPECT_EQ(lse[i], -INFINITY);
                continue;
            }
            std::vector<double> u(sel[i].inclusion.begin(), sel[i].inclusion.end()), ref;
            double rl = kvtest::ref_attention(q.data() + i * d, keys.data(), values.data(), d, d,
                                              sel[i].ids, &u, ref);
            EXPECT_NEAR(lse[i], rl, 1e-4) << "hits " << hits;
            EXPECT_LT(kvtest::rel_max_err(out.data() + i * d, ref), 1e-4) << "hits " << hits;
        }
    }
}

}  // namespace test_lsh_speed_paths
