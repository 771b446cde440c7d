#pragma once

// Eviction scores on the device (IndexProxyEvict's proxy_scores): for R =
// n_heads * n_q query rows and n keys,
//
//   F_j = sum_r softmax_r(q_r . K / sqrt(d))_j,
//
// row r seeing the keys j <= lim_r only (causal: lim_r = q_pos[r % n_q] -
// first_pos clamped to [-1, n - 1]; otherwise n - 1). This is GEMM-sized
// work (NaCl at 128k tokens: ~1.5 TMAC per pass for a GQA group of 4), so
// both passes are tiled float32 GEMMs on the CUDA cores: float32 FMA, no
// tensor cores, whose tf32 / bf16 rounding would move scores enough to
// change which tokens are kept.
//
//   pass 0  proxy_limits_kernel     lim_r per row, and its max per row tile
//   pass 1  proxy_lse_kernel        per (row tile, key split): online (max, sum)
//                                   of each row over its visible keys
//           proxy_lse_merge_kernel  per row: the splits merged, lse_r (base 2)
//   pass 2  proxy_colsum_kernel     per (key tile, row split): sum over the
//                                   rows of 2^(s_rj - lse_r), visible only
//           proxy_sum_kernel        per key: the row splits summed in double
//
// A block tile is 64 rows x 64 keys (kProxyTile), 256 threads, each owning
// 4 rows x 4 keys in registers (rows 4 ty .. 4 ty + 3, keys 4 tx .. 4 tx + 3,
// tx = thread % 16, ty = thread / 16); the head dimension is streamed
// through shared memory 32 at a time (kProxyChunk), both operands stored
// transposed ([dim][row]) so that a thread reads its 4 rows and its 4 keys
// as one 16-byte load each. Scores run in base 2: queries are scaled by
// log2(e) / sqrt(d) on their way into shared memory, and both passes
// compute s_rj with the same code (proxy_tile_scores), hence the same bits.
// Tiles whose rows see none of their keys (causal) are skipped whole.
//
// Shapes (device memory, row-major):
//   keys        [n][d] float32, 16-byte aligned, d % 4 == 0
//   queries     [R][d] float32, row r = h * n_q + i (head-major), aligned alike
//   q_pos       [n_q] int64 absolute positions (read when causal only)
//   lims        [R] int32: last visible key of each row, -1 for none
//   tile_max    [ceil(R / 64)] int32: max of lims over each row tile
//   part_m      [n_key_splits][R] float32: max of a row's scores in a split
//   part_l      [n_key_splits][R] float32: sum of 2^(s - part_m) in a split
//   lse         [R] float32, base 2 (-inf: the row sees no key)
//   part_f      [n_row_splits][n] float32: a row split's share of F
//   scores      [n] float32

#include <cuda_runtime.h>

#include <cstdint>

