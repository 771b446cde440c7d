#pragma once

// MagicPIG's LSH sampling on the device (IndexLSHSample, papers/magicpig.txt):
// the query's SimHash codes, the collision count over the CSR hash tables,
// the inclusion probability u of each sampled key, and the score bias
// -log2 u that turns list_attention into the unbiased estimator
// softmax(s_i - log u_i). A query row is hashed raw; keys were centred by
// the mean and hashed by the CPU code (IndexLSHSample::add_kv), whose tables
// the device reads as they are.
//
// Shapes (device memory, row-major; n_rows = n_heads * rows_per_head, row r
// belongs to head r / rows_per_head; "inner" ids count the tokens of the
// sampled middle, token row = first_inner + inner id):
//   q              [n_rows][D] float32
//   planes         head h at planes + h * planes_head_stride: [K * L][D]
//                  float32, hyperplane lK + b is bit b of table l (stride 0:
//                  every head shares one set)
//   mean           head h at mean + h * mean_head_stride: [D] float32
//   q_codes        [n_rows][L] uint16: bit b of code l = (<q, plane lK+b> > 0)
//   q_mean, q_norm [n_rows] float32: <q, mean of the row's head>, |q|
//   level          (main and recent) head h at offsets + h * offsets_head_stride:
//                  [L][2^K + 1] uint32 bucket starts, and at ids + h *
//                  ids_head_stride: [L][n_per_table] int32 inner ids sorted
//                  by bucket (IndexLSHSample::build_tables)
//   tail_codes     head h at tail_codes + h * tail_head_stride: [n_tail][L]
//                  uint16, the codes of inner tokens tail_begin .. in no level
//   seen1, seen2   [n_rows][words] uint32 bitsets over the inner ids of the
//                  levels (min_hits <= 2): hit at least once / twice (the
//                  global walk; the range walk holds them in shared memory)
//   counts         [n_rows][words] uint32, two 16-bit collision counters per
//                  word (min_hits >= 3; L <= 4096 cannot carry into the other half)
//   list ids, lens [n_rows][stride] int32 token rows, [n_rows] int32: the
//                  sample of each row, in no particular order (appended by
//                  atomics), each sampled token exactly once
//   norms          head h at norms + h * norms_head_stride: [n_inner] float32,
//                  |k_i - mean|
//
// Launch shapes are documented at each kernel.

#include <cooperative_groups.h>

#include <cstdint>

#include "kv_vec.cuh"

