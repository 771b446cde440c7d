// Every SIMD level the CPU runs is checked against the double reference.

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/kernels.h>

#include "reference.h"
#include "simd_levels.h"

namespace test_kernels {

using namespace kvindex;
using kvtest::gaussian;

namespace {

const size_t kDims[] = {1, 3, 8, 17, 64, 128, 130};
const size_t kCounts[] = {0, 1, 3, 4, 5, 255, 256, 257, 1000};

double dot_ref(const float* a, const float* b, size_t d) {
    double s = 0;
    for (size_t j = 0; j < d; j++) {
        s += double(a[j]) * b[j];
    }
    return s;
}

} // namespace

class KernelsTest : public kvtest::SimdLevelTest {};

TEST_P(KernelsTest, InnerProductsMatchReference) {
    for (size_t d : kDims) {
        for (size_t n : kCounts) {
            auto x = gaussian(n, d, 1 + n + d);
            auto q = gaussian(1, d, 99 + d);
            std::vector<float> s(n);
            inner_products_scaled(q.data(), x.data(), d, n, 0.5f, s.data());
            std::vector<int64_t> ids(n);
            for (size_t i = 0; i < n; i++) {
                ids[i] = int64_t((i * 7919) % n);
            }
            std::vector<float> sg(n);
            inner_products_by_ids(q.data(), x.data(), d, ids.data(), n, 0.5f, sg.data());
            for (size_t i = 0; i < n; i++) {
                // float accumulation over d terms of magnitude ~1: 1e-5 * sqrt(d)
                double tol = 1e-5 * std::sqrt(double(d)) + 1e-6;
                EXPECT_NEAR(s[i], 0.5 * dot_ref(q.data(), &x[i * d], d), tol) << d << " " << n;
                EXPECT_NEAR(sg[i], 0.5 * dot_ref(q.data(), &x[ids[i] * d], d), tol);
            }
        }
    }
}

TEST_P(KernelsTest, CodeInnerProductsMatchReference) {
    for (size_t d : kDims) {
        for (size_t n : kCounts) {
            std::vector<uint8_t> codes(n * d);
            for (size_t i = 0; i < codes.size(); i++) {
                codes[i] = uint8_t((i * 2654435761u) >> 24); // every byte value, 0 and 255 too
            }
            auto q = gaussian(1, d, 7 + d);
            std::vector<int64_t> ids(n);
            for (size_t i = 0; i < n; i++) {
                ids[i] = int64_t((i * 7919) % n);
            }
            std::vector<float> s(n);
            inner_products_by_ids(q.data(), codes.data(), d, ids.data(), n, 0.5f, s.data());
            for (size_t i = 0; i < n; i++) {
                double ref = 0;
                for (size_t j = 0; j < d; j++) {
                    ref += double(q[j]) * codes[size_t(ids[i]) * d + j];
                }
                // float accumulation over d terms of magnitude ~255
                double tol = 255 * (1e-5 * std::sqrt(double(d)) + 1e-6);
                EXPECT_NEAR(s[i], 0.5 * ref, tol) << d << " " << n << " " << i;
            }
        }
    }
}

TEST_P(KernelsTest, SoftmaxMatchesReferenceAndIsStable) {
    for (size_t n : kCounts) {
        for (float magnitude : {1.0f, 100.0f, 1e4f}) {
            auto s = gaussian(1, n, 7 + n, magnitude);
            auto bias = gaussian(1, n, 8 + n, 3.0f);
            std::vector<float> w = s;
            float lse = softmax_inplace(w.data(), bias.data(), n);
            if (n == 0) {
                EXPECT_EQ(lse, -std::numeric_limits<float>::infinity());
                continue;
            }
            double m = -INFINITY;
            for (size_t i = 0; i < n; i++) {
                m = std::max(m, double(s[i]) - bias[i]);
            }
            double z = 0;
            for (size_t i = 0; i < n; i++) {
                z += std::exp(double(s[i]) - bias[i] - m);
            }
            // lse relative 1e-6 (float rounding of values up to 1e4)
            EXPECT_NEAR(lse, m + std::log(z), 1e-6 * std::max(1.0, std::abs(m)) + 1e-5);
            double sum = 0;
            for (size_t i = 0; i < n; i++) {
                double ref = std::exp(double(s[i]) - bias[i] - m) / z;
                EXPECT_NEAR(w[i], ref, 1e-6 + 1e-5 * ref);
                sum += w[i];
            }
            EXPECT_NEAR(sum, 1.0, 1e-5);
        }
    }
}

TEST_P(KernelsTest, SoftmaxReadsMinusInfAsAMaskedToken) {
    // -inf scores weigh 0; when all are -inf the set is empty (weights 0,
    // lse -inf) rather than 0/0 = NaN; a NaN among them stays NaN (max_of
    // skips NaN, so the empty-set branch must not hide it)
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (size_t n : kCounts) {
        if (n == 0) {
            continue;
        }
        auto s = gaussian(1, n, 40 + n, 5.0f);
        std::vector<float> masked = s;
        for (size_t i = 0; i < n; i += 3) {
            masked[i] = neg_inf;
        }
        std::vector<float> w = masked;
        float lse = softmax_inplace(w.data(), nullptr, n);
        double m = -INFINITY, z = 0;
        for (size_t i = 1; i < n; i++) {
            m = std::max(m, double(i % 3 ? s[i] : -INFINITY));
        }
        for (size_t i = 1; i < n; i++) {
            z += i % 3 ? std::exp(double(s[i]) - m) : 0.0;
        }
        if (n == 1) {
            EXPECT_EQ(lse, neg_inf);
        } else {
            EXPECT_NEAR(lse, m + std::log(z), 1e-5 * std::max(1.0, std::abs(m)));
        }
        for (size_t i = 0; i < n; i++) {
            double ref = i % 3 ? std::exp(double(s[i]) - m) / z : 0.0;
            EXPECT_NEAR(w[i], ref, 1e-6 + 1e-5 * ref) << "n=" << n << " i=" << i;
        }
        std::vector<float> all(n, neg_inf);
        EXPECT_EQ(softmax_inplace(all.data(), nullptr, n), neg_inf) << "n=" << n;
        EXPECT_EQ(all, std::vector<float>(n, 0.0f));
        // a bias of +inf masks too
        std::vector<float> finite = s, bias(n, std::numeric_limits<float>::infinity());
        EXPECT_EQ(softmax_inplace(finite.data(), bias.data(), n), neg_inf);
        std::vector<float> with_nan(n, neg_inf);
        with_nan[n - 1] = std::numeric_limits<float>::quiet_NaN();
        EXPECT_TRUE(std::isnan(softmax_inplace(with_nan.data(), nullptr, n))) << "n=" << n;
    }
}

TEST_P(KernelsTest, InnerProductsMultiScoresEachRowAloneWhateverTheCall) {
    // IndexLSHSample hashes blocks of keys with it and single keys with it
    // too: a score must not depend on the other queries, the number of
    // rows or where a row falls in a tile. Widths around the vector
    // lengths, odd query counts, row counts around the tile width, rows of
    // s with padding; against a double reference and against each row
    // scored alone by one query.
    for (size_t d : {size_t(1), size_t(3), size_t(16), size_t(40), size_t(128), size_t(131)}) {
        for (size_t g : {size_t(0), size_t(1), size_t(2), size_t(5)}) {
            for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(16), size_t(17), size_t(53)}) {
                auto q = gaussian(g, d, 11 + d + g);
                auto x = gaussian(n, d, 12 + d * n);
                const size_t ld = n + 3;
                std::vector<float> s(g * ld, -7.0f);
                inner_products_multi(q.data(), g, x.data(), d, n, s.data(), ld);
                for (size_t b = 0; b < g; b++) {
                    for (size_t i = 0; i < n; i++) {
                        double ref = 0;
                        for (size_t j = 0; j < d; j++) {
                            ref += double(q[b * d + j]) * x[i * d + j];
                        }
                        float alone;
                        inner_products_multi(q.data() + b * d, 1, x.data() + i * d, d, 1, &alone, 1);
                        SCOPED_TRACE(::testing::Message() << "d=" << d << " g=" << g << " n=" << n
                                                          << " b=" << b << " i=" << i);
                        EXPECT_EQ(std::memcmp(&s[b * ld + i], &alone, sizeof(float)), 0)
                                << s[b * ld + i] << " vs " << alone;
                        EXPECT_NEAR(s[b * ld + i], ref, 1e-5 * (1 + std::sqrt(double(d))));
                    }
                    for (size_t i = n; i < ld; i++) {
                        EXPECT_EQ(s[b * ld + i], -7.0f) << "wrote past n";
                    }
                }
            }
        }
    }
}

