// GpuIndexTopK against its CPU twin ("Sink<n>,Window<m>,TopK(Flat)") and
// the double-precision reference: the selection is the exact top-k of the
// middle (ties by smaller id), the static part is merged by lse, a budget
// covering the middle is dense attention, decode appends, long contexts.
//
// Selections are compared exactly where scores are tied exactly (repeated
// keys) and up to order-of-summation swaps elsewhere: an id in one
// selection and not the other must score within 1e-5 (relative) of the
// k-th best, which only a near-tie can. Outputs: as test_gpu_flat.cpp.

#include <algorithm>
#include <cmath>
#include <memory>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/IndexSinkWindow.h>
#include <kvindex/gpu/GpuCloner.h>
#include <kvindex/gpu/GpuIndexKVFlat.h>
#include <kvindex/gpu/GpuIndexTopK.h>
#include <kvindex/index_factory.h>
#include <kvindex/parameters.h>

#include "expect_throw.h"
#include "gpu_test.h"

using namespace kvindex;
using kvtest::gaussian;
using kvtest::make_kv;
using kvtest::rel_err;

namespace {

constexpr double kTwinTol = 2e-5;

/// The stored keys of an index, as floats.
std::vector<float> stored_keys(const KVIndex& index) {
    std::vector<float> k(size_t(index.ntotal) * index.d);
    for (idx_t i = 0; i < index.ntotal; i++) {
        index.reconstruct(i, k.data() + i * index.d);
    }
    return k;
}

/// a and b (sets of ids of the middle) agree up to near-ties at the k-th score.
void expect_same_topk(const std::vector<idx_t>& a, const std::vector<idx_t>& b,
                      const std::vector<double>& scores, const char* what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    std::set<idx_t> sa(a.begin(), a.end()), sb(b.begin(), b.end());
    ASSERT_EQ(sa.size(), a.size()) << what << ": repeated ids";
    double kth = INFINITY;
    for (idx_t i : b) {
        kth = std::min(kth, scores[i]);
    }
    for (idx_t i : a) {
        if (!sb.count(i)) {
            EXPECT_NEAR(scores[i], kth, 1e-5 * std::max(1.0, std::abs(kth)))
                    << what << ": id " << i << " selected, not a near-tie";
        }
    }
}

std::shared_ptr<GpuResources> res() {
    return default_gpu_resources(0);
}

} // namespace

TEST(GpuTopK, AttendAndSelectMatchCpuChain) {
    KVINDEX_REQUIRE_GPU();
    const char* chains[] = {"TopK(Flat)", "Sink4,Window64,TopK(Flat)", "Sink16,TopK(Flat)",
                            "Window32,TopK(Flat)"};
    const int d = 128;
    const idx_t n = 6000, nq = 6;
    for (KVType t : {KVType::f32, KVType::bf16, KVType::f16}) {
        for (const char* chain : chains) {
            for (idx_t k : {idx_t(1), idx_t(50), idx_t(1000)}) {
                auto x = make_kv(n, nq, d, 40 + k, true);
                std::string s = std::string(kv_type_prefix(t)) + chain;
                auto cpu = index_factory(d, s);
                set_index_parameter(cpu.get(), "k", double(k));
                cpu->add_kv(n, x.keys.data(), x.values.data());
                auto gpu = index_cpu_to_gpu(res(), cpu.get());
                ASSERT_STREQ(gpu->type_name(), "GpuIndexTopK");
                EXPECT_EQ(gpu->k, k);
                std::string what = s + " k=" + std::to_string(k);

                std::vector<float> go(nq * d), gl(nq), co(nq * d), cl(nq);
                gpu->attend(nq, x.queries.data(), go.data(), gl.data());
                cpu->attend(nq, x.queries.data(), co.data(), cl.data());
                EXPECT_LE(rel_err(go.data(), co.data(), go.size()), kTwinTol) << what;
                for (idx_t i = 0; i < nq; i++) {
                    EXPECT_NEAR(gl[i], cl[i], kTwinTol * std::max(1.0f, std::abs(cl[i])))
                            << what;
                }

                std::vector<Selection> gs(nq), cs(nq);
                gpu->select(nq, x.queries.data(), gs.data());
                cpu->select(nq, x.queries.data(), cs.data());
                std::vector<float> keys = stored_keys(*cpu);
                for (idx_t i = 0; i < nq; i++) {
                    auto ref = kvtest::ref_scores(x.queries.data() + i * d, keys.data(), d, n);
                    std::vector<idx_t> a = gs[i].ids, b = cs[i].ids;
                    std::sort(b.begin(), b.end());
                    EXPECT_TRUE(std::is_sorted(a.begin(), a.end())) << what;
                    expect_same_topk(a, b, ref, what.c_str());
                    for (float u : gs[i].inclusion) {
                        ASSERT_EQ(u, 1.0f);
                    }
                }
            }
        }
    }
}