namespace kvindex {
namespace gpu {

/// Smallest inclusion probability, as the CPU's LSHInclusionTable::kMinInclusion:
/// below it u is this floor, so that the weights 1/u stay finite.
constexpr float kLSHMinInclusion = 1e-30f;

/// 2^e2 * x for x >= 0, without overflow (2^e2 <= 2 here) nor a needless
/// underflow of 2^e2 alone (x may be large after renormalisations).
__host__ __device__ inline float lsh_scaled(float e2, float x) {
    if (e2 > -120.0f) {
        return exp2f(e2) * x;
    }
    return x > 0.0f ? exp2f(e2 + log2f(x)) : 0.0f;
}

/** MagicPIG's inclusion probability for a key at cosine c from the query:
 * p = 1 - theta / pi, P = p^K (one table collides), u = P[Binomial(L, P)
 * >= m], floored at kLSHMinInclusion; m <= 0 gives 1. The algorithm of
 * lsh_inclusion_probability (index/IndexLSHSample.cpp) in float:
 *
 *  - p = acos(-c) / pi, not 1 - acos(c) / pi: accurate relative to p as p
 *    goes to 0 (theta near pi), where u ~ C(L, m) p^(mK) amplifies any
 *    relative error of p by m K;
 *  - P = p^K by repeated squaring (each step 0.5 ulp, no log / exp);
 *  - the binomial terms t_j = C(L, j) P^j (1-P)^(L-j) by their ratio
 *    recurrence from t_0 = (1-P)^L, kept as 2^e * t with t renormalised by
 *    2^-100 steps, so that neither (1-P)^L underflowing (large L P) nor
 *    the terms near the mode overflowing (large m) loses them;
 *  - lower = sum_{j < m} t_j; u = 1 - lower while lower < 0.5, else the
 *    upper tail summed directly (1 - lower would cancel).
 *
 * Accuracy (for c exact in float, where u >= 1e-30): the error of p
 * (acosf: 2 ulp, times 1/pi: 0.5 ulp) is amplified m K times at most (u
 * ~ P^m for small P), the squarings add K ulp / 2 to P, the recurrence,
 * log1pf and exp2f a few ulp: |u_float / u - 1| <= (0.5 K m + 4) 1e-6,
 * i.e. 1.4e-5 at MagicPIG's K = 10, m = 2 (tests/gpu/test_gpu_lsh.cpp
 * checks it over K in [1, 16], L up to 300, m in 1..3; the same code on
 * the host, with glibc's float functions, peaks at 3.6e-6 for K = 10, m =
 * 2 and 8.9e-6 for K = 16, m = 3). Far beyond MagicPIG's min_hits (tens
 * to thousands) the scale 2^e2 carries the error of a large exponent:
 * ~1e-4 at L = 4096, m = 2000. The CPU's table is exact to 1e-7; the
 * sample, not this rounding, dominates the estimator's error. */
__host__ __device__ inline float lsh_inclusion_of_p(float p, int K, int L, int m);

__host__ __device__ inline float lsh_inclusion(float c, int K, int L, int m) {
    if (m <= 0) {
        return 1.0f;
    }
    if (m > L) { // never collides m times: u = 0, floored
        return kLSHMinInclusion;
    }
    c = fminf(1.0f, fmaxf(-1.0f, c)); // a NaN becomes 1 (fminf): u = 1, never a NaN weight
    return lsh_inclusion_of_p(acosf(-c) * 0.318309886183790672f, K, L, m); // p = 1 - theta / pi
}

/// lsh_inclusion for a single-bit collision probability p = 1 - theta / pi
/// in [0, 1], 1 <= m <= L.
__host__ __device__ inline float lsh_inclusion_of_p(float p, int K, int L, int m) {
    if (p >= 1.0f) {
        return 1.0f;
    }
    float P = 1.0f, b = p;
    for (int e = K; e > 0; e >>= 1) {
        if (e & 1) {
            P *= b;
        }
        b *= b;
    }
    if (!(P > 0.0f)) { // p^K underflowed: u <= C(L, m) P^m is far below the floor
        return kLSHMinInclusion;
    }
    if (P >= 1.0f) {
        return 1.0f;
    }
    constexpr float kDown = 0x1p-100f; // renormalisation step of the terms (exact)
    constexpr float kBig = 0x1p100f;
    const float ratio = P / (1.0f - P);
    // t_j = 2^e2 * t: e2 starts at log2 t_0 = L log2(1 - P)
    float e2 = float(L) * (log1pf(-P) * 1.44269504088896341f);
    float t = 1.0f, lower = 0.0f;
    int j = 0;
    for (; j < m; j++) {
        lower += t;
        t *= float(L - j) / float(j + 1) * ratio;
        if (t > kBig) {
            t *= kDown;
            lower *= kDown;
            e2 += 100.0f;
        }
    }
    const float low = lsh_scaled(e2, lower);
    if (low < 0.5f) {
        return 1.0f - low;
    }
    // 1 - lower would cancel: sum the upper tail from t (= t_m) directly;
    // the terms decrease past the mode, which lies below m here
    float upper = 0.0f;
    for (; j <= L; j++) {
        upper += t;
        if (t < 0x1p-30f * upper) {
            break;
        }
        t *= float(L - j) / float(j + 1) * ratio;
        if (t > kBig) {
            t *= kDown;
            upper *= kDown;
            e2 += 100.0f;
        }
    }
    return fminf(1.0f, fmaxf(kLSHMinInclusion, lsh_scaled(e2, upper)));
}

/// Cells of the table over p that the attention's bias reads.
constexpr int kLSHTableCells = 16384;
constexpr int kLSHTableThreads = 128;
/// log2 of kLSHMinInclusion: the floor of log2 u.
constexpr float kLSHLog2MinInclusion = -99.65784284662087f;

/** The table of the inclusion probability over p = 1 - theta / pi, in the
 * variable that is smooth on all of [0, 1]: g(p) = log2 u(p) - m K log2 p
 * (u ~ C(L, m) p^(mK) as p -> 0, so g(0) = log2 C(L, m); the CPU's
 * LSHInclusionTable shifts its far half the same way), at p_i = i / N, i =
 * 0 .. N. u = P[Binomial(L, p^K) >= m] is summed from its terms in the log
 * domain in double (lgamma; no floor, no cancellation): exact to double
 * rounding. Grid (N + 1), block kLSHTableThreads; 1 <= m <= L. Built once
 * per (device, K, L, m) (lsh_sample.cu). */
__global__ void __launch_bounds__(kLSHTableThreads) lsh_table_kernel(int K, int L, int m,
                                                                      float* g) {
    __shared__ double red[kLSHTableThreads / 32];
    const int i = blockIdx.x;
    constexpr double kLn2 = 0.6931471805599453;
    const double log_c = lgamma(L + 1.0);
    if (i == 0 || i == kLSHTableCells) { // the limit at p = 0; u = 1 at p = 1
        if (threadIdx.x == 0) {
            g[i] = i == 0 ? float((log_c - lgamma(m + 1.0) - lgamma(L - m + 1.0)) / kLn2) : 0.0f;
        }
        return; // the whole block
    }
    const double p = double(i) / kLSHTableCells;
    const double log_P = K * log(p), log_Q = log1p(-exp(log_P));
    auto term = [&](int j) {
        return log_c - lgamma(j + 1.0) - lgamma(L - j + 1.0) + j * log_P + (L - j) * log_Q;
    };
    // log-sum-exp of the terms j = m .. L: their max, then the sum
    auto reduce = [&](double x, bool is_max) {
        for (int off = 16; off > 0; off /= 2) {
            const double y = __shfl_xor_sync(kFullMask, x, off);
            x = is_max ? fmax(x, y) : x + y;
        }
        if (threadIdx.x % 32 == 0) {
            red[threadIdx.x / 32] = x;
        }
        __syncthreads();
        double r = red[0];
        for (int w = 1; w < kLSHTableThreads / 32; w++) {
            r = is_max ? fmax(r, red[w]) : r + red[w];
        }
        __syncthreads(); // red is rewritten by the next reduction
        return r;
    };
    double mx = -INFINITY;
    for (int j = m + int(threadIdx.x); j <= L; j += kLSHTableThreads) {
        mx = fmax(mx, term(j));
    }
    mx = reduce(mx, true);
    double sum = 0.0;
    for (int j = m + int(threadIdx.x); j <= L; j += kLSHTableThreads) {
        sum += exp(term(j) - mx);
    }
    sum = reduce(sum, false);
    if (threadIdx.x == 0) {
        g[i] = float((mx + log(sum)) / kLn2 - double(m) * K * log2(p));
    }
}

/** log2 u for cosine c from the table: p = acos(-c) / pi, g interpolated
 * linearly between the two nodes around p, plus m K log2 p, within
 * [log2 of the floor, 0]. The interpolation of the smooth g is within
 * 3.4e-6 (relative, in u) of the exact u over K in [1, 16], L up to 300,
 * m in 1..3 (a double evaluation of both; worst at K = 1, L = 300); float
 * rounding adds a few 1e-6. One acosf, one log2f, two loads and an fma per
 * sampled key, where lsh_inclusion sums the binomial tail. */
__device__ __forceinline__ float lsh_log2_inclusion_table(float c, const float* __restrict__ t,
                                                          float mK) {
    c = fminf(1.0f, fmaxf(-1.0f, c));
    const float p = acosf(-c) * 0.318309886183790672f;
    const float x = p * kLSHTableCells;
    const int i = min(int(x), kLSHTableCells - 1);
    const float a = __ldg(t + i), b = __ldg(t + i + 1);
    const float v = fmaf(x - float(i), b - a, a) + mK * log2f(p); // p = 0: -inf, floored
    return fmaxf(kLSHLog2MinInclusion, fminf(0.0f, v));
}

/** The score bias of the unbiased estimator for list_slices_kernel
 * (attend_slice): -log2 u_t, u_t the inclusion probability at cos(q, k_t -
 * mean) read from Params::log2u_table (lsh_log2_inclusion_table), cos =
 * (<q, k_t> - <q, mean>) / (|q| |k_t - mean|) from the base-2 score s =
 * q_scale <q, k_t> the kernel already has, so that a sampled key costs no
 * extra read but its norm. A zero norm gives cos 0, as on the CPU. */
struct LSHBias {
    struct Params {
        const float* q_mean = nullptr; ///< [n_rows] <q, mean>
        const float* q_norm = nullptr; ///< [n_rows] |q|
        const float* norms = nullptr;  ///< head h at norms + h * norms_head_stride: [n_inner]
        int64_t norms_head_stride = 0;
        int64_t first_inner = 0;       ///< token row of inner token 0
        float inv_q_scale = 1.0f;      ///< 1 / q_scale: s back to <q, k_t>
        int K = 1, L = 1, min_hits = 1;
        /// the table over p (lsh_table_kernel) of (K, L, min_hits); the
        /// attention needs it (lsh_fill_kernel, select's exact u, does not)
        const float* log2u_table = nullptr;
    };

