// IndexLSHSample: SimHash collision laws, table retrieval, the unbiased
// estimator (papers/magicpig.txt).

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/IndexLSHSample.h>
#include <kvindex/index_factory.h>
#include <kvindex/impl/gap_codes.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>

#include "expect_throw.h"
#include "reference.h"

namespace test_lsh_sample {

using namespace kvindex;
using kvtest::gaussian;

namespace {

constexpr int kD = 16;

/// Two unit vectors at angle theta.
void pair_at_angle(double theta, uint64_t seed, std::vector<float>& a, std::vector<float>& b) {
    auto x = gaussian(1, kD, seed), y = gaussian(1, kD, seed + 1);
    double nx = 0, dot = 0, ny = 0;
    for (int j = 0; j < kD; j++) {
        nx += double(x[j]) * x[j];
    }
    for (int j = 0; j < kD; j++) {
        dot += x[j] * y[j] / nx;
    }
    for (int j = 0; j < kD; j++) {
        y[j] -= float(dot * x[j]); // y orthogonal to x
        ny += double(y[j]) * y[j];
    }
    a.resize(kD);
    b.resize(kD);
    for (int j = 0; j < kD; j++) {
        a[j] = float(x[j] / std::sqrt(nx));
        b[j] = float(std::cos(theta) * a[j] + std::sin(theta) * y[j] / std::sqrt(ny));
    }
}

std::unique_ptr<IndexLSHSample> lsh(int K, int L, int min_hits = 2) {
    auto h = std::make_unique<IndexLSHSample>(kD, kD, K, L);
    h->min_hits = min_hits;
    return h;
}

/// Codes of x in double precision, straight from the hyperplanes.
std::vector<int> ref_codes(const IndexLSHSample& h, const float* x, const std::vector<double>& center) {
    std::vector<int> c(h.L, 0);
    for (int l = 0; l < h.L; l++) {
        for (int b = 0; b < h.K; b++) {
            double p = 0;
            for (int j = 0; j < kD; j++) {
                p += double(h.planes[(l * h.K + b) * kD + j]) * (x[j] - center[j]);
            }
            c[l] |= int(p > 0) << b;
        }
    }
    return c;
}

} // namespace

TEST(LSHSample, SingleBitCollisionRateIsOneMinusThetaOverPi) {
    // 20000 one-bit tables = 20000 independent hyperplanes
    int L = 4000;
    for (double theta : {0.3, 1.0, 2.0, 2.8}) {
        std::vector<float> a, b;
        pair_at_angle(theta, 7, a, b);
        double hits = 0, trials = 0;
        for (uint64_t s = 0; s < 5; s++) {
            auto h = lsh(1, L);
            h->set_seed(100 + s);
            std::vector<uint16_t> ca(L), cb(L);
            h->hash(a.data(), nullptr, ca.data());
            h->hash(b.data(), nullptr, cb.data());
            for (int l = 0; l < L; l++) {
                hits += ca[l] == cb[l];
            }
            trials += L;
        }
        double p = 1 - theta / M_PI, rate = hits / trials;
        // 4.5 binomial standard deviations: fails by chance < 1e-5
        EXPECT_NEAR(rate, p, 4.5 * std::sqrt(p * (1 - p) / trials)) << "theta=" << theta;
    }
}

TEST(LSHSample, InclusionProbabilityMatchesCollisionsOverSeeds) {
    EXPECT_EQ(lsh_inclusion_probability(1.0, 4, 10, 0), 1.0);
    EXPECT_EQ(lsh_inclusion_probability(1.0, 4, 10, 11), 0.0);
    for (double theta : {0.2, 0.7, 1.3}) {
        // the closed form of the paper for min_hits = 2
        double P = std::pow(1 - theta / M_PI, 10);
        double closed = 1 - std::pow(1 - P, 150) - 150 * P * std::pow(1 - P, 149);
        EXPECT_NEAR(lsh_inclusion_probability(theta, 10, 150, 2), closed, 1e-12 + 1e-9 * closed);
    }
    // tiny probabilities keep their relative precision (no 1 - (1 - eps) cancellation)
    double P = std::pow(1 - 2.5 / M_PI, 10);
    EXPECT_NEAR(lsh_inclusion_probability(2.5, 10, 150, 2) / (150 * 149 / 2.0 * P * P), 1.0, 1e-3);

    int K = 3, L = 10, trials = 3000;
    for (int m : {2, 3}) {
        for (double theta : {0.4, 0.9, 1.4}) {
            std::vector<float> a, b;
            pair_at_angle(theta, 11, a, b);
            int included = 0;
            for (int t = 0; t < trials; t++) {
                auto h = lsh(K, L);
                h->set_seed(1000 + t);
                std::vector<uint16_t> ca(L), cb(L);
                h->hash(a.data(), nullptr, ca.data());
                h->hash(b.data(), nullptr, cb.data());
                int c = 0;
                for (int l = 0; l < L; l++) {
                    c += ca[l] == cb[l];
                }
                included += c >= m;
            }
            double u = lsh_inclusion_probability(theta, K, L, m), rate = double(included) / trials;
            EXPECT_NEAR(rate, u, 4.5 * std::sqrt(u * (1 - u) / trials) + 1e-3)
                    << "theta=" << theta << " min_hits=" << m;
        }
    }
}

TEST(LSHSample, RetrievalEqualsBruteForceCountIncludingAppends) {
    idx_t n = 3000;
    auto keys = gaussian(n, kD, 21, 1.0f, 0.8f), values = gaussian(n, kD, 22);
    auto h = lsh(6, 20);
    idx_t n0 = 2000;
    h->add_kv(n0, keys.data(), values.data());
    // the centring mean is the mean of the first keys hashed, in double
    std::vector<double> mean(kD, 0.0);
    for (idx_t i = 0; i < n0; i++) {
        for (int j = 0; j < kD; j++) {
            mean[j] += keys[i * kD + j] / double(n0);
        }
    }
    auto queries = gaussian(10, kD, 23, 2.0f, -0.5f);
    auto check = [&](idx_t nt) {
        // stored codes (the tail's, and the tables' tokens' read back from
        // the tables) agree with double-precision hashing
        const std::vector<uint16_t> codes = h->all_codes();
        ASSERT_EQ(codes.size(), size_t(nt) * h->L);
        idx_t disagree = 0;
        for (idx_t i = 0; i < nt; i++) {
            auto c = ref_codes(*h, keys.data() + i * kD, mean);
            for (int l = 0; l < h->L; l++) {
                disagree += c[l] != codes[i * h->L + l];
            }
        }
        EXPECT_LE(disagree, nt * h->L / 10000); // only projections within rounding of 0
        std::vector<Selection> sel(10);
        h->select(10, queries.data(), sel.data());
        for (int qi = 0; qi < 10; qi++) {
            std::vector<double> zero(kD, 0.0);
            auto qc = ref_codes(*h, queries.data() + qi * kD, zero);
            std::set<idx_t> brute;
            for (idx_t i = 0; i < nt; i++) {
                int c = 0;
                for (int l = 0; l < h->L; l++) {
                    c += codes[i * h->L + l] == qc[l];
                }
                if (c >= h->min_hits) {
                    brute.insert(i);
                }
            }
            std::set<idx_t> got(sel[qi].ids.begin(), sel[qi].ids.end());
            EXPECT_EQ(got.size(), sel[qi].size()); // each id once
            EXPECT_EQ(got, brute) << "query " << qi << " ntotal " << nt;
            // n_scanned: the bytes read besides the sample's rows, counted
            // from the codes: the float hyperplanes; per table the bucket's
            // bounds and ids in each level (the main level's table start too,
            // and its ids as 16-bit gaps, 3 words for a gap >= 2^16), the
            // tokens of neither level code by code; the sample's norms
            size_t bytes = size_t(6 * 20 * kD) * sizeof(float) + brute.size() * sizeof(float);
            idx_t levels_end = std::max(h->n_recent, h->n_indexed);
            for (int l = 0; l < h->L; l++) {
                size_t main_words = 0, in_recent = 0;
                idx_t last = -1;
                for (idx_t i = 0; i < levels_end; i++) {
                    if (codes[i * h->L + l] != qc[l]) {
                        continue;
                    }
                    if (i < h->n_indexed) {
                        main_words += i - last >= 65536 ? 3 : 1;
                        last = i;
                    } else {
                        in_recent++;
                    }
                }
                bytes += 16 + main_words * 2;
                bytes += h->n_recent > h->n_indexed ? 8 + in_recent * 4 : 0;
            }
            bytes += size_t(nt - levels_end) * h->L * sizeof(uint16_t);
            size_t key = kD * sizeof(float);
            EXPECT_EQ(sel[qi].n_scanned, (bytes + key - 1) / key) << "query " << qi;
            EXPECT_GT(sel[qi].n_scanned, size_t(6 * 20)) << "more than the hyperplanes";
        }
    };
    check(n0);
    bool saw_tail = false;
    for (idx_t i = n0; i < n; i++) { // decode: one token at a time
        h->add_kv(1, keys.data() + i * kD, values.data() + i * kD);
        saw_tail = saw_tail || h->n_indexed < h->ntotal;
        if (i % 250 == 0) {
            check(i + 1);
        }
    }
    EXPECT_TRUE(saw_tail);
    check(n);
}

TEST(LSHSample, GapCodesRoundTripAtTheSixteenBitEdges) {
    // gaps of 1, 65535 (the longest in one word), 65536 and 65537 (the
    // shortest in three), a first id that is a long gap from -1, ids near 2^32
    const std::vector<std::vector<uint32_t>> lists = {
            {},
            {0},
            {65534},
            {65535},
            {0, 1, 2},
            {0, 65535, 131071, 196608, 196609},
            {7, 65544, 0xFFFFFFFDu}};
    for (const auto& ids : lists) {
        std::vector<uint16_t> words;
        uint32_t last = ~0u;
        int64_t prev = -1;
        size_t long_gaps = 0;
        for (uint32_t id : ids) {
            append_gap(words, last, id);
            long_gaps += int64_t(id) - prev >= 65536;
            prev = id;
        }
        EXPECT_EQ(words.size(), ids.size() + 2 * long_gaps);
        std::vector<uint32_t> back;
        GapCodedIds{words.data(), words.size()}.for_each([&](uint32_t id) { back.push_back(id); });
        EXPECT_EQ(back, ids);
    }
}

TEST(LSHSample, GapCodedTablesHoldEveryIdPastSixteenBits) {
    // K = 16 over 140k tokens: buckets of ~2 ids, so many gaps of 2^16 or
    // more (3 words each) beside short ones, and ids past 16 bits; folds
    // and tails along the way. Everything is checked against the keys'
    // codes hashed again here, not against the tables.
    const int d = 8, K = 16, L = 3;
    const idx_t n = 140000;
    auto keys = gaussian(n, d, 81, 1.0f, 0.3f), values = gaussian(n, d, 82);
    auto queries = gaussian(4, d, 83, 2.0f);
    IndexLSHSample h(d, d, K, L);
    h.min_hits = 1;
    h.add_kv(40000, keys.data(), values.data());
    size_t long_gaps_seen = 0;
    for (idx_t i = 40000; i < n; i += 5000) {
        h.add_kv(5000, keys.data() + i * d, values.data() + i * d);
        h.check_invariants();
        if (h.ntotal < 70000 && h.ntotal != n) {
            continue;
        }
        std::vector<uint16_t> codes(size_t(h.ntotal) * L);
        for (idx_t t = 0; t < h.ntotal; t++) {
            h.hash_projected(keys.data() + t * d, h.mean_projection.data(), codes.data() + t * L);
        }
        ASSERT_EQ(h.all_codes(), codes) << "ntotal " << h.ntotal;
        // the tables' words: one per id, two more per long gap
        std::vector<uint32_t> plain_offsets;
        std::vector<int32_t> plain_ids;
        h.plain_tables(plain_offsets, plain_ids);
        size_t B = size_t(1) << K, long_gaps = 0;
        for (int l = 0; l < L; l++) {
            std::vector<idx_t> last(B, -1);
            std::vector<std::vector<int32_t>> buckets(B);
            for (idx_t t = 0; t < h.n_indexed; t++) {
                uint16_t b = codes[t * L + l];
                long_gaps += t - last[b] >= 65536;
                last[b] = t;
                buckets[b].push_back(int32_t(t));
            }
            for (size_t b = 0; b < B; b++) {
                const uint32_t* off = plain_offsets.data() + l * (B + 1);
                const int32_t* ids = plain_ids.data() + l * h.n_indexed;
                ASSERT_EQ(std::vector<int32_t>(ids + off[b], ids + off[b + 1]), buckets[b])
                        << "table " << l << " bucket " << b;
            }
        }
        EXPECT_EQ(h.table_words.size(), size_t(L) * h.n_indexed + 2 * long_gaps);
        long_gaps_seen = std::max(long_gaps_seen, long_gaps);
        for (int qi = 0; qi < 4; qi++) {
            std::vector<uint16_t> qc(L);
            h.hash(queries.data() + qi * d, nullptr, qc.data());
            std::vector<idx_t> brute;
            for (idx_t t = 0; t < h.ntotal; t++) {
                bool hit = false;
                for (int l = 0; l < L; l++) {
                    hit = hit || codes[t * L + l] == qc[l];
                }
                if (hit) {
                    brute.push_back(t);
                }
            }
            Selection sel;
            h.select(1, queries.data() + qi * d, &sel);
            ASSERT_EQ(sel.ids, brute) << "query " << qi << " ntotal " << h.ntotal;
        }
    }
    EXPECT_GT(h.n_indexed, 65536);
    EXPECT_GT(long_gaps_seen, 1000u);
    std::vector<uint8_t> buf;
    write_index(&h, &buf);
    auto copy = read_index(buf);
    const auto& c = dynamic_cast<const IndexLSHSample&>(*copy);
    EXPECT_EQ(c.table_words, h.table_words);
    EXPECT_EQ(c.offsets, h.offsets);
}

TEST(LSHSample, EstimatorIsUnbiasedOverHashSeeds) {
    idx_t n = 300;
    auto keys = gaussian(n, kD, 31, 1.0f, 0.3f), values = gaussian(n, kD, 32);
    auto q = gaussian(1, kD, 33, 1.0f);
    double Z = 0;
    std::vector<double> s(n);
    for (idx_t i = 0; i < n; i++) {
        s[i] = 0;
        for (int j = 0; j < kD; j++) {
            s[i] += double(q[j]) * keys[i * kD + j];
        }
        s[i] /= std::sqrt(double(kD));
        Z += std::exp(s[i]);
    }
    int trials = 1500;
    double sum = 0, sum2 = 0, frac = 0;
    for (int t = 0; t < trials; t++) {
        auto h = lsh(3, 12);
        h->set_seed(5000 + t);
        h->add_kv(n, keys.data(), values.data());
        Selection sel;
        h->select(1, q.data(), &sel);
        double est = 0;
        for (size_t j = 0; j < sel.size(); j++) {
            est += std::exp(s[sel.ids[j]]) / sel.inclusion[j];
        }
        sum += est;
        sum2 += est * est;
        frac += double(sel.size()) / n / trials;
    }
    double mean = sum / trials, se = std::sqrt((sum2 / trials - mean * mean) / trials);
    ASSERT_GT(frac, 0.05);
    ASSERT_LT(frac, 0.9); // a real sample, not everything
    EXPECT_NEAR(mean, Z, 4.5 * se) << "Z=" << Z << " se=" << se;
}

TEST(LSHSample, AllTokensWithUnitInclusionIsExact) {
    idx_t n = 500;
    auto keys = gaussian(n, kD, 41, 1.0f, 0.5f), values = gaussian(n, kD, 42);
    for (const char* s : {"LSHSample8x20", "Sink4,Window16,LSHSample8x20"}) {
        auto index = index_factory(kD, s);
        set_index_parameters(index.get(), "min_hits=0");
        index->add_kv(n, keys.data(), values.data());
        auto q = gaussian(5, kD, 43, 2.0f);
        std::vector<float> out(5 * kD), lse(5);
        index->attend(5, q.data(), out.data(), lse.data());
        for (int i = 0; i < 5; i++) {
            std::vector<double> ref;
            double rl = kvtest::ref_attention_all(q.data() + i * kD, keys.data(), values.data(), kD, kD, n, ref);
            EXPECT_NEAR(lse[i], rl, 1e-5) << s;
            EXPECT_LT(kvtest::rel_max_err(out.data() + i * kD, ref), 1e-5) << s;
        }
    }
}

TEST(LSHSample, ZeroQueryAgainstZeroKeysCollidesEverywhere) {
    // zero keys (their mean is zero: centred, still zero) and a zero query
    // hash to the same all-zero codes in every table, so each is sampled
    // with u = 1 and the estimate is exact: lse = log n, out = mean value
    idx_t n = 300;
    std::vector<float> keys(n * kD, 0.0f), values = gaussian(n, kD, 44);
    auto index = index_factory(kD, "LSHSample6x20");
    index->add_kv(n, keys.data(), values.data());
    std::vector<float> q(kD, 0.0f), out(kD);
    float lse;
    index->attend(1, q.data(), out.data(), &lse);
    std::vector<double> ref;
    double rl = kvtest::ref_attention_all(q.data(), keys.data(), values.data(), kD, kD, n, ref);
    EXPECT_NEAR(lse, rl, 1e-5);
    EXPECT_LT(kvtest::rel_max_err(out.data(), ref), 1e-5);
    std::vector<Selection> sel(1);
    index->select(1, q.data(), sel.data());
    ASSERT_EQ(idx_t(sel[0].size()), n);
    for (float u : sel[0].inclusion) {
        ASSERT_EQ(u, 1.0f);
    }
}

TEST(LSHSample, AttendIsTheUnbiasedEstimatorOverTheSample) {
    idx_t n = 2000;
    auto keys = gaussian(n, kD, 51, 1.0f, 0.5f), values = gaussian(n, kD, 52);
    auto h = lsh(5, 30);
    h->add_kv(n, keys.data(), values.data());
    auto q = gaussian(4, kD, 53, 2.0f);
    std::vector<Selection> sel(4);
    h->select(4, q.data(), sel.data());
    std::vector<float> out(4 * kD), lse(4);
    h->attend(4, q.data(), out.data(), lse.data());
    for (int i = 0; i < 4; i++) {
        ASSERT_GT(sel[i].size(), 0u);
        std::vector<double> u(sel[i].inclusion.begin(), sel[i].inclusion.end()), ref;
        double rl = kvtest::ref_attention(q.data() + i * kD, keys.data(), values.data(), kD, kD, sel[i].ids, &u, ref);
        EXPECT_NEAR(lse[i], rl, 1e-4);
        EXPECT_LT(kvtest::rel_max_err(out.data() + i * kD, ref), 1e-5);
    }
    // a cap keeps the best-scoring keys of the sample, in id order, and
    // so does it over every key (min_hits = 0: the sample is all of them)
    for (int hits : {-1, 0}) {
        SCOPED_TRACE(hits);
        SearchParametersLSH all, capped;
        all.min_hits = capped.min_hits = hits;
        capped.max_sample = 5;
        Selection whole, cap;
        h->select(1, q.data(), &whole, &all);
        h->select(1, q.data(), &cap, &capped);
        ASSERT_GT(whole.size(), 5u);
        if (hits == 0) {
            ASSERT_EQ(whole.size(), size_t(n));
        }
        std::vector<double> s = kvtest::ref_scores(q.data(), keys.data(), kD, n);
        std::vector<idx_t> best = whole.ids;
        std::partial_sort(best.begin(), best.begin() + 5, best.end(), [&](idx_t a, idx_t b) {
            return s[a] > s[b] || (s[a] == s[b] && a < b);
        });
        best.resize(5);
        std::sort(best.begin(), best.end());
        EXPECT_EQ(cap.ids, best);
        // the keys scored and dropped by the cap were read too
        EXPECT_EQ(cap.n_scanned, whole.n_scanned + whole.size() - 5);
        if (hits == 0) {
            EXPECT_EQ(whole.n_scanned, 0u) << "every key selected, nothing hashed";
        }
    }
}

TEST(LSHSample, FactoryIoAndParameters) {
    idx_t n = 1500;
    auto keys = gaussian(n, kD, 61, 1.0f, 0.4f), values = gaussian(n, kD, 62);
    for (const char* s : {"LSHSample10x150", "LSHSample7x75", "Sink4,Window64,LSHSample8x50"}) {
        SCOPED_TRACE(s);
        auto index = index_factory(kD, s);
        EXPECT_EQ(index_factory_string(index.get()), s);
        index->add_kv(1000, keys.data(), values.data());
        for (idx_t i = 1000; i < n; i += 50) { // leave a tail
            index->add_kv(50, keys.data() + i * kD, values.data() + i * kD);
        }
        std::vector<uint8_t> buf;
        write_index(index.get(), &buf);
        auto copy = read_index(buf);
        EXPECT_EQ(index_factory_string(copy.get()), s);
        auto q = gaussian(4, kD, 63, 2.0f);
        std::vector<float> o1(4 * kD), o2(4 * kD), l1(4), l2(4);
        index->attend(4, q.data(), o1.data(), l1.data());
        copy->attend(4, q.data(), o2.data(), l2.data());
        EXPECT_EQ(o1, o2);
        EXPECT_EQ(l1, l2);
        for (size_t len = 0; len < buf.size(); len += 1009) {
            EXPECT_THROW(read_index(buf.data(), len), faiss::FaissException);
        }
    }
    auto h = index_factory(kD, "LSHSample8x20");
    set_index_parameters(h.get(), "min_hits=3,max_sample=100");
    EXPECT_EQ(dynamic_cast<IndexLSHSample*>(h.get())->min_hits, 3);
    EXPECT_THROW_MSG(set_index_parameters(h.get(), "min_hits=21"), "min_hits");
    EXPECT_THROW_MSG(set_index_parameters(h.get(), "nprobe=2"), "nprobe");
    EXPECT_THROW_MSG(index_factory(kD, "LSHSample17x10"), "K=17");
    EXPECT_THROW_MSG(index_factory(kD, "LSHSamplex10"), "LSHSamplex10");
}

}  // namespace test_lsh_sample
