// GpuIndexProxyEvict and gpu::proxy_scores against the CPU side:
//  - the device scores against an independent double-precision reference
//    and the CPU proxy_scores (OOD data, tile edges, causal rows that see
//    no key);
//  - the kept positions against the CPU twin's (every policy), and exactly
//    against the CPU choice made from the device's own scores;
//  - attend / select / search / reconstruct against the CPU twin holding
//    the same kept tokens, after prefill and after decode appends;
//  - the converters, io, knobs, KVCache with the GPU string, bad input.
// The tests without KVINDEX_REQUIRE_GPU need no device (registry rows,
// argument checks, forged records) and run everywhere.
//
// Tolerances. Scores: the device computes s_rj in float32 (as the CPU
// does: float dot products), exponentials in float, and sums at most 256
// terms a thread in float before the splits are added in double; the
// errors relative to a score are ~1e-6 .. 1e-5 on OOD data, so each score
// must be within 1e-4 of the largest one (the CPU's own float dot products
// err as much against the double reference). Kept sets: a token may differ
// from the CPU twin's only where its CPU score is within that same bound of
// the boundary score (a near-tie the float scores cannot order); on data
// built without near-ties, and against the CPU choice from the device's
// scores, the sets are equal. Outputs: as test_gpu_flat.cpp (2e-5).

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <kvindex/IndexProxyEvict.h>
#include <kvindex/KVCache.h>
#include <kvindex/gpu/GpuCloner.h>
#include <kvindex/gpu/GpuIndexProxyEvict.h>
#include <kvindex/gpu/GpuKVCache.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>
#include <kvindex/registry.h>

#include "device_memory.h"
#include "expect_throw.h"
#include "forge.h"
#include "gpu_test.h"
#include "proxy_scores.h"

using namespace kvindex;
using kvtest::gaussian;
using kvtest::make_kv;
using kvtest::rel_err;

