#pragma once

// Split-K ("flash-decoding") attention for decode: a few query rows per KV
// head against a long KV cache, a memory-bound problem. Each block reads one
// slice of the tokens once for up to NQ query rows of the same KV head (the
// query heads of a GQA group share the pass), keeps an online softmax per
// row in registers, and writes a partial result: the normalised output of
// its slice and the slice's log-sum-exp. merge_splits_kernel then merges
// the slices by lse. Scores and lse run in base 2 inside (the query is
// pre-scaled by log2(e) / sqrt(d)); the merge returns the natural-log lse.
//
// Shapes (device memory, row-major):
//   keys, values   head h, token t at base + (h * head_stride + t) * D
//   q              [n_heads][rows_per_head][D] float32
//   part_out       [n_rows][total_splits][D] float32, n_rows = n_heads * rows_per_head
//   part_lse       [n_rows][total_splits] float32 (base 2; -inf for an empty slice)
//   out, lse       [n_rows][D], [n_rows] float32
//
// Two token sources share the body (attend_slice): up to two ranges read
// as one list (dense attention; the sink and window of top-k), or one list
// of token ids per row (the keys top-k selected).

#include <cstdint>
#include <type_traits>

#include "kv_vec.cuh"

namespace kvindex {
namespace gpu {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;

/// Up to two ranges of tokens read as one list: position v < n0 is token
/// b0 + v, the others b1 + (v - n0).
struct TokenRanges {
    int64_t b0 = 0, n0 = 0, b1 = 0, n1 = 0;
    __host__ __device__ int64_t size() const {
        return n0 + n1;
    }
    __device__ int64_t operator()(int64_t v) const {
        return v < n0 ? b0 + v : b1 + (v - n0);
    }
};

/// A row's own list of token ids (top-k selections).
struct TokenList {
    const int32_t* ids;
    __device__ int64_t operator()(int64_t v) const {
        return ids[v];
    }
};

struct DecodeKernelArgs {
    const void* keys;
    const void* values;
    int64_t head_stride;  ///< rows between heads
    const float* q;       ///< [n_heads][rows_per_head][D]
    int rows_per_head;
    float q_scale;        ///< log2(e) / sqrt(d)
    int64_t split_len;    ///< tokens per slice
    int n_splits;         ///< slices of this launch
    int split_offset;     ///< slot of this launch's first slice in the partials
    int total_splits;     ///< slots per row in the partials
    float* part_out;
    float* part_lse;
    // dense launches
    TokenRanges ranges;
    // gathered launches: ids [n_rows][ids_per_row]
    const int32_t* ids;
    int64_t ids_per_row;
};

/// No additive term: plain softmax weights (every kernel but the samplers').
/// A bias is two calls: fetch(t) loads what token t's term needs (issued
/// with the token's key and value loads, so that its latency hides under
/// theirs), then bias(fetched, s) computes the term from it and the score.
struct NoBias {
    struct Params {};
    __device__ NoBias(const Params&, int64_t /*head*/, int64_t /*row*/) {}
    __device__ float fetch(int64_t /*t*/) const {
        return 0.0f;
    }
    __device__ float operator()(float /*fetched*/, float /*s*/) const {
        return 0.0f;
    }
};

/// What the warps of a block merge through (attend_slice).
template <int NQ, int D>
struct SliceMergeShared {
    float m[kDecodeWarps][NQ];
    float l[kDecodeWarps][NQ];
    float acc[kDecodeWarps][NQ][D];
};

/// One SliceMergeShared per (NQ, D), whatever the token source, so that a
/// kernel running attend_slice over two sources (the static part and the
/// lists) holds it once.
template <int NQ, int D>
__device__ __forceinline__ SliceMergeShared<NQ, D>& slice_merge_shared() {
    __shared__ SliceMergeShared<NQ, D> sm;
    return sm;
}

/** The online-softmax pass of one block over list positions [v0, v1) of
 * `token_at`, for NQ query rows (row pointers nullptr past the last row),
 * writing the slice's normalised output and base-2 lse to out_rows[qi] /
 * *lse_rows[qi]. Every thread of the block must call it.
 *
 * `bias(bias.fetch(t), s)` is added to the base-2 score s of token t
 * before the softmax (an importance weight, -log2 u_t for a sampler); it
 * is one term for every row, so a per-row bias needs NQ = 1. NoBias
 * compiles away.
 *
 * A list's token ids are read one step ahead: each id load overlaps the
 * step before instead of standing in front of the step's own key and
 * value loads (a dependent chain per step otherwise). */
template <typename T, int D, int NQ, typename TokenAt, typename Bias = NoBias>
__device__ __forceinline__ void attend_slice(
        const T* __restrict__ K,
        const T* __restrict__ V,
        const float* const (&q_rows)[NQ],
        float q_scale,
        int64_t v0,
        int64_t v1,
        TokenAt token_at,
        float* const (&out_rows)[NQ],
        float* const (&lse_rows)[NQ],
        const Bias& bias = Bias(typename Bias::Params(), 0, 0)) {
    using L = RowLayout<T, D>;
    constexpr int EPL = L::EPL;
    constexpr int VPL = L::VPL;
    constexpr int VEC = L::VEC;
    // keys per stream and step: enough 16-byte loads in flight to cover
    // memory latency, few enough that the accumulators stay in registers
    constexpr int U = (NQ >= 8 || VPL >= 2) ? 2 : 4;
    constexpr int NS = kDecodeWarps * L::G; // row streams in the block

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int lr = lane % L::LPK;
    const int group = lane / L::LPK;

    float q[NQ][EPL];
#pragma unroll
    for (int qi = 0; qi < NQ; qi++) {
#pragma unroll
        for (int v = 0; v < VPL; v++) {
#pragma unroll
            for (int e = 0; e < VEC; e++) {
                q[qi][v * VEC + e] =
                        q_rows[qi] ? q_rows[qi][L::element(lr, v) + e] * q_scale : 0.0f;
            }
        }
    }
    float m[NQ], l[NQ], acc[NQ][EPL];
#pragma unroll
    for (int qi = 0; qi < NQ; qi++) {
        m[qi] = kNegInf;
        l[qi] = 0.0f;
#pragma unroll
        for (int e = 0; e < EPL; e++) {
            acc[qi][e] = 0.0f;
        }
    }

    // The loop runs while any row stream of the warp has a token (the trip
    // count is the warp's, not the stream's): the shuffles of row_sum need
    // every lane of the warp, so a stream past the end idles along (ok =
    // false) instead of leaving the loop.
    // a list's ids are read a step ahead; ranges are arithmetic (reading
    // them ahead only costs registers: measured slower on dense)
    constexpr bool kAhead = !std::is_same<TokenAt, TokenRanges>::value;
    int64_t next_tok[U]; // the tokens of the next step (0 past v1)
    auto read_tokens = [&](int64_t wbase) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int64_t v = wbase + group + int64_t(u) * NS;
            next_tok[u] = v < v1 ? token_at(v) : 0;
        }
    };
    if constexpr (kAhead) {
        read_tokens(v0 + warp * L::G);
    }
    for (int64_t wbase = v0 + warp * L::G; wbase < v1; wbase += int64_t(NS) * U) {
        const int64_t base = wbase + group;
        // every load of the step first (with the next step's tokens), then
        // the arithmetic
        uint4 kr[U][VPL], vr[U][VPL];
        bool ok[U];
        float fetched[U]; // the bias's loads (dead code for NoBias)
#pragma unroll
        for (int u = 0; u < U; u++) {
            int64_t v = base + int64_t(u) * NS;
            ok[u] = v < v1;
            fetched[u] = 0.0f;
            if (ok[u]) {
                const int64_t t = kAhead ? next_tok[u] : token_at(v);
                fetched[u] = bias.fetch(t);
                const T* kp = K + t * D;
                const T* vp = V + t * D;
#pragma unroll
                for (int j = 0; j < VPL; j++) {
                    kr[u][j] = load16(kp + L::element(lr, j));
                    vr[u][j] = load16(vp + L::element(lr, j));
                }
            } else {
#pragma unroll
                for (int j = 0; j < VPL; j++) {
                    kr[u][j] = make_uint4(0, 0, 0, 0);
                    vr[u][j] = make_uint4(0, 0, 0, 0);
                }
            }
        }
        if constexpr (kAhead) {
            read_tokens(wbase + int64_t(NS) * U);
        }
        float s[U][NQ];
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
                    p = fmaf(q[qi][e], kf[e], p);
                }
                // all lanes shuffle (full mask), whatever ok says
                p = row_sum<L::LPK>(p);
                s[u][qi] = ok[u] ? p + bias(fetched[u], p) : kNegInf;
            }
        }
        float w[U][NQ];
