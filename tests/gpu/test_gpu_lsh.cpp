// GpuIndexLSHSample (MagicPIG on the GPU) against its CPU twin
// ("[Sink<n>,][Window<m>,]LSHSample<K>x<L>"), the double-precision
// reference and the statistics of LSH sampling (papers/magicpig.txt).
//
// Tolerances, and where they come from:
//  - The inclusion function. The device computes u in float
//    (gpu::lsh_inclusion): p = acos(-c) / pi carries <= 2.5 ulp (acosf 2
//    ulp, the product by 1/pi 0.5), amplified m K times in u ~ C(L, m) P^m,
//    P = p^K; the K-fold squaring adds <= K / 2 ulp to P, the binomial
//    recurrence, log1pf and exp2f a few ulp in all: |u_dev / u - 1| <=
//    (0.5 K m + 4) 1e-6 wherever u >= 1e-30 (the same code on the host,
//    with glibc's float functions, peaks at 8.9e-6 for K = 16, m = 3, where
//    this gives 2.8e-5); below 1e-30 the floor, as the CPU's table.
//  - Samples. The sample is a function of the query's L codes; a d-term
//    float sum is within d 2^-24 |q| |plane| of <q, plane> whatever its
//    order, so a code bit can differ between the CPU and the device only
//    where |<q, plane>| <= 2 d 2^-24 |q| |plane|. Rows with such a plane
//    are skipped (about one in five at K L = 1500, d = 128, fewer at
//    smaller K L); every other row must select exactly the CPU's ids.
//  - u of the sample. Both sides compute cos(q, k - mean) from float dot
//    products (the device entirely in float): the cosine is within delta =
//    2 d 2^-24 (sum |q_j k_j| + sum |q_j m_j|) / (|q| |k - m|) + 8 2^-24 of
//    the double one (the keys sit around a large offset, so <q, k> - <q, m>
//    cancels: delta is what makes u differ, not the function). u is
//    increasing in the cosine: the device's u must lie in [u(c - delta),
//    u(c + delta)] of the double reference, widened by the function's bound;
//    the CPU's by its table's 1e-7 and the float log u it keeps (4e-6).
//  - Attention against the CPU twin: the weights 1/u differ as u does; an
//    output is a convex combination of values (|v| <~ 4 here), so it moves
//    by at most 2 eps max |v| for weights off by eps. Sampled keys lie at
//    small angles, where u is flat in the cosine: a host emulation of the
//    device's float paths (the same lane split, summation trees and FMAs,
//    glibc's acosf / log1pf / exp2f for CUDA's) over exactly the
//    configurations of SampleAndAttendMatchCpuTwinThroughDecode gives u
//    within 6.6e-6 of the CPU's, outputs within 2.5e-6 and lse within 3e-7.
//    CUDA's functions (<= 2 ulp) may add the function's bound to eps:
//    outputs 2e-4 (relative to max(1, |out|)), lse 1e-4. Against the double
//    reference of the estimator over the device's own selection and u (the
//    bias recomputes the cosine from the pre-scaled query: emulated, 2.3e-6
//    on outputs): 1e-4.
//  - Statistics over S = 300 hyperplane seeds: the frequency with which a
//    key is sampled is Binomial(S, u): |z| < 5 for every key with S u (1 -
//    u) >= 10 (a 5-sigma event is ~1e-6 per key, ~3000 keys tested); the
//    mean of e^lse over the seeds estimates Z: |z| < 5 with the spread
//    measured over the seeds, and within 5% (the spread of one estimate is
//    0.064 Z here, measured with the CPU twin over the same seeds, so 5
//    standard errors of the mean are 1.9%). The CPU twin over the same 300
//    seeds: 2936 keys tested, largest |z| 3.4; mean/Z - 1 = -3e-4.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/IndexLSHSample.h>
#include <kvindex/IndexSinkWindow.h>
#include <kvindex/gpu/GpuCloner.h>
#include <kvindex/gpu/GpuIndexLSHSample.h>
#include <kvindex/gpu/GpuKVCache.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>
#include <kvindex/registry.h>

#include "decode_attention.h"
#include "expect_throw.h"
#include "gpu_test.h"
#include "lsh_sample.h"

using namespace kvindex;
using kvtest::gaussian;
using kvtest::make_kv;
using kvtest::rel_err;

