// GpuIndexIVFAsym against its CPU twin ("[Sink<n>,][Window<m>,]IVFAsym<C>
// [_probe]") and the double-precision reference.
//
// Routing: the device probe (the de-RoPEd query, the Q-model or the
// centroid / moment scores, the nprobe best buckets) must pick the CPU's
// buckets; the classifier sums in another order on the device, so a bucket
// in one set and not the other must score, by the CPU's own scores, within
// 1e-4 (relative) of the nprobe-th best: only a near-tie can swap. Where the
// sets agree (every row here, unless a near-tie is reported), the
// selections must be identical and the attention equal to the CPU's
// (2e-5) and to the double reference over the same tokens (1e-4).

#include <algorithm>
#include <cmath>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/IndexIVFAsym.h>
#include <kvindex/IndexTopK.h>
#include <kvindex/gpu/GpuCloner.h>
#include <kvindex/gpu/GpuIndexIVFAsym.h>
#include <kvindex/gpu/GpuKVCache.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>
#include <kvindex/registry.h>

#include "expect_throw.h"
#include "gpu_test.h"

using namespace kvindex;
using kvtest::make_kv;
using kvtest::rel_err;

namespace {

constexpr double kTwinTol = 2e-5; ///< GPU vs CPU twin (float sums in another order)
constexpr double kRefTol = 1e-4;  ///< GPU vs the double reference on the stored values
constexpr double kTieTol = 1e-4;  ///< a routing swap needs scores this close

std::shared_ptr<GpuResources> res() {
    return default_gpu_resources(0);
}

/// The stored keys and values of an index, as floats, in token order.
void stored_kv(const KVIndex& index, std::vector<float>* k, std::vector<float>* v) {
    k->resize(size_t(index.ntotal) * index.d);
    v->resize(size_t(index.ntotal) * index.d_value);
    for (idx_t i = 0; i < index.ntotal; i++) {
        index.reconstruct(i, k->data() + i * index.d);
        index.reconstruct_value(i, v->data() + i * index.d_value);
    }
}

/// A prompt of n tokens whose last n_queries positions carry queries of
/// `heads` query heads (post-RoPE in spirit: the rotation is what the
/// de-RoPE undoes, whatever the vectors).
struct Prompt {
    kvtest::KVData x;
    std::vector<float> queries; ///< [heads][n_queries][d]
    idx_t n = 0, n_queries = 0;
    int heads = 1;

