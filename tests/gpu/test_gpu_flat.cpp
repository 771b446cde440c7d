// GpuIndexKVFlat against its CPU twin (IndexKVFlat, same stored values) and
// the double-precision reference: random and out-of-distribution data,
// float32 / bfloat16 / fp16 storage, GQA groups in one pass, decode
// appends, long contexts (many slices merged by lse), exact search with
// ties, and bad input.
//
// Tolerances. GPU and CPU read the same stored values (the conversion is
// the same code), so they differ only by float32 summation order: outputs
// within 2e-5 of max(1, |out|), lse within 2e-5 of max(1, |lse|). Against
// the double reference on the stored values: 1e-4. bfloat16 storage
// against float32 attention on the unrounded data (plain Gaussian data,
// scores ~ N(0, 1)): within 2e-2, the rounding of keys and values (unit
// roundoff 2^-8) carried through the softmax.

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include <faiss/impl/FaissException.h>
#include <gtest/gtest.h>

#include <kvindex/IndexKVFlat.h>
#include <kvindex/gpu/GpuIndexKVFlat.h>
#include <kvindex/index_factory.h>

#include "expect_throw.h"
#include "gpu_test.h"

using namespace kvindex;
using kvtest::gaussian;
using kvtest::make_kv;
using kvtest::rel_err;

namespace {

constexpr double kTwinTol = 2e-5;
constexpr double kRefTol = 1e-4;

std::unique_ptr<KVIndex> cpu_flat(int d, KVType t) {
    return index_factory(d, std::string(kv_type_prefix(t)) + "Flat");
}

/// The stored keys / values of an index, as floats.
void stored(const KVIndex& index, std::vector<float>* k, std::vector<float>* v) {
    k->resize(size_t(index.ntotal) * index.d);
    v->resize(size_t(index.ntotal) * index.d_value);
    for (idx_t i = 0; i < index.ntotal; i++) {
        index.reconstruct(i, k->data() + i * index.d);
        index.reconstruct_value(i, v->data() + i * index.d_value);
    }
}

/// out / lse of `nq` queries on the GPU and the CPU twin agree, and both
/// agree with the double reference on the stored values.
void expect_matches(const KVIndex& gpu, const KVIndex& cpu, const float* q, idx_t nq,
                    const char* what) {
    const int d = gpu.d, dv = gpu.d_value;
    std::vector<float> go(nq * dv, NAN), gl(nq, NAN), co(nq * dv), cl(nq);
    gpu.attend(nq, q, go.data(), gl.data());
    cpu.attend(nq, q, co.data(), cl.data());
    ASSERT_TRUE(kvtest::all_finite(go)) << what;
    ASSERT_TRUE(kvtest::all_finite(gl)) << what;
    EXPECT_LE(rel_err(go.data(), co.data(), go.size()), kTwinTol) << what;
    for (idx_t i = 0; i < nq; i++) {
        EXPECT_LE(std::abs(gl[i] - cl[i]), kTwinTol * std::max(1.0f, std::abs(cl[i])))
                << what << " query " << i;
    }
    std::vector<float> k, v;
    stored(cpu, &k, &v);
    for (idx_t i = 0; i < nq; i++) {
        std::vector<double> ref;
        double lse = kvtest::ref_attention_all(q + i * d, k.data(), v.data(), d, dv,
                                               cpu.ntotal, ref);
        EXPECT_LE(kvtest::rel_max_err(go.data() + i * dv, ref), kRefTol) << what << " q " << i;
        EXPECT_NEAR(gl[i], lse, kRefTol * std::max(1.0, std::abs(lse))) << what << " q " << i;
    }
}

std::shared_ptr<GpuResources> res() {
    return default_gpu_resources(0);
}

} // namespace

