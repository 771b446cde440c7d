// IndexProxyEvict: NaCl's one-shot eviction and the policies it generalises.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <numeric>
#include <set>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/IndexKVFlat.h>
#include <kvindex/IndexProxyEvict.h>
#include <kvindex/KVCache.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>

#include "expect_throw.h"
#include "forge.h"
#include "reference.h"

namespace test_proxy_evict {

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

TEST(ProxyEvict, PrintedPercentRebuildsTheSameBudget) {
    // canonical strings print as given; any percent, from the string or the
    // constructor, prints as a decimal that reads back to the same double
    for (const char* s : {"ProxyEvict0.00001", "ProxyEvict0.000001", "ProxyEvict12.34567",
                          "ProxyEvict99.99999", "ProxyEvict0.5_H2O", "Choose(Flat;ProxyEvict0.00001)"}) {
        SCOPED_TRACE(s);
        EXPECT_EQ(index_factory_string(index_factory(kD, s).get()), s);
    }
    EXPECT_EQ(index_factory_string(index_factory(kD, "ProxyEvict20.50").get()), "ProxyEvict20.5");
    for (double pct : {1.0 / 3, 100.0 / 7, 1e-6, 2.5e-5, 99.999999999, 100.0}) {
        SCOPED_TRACE(pct);
        IndexProxyEvict e(EvictPolicy::tova, pct, std::make_unique<IndexKVFlat>(kD));
        const std::string s = index_factory_string(&e);
        EXPECT_EQ(s.find('e', 10), std::string::npos) << s; // no exponent
        auto back = index_factory(kD, s);
        EXPECT_EQ(dynamic_cast<IndexProxyEvict*>(back.get())->keep_percent, pct) << s;
        EXPECT_EQ(index_factory_string(back.get()), s);
    }
    // what is not a plain decimal and a policy name is refused, never half read
    for (const char* bad : {"ProxyEvict20.5.7", "ProxyEvict20_", "ProxyEvict.", "ProxyEvict.5",
                            "ProxyEvict5.", "ProxyEvict1e-05", "ProxyEvict20_NaCl", "ProxyEvict-5"}) {
        SCOPED_TRACE(bad);
        EXPECT_THROW_MSG(index_factory(kD, bad), bad);
    }
    EXPECT_THROW_MSG(index_factory(kD, "ProxyEvict0.0000001"), "[1e-6, 100]");
    EXPECT_THROW_MSG(IndexProxyEvict(EvictPolicy::nacl, 1e-7, std::make_unique<IndexKVFlat>(kD)),
                     "[1e-6, 100]");
}

TEST(ProxyEvict, RefusesAnInnerThatReadsPositionsFromRows) {
    // the kept tokens reach the inner index as consecutive rows: IVFAsym
    // would de-RoPE them at the wrong positions
    for (const char* s : {"ProxyEvict20,IVFAsym4", "ProxyEvict50_Random,Sink2,Window8,IVFAsym4_Centroid",
                          "ProxyEvict20,Choose(Flat;IVFAsym4_Moment)"}) {
        SCOPED_TRACE(s);
        EXPECT_THROW_MSG(index_factory(kD, s), "cannot follow eviction");
    }
    EXPECT_NO_THROW(index_factory(kD, "ProxyEvict20,Sink2,Window8,RoarGraph8"));
}

TEST(ProxyEvict, DefaultKnobValuesCanBeSetBack) {
    // the values get_parameter reports for "not set" are accepted by set, so
    // that a budget or split once set can be taken back before prefill
    auto e = index_factory(kD, "ProxyEvict20");
    auto* pe = dynamic_cast<IndexProxyEvict*>(e.get());
    const EvictBudget table4 = pe->budget_for(1000);
    set_index_parameters(e.get(), "budget=64,protect=1,proxy_keep=12,proxy_window=1");
    EXPECT_EQ(pe->budget_for(1000).n_keep, 64);
    for (const char* name : {"budget", "protect", "proxy_keep", "proxy_window"}) {
        set_index_parameter(e.get(), name, name == std::string("budget") ? 0 : -1);
    }
    const EvictBudget back = pe->budget_for(1000);
    EXPECT_EQ(back.n_keep, table4.n_keep);
    EXPECT_EQ(back.n_top, table4.n_top);
    EXPECT_EQ(back.n_random, table4.n_random);
    EXPECT_EQ(back.n_proxy, table4.n_proxy);
    EXPECT_THROW_MSG(set_index_parameters(e.get(), "protect=-2"), "protect=-2");
    EXPECT_THROW_MSG(set_index_parameters(e.get(), "budget=-1"), "budget=-1");
    auto h = index_factory(kD, "Hybrid(TopK(Flat),Uniform)|sample=40");
    set_index_parameters(h.get(), "sample=-1");
    EXPECT_EQ(get_index_parameter(h.get(), "sample"), -1.0);
    EXPECT_THROW_MSG(set_index_parameters(h.get(), "sample=-2"), "sample=-2");
}

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
        if (index->reads_search_knob("k")) { // a TopK inner index
            set_index_parameters(index.get(), "k=9");
        }
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

// ---- proxy_tokens: NaCl's proxy window given in tokens (the question) ----

namespace {

/// The last t prompt positions of p, clamped to the prompt.
std::vector<idx_t> last_positions(idx_t n, idx_t t) {
    std::vector<idx_t> qs;
    for (idx_t i = n - std::min(t, n); i < n; i++) {
        qs.push_back(i);
    }
    return qs;
}

/// ref_scores over the keys [k0, k1) only (the part of the prompt an index
/// under a Sink/Window wrapper is given), non-causal, in double.
std::vector<double> ref_scores_range(const Prompt& p, const std::vector<idx_t>& qs, idx_t k0, idx_t k1) {
    std::vector<double> F(k1 - k0, 0.0);
    for (int h = 0; h < p.n_heads; h++) {
        for (idx_t qi : qs) {
            const float* q = p.queries.data() + (size_t(h) * p.n + qi) * kD;
            std::vector<double> s(k1 - k0);
            double mx = -INFINITY, z = 0;
            for (idx_t j = k0; j < k1; j++) {
                double dot = 0;
                for (int c = 0; c < kD; c++) {
                    dot += double(q[c]) * p.keys[j * kD + c];
                }
                s[j - k0] = dot / std::sqrt(double(kD));
                mx = std::max(mx, s[j - k0]);
            }
            for (double v : s) {
                z += std::exp(v - mx);
            }
            for (size_t j = 0; j < s.size(); j++) {
                F[j] += std::exp(s[j] - mx) / z;
            }
        }
    }
    return F;
}

std::vector<idx_t> iota_ids(idx_t n) {
    std::vector<idx_t> v(n);
    std::iota(v.begin(), v.end(), 0);
    return v;
}

/// Position of the 8 bytes of `value` in buf; fails unless there is exactly one.
size_t find_unique_i64(const std::vector<uint8_t>& buf, int64_t value) {
    size_t at = std::string::npos, count = 0;
    for (size_t i = 0; i + 8 <= buf.size(); i++) {
        if (std::memcmp(buf.data() + i, &value, 8) == 0) {
            at = i;
            count++;
        }
    }
    EXPECT_EQ(count, 1u) << "sentinel " << value << " found " << count << " times";
    return at;
}

} // namespace

TEST(ProxyEvictTokens, ScoresAreThoseOfExactlyTheLastTQueries) {
    // Top-only split (protect 0, proxy-keep = the whole budget): the kept set
    // is the top-B by the scores, for several B, so it pins the order of the
    // scores. GQA: 3 query heads, summed.
    Prompt p(300, 3, 21);
    for (idx_t t : {1, 5, 32, 299, 300, 1000}) {
        auto qs = last_positions(p.n, t);
        auto F = ref_scores(p, qs, /*causal=*/false);
        // the comparison can tell the window from one a query longer or
        // shorter (a long window barely moves with one more query: skipped)
        if (t <= 32) {
            for (idx_t other : {t - 1, t + 1}) {
                if (other < 1) {
                    continue;
                }
                auto F_other = ref_scores(p, last_positions(p.n, other), false);
                bool differs = false;
                for (idx_t B : {1, 10, 30, 60, 150}) {
                    differs = differs || top_of(F, iota_ids(p.n), B) != top_of(F_other, iota_ids(p.n), B);
                }
                EXPECT_TRUE(differs) << "t=" << t << " vs " << other;
            }
        }
        for (idx_t B : {1, 10, 30, 60, 150}) {
            SCOPED_TRACE("t=" + std::to_string(t) + " B=" + std::to_string(B));
            auto e = evict("ProxyEvict20");
            set_index_parameters(e.get(), "protect=0,proxy_keep=20,proxy_tokens=" + std::to_string(t) +
                                                  ",budget=" + std::to_string(B));
            EvictBudget b = e->budget_for(p.n);
            ASSERT_EQ(b.n_top, B);
            ASSERT_EQ(b.n_proxy, std::min<idx_t>(t, p.n));
            EXPECT_EQ(e->choose_kept(p.input()), top_of(F, iota_ids(p.n), B));
        }
    }
    // the default split too: protected ∪ top by the question's scores ∪ a
    // random part disjoint from both
    auto e = evict("ProxyEvict20");
    set_index_parameters(e.get(), "proxy_tokens=16");
    EvictBudget b = e->budget_for(p.n);
    ASSERT_GT(b.n_top, 0);
    ASSERT_GT(b.n_random, 0);
    auto F = ref_scores(p, last_positions(p.n, 16), false);
    std::vector<idx_t> cand;
    for (idx_t j = b.n_sink; j < p.n - b.n_recent; j++) {
        cand.push_back(j);
    }
    auto top = top_of(F, cand, b.n_top);
    auto kept = e->choose_kept(p.input());
    std::set<idx_t> k(kept.begin(), kept.end());
    for (idx_t j : top) {
        EXPECT_TRUE(k.count(j)) << "top token " << j;
    }
    EXPECT_EQ(idx_t(kept.size()), b.n_keep);
}

TEST(ProxyEvictTokens, QueriesGivenWithPositionsAndPartly) {
    // the caller passes only the last 64 queries, with explicit positions:
    // the window still means positions, not the last entries of the array
    Prompt p(200, 2, 22);
    idx_t nq = 64, t = 24;
    std::vector<float> q(2 * nq * kD);
    std::vector<idx_t> pos(nq);
    for (idx_t i = 0; i < nq; i++) {
        pos[i] = p.n - nq + i;
        for (int h = 0; h < 2; h++) {
            std::copy_n(p.queries.data() + (h * p.n + pos[i]) * kD, kD, q.data() + (h * nq + i) * kD);
        }
    }
    PrefillInput in = p.input();
    in.n_queries = nq;
    in.queries = q.data();
    in.query_positions = pos.data();
    auto e = evict("ProxyEvict20|protect=0,proxy_keep=20,proxy_tokens=24");
    auto F = ref_scores(p, last_positions(p.n, t), false);
    EXPECT_EQ(e->choose_kept(in), top_of(F, iota_ids(p.n), e->budget_for(p.n).n_keep));
    in.query_positions = nullptr; // the same: nullptr = the last n_queries positions
    EXPECT_EQ(e->choose_kept(in), top_of(F, iota_ids(p.n), e->budget_for(p.n).n_keep));
    // no query in the window: refused, naming the positions
    in.n_queries = 1;
    in.queries = p.queries.data() + 5 * kD; // head 0, any vector
    pos[0] = 10;
    in.query_positions = pos.data();
    EXPECT_THROW_MSG(e->choose_kept(in), "no queries at positions [176, 200)");
}

TEST(ProxyEvictTokens, UnderAWindowTheQuestionInTheWindowScores) {
    // Sink4,Window32 hands ProxyEvict the middle [4, 268) and n_after = 32:
    // the last t = 20 positions of the prompt (the question, in the window)
    // score the middle's keys
    Prompt p(300, 2, 23);
    auto index = index_factory(kD, "Sink4,Window32,ProxyEvict20|protect=0,proxy_keep=20,proxy_tokens=20");
    index->prefill(p.input());
    auto* e = dynamic_cast<const IndexProxyEvict*>(index->children()[0]);
    ASSERT_TRUE(e);
    ASSERT_EQ(e->ntotal, 264);
    auto F = ref_scores_range(p, last_positions(p.n, 20), 4, 268);
    EXPECT_EQ(e->positions, top_of(F, iota_ids(264), e->budget_for(264).n_keep));
}

TEST(ProxyEvictTokens, UnderAWindowTOVAAndH2OScoreWithThePromptsQueries) {
    // TOVA scored with the middle's last query (position 267), not the
    // prompt's (299, in the window), and refused a prefill given only the
    // prompt's last query; H2O left the window's queries out
    Prompt p(300, 2, 27);
    const idx_t n_mid = 264; // [4, 268)
    {
        auto index = index_factory(kD, "Sink4,Window32,ProxyEvict20_TOVA");
        index->prefill(p.input());
        auto* e = dynamic_cast<const IndexProxyEvict*>(index->children()[0]);
        ASSERT_TRUE(e);
        auto F = ref_scores_range(p, {299}, 4, 268);
        EXPECT_EQ(e->positions, top_of(F, iota_ids(n_mid), e->budget_for(n_mid).n_keep));
        // the last query alone, as TOVA needs
        std::vector<float> last(size_t(p.n_heads) * kD);
        for (int h = 0; h < p.n_heads; h++) {
            std::copy_n(p.queries.data() + (size_t(h) * p.n + 299) * kD, kD, last.data() + h * kD);
        }
        PrefillInput in = p.input();
        in.n_queries = 1;
        in.queries = last.data();
        auto alone = index_factory(kD, "Sink4,Window32,ProxyEvict20_TOVA");
        alone->prefill(in);
        EXPECT_EQ(dynamic_cast<const IndexProxyEvict*>(alone->children()[0])->positions, e->positions);
    }
    {
        auto index = index_factory(kD, "Sink4,Window32,ProxyEvict20_H2O");
        index->prefill(p.input());
        auto* e = dynamic_cast<const IndexProxyEvict*>(index->children()[0]);
        ASSERT_TRUE(e);
        // causal, over the middle's keys: query q sees [4, min(268, q + 1))
        std::vector<double> F(n_mid, 0.0);
        for (idx_t q = 4; q < p.n; q++) {
            std::vector<double> part = ref_scores_range(p, {q}, 4, std::min<idx_t>(268, q + 1));
            for (size_t j = 0; j < part.size(); j++) {
                F[j] += part[j];
            }
        }
        EvictBudget b = e->budget_for(n_mid);
        std::vector<idx_t> older(n_mid - b.n_recent), expected;
        std::iota(older.begin(), older.end(), 0);
        expected = top_of(F, older, b.n_top);
        for (idx_t j = n_mid - b.n_recent; j < n_mid; j++) {
            expected.push_back(j);
        }
        std::sort(expected.begin(), expected.end());
        EXPECT_EQ(e->positions, expected);
    }
}

TEST(ProxyEvictTokens, NeedleOfTheQuestionKeptThatThePercentWindowDrops) {
    // 1000 tokens, 20% budget, the default 20% proxy window: positions
    // [800, 1000). 180 distractors (100..279, key e1) take nearly all the
    // attention of the window's first 168 queries (800..967), 168/180 = 0.93
    // each; the question (the last 32 positions) puts 1.5% of each query's
    // mass on the needle (500, key e0): 0.48 in both windows. With a top-only
    // split (protect 2% = 4 sinks + 16 recent, proxy-keep 18% = 180) the
    // percent window's top 180 are the distractors, and the needle is the
    // first of the question's (the others get ~0.03).
    idx_t n = 1000, n_dis = 180, needle = 500, t = 32;
    std::vector<float> keys = gaussian(n, kD, 24, 0.05f), values = gaussian(n, kD, 25);
    std::vector<float> queries = gaussian(n, kD, 26, 0.05f);
    float s = std::sqrt(float(kD));
    for (idx_t j = 100; j < 100 + n_dis; j++) {
        keys[j * kD + 1] = 1.0f;
    }
    keys[needle * kD + 0] = 1.0f;
    for (idx_t p = 800; p < n - t; p++) {
        queries[p * kD + 1] = 12.0f * s;
    }
    for (idx_t p = n - t; p < n; p++) {
        queries[p * kD + 0] = std::log(0.015f * 999 / 0.985f) * s;
    }
    PrefillInput in;
    in.n_tokens = n;
    in.keys = keys.data();
    in.values = values.data();
    in.n_queries = n;
    in.queries = queries.data();
    auto has_needle = [&](const std::string& spec) {
        auto e = evict(spec);
        auto k = e->choose_kept(in);
        EXPECT_EQ(idx_t(k.size()), e->budget_for(n).n_keep) << spec;
        return std::binary_search(k.begin(), k.end(), needle);
    };
    const std::string top_only = "ProxyEvict20|protect=2,proxy_keep=18";
    {   // the construction, checked on the reference scores: a margin, not luck
        Prompt ref_p(n, 1, 0);
        ref_p.keys = keys;
        ref_p.queries = queries;
        auto e = evict(top_only);
        EvictBudget b = e->budget_for(n);
        ASSERT_EQ(b.n_proxy, 200);
        ASSERT_EQ(b.n_top, n_dis);
        ASSERT_EQ(b.n_random, 0);
        std::vector<idx_t> cand;
        for (idx_t j = b.n_sink; j < n - b.n_recent; j++) {
            cand.push_back(j);
        }
        auto F_pct = ref_scores(ref_p, last_positions(n, b.n_proxy), false);
        auto F_q = ref_scores(ref_p, last_positions(n, t), false);
        std::vector<double> sorted_pct, sorted_q;
        for (idx_t j : cand) {
            if (j != needle) {
                sorted_pct.push_back(F_pct[j]);
                sorted_q.push_back(F_q[j]);
            }
        }
        std::sort(sorted_pct.rbegin(), sorted_pct.rend());
        std::sort(sorted_q.rbegin(), sorted_q.rend());
        // percent window: 180 other tokens score well above the needle
        EXPECT_GT(sorted_pct[n_dis - 1], F_pct[needle] + 0.3);
        // question window: the needle is far above every other token
        EXPECT_GT(F_q[needle], 5 * sorted_q[0]);
    }
    EXPECT_FALSE(has_needle(top_only));
    EXPECT_TRUE(has_needle(top_only + ",proxy_tokens=32"));
    // the default split: the needle is in the deterministic top part with
    // the question window, whatever the random draws
    for (uint64_t seed : {1, 2, 3, 4, 5}) {
        EXPECT_TRUE(has_needle("ProxyEvict20|proxy_tokens=32,seed=" + std::to_string(seed)));
    }
}

TEST(ProxyEvictTokens, BudgetArithmeticDoesNotDependOnTheWindow) {
    for (const char* s : {"ProxyEvict1", "ProxyEvict10", "ProxyEvict20", "ProxyEvict30", "ProxyEvict50",
                          "ProxyEvict100"}) {
        auto base = evict(s);
        for (idx_t t : {1, 7, 32, 1000}) {
            auto e = evict(s);
            set_index_parameter(e.get(), "proxy_tokens", double(t));
            for (idx_t n = 1; n <= 400; n++) {
                EvictBudget a = base->budget_for(n), b = e->budget_for(n);
                ASSERT_EQ(b.n_keep, a.n_keep) << s << " t=" << t << " n=" << n;
                ASSERT_EQ(b.n_sink, a.n_sink) << s << " t=" << t << " n=" << n;
                ASSERT_EQ(b.n_recent, a.n_recent) << s << " t=" << t << " n=" << n;
                ASSERT_EQ(b.n_top, a.n_top) << s << " t=" << t << " n=" << n;
                ASSERT_EQ(b.n_random, a.n_random) << s << " t=" << t << " n=" << n;
                ASSERT_EQ(b.n_proxy, std::min(t, n)) << s << " t=" << t << " n=" << n;
            }
            // and with an absolute budget
            base->budget_tokens = e->budget_tokens = 37;
            EvictBudget a = base->budget_for(500), b = e->budget_for(500);
            EXPECT_EQ(a.n_keep, 37);
            EXPECT_TRUE(a.n_sink == b.n_sink && a.n_recent == b.n_recent && a.n_top == b.n_top &&
                        a.n_random == b.n_random);
            base->budget_tokens = 0;
        }
    }
}

TEST(ProxyEvictTokens, KnobRangeAndPolicies) {
    auto e = index_factory(kD, "ProxyEvict20");
    EXPECT_EQ(get_index_parameter(e.get(), "proxy_tokens"), 0.0); // default: the percent window
    bool listed = false;
    for (const ParameterInfo& p : index_parameter_info(e.get())) {
        if (p.name == "proxy_tokens") {
            listed = true;
            EXPECT_TRUE(p.prefill_time);
            EXPECT_NE(p.doc.find("tokens"), std::string::npos) << p.doc;
        }
    }
    EXPECT_TRUE(listed);
    set_index_parameters(e.get(), "proxy_tokens=32");
    EXPECT_EQ(get_index_parameter(e.get(), "proxy_tokens"), 32.0);
    EXPECT_EQ(get_index_parameter(index_factory(kD, "ProxyEvict20|proxy_tokens=7").get(), "proxy_tokens"), 7.0);
    EXPECT_THROW_MSG(set_index_parameters(e.get(), "proxy_tokens=-1"), "proxy_tokens=-1");
    EXPECT_THROW_MSG(set_index_parameters(e.get(), "proxy_tokens=2.5"), "proxy_tokens=2.5");
    EXPECT_EQ(get_index_parameter(e.get(), "proxy_tokens"), 32.0); // unchanged by a refusal
    set_index_parameters(e.get(), "proxy_tokens=0");                // back to the percent window
    EXPECT_EQ(get_index_parameter(e.get(), "proxy_tokens"), 0.0);
    // only NaCl has a proxy window: > 0 on the others is refused, 0 accepted
    for (const char* s : {"ProxyEvict20_H2O", "ProxyEvict20_TOVA", "ProxyEvict20_StreamingLLM",
                          "ProxyEvict20_Random"}) {
        SCOPED_TRACE(s);
        auto x = index_factory(kD, s);
        EXPECT_THROW_MSG(set_index_parameters(x.get(), "proxy_tokens=32"), "only NaCl");
        EXPECT_NO_THROW(set_index_parameters(x.get(), "proxy_tokens=0"));
        // the field is public: choose_kept refuses it too
        auto* pe = dynamic_cast<IndexProxyEvict*>(x.get());
        pe->proxy_tokens = 32;
        EXPECT_THROW_MSG(pe->budget_for(100), "proxy_tokens=32");
    }
    auto* pe = dynamic_cast<IndexProxyEvict*>(e.get());
    pe->proxy_tokens = -3;
    EXPECT_THROW_MSG(pe->budget_for(100), "proxy_tokens=-3");
    pe->proxy_tokens = 0;
    // prefill-time: refused once the index holds tokens
    Prompt p(50, 1, 27);
    e->prefill(p.input());
    EXPECT_THROW_MSG(set_index_parameters(e.get(), "proxy_tokens=8"), "prefill-time");
}

TEST(ProxyEvictTokens, IoKeepsTheKnobAndReadsVersion1) {
    Prompt p(300, 2, 28);
    auto index = index_factory(kD, "ProxyEvict20,TopK(Flat)|k=9,proxy_tokens=24");
    index->prefill(p.input());
    auto extra_k = gaussian(3, kD, 29), extra_v = gaussian(3, kD, 30);
    index->add_kv(3, extra_k.data(), extra_v.data());
    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);
    auto copy = read_index(buf);
    EXPECT_EQ(get_index_parameter(copy.get(), "proxy_tokens"), 24.0);
    EXPECT_EQ(index_factory_string(copy.get()), "ProxyEvict20,TopK(Flat)"); // a knob, not in the string
    auto q = gaussian(4, kD, 31);
    std::vector<float> o1(4 * kD), o2(4 * kD), l1(4), l2(4);
    index->attend(4, q.data(), o1.data(), l1.data());
    copy->attend(4, q.data(), o2.data(), l2.data());
    EXPECT_EQ(o1, o2);
    EXPECT_EQ(l1, l2);
    std::vector<uint8_t> again;
    write_index(copy.get(), &again);
    EXPECT_TRUE(again == buf);
    // the record is version 5 (proxy_tokens from 2, pool from 3, layer_vote
    // from 4, head_budget and head_floor from 5)
    const size_t version_at = kvtest::kIndexHeaderSize + 4; // after the outer fourcc
    uint32_t v;
    std::memcpy(&v, buf.data() + version_at, 4);
    EXPECT_EQ(v, 5u);