    PrefillInput input() const {
        PrefillInput in;
        in.n_tokens = n;
        in.keys = x.keys.data();
        in.values = x.values.data();
        in.n_queries = n_queries;
        in.n_query_heads = heads;
        in.queries = queries.data();
        in.rope.theta = 10000;
        in.rope.style = RopeStyle::half;
        return in;
    }
};

Prompt make_prompt(idx_t n, idx_t n_queries, int d, int heads, uint64_t seed) {
    Prompt p;
    p.x = make_kv(n, 64, d, seed, true); // 64 decode queries in x.queries
    p.queries = kvtest::gaussian(size_t(heads) * n_queries, d, seed + 7, 1.5f, -1.0f);
    p.n = n;
    p.n_queries = n_queries;
    p.heads = heads;
    return p;
}

/// Small, fast self-training (the models' quality is not what is tested);
/// only the Q-model probe trains, the others have no such knobs.
void small_training(KVIndex* index) {
    for (const ParameterInfo& p : index_parameter_info(index)) {
        if (p.name == "hidden") {
            set_index_parameters(index, "hidden=32,train_iterations=60");
            return;
        }
    }
}

/** The GPU probe of query q against the CPU's bucket scores: the same set,
 * or a swap within kTieTol of the nprobe-th score. Returns whether equal. */
bool check_probe(const IndexIVFAsym& cpu, const float* q, const int32_t* gpu_probed, int nprobe,
                 const std::string& what) {
    const int C = cpu.n_centroids;
    std::vector<float> scores(C);
    cpu.bucket_scores(q, cpu.query_position(), scores.data());
    std::vector<int32_t> cpu_probed(nprobe);
    cpu.probe_buckets(q, cpu.query_position(), nprobe, cpu_probed.data());
    std::set<int32_t> a(gpu_probed, gpu_probed + nprobe), b(cpu_probed.begin(), cpu_probed.end());
    EXPECT_EQ(a.size(), size_t(nprobe)) << what << ": repeated buckets";
    if (a == b) {
        return true;
    }
    const float kth = nprobe > 0 ? scores[cpu_probed[nprobe - 1]] : 0.0f;
    for (int32_t c : a) {
        EXPECT_TRUE(c >= 0 && c < C) << what << ": bucket " << c;
        if (!b.count(c) && c >= 0 && c < C) {
            EXPECT_NEAR(scores[c], kth, kTieTol * std::max(1.0f, std::abs(kth)))
                    << what << ": bucket " << c << " probed, not a near-tie";
        }
    }
    return false;
}

/** Everything a decode step answers, GPU vs CPU: probe, select, attend (vs
 * the twin and the double reference over the GPU's own selection). */
void expect_twins_agree(const KVIndex& cpu_chain, const GpuIndexIVFAsym& gpu, const float* queries,
                        idx_t nq, const std::string& what) {
    const IndexIVFAsym& ivf = gpu.ivf();
    const int d = gpu.d;
    const int nprobe = ivf.nprobe;
    std::vector<int32_t> probed(size_t(nq) * nprobe);
    if (ivf.is_trained_models()) {
        gpu.probe(nq, queries, probed.data());
    }
    std::vector<Selection> gs(nq), cs(nq);
    gpu.select(nq, queries, gs.data());
    cpu_chain.select(nq, queries, cs.data());
    std::vector<float> go(nq * d), gl(nq), co(nq * d), cl(nq);
    gpu.attend(nq, queries, go.data(), gl.data());
    cpu_chain.attend(nq, queries, co.data(), cl.data());
    std::vector<float> keys, values;
    stored_kv(cpu_chain, &keys, &values);
    int agreeing = 0;
    for (idx_t i = 0; i < nq; i++) {
        const float* q = queries + i * d;
        const std::string w = what + " query " + std::to_string(i);
        const bool same = !ivf.is_trained_models() || ivf.ntotal == 0 ||
                check_probe(ivf, q, probed.data() + i * nprobe, nprobe, w);
        // the reference over the GPU's own selection
        std::vector<idx_t> ids = gs[i].ids;
        EXPECT_TRUE(std::is_sorted(ids.begin(), ids.end())) << w;
        EXPECT_EQ(std::set<idx_t>(ids.begin(), ids.end()).size(), ids.size()) << w;
        for (float u : gs[i].inclusion) {
            ASSERT_EQ(u, 1.0f) << w;
        }
        std::vector<double> ref;
        const double ref_lse =
                kvtest::ref_attention(q, keys.data(), values.data(), d, d, ids, nullptr, ref);
        EXPECT_LE(kvtest::rel_max_err(go.data() + i * d, ref), kRefTol) << w;
        EXPECT_NEAR(gl[i], ref_lse, kRefTol * std::max(1.0, std::abs(ref_lse))) << w;
        if (!same) {
            continue;
        }
        agreeing++;
        std::vector<idx_t> b = cs[i].ids;
        std::sort(b.begin(), b.end());
        EXPECT_EQ(ids, b) << w;
        EXPECT_EQ(gs[i].n_scanned, cs[i].n_scanned) << w;
        EXPECT_LE(rel_err(go.data() + i * d, co.data() + i * d, d), kTwinTol) << w;
        EXPECT_NEAR(gl[i], cl[i], kTwinTol * std::max(1.0f, std::abs(cl[i]))) << w;
    }
    // near-ties are rare on this data: most rows must be compared in full
    EXPECT_GE(agreeing, nq - 2) << what;
}

} // namespace