TEST(GpuFlat, MatchesCpuTwinAndReference) {
    KVINDEX_REQUIRE_GPU();
    struct Case {
        idx_t n;
        idx_t nq;
        bool ood;
    };
    const Case cases[] = {{1, 1, false}, {37, 3, true}, {1000, 8, true},
                          {5000, 13, false}, {20000, 2, true}};
    for (KVType t : {KVType::f32, KVType::bf16, KVType::f16}) {
        for (int d : {64, 128, 256}) {
            for (const Case& c : cases) {
                auto x = make_kv(c.n, c.nq, d, 100 + c.n + d, c.ood);
                auto cpu = cpu_flat(d, t);
                GpuIndexKVFlat gpu(res(), d, d, t);
                cpu->add_kv(c.n, x.keys.data(), x.values.data());
                gpu.add_kv(c.n, x.keys.data(), x.values.data());
                std::string what = std::string(kv_type_name(t)) + " d=" + std::to_string(d) +
                        " n=" + std::to_string(c.n) + " nq=" + std::to_string(c.nq) +
                        (c.ood ? " ood" : "");
                expect_matches(gpu, *cpu, x.queries.data(), c.nq, what.c_str());
            }
        }
    }
}

TEST(GpuFlat, Bf16StorageWithinRoundingOfFloat32) {
    KVINDEX_REQUIRE_GPU();
    const int d = 128;
    const idx_t n = 4000, nq = 4;
    auto x = make_kv(n, nq, d, 7, false);
    GpuIndexKVFlat gpu(res(), d, d, KVType::bf16);
    gpu.add_kv(n, x.keys.data(), x.values.data());
    std::vector<float> out(nq * d), lse(nq);
    gpu.attend(nq, x.queries.data(), out.data(), lse.data());
    for (idx_t i = 0; i < nq; i++) {
        std::vector<double> ref;
        double l = kvtest::ref_attention_all(x.queries.data() + i * d, x.keys.data(),
                                             x.values.data(), d, d, n, ref);
        EXPECT_LE(kvtest::rel_max_err(out.data() + i * d, ref), 2e-2);
        EXPECT_NEAR(lse[i], l, 2e-2);
    }
}

TEST(GpuFlat, GqaGroupInOnePassEqualsOneCallPerQuery) {
    KVINDEX_REQUIRE_GPU();
    const int d = 128;
    const idx_t n = 30000, g = 8;
    auto x = make_kv(n, g, d, 3, true);
    GpuIndexKVFlat gpu(res(), d, d, KVType::bf16);
    gpu.add_kv(n, x.keys.data(), x.values.data());
    std::vector<float> all(g * d), all_lse(g), one(d);
    gpu.attend(g, x.queries.data(), all.data(), all_lse.data());
    for (idx_t i = 0; i < g; i++) {
        float l;
        gpu.attend(1, x.queries.data() + i * d, one.data(), &l);
        EXPECT_LE(rel_err(one.data(), all.data() + i * d, d), 1e-6) << i;
        EXPECT_NEAR(l, all_lse[i], 1e-5 * std::max(1.0f, std::abs(l))) << i;
    }
}

TEST(GpuFlat, DecodeAppendsMatchCpu) {
    KVINDEX_REQUIRE_GPU();
    const int d = 64;
    const idx_t n_prompt = 500, steps = 300, g = 4;
    for (KVType t : {KVType::f32, KVType::f16}) {
        auto x = make_kv(n_prompt + steps, g * steps, d, 11, true);
        auto cpu = cpu_flat(d, t);
        GpuIndexKVFlat gpu(res(), d, d, t);
        cpu->add_kv(n_prompt, x.keys.data(), x.values.data());
        gpu.add_kv(n_prompt, x.keys.data(), x.values.data());
        std::vector<float> go(g * d), gl(g), co(g * d), cl(g);
        for (idx_t s = 0; s < steps; s++) {
            const float* k = x.keys.data() + (n_prompt + s) * d;
            const float* v = x.values.data() + (n_prompt + s) * d;
            cpu->add_kv(1, k, v);
            gpu.add_kv(1, k, v); // capacity grows past 512 on the way
            const float* q = x.queries.data() + s * g * d;
            gpu.attend(g, q, go.data(), gl.data());
            cpu->attend(g, q, co.data(), cl.data());
            ASSERT_LE(rel_err(go.data(), co.data(), go.size()), kTwinTol) << "step " << s;
            for (idx_t i = 0; i < g; i++) {
                ASSERT_NEAR(gl[i], cl[i], kTwinTol * std::max(1.0f, std::abs(cl[i])));
            }
        }
        EXPECT_EQ(gpu.ntotal, n_prompt + steps);
        EXPECT_GE(gpu.storage.capacity, gpu.ntotal);
        std::vector<float> a(d), b(d);
        for (idx_t i : {idx_t(0), n_prompt, n_prompt + steps - 1}) {
            gpu.reconstruct(i, a.data());
            cpu->reconstruct(i, b.data());
            EXPECT_EQ(a, b) << i;
            gpu.reconstruct_value(i, a.data());
            cpu->reconstruct_value(i, b.data());
            EXPECT_EQ(a, b) << i;
        }
        // reset empties the index: a new sequence starts at token 0
        gpu.reset();
        EXPECT_EQ(gpu.ntotal, 0);
        EXPECT_EQ(gpu.storage.size, 0);
        gpu.add_kv(3, x.keys.data(), x.values.data());
        EXPECT_EQ(gpu.ntotal, 3);
        EXPECT_THROW(gpu.reconstruct(3, a.data()), faiss::FaissException);
    }
}

