// One pass per GQA group: the group kernel (dense_attention_group) against
// g separate dense_attention calls at every SIMD level; Flat and the
// sink / window wrapper attending n queries at once against n single
// calls; KVCache::attend (one call per KV head with its whole group)
// against each query head attended on its own.
//
// Tolerances: the group kernel sums the dot products in another order than
// dense_attention (a transposing fold instead of one horizontal sum per
// key), so the two agree to float rounding: out within 1e-5 of max(1, |out|)
// and lse within 1e-5 of max(1, |lse|) for scores of order 1-10. Within the
// group kernel a query's arithmetic does not depend on the other queries of
// its call, so every comparison of batched against single calls of kvindex
// itself is exact (bit for bit).

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/IndexKVFlat.h>
#include <kvindex/IndexSinkWindow.h>
#include <kvindex/KVCache.h>
#include <kvindex/attention.h>
#include <kvindex/index_factory.h>
#include <kvindex/kernels.h>

#include "reference.h"
#include "simd_levels.h"

namespace test_gqa_group {

using namespace kvindex;
using kvtest::gaussian;

namespace {

/// max_i |a_i - b_i| / max(1, max_i |b_i|)
double rel_err(const float* a, const float* b, size_t n) {
    double err = 0, mag = 1;
    for (size_t i = 0; i < n; i++) {
        err = std::max(err, std::abs(double(a[i]) - double(b[i])));
        mag = std::max(mag, std::abs(double(b[i])));
    }
    return err / mag;
}

} // namespace

class GroupKernelTest : public kvtest::SimdLevelTest {};

TEST_P(GroupKernelTest, EqualsSeparateDenseAttentionCalls) {
    constexpr double kTol = 1e-5;
    const size_t kGroups[] = {1, 2, 3, 4, 8, 9};
    const size_t kCounts[] = {0, 1, 255, 256, 257, 1000};
    // d = 37: a dimension that is no multiple of any vector width
    for (size_t d : {size_t(64), size_t(128), size_t(37)}) {
        for (size_t dv : {d, size_t(48), size_t(13)}) {
            for (size_t n : kCounts) {
                auto keys = gaussian(n, d, 100 + n + d, 1.0f, 0.1f);
                auto values = gaussian(n, dv, 200 + n + dv);
                float scale = float(1 / std::sqrt(double(d)));
                for (size_t g : kGroups) {
                    auto q = gaussian(g, d, 300 + g + d, 2.0f);
                    std::vector<float> out(g * dv, -7.0f), lse(g, -7.0f);
                    dense_attention_group(
                            q.data(), g, keys.data(), values.data(), d, dv, n, scale,
                            out.data(), lse.data());
                    for (size_t c = 0; c < g; c++) {
                        SCOPED_TRACE(
                                "d=" + std::to_string(d) + " dv=" + std::to_string(dv) +
                                " n=" + std::to_string(n) + " g=" + std::to_string(g) +
                                " query " + std::to_string(c));
                        std::vector<float> ref(dv);
                        float ref_lse = dense_attention(
                                q.data() + c * d, keys.data(), values.data(), d, dv, n, scale,
                                ref.data());
                        if (n == 0) {
                            EXPECT_EQ(lse[c], -std::numeric_limits<float>::infinity());
                            for (size_t j = 0; j < dv; j++) {
                                EXPECT_EQ(out[c * dv + j], 0.0f);
                            }
                            continue;
                        }
                        EXPECT_LE(
                                std::abs(double(lse[c]) - ref_lse),
                                kTol * std::max(1.0, std::abs(double(ref_lse))));
                        EXPECT_LE(rel_err(out.data() + c * dv, ref.data(), dv), kTol);
                        // the query alone in its call: the same bits
                        std::vector<float> one(dv);
                        float one_lse;
                        dense_attention_group(
                                q.data() + c * d, 1, keys.data(), values.data(), d, dv, n,
                                scale, one.data(), &one_lse);
                        EXPECT_EQ(one_lse, lse[c]);
                        EXPECT_TRUE(std::equal(one.begin(), one.end(), out.begin() + c * dv));
                    }
                }
            }
        }
    }
}

TEST_P(GroupKernelTest, MatchesDoubleReferenceWithLargeScores) {
    // scores of magnitude ~1e3: the online softmax rescales block after block
    size_t d = 64, dv = 64, n = 1000, g = 3;
    auto keys = gaussian(n, d, 7, 30.0f);
    auto values = gaussian(n, dv, 8);
    auto q = gaussian(g, d, 9, 4.0f);
    std::vector<float> out(g * dv), lse(g);
    dense_attention_group(
            q.data(), g, keys.data(), values.data(), d, dv, n,
            float(1 / std::sqrt(double(d))), out.data(), lse.data());
    for (size_t c = 0; c < g; c++) {
        std::vector<double> ref;
        double ref_lse = kvtest::ref_attention_all(
                q.data() + c * d, keys.data(), values.data(), d, dv, n, ref);
        EXPECT_NEAR(lse[c], ref_lse, 2e-6 * std::abs(ref_lse) + 1e-4);
        EXPECT_LT(kvtest::rel_max_err(out.data() + c * dv, ref), 1e-2);
    }
}

KVTEST_AT_EVERY_SIMD_LEVEL(GroupKernelTest);

namespace {

/// attend(n) in one call against n calls of attend(1): exactly equal.
void expect_batch_equals_single_calls(const KVIndex& index, idx_t n, uint64_t seed) {
    int d = index.d, dv = index.d_value;
    auto q = gaussian(n, d, seed, 2.0f);
    std::vector<float> out(n * dv), lse(n);
    index.attend(n, q.data(), out.data(), lse.data());
    for (idx_t i = 0; i < n; i++) {
        std::vector<float> one(dv);
        float one_lse;
        index.attend(1, q.data() + i * d, one.data(), &one_lse);
        EXPECT_EQ(one_lse, lse[i]) << "query " << i << " of " << n;
        EXPECT_TRUE(std::equal(one.begin(), one.end(), out.begin() + i * dv))
                << "query " << i << " of " << n;
        // and exact attention to float rounding
        std::vector<double> ref;
        std::vector<float> all_k(index.ntotal * size_t(d)), all_v(index.ntotal * size_t(dv));
        for (idx_t t = 0; t < index.ntotal; t++) {
            index.reconstruct(t, all_k.data() + t * d);
            index.reconstruct_value(t, all_v.data() + t * dv);
        }
        double ref_lse = kvtest::ref_attention_all(
                q.data() + i * d, all_k.data(), all_v.data(), d, dv, index.ntotal, ref);
        EXPECT_NEAR(lse[i], ref_lse, 1e-5 * std::max(1.0, std::abs(ref_lse)));
        EXPECT_LT(kvtest::rel_max_err(out.data() + i * dv, ref), 1e-5);
    }
}

} // namespace

TEST(GQAGroup, FlatAttendOfNQueriesEqualsNSingleCalls) {
    for (idx_t n_tokens : {1, 255, 700}) {
        IndexKVFlat flat(64, 40);
        auto k = gaussian(n_tokens, 64, 1, 1.0f, 0.2f), v = gaussian(n_tokens, 40, 2);
        flat.add_kv(n_tokens, k.data(), v.data());
        for (idx_t n : {1, 2, 3, 8, 9, 17}) {
            SCOPED_TRACE("tokens=" + std::to_string(n_tokens) + " n=" + std::to_string(n));
            expect_batch_equals_single_calls(flat, n, 10 + n);
        }
    }
}

TEST(GQAGroup, SinkWindowAttendOfNQueriesEqualsNSingleCalls) {
    auto index = index_factory(64, "Sink4,Window16,Flat", 48);
    auto k = gaussian(300, 64, 3, 1.0f, 0.2f), v = gaussian(300, 48, 4);
    // only sink tokens, sink + part of the window, then all three parts
    idx_t filled = 0;
    for (idx_t upto : {3, 12, 300}) {
        index->add_kv(upto - filled, k.data() + filled * 64, v.data() + filled * 48);
        filled = upto;
        for (idx_t n : {1, 3, 8, 9, 17}) {
            SCOPED_TRACE("tokens=" + std::to_string(upto) + " n=" + std::to_string(n));
            expect_batch_equals_single_calls(*index, n, 20 + n);
        }
    }
}

TEST(GQAGroup, KVCacheAttendEqualsPerHeadAttends) {
    // SmolLM2-135M's shape (9 query heads on 3 KV heads, d = 64) and a
    // Llama-3-like group of 4; several queries per head
    struct Shape {
        int q_heads, kv_heads, d, dv;
    };
    for (Shape s : {Shape{9, 3, 64, 64}, Shape{8, 2, 32, 24}, Shape{4, 4, 16, 16}}) {
        for (const char* str : {"Flat", "Sink4,Window16,Flat", "TopK(Flat)"}) {
            idx_t n_tokens = 300;
            KVCache cache(2, s.q_heads, s.kv_heads, s.d, s.dv, str);
            for (int l = 0; l < 2; l++) {
                auto k = gaussian(s.kv_heads * n_tokens, s.d, 40 + l, 1.0f, 0.2f);
                auto v = gaussian(s.kv_heads * n_tokens, s.dv, 50 + l);
                cache.prefill(l, n_tokens, k.data(), v.data(), 0, nullptr, nullptr, RopeParams{});
            }
            for (idx_t n : {1, 5}) {
                SCOPED_TRACE(
                        std::string(str) + " q_heads=" + std::to_string(s.q_heads) +
                        " n=" + std::to_string(n));
                auto q = gaussian(s.q_heads * n, s.d, 60 + n, 2.0f);
                std::vector<float> out(s.q_heads * n * s.dv), lse(s.q_heads * n);
                cache.attend(1, n, q.data(), out.data(), lse.data());
                std::vector<float> out2(out.size());
                cache.attend(1, n, q.data(), out2.data(), nullptr);
                EXPECT_EQ(out2, out);
                for (int h = 0; h < s.q_heads; h++) {
                    std::vector<float> ho(n * s.dv), hl(n);
                    cache.index(1, cache.kv_head_of(h))
                            ->attend(n, q.data() + h * n * s.d, ho.data(), hl.data());
                    EXPECT_TRUE(std::equal(ho.begin(), ho.end(), out.begin() + h * n * s.dv))
                            << "query head " << h;
                    EXPECT_TRUE(std::equal(hl.begin(), hl.end(), lse.begin() + h * n))
                            << "query head " << h;
                }
            }
        }
    }
}

}  // namespace test_gqa_group