TEST(GpuIVFAsym, TwinOfEveryDeviceProbe) {
    KVINDEX_REQUIRE_GPU();
    const int d = 128;
    const char* chains[] = {"IVFAsym16", "Sink4,Window32,IVFAsym16", "IVFAsym24_Centroid",
                            "Sink1,Window63,IVFAsym8_CentroidRoPE", "Sink4,Window16,IVFAsym32_Moment"};
    for (KVType t : {KVType::f32, KVType::bf16}) {
        for (const char* chain : chains) {
            const std::string s = std::string(kv_type_prefix(t)) + chain;
            Prompt p = make_prompt(3000, 400, d, 1, 11);
            auto cpu = index_factory(d, s);
            small_training(cpu.get());
            set_index_parameters(cpu.get(), "nprobe=3");
            if (std::string(chain).find("Moment") != std::string::npos) {
                set_index_parameters(cpu.get(), "var_weight=0.25");
            }
            cpu->prefill(p.input());
            auto gpu = index_cpu_to_gpu(res(), cpu.get());
            ASSERT_STREQ(gpu->type_name(), "GpuIndexIVFAsym");
            EXPECT_EQ(gpu->factory_string(), "GPU," + cpu->factory_string());
            auto& g = dynamic_cast<GpuIndexIVFAsym&>(*gpu);
            ASSERT_TRUE(g.ivf().is_trained_models()) << s;
            expect_twins_agree(*cpu, g, p.x.queries.data(), 16, s + " after prefill");

            // decode: single appends (through the window), then a batch
            // (some straight to the inner index), both twins alike
            auto more = make_kv(120, 1, d, 99, true);
            for (idx_t i = 0; i < 100; i++) {
                cpu->add_kv(1, more.keys.data() + i * d, more.values.data() + i * d);
                gpu->add_kv(1, more.keys.data() + i * d, more.values.data() + i * d);
            }
            cpu->add_kv(20, more.keys.data() + 100 * d, more.values.data() + 100 * d);
            gpu->add_kv(20, more.keys.data() + 100 * d, more.values.data() + 100 * d);
            ASSERT_EQ(gpu->ntotal, cpu->ntotal);
            expect_twins_agree(*cpu, g, p.x.queries.data() + 16 * d, 16, s + " after appends");
        }
    }
}

TEST(GpuIVFAsym, AllBucketsIsExactAndNoneIsTheStaticPart) {
    KVINDEX_REQUIRE_GPU();
    const int d = 64;
    Prompt p = make_prompt(2500, 300, d, 1, 21);
    auto cpu = index_factory(d, "Sink4,Window32,IVFAsym12_Centroid");
    cpu->prefill(p.input());
    auto gpu = index_cpu_to_gpu(res(), cpu.get());
    const idx_t nq = 8, n = cpu->ntotal;
    std::vector<float> keys, values;
    stored_kv(*cpu, &keys, &values);
    std::vector<float> out(nq * d), lse(nq);
    // nprobe = C: every bucket, i.e. exact attention over all tokens
    SearchParametersTopK all;
    all.nprobe = 12;
    gpu->attend(nq, p.x.queries.data(), out.data(), lse.data(), &all);
    for (idx_t i = 0; i < nq; i++) {
        std::vector<double> ref;
        double l = kvtest::ref_attention_all(p.x.queries.data() + i * d, keys.data(),
                                             values.data(), d, d, n, ref);
        EXPECT_LE(kvtest::rel_max_err(out.data() + i * d, ref), kRefTol);
        EXPECT_NEAR(lse[i], l, kRefTol * std::max(1.0, std::abs(l)));
    }
    // nprobe = 0: the sink and the window alone (nothing is unassigned)
    set_index_parameters(gpu.get(), "nprobe=0");
    gpu->attend(nq, p.x.queries.data(), out.data(), lse.data());
    std::vector<idx_t> stat;
    for (idx_t t = 0; t < 4; t++) {
        stat.push_back(t);
    }
    for (idx_t t = n - 32; t < n; t++) {
        stat.push_back(t);
    }
    for (idx_t i = 0; i < nq; i++) {
        std::vector<double> ref;
        double l = kvtest::ref_attention(p.x.queries.data() + i * d, keys.data(), values.data(),
                                         d, d, stat, nullptr, ref);
        EXPECT_LE(kvtest::rel_max_err(out.data() + i * d, ref), kRefTol);
        EXPECT_NEAR(lse[i], l, kRefTol * std::max(1.0, std::abs(l)));
    }
}