    const float* norms;
    int64_t first_inner;
    float q_mean, q_norm, inv_q_scale;
    int K, L, min_hits;
    const float* table;

    __device__ LSHBias(const Params& p, int64_t head, int64_t row)
            : norms(p.norms + head * p.norms_head_stride),
              first_inner(p.first_inner),
              q_mean(p.q_mean[row]),
              q_norm(p.q_norm[row]),
              inv_q_scale(p.inv_q_scale),
              K(p.K),
              L(p.L),
              min_hits(p.min_hits),
              table(p.log2u_table) {}

    /// t: a token row of the list (an inner token): its norm.
    __device__ float fetch(int64_t t) const {
        return __ldg(norms + (t - first_inner));
    }

    /// norm: fetch(t); s: the token's base-2 score.
    __device__ float operator()(float norm, float s) const {
        const float den = q_norm * norm;
        const float c = den > 0.0f ? (s * inv_q_scale - q_mean) / den : 0.0f;
        return -lsh_log2_inclusion_table(c, table, float(K * min_hits));
    }
};

// ---- query hashing ----------------------------------------------------------

/// One warp per bit of a table: K <= 16 warps a block.
constexpr int kHashMaxWarps = 16;

struct LSHHashArgs {
    const float* q;
    int64_t n_rows;
    int rows_per_head;
    /// rows hashed against one set of planes: rows_per_head with planes per
    /// head, n_rows with shared planes (a tile of rows then spans heads)
    int64_t rows_per_group;
    const float* planes;
    int64_t planes_head_stride; ///< elements; 0: shared
    const float* mean;
    int64_t mean_head_stride;   ///< elements; 0: shared
    int K, L;
    uint16_t* q_codes;
    float* q_mean;
    float* q_norm;
};

/// Sum over the 32 lanes of a warp (every lane gets it; all 32 must call).
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) {
        x += __shfl_xor_sync(kFullMask, x, off);
    }
    return x;
}