namespace kvindex {
namespace gpu {

constexpr int kProxyTile = 64;      ///< rows and keys of a block tile
constexpr int kProxyChunk = 32;     ///< head dimensions per shared-memory stage
constexpr int kProxyThreads = 256;  ///< 16 x 16 threads, 4 x 4 scores each
constexpr int kProxyMicro = 4;      ///< rows (and keys) per thread
/// Row stride of the transposed tiles in shared memory: a multiple of 4
/// (16-byte reads) that makes the transposing stores conflict-free (see
/// proxy_load_tile).
constexpr int kProxyLd = kProxyTile + 4;

static_assert(kProxyThreads == (kProxyTile / kProxyMicro) * (kProxyTile / kProxyMicro),
              "one thread per 4 x 4 micro-tile");
static_assert(kProxyTile * kProxyChunk / 4 == 2 * kProxyThreads,
              "a tile's chunk is two 16-byte loads per thread");

struct ProxyArgs {
    const float* keys;     ///< [n][d]
    const float* queries;  ///< [R][d]
    int64_t n;             ///< keys
    int64_t n_rows;        ///< R = n_heads * n_q
    int d;
    float q_scale;         ///< log2(e) / sqrt(d)
};

/** Copies dims [c0, c0 + 32) of rows [row0, row0 + 64) of x ([n_x][d]) into
 * dst[dim - c0][row - row0], times `scale`, zeros past the edges (rows >=
 * n_x, dims >= d). Thread t loads two 16-byte vectors: row (lane % 16) +
 * 16 (warp % 4), vector (lane / 16) + 2 (warp / 4 + 2 p), p = 0, 1, so
 * that a warp reads 16 rows x 32 contiguous bytes (whole sectors), and its
 * transposed stores land in 32 distinct banks (rows 0..15 of two dims 4
 * apart: kProxyLd * 4 = 16 mod 32 banks). */
__device__ __forceinline__ void proxy_load_tile(
        const float* __restrict__ x,
        int64_t n_x,
        int d,
        int64_t row0,
        int c0,
        float scale,
        float (*dst)[kProxyLd]) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int row = (lane & 15) + 16 * (warp & 3);
    const int64_t r = row0 + row;
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const int v = (lane >> 4) + 2 * ((warp >> 2) + 2 * p); // 0 .. 7
        const int dim = c0 + 4 * v;
        float4 val = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < n_x && dim < d) { // d % 4 == 0: the vector is whole
            val = __ldg(reinterpret_cast<const float4*>(x + r * d + dim));
        }
        dst[4 * v + 0][row] = val.x * scale;
        dst[4 * v + 1][row] = val.y * scale;
        dst[4 * v + 2][row] = val.z * scale;
        dst[4 * v + 3][row] = val.w * scale;
    }
}

/** acc[i][j] = base-2 score of row row0 + 4 ty + i against key key0 + 4 tx
 * + j over the whole head dimension (0 past the edges). Every thread of
 * the block must call it (it synchronises); qs and ks are the block's
 * shared tiles. */
__device__ __forceinline__ void proxy_tile_scores(
        const ProxyArgs& a,
        int64_t row0,
        int64_t key0,
        float (*qs)[kProxyLd],
        float (*ks)[kProxyLd],
        float (&acc)[kProxyMicro][kProxyMicro]) {
    const int tx = threadIdx.x % 16;
    const int ty = threadIdx.x / 16;
#pragma unroll
    for (int i = 0; i < kProxyMicro; i++) {
#pragma unroll
        for (int j = 0; j < kProxyMicro; j++) {
            acc[i][j] = 0.0f;
        }
    }
    for (int c0 = 0; c0 < a.d; c0 += kProxyChunk) {
        __syncthreads(); // every thread is done reading the previous stage
        proxy_load_tile(a.queries, a.n_rows, a.d, row0, c0, a.q_scale, qs);
        proxy_load_tile(a.keys, a.n, a.d, key0, c0, 1.0f, ks);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kProxyChunk; kk++) {
            const float4 q4 = *reinterpret_cast<const float4*>(&qs[kk][ty * kProxyMicro]);
            const float4 k4 = *reinterpret_cast<const float4*>(&ks[kk][tx * kProxyMicro]);
            const float qv[kProxyMicro] = {q4.x, q4.y, q4.z, q4.w};
            const float kv[kProxyMicro] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
            for (int i = 0; i < kProxyMicro; i++) {
#pragma unroll
                for (int j = 0; j < kProxyMicro; j++) {
                    acc[i][j] = fmaf(qv[i], kv[j], acc[i][j]);
                }
            }
        }
    }
}

/// Pass 0: grid ceil(R / 64), 64 threads (two whole warps).
__global__ void __launch_bounds__(kProxyTile) proxy_limits_kernel(
        const int64_t* __restrict__ q_pos,
        int64_t n_q,
        int64_t n_rows,
        int64_t n,
        int64_t first_pos,
        bool causal,
        int* __restrict__ lims,
        int* __restrict__ tile_max) {
    const int64_t r = int64_t(blockIdx.x) * kProxyTile + threadIdx.x;
    int lim = -1;
    if (r < n_rows) {
        if (causal) {
            const int64_t p = q_pos[r % n_q];
            // p < first_pos: the row sees no key (and p - first_pos cannot overflow)
            lim = p < first_pos ? -1 : int(p - first_pos < n ? p - first_pos : n - 1);
        } else {
            lim = int(n - 1);
        }
        lims[r] = lim;
    }
    int m = lim;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
    }
    __shared__ int warp_max[kProxyTile / 32];
    if ((threadIdx.x & 31) == 0) {
        warp_max[threadIdx.x >> 5] = m;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        tile_max[blockIdx.x] = max(warp_max[0], warp_max[1]);
    }
}

