#pragma once

// SAAP's asymmetric partitions on the device ("Inference-time sparse
// attention with asymmetric indexing", arXiv 2502.08246, Appendix F): the
// routing of decode queries to buckets, and the token lists of the buckets
// they read. The attention over those lists is list_slices_kernel
// (decode_attention.cuh).
//
// A decode step of a layer, for n_heads KV heads and R = rows_per_head
// query rows each (n_rows = n_heads * R):
//   1. probe_input_kernel   the classifier's input per row: the query
//      rotated back to position 0 (de-RoPE), the query as is, or the
//      moment probe's [s q, c q^2]
//   2. rows_matmul_kernel   Y = act(X W^T): the Q-model's two layers (batch
//      normalisation folded into a scale and shift, ReLU), or the centroid /
//      moment scores, all rows of a head against its matrix at once
//   3. probe_top_kernel     per list (a row, or a GQA group of rows summing
//      their probabilities), the nprobe best buckets: a radix select over
//      (score, bucket) keys in shared memory, ties to the smaller bucket,
//      then a bitonic sort of the nprobe selected;
//      then, in the same block, the token rows of the probed buckets
//      (write_list): the contiguous runs of the bucket-sorted part, then
//      the tokens appended since (the tail) whose bucket was probed, in
//      slot order (unprobed_lists_kernel: the same without a probe)
//
// Shapes (device memory, row-major, per head h):
//   x        [n_heads][R][din] float32 (din = d, or 2 d for the moments)
//   W        [n_heads][C_out][din] float32 (head stride may be 0: shared)
//   y        [n_heads][R][C_out] float32
//   probed   [n_lists][nprobe] int32, best first
//   begin, end  [n_heads][C + 1] int32: bucket b of head h occupies token
//            rows [begin, end) of the sorted part; bucket C is the
//            unassigned run, read by every query
//   tail_bucket [n_heads][tail_stride] int32: bucket of tail row t, at
//            index t - tail_begin (C: read by every query)
//   ids, lens   the lists (decode_attention.h TokenLists)

#include <cstdint>

#include "kv_vec.cuh"