TEST(GpuFlat, LongContextSlicesMergeByLse) {
    KVINDEX_REQUIRE_GPU();
    // 300k tokens: hundreds of slices; one needle far above the rest in one
    // slice, so that the merge must weight the slices by their lse
    const int d = 128;
    const idx_t n = 300000, nq = 4;
    auto x = make_kv(n, nq, d, 5, true);
    const idx_t needle = 123457;
    for (int j = 0; j < d; j++) {
        x.keys[needle * d + j] = x.queries[j] * 0.8f; // query 0 points at it
    }
    auto cpu = cpu_flat(d, KVType::bf16);
    GpuIndexKVFlat gpu(res(), d, d, KVType::bf16);
    cpu->add_kv(n, x.keys.data(), x.values.data());
    gpu.add_kv(n, x.keys.data(), x.values.data());
    expect_matches(gpu, *cpu, x.queries.data(), nq, "300k bf16");
}

TEST(GpuFlat, SearchEqualsCpuTopK) {
    KVINDEX_REQUIRE_GPU();
    const int d = 64;
    const idx_t n = 5000, nq = 5, k = 10;
    auto x = make_kv(n, nq, d, 21, true);
    auto cpu = cpu_flat(d, KVType::f32);
    GpuIndexKVFlat gpu(res(), d);
    cpu->add_kv(n, x.keys.data(), x.values.data());
    gpu.add_kv(n, x.keys.data(), x.values.data());
    std::vector<float> gd(nq * k), cd(nq * k);
    std::vector<idx_t> gi(nq * k), ci(nq * k);
    gpu.search(nq, x.queries.data(), k, gd.data(), gi.data());
    cpu->search(nq, x.queries.data(), k, cd.data(), ci.data());
    EXPECT_EQ(gi, ci);
    EXPECT_LE(rel_err(gd.data(), cd.data(), gd.size()), 1e-5);
    for (idx_t i = 0; i < nq; i++) {
        auto ref = kvtest::ref_topk(x.queries.data() + i * d, x.keys.data(), d, n, k);
        EXPECT_EQ(std::vector<idx_t>(gi.begin() + i * k, gi.begin() + (i + 1) * k), ref) << i;
    }
    // k beyond the index: padding as Faiss (lowest float, -1), as the CPU
    const idx_t big = n + 3;
    std::vector<float> pd(big);
    std::vector<idx_t> pi(big);
    gpu.search(1, x.queries.data(), big, pd.data(), pi.data());
    for (idx_t j = n; j < big; j++) {
        EXPECT_EQ(pi[j], -1);
        EXPECT_EQ(pd[j], std::numeric_limits<float>::lowest());
    }
    std::vector<idx_t> sorted(pi.begin(), pi.begin() + n);
    std::sort(sorted.begin(), sorted.end());
    for (idx_t j = 0; j < n; j++) {
        ASSERT_EQ(sorted[j], j);
    }
}