TEST(GpuTopK, TiesTakeTheSmallerIdsLikeTheReference) {
    KVINDEX_REQUIRE_GPU();
    // keys repeated 7 times: exact ties; the selection of the middle is the
    // reference top-k (ties by id) exactly
    const int d = 64;
    const idx_t distinct = 500, n = 3500, nq = 3, k = 40, n_sink = 4, n_window = 16;
    auto base = gaussian(distinct, d, 51);
    std::vector<float> keys(n * d), values = gaussian(n, d, 52);
    for (idx_t i = 0; i < n; i++) {
        std::copy(base.begin() + (i % distinct) * d, base.begin() + (i % distinct + 1) * d,
                  keys.begin() + i * d);
    }
    auto q = gaussian(nq, d, 53);
    GpuIndexTopK gpu(res(), d, d, KVType::f32, n_sink, n_window);
    gpu.k = k;
    gpu.add_kv(n, keys.data(), values.data());
    std::vector<Selection> sel(nq);
    gpu.select(nq, q.data(), sel.data());
    const idx_t mid = n - n_sink - n_window;
    for (idx_t i = 0; i < nq; i++) {
        auto ref = kvtest::ref_topk(q.data() + i * d, keys.data() + n_sink * d, d, mid, k);
        for (idx_t& id : ref) {
            id += n_sink;
        }
        std::sort(ref.begin(), ref.end());
        std::vector<idx_t> expect;
        for (idx_t t = 0; t < n_sink; t++) {
            expect.push_back(t);
        }
        expect.insert(expect.end(), ref.begin(), ref.end());
        for (idx_t t = n - n_window; t < n; t++) {
            expect.push_back(t);
        }
        EXPECT_EQ(sel[i].ids, expect) << "query " << i;
    }
}

TEST(GpuTopK, OutputIsTheReferenceOverStaticAndSelectedTokens) {
    KVINDEX_REQUIRE_GPU();
    // lse merge of the static part and the gathered top-k: the output equals
    // exact attention (in double) over the union of the selected ids
    const int d = 128;
    const idx_t n = 20000, nq = 4;
    auto x = make_kv(n, nq, d, 61, true);
    GpuIndexTopK gpu(res(), d, d, KVType::bf16, 64, 256);
    gpu.k = 200;
    gpu.add_kv(n, x.keys.data(), x.values.data());
    std::vector<float> out(nq * d), lse(nq);
    gpu.attend(nq, x.queries.data(), out.data(), lse.data());
    std::vector<Selection> sel(nq);
    gpu.select(nq, x.queries.data(), sel.data());
    std::vector<float> keys = stored_keys(gpu);
    std::vector<float> values(size_t(n) * d);
    for (idx_t i = 0; i < n; i++) {
        gpu.reconstruct_value(i, values.data() + i * d);
    }
    for (idx_t i = 0; i < nq; i++) {
        EXPECT_EQ(sel[i].size(), size_t(64 + 256 + 200));
        std::vector<double> ref;
        double l = kvtest::ref_attention(x.queries.data() + i * d, keys.data(), values.data(),
                                         d, d, sel[i].ids, nullptr, ref);
        EXPECT_LE(kvtest::rel_max_err(out.data() + i * d, ref), 1e-4) << i;
        EXPECT_NEAR(lse[i], l, 1e-4 * std::max(1.0, std::abs(l))) << i;
    }
}