namespace kvindex {
namespace gpu {

/// What the classifier input of a row is.
enum class ProbeInput : int {
    rope_inverted = 0, ///< the query rotated back to position 0 (Q-model, centroids)
    as_is = 1,         ///< the post-RoPE query (centroids of the RoPEd baseline)
    moments = 2,       ///< [mean_scale q, var_scale q^2] (the moment probe)
};

struct ProbeInputArgs {
    const float* q;   ///< [n_rows][d]
    float* x;         ///< [n_rows][din]
    int d;
    ProbeInput kind;
    int64_t position; ///< position of the decode query (de-RoPE)
    double theta;     ///< RoPE base
    int half_style;   ///< 1: pairs (j, j + d/2); 0: interleaved (2j, 2j + 1)
    float mean_scale; ///< moments: factor of q
    float var_scale;  ///< moments: factor of q^2
};

/** Grid (n_rows), any block size. De-RoPE in double, as the CPU side
 * (rope.cpp): angle = -position * theta^(-2j/d). */
__global__ void probe_input_kernel(ProbeInputArgs a) {
    const int64_t row = blockIdx.x;
    const float* q = a.q + row * a.d;
    if (a.kind == ProbeInput::rope_inverted) {
        const int half = a.d / 2;
        float* x = a.x + row * a.d;
        for (int j = threadIdx.x; j < half; j += blockDim.x) {
            const double freq = pow(a.theta, -2.0 * j / a.d);
            const double angle = -double(a.position) * freq;
            double s, c;
            sincos(angle, &s, &c);
            const int ia = a.half_style ? j : 2 * j;
            const int ib = a.half_style ? j + half : 2 * j + 1;
            const double xa = q[ia], xb = q[ib];
            x[ia] = float(xa * c - xb * s);
            x[ib] = float(xa * s + xb * c);
        }
    } else if (a.kind == ProbeInput::as_is) {
        float* x = a.x + row * a.d;
        for (int j = threadIdx.x; j < a.d; j += blockDim.x) {
            x[j] = q[j];
        }
    } else {
        float* x = a.x + row * 2 * a.d;
        for (int j = threadIdx.x; j < a.d; j += blockDim.x) {
            x[j] = a.mean_scale * q[j];
            x[a.d + j] = a.var_scale * (q[j] * q[j]);
        }
    }
}

constexpr int kMatThreads = 256;
constexpr int kMatColsPerWarp = 4; ///< outputs a warp computes per row
constexpr int kMatCols = (kMatThreads / 32) * kMatColsPerWarp;
constexpr int kMatChunk = 128;     ///< input elements staged at once

struct MatmulArgs {
    const float* x;     ///< [n_heads][R][din]
    const float* w;     ///< [n_heads][C_out][din], head stride w_head_stride
    int64_t w_head_stride;
    const float* scale; ///< [n_heads][C_out] or nullptr (1); head stride v_head_stride
    const float* shift; ///< [n_heads][C_out] or nullptr (0)
    int64_t v_head_stride;
    float* y;           ///< [n_heads][R][C_out]
    int rows;           ///< R
    int din;
    int c_out;
};

/** y = act(<x_r, w_c> * scale_c + shift_c), act = ReLU when kRelu. Grid
 * (ceil(C_out / kMatCols), ceil(R / RT), n_heads), block kMatThreads: warp
 * w computes outputs c0 + 4w .. c0 + 4w + 3 for the block's RT rows
 * (RT = 1, 2, 4, 8: a decode step has one or a few rows a head, and a
 * wider tile would multiply and reduce zeros), lanes striding the input
 * (coalesced rows of W, conflict-free reads of the staged x); each row of
 * W is read once per RT rows of x. */
template <bool kRelu, int RT>
__global__ void __launch_bounds__(kMatThreads) rows_matmul_kernel(MatmulArgs a) {
    __shared__ float xs[RT][kMatChunk];
    const int64_t h = blockIdx.z;
    const int r0 = blockIdx.y * RT;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int c0 = blockIdx.x * kMatCols + warp * kMatColsPerWarp;
    const float* X = a.x + h * int64_t(a.rows) * a.din;
    const float* W = a.w + h * a.w_head_stride;
    float acc[kMatColsPerWarp][RT];
#pragma unroll
    for (int c = 0; c < kMatColsPerWarp; c++) {
#pragma unroll
        for (int r = 0; r < RT; r++) {
            acc[c][r] = 0.0f;
        }
    }
    for (int j0 = 0; j0 < a.din; j0 += kMatChunk) {
        for (int i = threadIdx.x; i < RT * kMatChunk; i += kMatThreads) {
            const int r = i / kMatChunk, j = i % kMatChunk;
            xs[r][j] = r0 + r < a.rows && j0 + j < a.din ? X[int64_t(r0 + r) * a.din + j0 + j]
                                                         : 0.0f;
        }
        __syncthreads();
        const int jn = min(kMatChunk, a.din - j0);
#pragma unroll 4 // independent loads of W in flight
        for (int j = lane; j < jn; j += 32) {
#pragma unroll
            for (int c = 0; c < kMatColsPerWarp; c++) {
                const float w = c0 + c < a.c_out ? W[int64_t(c0 + c) * a.din + j0 + j] : 0.0f;
#pragma unroll
                for (int r = 0; r < RT; r++) {
                    acc[c][r] = fmaf(w, xs[r][j], acc[c][r]);
                }
            }
        }
        __syncthreads(); // xs is restaged next
    }
#pragma unroll
    for (int c = 0; c < kMatColsPerWarp; c++) {
#pragma unroll
        for (int r = 0; r < RT; r++) {
            acc[c][r] = row_sum<32>(acc[c][r]);
        }
    }
    if (lane == 0) {
        const float* scale = a.scale ? a.scale + h * a.v_head_stride : nullptr;
        const float* shift = a.shift ? a.shift + h * a.v_head_stride : nullptr;
#pragma unroll
        for (int c = 0; c < kMatColsPerWarp; c++) {
            const int col = c0 + c;
            if (col >= a.c_out) {
                continue;
            }
#pragma unroll
            for (int r = 0; r < RT; r++) {
                if (r0 + r < a.rows) {
                    float v = acc[c][r] * (scale ? scale[col] : 1.0f) + (shift ? shift[col] : 0.0f);
                    if (kRelu) {
                        v = fmaxf(v, 0.0f);
                    }
                    a.y[(h * a.rows + r0 + r) * int64_t(a.c_out) + col] = v;
                }
            }
        }
    }
}

/// Most buckets the device probe sorts (its keys fill 32 KB of shared memory).
constexpr int kMaxProbeBuckets = 4096;
constexpr int kListThreads = 256;

/** Where a query's list goes and what it reads besides the probed buckets
 * (see the shapes above). */
struct ListBuildArgs {
    int n_centroids;            ///< C (bucket C: always read)
    const int32_t* begin;       ///< [n_heads][C + 1]
    const int32_t* end;         ///< [n_heads][C + 1]
    const int32_t* tail_bucket; ///< [n_heads][tail_stride]
    int64_t tail_stride;
    int64_t tail_begin;         ///< first tail row
    int64_t tail_end;           ///< rows past it are not read (the window)
    int rows_per_list;
    int rows_per_head;
    int32_t* ids;               ///< [n_lists][stride]
    int32_t* lens;              ///< [n_lists]
    int64_t stride;
};

/// Exclusive prefix sum of x over the block (blockDim.x a multiple of 32,
/// at most 1024), and the block's total in *total; every thread calls it.
__device__ __forceinline__ int64_t block_exclusive_scan(int64_t x, int64_t* total) {
    __shared__ int64_t warp_sums[32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n_warps = blockDim.x / 32;
    int64_t inc = x;
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
        const int64_t y = __shfl_up_sync(kFullMask, inc, off);
        if (lane >= off) {
            inc += y;
        }
    }
    if (lane == 31) {
        warp_sums[warp] = inc;
    }
    __syncthreads();
    int64_t before = 0, all = 0;
    for (int w = 0; w < n_warps; w++) {
        before += w < warp ? warp_sums[w] : 0;
        all += warp_sums[w];
    }
    __syncthreads(); // warp_sums is reused by the next call
    *total = all;
    return before + inc - x;
}

/** The token rows one list reads (every thread of the block calls it):
 * the runs of its n_runs buckets in the sorted part (bucket_at(e), e <
 * n_runs, then bucket C), then the tail rows whose bucket is in `set` (a
 * shared bitset of C + 1 bits, C included), in slot order. The runs'
 * bounds are read in parallel, a block of runs at a time, and written by
 * the whole block run by run; the tail by an ordered block-wide
 * compaction. A list never exceeds its stride (the host bounds it). */
template <typename BucketAt>
__device__ void write_list(const ListBuildArgs& a, int64_t list, int n_runs, BucketAt bucket_at,
                           const uint32_t* set) {
    constexpr int kMaxThreads = 512; // the blocks of both callers (static shared memory)
    __shared__ int32_t run_begin[kMaxThreads];
    __shared__ int32_t run_len[kMaxThreads];
    __shared__ int64_t run_off[kMaxThreads];
    __shared__ int warp_count[32];
    const int C = a.n_centroids;
    const int64_t head = list * a.rows_per_list / a.rows_per_head;
    const int32_t* begin = a.begin + head * (C + 1);
    const int32_t* end = a.end + head * (C + 1);
    int32_t* ids = a.ids + list * a.stride;
    int64_t off = 0;
    for (int c0 = 0; c0 <= n_runs; c0 += blockDim.x) {
        const int e = c0 + threadIdx.x;
        int32_t b0 = 0, len = 0;
        if (e <= n_runs) {
            const int b = e < n_runs ? bucket_at(e) : C;
            b0 = begin[b];
            len = end[b] - b0;
        }
        int64_t chunk_total;
        const int64_t ex = block_exclusive_scan(len, &chunk_total);
        run_begin[threadIdx.x] = b0;
        run_len[threadIdx.x] = len;
        run_off[threadIdx.x] = off + ex;
        __syncthreads();
        const int count = min(int(blockDim.x), n_runs + 1 - c0);
        for (int i = 0; i < count; i++) {
            const int64_t o = run_off[i];
            for (int t = threadIdx.x; t < run_len[i]; t += blockDim.x) {
                if (o + t < a.stride) {
                    ids[o + t] = run_begin[i] + t;
                }
            }
        }
        off += chunk_total;
        __syncthreads(); // the run arrays are rewritten next round
    }
    // the tail: rows whose bucket is in the set, kept in order
    const int32_t* tail = a.tail_bucket + head * a.tail_stride;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n_warps = blockDim.x / 32;
    for (int64_t base = a.tail_begin; base < a.tail_end; base += blockDim.x) {
        const int64_t row = base + threadIdx.x;
        bool take = false;
        if (row < a.tail_end) {
            const int b = tail[row - a.tail_begin];
            take = (set[b / 32] >> (b % 32)) & 1u;
        }
        const uint32_t ballot = __ballot_sync(kFullMask, take);
        if (lane == 0) {
            warp_count[warp] = __popc(ballot);
        }
        __syncthreads();
        int64_t before = off;
        int total = 0;
        for (int w = 0; w < n_warps; w++) {
            before += w < warp ? warp_count[w] : 0;
            total += warp_count[w];
        }
        if (take) {
            const int64_t at = before + __popc(ballot & ((1u << lane) - 1u));
            if (at < a.stride) {
                ids[at] = int32_t(row);
            }
        }
        off += total;
        __syncthreads(); // warp_count is rewritten next round
    }
    if (threadIdx.x == 0) {
        a.lens[list] = int32_t(min(off, a.stride));
    }
}

/** The lists of queries that probe nothing (no model, or nprobe = 0): the
 * unassigned run C and its tail rows. Grid (n_lists), block kListThreads. */
__global__ void __launch_bounds__(kListThreads) unprobed_lists_kernel(ListBuildArgs a) {
    __shared__ uint32_t set[kMaxProbeBuckets / 32 + 1];
    const int C = a.n_centroids;
    for (int w = threadIdx.x; w <= C / 32; w += kListThreads) {
        set[w] = w == C / 32 ? 1u << (C % 32) : 0u;
    }
    __syncthreads();
    write_list(a, blockIdx.x, 0, [](int) { return 0; }, set);
}

constexpr int kTopThreads = 512;

struct ProbeTopArgs {
    const float* y;     ///< [n_rows][C] classifier outputs (logits or scores)
    int n_centroids;    ///< C
    int padded;         ///< C rounded up to a power of two (the sort's size), <= kMaxProbeBuckets
    int rows_per_list;  ///< rows summed into one list's scores
    bool softmax;       ///< rows contribute softmax(y) (probabilities); else y
    int nprobe;
    int32_t* probed;    ///< [n_lists][nprobe], or nullptr
    bool lists;         ///< also write each list (list_args)
    ListBuildArgs list_args;
};

/// The sort key of bucket c of score s: higher score first, then smaller c.
__device__ __forceinline__ unsigned long long bucket_key(float s, int c) {
    uint32_t u = __float_as_uint(s == 0.0f ? 0.0f : s);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return (static_cast<unsigned long long>(u) << 32) | (0xffffffffu - uint32_t(c));
}

/// The bucket of a sort key.
__device__ __forceinline__ int32_t bucket_of_key(unsigned long long key) {
    return int32_t(0xffffffffu - uint32_t(key & 0xffffffffull));
}

/// x reduced over the block (max or sum), to every thread; scratch holds
/// kTopThreads / 32 + 1 floats.
template <bool kMax>
__device__ __forceinline__ float top_block_reduce(float x, float* scratch) {
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) {
        const float y = __shfl_xor_sync(kFullMask, x, off);
        x = kMax ? fmaxf(x, y) : x + y;
    }
    constexpr int W = kTopThreads / 32;
    if (threadIdx.x % 32 == 0) {
        scratch[threadIdx.x / 32] = x;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float r = scratch[0];
        for (int w = 1; w < W; w++) {
            r = kMax ? fmaxf(r, scratch[w]) : r + scratch[w];
        }
        scratch[W] = r;
    }
    __syncthreads();
    const float r = scratch[W];
    __syncthreads();
    return r;
}

__device__ __forceinline__ int next_pow2_device(int x) {
    int p = 1;
    while (p < x) {
        p *= 2;
    }
    return p;
}

/** Radix select over n distinct keys in shared memory (every thread of a
 * block of kTopThreads calls it): on return the k largest keys are exactly
 * those with (key & *mask) >= *prefix (unsigned), 1 <= k <= n. A byte per
 * pass from the top: a histogram of the keys that match the decided
 * prefix, then warp 0 finds the byte whose bucket holds the k-th largest;
 * it stops once that bucket holds exactly the keys still needed (two or
 * three passes for random scores; eight at most, by distinctness). */
__device__ void radix_select_top(const unsigned long long* keys, int n, int k,
                                 unsigned long long* prefix_out, unsigned long long* mask_out) {
    __shared__ unsigned int hist[256];
    __shared__ unsigned long long s_prefix, s_mask;
    __shared__ int s_need, s_done;
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_mask = 0;
        s_need = k;
        s_done = 0;
    }
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += kTopThreads) {
            hist[i] = 0;
        }
        __syncthreads(); // also publishes the state of the previous pass
        const unsigned long long prefix = s_prefix, mask = s_mask;
        for (int i = threadIdx.x; i < n; i += kTopThreads) {
            const unsigned long long key = keys[i];
            if ((key & mask) == prefix) {
                atomicAdd(&hist[(key >> shift) & 255u], 1u);
            }
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // lane l holds the bytes 255 - 8l down to 248 - 8l, so that the
            // lanes' running sums count keys from the largest byte down
            const int lane = threadIdx.x;
            unsigned int cnt[8], sum = 0;
#pragma unroll
            for (int b = 0; b < 8; b++) {
                cnt[b] = hist[255 - 8 * lane - b];
                sum += cnt[b];
            }
            unsigned int incl = sum;
#pragma unroll
            for (int off = 1; off < 32; off *= 2) {
                const unsigned int y = __shfl_up_sync(kFullMask, incl, off);
                if (lane >= off) {
                    incl += y;
                }
            }
            const unsigned int need = unsigned(s_need);
            unsigned int above = incl - sum;
            if (above < need && need <= incl) { // one lane: the k-th largest is here
#pragma unroll
                for (int b = 0; b < 8; b++) {
                    if (above + cnt[b] >= need) {
                        const unsigned long long byte = 255u - 8u * lane - b;
                        s_prefix = prefix | (byte << shift);
                        s_mask = mask | (0xffull << shift);
                        s_need = int(need - above);
                        s_done = cnt[b] == need - above;
                        break;
                    }
                    above += cnt[b];
                }
            }
        }
        __syncthreads();
        if (s_done) {
            break; // the same for every thread
        }
    }
    *prefix_out = s_prefix;
    *mask_out = s_mask;
    __syncthreads(); // the state is read before any later call rewrites it
}