namespace {

constexpr double kTwinOutTol = 2e-4; ///< outputs vs the CPU twin (see the header)
constexpr double kTwinLseTol = 1e-4; ///< lse vs the CPU twin
constexpr double kRefTol = 1e-4;     ///< vs the double reference on the same sample and u
constexpr double kMinU = 1e-30;      ///< the floor of u (LSHInclusionTable::kMinInclusion)

std::shared_ptr<GpuResources> res() {
    return default_gpu_resources(0);
}

/// The device function's relative error bound (header).
double device_u_bound(int K, int m) {
    return (0.5 * K * m + 4) * 1e-6;
}

/// u of the double reference at cosine c, floored as the indexes floor it.
double u_ref(double c, int K, int L, int m) {
    c = std::min(1.0, std::max(-1.0, c));
    return std::max(kMinU, lsh_inclusion_probability(std::acos(c), K, L, m));
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

/// Whether q lies within float rounding of one of the hyperplanes (a code
/// bit may then differ between any two float evaluations).
bool near_hyperplane(const IndexLSHSample& s, const float* q) {
    const int d = s.d;
    double qq = 0;
    for (int j = 0; j < d; j++) {
        qq += double(q[j]) * q[j];
    }
    const double tol = 2.0 * d * std::ldexp(1.0, -24) * std::sqrt(qq);
    for (int r = 0; r < s.K * s.L; r++) {
        const float* p = s.planes.data() + size_t(r) * d;
        double dot = 0, pp = 0;
        for (int j = 0; j < d; j++) {
            dot += double(q[j]) * p[j];
            pp += double(p[j]) * p[j];
        }
        if (std::abs(dot) <= tol * std::sqrt(pp)) {
            return true;
        }
    }
    return false;
}

/// cos(q, k - mean) in double and the float rounding bound of its
/// evaluation from float dot products (header).
struct Cosine {
    double c = 0, delta = 0;
};

Cosine cosine(const float* q, const float* k, const float* mean, int d) {
    double qk = 0, qm = 0, aqk = 0, aqm = 0, qq = 0, cc = 0;
    for (int j = 0; j < d; j++) {
        const double cj = double(k[j]) - mean[j];
        qk += double(q[j]) * k[j];
        qm += double(q[j]) * mean[j];
        aqk += std::abs(double(q[j]) * k[j]);
        aqm += std::abs(double(q[j]) * mean[j]);
        qq += double(q[j]) * q[j];
        cc += cj * cj;
    }
    Cosine r;
    const double den = std::sqrt(qq) * std::sqrt(cc);
    if (den > 0) {
        const double eps = std::ldexp(1.0, -24);
        r.c = (qk - qm) / den;
        r.delta = 2.0 * d * eps * (aqk + aqm) / den + 8 * eps;
    }
    return r;
}

/// The GpuIndexLSHSample inside a GPU index.
const GpuIndexLSHSample& as_lsh(const KVIndex& index) {
    auto g = dynamic_cast<const GpuIndexLSHSample*>(&index);
    if (!g) {
        throw std::runtime_error(std::string("not a GpuIndexLSHSample: ") + index.type_name());
    }
    return *g;
}

/** Compares select and attend of `gpu` with its CPU twin `cpu` (same
 * tokens) for nq queries at min_hits `hits` (header: tolerances). Returns
 * the rows whose samples were compared (rows near a hyperplane are not). */
int compare_with_twin(const KVIndex& cpu, const KVIndex& gpu, const float* q, idx_t nq, int hits,
                      const std::string& what) {
    const GpuIndexLSHSample& g = as_lsh(gpu);
    const IndexLSHSample& s = g.lsh();
    const int d = cpu.d, K = s.K, L = s.L;
    std::vector<float> keys, values;
    stored_kv(cpu, &keys, &values);
    const idx_t n_inner = s.ntotal;
    const idx_t sink = std::min(g.n_sink, cpu.ntotal);
    const idx_t window_start = sink + n_inner;
    SearchParametersLSH p;
    p.min_hits = hits;
    std::vector<Selection> cs(nq), gs(nq);
    cpu.select(nq, q, cs.data(), &p);
    gpu.select(nq, q, gs.data(), &p);
    std::vector<float> co(nq * d), cl(nq), go(nq * d), gl(nq);
    cpu.attend(nq, q, co.data(), cl.data(), &p);
    gpu.attend(nq, q, go.data(), gl.data(), &p);
    const double bound = device_u_bound(K, hits);
    int compared = 0;
    for (idx_t i = 0; i < nq; i++) {
        const float* qi = q + i * d;
        const std::string row = what + " min_hits=" + std::to_string(hits) + " row " +
                std::to_string(i);
        EXPECT_TRUE(std::is_sorted(gs[i].ids.begin(), gs[i].ids.end())) << row;
        EXPECT_EQ(gs[i].n_scanned, cs[i].n_scanned) << row;
        // the device's attend is the estimator over the device's own sample
        std::vector<double> u(gs[i].size()), ref;
        for (size_t j = 0; j < u.size(); j++) {
            u[j] = gs[i].inclusion[j];
        }
        const double lse = kvtest::ref_attention(qi, keys.data(), values.data(), d, d,
                                                 gs[i].ids, &u, ref);
        EXPECT_LE(kvtest::rel_max_err(go.data() + i * d, ref), kRefTol) << row;
        EXPECT_NEAR(gl[i], lse, kRefTol * std::max(1.0, std::abs(lse))) << row;
        if (near_hyperplane(s, qi)) {
            continue;
        }
        compared++;
        EXPECT_EQ(gs[i].ids, cs[i].ids) << row;
        if (gs[i].ids != cs[i].ids) {
            continue;
        }
        for (size_t j = 0; j < gs[i].size(); j++) {
            const idx_t id = gs[i].ids[j];
            if (id < sink || id >= window_start || hits == 0) {
                EXPECT_EQ(gs[i].inclusion[j], 1.0f) << row << " static id " << id;
                continue;
            }
            const Cosine c = cosine(qi, keys.data() + id * d, s.mean.data(), d);
            const double lo = u_ref(c.c - c.delta, K, L, hits);
            const double hi = u_ref(c.c + c.delta, K, L, hits);
            const double gu = gs[i].inclusion[j], cu = cs[i].inclusion[j];
            EXPECT_GE(gu, lo * (1 - bound)) << row << " id " << id << " cos " << c.c;
            EXPECT_LE(gu, hi * (1 + bound)) << row << " id " << id << " cos " << c.c;
            EXPECT_GE(cu, lo * (1 - 5e-6)) << row << " id " << id << " (CPU)";
            EXPECT_LE(cu, hi * (1 + 5e-6)) << row << " id " << id << " (CPU)";
        }
        EXPECT_LE(rel_err(go.data() + i * d, co.data() + i * d, d), kTwinOutTol) << row;
        EXPECT_NEAR(gl[i], cl[i], kTwinLseTol * std::max(1.0f, std::abs(cl[i]))) << row;
    }
    return compared;
}

} // namespace

// ---- without a device ----------------------------------------------------------

TEST(GpuLSHRegistry, RowAndTwinAcceptance) {
    register_gpu_index_types();
    EXPECT_EQ(index_type("GpuIndexLSHSample").fourcc, fourcc("KGls"));
    for (const char* s : {"LSHSample10x150", "Sink4,Window64,LSHSample8x75", "Window16,LSHSample4x20",
                          "BF16,Sink4,LSHSample10x150"}) {
        auto cpu = index_factory(64, s);
        EXPECT_TRUE(GpuIndexLSHSample::accepts_cpu(*cpu)) << s;
    }
    for (const char* s : {"Flat", "Sink4,Window64,TopK(Flat)", "IVFAsym16"}) {
        auto cpu = index_factory(64, s);
        EXPECT_FALSE(GpuIndexLSHSample::accepts_cpu(*cpu)) << s;
    }
}

// ---- the inclusion probability ------------------------------------------------------

TEST(GpuLSH, InclusionFunctionMatchesDoubleReference) {
    KVINDEX_REQUIRE_GPU();
    // a grid of cosines over [-1, 1] (every 1e-4), plus the ends approached
    // geometrically (the square-root behaviour of acos there)
    std::vector<float> c;
    for (int i = 0; i <= 20000; i++) {
        c.push_back(float(-1.0 + 2.0 * i / 20000));
    }
    for (int e = 1; e <= 24; e++) {
        c.push_back(float(1.0 - std::ldexp(1.0, -e)));
        c.push_back(float(-1.0 + std::ldexp(1.0, -e)));
    }
    const int64_t n = int64_t(c.size());
    cudaStream_t stream = res()->stream();
    DeviceScope scope(res()->device());
    float *c_d = nullptr, *u_d = nullptr;
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&c_d), n * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&u_d), n * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(c_d, c.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    std::vector<float> u(n);
    for (int K : {1, 4, 8, 10, 16}) {
        for (int L : {1, 10, 75, 150, 300}) {
            for (int m = 0; m <= 3; m++) {
                if (m > L) {
                    continue;
                }
                gpu::lsh_inclusion_eval(c_d, n, K, L, m, u_d, stream);
                ASSERT_EQ(cudaMemcpyAsync(u.data(), u_d, n * sizeof(float),
                                          cudaMemcpyDeviceToHost, stream),
                          cudaSuccess);
                res()->synchronize("inclusion");
                const double bound = device_u_bound(K, m);
                double worst = 0;
                for (int64_t i = 0; i < n; i++) {
                    const double ref =
                            lsh_inclusion_probability(std::acos(double(c[i])), K, L, m);
                    ASSERT_TRUE(std::isfinite(u[i]) && u[i] > 0 && u[i] <= 1)
                            << "K=" << K << " L=" << L << " m=" << m << " c=" << c[i];
                    if (ref >= kMinU) {
                        worst = std::max(worst, std::abs(u[i] / ref - 1));
                        ASSERT_LE(std::abs(u[i] / ref - 1), bound)
                                << "K=" << K << " L=" << L << " m=" << m << " c=" << c[i]
                                << " device " << u[i] << " reference " << ref;
                    } else { // the floor (a reference just below it may round above)
                        ASSERT_LE(u[i], kMinU * (1 + bound))
                                << "K=" << K << " L=" << L << " m=" << m << " c=" << c[i];
                    }
                }
                if (m == 0) {
                    EXPECT_EQ(worst, 0.0); // u = 1 exactly
                    continue;
                }
                // the table the attention reads (lsh_log2_inclusion_table):
                // the same acosf, then the interpolation of the smooth
                // g = log2 u - m K log2 p (3.4e-6 at worst over this grid,
                // a double evaluation of both) and g + m K log2 p in float
                // (|log2 u| <= 100: 1e-5 at most): the function's bound + 2e-5
                gpu::lsh_inclusion_eval(c_d, n, K, L, m, u_d, stream, true);
                ASSERT_EQ(cudaMemcpyAsync(u.data(), u_d, n * sizeof(float),
                                          cudaMemcpyDeviceToHost, stream),
                          cudaSuccess);
                res()->synchronize("inclusion table");
                for (int64_t i = 0; i < n; i++) {
                    const double ref =
                            lsh_inclusion_probability(std::acos(double(c[i])), K, L, m);
                    ASSERT_TRUE(std::isfinite(u[i]) && u[i] > 0 && u[i] <= 1)
                            << "table K=" << K << " L=" << L << " m=" << m << " c=" << c[i];
                    if (ref >= 1e-25) { // clear of the floor
                        ASSERT_LE(std::abs(u[i] / ref - 1), bound + 2e-5)
                                << "table K=" << K << " L=" << L << " m=" << m << " c=" << c[i]
                                << " device " << u[i] << " reference " << ref;
                    }
                }
            }
        }
    }
    cudaFree(c_d);
    cudaFree(u_d);
}

