// The estimator layer against the double reference.

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include <faiss/impl/FaissAssert.h>
#include <kvindex/attention.h>
#include <kvindex/kernels.h>

#include "expect_throw.h"
#include "reference.h"

namespace test_attention {

using namespace kvindex;
using kvtest::gaussian;

namespace {

struct Tokens {
    size_t n, d, dv;
    std::vector<float> keys, values, q;
    Tokens(size_t n, size_t d, size_t dv, uint64_t seed, float key_scale = 1.0f)
            : n(n), d(d), dv(dv),
              keys(gaussian(n, d, seed, key_scale)),
              values(gaussian(n, dv, seed + 1)),
              q(gaussian(1, d, seed + 2, 2.0f)) {}
};

Selection random_subset(size_t n, size_t m, uint64_t seed, bool with_u) {
    std::vector<idx_t> ids(n);
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937_64 rng(seed);
    std::shuffle(ids.begin(), ids.end(), rng);
    std::uniform_real_distribution<float> u(0.01f, 1.0f);
    Selection sel;
    for (size_t i = 0; i < m; i++) {
        sel.push_back(ids[i], with_u ? u(rng) : 1.0f);
    }
    return sel;
}

} // namespace

TEST(Attention, TopKIsSoftmaxOverTheSet) {
    Tokens t(500, 64, 32, 1);
    Selection sel = random_subset(t.n, 37, 2, /*with_u=*/true);
    std::vector<float> out(t.dv);
    // topk ignores the inclusion probabilities
    float lse = estimate_attention(
            Estimator::topk, t.q.data(), t.keys.data(), t.values.data(), t.d, t.dv, sel, out.data());
    std::vector<double> ref;
    double ref_lse = kvtest::ref_attention(
            t.q.data(), t.keys.data(), t.values.data(), t.d, t.dv, sel.ids, nullptr, ref);
    EXPECT_NEAR(lse, ref_lse, 1e-5);
    EXPECT_LT(kvtest::rel_max_err(out.data(), ref), 1e-5);
}

TEST(Attention, UnbiasedWeightsByInclusion) {
    Tokens t(500, 64, 48, 3);
    Selection sel = random_subset(t.n, 61, 4, true);
    std::vector<double> u(sel.inclusion.begin(), sel.inclusion.end());
    std::vector<float> out(t.dv);
    float lse = estimate_attention(
            Estimator::unbiased, t.q.data(), t.keys.data(), t.values.data(), t.d, t.dv, sel, out.data());
    std::vector<double> ref;
    double ref_lse = kvtest::ref_attention(
            t.q.data(), t.keys.data(), t.values.data(), t.d, t.dv, sel.ids, &u, ref);
    EXPECT_NEAR(lse, ref_lse, 1e-5);
    EXPECT_LT(kvtest::rel_max_err(out.data(), ref), 1e-5);
}

TEST(Attention, UnbiasedWithUnitInclusionOverAllIsExact) {
    Tokens t(777, 128, 128, 5);
    Selection sel = random_subset(t.n, t.n, 6, false);
    std::vector<float> out(t.dv), exact(t.dv);
    float lse = estimate_attention(
            Estimator::unbiased, t.q.data(), t.keys.data(), t.values.data(), t.d, t.dv, sel, out.data());
    float exact_lse = exact_attention(
            t.q.data(), t.keys.data(), t.values.data(), t.d, t.dv, t.n, exact.data());
    std::vector<double> ref;
    double ref_lse = kvtest::ref_attention_all(
            t.q.data(), t.keys.data(), t.values.data(), t.d, t.dv, t.n, ref);
    EXPECT_NEAR(lse, ref_lse, 1e-5);
    EXPECT_NEAR(exact_lse, ref_lse, 1e-5);
    EXPECT_LT(kvtest::rel_max_err(out.data(), ref), 1e-5);
    EXPECT_LT(kvtest::rel_max_err(exact.data(), ref), 1e-5);
}

TEST(Attention, MergeOfDisjointPartitionsIsExact) {
    Tokens t(1000, 32, 16, 7, 3.0f);
    std::vector<double> ref;
    double ref_lse = kvtest::ref_attention_all(
            t.q.data(), t.keys.data(), t.values.data(), t.d, t.dv, t.n, ref);
    std::mt19937_64 rng(8);
    for (int trial = 0; trial < 50; trial++) {
        // random partition into 1..6 parts, some possibly empty
        size_t n_parts = 1 + rng() % 6;
        std::vector<Selection> parts(n_parts);
        for (idx_t i = 0; i < idx_t(t.n); i++) {
            parts[rng() % n_parts].push_back(i);
        }
        std::vector<float> outs(n_parts * t.dv), lses(n_parts);
        std::vector<const float*> ptrs(n_parts);
        for (size_t p = 0; p < n_parts; p++) {
            lses[p] = estimate_attention(
                    Estimator::topk, t.q.data(), t.keys.data(), t.values.data(),
                    t.d, t.dv, parts[p], outs.data() + p * t.dv);
            ptrs[p] = outs.data() + p * t.dv;
        }
        std::vector<float> out(t.dv);
        float lse = merge_attention(n_parts, ptrs.data(), lses.data(), t.dv, out.data());
        EXPECT_NEAR(lse, ref_lse, 1e-5 * std::max(1.0, std::abs(ref_lse)));
        EXPECT_LT(kvtest::rel_max_err(out.data(), ref), 1e-5);
    }
}

TEST(Attention, EmptySetsAndSingleTokens) {
    Tokens t(10, 16, 8, 9);
    Selection empty;
    std::vector<float> out(t.dv, 7.0f);
    float lse = estimate_attention(
            Estimator::unbiased, t.q.data(), t.keys.data(), t.values.data(), t.d, t.dv, empty, out.data());
    EXPECT_EQ(lse, -std::numeric_limits<float>::infinity());
    for (float o : out) {
        EXPECT_EQ(o, 0.0f);
    }
    // a single token: output is its value, lse its score
    Selection one;
    one.push_back(4);
    lse = estimate_attention(
            Estimator::topk, t.q.data(), t.keys.data(), t.values.data(), t.d, t.dv, one, out.data());
    double s = 0;
    for (size_t j = 0; j < t.d; j++) {
        s += double(t.q[j]) * t.keys[4 * t.d + j];
    }
    EXPECT_NEAR(lse, s / 4.0, 1e-5);
    for (size_t j = 0; j < t.dv; j++) {
        EXPECT_NEAR(out[j], t.values[4 * t.dv + j], 1e-6);
    }
    // merging an empty part with a real one gives the real one; all empty gives empty
    float neg_inf = -std::numeric_limits<float>::infinity();
    std::vector<float> zero(t.dv, 0.0f), merged(t.dv);
    const float* ptrs[2] = {zero.data(), out.data()};
    float lses[2] = {neg_inf, lse};
    EXPECT_EQ(merge_attention(2, ptrs, lses, t.dv, merged.data()), lse);
    EXPECT_EQ(merged, out);
    float both[2] = {neg_inf, neg_inf};
    EXPECT_EQ(merge_attention(2, ptrs, both, t.dv, merged.data()), neg_inf);
    EXPECT_EQ(merged, zero);
}

TEST(Attention, StableForScoresOfMagnitude1e4) {
    // keys scaled so that scores reach ~1e4: naive exp would overflow
    Tokens t(300, 64, 64, 11, 1500.0f);
    std::vector<double> ref;
    double ref_lse = kvtest::ref_attention_all(
            t.q.data(), t.keys.data(), t.values.data(), t.d, t.dv, t.n, ref);
    ASSERT_GT(std::abs(ref_lse), 5e3);
    std::vector<float> out(t.dv);
    float lse = exact_attention(
            t.q.data(), t.keys.data(), t.values.data(), t.d, t.dv, t.n, out.data());
    EXPECT_NEAR(lse, ref_lse, 1e-6 * std::abs(ref_lse));
    // the softmax is nearly one-hot; score rounding (~1e-3 absolute at 1e4)
    // moves the weights by ~1e-3 relative
    EXPECT_LT(kvtest::rel_max_err(out.data(), ref), 5e-3);
    // two halves merged give the same answer
    Selection a, b;
    for (idx_t i = 0; i < idx_t(t.n); i++) {
        (i % 2 ? a : b).push_back(i);
    }
    std::vector<float> oa(t.dv), ob(t.dv), merged(t.dv);
    float la = estimate_attention(Estimator::topk, t.q.data(), t.keys.data(), t.values.data(), t.d, t.dv, a, oa.data());
    float lb = estimate_attention(Estimator::topk, t.q.data(), t.keys.data(), t.values.data(), t.d, t.dv, b, ob.data());
    const float* ptrs[2] = {oa.data(), ob.data()};
    float lses[2] = {la, lb};
    float lm = merge_attention(2, ptrs, lses, t.dv, merged.data());
    EXPECT_NEAR(lm, ref_lse, 1e-6 * std::abs(ref_lse));
    EXPECT_LT(kvtest::rel_max_err(merged.data(), ref), 5e-3);
}

TEST(Attention, InclusionOutOfRangeThrows) {
    Tokens t(10, 16, 8, 12);
    Selection sel;
    sel.push_back(1, 0.0f);
    std::vector<float> out(t.dv);
    EXPECT_THROW(
            estimate_attention(Estimator::unbiased, t.q.data(), t.keys.data(), t.values.data(), t.d, t.dv, sel, out.data()),
            faiss::FaissException);
}

TEST(Attention, MergeRefusesAnLseThatIsNone) {
    // -inf is an empty part; NaN and +inf are no log-sum-exp: a NaN part
    // was dropped as if empty, a +inf one made the output NaN
    std::vector<float> a(4, 1.0f), b(4, 2.0f), out(4);
    const float* outs[2] = {a.data(), b.data()};
    const float inf = std::numeric_limits<float>::infinity();
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), inf}) {
        float lses[2] = {0.5f, bad};
        EXPECT_THROW_MSG(merge_attention(2, outs, lses, 4, out.data()), "part 1 has lse");
    }
    float lses[2] = {-inf, 0.5f};
    EXPECT_FLOAT_EQ(merge_attention(2, outs, lses, 4, out.data()), 0.5f);
    EXPECT_EQ(out, b);
    EXPECT_THROW_MSG(set_simd_level(SimdLevel(7)), "7 is no SimdLevel");
}

