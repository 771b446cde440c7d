#include <cmath>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include <faiss/impl/FaissAssert.h>
#include <kvindex/rope.h>

#include "reference.h"

namespace test_rope {

using namespace kvindex;

namespace {

std::vector<int64_t> positions(size_t n, int64_t step) {
    std::vector<int64_t> p(n);
    for (size_t i = 0; i < n; i++) {
        p[i] = int64_t(i) * step;
    }
    return p;
}

double dot(const float* a, const float* b, int d) {
    double s = 0;
    for (int j = 0; j < d; j++) {
        s += double(a[j]) * b[j];
    }
    return s;
}

} // namespace

TEST(Rope, InvertUndoesApply) {
    for (RopeStyle style : {RopeStyle::half, RopeStyle::interleaved}) {
        for (double theta : {10000.0, 500000.0}) {
            int d = 64;
            size_t n = 200;
            auto x = kvtest::gaussian(n, d, 1);
            auto y = x;
            auto pos = positions(n, 997); // up to ~2e5
            RopeParams rope{theta, style};
            apply_rope(n, d, y.data(), pos.data(), rope);
            EXPECT_NE(x, y);
            invert_rope(n, d, y.data(), pos.data(), rope);
            for (size_t i = 0; i < x.size(); i++) {
                ASSERT_NEAR(y[i], x[i], 2e-6) << rope_style_name(style) << " " << i;
            }
        }
    }
}

TEST(Rope, MatchesTheFormula) {
    // one vector, hand-written rotation in double for both pairings
    int d = 8;
    auto x = kvtest::gaussian(1, d, 2);
    int64_t p = 37;
    for (RopeStyle style : {RopeStyle::half, RopeStyle::interleaved}) {
        auto y = x;
        apply_rope(1, d, y.data(), &p, RopeParams{10000.0, style});
        for (int j = 0; j < d / 2; j++) {
            double ang = p * std::pow(10000.0, -2.0 * j / d);
            int a = style == RopeStyle::half ? j : 2 * j;
            int b = style == RopeStyle::half ? j + d / 2 : 2 * j + 1;
            EXPECT_NEAR(y[a], x[a] * std::cos(ang) - x[b] * std::sin(ang), 1e-6);
            EXPECT_NEAR(y[b], x[a] * std::sin(ang) + x[b] * std::cos(ang), 1e-6);
        }
    }
}

TEST(Rope, ScoresDependOnRelativePositionOnly) {
    // <R_p q, R_t k> = <R_{p+s} q, R_{t+s} k>: the property attention relies on
    int d = 32;
    auto q = kvtest::gaussian(1, d, 3);
    auto k = kvtest::gaussian(1, d, 4);
    for (RopeStyle style : {RopeStyle::half, RopeStyle::interleaved}) {
        RopeParams rope{10000.0, style};
        double ref = 0;
        for (int64_t shift : {0, 5, 1000}) {
            auto qr = q, kr = k;
            int64_t pq = 50 + shift, pk = 20 + shift;
            apply_rope(1, d, qr.data(), &pq, rope);
            apply_rope(1, d, kr.data(), &pk, rope);
            double s = dot(qr.data(), kr.data(), d);
            if (shift == 0) {
                ref = s;
            }
            EXPECT_NEAR(s, ref, 1e-4);
        }
    }
}

TEST(Rope, BadParametersThrow) {
    std::vector<float> x(6, 1.0f);
    int64_t p = 0;
    EXPECT_THROW(apply_rope(1, 5, x.data(), &p, RopeParams{}), faiss::FaissException);
    EXPECT_THROW(apply_rope(1, 6, x.data(), &p, RopeParams{-1.0}), faiss::FaissException);
    EXPECT_THROW(apply_rope(1, 6, x.data(), &p, RopeParams{NAN}), faiss::FaissException);
    int64_t neg = -1;
    EXPECT_THROW(apply_rope(1, 6, x.data(), &neg, RopeParams{}), faiss::FaissException);
    EXPECT_THROW(rope_style_from_name("rotary"), faiss::FaissException);
    EXPECT_EQ(rope_style_from_name("half"), RopeStyle::half);
    EXPECT_EQ(rope_style_from_name("interleaved"), RopeStyle::interleaved);
}

TEST(Rope, ARefusedPositionLeavesEveryRowAsItWas) {
    // the bad position is the third row's: the rows before it must not be
    // rotated either (the call works in place)
    const int d = 4;
    std::vector<float> x(4 * d, 1.0f);
    const std::vector<float> before = x;
    std::vector<int64_t> pos = {5, 6, -1, 7};
    EXPECT_THROW(apply_rope(4, d, x.data(), pos.data(), RopeParams{}), faiss::FaissException);
    EXPECT_EQ(x, before);
    EXPECT_THROW(invert_rope(4, d, x.data(), pos.data(), RopeParams{}), faiss::FaissException);
    EXPECT_EQ(x, before);
}

}  // namespace test_rope