#pragma unroll
        for (int qi = 0; qi < NQ; qi++) {
            float mx = m[qi];
#pragma unroll
            for (int u = 0; u < U; u++) {
                mx = fmaxf(mx, s[u][qi]);
            }
            // mx = -inf: nothing seen yet, and nothing in this step either
            const bool none = mx == kNegInf;
            const float rescale = none ? 1.0f : exp2f(m[qi] - mx);
            float sum = 0.0f;
#pragma unroll
            for (int u = 0; u < U; u++) {
                w[u][qi] = none ? 0.0f : exp2f(s[u][qi] - mx);
                sum += w[u][qi];
            }
            l[qi] = l[qi] * rescale + sum;
            m[qi] = mx;
#pragma unroll
            for (int e = 0; e < EPL; e++) {
                acc[qi][e] *= rescale;
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            float vf[EPL];
#pragma unroll
            for (int j = 0; j < VPL; j++) {
                widen(vr[u][j], static_cast<const T*>(nullptr), vf + j * VEC);
            }
#pragma unroll
            for (int qi = 0; qi < NQ; qi++) {
#pragma unroll
                for (int e = 0; e < EPL; e++) {
                    acc[qi][e] = fmaf(w[u][qi], vf[e], acc[qi][e]);
                }
            }
        }
    }

    // merge the row streams of the warp (lanes at the same place in
    // their row hold the same output elements)