    // sentinels locate the fields
    auto* pe = dynamic_cast<IndexProxyEvict*>(index.get());
    const int64_t sentinel = 0x5A17E11E0F0F0F1, pool_sentinel = 0x3B0071E5A5A5A5B;
    pe->proxy_tokens = sentinel;
    pe->pool = pool_sentinel;
    pe->layer_vote = true;
    pe->head_floor_percent = 37.625; // head_budget stays 0: layer_vote excludes it
    std::vector<uint8_t> marked;
    write_index(index.get(), &marked);
    pe->proxy_tokens = 24;
    pe->pool = 0;
    pe->layer_vote = false;
    pe->head_floor_percent = 20;
    size_t at = find_unique_i64(marked, sentinel), pool_at = find_unique_i64(marked, pool_sentinel);
    ASSERT_NE(at, std::string::npos);
    ASSERT_EQ(pool_at, at + 8);
    const size_t vote_at = pool_at + 8; // one byte
    ASSERT_EQ(marked[vote_at], 1);
    const size_t head_at = vote_at + 1, floor_at = head_at + 1; // one byte, a double
    ASSERT_EQ(marked[head_at], 0);
    double floor_read;
    std::memcpy(&floor_read, marked.data() + floor_at, 8);
    ASSERT_EQ(floor_read, 37.625);
    const int64_t as_written[2] = {24, 0}; // proxy_tokens, pool
    std::memcpy(marked.data() + at, as_written, 16);
    marked[vote_at] = 0;
    const double floor_written = 20;
    std::memcpy(marked.data() + floor_at, &floor_written, 8);
    kvtest::forge_header(marked); // the checksum of the restored bytes
    EXPECT_TRUE(marked == buf);
    // an older record: without the fields its version did not have
    auto older = [&](uint32_t version) {
        std::vector<uint8_t> old(marked);
        const size_t from = version == 1 ? at : version == 2 ? pool_at : version == 3 ? vote_at : head_at;
        old.erase(old.begin() + from, old.begin() + floor_at + 8);
        std::memcpy(old.data() + version_at, &version, 4);
        kvtest::forge_header(old);
        return old;
    };
    for (uint32_t version : {1u, 2u, 3u, 4u}) {
        SCOPED_TRACE("version " + std::to_string(version));
        // version 1 reads as the percent window, versions 2 and 3 keep the
        // tokens; none pools or votes over the layer; same answers (the
        // kept tokens are stored)
        std::vector<uint8_t> bytes = older(version);
        std::unique_ptr<KVIndex> old;
        ASSERT_NO_THROW(old = read_index(bytes));
        EXPECT_EQ(get_index_parameter(old.get(), "proxy_tokens"), version == 1 ? 0.0 : 24.0);
        EXPECT_EQ(get_index_parameter(old.get(), "pool"), 0.0);
        EXPECT_EQ(get_index_parameter(old.get(), "layer_vote"), 0.0);
        std::vector<float> o3(4 * kD), l3(4);
        old->attend(4, q.data(), o3.data(), l3.data());
        EXPECT_EQ(o1, o3);
        EXPECT_EQ(l1, l3);
        EXPECT_EQ(get_index_parameter(old.get(), "head_budget"), 0.0);
        EXPECT_EQ(get_index_parameter(old.get(), "head_floor"), 20.0);
        // written back as version 5
        std::vector<uint8_t> up;
        write_index(old.get(), &up);
        std::memcpy(&v, up.data() + version_at, 4);
        EXPECT_EQ(v, 5u);
        EXPECT_EQ(up.size(), bytes.size() + 9 + (version == 1 ? 17 : version == 2 ? 9 : version == 3 ? 1 : 0));
    }
    {   // a forged layer vote other than 0 or 1 is refused
        std::vector<uint8_t> bad(marked);
        bad[vote_at] = 2;
        kvtest::forge_header(bad);
        EXPECT_THROW_MSG(read_index(bad), "invalid layer vote 2");
    }
    {   // a forged even pool is refused, naming it
        std::vector<uint8_t> bad(marked);
        int64_t even = 4;
        std::memcpy(bad.data() + pool_at, &even, 8);
        kvtest::forge_header(bad);
        EXPECT_THROW_MSG(read_index(bad), "pool=4");
    }
    {   // a forged negative field is refused, naming it
        std::vector<uint8_t> bad(marked);
        int64_t neg = -5;
        std::memcpy(bad.data() + at, &neg, 8);
        kvtest::forge_header(bad);
        EXPECT_THROW_MSG(read_index(bad), "proxy_tokens=-5");
    }
    {   // a forged head budget flag other than 0 or 1, or a floor out of
        // [0, 100], is refused
        std::vector<uint8_t> bad(marked);
        bad[head_at] = 3;
        kvtest::forge_header(bad);
        EXPECT_THROW_MSG(read_index(bad), "invalid head budget flag 3");
        std::vector<uint8_t> bad_floor(marked);
        const double over = 140;
        std::memcpy(bad_floor.data() + floor_at, &over, 8);
        kvtest::forge_header(bad_floor);
        EXPECT_THROW_MSG(read_index(bad_floor), "head_floor=140");
        std::vector<uint8_t> both(marked); // head_budget with the layer's vote
        both[head_at] = 1;
        both[vote_at] = 1;
        kvtest::forge_header(both);
        EXPECT_THROW_MSG(read_index(both), "head_budget=1 with layer_vote=1");
    }
    {   // a version 6 record is from a newer build
        std::vector<uint8_t> newer(buf);
        uint32_t six = 6;
        std::memcpy(newer.data() + version_at, &six, 4);
        kvtest::forge_header(newer);
        EXPECT_THROW_MSG(read_index(newer), "IndexProxyEvict record version 6");
    }
    {   // proxy_tokens > 0 forged on H2O is refused (and never written:
        // the writer checks what the reader does). The field sits where
        // it sits in the NaCl record: only fixed-size fields precede it.
        auto h2o = index_factory(kD, "ProxyEvict20_H2O");
        h2o->prefill(p.input());
        auto* ph = dynamic_cast<IndexProxyEvict*>(h2o.get());
        ph->proxy_tokens = 7;
        std::vector<uint8_t> hb;
        EXPECT_THROW_MSG(write_index(h2o.get(), &hb), "proxy_tokens=7");
        ph->proxy_tokens = 0;
        write_index(h2o.get(), &hb);
        int64_t stored = -1;
        std::memcpy(&stored, hb.data() + at, 8);
        ASSERT_EQ(stored, 0);
        int64_t seven = 7;
        std::memcpy(hb.data() + at, &seven, 8);
        kvtest::forge_header(hb);
        EXPECT_THROW_MSG(read_index(hb), "proxy_tokens=7");
    }
}