/** The L codes of each query row and its <q, mean>, |q|: grid (L + 1,
 * n_groups, ceil(rows_per_group / NR)), block K warps. Block x < L is
 * table x: warp b computes bit b for NR rows of the group (the rows'
 * elements in registers, D / 32 per lane, the plane read once for the NR
 * rows), so the K plane reads of a table are in flight together instead
 * of one after another; the bits meet in shared memory. Block x = L
 * computes <q, mean> and |q|, row r by warp r % K. */
template <int D, int NR>
__global__ void __launch_bounds__(kHashMaxWarps * 32) lsh_hash_kernel(LSHHashArgs a) {
    constexpr int E = D / 32;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int n_warps = blockDim.x / 32;
    const int l = blockIdx.x;
    const int64_t group = blockIdx.y;
    int64_t rows[NR];
    bool valid[NR];
    float q[NR][E];
#pragma unroll
    for (int r = 0; r < NR; r++) {
        const int64_t in_group = int64_t(blockIdx.z) * NR + r;
        valid[r] = in_group < a.rows_per_group;
        rows[r] = group * a.rows_per_group + in_group;
#pragma unroll
        for (int e = 0; e < E; e++) {
            q[r][e] = valid[r] ? a.q[rows[r] * D + lane + 32 * e] : 0.0f;
        }
    }
    if (l < a.L) { // the whole block: its barriers are uniform
        __shared__ uint32_t codes[NR];
        if (threadIdx.x < NR) {
            codes[threadIdx.x] = 0;
        }
        __syncthreads();
        // the head of the group (planes per head: groups are heads)
        const int64_t group_head = a.planes_head_stride != 0 ? group : 0;
        const float* plane = a.planes + group_head * a.planes_head_stride +
                (int64_t(l) * a.K + warp) * D;
        float pv[E];
#pragma unroll
        for (int e = 0; e < E; e++) {
            pv[e] = plane[lane + 32 * e];
        }
#pragma unroll
        for (int r = 0; r < NR; r++) {
            float s = 0.0f;
#pragma unroll
            for (int e = 0; e < E; e++) {
                s = fmaf(q[r][e], pv[e], s);
            }
            s = warp_sum(s);
            if (lane == 0 && s > 0.0f) {
                atomicOr(codes + r, 1u << warp);
            }
        }
        __syncthreads();
        const int64_t in_group = int64_t(blockIdx.z) * NR + threadIdx.x;
        if (threadIdx.x < NR && in_group < a.rows_per_group) {
            a.q_codes[(group * a.rows_per_group + in_group) * a.L + l] =
                    uint16_t(codes[threadIdx.x]);
        }
        return;
    }
    // l == L: <q, mean of the row's head> and |q|
#pragma unroll
    for (int r = 0; r < NR; r++) {
        if (r % n_warps != warp) {
            continue; // the warp's, not a lane's: the shuffles below have all lanes
        }
        // rows of a tile may span heads when the planes are shared
        const int64_t head = valid[r] ? rows[r] / a.rows_per_head : 0;
        const float* mean = a.mean + head * a.mean_head_stride;
        float qm = 0.0f, qq = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++) {
            qm = fmaf(q[r][e], valid[r] ? mean[lane + 32 * e] : 0.0f, qm);
            qq = fmaf(q[r][e], q[r][e], qq);
        }
        qm = warp_sum(qm);
        qq = warp_sum(qq);
        if (lane == 0 && valid[r]) {
            a.q_mean[rows[r]] = qm;
            a.q_norm[rows[r]] = sqrtf(qq);
        }
    }
}

