#pragma once

// Exact top-k on the device, for decode: the scores of a range of tokens in
// one pass over the keys (all query rows of a KV head share it), then a
// radix select per row, then the selected ids written in increasing order.
//
// Selection key. Each candidate is ranked by a 64-bit key: the score's bits
// mapped to an unsigned integer of the same order (high word), and
// 0xffffffff - t (low word), so that keys are distinct and a larger key
// means a higher score, or the same score and a smaller token id: the k
// largest keys are the top-k with ties broken by id, as the CPU side does.
//
// Radix select. From the most significant byte down, one pass per byte:
// each block histograms the byte of the candidates that still match the
// decided prefix; the last block of the pass to finish (a counter per row)
// picks the byte whose bucket holds the k-th largest key, subtracts what
// lies above it, and marks the row done once the bucket holds exactly the
// keys still needed. A row that is done skips the later passes; then every
// key whose decided bits are >= the prefix is selected: exactly k of them.
//
// Shapes (device memory):
//   scores  [n_rows][n_candidates] float32, candidate c = token begin + c
//   state   [n_rows] RadixState
//   counts  [n_rows][n_chunks] selected per chunk, then its exclusive prefix
//   ids     [n_rows][k] int32, increasing; scores_out likewise (optional)

#include <cstdint>

#include "kv_vec.cuh"