TEST(ProxyEvictTokens, GoldenVersion1FilesReadAsThePercentWindow) {
    // golden files written before proxy_tokens existed (record version 1)
    for (const char* name : {"09_ProxyEvict20.f1.kvix", "09_ProxyEvict20.f2.kvix", "09_ProxyEvict20.f3.kvix",
                             "14_ProxyEvict20_Sink4_Window64_LSHSample8x50.f3.kvix"}) {
        SCOPED_TRACE(name);
        std::ifstream f(std::string(KVINDEX_GOLDEN_DIR) + "/" + name, std::ios::binary);
        ASSERT_TRUE(f.good());
        std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), {});
        auto index = read_index(bytes);
        EXPECT_EQ(get_index_parameter(index.get(), "proxy_tokens"), 0.0);
    }
}

// ---- pool: scores max-pooled over neighbouring tokens (SnapKV) ----

TEST(ProxyEvictPool, KeptSetIsTheTopOfTheMaxPooledScores) {
    // top-only split: the kept set is the top-B of the reference scores
    // max-pooled over [j - w/2, j + w/2], pooled here in double
    Prompt p(300, 3, 41);
    auto F = ref_scores(p, last_positions(p.n, 12), /*causal=*/false);
    for (int w : {1, 3, 7, 15}) {
        std::vector<double> pooled(p.n);
        for (idx_t j = 0; j < p.n; j++) {
            pooled[j] = F[j];
            for (idx_t i = std::max<idx_t>(0, j - w / 2); i <= std::min<idx_t>(p.n - 1, j + w / 2); i++) {
                pooled[j] = std::max(pooled[j], F[i]);
            }
        }
        for (idx_t B : {5, 30, 90}) {
            SCOPED_TRACE("w=" + std::to_string(w) + " B=" + std::to_string(B));
            auto e = evict("ProxyEvict20");
            set_index_parameters(e.get(), "protect=0,proxy_keep=20,proxy_tokens=12,pool=" + std::to_string(w) +
                                                  ",budget=" + std::to_string(B));
            EXPECT_EQ(e->choose_kept(p.input()), top_of(pooled, iota_ids(p.n), B));
        }
    }
    // pooling keeps the neighbours of the best token: with w = 7 the three
    // tokens on each side of the top score are kept (B = 7, one peak)
    auto best = std::max_element(F.begin() + 3, F.end() - 3) - F.begin();
    auto e = evict("ProxyEvict20|protect=0,proxy_keep=20,proxy_tokens=12,pool=7,budget=7");
    std::vector<idx_t> kept = e->choose_kept(p.input());
    if (std::max_element(F.begin(), F.end()) - F.begin() == best) {
        std::vector<idx_t> span;
        for (idx_t j = best - 3; j <= best + 3; j++) {
            span.push_back(j);
        }
        EXPECT_EQ(kept, span);
    }
}

