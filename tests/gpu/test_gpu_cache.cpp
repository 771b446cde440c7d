// GpuKVCache against KVCache (its CPU twin): GQA, dense and sparse layers,
// prefill then decode appends, device arrays, the CPU copy, bad input.

#include <climits>
#include <cmath>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <faiss/IndexIVF.h>

#include <kvindex/IndexTopK.h>
#include <kvindex/KVCache.h>
#include <kvindex/gpu/GpuKVCache.h>

#include "expect_throw.h"
#include "gpu_test.h"

using namespace kvindex;
using kvtest::gaussian;
using kvtest::rel_err;

namespace {
constexpr int kLayers = 2, kQHeads = 6, kKVHeads = 2, kD = 64;

/// Keys or values of one layer for tokens [from, from + n): [kKVHeads][n][kD]
/// cut from an array of [kKVHeads][n_total][kD].
std::vector<float> slice(const std::vector<float>& x, idx_t n_total, idx_t from, idx_t n) {
    std::vector<float> s;
    for (int h = 0; h < kKVHeads; h++) {
        s.insert(s.end(), x.begin() + (h * n_total + from) * kD,
                 x.begin() + (h * n_total + from + n) * kD);
    }
    return s;
}
} // namespace

TEST(GpuKVCache, PrefillAndDecodeMatchKVCache) {
    KVINDEX_REQUIRE_GPU();
    const idx_t n_prompt = 400, steps = 40, n_total = n_prompt + steps;
    for (const char* s : {"Sink2,Window8,TopK(Flat)|k=16", "BF16,Flat", "GPU,Window32,TopK(Flat)"}) {
        GpuKVCache gpu(kLayers, kQHeads, kKVHeads, kD, kD, s, "Flat", {0});
        std::string cpu_string = s;
        if (cpu_string.rfind("GPU,", 0) == 0) {
            cpu_string = cpu_string.substr(4);
        }
        KVCache cpu(kLayers, kQHeads, kKVHeads, kD, kD, cpu_string, "Flat", {0});
        RopeParams rope;
        std::vector<std::vector<float>> keys, values;
        for (int l = 0; l < kLayers; l++) {
            keys.push_back(gaussian(kKVHeads * n_total, kD, 10 + l, 1.0f, 1.0f));
            values.push_back(gaussian(kKVHeads * n_total, kD, 20 + l));
            auto k = slice(keys[l], n_total, 0, n_prompt), v = slice(values[l], n_total, 0, n_prompt);
            gpu.prefill(l, n_prompt, k.data(), v.data(), 0, nullptr, nullptr, rope);
            cpu.prefill(l, n_prompt, k.data(), v.data(), 0, nullptr, nullptr, rope);
        }
        std::vector<float> go(kQHeads * kD), gl(kQHeads), co(kQHeads * kD), cl(kQHeads);
        for (idx_t t = 0; t < steps; t++) {
            for (int l = 0; l < kLayers; l++) {
                auto k = slice(keys[l], n_total, n_prompt + t, 1);
                auto v = slice(values[l], n_total, n_prompt + t, 1);
                gpu.append(l, 1, k.data(), v.data());
                cpu.append(l, 1, k.data(), v.data());
                auto q = gaussian(kQHeads, kD, 1000 * l + t, 1.0f, -0.5f);
                gpu.attend(l, 1, q.data(), go.data(), gl.data());
                cpu.attend(l, 1, q.data(), co.data(), cl.data());
                ASSERT_LE(rel_err(go.data(), co.data(), go.size()), 2e-5)
                        << s << " layer " << l << " step " << t;
                for (int h = 0; h < kQHeads; h++) {
                    ASSERT_NEAR(gl[h], cl[h], 2e-5 * std::max(1.0f, std::abs(cl[h])));
                }
            }
        }
        EXPECT_EQ(gpu.n_tokens(1), n_total);
    }
}