#pragma unroll
    for (int off = L::LPK; off < 32; off *= 2) {
#pragma unroll
        for (int qi = 0; qi < NQ; qi++) {
            float mo = __shfl_xor_sync(kFullMask, m[qi], off);
            float lo = __shfl_xor_sync(kFullMask, l[qi], off);
            float mx = fmaxf(m[qi], mo);
            const bool none = mx == kNegInf;
            float a = none ? 0.0f : exp2f(m[qi] - mx);
            float b = none ? 0.0f : exp2f(mo - mx);
            l[qi] = l[qi] * a + lo * b;
            m[qi] = mx;
#pragma unroll
            for (int e = 0; e < EPL; e++) {
                float ao = __shfl_xor_sync(kFullMask, acc[qi][e], off);
                acc[qi][e] = acc[qi][e] * a + ao * b;
            }
        }
    }

    // then the warps of the block, through shared memory
    SliceMergeShared<NQ, D>& sm = slice_merge_shared<NQ, D>();
    auto& sm_m = sm.m;
    auto& sm_l = sm.l;
    auto& sm_acc = sm.acc;
    if (lane < L::LPK) {
#pragma unroll
        for (int qi = 0; qi < NQ; qi++) {
#pragma unroll
            for (int j = 0; j < VPL; j++) {
#pragma unroll
                for (int e = 0; e < VEC; e++) {
                    sm_acc[warp][qi][L::element(lr, j) + e] = acc[qi][j * VEC + e];
                }
            }
            if (lane == 0) {
                sm_m[warp][qi] = m[qi];
                sm_l[warp][qi] = l[qi];
            }
        }
    }
    __syncthreads();
    // one output row at a time (qi unrolled: the row pointers stay in
    // registers)
#pragma unroll
    for (int qi = 0; qi < NQ; qi++) {
        if (!out_rows[qi]) {
            continue;
        }
        float mx = kNegInf;
#pragma unroll
        for (int w2 = 0; w2 < kDecodeWarps; w2++) {
            mx = fmaxf(mx, sm_m[w2][qi]);
        }
        float sum = 0.0f;
        if (mx != kNegInf) {
#pragma unroll
            for (int w2 = 0; w2 < kDecodeWarps; w2++) {
                sum += sm_l[w2][qi] * exp2f(sm_m[w2][qi] - mx);
            }
        }
        for (int dim = threadIdx.x; dim < D; dim += kDecodeThreads) {
            float o = 0.0f;
            if (mx != kNegInf) {
                float a = 0.0f;
#pragma unroll
                for (int w2 = 0; w2 < kDecodeWarps; w2++) {
                    a += sm_acc[w2][qi][dim] * exp2f(sm_m[w2][qi] - mx);
                }
                o = a / sum;
            }
            out_rows[qi][dim] = o;
        }
        if (threadIdx.x == 0) {
            *lse_rows[qi] = mx != kNegInf ? mx + log2f(sum) : kNegInf;
        }
    }
}