TEST(ProxyEvictPool, KnobRangeAndPolicies) {
    auto e = evict("ProxyEvict20");
    EXPECT_EQ(get_index_parameter(e.get(), "pool"), 0.0); // default: off
    set_index_parameters(e.get(), "pool=7");
    EXPECT_EQ(get_index_parameter(e.get(), "pool"), 7.0);
    EXPECT_THROW_MSG(set_index_parameters(e.get(), "pool=4"), "pool=4");
    EXPECT_THROW_MSG(set_index_parameters(e.get(), "pool=-1"), "pool=-1");
    EXPECT_EQ(get_index_parameter(e.get(), "pool"), 7.0); // unchanged by a refusal
    EXPECT_NO_THROW(set_index_parameters(evict("ProxyEvict20_H2O").get(), "pool=5"));
    EXPECT_NO_THROW(set_index_parameters(evict("ProxyEvict20_TOVA").get(), "pool=5"));
    for (const char* s : {"ProxyEvict20_StreamingLLM", "ProxyEvict20_Random"}) {
        EXPECT_THROW_MSG(set_index_parameters(evict(s).get(), "pool=5"), "nothing to pool");
    }
    // the fields are public: prefill refuses what set_parameter would have
    auto r = evict("ProxyEvict20_Random");
    r->pool = 5;
    EXPECT_THROW_MSG(r->budget_for(100), "pool=5");
    e->pool = 6;
    EXPECT_THROW_MSG(e->budget_for(100), "pool=6");
}