// ---- the GPU index against its CPU twin -------------------------------------------------

TEST(GpuLSH, SampleAndAttendMatchCpuTwinThroughDecode) {
    KVINDEX_REQUIRE_GPU();
    // a prompt, then single-token appends: the code-by-code tail (first
    // tokens), the recent level (past 256 tail tokens), a main rebuild
    // (past 1/8 of the indexed tokens); checked after each phase
    const int d = 128;
    const idx_t n0 = 4000, nq = 6;
    const idx_t checkpoints[] = {0, 100, 300, 520, 700};
    const char* chains[] = {"LSHSample10x150", "Sink4,Window64,LSHSample10x150",
                            "LSHSample8x75", "Sink4,Window64,LSHSample8x75",
                            "LSHSample4x20", "Sink4,Window64,LSHSample4x20"};
    int rows = 0, compared = 0, seed = 0;
    for (KVType t : {KVType::f32, KVType::bf16}) {
        for (const char* chain : chains) {
            seed++;
            const std::string s = std::string(kv_type_prefix(t)) + chain;
            auto x = make_kv(n0 + 700, nq * 5, d, 100 + seed, true);
            auto cpu = index_factory(d, s);
            cpu->add_kv(n0, x.keys.data(), x.values.data());
            auto gpu = index_cpu_to_gpu(res(), cpu.get());
            ASSERT_STREQ(gpu->type_name(), "GpuIndexLSHSample");
            EXPECT_FALSE(gpu->shares_layer_storage());
            const GpuIndexLSHSample& g = as_lsh(*gpu);
            idx_t sink_w, window_w;
            const IndexLSHSample* cpu_lsh = nullptr;
            if (auto sw = dynamic_cast<const IndexSinkWindow*>(cpu.get())) {
                cpu_lsh = dynamic_cast<const IndexLSHSample*>(sw->inner.get());
                sink_w = sw->n_sink;
                window_w = sw->n_window;
            } else {
                cpu_lsh = dynamic_cast<const IndexLSHSample*>(cpu.get());
                sink_w = window_w = 0;
            }
            ASSERT_TRUE(cpu_lsh);
            EXPECT_EQ(g.n_sink, sink_w);
            EXPECT_EQ(g.n_window, window_w);
            bool saw_tail = false, saw_recent = false, saw_rebuild = false;
            idx_t done = 0, indexed = cpu_lsh->n_indexed;
            for (int c = 0; c < 5; c++) {
                for (; done < checkpoints[c]; done++) {
                    const float* k = x.keys.data() + (n0 + done) * d;
                    const float* v = x.values.data() + (n0 + done) * d;
                    cpu->add_kv(1, k, v);
                    gpu->add_kv(1, k, v);
                    const IndexLSHSample& h = g.lsh();
                    // the GPU's twin evolves as the CPU index does
                    ASSERT_EQ(h.n_indexed, cpu_lsh->n_indexed) << s;
                    ASSERT_EQ(h.n_recent, cpu_lsh->n_recent) << s;
                    saw_rebuild = saw_rebuild || h.n_indexed != indexed;
                    saw_recent = saw_recent || h.n_recent > h.n_indexed;
                    saw_tail = saw_tail || h.ntotal > std::max(h.n_recent, h.n_indexed);
                    indexed = h.n_indexed;
                }
                const float* q = x.queries.data() + c * nq * d;
                for (int hits : {1, 2, 3}) {
                    compared += compare_with_twin(*cpu, *gpu, q, nq, hits,
                                                  s + " +" + std::to_string(done));
                    rows += int(nq);
                }
            }
            EXPECT_TRUE(saw_tail && saw_recent && saw_rebuild)
                    << s << ": tail " << saw_tail << " recent " << saw_recent << " rebuild "
                    << saw_rebuild;
        }
    }
    // rows near a hyperplane are skipped: about one in ten
    EXPECT_GE(compared, rows / 2) << compared << " of " << rows << " rows compared";
}

