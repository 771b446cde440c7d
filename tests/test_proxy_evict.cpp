// IndexProxyEvict: NaCl's one-shot eviction and the policies it generalises.

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/IndexKVFlat.h>
#include <kvindex/IndexProxyEvict.h>
#include <kvindex/KVCache.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>

#include "expect_throw.h"
#include "reference.h"

using namespace kvindex;
using kvtest::gaussian;

namespace {

constexpr int kD = 16;

/// A prompt of n tokens with a query at every position (n_heads heads).
struct Prompt {
    idx_t n;
    int n_heads;
    std::vector<float> keys, values, queries;
    Prompt(idx_t n, int n_heads, uint64_t seed, float q_scale = 1.5f)
            : n(n), n_heads(n_heads),
              keys(gaussian(n, kD, seed)),
              values(gaussian(n, kD, seed + 1)),
              queries(gaussian(n_heads * n, kD, seed + 2, q_scale)) {}
    PrefillInput input() const {
        PrefillInput in;
        in.n_tokens = n;
        in.keys = keys.data();
        in.values = values.data();
        in.n_queries = n;
        in.n_query_heads = n_heads;
        in.queries = queries.data();
        return in;
    }
};

std::unique_ptr<IndexProxyEvict> evict(const std::string& s) {
    auto index = index_factory(kD, s);
    auto* e = dynamic_cast<IndexProxyEvict*>(index.get());
    EXPECT_TRUE(e) << s;
    index.release();
    return std::unique_ptr<IndexProxyEvict>(e);
}

/// Brute-force scores in double: sum over heads and the given queries of
/// softmax over keys (causal: keys at positions <= the query's).
std::vector<double> ref_scores(const Prompt& p, const std::vector<idx_t>& qs, bool causal) {
    std::vector<double> F(p.n, 0.0);
    for (int h = 0; h < p.n_heads; h++) {
        for (idx_t qi : qs) {
            idx_t m = causal ? qi + 1 : p.n;
            const float* q = p.queries.data() + (size_t(h) * p.n + qi) * kD;
            std::vector<double> s(m);
            double mx = -INFINITY, z = 0;
            for (idx_t j = 0; j < m; j++) {
                s[j] = 0;
                for (int c = 0; c < kD; c++) {
                    s[j] += double(q[c]) * p.keys[j * kD + c];
                }
                s[j] /= std::sqrt(double(kD));
                mx = std::max(mx, s[j]);
            }
            for (idx_t j = 0; j < m; j++) {
                z += std::exp(s[j] - mx);
            }
            for (idx_t j = 0; j < m; j++) {
                F[j] += std::exp(s[j] - mx) / z;
            }
        }
    }
    return F;
}

/// Indices of the k largest scores among `cand` (ties to the earlier).
std::vector<idx_t> top_of(const std::vector<double>& F, std::vector<idx_t> cand, idx_t k) {
    std::stable_sort(cand.begin(), cand.end(), [&](idx_t a, idx_t b) { return F[a] > F[b]; });
    cand.resize(k);
    std::sort(cand.begin(), cand.end());
    return cand;
}

} // namespace

TEST(ProxyEvict, ScoresMatchBruteForce) {
    Prompt p(60, 2, 1);
    std::vector<idx_t> qs = {5, 17, 40, 59};
    for (bool causal : {false, true}) {
        std::vector<float> q(2 * qs.size() * kD);
        for (int h = 0; h < 2; h++) {
            for (size_t i = 0; i < qs.size(); i++) {
                std::copy_n(p.queries.data() + (h * p.n + qs[i]) * kD, kD, q.data() + (h * qs.size() + i) * kD);
            }
        }
        std::vector<double> F(p.n);
        proxy_scores(p.keys.data(), p.n, kD, q.data(), 2, idx_t(qs.size()), qs.data(), 0, causal, F.data());
        auto ref = ref_scores(p, qs, causal);
        for (idx_t j = 0; j < p.n; j++) {
            EXPECT_NEAR(F[j], ref[j], 1e-5) << "causal=" << causal << " j=" << j;
        }
    }
}