/// One block of dense_slices_kernel: slice `split` of args.ranges for the
/// NQ rows of tile `tile` of head `head`.
template <typename T, int D, int NQ>
__device__ __forceinline__ void dense_slice_block(const DecodeKernelArgs& args, int split,
                                                  int head, int tile) {
    const int64_t v0 = int64_t(split) * args.split_len;
    const int64_t v1 = min(v0 + args.split_len, args.ranges.size());
    const T* K = static_cast<const T*>(args.keys) + head * args.head_stride * D;
    const T* V = static_cast<const T*>(args.values) + head * args.head_stride * D;
    const float* q_rows[NQ];
    float* out_rows[NQ];
    float* lse_rows[NQ];
#pragma unroll
    for (int qi = 0; qi < NQ; qi++) {
        const int r = tile * NQ + qi;
        const bool valid = r < args.rows_per_head;
        const int64_t row = int64_t(head) * args.rows_per_head + r;
        const int64_t slot = row * args.total_splits + args.split_offset + split;
        q_rows[qi] = valid ? args.q + row * D : nullptr;
        out_rows[qi] = valid ? args.part_out + slot * D : nullptr;
        lse_rows[qi] = valid ? args.part_lse + slot : nullptr;
    }
    attend_slice<T, D, NQ>(K, V, q_rows, args.q_scale, v0, v1, args.ranges, out_rows, lse_rows);
}

/// Dense slices: grid (n_splits, n_heads, ceil(rows_per_head / NQ)); one
/// block reads one slice of args.ranges once for NQ rows of its head.
template <typename T, int D, int NQ>
__global__ void __launch_bounds__(kDecodeThreads) dense_slices_kernel(DecodeKernelArgs args) {
    dense_slice_block<T, D, NQ>(args, blockIdx.x, blockIdx.y, blockIdx.z);
}

/// Gathered slices: grid (n_splits, n_rows); row r reads the tokens
/// ids[r][v], v in its slice.
template <typename T, int D>
__global__ void __launch_bounds__(kDecodeThreads) gather_slices_kernel(DecodeKernelArgs args) {
    const int split = blockIdx.x;
    const int64_t row = blockIdx.y;
    const int64_t head = row / args.rows_per_head;
    const int64_t v0 = int64_t(split) * args.split_len;
    const int64_t v1 = min(v0 + args.split_len, args.ids_per_row);
    const T* K = static_cast<const T*>(args.keys) + head * args.head_stride * D;
    const T* V = static_cast<const T*>(args.values) + head * args.head_stride * D;
    const int64_t slot = row * args.total_splits + args.split_offset + split;
    const float* q_rows[1] = {args.q + row * D};
    float* out_rows[1] = {args.part_out + slot * D};
    float* lse_rows[1] = {args.part_lse + slot};
    TokenList list{args.ids + row * args.ids_per_row};
    attend_slice<T, D, 1>(K, V, q_rows, args.q_scale, v0, v1, list, out_rows, lse_rows);
}

/** Token lists read by list_slices_kernel: list l holds lens[l] token rows
 * of its head at ids + l * stride. A list serves rows_per_list consecutive
 * query rows (a KV head's rows_per_head when its rows share one list, 1 for
 * one list per row); rows_per_list divides rows_per_head. */
struct ListArgs {
    const int32_t* ids;
    const int32_t* lens;
    int64_t stride;
    int rows_per_list;
};