TEST(GpuLSH, ManyRowsAndLongerContext) {
    KVINDEX_REQUIRE_GPU();
    // 37 rows (tiles of 8 rows in the hash, a partial last tile), 50k
    // tokens (32-bit table ids on the host), min_hits 2
    const int d = 64;
    const idx_t n = 50000, nq = 37;
    auto x = make_kv(n, nq, d, 7, true);
    auto cpu = index_factory(d, "BF16,Sink4,Window64,LSHSample10x150");
    cpu->add_kv(n, x.keys.data(), x.values.data());
    auto gpu = index_cpu_to_gpu(res(), cpu.get());
    const int compared = compare_with_twin(*cpu, *gpu, x.queries.data(), nq, 2, "50k");
    EXPECT_GE(compared, int(nq) / 2);
    const idx_t m = 70000;
    auto y = make_kv(m, 4, d, 8, true);
    auto big = index_factory(d, "LSHSample8x75");
    big->add_kv(m, y.keys.data(), y.values.data());
    EXPECT_GT(as_lsh(*index_cpu_to_gpu(res(), big.get())).lsh().n_indexed, 65536); // ids past 16 bits
    compare_with_twin(*big, *index_cpu_to_gpu(res(), big.get()), y.queries.data(), 4, 1, "70k");
}

TEST(GpuLSH, SharedMemoryWalkSelectsWhatTheGlobalWalkSelects) {
    KVINDEX_REQUIRE_GPU();
    // min_hits 1 and 2 count collisions in shared memory, the tokens split
    // by range over blocks that each search their run of every bucket
    // (gpu::set_lsh_shared_walk); the global bitsets must give the same
    // sample on the same device: contexts of fewer tokens than the blocks
    // own words (some own none), a partial last word, ranges that cut
    // buckets, and both levels after decode appends
    const int d = 64;
    const idx_t nq = 9;
    int rows = 0;
    // 4x300 with its recent level walks 600 buckets: two chunks of searches
    for (const char* chain : {"Sink4,Window64,LSHSample6x40", "Sink4,Window64,LSHSample4x300"}) {
        for (idx_t n : {idx_t(200), idx_t(4099), idx_t(40000)}) {
            auto x = make_kv(n + 300, nq, d, 60 + int(n % 97), true);
            auto cpu = index_factory(d, chain);
            cpu->add_kv(n, x.keys.data(), x.values.data());
            auto gpu = index_cpu_to_gpu(res(), cpu.get());
            for (int phase = 0; phase < 2; phase++) {
                if (phase == 1) { // appends: the code-by-code tail, then the recent level
                    gpu->add_kv(300, x.keys.data() + n * d, x.values.data() + n * d);
                }
                for (int hits : {1, 2}) {
                    SearchParametersLSH p;
                    p.min_hits = hits;
                    std::vector<Selection> by_shared(nq), by_global(nq);
                    gpu->select(nq, x.queries.data(), by_shared.data(), &p);
                    gpu::set_lsh_shared_walk(false);
                    gpu->select(nq, x.queries.data(), by_global.data(), &p);
                    gpu::set_lsh_shared_walk(true);
                    for (idx_t i = 0; i < nq; i++) {
                        EXPECT_EQ(by_shared[i].ids, by_global[i].ids)
                                << chain << ", " << n << " tokens, phase " << phase
                                << ", min_hits " << hits << ", row " << i;
                        EXPECT_EQ(by_shared[i].inclusion, by_global[i].inclusion);
                        rows += by_shared[i].size() > 0;
                    }
                }
            }
        }
    }
    EXPECT_GE(rows, 2 * 3 * 2 * 2 * int(nq) / 2); // most rows sample something
}