TEST(ProxyEvict, BudgetArithmeticIsExact) {
    for (const char* s : {"ProxyEvict1", "ProxyEvict10", "ProxyEvict20", "ProxyEvict30", "ProxyEvict50",
                          "ProxyEvict100", "ProxyEvict20_H2O", "ProxyEvict20_TOVA",
                          "ProxyEvict20_StreamingLLM", "ProxyEvict20_Random"}) {
        auto e = evict(s);
        for (idx_t n = 1; n <= 400; n++) {
            EvictBudget b = e->budget_for(n);
            idx_t expected = std::max<idx_t>(1, std::min<idx_t>(n, std::llround(e->keep_percent / 100 * n)));
            ASSERT_EQ(b.n_keep, expected) << s << " n=" << n;
            ASSERT_EQ(b.n_sink + b.n_recent + b.n_top + b.n_random, b.n_keep) << s << " n=" << n;
            ASSERT_TRUE(b.n_sink >= 0 && b.n_recent >= 0 && b.n_top >= 0 && b.n_random >= 0);
            ASSERT_LE(b.n_proxy, n);
        }
        e->budget_tokens = 7; // an absolute budget, clamped to the prompt
        EXPECT_EQ(e->budget_for(5).n_keep, 5);
        EXPECT_EQ(e->budget_for(500).n_keep, 7);
    }
}

TEST(ProxyEvict, KeptSetHasExactlyTheBudgetAndTheProtectedTokens) {
    for (const char* s : {"ProxyEvict10", "ProxyEvict20", "ProxyEvict30", "ProxyEvict20_H2O",
                          "ProxyEvict20_TOVA", "ProxyEvict20_StreamingLLM", "ProxyEvict20_Random"}) {
        auto e = evict(s);
        for (idx_t n : {1, 2, 3, 7, 20, 99, 300}) {
            Prompt p(n, 2, 100 + n);
            auto kept = e->choose_kept(p.input());
            EvictBudget b = e->budget_for(n);
            ASSERT_EQ(idx_t(kept.size()), b.n_keep) << s << " n=" << n;
            ASSERT_TRUE(std::is_sorted(kept.begin(), kept.end()));
            ASSERT_EQ(std::set<idx_t>(kept.begin(), kept.end()).size(), kept.size());
            ASSERT_TRUE(kept.front() >= 0 && kept.back() < n);
            std::set<idx_t> k(kept.begin(), kept.end());
            for (idx_t j = 0; j < b.n_sink; j++) {
                ASSERT_TRUE(k.count(j)) << s << " sink " << j;
            }
            for (idx_t j = n - b.n_recent; j < n; j++) {
                ASSERT_TRUE(k.count(j)) << s << " recent " << j;
            }
        }
    }
}

TEST(ProxyEvict, NaClIsProtectedPlusTopPlusDisjointRandom) {
    Prompt p(500, 2, 3);
    auto e = evict("ProxyEvict20");
    EvictBudget b = e->budget_for(p.n);
    ASSERT_GT(b.n_top, 0);
    ASSERT_GT(b.n_random, 0);
    auto kept = e->choose_kept(p.input());
    std::vector<idx_t> proxies;
    for (idx_t i = p.n - b.n_proxy; i < p.n; i++) {
        proxies.push_back(i);
    }
    auto F = ref_scores(p, proxies, /*causal=*/false);
    std::set<idx_t> prot;
    std::vector<idx_t> cand;
    for (idx_t j = 0; j < p.n; j++) {
        if (j < b.n_sink || j >= p.n - b.n_recent) {
            prot.insert(j);
        } else {
            cand.push_back(j);
        }
    }
    auto top = top_of(F, cand, b.n_top);
    std::set<idx_t> top_set(top.begin(), top.end()), k(kept.begin(), kept.end());
    for (idx_t j : top) {
        EXPECT_TRUE(k.count(j)) << "top token " << j;
    }
    idx_t n_random = 0;
    for (idx_t j : kept) {
        if (!prot.count(j) && !top_set.count(j)) {
            n_random++; // inside the candidate range, outside the top part
            EXPECT_TRUE(j >= b.n_sink && j < p.n - b.n_recent);
        }
    }
    EXPECT_EQ(n_random, b.n_random);
}