// ---- collision counting -------------------------------------------------------

/// One CSR level as the kernels read it (see the shapes above).
struct LSHLevelArgs {
    const uint32_t* offsets;
    int64_t offsets_head_stride;
    const int32_t* ids;
    int64_t ids_head_stride;
    int64_t n_per_table; ///< ids per table; 0: the level is empty

    /// Table l's 2^K + 1 bucket starts for head `head`.
    __device__ const uint32_t* table_offsets(int64_t head, int l, int K) const {
        return offsets + head * offsets_head_stride + int64_t(l) * ((int64_t(1) << K) + 1);
    }
    /// Table l's ids for head `head`, sorted by bucket: [n_per_table].
    __device__ const int32_t* table_ids(int64_t head, int l) const {
        return ids + head * ids_head_stride + int64_t(l) * n_per_table;
    }
};

/// The rows' lists the sampler appends to.
struct LSHListOut {
    int32_t* ids;        ///< [n_rows][stride]
    int32_t* lens;       ///< [n_rows], zeroed before the sampling
    int64_t stride;      ///< >= every inner token: a token is appended once
    int64_t first_inner; ///< token row of inner token 0
};

/** Appends inner token `id` to row `row`'s list. The lanes of the warp that
 * append at this point share one atomicAdd (they all serve the same row:
 * a block is one row), so that a row's length is not one hot atomic per
 * token. Called in divergent code: coalesced_threads() is the set of lanes
 * here now. */
__device__ __forceinline__ void lsh_append(const LSHListOut& out, int64_t row, int64_t id) {
    namespace cg = cooperative_groups;
    cg::coalesced_group g = cg::coalesced_threads();
    int base = 0;
    if (g.thread_rank() == 0) {
        base = atomicAdd(out.lens + row, int(g.size()));
    }
    base = g.shfl(base, 0);
    const int64_t pos = int64_t(base) + g.thread_rank();
    if (pos < out.stride) { // always true: each inner token is appended once
        out.ids[row * out.stride + pos] = int32_t(out.first_inner + id);
    }
}

struct LSHWalkArgs {
    const uint16_t* q_codes;
    int rows_per_head;
    int K, L;
    int min_hits;
    LSHLevelArgs main, recent;
    uint32_t* seen1;  ///< [n_rows][words] (modes 1, 2)
    uint32_t* seen2;  ///< [n_rows][words] (mode 2)
    uint32_t* counts; ///< [n_rows][words] (mode 3)
    int64_t words;    ///< words per row of the array the mode uses
    LSHListOut out;

    /// The level of walked bucket b: the main level's L tables, then the
    /// recent level's.
    __device__ LSHLevelArgs level_of(int b) const {
        return b >= L ? recent : main;
    }
    /// The table of walked bucket b within its level.
    __device__ int table_of(int b) const {
        return b >= L ? b - L : b;
    }
};

/** Walks the query's bucket of one table in one level for one row: grid
 * (2 L, n_rows), block kWalkThreads; block x < L is table x of the main
 * level, x >= L table x - L of the recent level. Each id of the bucket is
 * one collision of that token; the token is appended to the row's list at
 * its min_hits-th collision, exactly once whatever the order in which the
 * blocks run: kMode 1 (min_hits 1): the atomicOr that sets its bit in seen1
 * appends; kMode 2 (min_hits 2): a hit that finds the seen1 bit set tries
 * seen2, and the one that sets the seen2 bit appends; kMode 3 (min_hits >=
 * 3): the atomicAdd that takes its 16-bit counter from min_hits - 1
 * appends. A token lives in one level only, so both levels share the
 * arrays. */