TEST(GpuLSH, MinHitsZeroIsExactAttention) {
    KVINDEX_REQUIRE_GPU();
    const int d = 128;
    const idx_t n = 3000, nq = 5;
    auto x = make_kv(n, nq, d, 21, true);
    for (const char* chain : {"LSHSample10x150", "Sink4,Window64,LSHSample8x75"}) {
        auto cpu = index_factory(d, chain);
        cpu->add_kv(n, x.keys.data(), x.values.data());
        auto gpu = index_cpu_to_gpu(res(), cpu.get());
        set_index_parameter(gpu.get(), "min_hits", 0);
        std::vector<float> out(nq * d), lse(nq);
        gpu->attend(nq, x.queries.data(), out.data(), lse.data());
        std::vector<Selection> sel(nq);
        gpu->select(nq, x.queries.data(), sel.data());
        for (idx_t i = 0; i < nq; i++) {
            std::vector<double> ref;
            const double l = kvtest::ref_attention_all(x.queries.data() + i * d, x.keys.data(),
                                                       x.values.data(), d, d, n, ref);
            EXPECT_LE(kvtest::rel_max_err(out.data() + i * d, ref), kRefTol) << chain;
            EXPECT_NEAR(lse[i], l, kRefTol * std::max(1.0, std::abs(l))) << chain;
            EXPECT_EQ(sel[i].size(), size_t(n)) << chain;
            for (float u : sel[i].inclusion) {
                ASSERT_EQ(u, 1.0f);
            }
            EXPECT_EQ(sel[i].n_scanned, 0u) << "every token selected, nothing hashed";
        }
    }
}

TEST(GpuLSH, SearchIsTheTopKOfTheSelection) {
    KVINDEX_REQUIRE_GPU();
    const int d = 64;
    const idx_t n = 5000, nq = 8, k = 30;
    auto x = make_kv(n, nq, d, 31, true);
    for (const char* chain : {"Sink4,Window64,LSHSample4x20", "LSHSample8x75"}) {
        auto cpu = index_factory(d, chain);
        cpu->add_kv(n, x.keys.data(), x.values.data());
        auto gpu = index_cpu_to_gpu(res(), cpu.get());
        const IndexLSHSample& s = as_lsh(*gpu).lsh();
        std::vector<float> gd(nq * k), cd(nq * k);
        std::vector<idx_t> gi(nq * k), ci(nq * k);
        gpu->search(nq, x.queries.data(), k, gd.data(), gi.data());
        cpu->search(nq, x.queries.data(), k, cd.data(), ci.data());
        for (idx_t i = 0; i < nq; i++) {
            const float* qi = x.queries.data() + i * d;
            if (near_hyperplane(s, qi)) {
                continue;
            }
            auto scores = kvtest::ref_scores(qi, x.keys.data(), d, n);
            // the same candidates: equal up to swaps at a near-tie with the
            // k-th score (float sums in another order)
            double kth = INFINITY;
            std::set<idx_t> cset;
            for (idx_t j = 0; j < k; j++) {
                if (ci[i * k + j] >= 0) {
                    kth = std::min(kth, scores[ci[i * k + j]]);
                    cset.insert(ci[i * k + j]);
                }
            }
            for (idx_t j = 0; j < k; j++) {
                const idx_t id = gi[i * k + j];
                EXPECT_EQ(id < 0, ci[i * k + j] < 0) << chain << " row " << i << " rank " << j;
                if (id < 0) {
                    continue;
                }
                EXPECT_NEAR(gd[i * k + j], scores[id], 1e-4 * std::max(1.0, std::abs(scores[id])));
                if (!cset.count(id)) {
                    EXPECT_NEAR(scores[id], kth, 1e-5 * std::max(1.0, std::abs(kth)))
                            << chain << " row " << i << ": id " << id << " is not a near-tie";
                }
            }
        }
    }
}