namespace {

constexpr double kScoreTol = 1e-4; ///< of the largest score (see the top)
constexpr double kTwinTol = 2e-5;  ///< outputs and lse against the CPU twin

std::shared_ptr<GpuResources> res() {
    return default_gpu_resources(0);
}

/** gpu::proxy_scores on host arrays, as double. The output is poisoned
 * with NaN and the workspace with 0xff bytes first, so that an element the
 * kernels do not write, or a partial they read unwritten, shows. */
std::vector<double> device_scores(
        const float* keys,
        idx_t n,
        int d,
        const float* queries,
        int n_heads,
        idx_t n_q,
        const idx_t* q_pos,
        idx_t first_pos,
        bool causal) {
    auto r = res();
    DeviceScope scope(r->device());
    cudaStream_t stream = r->stream();
    gpu::DeviceScratch keys_d = gpu::upload(keys, size_t(n) * d, stream, "test: keys");
    gpu::DeviceScratch queries_d =
            gpu::upload(queries, size_t(n_heads) * n_q * d, stream, "test: queries");
    const std::vector<int64_t> pos(q_pos, q_pos + n_q);
    gpu::DeviceScratch pos_d = gpu::upload(pos.data(), pos.size(), stream, "test: positions");
    gpu::DeviceScratch scores_d(size_t(n) * sizeof(float), stream);
    gpu::check_cuda(cudaMemsetAsync(scores_d.get(), 0xff, size_t(n) * sizeof(float), stream),
                    "test: poison scores");
    gpu::Workspace sizing = gpu::Workspace::sizing();
    gpu::proxy_scores(nullptr, n, d, nullptr, n_heads, n_q, nullptr, first_pos, causal, nullptr,
                      sizing, stream);
    gpu::DeviceScratch ws_d(sizing.used, stream);
    gpu::check_cuda(cudaMemsetAsync(ws_d.get(), 0xff, sizing.used, stream),
                    "test: poison workspace");
    gpu::Workspace ws(ws_d.get(), sizing.used);
    gpu::proxy_scores(keys_d.as<float>(), n, d, queries_d.as<float>(), n_heads, n_q,
                      pos_d.as<int64_t>(), first_pos, causal, scores_d.as<float>(), ws, stream);
    std::vector<float> f(static_cast<size_t>(n));
    gpu::download(f.data(), scores_d.get(), f.size(), stream, "test: scores");
    r->synchronize("test: proxy_scores");
    return std::vector<double>(f.begin(), f.end());
}

/// device_scores as a ProxyScorer (what GpuIndexProxyEvict runs).
void device_scorer(const float* keys, idx_t n, int d, const float* queries, int n_heads,
                   idx_t n_q, const idx_t* q_pos, idx_t first_pos, bool causal, double* scores) {
    std::vector<double> f =
            device_scores(keys, n, d, queries, n_heads, n_q, q_pos, first_pos, causal);
    std::copy(f.begin(), f.end(), scores);
}

/// The scores in double throughout (s_rj too): independent of both sides.
std::vector<double> ref_proxy_scores(
        const float* keys,
        idx_t n,
        int d,
        const float* queries,
        int n_heads,
        idx_t n_q,
        const idx_t* q_pos,
        idx_t first_pos,
        bool causal) {
    std::vector<double> F(n, 0.0), s(n);
    for (idx_t r = 0; r < n_heads * n_q; r++) {
        const idx_t m = causal ? std::min<idx_t>(n, q_pos[r % n_q] - first_pos + 1) : n;
        if (m <= 0) {
            continue;
        }
        double mx = -INFINITY;
        for (idx_t j = 0; j < m; j++) {
            double acc = 0;
            for (int c = 0; c < d; c++) {
                acc += double(queries[r * d + c]) * keys[j * d + c];
            }
            s[j] = acc / std::sqrt(double(d));
            mx = std::max(mx, s[j]);
        }
        double z = 0;
        for (idx_t j = 0; j < m; j++) {
            z += std::exp(s[j] - mx);
        }
        for (idx_t j = 0; j < m; j++) {
            F[j] += std::exp(s[j] - mx) / z;
        }
    }
    return F;
}

/// A prompt of n tokens with a query of each of n_heads heads at every position.
struct Prompt {
    idx_t n = 0;
    int d = 0;
    int n_heads = 1;
    std::vector<float> keys, values, queries; ///< [n][d], [n][d], [n_heads][n][d]

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

/// OOD keys and queries (gpu_test.h make_kv).
Prompt ood_prompt(idx_t n, int d, int n_heads, uint64_t seed) {
    auto x = make_kv(n, size_t(n_heads) * n, d, seed, true);
    Prompt p;
    p.n = n;
    p.d = d;
    p.n_heads = n_heads;
    p.keys = std::move(x.keys);
    p.values = std::move(x.values);
    p.queries = std::move(x.queries);
    return p;
}

/** A prompt whose scores have no near-tie: key j = (level of j) * e_0 +
 * noise on the other coordinates, levels a shuffled 0, step, 2 step, ...;
 * every query is b * e_0 (b in [1, 1.5], zero elsewhere). Then s_rj = b
 * level_j / sqrt(d) exactly, consecutive levels differ by >= 0.01 in every
 * row's score, and the non-causal F is increasing in the level with
 * consecutive values >= 1% apart: the CPU and the device order every pair
 * of tokens alike (top part, max-pooling, the order the random draws are
 * assigned in). */
Prompt separated_prompt(idx_t n, int d, int n_heads, uint64_t seed) {
    Prompt p;
    p.n = n;
    p.d = d;
    p.n_heads = n_heads;
    p.keys = gaussian(n, d, seed, 1.0f, 0.5f);
    p.values = gaussian(n, d, seed + 1);
    std::vector<idx_t> level(n);
    std::iota(level.begin(), level.end(), idx_t(0));
    std::mt19937_64 rng(seed + 2);
    std::shuffle(level.begin(), level.end(), rng);
    const float step = 0.01f * std::sqrt(float(d));
    for (idx_t j = 0; j < n; j++) {
        p.keys[j * d] = float(level[j]) * step;
    }
    std::uniform_real_distribution<float> b(1.0f, 1.5f);
    p.queries.assign(size_t(n_heads) * n * d, 0.0f);
    for (size_t r = 0; r < size_t(n_heads) * n; r++) {
        p.queries[r * d] = b(rng);
    }
    return p;
}

IndexProxyEvict& as_evict(KVIndex& index) {
    auto e = dynamic_cast<IndexProxyEvict*>(&index);
    EXPECT_TRUE(e) << index.type_name();
    return *e;
}

GpuIndexProxyEvict& as_gpu_evict(KVIndex& index) {
    auto e = dynamic_cast<GpuIndexProxyEvict*>(&index);
    EXPECT_TRUE(e) << index.type_name();
    return *e;
}

/** a (device) and b (CPU) kept sets agree up to near-ties: every token in
 * one and not the other has a CPU score within kScoreTol of the CPU
 * boundary (the lowest score the CPU kept among the tokens it chose by
 * score), relative to it: a swap of x for y needs the two sides to order
 * them differently, so |F_x - F_y| <= the two scores' errors (~1e-5
 * relative each), and the boundary lies between them. */
void expect_same_kept_up_to_ties(
        const std::vector<idx_t>& a,
        const std::vector<idx_t>& b,
        const std::vector<double>& F,
        const EvictBudget& budget,
        const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    const idx_t n = idx_t(F.size());
    auto is_protected = [&](idx_t j) { return j < budget.n_sink || j >= n - budget.n_recent; };
    double boundary = INFINITY;
    for (idx_t j : b) {
        if (!is_protected(j)) {
            boundary = std::min(boundary, F[j]);
        }
    }
    std::set<idx_t> sa(a.begin(), a.end()), sb(b.begin(), b.end());
    int differ = 0;
    for (idx_t j = 0; j < n; j++) {
        if (sa.count(j) != sb.count(j)) {
            differ++;
            EXPECT_FALSE(is_protected(j)) << what << ": protected token " << j;
            EXPECT_LE(std::abs(F[j] - boundary), kScoreTol * boundary)
                    << what << ": token " << j << " (score " << F[j] << ", boundary " << boundary
                    << ") kept by one side only, not a near-tie";
        }
    }
    // a near-tie swaps a token (or a pooled plateau) for another: few of them
    EXPECT_LE(differ, std::max<idx_t>(8, idx_t(a.size()) / 20)) << what;
}

/// The CPU scores F (double, before pooling) that choose_kept uses for `in`.
std::vector<double> cpu_scores_of(const IndexProxyEvict& e, const PrefillInput& in) {
    std::vector<double> F(in.n_tokens, 0.0);
    e.choose_kept(in, [&](const float* keys, idx_t n, int d, const float* q, int h, idx_t nq,
                          const idx_t* pos, idx_t first, bool causal, double* scores) {
        proxy_scores(keys, n, d, q, h, nq, pos, first, causal, scores);
        F.assign(scores, scores + n);
    });
    return F;
}

/// search of a and b agree: distances within tol, labels equal but where
/// the CPU's distances tie within tol.
void expect_same_search(const std::vector<float>& gd, const std::vector<idx_t>& gl,
                        const std::vector<float>& cd, const std::vector<idx_t>& cl, idx_t k,
                        const std::string& what) {
    for (size_t i = 0; i < gd.size(); i++) {
        const float tol = float(kTwinTol) * std::max(1.0f, std::abs(cd[i]));
        EXPECT_NEAR(gd[i], cd[i], tol) << what << " rank " << i % k;
        if (gl[i] != cl[i]) {
            const size_t j = i % size_t(k);
            const bool tie = (j > 0 && std::abs(cd[i] - cd[i - 1]) <= tol) ||
                    (j + 1 < size_t(k) && std::abs(cd[i] - cd[i + 1]) <= tol);
            EXPECT_TRUE(tie) << what << ": label " << gl[i] << " vs " << cl[i] << " at rank " << j;
        }
    }
}

} // namespace

// ---- no device needed -----------------------------------------------------

TEST(GpuEvictRegistry, RowAndTwinAreListed) {
    register_gpu_index_types();
    IndexTypeInfo row = index_type("GpuIndexProxyEvict");
    EXPECT_EQ(row.fourcc, fourcc("KGpe"));
    std::set<uint32_t> tags;
    for (const IndexTypeInfo& t : index_types()) {
        EXPECT_TRUE(tags.insert(t.fourcc).second) << t.name << ": fourcc taken";
    }
    for (const char* s : {"ProxyEvict20", "ProxyEvict20,Flat", "BF16,ProxyEvict30_H2O",
                          "ProxyEvict10_TOVA", "FP16,ProxyEvict20_StreamingLLM",
                          "ProxyEvict20_Random"}) {
        EXPECT_TRUE(GpuIndexProxyEvict::accepts_cpu(*index_factory(64, s))) << s;
    }
    for (const char* s : {"Flat", "ProxyEvict20,TopK(Flat)", "Sink4,Window8,ProxyEvict20"}) {
        EXPECT_FALSE(GpuIndexProxyEvict::accepts_cpu(*index_factory(64, s))) << s;
    }
    // refused before any device is touched, listing the eviction row
    auto cpu = index_factory(64, "ProxyEvict20,TopK(Flat)");
    EXPECT_THROW_MSG(index_cpu_to_gpu(nullptr, cpu.get()), "ProxyEvict<P>");
}

TEST(GpuEvictRegistry, ForgedGpuRecordIsRefused) {
    register_gpu_index_types();
    auto cpu = index_factory(64, "ProxyEvict20");
    std::vector<uint8_t> buf;
    write_index(cpu.get(), &buf);
    // the GPU tag, and a record version its row reads (the CPU record is v3)
    const uint32_t tag = fourcc("KGpe"), version = 1;
    std::memcpy(buf.data() + kvtest::kIndexHeaderSize, &tag, 4);
    std::memcpy(buf.data() + kvtest::kIndexHeaderSize + 4, &version, 4);
    kvtest::forge_header(buf);
    EXPECT_THROW_MSG(read_index(buf), "forged");
}

TEST(GpuProxyScores, ShapesAreCheckedAndTheWorkspaceSizedWithoutDevice) {
    auto sized = [](int64_t n, int d, int heads, int64_t n_q, int64_t first, bool causal) {
        gpu::Workspace ws = gpu::Workspace::sizing();
        gpu::proxy_scores(nullptr, n, d, nullptr, heads, n_q, nullptr, first, causal, nullptr, ws,
                          nullptr);
        return ws.used;
    };
    EXPECT_THROW_MSG(sized(100, 6, 1, 3, 0, false), "d=6");
    EXPECT_THROW_MSG(sized(100, 0, 1, 3, 0, false), "d=0");
    EXPECT_THROW_MSG(sized(-1, 64, 1, 3, 0, false), "n=-1");
    EXPECT_THROW_MSG(sized(100, 64, 0, 3, 0, false), "n_heads=0");
    EXPECT_THROW_MSG(sized(100, 64, 1, -2, 0, false), "n_q=-2");
    EXPECT_THROW_MSG(sized(100, 64, 1, 3, -5, true), "first_pos=-5");
    // the bytes depend on the shapes only: nothing without keys, a token
    // without rows (the output is zeroed then)
    EXPECT_EQ(sized(0, 64, 3, 10, 0, true), 0u);
    EXPECT_GT(sized(100, 64, 1, 0, 0, true), 0u);
    EXPECT_LE(sized(100, 64, 1, 0, 0, true), 256u);
    const size_t big = sized(131072, 128, 4, 23593, 0, false);
    EXPECT_GT(big, size_t(4) * 131072);
    EXPECT_EQ(big, sized(131072, 128, 4, 23593, 0, false));
    EXPECT_LT(sized(131072, 128, 4, 131072, 0, true), size_t(1) << 30); // H2O at 128k: < 1 GB
}

// ---- the scores -------------------------------------------------------------

TEST(GpuProxyScores, MatchTheDoubleReferenceAndTheCpu) {
    KVINDEX_REQUIRE_GPU();
    struct Case {
        idx_t n;
        int d;
        int heads;
        idx_t n_q;
        bool causal;
        idx_t first;
    };
    // n and n_q off the 64-tiles, d = 36 (a partial 32-chunk), 256, rows
    // that see no key (positions before first_pos)
    const Case cases[] = {
            {1000, 64, 1, 1, false, 0},    {1000, 128, 3, 37, true, 0},
            {1000, 64, 3, 300, false, 0},  {5003, 128, 1, 300, true, 0},
            {5003, 64, 3, 37, false, 0},   {5003, 128, 3, 1, true, 0},
            {777, 36, 2, 50, true, 100},   {64, 256, 1, 64, true, 0},
            {3000, 128, 1, 200, true, 7},
    };
    uint64_t seed = 100;
    for (const Case& c : cases) {
        seed += 10;
        auto x = make_kv(c.n, size_t(c.heads) * c.n_q, c.d, seed, true);
        std::vector<idx_t> pos(c.n_q);
        std::mt19937_64 rng(seed);
        std::uniform_int_distribution<idx_t> any(0, c.first + c.n + 3);
        for (idx_t& p : pos) {
            p = any(rng);
        }
        if (c.n_q > 2) {
            pos[0] = c.first + c.n - 1; // sees every key
            pos[1] = c.first;           // sees one key
        }
        if (c.n_q > 3 && c.first > 0) {
            pos[2] = c.first - 1;       // sees none
        }
        std::string what = "n=" + std::to_string(c.n) + " d=" + std::to_string(c.d) +
                " heads=" + std::to_string(c.heads) + " n_q=" + std::to_string(c.n_q) +
                (c.causal ? " causal" : "");
        auto F = device_scores(x.keys.data(), c.n, c.d, x.queries.data(), c.heads, c.n_q,
                               pos.data(), c.first, c.causal);
        auto ref = ref_proxy_scores(x.keys.data(), c.n, c.d, x.queries.data(), c.heads, c.n_q,
                                    pos.data(), c.first, c.causal);
        std::vector<double> cpu(c.n);
        proxy_scores(x.keys.data(), c.n, c.d, x.queries.data(), c.heads, c.n_q, pos.data(),
                     c.first, c.causal, cpu.data());
        double fmax = 0, sum = 0;
        for (double f : ref) {
            fmax = std::max(fmax, f);
        }
        for (idx_t j = 0; j < c.n; j++) {
            ASSERT_TRUE(std::isfinite(F[j])) << what << ": score " << j << " not written";
            EXPECT_NEAR(F[j], ref[j], kScoreTol * fmax) << what << " key " << j;
            EXPECT_NEAR(F[j], cpu[j], kScoreTol * fmax) << what << " key " << j;
            sum += F[j];
        }
        // each row that sees a key spreads a probability of 1 over them
        idx_t seeing = 0;
        for (idx_t r = 0; r < c.heads * c.n_q; r++) {
            seeing += !c.causal || pos[r % c.n_q] >= c.first;
        }
        EXPECT_NEAR(sum, double(seeing), 1e-4 * std::max<double>(1, seeing)) << what;
    }
}

TEST(GpuProxyScores, RowsThatSeeNoKeyContributeNothing) {
    KVINDEX_REQUIRE_GPU();
    const idx_t n = 300, n_q = 70;
    const int d = 64;
    auto x = make_kv(n, 2 * n_q, d, 7, true);
    std::vector<idx_t> pos(n_q);
    for (idx_t i = 0; i < n_q; i++) {
        pos[i] = i; // all before first_pos = 500
    }
    auto F = device_scores(x.keys.data(), n, d, x.queries.data(), 2, n_q, pos.data(), 500, true);
    for (idx_t j = 0; j < n; j++) {
        ASSERT_EQ(F[j], 0.0) << j;
    }
    // no row at all: zeros, every element written
    F = device_scores(x.keys.data(), n, d, x.queries.data(), 2, 0, pos.data(), 0, true);
    for (idx_t j = 0; j < n; j++) {
        ASSERT_EQ(F[j], 0.0) << j;
    }
}

// ---- the kept tokens ---------------------------------------------------------

TEST(GpuEvict, PrefillKeepsTheCpuTwinsPositions) {
    KVINDEX_REQUIRE_GPU();
    register_gpu_index_types();
    const int d = 64;
    const idx_t n = 1000;
    const Prompt p = separated_prompt(n, d, 2, 11);
    // scores without near-ties: equal sets, random part included
    for (const char* s :
         {"ProxyEvict20", "ProxyEvict20|proxy_tokens=40", "ProxyEvict20|pool=5",
          "ProxyEvict30|budget=123,seed=77,n_sink=2", "ProxyEvict10_TOVA",
          "ProxyEvict20_StreamingLLM", "ProxyEvict20_Random", "ProxyEvict25_TOVA|pool=3"}) {
        auto cpu = index_factory(d, s);
        auto gpu = index_factory(d, std::string("GPU,") + s);
        ASSERT_STREQ(gpu->type_name(), "GpuIndexProxyEvict") << s;
        cpu->set_stream(5);
        gpu->set_stream(5);
        cpu->prefill(p.input());
        gpu->prefill(p.input());
        EXPECT_EQ(as_gpu_evict(*gpu).positions, as_evict(*cpu).positions) << s;
        EXPECT_EQ(gpu->ntotal, n);
    }
    // H2O is causal: its scores are not monotone in the level, so near-ties
    // may exist; a difference must be one
    for (const char* s : {"ProxyEvict20_H2O", "ProxyEvict35_H2O|pool=3"}) {
        auto cpu = index_factory(d, s);
        auto gpu = index_factory(d, std::string("GPU,") + s);
        cpu->prefill(p.input());
        gpu->prefill(p.input());
        const IndexProxyEvict& e = as_evict(*cpu);
        auto F = cpu_scores_of(e, p.input());
        if (e.pool > 1) { // what choose_kept compares
            std::vector<double> pooled(F.size());
            const idx_t r = e.pool / 2;
            for (idx_t j = 0; j < n; j++) {
                pooled[j] = *std::max_element(F.begin() + std::max<idx_t>(0, j - r),
                                              F.begin() + std::min<idx_t>(n, j + r + 1));
            }
            F = pooled;
        }
        expect_same_kept_up_to_ties(as_gpu_evict(*gpu).positions, e.positions, F,
                                    e.budget_for(n), s);
    }
}

TEST(GpuEvict, PrefillOnOodDataKeepsTheCpuTwinsPositionsUpToTies) {
    KVINDEX_REQUIRE_GPU();
    register_gpu_index_types();
    const int d = 128;
    const idx_t n = 2000;
    const Prompt p = ood_prompt(n, d, 3, 21);
    // the policies whose choice is a top-k (no random part): NaCl with its
    // random share moved to the top part, H2O, TOVA
    for (const char* s : {"ProxyEvict20|protect=2,proxy_keep=18", "ProxyEvict20_H2O",
                          "ProxyEvict10_TOVA", "ProxyEvict20|protect=2,proxy_keep=18,proxy_tokens=64"}) {
        auto cpu = index_factory(d, s);
        auto gpu = index_factory(d, std::string("GPU,") + s);
        cpu->prefill(p.input());
        gpu->prefill(p.input());
        const IndexProxyEvict& e = as_evict(*cpu);
        ASSERT_EQ(e.budget_for(n).n_random, 0) << s;
        expect_same_kept_up_to_ties(as_gpu_evict(*gpu).positions, e.positions,
                                    cpu_scores_of(e, p.input()), e.budget_for(n), s);
    }
}

TEST(GpuEvict, KeptTokensAreTheCpuChoiceFromTheDeviceScores) {
    KVINDEX_REQUIRE_GPU();
    register_gpu_index_types();
    // the scoring hook is the only difference: the CPU policy fed the
    // device's scores chooses exactly what the GPU index keeps (the kernels
    // are deterministic: no atomics, a plan that does not depend on the device)
    const int d = 128;
    const idx_t n = 1500;
    const Prompt p = ood_prompt(n, d, 2, 31);
    for (const char* s : {"ProxyEvict20", "ProxyEvict20|proxy_tokens=50,pool=5", "ProxyEvict25_H2O",
                          "ProxyEvict10_TOVA", "ProxyEvict30_Random"}) {
        auto cpu = index_factory(d, s);
        auto gpu = index_factory(d, std::string("GPU,") + s);
        cpu->set_stream(9);
        gpu->set_stream(9);
        gpu->prefill(p.input());
        std::vector<idx_t> expect = as_evict(*cpu).choose_kept(p.input(), device_scorer);
        EXPECT_EQ(as_gpu_evict(*gpu).positions, expect) << s;
    }
}

// ---- queries over the kept tokens -------------------------------------------

TEST(GpuEvict, AttendSelectSearchMatchTheCpuTwin) {
    KVINDEX_REQUIRE_GPU();
    const int d = 128;
    const idx_t n = 3000, nq = 5, steps = 20, k_search = 10;
    for (KVType t : {KVType::f32, KVType::bf16}) {
        for (const char* s : {"ProxyEvict20", "ProxyEvict25_H2O"}) {
            const std::string str = std::string(kv_type_prefix(t)) + s;
            const Prompt p = ood_prompt(n, d, 2, 41);
            auto cpu = index_factory(d, str);
            cpu->set_stream(3);
            cpu->prefill(p.input());
            // the same kept tokens on the device: the CPU index converted
            auto gpu = index_cpu_to_gpu(res(), cpu.get());
            ASSERT_STREQ(gpu->type_name(), "GpuIndexProxyEvict");
            const std::vector<idx_t>& kept = as_evict(*cpu).positions;
            EXPECT_EQ(as_gpu_evict(*gpu).positions, kept);
            EXPECT_EQ(gpu->ntotal, n);
            auto x = make_kv(steps, nq * (steps + 1), d, 43, true);
            for (idx_t step = 0; step <= steps; step++) {
                const std::string what = str + " step " + std::to_string(step);
                const float* q = x.queries.data() + step * nq * d;
                std::vector<float> go(nq * d), gl(nq), co(nq * d), cl(nq);
                gpu->attend(nq, q, go.data(), gl.data());
                cpu->attend(nq, q, co.data(), cl.data());
                EXPECT_LE(rel_err(go.data(), co.data(), go.size()), kTwinTol) << what;
                for (idx_t i = 0; i < nq; i++) {
                    EXPECT_NEAR(gl[i], cl[i], kTwinTol * std::max(1.0f, std::abs(cl[i]))) << what;
                }
                std::vector<Selection> gs(nq), cs(nq);
                gpu->select(nq, q, gs.data());
                cpu->select(nq, q, cs.data());
                for (idx_t i = 0; i < nq; i++) {
                    EXPECT_EQ(gs[i].ids, cs[i].ids) << what;
                    EXPECT_EQ(gs[i].inclusion, cs[i].inclusion) << what;
                }
                std::vector<float> gd(nq * k_search), cd(nq * k_search);
                std::vector<idx_t> glab(nq * k_search), clab(nq * k_search);
                gpu->search(nq, q, k_search, gd.data(), glab.data());
                cpu->search(nq, q, k_search, cd.data(), clab.data());
                expect_same_search(gd, glab, cd, clab, k_search, what);
                if (step == steps) {
                    break;
                }
                // decode: a generated token, never evicted
                gpu->add_kv(1, x.keys.data() + step * d, x.values.data() + step * d);
                cpu->add_kv(1, x.keys.data() + step * d, x.values.data() + step * d);
            }
            EXPECT_EQ(gpu->ntotal, n + steps);
            EXPECT_EQ(as_gpu_evict(*gpu).positions, as_evict(*cpu).positions);
            // search past the stored count pads as Faiss does
            const idx_t stored = idx_t(as_gpu_evict(*gpu).positions.size());
            std::vector<float> dis(stored + 3);
            std::vector<idx_t> lab(stored + 3);
            gpu->search(1, x.queries.data(), stored + 3, dis.data(), lab.data());
            EXPECT_EQ(lab[stored + 2], -1);
            EXPECT_GE(lab[stored - 1], 0);
            // reconstruct: kept tokens as stored, evicted ones refused as on the CPU
            std::vector<float> a(d), b(d);
            idx_t evicted = -1;
            for (idx_t j = 0; j < n && evicted < 0; j++) {
                if (!std::binary_search(kept.begin(), kept.end(), j)) {
                    evicted = j;
                }
            }
            ASSERT_GE(evicted, 0);
            EXPECT_THROW_MSG(gpu->reconstruct(evicted, a.data()), "was evicted");
            EXPECT_THROW_MSG(gpu->reconstruct_value(evicted, a.data()), "was evicted");
            for (idx_t j : {kept.front(), kept.back(), n + steps - 1}) {
                gpu->reconstruct(j, a.data());
                cpu->reconstruct(j, b.data());
                EXPECT_EQ(a, b) << str << " token " << j;
                gpu->reconstruct_value(j, a.data());
                cpu->reconstruct_value(j, b.data());
                EXPECT_EQ(a, b) << str << " token " << j;
            }
        }
    }
}

TEST(GpuEvict, OwnPrefillAttendsLikeItsCpuCopy) {
    KVINDEX_REQUIRE_GPU();
    register_gpu_index_types();
    const int d = 64;
    const idx_t n = 2500, nq = 4;
    const Prompt p = ood_prompt(n, d, 3, 51);
    auto gpu = index_factory(d, "GPU,ProxyEvict20|proxy_tokens=100");
    gpu->prefill(p.input());
    auto cpu = index_gpu_to_cpu(gpu.get());
    EXPECT_EQ(as_evict(*cpu).positions, as_gpu_evict(*gpu).positions);
    auto q = gaussian(nq, d, 52, 1.5f, -1.0f);
    std::vector<float> go(nq * d), gl(nq), co(nq * d), cl(nq);
    gpu->attend(nq, q.data(), go.data(), gl.data());
    cpu->attend(nq, q.data(), co.data(), cl.data());
    EXPECT_LE(rel_err(go.data(), co.data(), go.size()), kTwinTol);
    for (idx_t i = 0; i < nq; i++) {
        EXPECT_NEAR(gl[i], cl[i], kTwinTol * std::max(1.0f, std::abs(cl[i])));
    }
    // reset: a new sequence, the knobs stay
    gpu->reset();
    EXPECT_EQ(gpu->ntotal, 0);
    EXPECT_TRUE(as_gpu_evict(*gpu).positions.empty());
    EXPECT_EQ(get_index_parameter(gpu.get(), "proxy_tokens"), 100.0);
    gpu->prefill(p.input());
    EXPECT_EQ(as_gpu_evict(*gpu).positions, as_evict(*cpu).positions);
}

// ---- converters, io, knobs --------------------------------------------------

TEST(GpuEvict, ClonerRoundTripKeepsPositionsKnobsAndFiles) {
    KVINDEX_REQUIRE_GPU();
    const int d = 64;
    const idx_t n = 1200;
    const Prompt p = ood_prompt(n, d, 1, 61);
    for (const char* s : {"BF16,ProxyEvict20", "ProxyEvict30_H2O,Flat", "FP16,ProxyEvict10_TOVA"}) {
        auto cpu = index_factory(d, s);
        set_index_parameters(cpu.get(), std::string(s).find("ProxyEvict20") != std::string::npos
                                                 ? "proxy_tokens=16,pool=3,seed=9"
                                                 : "budget=150"); // H2O, TOVA keep no sinks
        cpu->set_stream(11);
        PrefillInput in = p.input();
        in.rope.theta = 12345;
        cpu->prefill(in);

        auto gpu = index_cpu_to_gpu(nullptr, cpu.get());
        const std::string cpu_str = index_factory_string(cpu.get());
        const std::string prefix = kv_type_prefix(cpu->kv_type);
        EXPECT_EQ(index_factory_string(gpu.get()), prefix + "GPU," + cpu_str.substr(prefix.size()));
        EXPECT_EQ(as_gpu_evict(*gpu).positions, as_evict(*cpu).positions) << s;
        EXPECT_EQ(gpu->ntotal, n);
        EXPECT_TRUE(gpu->has_rope);
        EXPECT_EQ(gpu->rope.theta, 12345);
        for (const ParameterInfo& knob : index_parameter_info(cpu.get())) {
            EXPECT_EQ(get_index_parameter(gpu.get(), knob.name), get_index_parameter(cpu.get(), knob.name))
                    << s << " " << knob.name;
        }
        EXPECT_EQ(as_gpu_evict(*gpu).policy().stream, 11u);

        auto back = index_gpu_to_cpu(gpu.get());
        EXPECT_EQ(index_factory_string(back.get()), cpu_str);
        EXPECT_EQ(as_evict(*back).positions, as_evict(*cpu).positions);
        // io of the GPU index = io of its CPU twin, byte for byte
        std::vector<uint8_t> from_gpu, from_cpu;
        write_index(gpu.get(), &from_gpu);
        write_index(cpu.get(), &from_cpu);
        EXPECT_EQ(from_gpu, from_cpu) << s;
        auto read = read_index(from_gpu);
        EXPECT_STREQ(read->type_name(), "IndexProxyEvict");
        EXPECT_EQ(as_evict(*read).positions, as_evict(*cpu).positions);
    }
    // an empty index converts too, and the knobs set later apply to its prefill
    auto empty = index_factory(d, "ProxyEvict30_TOVA");
    auto gpu = index_cpu_to_gpu(nullptr, empty.get());
    EXPECT_EQ(gpu->ntotal, 0);
    std::vector<uint8_t> a, b;
    write_index(gpu.get(), &a);
    write_index(empty.get(), &b);
    EXPECT_EQ(a, b);
    set_index_parameters(gpu.get(), "budget=77");
    set_index_parameters(empty.get(), "budget=77");
    gpu->prefill(p.input());
    empty->prefill(p.input());
    EXPECT_EQ(as_gpu_evict(*gpu).positions.size(), 77u);
    expect_same_kept_up_to_ties(as_gpu_evict(*gpu).positions, as_evict(*empty).positions,
                                cpu_scores_of(as_evict(*empty), p.input()),
                                as_evict(*empty).budget_for(n), "TOVA budget=77");
}

TEST(GpuEvict, KnobsAreTheCpuPolicys) {
    KVINDEX_REQUIRE_GPU();
    register_gpu_index_types();
    auto gpu = index_factory(64, "GPU,ProxyEvict20|proxy_tokens=32,pool=7");
    auto cpu = index_factory(64, "ProxyEvict20|proxy_tokens=32,pool=7");
    EXPECT_EQ(index_factory_string(gpu.get()), "GPU,ProxyEvict20");
    EXPECT_EQ(get_index_parameter(gpu.get(), "proxy_tokens"), 32.0);
    EXPECT_EQ(get_index_parameter(gpu.get(), "pool"), 7.0);
    // the CPU code checks the values: the same messages
    std::string g = kvtest::faiss_error([&] { set_index_parameters(gpu.get(), "pool=4"); });
    std::string c = kvtest::faiss_error([&] { set_index_parameters(cpu.get(), "pool=4"); });
    EXPECT_EQ(g, c);
    auto h2o = index_factory(64, "GPU,ProxyEvict20_H2O");
    EXPECT_THROW_MSG(set_index_parameters(h2o.get(), "proxy_tokens=5"), "only NaCl");
    // the same list of knobs as the CPU chain
    std::vector<std::string> gn, cn;
    for (auto& i : index_parameter_info(gpu.get())) {
        gn.push_back(i.name);
    }
    for (auto& i : index_parameter_info(cpu.get())) {
        cn.push_back(i.name);
    }
    EXPECT_EQ(gn, cn);
    // prefill-time knobs are refused once the index holds tokens
    const Prompt p = ood_prompt(300, 64, 1, 71);
    gpu->prefill(p.input());
    EXPECT_THROW_MSG(set_index_parameters(gpu.get(), "budget=10"), "prefill-time");
    // eviction over a Flat reads no top-k budget, as on the CPU
    EXPECT_THROW_MSG(set_index_parameters(gpu.get(), "k=12"), "unknown parameter 'k'");
    EXPECT_THROW_MSG(set_index_parameters(cpu.get(), "k=12"), "unknown parameter 'k'");
}

// ---- bad input, caches ------------------------------------------------------

TEST(GpuEvict, BadInputGivesTheCpuMessages) {
    KVINDEX_REQUIRE_GPU();
    register_gpu_index_types();
    const int d = 64;
    const idx_t n = 200;
    Prompt p = ood_prompt(n, d, 1, 81);
    // no proxy query in the window: the CPU policy's error, word for word
    PrefillInput in = p.input();
    in.n_queries = 1;
    std::vector<idx_t> pos = {10};
    in.query_positions = pos.data();
    auto cpu = index_factory(d, "ProxyEvict20");
    auto gpu = index_factory(d, "GPU,ProxyEvict20");
    std::string c = kvtest::faiss_error([&] { cpu->prefill(in); });
    std::string g = kvtest::faiss_error([&] { gpu->prefill(in); });
    EXPECT_NE(c.find("no queries at positions"), std::string::npos) << c;
    EXPECT_EQ(g, c);
    EXPECT_EQ(gpu->ntotal, 0); // refused: nothing stored
    in.n_queries = 0;
    in.query_positions = nullptr;
    EXPECT_THROW_MSG(gpu->prefill(in), "no queries at positions");
    // shapes the kernels lack, chains without a twin
    EXPECT_THROW_MSG(index_factory(96, "GPU,ProxyEvict20"), "d=96");
    EXPECT_THROW_MSG(index_factory(64, "GPU,ProxyEvict20,TopK(Flat)"), "no GPU twin");
    // per-head state: GpuKVCache refuses the string, naming it
    EXPECT_THROW_MSG(GpuKVCache(1, 4, 2, d, d, "ProxyEvict20"), "ProxyEvict20");
    EXPECT_THROW_MSG(GpuKVCache(1, 4, 2, d, d, "GPU,ProxyEvict20_H2O"), "per-head state");
    EXPECT_THROW_MSG(GpuKVCache(2, 4, 2, d, d, "Flat", "ProxyEvict20", {1}), "per-head state");
}

TEST(GpuEvict, KVCacheWithTheGpuStringRunsOneIndexPerHead) {
    KVINDEX_REQUIRE_GPU();
    register_gpu_index_types();
    // what GpuKVCache's refusal points to: KVCache, one GPU index per head,
    // each with its own random stream
    const int n_layers = 2, n_q = 6, n_kv = 2, d = 64;
    const idx_t n = 800;
    KVCache cache(n_layers, n_q, n_kv, d, d, "GPU,ProxyEvict20");
    for (int l = 0; l < n_layers; l++) {
        auto k = gaussian(n_kv * n, d, 90 + l, 1.0f, 1.0f);
        auto v = gaussian(n_kv * n, d, 95 + l);
        auto q = gaussian(n_q * n, d, 99 + l, 1.5f, -0.5f);
        cache.prefill(l, n, k.data(), v.data(), n, q.data(), nullptr, RopeParams());
        for (int h = 0; h < n_kv; h++) {
            auto& e = as_gpu_evict(*cache.index(l, h));
            EXPECT_EQ(e.policy().stream, uint64_t(l) * n_kv + h);
            EXPECT_EQ(e.positions.size(), size_t(e.policy().budget_for(n).n_keep));
        }
        auto nk = gaussian(n_kv, d, 200 + l), nv = gaussian(n_kv, d, 210 + l);
        cache.append(l, 1, nk.data(), nv.data());
        auto qd = gaussian(n_q, d, 220 + l, 1.5f, -0.5f);
        std::vector<float> out(n_q * d), lse(n_q);
        cache.attend(l, 1, qd.data(), out.data(), lse.data());
        // each head answers as its CPU copy
        for (int h = 0; h < n_kv; h++) {
            auto cpu = index_gpu_to_cpu(cache.index(l, h));
            const int g = n_q / n_kv;
            std::vector<float> co(g * d), cl(g);
            cpu->attend(g, qd.data() + h * g * d, co.data(), cl.data());
            EXPECT_LE(rel_err(out.data() + h * g * d, co.data(), co.size()), kTwinTol);
            for (int i = 0; i < g; i++) {
                EXPECT_NEAR(lse[h * g + i], cl[i], kTwinTol * std::max(1.0f, std::abs(cl[i])));
            }
        }
    }
}