TEST_P(KernelsTest, InclusionPassMatchesReference) {
    // weights with zeros (excluded tokens) and a few heavy ones, at every
    // length around the vector widths; c from "none sure" to "most sure"
    for (size_t n : {size_t(0), size_t(1), size_t(7), size_t(8), size_t(15), size_t(16), size_t(17),
                     size_t(33), size_t(1000), size_t(4099)}) {
        auto g = gaussian(1, n, 5 + n);
        std::vector<float> w(n);
        for (size_t i = 0; i < n; i++) {
            w[i] = i % 5 == 2 ? 0.0f : std::exp(2.0f * g[i]); // 0 or in (0, ~e^10)
        }
        for (double c : {0.0, 1e-3, 0.05, 1.0, 40.0}) {
            size_t sure = 0, positive = 0;
            double light = inclusion_pass(w.data(), n, c, &sure, &positive);
            size_t ref_sure = 0, ref_pos = 0;
            double ref_light = 0;
            for (size_t i = 0; i < n; i++) {
                if (w[i] > 0) {
                    ref_pos++;
                    if (double(w[i]) * c >= 1) {
                        ref_sure++;
                    } else {
                        ref_light += w[i];
                    }
                }
            }
            EXPECT_EQ(sure, ref_sure) << "n=" << n << " c=" << c;
            EXPECT_EQ(positive, ref_pos) << "n=" << n << " c=" << c;
            // positive terms in another order: a few ulps of double
            EXPECT_NEAR(light, ref_light, 1e-13 * ref_light) << "n=" << n << " c=" << c;
            EXPECT_EQ(inclusion_pass(w.data(), n, c, nullptr, nullptr), light);
        }
    }
}