TEST(GpuFlat, ExactTiesBrokenBySmallerId) {
    KVINDEX_REQUIRE_GPU();
    // each key repeated 10 times: every score is tied exactly (the same
    // stored key gives the same product), and the top-k must take the
    // smallest ids of a tied group first, as the CPU and the reference do
    const int d = 64;
    const idx_t distinct = 300, n = 3000, nq = 4, k = 25;
    for (KVType t : {KVType::f32, KVType::bf16}) {
        auto base = gaussian(distinct, d, 31);
        std::vector<float> keys(n * d), values = gaussian(n, d, 32);
        for (idx_t i = 0; i < n; i++) {
            std::copy(base.begin() + (i % distinct) * d, base.begin() + (i % distinct + 1) * d,
                      keys.begin() + i * d);
        }
        round_to(t, keys.data(), keys.size(), keys.data());
        auto q = gaussian(nq, d, 33);
        auto cpu = cpu_flat(d, t);
        GpuIndexKVFlat gpu(res(), d, d, t);
        cpu->add_kv(n, keys.data(), values.data());
        gpu.add_kv(n, keys.data(), values.data());
        std::vector<float> gd(nq * k), cd(nq * k);
        std::vector<idx_t> gi(nq * k), ci(nq * k);
        gpu.search(nq, q.data(), k, gd.data(), gi.data());
        cpu->search(nq, q.data(), k, cd.data(), ci.data());
        EXPECT_EQ(gi, ci) << kv_type_name(t);
        for (idx_t i = 0; i < nq; i++) {
            auto ref = kvtest::ref_topk(q.data() + i * d, keys.data(), d, n, k);
            EXPECT_EQ(std::vector<idx_t>(gi.begin() + i * k, gi.begin() + (i + 1) * k), ref);
        }
    }
}

TEST(GpuFlat, EmptyAndBadInputThrow) {
    KVINDEX_REQUIRE_GPU();
    const int d = 64;
    GpuIndexKVFlat gpu(res(), d);
    auto q = gaussian(2, d, 1);
    std::vector<float> out(2 * d), lse(2);
    EXPECT_THROW_MSG(gpu.attend(2, q.data(), out.data(), lse.data()), "empty");
    std::vector<float> dis(6);
    std::vector<idx_t> lab(6);
    gpu.search(2, q.data(), 3, dis.data(), lab.data()); // empty: padding
    EXPECT_EQ(lab, std::vector<idx_t>(6, -1));

    EXPECT_THROW_MSG(GpuIndexKVFlat(res(), 96), "d=96");
    EXPECT_THROW_MSG(GpuIndexKVFlat(res(), 64, 32), "d_value=32");
    EXPECT_THROW_MSG(GpuIndexKVFlat(nullptr, 64), "resources");

    auto x = make_kv(10, 1, d, 2, false);
    std::vector<float> bad = x.keys;
    bad[17] = NAN;
    EXPECT_THROW_MSG(gpu.add_kv(10, bad.data(), x.values.data()), "non-finite");
    GpuIndexKVFlat half(res(), d, d, KVType::f16);
    bad = x.values;
    bad[3] = 1e6f; // beyond fp16's 65504
    EXPECT_THROW_MSG(half.add_kv(10, x.keys.data(), bad.data()), "f16");
    EXPECT_EQ(half.ntotal, 0);

    gpu.add_kv(10, x.keys.data(), x.values.data());
    std::vector<float> qbad = q;
    qbad[5] = INFINITY;
    EXPECT_THROW_MSG(gpu.attend(2, qbad.data(), out.data(), lse.data()), "non-finite");
    EXPECT_THROW_MSG(gpu.search(2, q.data(), 0, dis.data(), lab.data()), "k=0");
    std::vector<float> rec(d);
    EXPECT_THROW_MSG(gpu.reconstruct(10, rec.data()), "10");
    SearchParametersKV p;
    p.k = -1;
    EXPECT_THROW_MSG(gpu.attend(2, q.data(), out.data(), lse.data(), &p), "k");
    // the index is still usable after every refusal
    gpu.attend(2, q.data(), out.data(), lse.data());
    EXPECT_TRUE(kvtest::all_finite(out));
}