TEST(GpuLSH, SmallContextsAndReset) {
    KVINDEX_REQUIRE_GPU();
    // fewer tokens than sink + window (no middle), then a middle, then a
    // new sequence after reset
    const int d = 64;
    const idx_t nq = 3;
    auto x = make_kv(700, nq, d, 41, true);
    auto cpu = index_factory(d, "Sink4,Window64,LSHSample6x30");
    cpu->add_kv(30, x.keys.data(), x.values.data());
    auto gpu = index_cpu_to_gpu(res(), cpu.get());
    std::vector<float> go(nq * d), gl(nq), co(nq * d), cl(nq);
    gpu->attend(nq, x.queries.data(), go.data(), gl.data());
    cpu->attend(nq, x.queries.data(), co.data(), cl.data());
    EXPECT_LE(rel_err(go.data(), co.data(), go.size()), 2e-5);
    std::vector<Selection> sel(nq);
    gpu->select(nq, x.queries.data(), sel.data());
    EXPECT_EQ(sel[0].size(), 30u);
    EXPECT_EQ(sel[0].n_scanned, 0u);
    for (idx_t i = 30; i < 200; i++) {
        cpu->add_kv(1, x.keys.data() + i * d, x.values.data() + i * d);
        gpu->add_kv(1, x.keys.data() + i * d, x.values.data() + i * d);
    }
    compare_with_twin(*cpu, *gpu, x.queries.data(), nq, 1, "200 tokens");
    cpu->reset();
    gpu->reset();
    EXPECT_EQ(gpu->ntotal, 0);
    cpu->add_kv(500, x.keys.data() + 200 * d, x.values.data() + 200 * d);
    gpu->add_kv(500, x.keys.data() + 200 * d, x.values.data() + 200 * d);
    compare_with_twin(*cpu, *gpu, x.queries.data(), nq, 2, "after reset");
}

// ---- statistics over hyperplane seeds -------------------------------------------------

TEST(GpuLSH, InclusionFrequenciesAndPartitionSumOverSeeds) {
    KVINDEX_REQUIRE_GPU();
    const int d = 64, K = 4, L = 20, S = 300;
    const idx_t n = 1000;
    auto keys = gaussian(n, d, 51, 1.0f, 0.5f);
    auto values = gaussian(n, d, 52);
    auto q = gaussian(1, d, 53, 0.3f); // flat scores: a sampling regime, not a needle
    std::vector<std::vector<int>> counts(4, std::vector<int>(n, 0));
    double sum_z = 0, sum_z2 = 0;
    std::vector<float> mean;
    for (int s = 0; s < S; s++) {
        IndexLSHSample cpu(d, d, K, L);
        cpu.set_seed(1000 + s);
        cpu.add_kv(n, keys.data(), values.data());
        mean = cpu.mean; // the same for every seed: the mean of the keys
        auto gpu = index_cpu_to_gpu(res(), &cpu);
        for (int m = 1; m <= 3; m++) {
            SearchParametersLSH p;
            p.min_hits = m;
            Selection sel;
            gpu->select(1, q.data(), &sel, &p);
            for (idx_t id : sel.ids) {
                counts[m][id]++;
            }
        }
        SearchParametersLSH p;
        p.min_hits = 2;
        float out[64], lse;
        gpu->attend(1, q.data(), out, &lse, &p);
        const double z = std::exp(double(lse));
        sum_z += z;
        sum_z2 += z * z;
    }
    int tested = 0;
    for (int m = 1; m <= 3; m++) {
        for (idx_t i = 0; i < n; i++) {
            const Cosine c = cosine(q.data(), keys.data() + i * d, mean.data(), d);
            const double u = lsh_inclusion_probability(std::acos(c.c), K, L, m);
            const double var = S * u * (1 - u);
            if (var < 10) {
                continue;
            }
            tested++;
            const double zscore = (counts[m][i] - S * u) / std::sqrt(var);
            EXPECT_LT(std::abs(zscore), 5.0)
                    << "key " << i << " min_hits " << m << ": sampled " << counts[m][i]
                    << " times in " << S << ", u = " << u;
        }
    }
    EXPECT_GT(tested, 1000);
    // Z = sum_i e^{s_i}: e^lse of the sample is its unbiased estimate
    auto scores = kvtest::ref_scores(q.data(), keys.data(), d, n);
    double Z = 0;
    for (double sc : scores) {
        Z += std::exp(sc / std::sqrt(double(d)));
    }
    const double mean_z = sum_z / S;
    const double sd = std::sqrt(std::max(0.0, sum_z2 / S - mean_z * mean_z));
    EXPECT_LT(std::abs(mean_z - Z), 5 * sd / std::sqrt(double(S)))
            << "mean " << mean_z << " Z " << Z << " sd " << sd;
    EXPECT_LT(std::abs(mean_z / Z - 1), 0.05) << "mean " << mean_z << " Z " << Z << " sd " << sd;
}

// ---- the kernel layer with several heads (the benchmarks' entry) ------------------------