TEST(GpuKVCache, DeviceArraysGiveTheHostAnswer) {
    KVINDEX_REQUIRE_GPU();
    const idx_t n = 3000, nq = 2;
    GpuKVCache gpu(1, kQHeads, kKVHeads, kD, kD, "BF16,Sink4,Window64,TopK(Flat)|k=100");
    auto k = gaussian(kKVHeads * n, kD, 1, 1.0f, 1.0f), v = gaussian(kKVHeads * n, kD, 2);
    gpu.append(0, n, k.data(), v.data());
    auto q = gaussian(kQHeads * nq, kD, 3);
    std::vector<float> ho(q.size()), hl(kQHeads * nq), d_o(q.size()), d_l(kQHeads * nq);
    gpu.attend(0, nq, q.data(), ho.data(), hl.data());
    float *qd = nullptr, *od = nullptr, *ld = nullptr;
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&qd), q.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&od), q.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&ld), hl.size() * 4), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(qd, q.data(), q.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    gpu.attend_device(0, nq, qd, od, ld);
    gpu.resources->synchronize("test");
    ASSERT_EQ(cudaMemcpy(d_o.data(), od, q.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(d_l.data(), ld, hl.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    cudaFree(qd);
    cudaFree(od);
    cudaFree(ld);
    EXPECT_EQ(ho, d_o);
    EXPECT_EQ(hl, d_l);
}

TEST(GpuKVCache, ToCpuKeepsTokensStringsAndKnobs) {
    KVINDEX_REQUIRE_GPU();
    const idx_t n = 500;
    GpuKVCache gpu(kLayers, kQHeads, kKVHeads, kD, kD, "FP16,GPU,Sink4,TopK(Flat)|k=9", "FP16,Flat",
                   {1});
    for (int l = 0; l < kLayers; l++) {
        auto k = gaussian(kKVHeads * n, kD, 5 + l), v = gaussian(kKVHeads * n, kD, 7 + l);
        RopeParams rope;
        rope.theta = 5e5;
        gpu.prefill(l, n, k.data(), v.data(), 0, nullptr, nullptr, rope);
    }
    std::unique_ptr<KVCache> cpu = gpu.to_cpu();
    EXPECT_EQ(cpu->index_string, "FP16,Sink4,TopK(Flat)|k=9");
    EXPECT_EQ(cpu->index(0, 1)->top_k_budget(), 9);
    EXPECT_EQ(cpu->n_tokens(0), n);
    EXPECT_TRUE(cpu->has_rope);
    EXPECT_EQ(cpu->rope.theta, 5e5);
    std::vector<float> a, b, rec(kD);
    gpu.layers[0].read(1, 0, n, &a, &b, gpu.resources->stream());
    for (idx_t i : {idx_t(0), idx_t(3), idx_t(250), n - 1}) {
        cpu->index(0, 1)->reconstruct(i, rec.data());
        EXPECT_EQ(std::vector<float>(a.begin() + i * kD, a.begin() + (i + 1) * kD), rec) << i;
    }
}

// The shape is checked before any device is asked for: these run (and pass)
// on a machine without one.
TEST(GpuKVCache, ABadShapeIsNamedBeforeTheDevice) {
    EXPECT_THROW_MSG(GpuKVCache(0, 4, 2, kD, kD, "Flat"), "GpuKVCache: n_layers=0");
    EXPECT_THROW_MSG(GpuKVCache(1 << 16, 4, 2, kD, kD, "Flat"), "n_layers=65536");
    EXPECT_THROW_MSG(GpuKVCache(2, 5, 2, kD, kD, "Flat"), "n_q_heads=5 is not a multiple of n_kv_heads=2");
    EXPECT_THROW_MSG(GpuKVCache(2, 4, 2, 0, kD, "Flat"), "d=0");
    EXPECT_THROW_MSG(GpuKVCache(2, 4, 2, kD, 1 << 20, "Flat"), "d_value=1048576");
    EXPECT_THROW_MSG(GpuKVCache(2, 4, 2, kD, kD, "Flat", "Flat", {-1}), "dense layer -1");
    // named before any member is sized by it (16 GiB of per-layer counters)
    EXPECT_THROW_MSG(GpuKVCache(INT_MAX, 4, 2, kD, kD, "Flat"), "n_layers=2147483647");
}

TEST(GpuKVCache, BadInputThrows) {
    KVINDEX_REQUIRE_GPU();
    EXPECT_THROW_MSG(GpuKVCache(2, 5, 2, kD, kD, "Flat"), "multiple");
    EXPECT_THROW_MSG(GpuKVCache(2, 4, 2, 48, 48, "Flat"), "d=48");
    EXPECT_THROW_MSG(GpuKVCache(2, 4, 2, kD, kD, "RoarGraph16"), "no GPU twin");
    EXPECT_THROW_MSG(GpuKVCache(2, 4, 2, kD, kD, "LSHSample10x150"), "per-head state");
    EXPECT_THROW_MSG(GpuKVCache(2, 4, 2, kD, kD, "Flat", "Flat", {2}), "dense layer 2");
    GpuKVCache c(2, 4, 2, kD, kD, "Flat");
    auto q = gaussian(4, kD, 1);
    std::vector<float> out(4 * kD), lse(4);
    EXPECT_THROW_MSG(c.attend(0, 1, q.data(), out.data(), lse.data()), "empty");
    EXPECT_THROW_MSG(c.attend(2, 1, q.data(), out.data(), lse.data()), "layer 2");
    auto k = gaussian(2 * 10, kD, 2), v = gaussian(2 * 10, kD, 3);
    k[7] = NAN;
    EXPECT_THROW_MSG(c.append(0, 10, k.data(), v.data()), "non-finite");
    EXPECT_EQ(c.n_tokens(0), 0);
    k[7] = 0.5f;
    c.append(0, 10, k.data(), v.data());
    q[3] = NAN;
    EXPECT_THROW_MSG(c.attend(0, 1, q.data(), out.data(), lse.data()), "non-finite");
    RopeParams rope;
    EXPECT_THROW_MSG(c.prefill(0, 10, k.data(), v.data(), 0, nullptr, nullptr, rope), "already");

    // what KVCache refuses, the GPU cache refuses too (it checked only
    // that values were finite): values above kMaxInputMagnitude, whose
    // scores overflow float on the device
    q[3] = 0.5f;
    std::vector<float> huge = k;
    huge[5] = 1e20f;
    EXPECT_THROW_MSG(c.append(0, 10, huge.data(), v.data()), "too large a value");
    std::vector<float> huge_q = q;
    huge_q[2] = -1e20f;
    EXPECT_THROW_MSG(c.attend(0, 1, huge_q.data(), out.data(), lse.data()), "too large a value");
    // a count whose buffer size wraps (the product read nothing, and
    // reserve took 2^60 tokens of a null array)
    EXPECT_THROW_MSG(c.append(1, idx_t(1) << 60, k.data(), v.data()), "more than any buffer");
    EXPECT_EQ(c.n_tokens(1), 0);
    // RoPE theta 0: to_cpu refused it later
    RopeParams no_theta;
    no_theta.theta = 0;
    EXPECT_THROW_MSG(c.prefill(1, 10, k.data(), v.data(), 0, nullptr, nullptr, no_theta), "theta=0");
    EXPECT_EQ(c.n_tokens(1), 0);
    // knobs the layer's index would not read (Flat reads no nprobe), and
    // Faiss's own subclasses, are refused, not ignored
    SearchParametersTopK nprobe;
    nprobe.nprobe = 8;
    EXPECT_THROW_MSG(c.attend(0, 1, q.data(), out.data(), lse.data(), &nprobe), "does not apply");
    faiss::SearchParametersIVF ivf;
    EXPECT_THROW_MSG(c.attend(0, 1, q.data(), out.data(), lse.data(), &ivf), "Faiss SearchParameters subclass");
    c.attend(0, 1, q.data(), out.data(), lse.data());
    EXPECT_EQ(c.n_tokens(0), 10);
}

TEST(GpuKVCache, FromCpuAnswersAsTheCpuCache) {
    KVINDEX_REQUIRE_GPU();
    const idx_t n = 800;
    KVCache cpu(kLayers, kQHeads, kKVHeads, kD, kD, "BF16,Sink4,Window32,TopK(Flat)", "BF16,Flat",
                {0});
    for (int l = 0; l < kLayers; l++) {
        auto k = gaussian(kKVHeads * n, kD, 40 + l, 1.0f, 0.7f), v = gaussian(kKVHeads * n, kD, 50 + l);
        RopeParams rope;
        cpu.prefill(l, n, k.data(), v.data(), 0, nullptr, nullptr, rope);
        if (l == 1) { // the sparse layer: its inner TopK's budget
            for (int h = 0; h < kKVHeads; h++) {
                cpu.index(l, h)->mutable_children().at(0)->k = 24;
            }
        }
    }
    auto gpu = GpuKVCache::from_cpu(cpu);
    EXPECT_EQ(gpu->layer_index[1]->k, 24);
    auto q = gaussian(kQHeads * 2, kD, 60);
    std::vector<float> go(q.size()), gl(kQHeads * 2), co(q.size()), cl(kQHeads * 2);
    for (int l = 0; l < kLayers; l++) {
        gpu->attend(l, 2, q.data(), go.data(), gl.data());
        cpu.attend(l, 2, q.data(), co.data(), cl.data());
        EXPECT_LE(rel_err(go.data(), co.data(), go.size()), 2e-5) << "layer " << l;
    }
}