TEST(ProxyEvict, RandomPartFollowsSoftmaxOfScores) {
    // one random token from 20 candidates: its law must be softmax(F)
    Prompt p(20, 1, 4, 3.0f);
    auto e = evict("ProxyEvict20");
    e->budget_tokens = 1;
    e->protect_percent = 0;
    e->proxy_keep_percent = 0;
    e->proxy_window_percent = 25; // the last 5 positions score
    EvictBudget b = e->budget_for(p.n);
    ASSERT_EQ(b.n_random, 1);
    std::vector<idx_t> proxies = {15, 16, 17, 18, 19};
    auto F = ref_scores(p, proxies, false);
    double mx = *std::max_element(F.begin(), F.end()), z = 0;
    std::vector<double> prob(p.n);
    for (idx_t j = 0; j < p.n; j++) {
        z += prob[j] = std::exp(F[j] - mx);
    }
    std::vector<double> count(p.n, 0.0);
    int trials = 20000;
    for (int t = 0; t < trials; t++) {
        e->stream = t;
        count[e->choose_kept(p.input())[0]] += 1;
    }
    // chi-square over bins with expected >= 5 (the rest pooled)
    double chi2 = 0, pooled_e = 0, pooled_o = 0;
    int bins = 0;
    for (idx_t j = 0; j < p.n; j++) {
        double expct = trials * prob[j] / z;
        if (expct >= 5) {
            chi2 += (count[j] - expct) * (count[j] - expct) / expct;
            bins++;
        } else {
            pooled_e += expct;
            pooled_o += count[j];
        }
    }
    if (pooled_e > 0) {
        chi2 += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e;
        bins++;
    }
    ASSERT_GE(bins, 5);
    // 99.9% quantile of chi-square with <= 19 degrees of freedom is 43.8
    EXPECT_LT(chi2, 43.8) << bins << " bins";
}

TEST(ProxyEvict, SeedsAndStreams) {
    Prompt p(400, 2, 5);
    auto a = evict("ProxyEvict20"), b = evict("ProxyEvict20");
    EXPECT_EQ(a->choose_kept(p.input()), b->choose_kept(p.input()));
    b->stream = 1;
    EXPECT_NE(a->choose_kept(p.input()), b->choose_kept(p.input()));
    // KVCache gives each (layer, head) its own stream: same keys, other draws
    KVCache cache(1, 2, 2, kD, kD, "ProxyEvict20");
    std::vector<float> keys(2 * p.n * kD), values(2 * p.n * kD);
    for (int h = 0; h < 2; h++) {
        std::copy(p.keys.begin(), p.keys.end(), keys.begin() + h * p.n * kD);
        std::copy(p.values.begin(), p.values.end(), values.begin() + h * p.n * kD);
    }
    std::vector<float> q(2 * p.n * kD);
    std::copy_n(p.queries.begin(), p.n * kD, q.begin());
    std::copy_n(p.queries.begin(), p.n * kD, q.begin() + p.n * kD);
    cache.prefill(0, p.n, keys.data(), values.data(), p.n, q.data(), nullptr, RopeParams{});
    auto* e0 = dynamic_cast<IndexProxyEvict*>(cache.index(0, 0));
    auto* e1 = dynamic_cast<IndexProxyEvict*>(cache.index(0, 1));
    EXPECT_NE(e0->positions, e1->positions);
}

TEST(ProxyEvict, H2OAndTOVAScores) {
    Prompt p(120, 2, 6);
    // H2O: recent half + top by causal scores of every prompt query
    auto h2o = evict("ProxyEvict20_H2O");
    EvictBudget b = h2o->budget_for(p.n);
    std::vector<idx_t> all(p.n);
    std::iota(all.begin(), all.end(), 0);
    auto F = ref_scores(p, all, /*causal=*/true);
    std::vector<idx_t> cand(all.begin(), all.end() - b.n_recent);
    auto expected = top_of(F, cand, b.n_top);
    for (idx_t j = p.n - b.n_recent; j < p.n; j++) {
        expected.push_back(j);
    }
    EXPECT_EQ(h2o->choose_kept(p.input()), expected);
    // TOVA: top by the last query's attention
    auto tova = evict("ProxyEvict20_TOVA");
    auto Fl = ref_scores(p, {p.n - 1}, false);
    EXPECT_EQ(tova->choose_kept(p.input()), top_of(Fl, all, tova->budget_for(p.n).n_keep));
}