TEST(GpuLSH, KernelLayerHeadsMatchTheirIndexes) {
    KVINDEX_REQUIRE_GPU();
    // two KV heads, three rows each, through gpu::lsh_attention with head
    // strides, against one CPU chain per head; the planes shared (one seed)
    // or given per head (stride K L d)
    const int d = 64, H = 2, R = 3;
    const idx_t n = 3000, n_sink = 4, n_window = 16;
    const std::string chain = "Sink4,Window16,LSHSample6x20";
    std::vector<std::unique_ptr<KVIndex>> cpu;
    std::vector<float> keys(H * n * d), values(H * n * d), q;
    for (int h = 0; h < H; h++) {
        auto x = make_kv(n, R, d, 61 + h, true);
        std::copy(x.keys.begin(), x.keys.end(), keys.begin() + h * n * d);
        std::copy(x.values.begin(), x.values.end(), values.begin() + h * n * d);
        q.insert(q.end(), x.queries.begin(), x.queries.end());
        cpu.push_back(index_factory(d, chain));
        cpu.back()->add_kv(n, x.keys.data(), x.values.data());
    }
    auto lsh = [&](int h) -> const IndexLSHSample& {
        return *dynamic_cast<const IndexLSHSample*>(
                dynamic_cast<const IndexSinkWindow&>(*cpu[h]).inner.get());
    };
    const int K = lsh(0).K, L = lsh(0).L;
    const idx_t n_inner = lsh(0).ntotal, B1 = (idx_t(1) << K) + 1;
    ASSERT_EQ(lsh(0).n_indexed, n_inner); // one level: everything indexed at the add
    std::vector<float> planes, mean, norms;
    std::vector<uint32_t> offsets;
    std::vector<int32_t> ids;
    for (int h = 0; h < H; h++) {
        const IndexLSHSample& s = lsh(h);
        planes.insert(planes.end(), s.planes.begin(), s.planes.end());
        mean.insert(mean.end(), s.mean.begin(), s.mean.end());
        norms.insert(norms.end(), s.norms.begin(), s.norms.end());
        std::vector<uint32_t> plain_offsets;
        std::vector<int32_t> plain_ids;
        s.plain_tables(plain_offsets, plain_ids);
        offsets.insert(offsets.end(), plain_offsets.begin(), plain_offsets.end());
        ids.insert(ids.end(), plain_ids.begin(), plain_ids.end());
    }
    DeviceScope scope(res()->device());
    cudaStream_t stream = res()->stream();
    std::vector<void*> allocs;
    auto up = [&](const void* p, size_t bytes) {
        void* d_ptr = nullptr;
        EXPECT_EQ(cudaMalloc(&d_ptr, std::max<size_t>(bytes, 4)), cudaSuccess);
        EXPECT_EQ(cudaMemcpy(d_ptr, p, bytes, cudaMemcpyHostToDevice), cudaSuccess);
        allocs.push_back(d_ptr);
        return d_ptr;
    };
    gpu::KVHeadsView kv;
    kv.keys = up(keys.data(), keys.size() * 4);
    kv.values = up(values.data(), values.size() * 4);
    kv.head_stride = n;
    kv.n_tokens = n;
    kv.n_heads = H;
    kv.d = d;
    kv.type = KVType::f32;
    const float* q_d = static_cast<const float*>(up(q.data(), q.size() * 4));
    gpu::LSHTables t;
    t.K = K;
    t.L = L;
    t.planes = static_cast<const float*>(up(planes.data(), planes.size() * 4));
    t.mean = static_cast<const float*>(up(mean.data(), mean.size() * 4));
    t.mean_head_stride = d;
    t.norms = static_cast<const float*>(up(norms.data(), norms.size() * 4));
    t.norms_head_stride = n_inner;
    t.first_inner = n_sink;
    t.n_inner = n_inner;
    t.main.offsets = static_cast<const uint32_t*>(up(offsets.data(), offsets.size() * 4));
    t.main.offsets_head_stride = L * B1;
    t.main.ids = static_cast<const int32_t*>(up(ids.data(), ids.size() * 4));
    t.main.ids_head_stride = L * n_inner;
    t.main.n_per_table = n_inner;
    float *out_d = nullptr, *lse_d = nullptr;
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&out_d), H * R * d * 4), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&lse_d), H * R * 4), cudaSuccess);
    for (int64_t stride : {int64_t(0), int64_t(K) * L * d}) {
        t.planes_head_stride = stride;
        for (int hits : {1, 2, 3}) {
            gpu::Workspace sizing = gpu::Workspace::sizing();
            gpu::lsh_attention(kv, q_d, R, n_sink, n_window, t, hits, nullptr, nullptr, sizing,
                               stream);
            void* w = nullptr;
            ASSERT_EQ(cudaMalloc(&w, std::max<size_t>(sizing.used, 1)), cudaSuccess);
            gpu::Workspace ws(w, sizing.used);
            gpu::lsh_attention(kv, q_d, R, n_sink, n_window, t, hits, out_d, lse_d, ws, stream);
            std::vector<float> out(H * R * d), lse(H * R);
            ASSERT_EQ(cudaMemcpyAsync(out.data(), out_d, out.size() * 4, cudaMemcpyDeviceToHost,
                                      stream),
                      cudaSuccess);
            ASSERT_EQ(cudaMemcpyAsync(lse.data(), lse_d, lse.size() * 4, cudaMemcpyDeviceToHost,
                                      stream),
                      cudaSuccess);
            res()->synchronize("kernel layer");
            cudaFree(w);
            for (int h = 0; h < H; h++) {
                SearchParametersLSH p;
                p.min_hits = hits;
                std::vector<float> co(R * d), cl(R);
                cpu[h]->attend(R, q.data() + h * R * d, co.data(), cl.data(), &p);
                for (int r = 0; r < R; r++) {
                    if (near_hyperplane(lsh(h), q.data() + (h * R + r) * d)) {
                        continue;
                    }
                    const std::string what = "head " + std::to_string(h) + " row " +
                            std::to_string(r) + " min_hits " + std::to_string(hits) +
                            " planes stride " + std::to_string(stride);
                    EXPECT_LE(rel_err(out.data() + (h * R + r) * d, co.data() + r * d, d),
                              kTwinOutTol)
                            << what;
                    EXPECT_NEAR(lse[h * R + r], cl[r],
                                kTwinLseTol * std::max(1.0f, std::abs(cl[r])))
                            << what;
                }
            }
        }
    }
    cudaFree(out_d);
    cudaFree(lse_d);
    for (void* p : allocs) {
        cudaFree(p);
    }
}

// ---- conversion, io, knobs, bad input -----------------------------------------------------