constexpr int kWalkThreads = 128;

template <int kMode>
__global__ void __launch_bounds__(kWalkThreads) lsh_walk_kernel(LSHWalkArgs a) {
    const int l = a.table_of(int(blockIdx.x));
    const LSHLevelArgs level = a.level_of(int(blockIdx.x));
    if (level.n_per_table == 0) {
        return; // the whole block: no barrier follows
    }
    const int64_t row = blockIdx.y;
    const int64_t head = row / a.rows_per_head;
    const uint32_t code = a.q_codes[row * a.L + l];
    const uint32_t* off = level.table_offsets(head, l, a.K);
    const int64_t b0 = off[code], b1 = off[code + 1];
    const int32_t* ids = level.table_ids(head, l);
    uint32_t* seen1 = a.seen1 ? a.seen1 + row * a.words : nullptr;
    uint32_t* seen2 = a.seen2 ? a.seen2 + row * a.words : nullptr;
    uint32_t* counts = a.counts ? a.counts + row * a.words : nullptr;
    for (int64_t i = b0 + threadIdx.x; i < b1; i += kWalkThreads) {
        const uint32_t id = uint32_t(ids[i]);
        bool emit;
        if (kMode == 3) {
            const uint32_t shift = (id & 1u) * 16u;
            const uint32_t old = atomicAdd(counts + (id >> 1), 1u << shift);
            emit = ((old >> shift) & 0xffffu) + 1u == uint32_t(a.min_hits);
        } else {
            const uint32_t bit = 1u << (id & 31u);
            const uint32_t old = atomicOr(seen1 + (id >> 5), bit);
            if (kMode == 1) {
                emit = (old & bit) == 0;
            } else {
                emit = false;
                if (old & bit) { // a second (or later) hit: the first to mark seen2 appends
                    emit = (atomicOr(seen2 + (id >> 5), bit) & bit) == 0;
                }
            }
        }
        if (emit) {
            lsh_append(a.out, row, id);
        }
    }
}

constexpr int kRangeWalkThreads = 1024;
/// ids a lane loads before its first atomic (loads in flight per lane)
constexpr int kRangeWalkUnroll = 4;
/// buckets whose bounds are searched at once: one thread per bound
constexpr int kRangeWalkChunk = kRangeWalkThreads / 2;

/// First position in ids[b, e) (ascending) holding an id >= x, or e.
__device__ __forceinline__ uint32_t lower_bound_ids(const int32_t* ids, uint32_t b, uint32_t e,
                                                    int64_t x) {
    uint32_t n = e - b;
    while (n > 0) {
        const uint32_t half = n / 2;
        if (int64_t(__ldg(ids + b + half)) < x) {
            b += half + 1;
            n -= half + 1;
        } else {
            n = half;
        }
    }
    return b;
}

/** The collision count of lsh_walk_kernel (kMode 1 and 2) with the
 * bitsets in shared memory: grid (n_parts, n_rows), block
 * kRangeWalkThreads, dynamic shared memory kMode * wpb words. Block p owns
 * the inner tokens [p * 32 wpb, (p + 1) * 32 wpb) of its row: its seen1
 * (then seen2 for kMode 2) bitsets over them live in its shared memory,
 * so that every hit is a shared-memory atomic instead of one in L2. The
 * ids of a bucket are ascending (IndexLSHSample::build_tables, both
 * levels), so the block reads only the run of each bucket that falls in
 * its tokens: the buckets (the L main tables, then the L recent ones when
 * that level holds tokens) go by chunks of kRangeWalkChunk, one thread
 * per bound searches it (lower_bound_ids), then one warp per bucket walks
 * the run. The block then appends its tokens set in the final bitset
 * (seen1 for min_hits 1, seen2 for 2) to the row's list, with one
 * atomicAdd on the row's length. A token is appended exactly once, as in
 * lsh_walk_kernel. */