TEST(ProxyEvict, NeedleKeptByNaClDroppedByH2OAndTOVA) {
    // 1000 tokens. 60 "heavy" tokens (100..159) share key direction e1 and
    // every early query (160..959) attends them; a needle (500) has key e0
    // and only the question (the last 40 positions) attends it, with ~20% of
    // its mass; the last query looks at recent tokens (e2) instead.
    idx_t n = 1000;
    std::vector<float> keys = gaussian(n, kD, 7, 0.05f), values = gaussian(n, kD, 8);
    std::vector<float> queries = gaussian(n, kD, 9, 0.05f);
    float s = std::sqrt(float(kD));
    for (idx_t j = 100; j < 160; j++) {
        keys[j * kD + 1] = 1.0f;
    }
    keys[500 * kD + 0] = 1.0f;
    for (idx_t j = 950; j < n; j++) {
        keys[j * kD + 2] = 1.0f;
    }
    for (idx_t p = 160; p < 960; p++) {
        queries[p * kD + 1] = 12.0f * s;
    }
    for (idx_t p = 960; p < n - 1; p++) {
        queries[p * kD + 0] = std::log(0.25f * 999 / 0.75f) * s; // ~25% on the needle
    }
    queries[(n - 1) * kD + 2] = 12.0f * s;
    PrefillInput in;
    in.n_tokens = n;
    in.keys = keys.data();
    in.values = values.data();
    in.n_queries = n;
    in.queries = queries.data();
    auto kept = [&](const char* s) {
        auto e = evict(s);
        auto k = e->choose_kept(in);
        return std::binary_search(k.begin(), k.end(), idx_t(500));
    };
    EXPECT_TRUE(kept("ProxyEvict10"));
    EXPECT_FALSE(kept("ProxyEvict10_H2O"));
    EXPECT_FALSE(kept("ProxyEvict10_TOVA"));
}

TEST(ProxyEvict, FullBudgetIsExactAndAppendsAreKept) {
    Prompt p(200, 1, 10);
    for (const char* s : {"ProxyEvict100", "ProxyEvict20"}) {
        auto e = evict(s);
        if (std::string(s) == "ProxyEvict20") {
            e->budget_tokens = 1000; // beyond the prompt: everything
        }
        e->prefill(p.input());
        EXPECT_EQ(e->inner->ntotal, p.n);
        auto extra_k = gaussian(10, kD, 11), extra_v = gaussian(10, kD, 12);
        e->add_kv(10, extra_k.data(), extra_v.data());
        std::vector<float> all_k(p.keys), all_v(p.values);
        all_k.insert(all_k.end(), extra_k.begin(), extra_k.end());
        all_v.insert(all_v.end(), extra_v.begin(), extra_v.end());
        auto q = gaussian(3, kD, 13, 2.0f);
        std::vector<float> out(3 * kD), lse(3);
        e->attend(3, q.data(), out.data(), lse.data());
        for (int i = 0; i < 3; i++) {
            std::vector<double> ref;
            double rl = kvtest::ref_attention_all(q.data() + i * kD, all_k.data(), all_v.data(), kD, kD, p.n + 10, ref);
            EXPECT_NEAR(lse[i], rl, 1e-5);
            EXPECT_LT(kvtest::rel_max_err(out.data() + i * kD, ref), 1e-5);
        }
    }
    // with eviction, appended tokens stay and evicted ones are gone
    auto e = evict("ProxyEvict20");
    e->prefill(p.input());
    auto k1 = gaussian(5, kD, 14), v1 = gaussian(5, kD, 15);
    e->add_kv(5, k1.data(), v1.data());
    EXPECT_EQ(e->ntotal, p.n + 5);
    EXPECT_EQ(e->inner->ntotal, 40 + 5);
    for (idx_t j = p.n; j < p.n + 5; j++) {
        EXPECT_TRUE(std::binary_search(e->positions.begin(), e->positions.end(), j));
    }
    idx_t evicted = -1;
    for (idx_t j = 0; j < p.n && evicted < 0; j++) {
        if (!std::binary_search(e->positions.begin(), e->positions.end(), j)) {
            evicted = j;
        }
    }
    std::vector<float> buf(kD);
    EXPECT_THROW_MSG(e->reconstruct(evicted, buf.data()), "evicted");
    e->reconstruct(e->positions[3], buf.data());
    EXPECT_TRUE(std::equal(buf.begin(), buf.end(), p.keys.begin() + e->positions[3] * kD));
    // memory holds the kept tokens only
    IndexKVFlat flat(kD, kD);
    flat.add_kv(p.n, p.keys.data(), p.values.data());
    EXPECT_LT(double(e->memory_bytes()), 0.35 * flat.memory_bytes());
}