/// One block of list_slices_kernel: slice `split` of list `list` for the
/// NQ rows of tile `tile` of the list's rows.
template <typename T, int D, int NQ, typename Bias>
__device__ __forceinline__ void list_slice_block(const DecodeKernelArgs& args,
                                                 const ListArgs& lists,
                                                 const typename Bias::Params& bias_params,
                                                 int split, int64_t list, int tile) {
    const int64_t first_row = list * lists.rows_per_list;
    const int64_t head = first_row / args.rows_per_head;
    const int64_t len = lists.lens[list];
    const int64_t v0 = len * split / args.n_splits;
    const int64_t v1 = len * (split + 1) / args.n_splits;
    const T* K = static_cast<const T*>(args.keys) + head * args.head_stride * D;
    const T* V = static_cast<const T*>(args.values) + head * args.head_stride * D;
    const float* q_rows[NQ];
    float* out_rows[NQ];
    float* lse_rows[NQ];
#pragma unroll
    for (int qi = 0; qi < NQ; qi++) {
        const int r = tile * NQ + qi; // within the list
        const bool valid = r < lists.rows_per_list;
        const int64_t row = first_row + r;
        const int64_t slot = row * args.total_splits + args.split_offset + split;
        q_rows[qi] = valid ? args.q + row * D : nullptr;
        out_rows[qi] = valid ? args.part_out + slot * D : nullptr;
        lse_rows[qi] = valid ? args.part_lse + slot : nullptr;
    }
    const Bias bias(bias_params, head, first_row + tile * NQ);
    TokenList tokens{lists.ids + list * lists.stride};
    attend_slice<T, D, NQ>(K, V, q_rows, args.q_scale, v0, v1, tokens, out_rows, lse_rows, bias);
}

/** Slices of token lists whose lengths only the device knows: grid
 * (n_splits, n_lists, ceil(rows_per_list / NQ)); slice `split` of list l
 * reads positions [len * split / n_splits, len * (split + 1) / n_splits)
 * for NQ of the list's rows, so that every list is cut into n_splits
 * near-equal slices whatever its length (empty slices write lse = -inf).
 * Bias (see attend_slice) is built per block from its params, head and
 * first row. */
template <typename T, int D, int NQ, typename Bias>
__global__ void __launch_bounds__(kDecodeThreads) list_slices_kernel(
        DecodeKernelArgs args, ListArgs lists, typename Bias::Params bias_params) {
    list_slice_block<T, D, NQ, Bias>(args, lists, bias_params, blockIdx.x, blockIdx.y,
                                     blockIdx.z);
}

/// The coordinates of block b of a grid whose blocks are counted x fastest.
struct GridCoords {
    int64_t x, y, z;
    __device__ GridCoords(int64_t b, dim3 grid)
            : x(b % grid.x), y((b / grid.x) % grid.y), z(b / (int64_t(grid.x) * grid.y)) {}
};

/** dense_slices_kernel over the static part and list_slices_kernel over
 * the lists in one launch, so that the two run side by side instead of
 * one after the other (the static part of a sparse step is a short,
 * fixed cost that would otherwise stand alone in front of the lists): a
 * 1-D grid, first the blocks of dense_slices_kernel's grid `static_grid`
 * (x fastest), then those of list_slices_kernel's grid `list_grid`. NQS
 * and NQL are the two kernels' NQ. */
template <typename T, int D, int NQS, int NQL, typename Bias>
__global__ void __launch_bounds__(kDecodeThreads) static_and_list_slices_kernel(
        DecodeKernelArgs static_args,
        dim3 static_grid,
        DecodeKernelArgs list_args,
        ListArgs lists,
        typename Bias::Params bias_params,
        dim3 list_grid) {
    const int64_t b = blockIdx.x;
    const int64_t n_static = int64_t(static_grid.x) * static_grid.y * static_grid.z;
    if (b < n_static) { // the whole block: attend_slice's barriers are uniform
        const GridCoords c(b, static_grid);
        dense_slice_block<T, D, NQS>(static_args, int(c.x), int(c.y), int(c.z));
        return;
    }
    const GridCoords c(b - n_static, list_grid);
    list_slice_block<T, D, NQL, Bias>(list_args, lists, bias_params, int(c.x), c.y, int(c.z));
}

/** <q_r, k_t> (unscaled) of every token of each row's list: grid (x,
 * n_rows), one warp per token, the row's query in shared memory. For
 * search over a selection, not a decode hot path. */
template <typename T, int D>
__global__ void __launch_bounds__(kDecodeThreads) list_scores_kernel(
        const T* __restrict__ keys,
        int64_t head_stride,
        const float* __restrict__ q,
        int rows_per_head,
        ListArgs lists,
        float* __restrict__ scores) {
    __shared__ float qs[D];
    const int64_t row = blockIdx.y;
    const int64_t head = row / rows_per_head;
    for (int j = threadIdx.x; j < D; j += kDecodeThreads) {
        qs[j] = q[row * D + j];
    }
    __syncthreads();
    const int32_t* ids = lists.ids + row * lists.stride;
    const int64_t len = lists.lens[row];
    const T* K = keys + head * head_stride * D;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int64_t v = int64_t(blockIdx.x) * kDecodeWarps + warp; v < len;
         v += int64_t(gridDim.x) * kDecodeWarps) {
        const T* k = K + int64_t(ids[v]) * D;
        float p = 0.0f;
        for (int j = lane; j < D; j += 32) {
            p = fmaf(qs[j], to_float(k[j]), p);
        }
        p = row_sum<32>(p);
        if (lane == 0) {
            scores[row * lists.stride + v] = p;
        }
    }
}