TEST(GpuTopK, BudgetCoveringTheMiddleIsDense) {
    KVINDEX_REQUIRE_GPU();
    const int d = 64;
    const idx_t nq = 3;
    for (idx_t n : {idx_t(10), idx_t(80), idx_t(2000)}) {
        auto x = make_kv(n, nq, d, 70 + n, true);
        GpuIndexKVFlat flat(res(), d);
        flat.add_kv(n, x.keys.data(), x.values.data());
        std::vector<float> fo(nq * d), fl(nq), to(nq * d), tl(nq);
        flat.attend(nq, x.queries.data(), fo.data(), fl.data());
        // n <= sink + window (no middle), and k >= the middle
        for (idx_t k : {idx_t(1), n}) {
            GpuIndexTopK topk(res(), d, d, KVType::f32, 16, n <= 80 ? 64 : 8);
            topk.k = k;
            topk.add_kv(n, x.keys.data(), x.values.data());
            if (n > 80 && k == 1) {
                continue; // a real top-1: covered elsewhere
            }
            topk.attend(nq, x.queries.data(), to.data(), tl.data());
            EXPECT_LE(rel_err(to.data(), fo.data(), to.size()), 1e-6) << n << " " << k;
            for (idx_t i = 0; i < nq; i++) {
                EXPECT_NEAR(tl[i], fl[i], 1e-5 * std::max(1.0f, std::abs(fl[i])));
            }
        }
    }
}

TEST(GpuTopK, DecodeAppendsMatchCpuChain) {
    KVINDEX_REQUIRE_GPU();
    const int d = 64;
    const idx_t n_prompt = 300, steps = 120, g = 3;
    auto x = make_kv(n_prompt + steps, g * steps, d, 81, true);
    auto cpu = index_factory(d, "FP16,Sink4,Window16,TopK(Flat)|k=20");
    cpu->add_kv(n_prompt, x.keys.data(), x.values.data());
    auto gpu = index_cpu_to_gpu(res(), cpu.get());
    EXPECT_EQ(gpu->k, 20);
    std::vector<float> go(g * d), gl(g), co(g * d), cl(g);
    for (idx_t s = 0; s < steps; s++) {
        const float* k = x.keys.data() + (n_prompt + s) * d;
        const float* v = x.values.data() + (n_prompt + s) * d;
        cpu->add_kv(1, k, v);
        gpu->add_kv(1, k, v);
        const float* q = x.queries.data() + s * g * d;
        gpu->attend(g, q, go.data(), gl.data());
        cpu->attend(g, q, co.data(), cl.data());
        ASSERT_LE(rel_err(go.data(), co.data(), go.size()), kTwinTol) << "step " << s;
    }
}

TEST(GpuTopK, LongContextOnePercent) {
    KVINDEX_REQUIRE_GPU();
    const int d = 128;
    const idx_t n = 200000, nq = 4;
    auto x = make_kv(n, nq, d, 91, true);
    auto cpu = index_factory(d, "BF16,Sink4,Window64,TopK(Flat)|k=2000");
    cpu->add_kv(n, x.keys.data(), x.values.data());
    auto gpu = index_cpu_to_gpu(res(), cpu.get());
    std::vector<float> go(nq * d), gl(nq), co(nq * d), cl(nq);
    gpu->attend(nq, x.queries.data(), go.data(), gl.data());
    cpu->attend(nq, x.queries.data(), co.data(), cl.data());
    EXPECT_LE(rel_err(go.data(), co.data(), go.size()), kTwinTol);
    for (idx_t i = 0; i < nq; i++) {
        EXPECT_NEAR(gl[i], cl[i], kTwinTol * std::max(1.0f, std::abs(cl[i])));
    }
}

TEST(GpuTopK, PerCallBudget) {
    KVINDEX_REQUIRE_GPU();
    const int d = 64;
    const idx_t n = 1000;
    auto x = make_kv(n, 1, d, 95, false);
    GpuIndexTopK gpu(res(), d);
    gpu.add_kv(n, x.keys.data(), x.values.data());
    SearchParametersKV p;
    p.k = 7;
    Selection sel;
    gpu.select(1, x.queries.data(), &sel, &p);
    EXPECT_EQ(sel.size(), 7u);
    gpu.select(1, x.queries.data(), &sel);
    EXPECT_EQ(sel.size(), size_t(gpu.k));
    p.k = -2;
    EXPECT_THROW_MSG(gpu.select(1, x.queries.data(), &sel, &p), "k=");
    EXPECT_THROW_MSG(GpuIndexTopK(res(), d, d, KVType::f32, -1, 0), "n_sink");
}