TEST(ProxyEvict, NeedsQueriesToScore) {
    Prompt p(50, 1, 16);
    PrefillInput in = p.input();
    in.n_queries = 0;
    EXPECT_THROW_MSG(evict("ProxyEvict20")->prefill(in), "no queries");
    EXPECT_NO_THROW(evict("ProxyEvict20_StreamingLLM")->prefill(in));
}

TEST(ProxyEvict, FactoryAndIoRoundTrip) {
    Prompt p(300, 2, 17);
    for (const char* s : {"ProxyEvict20", "ProxyEvict10_H2O", "ProxyEvict30_TOVA",
                          "ProxyEvict20_StreamingLLM", "ProxyEvict5_Random", "ProxyEvict20,TopK(Flat)",
                          "ProxyEvict20,Sink4,Window16,TopK(IVF4,Flat)", "Sink4,ProxyEvict50"}) {
        SCOPED_TRACE(s);
        auto index = index_factory(kD, s);
        EXPECT_EQ(index_factory_string(index.get()), s);
        set_index_parameters(index.get(), "k=9");
        index->prefill(p.input());
        auto extra_k = gaussian(3, kD, 18), extra_v = gaussian(3, kD, 19);
        index->add_kv(3, extra_k.data(), extra_v.data());
        std::vector<uint8_t> buf;
        write_index(index.get(), &buf);
        auto copy = read_index(buf);
        EXPECT_EQ(index_factory_string(copy.get()), s);
        auto q = gaussian(4, kD, 20);
        std::vector<float> o1(4 * kD), o2(4 * kD), l1(4), l2(4), d1(20), d2(20);
        std::vector<idx_t> i1(20), i2(20);
        index->attend(4, q.data(), o1.data(), l1.data());
        copy->attend(4, q.data(), o2.data(), l2.data());
        index->search(4, q.data(), 5, d1.data(), i1.data());
        copy->search(4, q.data(), 5, d2.data(), i2.data());
        EXPECT_EQ(o1, o2);
        EXPECT_EQ(l1, l2);
        EXPECT_EQ(i1, i2);
        EXPECT_EQ(d1, d2);
        // every truncation is refused
        for (size_t len = 0; len < buf.size(); len += 97) {
            EXPECT_THROW(read_index(buf.data(), len), faiss::FaissException);
        }
    }
    EXPECT_THROW_MSG(index_factory(kD, "ProxyEvict20_LRU"), "ProxyEvict20_LRU");
    EXPECT_THROW_MSG(index_factory(kD, "ProxyEvict0"), "ProxyEvict");
    auto e = index_factory(kD, "ProxyEvict20");
    set_index_parameters(e.get(), "budget=64,protect=1,proxy_keep=12,proxy_window=1,n_sink=2");
    auto* pe = dynamic_cast<IndexProxyEvict*>(e.get());
    EXPECT_EQ(pe->budget_for(1000).n_keep, 64);
    EXPECT_THROW_MSG(set_index_parameters(e.get(), "protect=150"), "protect");
    // a split beyond the budget is refused when it is used (prefill)
    set_index_parameters(e.get(), "protect=15,proxy_keep=15");
    EXPECT_THROW_MSG(pe->budget_for(1000), "exceed");
}