TEST(GpuIVFAsym, CapturedMassGrowsWithNprobe) {
    KVINDEX_REQUIRE_GPU();
    // lse over a superset of tokens can only grow: probing more buckets
    // never lowers it (the probed sets are nested: best-first prefixes)
    const int d = 128;
    Prompt p = make_prompt(3000, 300, d, 1, 31);
    auto gpu = index_factory(d, "GPU,IVFAsym16_Centroid");
    gpu->prefill(p.input());
    const idx_t nq = 6;
    std::vector<float> out(nq * d), prev(nq, -INFINITY), lse(nq);
    for (int np : {1, 2, 4, 8, 16}) {
        SearchParametersTopK sp;
        sp.nprobe = size_t(np);
        gpu->attend(nq, p.x.queries.data(), out.data(), lse.data(), &sp);
        for (idx_t i = 0; i < nq; i++) {
            EXPECT_GE(lse[i], prev[i] - 1e-5f) << "nprobe " << np;
            prev[i] = lse[i];
        }
    }
}

TEST(GpuIVFAsym, GroupProbeReadsOneBucketSetPerPosition) {
    KVINDEX_REQUIRE_GPU();
    const int d = 64, g = 3;
    Prompt p = make_prompt(2500, 300, d, g, 41);
    auto cpu = index_factory(d, "Sink4,Window32,IVFAsym16");
    small_training(cpu.get());
    set_index_parameters(cpu.get(), "group_probe=1,nprobe=2");
    cpu->prefill(p.input());
    auto gpu = index_cpu_to_gpu(res(), cpu.get());
    // one position (g rows, head-major), then two positions (2 g rows)
    for (idx_t m : {idx_t(1), idx_t(2)}) {
        const idx_t nq = g * m;
        std::vector<float> go(nq * d), gl(nq), co(nq * d), cl(nq);
        gpu->attend(nq, p.x.queries.data(), go.data(), gl.data());
        cpu->attend(nq, p.x.queries.data(), co.data(), cl.data());
        EXPECT_LE(rel_err(go.data(), co.data(), go.size()), kTwinTol) << "positions " << m;
        for (idx_t i = 0; i < nq; i++) {
            EXPECT_NEAR(gl[i], cl[i], kTwinTol * std::max(1.0f, std::abs(cl[i])));
        }
    }
}

TEST(GpuIVFAsym, PrefillOnTheGpuIndexTrainsAsTheCpu) {
    KVINDEX_REQUIRE_GPU();
    const int d = 64;
    Prompt p = make_prompt(2000, 256, d, 1, 51);
    auto cpu = index_factory(d, "Sink4,Window32,IVFAsym8_Centroid");
    auto gpu = index_factory(d, "GPU,Sink4,Window32,IVFAsym8_Centroid");
    ASSERT_STREQ(gpu->type_name(), "GpuIndexIVFAsym");
    cpu->set_stream(5);
    gpu->set_stream(5);
    cpu->prefill(p.input());
    gpu->prefill(p.input());
    auto& g = dynamic_cast<GpuIndexIVFAsym&>(*gpu);
    EXPECT_EQ(g.ivf().centroids, ivf_asym_in_chain(cpu.get())->centroids);
    expect_twins_agree(*cpu, g, p.x.queries.data(), 12, "GPU prefill");
    // reset, then tokens without a prompt: nothing is routed yet (the
    // unassigned run is read by every query)
    gpu->reset();
    cpu->reset();
    auto more = make_kv(200, 1, d, 5, true);
    gpu->add_kv(200, more.keys.data(), more.values.data());
    cpu->add_kv(200, more.keys.data(), more.values.data());
    expect_twins_agree(*cpu, g, p.x.queries.data(), 4, "untrained");
}

TEST(GpuIVFAsym, AnAdoptedModelRoutesAsTheCpu) {
    // kvllm --trained: an index adopts a model trained elsewhere, then
    // takes tokens without a prefill
    KVINDEX_REQUIRE_GPU();
    const int d = 64;
    Prompt p = make_prompt(2000, 256, d, 1, 53);
    auto trained = index_factory(d, "Sink4,Window32,IVFAsym8_Centroid");
    trained->prefill(p.input());
    auto cpu = index_factory(d, "Sink4,Window32,IVFAsym8_Centroid");
    auto gpu = index_factory(d, "GPU,Sink4,Window32,IVFAsym8_Centroid");
    EXPECT_EQ(cpu->adopt_trained(*trained), 1);
    EXPECT_EQ(gpu->adopt_trained(*trained), 1);
    ASSERT_TRUE(ivf_asym_in_chain(cpu.get())->is_trained_models());
    auto more = make_kv(600, 1, d, 7, true);
    cpu->add_kv(600, more.keys.data(), more.values.data());
    gpu->add_kv(600, more.keys.data(), more.values.data());
    auto& g = dynamic_cast<GpuIndexIVFAsym&>(*gpu);
    expect_twins_agree(*cpu, g, p.x.queries.data(), 8, "adopted");
}