template <int kMode>
__global__ void __launch_bounds__(kRangeWalkThreads) lsh_range_walk_kernel(LSHWalkArgs a,
                                                                           int64_t wpb) {
    static_assert(kMode == 1 || kMode == 2, "bitsets count one or two hits");
    extern __shared__ uint32_t bits[]; // seen1 [wpb], then seen2 [wpb] (kMode 2)
    __shared__ uint32_t run_begin[kRangeWalkChunk], run_end[kRangeWalkChunk];
    uint32_t* seen1 = bits;
    uint32_t* seen2 = bits + wpb;
    const int64_t row = blockIdx.y;
    const int64_t head = row / a.rows_per_head;
    const int64_t lo = int64_t(blockIdx.x) * wpb * 32; // the block's inner tokens [lo, hi)
    const int64_t hi = lo + wpb * 32;
    for (int64_t i = threadIdx.x; i < kMode * wpb; i += kRangeWalkThreads) {
        bits[i] = 0;
    }
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int n_buckets = a.recent.n_per_table > 0 ? 2 * a.L : a.L;
    for (int chunk = 0; chunk < n_buckets; chunk += kRangeWalkChunk) {
        // the run of each bucket of the chunk inside [lo, hi): a thread a bound
        const int c = int(threadIdx.x) / 2;
        const int b = chunk + c;
        if (b < n_buckets) {
            const int l = a.table_of(b);
            const LSHLevelArgs level = a.level_of(b);
            // the level's ids: [first, first + n_per_table)
            const int64_t first = b >= a.L ? a.main.n_per_table : 0;
            uint32_t bound = 0;
            if (level.n_per_table > 0) {
                const uint32_t code = a.q_codes[row * a.L + l];
                const uint32_t* off = level.table_offsets(head, l, a.K);
                const uint32_t b0 = off[code], b1 = off[code + 1];
                const int64_t x = threadIdx.x % 2 == 0 ? lo : hi;
                if (x <= first) {
                    bound = b0; // every id of the level is >= x
                } else if (x >= first + level.n_per_table) {
                    bound = b1; // none is
                } else {
                    bound = lower_bound_ids(level.table_ids(head, l), b0, b1, x);
                }
            }
            (threadIdx.x % 2 == 0 ? run_begin : run_end)[c] = bound;
        }
        __syncthreads(); // the runs (and, the first time, the zeroed bitsets)
        const int n_chunk = min(kRangeWalkChunk, n_buckets - chunk);
        for (int j = warp; j < n_chunk; j += kRangeWalkThreads / 32) {
            const int b = chunk + j;
            const int32_t* ids = a.level_of(b).table_ids(head, a.table_of(b));
            const uint32_t e = run_end[j];
            for (uint32_t i = run_begin[j] + lane; i < e; i += 32 * kRangeWalkUnroll) {
                int64_t id[kRangeWalkUnroll];
#pragma unroll
                for (int u = 0; u < kRangeWalkUnroll; u++) {
                    const uint32_t k = i + 32 * u;
                    id[u] = k < e ? int64_t(__ldg(ids + k)) : -1;
                }
#pragma unroll
                for (int u = 0; u < kRangeWalkUnroll; u++) {
                    if (id[u] < 0) {
                        continue;
                    }
                    const uint32_t t = uint32_t(id[u] - lo); // < 32 wpb
                    const uint32_t bit = 1u << (t & 31u);
                    const uint32_t old = atomicOr(seen1 + (t >> 5), bit);
                    if (kMode == 2 && (old & bit)) {
                        atomicOr(seen2 + (t >> 5), bit);
                    }
                }
            }
        }
        __syncthreads(); // the runs are rewritten by the next chunk; the hits are in
    }

    // the block's tokens: count, reserve a run of the row's list, write
    const uint32_t* final_bits = kMode == 2 ? seen2 : seen1;
    const int64_t w0 = int64_t(blockIdx.x) * wpb;
    const int64_t n_own = w0 < a.words ? min(wpb, a.words - w0) : 0;
    __shared__ int block_count, block_base;
    if (threadIdx.x == 0) {
        block_count = 0;
    }
    __syncthreads();
    int mine = 0;
    for (int64_t w = threadIdx.x; w < n_own; w += kRangeWalkThreads) {
        mine += __popc(final_bits[w]);
    }
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) {
        mine += __shfl_xor_sync(kFullMask, mine, off);
    }
    if (lane == 0 && mine > 0) {
        atomicAdd(&block_count, mine);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        block_base = block_count > 0 ? atomicAdd(a.out.lens + row, block_count) : 0;
        block_count = 0; // now the cursor into the block's run
    }
    __syncthreads();
    int32_t* out = a.out.ids + row * a.out.stride;
    for (int64_t w = threadIdx.x; w < n_own; w += kRangeWalkThreads) {
        uint32_t word = final_bits[w];
        if (word == 0) {
            continue;
        }
        int64_t pos = block_base + atomicAdd(&block_count, __popc(word));
        while (word) {
            const int k = __ffs(int(word)) - 1;
            word &= word - 1;
            if (pos < a.out.stride) { // always true: each inner token is appended once
                out[pos] = int32_t(a.out.first_inner + (w0 + w) * 32 + k);
            }
            pos++;
        }
    }
}