namespace kvindex {
namespace gpu {

constexpr int kSelectThreads = 256;

struct RadixState {
    unsigned long long prefix; ///< decided bits of the k-th largest key
    unsigned long long mask;   ///< which bits are decided
    int64_t k_rem;             ///< keys still to take from the prefix's bucket
    int done;                  ///< every key >= prefix (masked) is selected
    unsigned int blocks_finished;
    unsigned int hist[256];
};

/// The selection key of score s of candidate c (see above).
__device__ __forceinline__ unsigned long long select_key(float s, int64_t c) {
    // +0 and -0 are the same score: map -0 to +0
    uint32_t u = __float_as_uint(s == 0.0f ? 0.0f : s);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return (static_cast<unsigned long long>(u) << 32) | (0xffffffffu - uint32_t(c));
}

/// Scores <q_r, k_t> (unscaled inner products) of tokens [begin, begin + n)
/// for NQ rows of a head: grid (n_splits, n_heads, row tiles), the same
/// row-stream layout as the attention kernels.
template <typename T, int D, int NQ>
__global__ void __launch_bounds__(kDecodeThreads) scores_kernel(
        const T* __restrict__ keys,
        int64_t head_stride,
        const float* __restrict__ q,
        int rows_per_head,
        int64_t begin,
        int64_t n,
        int64_t split_len,
        float* __restrict__ scores) {
    using L = RowLayout<T, D>;
    constexpr int EPL = L::EPL;
    constexpr int VPL = L::VPL;
    constexpr int VEC = L::VEC;
    constexpr int U = NQ >= 8 ? 2 : 4; // keys per stream and step
    const int head = blockIdx.y;
    const int lane = threadIdx.x % 32;
    const int lr = lane % L::LPK;
    const int warp = threadIdx.x / 32;
    const int group = lane / L::LPK;
    const T* K = keys + (head * head_stride + begin) * D;

    float qv[NQ][EPL];
    float* srow[NQ];
#pragma unroll
    for (int qi = 0; qi < NQ; qi++) {
        const int r = blockIdx.z * NQ + qi;
        const bool valid = r < rows_per_head;
        const int64_t row = int64_t(head) * rows_per_head + r;
        srow[qi] = valid ? scores + row * n : nullptr;
#pragma unroll
        for (int j = 0; j < VPL; j++) {
#pragma unroll
            for (int e = 0; e < VEC; e++) {
                qv[qi][j * VEC + e] = valid ? q[row * D + L::element(lr, j) + e] : 0.0f;
            }
        }
    }
    const int64_t v0 = int64_t(blockIdx.x) * split_len;
    const int64_t v1 = min(v0 + split_len, n);
    // Each warp step reads KW = G * U consecutive keys (group g takes keys
    // g, g + G, ...), so that after the step lane j < KW can hold the
    // score of key j and the warp stores KW consecutive scores per row at
    // once. The trip count is the warp's: row_sum's shuffles need every
    // lane (see attend_slice).
    constexpr int KW = L::G * U;
    for (int64_t wbase = v0 + int64_t(warp) * KW; wbase < v1; wbase += int64_t(kDecodeWarps) * KW) {
        uint4 kr[U][VPL];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t t = wbase + group + int64_t(u) * L::G;
#pragma unroll
            for (int j = 0; j < VPL; j++) {
                kr[u][j] = t < v1 ? load16(K + t * D + L::element(lr, j)) : make_uint4(0, 0, 0, 0);
            }
        }
        float mine[NQ]; // lane j < KW: the score of key wbase + j
#pragma unroll
        for (int u = 0; u < U; u++) {
            float kf[EPL];
#pragma unroll
            for (int j = 0; j < VPL; j++) {
                widen(kr[u][j], static_cast<const T*>(nullptr), kf + j * VEC);
            }
#pragma unroll
            for (int qi = 0; qi < NQ; qi++) {
                float p = 0.0f;
#pragma unroll
                for (int e = 0; e < EPL; e++) {
                    p = fmaf(qv[qi][e], kf[e], p);
                }
                p = row_sum<L::LPK>(p);
                // key (lane % G) + u * G sits in group lane % G
                p = __shfl_sync(kFullMask, p, (lane % L::G) * L::LPK);
                if (lane / L::G == u) {
                    mine[qi] = p;
                }
            }
        }
        const int64_t t = wbase + lane;
        if (lane < KW && t < v1) {
#pragma unroll
            for (int qi = 0; qi < NQ; qi++) {
                if (srow[qi]) {
                    srow[qi][t] = mine[qi];
                }
            }
        }
    }
}

/// Sets each row's state for a search of the k largest among n candidates
/// (k <= n; k == n selects everything at once).
__global__ void radix_init_kernel(RadixState* state, int n_rows, int64_t n, int64_t k) {
    const int row = blockIdx.x;
    if (row >= n_rows) {
        return;
    }
    RadixState& st = state[row];
    for (int b = threadIdx.x; b < 256; b += blockDim.x) {
        st.hist[b] = 0;
    }
    if (threadIdx.x == 0) {
        st.prefix = 0;
        st.mask = 0;
        st.k_rem = k;
        st.done = k >= n ? 1 : 0;
        st.blocks_finished = 0;
    }
}

/// One radix pass (byte at `shift`): grid (n_chunks, n_rows), block
/// kSelectThreads; chunk c holds candidates [c * chunk_len, ...).
__global__ void __launch_bounds__(kSelectThreads) radix_pass_kernel(
        const float* __restrict__ scores,
        int64_t n,
        int64_t chunk_len,
        int shift,
        RadixState* state) {
    const int row = blockIdx.y;
    RadixState& st = state[row];
    __shared__ unsigned int hist[256];
    __shared__ unsigned long long prefix, mask;
    __shared__ bool skip, last;
    if (threadIdx.x == 0) {
        skip = st.done != 0;
        prefix = st.prefix;
        mask = st.mask;
    }
    hist[threadIdx.x] = 0;
    __syncthreads();
    if (skip) {
        return;
    }
    const float* s = scores + int64_t(row) * n;
    const int64_t c0 = int64_t(blockIdx.x) * chunk_len;
    const int64_t c1 = min(c0 + chunk_len, n);
    for (int64_t c = c0 + threadIdx.x; c < c1; c += kSelectThreads) {
        unsigned long long key = select_key(s[c], c);
        if ((key & mask) == prefix) {
            atomicAdd(&hist[(key >> shift) & 0xff], 1u);
        }
    }
    __syncthreads();
    if (hist[threadIdx.x]) {
        atomicAdd(&st.hist[threadIdx.x], hist[threadIdx.x]);
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(&st.blocks_finished, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) {
        return;
    }
    // the last block: every block's counts are in st.hist (read past L1)
    __threadfence();
    __shared__ unsigned long long above[256]; // keys in buckets > b
    const int b = threadIdx.x;
    const unsigned int h = __ldcg(&st.hist[b]);
    above[b] = h;
    __syncthreads();
    // suffix sums by doubling: above[b] = sum of h over buckets >= b
    for (int off = 1; off < 256; off *= 2) {
        unsigned long long add = b + off < 256 ? above[b + off] : 0;
        __syncthreads();
        above[b] += add;
        __syncthreads();
    }
    const unsigned long long strictly_above = above[b] - h;
    const unsigned long long k_rem = static_cast<unsigned long long>(st.k_rem);
    if (h > 0 && strictly_above < k_rem && k_rem <= above[b]) {
        const int64_t k_new = int64_t(k_rem - strictly_above);
        st.k_rem = k_new;
        st.prefix = prefix | (static_cast<unsigned long long>(b) << shift);
        st.mask = mask | (0xffull << shift);
        st.done = int64_t(h) == k_new ? 1 : 0;
    }
    st.hist[b] = 0;
    if (b == 0) {
        st.blocks_finished = 0;
    }
}

/// Whether candidate key `key` is selected once the row's search is done.
__device__ __forceinline__ bool radix_selected(
        unsigned long long key, unsigned long long prefix, unsigned long long mask) {
    return (key & mask) >= prefix;
}

/// Selected candidates per chunk: grid (n_chunks, n_rows).
__global__ void __launch_bounds__(kSelectThreads) radix_count_kernel(
        const float* __restrict__ scores,
        int64_t n,
        int64_t chunk_len,
        const RadixState* state,
        int64_t* counts) {
    const int row = blockIdx.y;
    const unsigned long long prefix = state[row].prefix, mask = state[row].mask;
    const float* s = scores + int64_t(row) * n;
    const int64_t c0 = int64_t(blockIdx.x) * chunk_len;
    const int64_t c1 = min(c0 + chunk_len, n);
    unsigned int count = 0;
    for (int64_t c = c0 + threadIdx.x; c < c1; c += kSelectThreads) {
        count += radix_selected(select_key(s[c], c), prefix, mask) ? 1 : 0;
    }
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) {
        count += __shfl_xor_sync(kFullMask, count, off);
    }
    __shared__ unsigned int warp_counts[kSelectThreads / 32];
    if (threadIdx.x % 32 == 0) {
        warp_counts[threadIdx.x / 32] = count;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int64_t total = 0;
        for (int w = 0; w < kSelectThreads / 32; w++) {
            total += warp_counts[w];
        }
        counts[int64_t(row) * gridDim.x + blockIdx.x] = total;
    }
}

/// counts[row][*] -> exclusive prefix sums, one warp per row: grid (n_rows).
__global__ void radix_scan_kernel(int64_t* counts, int n_chunks) {
    int64_t* c = counts + int64_t(blockIdx.x) * n_chunks;
    const int lane = threadIdx.x;
    int64_t carry = 0;
    for (int i0 = 0; i0 < n_chunks; i0 += 32) {
        const int i = i0 + lane;
        int64_t x = i < n_chunks ? c[i] : 0;
        int64_t incl = x;
#pragma unroll
        for (int off = 1; off < 32; off *= 2) {
            int64_t y = __shfl_up_sync(kFullMask, incl, off);
            if (lane >= off) {
                incl += y;
            }
        }
        if (i < n_chunks) {
            c[i] = carry + incl - x;
        }
        carry += __shfl_sync(kFullMask, incl, 31);
    }
}

/// Writes the selected candidates of each chunk, in increasing order, at
/// the chunk's offset: ids (token = begin + candidate) and optionally their
/// scores. Grid (n_chunks, n_rows).
__global__ void __launch_bounds__(kSelectThreads) radix_write_kernel(
        const float* __restrict__ scores,
        int64_t n,
        int64_t chunk_len,
        const RadixState* state,
        const int64_t* offsets,
        int64_t begin,
        int64_t k,
        int32_t* ids,
        float* scores_out) {
    const int row = blockIdx.y;
    const unsigned long long prefix = state[row].prefix, mask = state[row].mask;
    const float* s = scores + int64_t(row) * n;
    const int64_t c0 = int64_t(blockIdx.x) * chunk_len;
    const int64_t c1 = min(c0 + chunk_len, n);
    int64_t out = offsets[int64_t(row) * gridDim.x + blockIdx.x];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    __shared__ unsigned int warp_counts[kSelectThreads / 32];
    for (int64_t base = c0; base < c1; base += kSelectThreads) {
        const int64_t c = base + threadIdx.x;
        float sc = c < c1 ? s[c] : 0.0f;
        const bool sel = c < c1 && radix_selected(select_key(sc, c), prefix, mask);
        const unsigned int ballot = __ballot_sync(kFullMask, sel);
        if (lane == 0) {
            warp_counts[warp] = __popc(ballot);
        }
        __syncthreads();
        unsigned int before = 0, total = 0;
#pragma unroll
        for (int w = 0; w < kSelectThreads / 32; w++) {
            before += w < warp ? warp_counts[w] : 0;
            total += warp_counts[w];
        }
        if (sel) {
            const int64_t pos = out + before + __popc(ballot & ((1u << lane) - 1u));
            ids[int64_t(row) * k + pos] = int32_t(begin + c);
            if (scores_out) {
                scores_out[int64_t(row) * k + pos] = sc;
            }
        }
        out += total;
        __syncthreads();
    }
}

} // namespace gpu
} // namespace kvindex