// ---- layer_vote: every query head of the layer scores (kvpress's TOVA) ----

namespace {

/// A layer of n tokens: n_kv KV heads, `group` query heads each, a query
/// at every position, through a KVCache of one layer.
struct LayerPrompt3 {
    idx_t n;
    int n_kv, group;
    std::vector<float> keys, values, queries; // (n_kv, n, d), (n_kv * group, n, d)
    LayerPrompt3(idx_t n, int n_kv, int group, uint64_t seed)
            : n(n), n_kv(n_kv), group(group),
              keys(gaussian(n_kv * n, kD, seed)),
              values(gaussian(n_kv * n, kD, seed + 1)),
              queries(gaussian(n_kv * group * n, kD, seed + 2, 1.5f)) {}
    std::unique_ptr<KVCache> cache(const std::string& s) const {
        auto c = std::make_unique<KVCache>(1, n_kv * group, n_kv, kD, kD, s);
        c->prefill(0, n, keys.data(), values.data(), n, queries.data(), nullptr, RopeParams());
        return c;
    }
    /// double scores: sum over every query head of the layer and the query
    /// positions qs of softmax over its own KV head's keys (causal or not)
    std::vector<double> scores(const std::vector<idx_t>& qs, bool causal) const {
        std::vector<double> F(n, 0.0);
        for (int kv = 0; kv < n_kv; kv++) {
            std::vector<double> f = head_scores(kv, qs, causal);
            for (idx_t j = 0; j < n; j++) {
                F[j] += f[j];
            }
        }
        return F;
    }
    /// the same for KV head kv's own query heads only
    std::vector<double> head_scores(int kv, const std::vector<idx_t>& qs, bool causal) const {
        Prompt p(n, group, 1);
        std::copy_n(keys.begin() + size_t(kv) * n * kD, n * kD, p.keys.begin());
        std::copy_n(queries.begin() + size_t(kv) * group * n * kD, size_t(group) * n * kD, p.queries.begin());
        return ref_scores(p, qs, causal);
    }
};

std::vector<idx_t> kept_of(const KVCache& c, int h) {
    return dynamic_cast<const IndexProxyEvict&>(*c.index(0, h)).positions;
}

} // namespace