constexpr int kTailWarps = 4;

struct LSHTailArgs {
    const uint16_t* q_codes;
    int rows_per_head;
    int L;
    int min_hits;
    const uint16_t* tail_codes;
    int64_t tail_head_stride; ///< elements
    int64_t tail_begin;       ///< inner id of tail token 0
    int64_t n_tail;
    LSHListOut out;
};

/** The tokens in no level, code by code: grid (ceil(n_tail / kTailWarps),
 * n_rows), one warp per token; lanes compare tables l = lane, lane + 32,
 * ..., the warp sums the matches and lane 0 appends the token when they
 * reach min_hits. A warp past the last token leaves whole (no barrier). */
__global__ void __launch_bounds__(kTailWarps * 32) lsh_tail_kernel(LSHTailArgs a) {
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int64_t i = int64_t(blockIdx.x) * kTailWarps + warp;
    if (i >= a.n_tail) {
        return;
    }
    const int64_t row = blockIdx.y;
    const int64_t head = row / a.rows_per_head;
    const uint16_t* codes = a.tail_codes + head * a.tail_head_stride + i * a.L;
    const uint16_t* qc = a.q_codes + row * a.L;
    float hits = 0.0f; // exact: at most L <= 4096 ones
    for (int l = lane; l < a.L; l += 32) {
        hits += codes[l] == qc[l] ? 1.0f : 0.0f;
    }
    hits = warp_sum(hits);
    if (lane == 0 && hits >= float(a.min_hits)) {
        const int pos = atomicAdd(a.out.lens + row, 1);
        if (pos < a.out.stride) {
            a.out.ids[row * a.out.stride + pos] = int32_t(a.out.first_inner + a.tail_begin + i);
        }
    }
}

// ---- per-entry scores and inclusion probabilities (select, search) ---------------

constexpr int kFillWarps = 4;

/** <q, k_t> and u_t of every entry of each row's list: grid (x, n_rows),
 * block kFillWarps warps, one warp per entry (grid-stride over the list);
 * the row's query in registers, D / 32 elements per lane. u (when `u` is
 * not nullptr) as LSHBias computes it; scores and u are [n_rows][stride],
 * entries past lens[row] untouched. */
template <typename T, int D>
__global__ void __launch_bounds__(kFillWarps * 32) lsh_fill_kernel(
        const T* __restrict__ keys,
        int64_t head_stride,
        const float* __restrict__ q,
        int rows_per_head,
        const int32_t* __restrict__ ids,
        const int32_t* __restrict__ lens,
        int64_t stride,
        LSHBias::Params bias,
        float* __restrict__ scores,
        float* __restrict__ u) {
    constexpr int E = D / 32;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int64_t row = blockIdx.y;
    const int64_t head = row / rows_per_head;
    float qr[E];
#pragma unroll
    for (int e = 0; e < E; e++) {
        qr[e] = q[row * D + lane + 32 * e];
    }
    const T* K = keys + head * head_stride * D;
    const int64_t len = lens[row];
    const int32_t* row_ids = ids + row * stride;
    // the loop bound is the warp's (v is the same on every lane): the
    // shuffles of warp_sum have all 32 lanes
    for (int64_t v = int64_t(blockIdx.x) * kFillWarps + warp; v < len;
         v += int64_t(gridDim.x) * kFillWarps) {
        const int64_t t = row_ids[v];
        const T* k = K + t * D;
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < E; e++) {
            s = fmaf(qr[e], to_float(k[lane + 32 * e]), s);
        }
        s = warp_sum(s);
        if (lane == 0) {
            if (scores) {
                scores[row * stride + v] = s;
            }
            if (u) {
                const float qm = bias.q_mean[row], qn = bias.q_norm[row];
                const float den =
                        qn * bias.norms[head * bias.norms_head_stride + t - bias.first_inner];
                const float c = den > 0.0f ? (s - qm) / den : 0.0f;
                u[row * stride + v] = lsh_inclusion(c, bias.K, bias.L, bias.min_hits);
            }
        }
    }
}

/// u[i] = lsh_inclusion(c[i], K, L, m), or from the table when `table` is
/// not nullptr: the device functions on an array (tests).
__global__ void lsh_inclusion_kernel(const float* c, int64_t n, int K, int L, int m,
                                     const float* table, float* u) {
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
        u[i] = table ? exp2f(lsh_log2_inclusion_table(c[i], table, float(K * m)))
                     : lsh_inclusion(c[i], K, L, m);
    }
}

} // namespace gpu
} // namespace kvindex