TEST(GpuIVFAsym, SearchIsTheTopKOfTheProbedTokens) {
    KVINDEX_REQUIRE_GPU();
    const int d = 128;
    Prompt p = make_prompt(3000, 300, d, 1, 61);
    auto cpu = index_factory(d, "Sink4,Window32,IVFAsym16_Centroid");
    set_index_parameters(cpu.get(), "nprobe=4");
    cpu->prefill(p.input());
    auto gpu = index_cpu_to_gpu(res(), cpu.get());
    const idx_t nq = 8, k = 20;
    std::vector<float> gd(nq * k), cd(nq * k);
    std::vector<idx_t> gi(nq * k), ci(nq * k);
    gpu->search(nq, p.x.queries.data(), k, gd.data(), gi.data());
    cpu->search(nq, p.x.queries.data(), k, cd.data(), ci.data());
    for (idx_t i = 0; i < nq * k; i++) {
        EXPECT_NEAR(gd[i], cd[i], 1e-4 * std::max(1.0f, std::abs(cd[i])));
    }
    int same = 0;
    for (idx_t i = 0; i < nq * k; i++) {
        same += gi[i] == ci[i];
    }
    EXPECT_GE(same, nq * k - 4); // only adjacent near-ties may swap
}

TEST(GpuIVFAsym, RoundTripsAndIo) {
    KVINDEX_REQUIRE_GPU();
    const int d = 64;
    Prompt p = make_prompt(1500, 200, d, 1, 71);
    auto cpu = index_factory(d, "BF16,Sink4,Window32,IVFAsym8_Moment");
    set_index_parameters(cpu.get(), "nprobe=2,var_weight=0.5");
    cpu->prefill(p.input());
    auto gpu = index_cpu_to_gpu(res(), cpu.get());
    auto back = index_gpu_to_cpu(gpu.get());
    EXPECT_EQ(index_factory_string(back.get()), index_factory_string(cpu.get()));
    EXPECT_EQ(get_index_parameter(back.get(), "var_weight"), 0.5);
    std::vector<uint8_t> a, b;
    write_index(cpu.get(), &a);
    write_index(gpu.get(), &b); // the twin's record
    EXPECT_EQ(a, b);
    auto read = read_index(b);
    EXPECT_STREQ(read->type_name(), cpu->type_name());
    // a knob set on the GPU index reaches its twin
    set_index_parameter(gpu.get(), "nprobe", 3);
    EXPECT_EQ(get_index_parameter(index_gpu_to_cpu(gpu.get()).get(), "nprobe"), 3);
}

TEST(GpuIVFAsym, RefusedWithReasons) {
    KVINDEX_REQUIRE_GPU();
    auto oracle = index_factory(64, "IVFAsym8_Oracle");
    EXPECT_THROW_MSG(index_cpu_to_gpu(res(), oracle.get()), "_Oracle");
    auto big = index_factory(64, "IVFAsym8192_Centroid");
    EXPECT_THROW_MSG(index_cpu_to_gpu(res(), big.get()), "4096");
    EXPECT_THROW_MSG(GpuKVCache(1, 3, 1, 64, 64, "Sink4,Window8,IVFAsym8"), "per-head state");
    Prompt p = make_prompt(600, 100, 64, 1, 81);
    auto gpu = index_factory(64, "GPU,IVFAsym8_Centroid");
    gpu->prefill(p.input());
    SearchParametersTopK sp;
    sp.nprobe = 9;
    std::vector<float> out(64), lse(1);
    EXPECT_THROW_MSG(gpu->attend(1, p.x.queries.data(), out.data(), lse.data(), &sp), "nprobe=9");
}

TEST(GpuRegistry, IVFAsymRowIsListed) {
    register_gpu_index_types();
    EXPECT_EQ(index_type("GpuIndexIVFAsym").fourcc, fourcc("KGia"));
}
