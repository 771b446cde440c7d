// The sink + window wrapper: exact when the inner index is exact, disjoint
// split while tokens are appended, top-k over the middle merged by lse.

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/IndexSinkWindow.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>

#include "reference.h"

namespace test_sink_window {

using namespace kvindex;
using kvtest::gaussian;

namespace {

constexpr int kD = 16;
constexpr int kDv = 12;

void expect_split_invariants(const IndexSinkWindow& w) {
    EXPECT_EQ(w.sink.size() + w.inner->ntotal + w.window.size(), w.ntotal);
    EXPECT_LE(w.sink.size(), w.n_sink);
    EXPECT_LE(w.window.size(), w.n_window);
    if (w.inner->ntotal > 0) {
        EXPECT_EQ(w.sink.size(), w.n_sink);
        EXPECT_EQ(w.window.size(), w.n_window);
    }
}

} // namespace

TEST(SinkWindow, ExactInnerGivesExactAttentionDuringDecode) {
    idx_t n = 400, n_prompt = 150;
    auto keys = gaussian(n, kD, 1, 1.0f, 0.3f);
    auto values = gaussian(n, kDv, 2);
    auto queries = gaussian(n, kD, 3, 2.0f);
    for (const char* s : {"Sink4,Window32,Flat", "Sink4,Window32,TopK(Flat)", "Sink1,Flat",
                          "Window8,Flat", "Sink200,Window300,Flat"}) {
        auto index = index_factory(kD, s, kDv);
        if (auto t = dynamic_cast<IndexSinkWindow*>(index.get())) {
            t->inner->k = 1 << 20; // TopK with k beyond the index: every token
        }
        PrefillInput in;
        in.n_tokens = n_prompt;
        in.keys = keys.data();
        in.values = values.data();
        index->prefill(in);
        for (idx_t p = n_prompt; p < n; p++) {
            index->add_kv(1, keys.data() + p * kD, values.data() + p * kDv);
            std::vector<float> out(kDv);
            float lse;
            index->attend(1, queries.data() + p * kD, out.data(), &lse);
            std::vector<double> ref;
            double ref_lse = kvtest::ref_attention_all(
                    queries.data() + p * kD, keys.data(), values.data(), kD, kDv, p + 1, ref);
            ASSERT_NEAR(lse, ref_lse, 1e-5 * std::max(1.0, std::abs(ref_lse))) << s << " p=" << p;
            ASSERT_LT(kvtest::rel_max_err(out.data(), ref), 1e-5) << s << " p=" << p;
            expect_split_invariants(*dynamic_cast<IndexSinkWindow*>(index.get()));
        }
        // every token is where it should be
        std::vector<float> k(kD), v(kDv);
        for (idx_t i = 0; i < n; i++) {
            index->reconstruct(i, k.data());
            index->reconstruct_value(i, v.data());
            ASSERT_TRUE(std::equal(k.begin(), k.end(), keys.begin() + i * kD)) << s << " " << i;
            ASSERT_TRUE(std::equal(v.begin(), v.end(), values.begin() + i * kDv)) << s << " " << i;
        }
    }
}

TEST(SinkWindow, PrefillAndAppendsGiveTheSameSplit) {
    idx_t n = 300;
    auto keys = gaussian(n, kD, 4);
    auto values = gaussian(n, kDv, 5);
    auto a = index_factory(kD, "Sink3,Window20,Flat", kDv);
    auto b = index_factory(kD, "Sink3,Window20,Flat", kDv);
    PrefillInput in;
    in.n_tokens = n;
    in.keys = keys.data();
    in.values = values.data();
    a->prefill(in);
    for (idx_t i = 0; i < n; i += 7) {
        idx_t m = std::min<idx_t>(7, n - i);
        b->add_kv(m, keys.data() + i * kD, values.data() + i * kDv);
    }
    auto* wa = dynamic_cast<IndexSinkWindow*>(a.get());
    auto* wb = dynamic_cast<IndexSinkWindow*>(b.get());
    EXPECT_EQ(wa->sink.keys, wb->sink.keys);
    // the same window tokens, in order (b's ring has turned: its slots differ)
    EXPECT_EQ(wa->window_head, 0);
    EXPECT_NE(wb->window_head, 0);
    ASSERT_EQ(wa->window.size(), 20);
    ASSERT_EQ(wb->window.size(), 20);
    std::vector<float> ka(kD), kb(kD), va(kDv), vb(kDv);
    for (idx_t j = 0; j < 20; j++) {
        wa->window.key(wa->window_slot(j), ka.data());
        wb->window.key(wb->window_slot(j), kb.data());
        wa->window.value(wa->window_slot(j), va.data());
        wb->window.value(wb->window_slot(j), vb.data());
        EXPECT_EQ(ka, kb) << j;
        EXPECT_EQ(va, vb) << j;
        EXPECT_TRUE(std::equal(ka.begin(), ka.end(), keys.begin() + (n - 20 + j) * kD)) << j;
    }
    EXPECT_EQ(wa->inner->ntotal, n - 23);
    EXPECT_EQ(wb->inner->ntotal, n - 23);
}

TEST(SinkWindow, TheRingTurnsThroughBatchesOfEverySize) {
    // batches that fill the window, wrap it mid-batch, and pass it whole
    // (more new tokens than the window holds): every answer is the exact
    // one, every token reconstructs, and a read index answers the same bits
    idx_t n = 696; // the batches below
    auto keys = gaussian(n, kD, 11, 1.0f, 0.3f);
    auto values = gaussian(n, kDv, 12);
    auto queries = gaussian(4, kD, 13, 2.0f);
    for (const char* s : {"Sink3,Window16,Flat", "Sink3,Window16,TopK(Flat)", "BF16,Window16,Flat"}) {
        SCOPED_TRACE(s);
        const bool bf16 = s[0] == 'B';
        auto index = index_factory(kD, s, kDv);
        auto* w = dynamic_cast<IndexSinkWindow*>(index.get());
        ASSERT_NE(w, nullptr);
        w->inner->k = 1 << 20; // TopK: every token, so exact
        std::vector<idx_t> heads;
        idx_t p = 0;
        for (idx_t batch : {2, 5, 9, 1, 15, 16, 17, 40, 3, 7, 11, 100, 1, 13, 250, 6, 200}) {
            batch = std::min(batch, n - p);
            index->add_kv(batch, keys.data() + p * kD, values.data() + p * kDv);
            p += batch;
            heads.push_back(w->window_head);
            expect_split_invariants(*w);
            for (idx_t i = 0; i < 4; i++) {
                const float* q = queries.data() + i * kD;
                std::vector<float> out(kDv);
                float lse;
                index->attend(1, q, out.data(), &lse);
                std::vector<double> ref;
                double ref_lse = kvtest::ref_attention_all(q, keys.data(), values.data(), kD, kDv, p, ref);
                const double tol = bf16 ? 2e-2 : 1e-5;
                ASSERT_NEAR(lse, ref_lse, tol * std::max(1.0, std::abs(ref_lse))) << "p=" << p;
                ASSERT_LT(kvtest::rel_max_err(out.data(), ref), tol) << "p=" << p;
                if (!bf16) { // the window's ids come back as positions
                    idx_t k = std::min<idx_t>(10, p);
                    std::vector<float> dis(k);
                    std::vector<idx_t> ids(k);
                    index->search(1, q, k, dis.data(), ids.data());
                    auto truth = kvtest::ref_topk(q, keys.data(), kD, p, k);
                    std::sort(ids.begin(), ids.end());
                    std::sort(truth.begin(), truth.end());
                    ASSERT_EQ(ids, truth) << "p=" << p;
                }
            }
        }
        ASSERT_EQ(p, n);
        // the ring has turned to several heads along the way
        std::sort(heads.begin(), heads.end());
        EXPECT_GE(std::unique(heads.begin(), heads.end()) - heads.begin(), 4);
        std::vector<float> k(kD), v(kDv), kr(kD);
        for (idx_t i = 0; i < n; i++) {
            index->reconstruct(i, k.data());
            index->reconstruct_value(i, v.data());
            for (int j = 0; j < kD; j++) {
                ASSERT_NEAR(k[j], keys[i * kD + j], bf16 ? 1e-2 * std::fabs(keys[i * kD + j]) : 0) << i;
            }
        }
        auto copy = clone_index(index.get());
        EXPECT_EQ(dynamic_cast<IndexSinkWindow&>(*copy).window_head, w->window_head);
        std::vector<float> a(4 * kDv), b(4 * kDv), la(4), lb(4);
        index->attend(4, queries.data(), a.data(), la.data());
        copy->attend(4, queries.data(), b.data(), lb.data());
        EXPECT_EQ(a, b);
        EXPECT_EQ(la, lb);
    }
}

TEST(SinkWindow, TopKInnerIsStaticPlusTopKOfTheMiddle) {
    idx_t n = 1000, nq = 10, k = 30;
    auto keys = gaussian(n, kD, 6, 1.0f, 0.2f);
    auto values = gaussian(n, kDv, 7);
    auto queries = gaussian(nq, kD, 8, 2.0f);
    auto index = index_factory(kD, "Sink4,Window64,TopK(Flat)", kDv);
    index->add_kv(n, keys.data(), values.data());
    SearchParametersKV params;
    params.k = k;
    std::vector<float> out(nq * kDv), lse(nq);
    index->attend(nq, queries.data(), out.data(), lse.data(), &params);
    std::vector<Selection> sel(nq);
    index->select(nq, queries.data(), sel.data(), &params);
    for (idx_t i = 0; i < nq; i++) {
        // reference set: sinks, window, and the exact top-k of the middle
        const float* q = queries.data() + i * kD;
        auto mid = kvtest::ref_topk(q, keys.data() + 4 * kD, kD, n - 68, k);
        std::vector<idx_t> ids;
        for (idx_t j = 0; j < 4; j++) {
            ids.push_back(j);
        }
        for (idx_t j : mid) {
            ids.push_back(j + 4);
        }
        for (idx_t j = n - 64; j < n; j++) {
            ids.push_back(j);
        }
        std::vector<double> ref;
        double ref_lse = kvtest::ref_attention(q, keys.data(), values.data(), kD, kDv, ids, nullptr, ref);
        EXPECT_NEAR(lse[i], ref_lse, 1e-5 * std::max(1.0, std::abs(ref_lse)));
        EXPECT_LT(kvtest::rel_max_err(out.data() + i * kDv, ref), 1e-5);
        // select reports the same set, each id once, every id in range
        std::set<idx_t> got(sel[i].ids.begin(), sel[i].ids.end());
        EXPECT_EQ(got.size(), sel[i].size());
        EXPECT_EQ(got, std::set<idx_t>(ids.begin(), ids.end()));
    }
    // search with an exact inner index is the exact top-k of everything
    std::vector<float> dis(nq * k);
    std::vector<idx_t> lab(nq * k);
    index->search(nq, queries.data(), k, dis.data(), lab.data());
    for (idx_t i = 0; i < nq; i++) {
        auto ref = kvtest::ref_topk(queries.data() + i * kD, keys.data(), kD, n, k);
        EXPECT_EQ(std::set<idx_t>(lab.begin() + i * k, lab.begin() + (i + 1) * k),
                  std::set<idx_t>(ref.begin(), ref.end()));
    }
}

TEST(SinkWindow, FewerTokensThanTheStaticPart) {
    auto keys = gaussian(3, kD, 9);
    auto values = gaussian(3, kDv, 10);
    auto q = gaussian(1, kD, 11);
    auto index = index_factory(kD, "Sink4,Window64,TopK(IVF16,Flat)", kDv);
    index->add_kv(3, keys.data(), values.data());
    std::vector<float> out(kDv);
    float lse;
    index->attend(1, q.data(), out.data(), &lse);
    std::vector<double> ref;
    double ref_lse = kvtest::ref_attention_all(q.data(), keys.data(), values.data(), kD, kDv, 3, ref);
    EXPECT_NEAR(lse, ref_lse, 1e-5);
    EXPECT_LT(kvtest::rel_max_err(out.data(), ref), 1e-5);
    // search pads like Faiss when k exceeds the tokens
    std::vector<float> dis(5);
    std::vector<idx_t> lab(5);
    index->search(1, q.data(), 5, dis.data(), lab.data());
    EXPECT_EQ(lab[3], -1);
    EXPECT_EQ(lab[4], -1);
}

}  // namespace test_sink_window