TEST(ProxyEvictLayerVote, EveryHeadKeepsTheTopOfTheLayersScores) {
    LayerPrompt3 p(300, 3, 3, 71);
    std::vector<idx_t> all(p.n);
    std::iota(all.begin(), all.end(), 0);
    // TOVA: the last query of each of the 9 query heads; B = 60, all by score
    auto tova = p.cache("ProxyEvict20_TOVA|layer_vote=1");
    std::vector<idx_t> want = top_of(p.scores({p.n - 1}, false), all, 60);
    for (int h = 0; h < p.n_kv; h++) {
        EXPECT_EQ(kept_of(*tova, h), want) << "KV head " << h;
    }
    // H2O: its recent half, then the top of the causal scores of every query
    auto h2o = p.cache("ProxyEvict20_H2O|layer_vote=1");
    std::vector<idx_t> older(all.begin(), all.end() - 30), hq = all;
    std::vector<idx_t> h2o_want = top_of(p.scores(hq, true), older, 30);
    for (idx_t j = p.n - 30; j < p.n; j++) {
        h2o_want.push_back(j);
    }
    for (int h = 0; h < p.n_kv; h++) {
        EXPECT_EQ(kept_of(*h2o, h), h2o_want) << "KV head " << h;
    }
    // each KV head voting alone keeps other positions: the vote decides
    auto alone = p.cache("ProxyEvict20_TOVA");
    EXPECT_NE(kept_of(*alone, 0), kept_of(*alone, 1));
    EXPECT_NE(kept_of(*alone, 0), want);
    // NaCl with no random part: the layer's proxy window scores every head alike
    auto nacl = p.cache("ProxyEvict20|layer_vote=1,protect=0,proxy_keep=20,proxy_tokens=16");
    std::vector<idx_t> window(16);
    std::iota(window.begin(), window.end(), p.n - 16);
    EXPECT_EQ(kept_of(*nacl, 0), top_of(p.scores(window, false), all, 60));
    EXPECT_EQ(kept_of(*nacl, 1), kept_of(*nacl, 0));
    EXPECT_EQ(kept_of(*nacl, 2), kept_of(*nacl, 0));
}