/// Most slices a row may have (the merge keeps one weight per slice in
/// shared memory).
constexpr int kMaxSplits = 1024;
constexpr int kMergeThreads = 256;

/// x reduced over the block (max or sum), returned to every thread;
/// `scratch` holds kMergeThreads / 32 + 1 floats. Every thread must call it.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float x, float* scratch) {
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) {
        float y = __shfl_xor_sync(kFullMask, x, off);
        x = kMax ? fmaxf(x, y) : x + y;
    }
    constexpr int W = kMergeThreads / 32;
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
    float r = scratch[W];
    __syncthreads(); // scratch may be reused right after
    return r;
}

/** Merges the slices of each row by their lse: grid (n_rows), block
 * kMergeThreads, n_splits <= kMaxSplits. out = sum_s 2^(lse_s - M) out_s /
 * sum_s 2^(lse_s - M); lse (natural log) = (M + log2 sum_s 2^(lse_s - M))
 * ln 2. A row whose slices are all empty gets out = 0, lse = -inf. The
 * slices are split among SL lanes of threads, each reading D / 4 float4
 * of a slice's output, then summed through shared memory. */
template <int D>
__global__ void __launch_bounds__(kMergeThreads) merge_slices_kernel(
        const float* __restrict__ part_out,
        const float* __restrict__ part_lse,
        int n_splits,
        float* __restrict__ out,
        float* __restrict__ lse) {
    constexpr int Q = D / 4;              // float4 of a row
    constexpr int SL = kMergeThreads / Q; // slices read at once
    __shared__ float weight[kMaxSplits];
    __shared__ float scratch[kMergeThreads / 32 + 1];
    __shared__ float4 partial[SL][Q];
    const int64_t row = blockIdx.x;
    const float* pl = part_lse + row * n_splits;
    const float* po = part_out + row * n_splits * D;

    float mx = kNegInf;
    for (int s = threadIdx.x; s < n_splits; s += kMergeThreads) {
        mx = fmaxf(mx, pl[s]);
    }
    mx = block_reduce<true>(mx, scratch);
    float sum = 0.0f;
    for (int s = threadIdx.x; s < n_splits; s += kMergeThreads) {
        const float w = mx == kNegInf ? 0.0f : exp2f(pl[s] - mx);
        weight[s] = w;
        sum += w;
    }
    sum = block_reduce<false>(sum, scratch); // its barriers publish weight[]

    const int sl = threadIdx.x / Q;
    const int q4 = threadIdx.x % Q;
    float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int s = sl; s < n_splits; s += SL) {
        const float w = weight[s];
        if (w > 0.0f) { // an empty slice's output is 0: skip its read
            const float4 v = reinterpret_cast<const float4*>(po + int64_t(s) * D)[q4];
            a.x = fmaf(w, v.x, a.x);
            a.y = fmaf(w, v.y, a.y);
            a.z = fmaf(w, v.z, a.z);
            a.w = fmaf(w, v.w, a.w);
        }
    }
    partial[sl][q4] = a;
    __syncthreads();
    if (threadIdx.x < Q) {
        float4 t = partial[0][q4];
        for (int i = 1; i < SL; i++) {
            t.x += partial[i][q4].x;
            t.y += partial[i][q4].y;
            t.z += partial[i][q4].z;
            t.w += partial[i][q4].w;
        }
        const float inv = mx == kNegInf ? 0.0f : 1.0f / sum;
        reinterpret_cast<float4*>(out + row * D)[q4] =
                make_float4(t.x * inv, t.y * inv, t.z * inv, t.w * inv);
    }
    if (threadIdx.x == 0) {
        lse[row] = mx != kNegInf ? (mx + log2f(sum)) * kLn2 : kNegInf;
    }
}

} // namespace gpu
} // namespace kvindex