TEST_P(KernelsTest, WeightedSumsMatchReference) {
    for (size_t dv : kDims) {
        for (size_t n : kCounts) {
            auto v = gaussian(n, dv, 3 + n * dv);
            auto w = gaussian(1, n, 4 + n);
            std::vector<int64_t> ids(n);
            for (size_t i = 0; i < n; i++) {
                ids[i] = int64_t((i * 31) % n);
            }
            std::vector<float> out(dv, 123.0f), outg(dv, 456.0f);
            weighted_sum(w.data(), v.data(), dv, n, out.data());
            weighted_sum_by_ids(w.data(), v.data(), dv, ids.data(), n, outg.data());
            for (size_t j = 0; j < dv; j++) {
                double r = 0, rg = 0;
                for (size_t i = 0; i < n; i++) {
                    r += double(w[i]) * v[i * dv + j];
                    rg += double(w[i]) * v[ids[i] * dv + j];
                }
                double tol = 1e-5 * std::sqrt(double(n)) + 1e-6;
                EXPECT_NEAR(out[j], r, tol);
                EXPECT_NEAR(outg[j], rg, tol);
            }
        }
    }
}

TEST_P(KernelsTest, DenseAttentionMatchesReference) {
    for (size_t d : {size_t(8), size_t(64), size_t(130)}) {
        for (size_t n : kCounts) {
            for (float magnitude : {1.0f, 30.0f, 1e3f}) {
                // scores up to ~magnitude^2 * sqrt(d): 1e3 gives |s| ~ 1e4 and more
                auto keys = gaussian(n, d, 11 + n, magnitude);
                auto values = gaussian(n, d / 2 + 1, 12 + n);
                auto q = gaussian(1, d, 13 + d, magnitude / 10 + 1);
                size_t dv = d / 2 + 1;
                std::vector<float> out(dv);
                float scale = float(1 / std::sqrt(double(d)));
                float lse = dense_attention(
                        q.data(), keys.data(), values.data(), d, dv, n, scale, out.data());
                std::vector<double> ref;
                double ref_lse = kvtest::ref_attention_all(
                        q.data(), keys.data(), values.data(), d, dv, n, ref);
                if (n == 0) {
                    EXPECT_EQ(lse, -std::numeric_limits<float>::infinity());
                    continue;
                }
                ASSERT_TRUE(std::isfinite(lse));
                // lse: float scores of magnitude |s| carry ~1e-6 |s| error
                EXPECT_NEAR(lse, ref_lse, 2e-6 * std::abs(ref_lse) + 1e-4);
                // output: sharp softmax amplifies score rounding, so allow more
                double tol = magnitude > 100 ? 2e-2 : 1e-4;
                EXPECT_LT(kvtest::rel_max_err(out.data(), ref), tol)
                        << "d=" << d << " n=" << n << " mag=" << magnitude;
            }
        }
    }
}

KVTEST_AT_EVERY_SIMD_LEVEL(KernelsTest);

TEST(Kernels, LevelSelection) {
    auto levels = available_simd_levels();
    ASSERT_FALSE(levels.empty());
    EXPECT_EQ(levels.front(), SimdLevel::generic);
    // the default is the widest level the CPU runs (unless KVINDEX_SIMD is set)
    if (!std::getenv("KVINDEX_SIMD")) {
        EXPECT_EQ(get_simd_level(), levels.back());
    }
}

}  // namespace test_kernels