/** Pass 1: grid (row tiles, key splits). Block (rt, ks) reads keys
 * [ks * split_len, min(n, (ks + 1) * split_len)) (split_len a multiple of
 * 64), stopping after the last key a row of the tile sees, and writes each
 * row's (max, sum of 2^(s - max)) over its visible keys there; (-inf, 0)
 * when it sees none. */
__global__ void __launch_bounds__(kProxyThreads) proxy_lse_kernel(
        ProxyArgs a,
        const int* __restrict__ lims,
        const int* __restrict__ tile_max,
        int64_t split_len,
        float* __restrict__ part_m,
        float* __restrict__ part_l) {
    __shared__ __align__(16) float qs[kProxyChunk][kProxyLd];
    __shared__ __align__(16) float ks[kProxyChunk][kProxyLd];
    const int tx = threadIdx.x % 16;
    const int ty = threadIdx.x / 16;
    const int64_t row0 = int64_t(blockIdx.x) * kProxyTile;
    const int64_t k0 = int64_t(blockIdx.y) * split_len;
    const int64_t k1 = min(a.n, k0 + split_len);
    // the same for every thread of the block: the loop below is uniform
    const int64_t k_end = min(k1, int64_t(tile_max[blockIdx.x]) + 1);

    int lim[kProxyMicro];
    float m[kProxyMicro], l[kProxyMicro];
#pragma unroll
    for (int i = 0; i < kProxyMicro; i++) {
        const int64_t r = row0 + ty * kProxyMicro + i;
        lim[i] = r < a.n_rows ? lims[r] : -1;
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    for (int64_t j0 = k0; j0 < k_end; j0 += kProxyTile) {
        float acc[kProxyMicro][kProxyMicro];
        proxy_tile_scores(a, row0, j0, qs, ks, acc);
        const int64_t key = j0 + tx * kProxyMicro;
#pragma unroll
        for (int i = 0; i < kProxyMicro; i++) {
            // lim <= n - 1: keys past n are masked too
            float v[kProxyMicro];
            float tile_m = -INFINITY;
#pragma unroll
            for (int j = 0; j < kProxyMicro; j++) {
                v[j] = key + j <= lim[i] ? acc[i][j] : -INFINITY;
                tile_m = fmaxf(tile_m, v[j]);
            }
            if (tile_m != -INFINITY) {
                const float mn = fmaxf(m[i], tile_m);
                float s = l[i] * exp2f(m[i] - mn); // m = -inf: l = 0, exp2f(-inf) = 0
#pragma unroll
                for (int j = 0; j < kProxyMicro; j++) {
                    s += exp2f(v[j] - mn); // masked: exp2f(-inf) = 0
                }
                l[i] = s;
                m[i] = mn;
            }
        }
    }
    // the 16 threads of a row group are the lanes of one half-warp: every
    // lane of every warp runs the shuffles (xor offsets < 16 stay in the half)
#pragma unroll
    for (int i = 0; i < kProxyMicro; i++) {
        float mm = m[i];
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) {
            mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, off));
        }
        float ll = mm == -INFINITY ? 0.0f : l[i] * exp2f(m[i] - mm);
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) {
            ll += __shfl_xor_sync(0xffffffffu, ll, off);
        }
        const int64_t r = row0 + ty * kProxyMicro + i;
        if (tx == 0 && r < a.n_rows) {
            part_m[int64_t(blockIdx.y) * a.n_rows + r] = mm;
            part_l[int64_t(blockIdx.y) * a.n_rows + r] = ll;
        }
    }
}