TEST(Attention, ANonFiniteResultIsRefused) {
    // the free functions read the caller's rows unchecked: NaN, Inf or
    // scores that overflow float showed only as a NaN output
    Tokens t(40, 16, 8, 13);
    std::vector<float> out(t.dv);
    Selection all = random_subset(t.n, t.n, 14, true);
    auto exact = [&](const Tokens& x) {
        return exact_attention(x.q.data(), x.keys.data(), x.values.data(), x.d, x.dv, x.n, out.data());
    };
    auto topk = [&](const Tokens& x) {
        return estimate_attention(
                Estimator::topk, x.q.data(), x.keys.data(), x.values.data(), x.d, x.dv, all, out.data());
    };
    Tokens overflow = t; // |q . k| ~ 1e40 > FLT_MAX
    for (float& x : overflow.keys) {
        x *= 1e20f;
    }
    for (float& x : overflow.q) {
        x *= 1e20f;
    }
    Tokens nan_value = t;
    nan_value.values[5 * t.dv + 2] = std::numeric_limits<float>::quiet_NaN();
    Tokens inf_key = t;
    inf_key.keys[7 * t.d] = std::copysign(std::numeric_limits<float>::infinity(), t.q[0]);
    Tokens minus_inf_key = t; // a score of -inf: weight 0 in exact_attention, refused by estimate
    minus_inf_key.keys[7 * t.d] = -std::copysign(std::numeric_limits<float>::infinity(), t.q[0]);
    for (const Tokens* bad : {&overflow, &nan_value, &inf_key}) {
        EXPECT_THROW_MSG(exact(*bad), "exact_attention: the result is not finite");
    }
    EXPECT_THROW_MSG(topk(overflow), "estimate_attention: the score of token");
    EXPECT_THROW_MSG(topk(inf_key), "estimate_attention: the score of token 7 is");
    EXPECT_THROW_MSG(topk(minus_inf_key), "estimate_attention: the score of token 7 is -inf");
    EXPECT_THROW_MSG(topk(nan_value), "estimate_attention: the result is not finite");
    // the same rows, finite, are answered
    EXPECT_TRUE(std::isfinite(exact(t)));
    EXPECT_TRUE(std::isfinite(topk(t)));

    // attention_from_scores: -inf is a masked token, +inf or NaN no score
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<idx_t> ids = {0, 1, 2, 3};
    std::vector<float> s = {0.5f, -inf, 1.5f, -inf};
    float lse = attention_from_scores(s.data(), nullptr, t.values.data(), t.dv, ids.data(), 4, out.data());
    std::vector<double> ref(t.dv);
    double e0 = std::exp(0.5), e2 = std::exp(1.5);
    for (size_t j = 0; j < t.dv; j++) {
        ref[j] = (e0 * t.values[j] + e2 * t.values[2 * t.dv + j]) / (e0 + e2);
    }
    EXPECT_NEAR(lse, std::log(e0 + e2), 1e-6);
    EXPECT_LT(kvtest::rel_max_err(out.data(), ref), 1e-6);
    std::vector<float> masked(4, -inf);
    EXPECT_EQ(attention_from_scores(masked.data(), nullptr, t.values.data(), t.dv, ids.data(), 4, out.data()), -inf);
    EXPECT_EQ(out, std::vector<float>(t.dv, 0.0f));
    for (float bad : {inf, std::numeric_limits<float>::quiet_NaN()}) {
        std::vector<float> b = {0.5f, bad, 1.5f, 0.0f};
        EXPECT_THROW_MSG(
                attention_from_scores(b.data(), nullptr, t.values.data(), t.dv, ids.data(), 4, out.data()),
                "attention_from_scores: the result is not finite");
    }
}

}  // namespace test_attention