/** The nprobe best buckets of each list: grid (n_lists), block kTopThreads,
 * dynamic shared memory padded * 8 bytes. The scores of the list's rows
 * are summed (probabilities for the softmax outputs, as the CPU side sums
 * a GQA group's classifier outputs; a row whose outputs are all -inf
 * contributes 0), the nprobe largest (score, bucket) keys are selected and
 * sorted descending (probed, best first), and with `lists` the list of
 * those buckets is written (write_list). */
__global__ void __launch_bounds__(kTopThreads) probe_top_kernel(ProbeTopArgs a) {
    extern __shared__ unsigned long long keys[];
    __shared__ float scratch[kTopThreads / 32 + 1];
    float* acc = reinterpret_cast<float*>(keys); // the first `padded` floats, until the keys
    const int C = a.n_centroids;
    const int64_t list = blockIdx.x;
    for (int c = threadIdx.x; c < C; c += kTopThreads) {
        acc[c] = 0.0f;
    }
    __syncthreads();
    for (int r = 0; r < a.rows_per_list; r++) {
        const float* y = a.y + (list * a.rows_per_list + r) * int64_t(C);
        if (a.softmax) {
            float mx = kNegInf;
            for (int c = threadIdx.x; c < C; c += kTopThreads) {
                mx = fmaxf(mx, y[c]);
            }
            mx = top_block_reduce<true>(mx, scratch);
            if (mx == kNegInf) {
                continue; // every output -inf (no bucket holds a key): nothing to add
            }
            float sum = 0.0f;
            for (int c = threadIdx.x; c < C; c += kTopThreads) {
                sum += expf(y[c] - mx);
            }
            sum = top_block_reduce<false>(sum, scratch);
            const float lse = mx + logf(sum);
            for (int c = threadIdx.x; c < C; c += kTopThreads) {
                acc[c] += expf(y[c] - lse);
            }
        } else {
            for (int c = threadIdx.x; c < C; c += kTopThreads) {
                acc[c] += y[c];
            }
        }
        __syncthreads(); // acc complete before the next row or the keys
    }
    // floats -> keys in place: read this thread's scores first (the keys
    // overwrite them), with the same stride as the writes below
    constexpr int kMaxPer = kMaxProbeBuckets / kTopThreads;
    float mine[kMaxPer];
#pragma unroll
    for (int i = 0; i < kMaxPer; i++) {
        const int c = threadIdx.x + i * kTopThreads;
        mine[i] = c < C ? acc[c] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kMaxPer; i++) {
        const int c = threadIdx.x + i * kTopThreads;
        if (c < a.padded) {
            keys[c] = c < C ? bucket_key(mine[i], c) : 0ull; // padding sorts last
        }
    }
    __syncthreads();
    // the nprobe largest keys: a radix select of the nprobe-th (a byte at
    // a time from the top, stopping once its bucket holds exactly the keys
    // still needed: keys are distinct), then those keys gathered into
    // keys[0, nprobe) and sorted there (a full sort of the C keys would
    // cost log^2 C barriers)
    unsigned long long prefix, mask;
    radix_select_top(keys, a.padded, a.nprobe, &prefix, &mask);
    unsigned long long held[kMaxPer];
#pragma unroll
    for (int i = 0; i < kMaxPer; i++) {
        const int c = threadIdx.x + i * kTopThreads;
        held[i] = c < a.padded ? keys[c] : 0ull;
    }
    __shared__ int n_taken;
    if (threadIdx.x == 0) {
        n_taken = 0;
    }
    __syncthreads(); // every key read before any is overwritten
    const int top = next_pow2_device(a.nprobe);
#pragma unroll
    for (int i = 0; i < kMaxPer; i++) {
        const int c = threadIdx.x + i * kTopThreads;
        if (c < a.padded && (held[i] & mask) >= prefix) {
            keys[atomicAdd(&n_taken, 1)] = held[i]; // exactly nprobe of them
        }
    }
    for (int i = a.nprobe + threadIdx.x; i < top; i += kTopThreads) {
        keys[i] = 0ull; // padding of the sort: sorts last
    }
    __syncthreads();
    // bitonic sort of the top keys, descending
    for (int size = 2; size <= top; size *= 2) {
        for (int stride = size / 2; stride > 0; stride /= 2) {
            for (int i = threadIdx.x; i < top; i += kTopThreads) {
                const int j = i ^ stride;
                if (j > i) {
                    const bool descending = (i & size) == 0;
                    const unsigned long long ki = keys[i], kj = keys[j];
                    if (descending ? ki < kj : ki > kj) {
                        keys[i] = kj;
                        keys[j] = ki;
                    }
                }
            }
            __syncthreads();
        }
    }
    if (a.probed) {
        for (int i = threadIdx.x; i < a.nprobe; i += kTopThreads) {
            a.probed[list * a.nprobe + i] = bucket_of_key(keys[i]);
        }
    }
    if (!a.lists) {
        return; // uniform: the whole block
    }
    // the list of the probed buckets, from the sorted keys in shared memory
    __shared__ uint32_t set[kMaxProbeBuckets / 32 + 1];
    for (int w = threadIdx.x; w <= C / 32; w += kTopThreads) {
        set[w] = 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i <= a.nprobe; i += kTopThreads) {
        const int b = i < a.nprobe ? bucket_of_key(keys[i]) : C;
        atomicOr(&set[b / 32], 1u << (b % 32));
    }
    __syncthreads();
    write_list(a.list_args, list, a.nprobe, [&](int e) { return bucket_of_key(keys[e]); }, set);
}

} // namespace gpu
} // namespace kvindex