/// Pass 1, merge: lse of each row from its n_splits partials (in double).
__global__ void proxy_lse_merge_kernel(
        const float* __restrict__ part_m,
        const float* __restrict__ part_l,
        int n_splits,
        int64_t n_rows,
        float* __restrict__ lse) {
    const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (r >= n_rows) {
        return;
    }
    float mx = -INFINITY;
    for (int s = 0; s < n_splits; s++) {
        mx = fmaxf(mx, part_m[int64_t(s) * n_rows + r]);
    }
    if (mx == -INFINITY) { // no visible key
        lse[r] = -INFINITY;
        return;
    }
    double sum = 0.0;
    for (int s = 0; s < n_splits; s++) {
        const float ms = part_m[int64_t(s) * n_rows + r];
        if (ms != -INFINITY) {
            sum += double(part_l[int64_t(s) * n_rows + r]) * exp2(double(ms) - double(mx));
        }
    }
    lse[r] = float(double(mx) + log2(sum));
}

/** Pass 2: grid (key tiles, row splits). Block (kt, rs) sums, for keys
 * [64 kt, 64 kt + 64), 2^(s_rj - lse_r) over the visible rows r of
 * [rs * split_rows, min(R, (rs + 1) * split_rows)) (split_rows a multiple
 * of 64), skipping row tiles that see none of these keys, and writes the
 * sums to part_f[rs][key] for every key < n of the tile. */
__global__ void __launch_bounds__(kProxyThreads) proxy_colsum_kernel(
        ProxyArgs a,
        const int* __restrict__ lims,
        const int* __restrict__ tile_max,
        const float* __restrict__ lse,
        int64_t split_rows,
        float* __restrict__ part_f) {
    __shared__ __align__(16) float qs[kProxyChunk][kProxyLd];
    __shared__ __align__(16) float ks[kProxyChunk][kProxyLd];
    __shared__ __align__(16) float red[kProxyTile / kProxyMicro][kProxyTile];
    const int tx = threadIdx.x % 16;
    const int ty = threadIdx.x / 16;
    const int64_t j0 = int64_t(blockIdx.x) * kProxyTile;
    const int64_t r_begin = int64_t(blockIdx.y) * split_rows;
    const int64_t r_end = min(a.n_rows, r_begin + split_rows);
    const int64_t key = j0 + tx * kProxyMicro;

    float col[kProxyMicro] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t row0 = r_begin; row0 < r_end; row0 += kProxyTile) {
        // the same value for every thread: a uniform skip
        if (tile_max[row0 / kProxyTile] < j0) {
            continue; // no row of this tile sees these keys
        }
        float acc[kProxyMicro][kProxyMicro];
        proxy_tile_scores(a, row0, j0, qs, ks, acc);
#pragma unroll
        for (int i = 0; i < kProxyMicro; i++) {
            const int64_t r = row0 + ty * kProxyMicro + i;
            const int lim = r < a.n_rows ? lims[r] : -1;
            // a row that sees a key has a finite lse (its max is one of them)
            const float row_lse = lim >= 0 ? lse[r] : 0.0f;
#pragma unroll
            for (int j = 0; j < kProxyMicro; j++) {
                if (key + j <= lim) { // lim <= n - 1: keys past n are masked
                    col[j] += exp2f(acc[i][j] - row_lse);
                }
            }
        }
    }
    // sum over the 16 row groups (ty) of the block
    *reinterpret_cast<float4*>(&red[ty][tx * kProxyMicro]) =
            make_float4(col[0], col[1], col[2], col[3]);
    __syncthreads();
    if (threadIdx.x < kProxyTile) {
        float s = 0.0f;
#pragma unroll
        for (int y = 0; y < kProxyTile / kProxyMicro; y++) {
            s += red[y][threadIdx.x];
        }
        const int64_t k = j0 + threadIdx.x;
        if (k < a.n) {
            part_f[int64_t(blockIdx.y) * a.n + k] = s;
        }
    }
}

/// Pass 2, sum: scores[j] = sum over the row splits, accumulated in double.
__global__ void proxy_sum_kernel(
        const float* __restrict__ part_f,
        int n_splits,
        int64_t n,
        float* __restrict__ scores) {
    const int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (j >= n) {
        return;
    }
    double s = 0.0;
    for (int p = 0; p < n_splits; p++) {
        s += double(part_f[int64_t(p) * n + j]);
    }
    scores[j] = float(s);
}

} // namespace gpu
} // namespace kvindex