TEST(ProxyEvictLayerVote, KnobPoliciesIoAndAnIndexAlone) {
    auto e = evict("ProxyEvict20_TOVA");
    EXPECT_EQ(get_index_parameter(e.get(), "layer_vote"), 0.0); // default: each KV head alone
    set_index_parameters(e.get(), "layer_vote=1");
    EXPECT_EQ(get_index_parameter(e.get(), "layer_vote"), 1.0);
    EXPECT_THROW_MSG(set_index_parameters(e.get(), "layer_vote=2"), "layer_vote=2");
    for (const char* s : {"ProxyEvict20_StreamingLLM", "ProxyEvict20_Random"}) {
        EXPECT_THROW_MSG(set_index_parameters(evict(s).get(), "layer_vote=1"), "nothing to vote on");
    }
    // an index prefilled alone has no layer to vote with
    Prompt p(200, 2, 5);
    EXPECT_THROW_MSG(e->prefill(p.input()), "through a KVCache");
    EXPECT_EQ(e->ntotal, 0);
    // the knob survives io, and the layer's kept positions with it
    LayerPrompt3 lp(200, 2, 2, 9);
    auto c = lp.cache("ProxyEvict20_TOVA|layer_vote=1");
    std::vector<uint8_t> buf;
    write_index(c->index(0, 1), &buf);
    auto back = read_index(buf);
    EXPECT_EQ(get_index_parameter(back.get(), "layer_vote"), 1.0);
    EXPECT_EQ(dynamic_cast<IndexProxyEvict&>(*back).positions, kept_of(*c, 0));
}

TEST(ProxyEvictLayerVote, TheLayersScoresAreComputedOncePerLayer) {
    LayerPrompt3 p(120, 3, 2, 13);
    LayerPrompt whole;
    whole.n_kv_heads = p.n_kv;
    whole.n_query_heads = p.group;
    whole.n_tokens = p.n;
    whole.keys = p.keys.data();
    whole.n_queries = p.n;
    whole.queries = p.queries.data();
    auto e = evict("ProxyEvict20_TOVA|layer_vote=1");
    int calls = 0;
    ProxyScorer counting = [&](const float* k, idx_t n, int d, const float* q, int nh, idx_t nq, const idx_t* pos,
                               idx_t first, bool causal, double* F) {
        calls++;
        proxy_scores(k, n, d, q, nh, nq, pos, first, causal, F);
    };
    auto kept_by_heads = [&] {
        std::vector<std::vector<idx_t>> kept;
        for (int h = 0; h < p.n_kv; h++) {
            PrefillInput in;
            in.n_tokens = p.n;
            in.keys = p.keys.data() + size_t(h) * p.n * kD;
            in.values = p.values.data() + size_t(h) * p.n * kD;
            in.n_queries = p.n;
            in.n_query_heads = p.group;
            in.queries = p.queries.data() + size_t(h) * p.group * p.n * kD;
            in.layer = &whole;
            kept.push_back(e->choose_kept(in, counting));
        }
        return kept;
    };
    auto alone = kept_by_heads(); // no shared results: each head sums the layer
    EXPECT_EQ(calls, p.n_kv * p.n_kv);
    calls = 0;
    whole.shared = std::make_shared<LayerPrompt::Shared>();
    auto shared = kept_by_heads();
    EXPECT_EQ(calls, p.n_kv); // once per KV head of the layer, for all of them
    EXPECT_EQ(shared, alone);
    EXPECT_EQ(shared[0], shared[2]);
}

// ---- head_budget: the layer's scored budget shared among its KV heads (AdaKV) ----

namespace {

/// AdaKV's allocation written plainly, for `cand` positions of each head:
/// each head's own top `floor`, then the layer's other picks by one sort
/// of every (score, head, position) left; returns each head's kept set.
std::vector<std::vector<idx_t>> ref_head_budgets(
        const std::vector<std::vector<double>>& F, const std::vector<idx_t>& cand, idx_t n_top, idx_t floor) {
    const int H = int(F.size());
    std::vector<std::vector<idx_t>> kept(H);
    std::vector<std::tuple<double, int, idx_t>> rest; // (-score, head, position): ascending = best first
    for (int h = 0; h < H; h++) {
        kept[h] = top_of(F[h], cand, floor);
        for (idx_t j : cand) {
            if (!std::binary_search(kept[h].begin(), kept[h].end(), j)) {
                rest.emplace_back(-F[h][j], h, j);
            }
        }
    }
    std::sort(rest.begin(), rest.end());
    for (idx_t i = 0; i < idx_t(H) * (n_top - floor); i++) {
        kept[std::get<1>(rest[i])].push_back(std::get<2>(rest[i]));
    }
    for (auto& k : kept) {
        std::sort(k.begin(), k.end());
    }
    return kept;
}

/// A layer whose KV heads attend differently: head 0's queries are sharp
/// (its attention sits on few keys), head 2's flat.
LayerPrompt3 uneven_layer(idx_t n, uint64_t seed) {
    LayerPrompt3 p(n, 3, 3, seed);
    const float scale[3] = {4.0f, 1.0f, 0.25f};
    for (int kv = 0; kv < 3; kv++) {
        for (size_t i = 0; i < size_t(p.group) * n * kD; i++) {
            p.queries[size_t(kv) * p.group * n * kD + i] *= scale[kv];
        }
    }
    return p;
}

} // namespace