TEST(GpuLSH, ClonerRoundTripIoAndDecode) {
    KVINDEX_REQUIRE_GPU();
    const int d = 64;
    const idx_t n = 2000;
    auto x = make_kv(n + 400, 4, d, 71, true);
    auto cpu = index_factory(d, "BF16,Sink4,Window64,LSHSample8x75");
    set_index_parameter(cpu.get(), "min_hits", 1);
    PrefillInput in;
    in.n_tokens = n;
    in.keys = x.keys.data();
    in.values = x.values.data();
    in.rope.theta = 12345;
    cpu->prefill(in);
    for (idx_t i = n; i < n + 300; i++) { // a recent level and a tail
        cpu->add_kv(1, x.keys.data() + i * d, x.values.data() + i * d);
    }
    auto gpu = index_cpu_to_gpu(nullptr, cpu.get());
    EXPECT_STREQ(gpu->type_name(), "GpuIndexLSHSample");
    EXPECT_EQ(index_factory_string(gpu.get()), "BF16,GPU,Sink4,Window64,LSHSample8x75");
    EXPECT_EQ(get_index_parameter(gpu.get(), "min_hits"), 1.0);
    EXPECT_TRUE(gpu->has_rope);
    EXPECT_EQ(gpu->rope.theta, 12345);
    EXPECT_EQ(gpu->ntotal, cpu->ntotal);

    // io of the GPU index = its twin's record; it reads back as the CPU
    // type, whose attention is the CPU's bit for bit
    std::vector<uint8_t> from_gpu, from_cpu;
    write_index(gpu.get(), &from_gpu);
    write_index(cpu.get(), &from_cpu);
    EXPECT_EQ(from_gpu, from_cpu);
    auto read = read_index(from_gpu);
    EXPECT_STREQ(read->type_name(), cpu->type_name());
    std::vector<float> a(4 * d), al(4), b(4 * d), bl(4);
    cpu->attend(4, x.queries.data(), a.data(), al.data());
    read->attend(4, x.queries.data(), b.data(), bl.data());
    EXPECT_EQ(a, b);
    EXPECT_EQ(al, bl);
    auto back = index_gpu_to_cpu(gpu.get());
    EXPECT_EQ(index_factory_string(back.get()), index_factory_string(cpu.get()));
    back->attend(4, x.queries.data(), b.data(), bl.data());
    EXPECT_EQ(a, b);
    compare_with_twin(*cpu, *gpu, x.queries.data(), 4, 1, "converted");

    // decode on both: the twin inside the GPU index stays the CPU's record
    for (idx_t i = n + 300; i < n + 400; i++) {
        cpu->add_kv(1, x.keys.data() + i * d, x.values.data() + i * d);
        gpu->add_kv(1, x.keys.data() + i * d, x.values.data() + i * d);
    }
    write_index(gpu.get(), &from_gpu);
    write_index(cpu.get(), &from_cpu);
    EXPECT_EQ(from_gpu, from_cpu);
    compare_with_twin(*cpu, *gpu, x.queries.data(), 4, 2, "decoded");
}

TEST(GpuLSH, KnobsAndBadInput) {
    KVINDEX_REQUIRE_GPU();
    register_gpu_index_types();
    const int d = 64;
    for (const char* s : {"GPU,LSHSample10x150", "BF16,GPU,Sink4,Window64,LSHSample10x150",
                          "FP16,GPU,Window16,LSHSample8x75"}) {
        auto index = index_factory(d, s);
        EXPECT_EQ(index_factory_string(index.get()), s);
    }
    auto g = index_factory(d, "GPU,Sink4,Window64,LSHSample10x150|min_hits=1");
    EXPECT_STREQ(g->type_name(), "GpuIndexLSHSample");
    EXPECT_EQ(get_index_parameter(g.get(), "min_hits"), 1.0);
    EXPECT_THROW_MSG(set_index_parameters(g.get(), "k=7"), "unknown parameter 'k'"); // as the CPU's
    EXPECT_EQ(as_lsh(*g).lsh().min_hits, 1);
    auto x = make_kv(500, 2, d, 81, true);
    g->add_kv(500, x.keys.data(), x.values.data());
    std::vector<float> out(2 * d), lse(2);
    Selection sel[2];

    // max_sample: a capped sample is not on the device, everywhere it can come in
    EXPECT_THROW_MSG(set_index_parameter(g.get(), "max_sample", 5), "max_sample");
    SearchParametersLSH p;
    p.max_sample = 3;
    EXPECT_THROW_MSG(g->attend(2, x.queries.data(), out.data(), lse.data(), &p), "max_sample");
    EXPECT_THROW_MSG(g->select(2, x.queries.data(), sel, &p), "max_sample");
    auto capped = index_factory(d, "LSHSample10x150|max_sample=50");
    EXPECT_THROW_MSG(index_cpu_to_gpu(res(), capped.get()), "max_sample");
    // min_hits beyond the tables
    p.max_sample = -1;
    p.min_hits = 151;
    EXPECT_THROW_MSG(g->attend(2, x.queries.data(), out.data(), lse.data(), &p), "min_hits");
    EXPECT_THROW_MSG(set_index_parameter(g.get(), "min_hits", 151), "min_hits");
    // the per-call knob reaches the device
    p.min_hits = 2;
    g->select(2, x.queries.data(), sel, &p);
    std::vector<Selection> cs(2);
    auto cpu = index_gpu_to_cpu(g.get());
    cpu->select(2, x.queries.data(), cs.data(), &p);
    for (int i = 0; i < 2; i++) {
        if (!near_hyperplane(as_lsh(*g).lsh(), x.queries.data() + i * d)) {
            EXPECT_EQ(sel[i].ids, cs[i].ids);
        }
    }
    // shapes without a kernel, a shared layer storage
    EXPECT_THROW_MSG(index_factory(96, "GPU,LSHSample10x150"), "d=96");
    EXPECT_THROW_MSG(GpuKVCache(2, 4, 2, d, d, "LSHSample10x150"), "per-head state");
    EXPECT_THROW_MSG(GpuIndexLSHSample(res(), d, "Sink4,TopK(Flat)"), "LSHSample");
    // the hyperplanes change on an empty index only
    EXPECT_THROW_MSG(const_cast<GpuIndexLSHSample&>(as_lsh(*g)).set_seed(5), "empty");
}