TEST(ProxyEvictHeadBudget, TheLayersScoredTokensGoToTheHighestScoresOfAnyHead) {
    LayerPrompt3 p = uneven_layer(300, 83);
    std::vector<idx_t> all(p.n);
    std::iota(all.begin(), all.end(), 0);
    // TOVA, B = 60 per head, all by score: 180 for the layer, 12 (20%) per
    // head first
    auto c = p.cache("ProxyEvict20_TOVA|head_budget=1");
    std::vector<std::vector<double>> F;
    for (int kv = 0; kv < p.n_kv; kv++) {
        F.push_back(p.head_scores(kv, {p.n - 1}, false));
    }
    auto want = ref_head_budgets(F, all, 60, 12);
    size_t total = 0;
    for (int h = 0; h < p.n_kv; h++) {
        EXPECT_EQ(kept_of(*c, h), want[h]) << "KV head " << h;
        EXPECT_GE(kept_of(*c, h).size(), 12u);
        total += kept_of(*c, h).size();
    }
    EXPECT_EQ(total, 180u); // the layer keeps its budget
    // the sharp head needs fewer tokens for its mass than the flat one
    EXPECT_LT(kept_of(*c, 0).size(), 60u);
    EXPECT_GT(kept_of(*c, 2).size(), 60u);
    // what a head keeps holds at least the mass of its top 60 summed over
    // the layer: the allocation maximises the layer's kept scores
    double shared = 0, even = 0;
    for (int h = 0; h < p.n_kv; h++) {
        for (idx_t j : kept_of(*c, h)) {
            shared += F[h][j];
        }
        for (idx_t j : top_of(F[h], all, 60)) {
            even += F[h][j];
        }
    }
    EXPECT_GT(shared, even);

    // a floor of 100% is every head's own top: the plain policy
    auto own = p.cache("ProxyEvict20_TOVA|head_budget=1,head_floor=100");
    auto plain = p.cache("ProxyEvict20_TOVA");
    for (int h = 0; h < p.n_kv; h++) {
        EXPECT_EQ(kept_of(*own, h), kept_of(*plain, h)) << "KV head " << h;
    }
    // a floor of 0: the layer's top 180 of every (head, token) score
    auto none = p.cache("ProxyEvict20_TOVA|head_budget=1,head_floor=0");
    auto want0 = ref_head_budgets(F, all, 60, 0);
    for (int h = 0; h < p.n_kv; h++) {
        EXPECT_EQ(kept_of(*none, h), want0[h]) << "KV head " << h;
    }

    // H2O: the recent half stays per head, the heavy hitters are shared
    auto h2o = p.cache("ProxyEvict20_H2O|head_budget=1");
    std::vector<idx_t> older(all.begin(), all.end() - 30);
    std::vector<std::vector<double>> Fc;
    for (int kv = 0; kv < p.n_kv; kv++) {
        Fc.push_back(p.head_scores(kv, all, true));
    }
    auto want_h2o = ref_head_budgets(Fc, older, 30, 6);
    for (int h = 0; h < p.n_kv; h++) {
        for (idx_t j = p.n - 30; j < p.n; j++) {
            want_h2o[h].push_back(j);
        }
        EXPECT_EQ(kept_of(*h2o, h), want_h2o[h]) << "KV head " << h;
    }

    // NaCl: protected and random parts per head, the part by score shared
    // (B = 60: 6 protected, 18 by score, 36 drawn)
    auto nacl = p.cache("ProxyEvict20|head_budget=1,proxy_tokens=16");
    size_t nacl_total = 0;
    for (int h = 0; h < p.n_kv; h++) {
        const auto& k = kept_of(*nacl, h);
        nacl_total += k.size();
        EXPECT_GE(k.size(), 6u + 3 + 36) << "KV head " << h; // its floor of the 18
        for (idx_t j : {idx_t(0), idx_t(1), idx_t(2), idx_t(3), p.n - 2, p.n - 1}) { // 4 sinks, 2 recent
            EXPECT_TRUE(std::binary_search(k.begin(), k.end(), j)) << "KV head " << h << ", token " << j;
        }
    }
    EXPECT_EQ(nacl_total, 180u);
}

TEST(ProxyEvictHeadBudget, KnobsIoAndRefusals) {
    auto e = evict("ProxyEvict20_TOVA");
    EXPECT_EQ(get_index_parameter(e.get(), "head_budget"), 0.0); // default: n_top per head
    EXPECT_EQ(get_index_parameter(e.get(), "head_floor"), 20.0);
    set_index_parameters(e.get(), "head_budget=1,head_floor=35");
    EXPECT_EQ(get_index_parameter(e.get(), "head_budget"), 1.0);
    EXPECT_EQ(get_index_parameter(e.get(), "head_floor"), 35.0);
    EXPECT_THROW_MSG(set_index_parameters(e.get(), "head_budget=2"), "head_budget=2");
    EXPECT_THROW_MSG(set_index_parameters(e.get(), "head_floor=101"), "head_floor=101");
    EXPECT_THROW_MSG(set_index_parameters(e.get(), "layer_vote=1"), "head_budget=1 is set");
    auto v = evict("ProxyEvict20_TOVA|layer_vote=1");
    EXPECT_THROW_MSG(set_index_parameters(v.get(), "head_budget=1"), "layer_vote=1 is set");
    for (const char* s : {"ProxyEvict20_StreamingLLM", "ProxyEvict20_Random"}) {
        EXPECT_THROW_MSG(set_index_parameters(evict(s).get(), "head_budget=1"), "nothing to share by");
    }
    // an index prefilled alone has no layer to share with
    Prompt p(200, 2, 5);
    EXPECT_THROW_MSG(e->prefill(p.input()), "through a KVCache");
    EXPECT_EQ(e->ntotal, 0);
    // the knobs survive io, and the kept positions with them
    LayerPrompt3 lp = uneven_layer(200, 9);
    auto c = lp.cache("ProxyEvict20_TOVA|head_budget=1,head_floor=35");
    std::vector<uint8_t> buf;
    write_index(c->index(0, 2), &buf);
    auto back = read_index(buf);
    EXPECT_EQ(get_index_parameter(back.get(), "head_budget"), 1.0);
    EXPECT_EQ(get_index_parameter(back.get(), "head_floor"), 35.0);
    EXPECT_EQ(dynamic_cast<IndexProxyEvict&>(*back).positions, kept_of(*c, 2));
}

}  // namespace test_proxy_evict
