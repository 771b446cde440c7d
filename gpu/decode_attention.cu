// Host side of the decode kernels: launch plans and dispatch on the stored
// type, the head dimension and the rows per head (decode_attention.h).

#include "decode_attention.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <string>
#include <type_traits>

#include "gpu_error.h"
#include "launch_plan.cuh"
#include "list_attention.cuh"
#include "kernels/topk_select.cuh"

namespace kvindex {
namespace gpu {

namespace {

/// Fewest candidates a select chunk holds.
constexpr int64_t kMinChunk = 2048;

int sm_count() {
    int dev = 0, n = 0;
    check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
    check_cuda(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev),
               "cudaDeviceGetAttribute(multiprocessors)");
    return n;
}

/// Blocks per multiprocessor the slicing aims at (set_slices_per_sm).
std::atomic<int> slices_per_sm{kDefaultSlicesPerSm};

template <class T, int D>
void launch_scores(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        int64_t begin,
        int64_t n,
        const Slicing& sl,
        int nq,
        float* scores,
        cudaStream_t stream) {
    dim3 grid(sl.n_splits, kv.n_heads, unsigned(ceil_div(rows_per_head, nq)));
    const T* keys = static_cast<const T*>(kv.keys);
    switch (nq) {
        case 1:
            scores_kernel<T, D, 1><<<grid, kDecodeThreads, 0, stream>>>(
                    keys, kv.head_stride, q, rows_per_head, begin, n, sl.split_len, scores);
            break;
        case 2:
            scores_kernel<T, D, 2><<<grid, kDecodeThreads, 0, stream>>>(
                    keys, kv.head_stride, q, rows_per_head, begin, n, sl.split_len, scores);
            break;
        case 4:
            scores_kernel<T, D, 4><<<grid, kDecodeThreads, 0, stream>>>(
                    keys, kv.head_stride, q, rows_per_head, begin, n, sl.split_len, scores);
            break;
        default:
            scores_kernel<T, D, 8><<<grid, kDecodeThreads, 0, stream>>>(
                    keys, kv.head_stride, q, rows_per_head, begin, n, sl.split_len, scores);
            break;
    }
    check_launch("scores_kernel");
}

} // namespace

int64_t target_blocks() {
    return int64_t(sm_count()) * slices_per_sm.load();
}

void set_slices_per_sm(int n) {
    if (n < 1 || n > 64) {
        throw_gpu_error("set_slices_per_sm: " + std::to_string(n) + " outside [1, 64]");
    }
    slices_per_sm.store(n);
}

bool supported_head_dim(int d) {
    return d == 64 || d == 128 || d == 256;
}

void Workspace::overflow() const {
    throw_gpu_error("GPU workspace of " + std::to_string(size) + " bytes is too small (" +
                    std::to_string(used) + " needed)");
}

void dense_attention(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        float* out,
        float* lse,
        Workspace& ws,
        cudaStream_t stream) {
    check_view(kv, rows_per_head, "dense_attention");
    const int64_t n_rows = int64_t(kv.n_heads) * rows_per_head;
    const int nq = rows_tile(rows_per_head);
    const int64_t q_tiles = ceil_div(rows_per_head, nq);
    // the workspace holds the most slices any device could want, so that
    // sizing needs no device
    const int cap = max_slices(kv.n_tokens, kMinSliceTokens, kMaxSplits);
    float* part_out = ws.take<float>(size_t(n_rows) * cap * kv.d);
    float* part_lse = ws.take<float>(size_t(n_rows) * cap);
    if (ws.counting()) {
        return;
    }
    const Slicing sl = slice(kv.n_tokens, kv.n_heads * q_tiles, target_blocks(),
                             kMinSliceTokens, kMaxSplits);
    if (sl.n_splits > 0) {
        DecodeKernelArgs a = kernel_args(kv, q, rows_per_head);
        a.ranges.b0 = 0;
        a.ranges.n0 = kv.n_tokens;
        a.split_len = sl.split_len;
        a.n_splits = sl.n_splits;
        a.split_offset = 0;
        a.total_splits = sl.n_splits;
        a.part_out = part_out;
        a.part_lse = part_lse;
        dim3 grid(sl.n_splits, kv.n_heads, unsigned(q_tiles));
        with_type_and_dim(kv.type, kv.d, [&](auto tag, auto dim) {
            using T = typename decltype(tag)::type;
            launch_dense_slices<T, decltype(dim)::value>(a, nq, grid, stream);
        });
    }
    merge(part_out, part_lse, sl.n_splits, n_rows, kv.d, out, lse, stream);
}

void topk_select(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        int64_t begin,
        int64_t end,
        int64_t k,
        int32_t* ids,
        float* scores_out,
        Workspace& ws,
        cudaStream_t stream) {
    check_view(kv, rows_per_head, "topk_select");
    const int64_t n = end - begin;
    if (begin < 0 || end > kv.n_tokens || n < 1 || k < 1 || k > n) {
        throw_gpu_error("topk_select: k=" + std::to_string(k) + " of tokens [" +
                        std::to_string(begin) + ", " + std::to_string(end) + ") of " +
                        std::to_string(kv.n_tokens));
    }
    const int64_t n_rows = int64_t(kv.n_heads) * rows_per_head;
    const int nq = rows_tile(rows_per_head);
    const int64_t q_tiles = ceil_div(rows_per_head, nq);
    // chunks of the radix passes: the same for every device, so that the
    // counting pass sizes them
    const int64_t want_chunks = ceil_div(132 * 4, n_rows);
    const int64_t n_chunks_plan =
            std::max<int64_t>(1, std::min(want_chunks, ceil_div(n, kMinChunk)));
    const int64_t chunk_len = ceil_div(n, n_chunks_plan);
    const int n_chunks = int(ceil_div(n, chunk_len));

    float* scores = ws.take<float>(size_t(n_rows) * n);
    RadixState* state = ws.take<RadixState>(size_t(n_rows));
    int64_t* counts = ws.take<int64_t>(size_t(n_rows) * n_chunks);
    if (ws.counting()) {
        return;
    }
    // the scores kernel has the dense kernel's shape and registers or fewer
    const Slicing sl = slice(n, kv.n_heads * q_tiles, target_blocks(),
                             kMinSliceTokens, kMaxSplits);
    with_type_and_dim(kv.type, kv.d, [&](auto tag, auto dim) {
        using T = typename decltype(tag)::type;
        launch_scores<T, decltype(dim)::value>(kv, q, rows_per_head, begin, n, sl, nq, scores,
                                               stream);
    });
    radix_init_kernel<<<unsigned(n_rows), 256, 0, stream>>>(state, int(n_rows), n, k);
    check_launch("radix_init_kernel");
    dim3 grid(n_chunks, unsigned(n_rows));
    for (int shift = 56; shift >= 0; shift -= 8) {
        radix_pass_kernel<<<grid, kSelectThreads, 0, stream>>>(scores, n, chunk_len, shift, state);
        check_launch("radix_pass_kernel");
    }
    radix_count_kernel<<<grid, kSelectThreads, 0, stream>>>(scores, n, chunk_len, state, counts);
    check_launch("radix_count_kernel");
    radix_scan_kernel<<<unsigned(n_rows), 32, 0, stream>>>(counts, n_chunks);
    check_launch("radix_scan_kernel");
    radix_write_kernel<<<grid, kSelectThreads, 0, stream>>>(
            scores, n, chunk_len, state, counts, begin, k, ids, scores_out);
    check_launch("radix_write_kernel");
}

void topk_attention(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        int64_t n_sink,
        int64_t n_window,
        int64_t k,
        float* out,
        float* lse,
        Workspace& ws,
        cudaStream_t stream) {
    check_view(kv, rows_per_head, "topk_attention");
    if (n_sink < 0 || n_window < 0 || k < 1) {
        throw_gpu_error("topk_attention: invalid n_sink " + std::to_string(n_sink) +
                        ", n_window " + std::to_string(n_window) + " or k " +
                        std::to_string(k));
    }
    // the middle [sink, mid_end) between the static ranges
    const TokenRanges ranges = static_ranges(kv.n_tokens, n_sink, n_window);
    const int64_t sink = ranges.n0, mid_end = ranges.b1;
    if (k >= mid_end - sink) { // the budget covers the middle: every token, exactly
        dense_attention(kv, q, rows_per_head, out, lse, ws, stream);
        return;
    }
    const int64_t n_rows = int64_t(kv.n_heads) * rows_per_head;
    const int nq = rows_tile(rows_per_head);
    const int64_t q_tiles = ceil_div(rows_per_head, nq);
    // the static slices and the gathered ones share the merge: half its
    // slots each
    constexpr int64_t kHalf = kMaxSplits / 2;
    const int cap = max_slices(ranges.size(), kMinSliceTokens, kHalf) +
            max_slices(k, kMinGather, kHalf);

    int32_t* ids = ws.take<int32_t>(size_t(n_rows) * k);
    float* part_out = ws.take<float>(size_t(n_rows) * cap * kv.d);
    float* part_lse = ws.take<float>(size_t(n_rows) * cap);
    topk_select(kv, q, rows_per_head, sink, mid_end, k, ids, nullptr, ws, stream);
    if (ws.counting()) {
        return;
    }
    const Slicing st = slice(ranges.size(), kv.n_heads * q_tiles, target_blocks(),
                             kMinSliceTokens, kHalf);
    const Slicing ga = slice(k, n_rows, target_blocks(), kMinGather, kHalf);
    const int total = st.n_splits + ga.n_splits;
    DecodeKernelArgs a = kernel_args(kv, q, rows_per_head);
    a.total_splits = total;
    a.part_out = part_out;
    a.part_lse = part_lse;
    with_type_and_dim(kv.type, kv.d, [&](auto tag, auto dim) {
        using T = typename decltype(tag)::type;
        constexpr int D = decltype(dim)::value;
        if (st.n_splits > 0) {
            DecodeKernelArgs s = a;
            s.ranges = ranges;
            s.split_len = st.split_len;
            s.n_splits = st.n_splits;
            s.split_offset = 0;
            launch_dense_slices<T, D>(s, nq, dim3(st.n_splits, kv.n_heads, unsigned(q_tiles)),
                                      stream);
        }
        DecodeKernelArgs g = a;
        g.ids = ids;
        g.ids_per_row = k;
        g.split_len = ga.split_len;
        g.n_splits = ga.n_splits;
        g.split_offset = st.n_splits;
        gather_slices_kernel<T, D><<<dim3(ga.n_splits, unsigned(n_rows)), kDecodeThreads, 0,
                                     stream>>>(g);
        check_launch("gather_slices_kernel");
    });
    merge(part_out, part_lse, total, n_rows, kv.d, out, lse, stream);
}

void list_attention(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        int64_t n_sink,
        int64_t n_window,
        const TokenLists& lists,
        float* out,
        float* lse,
        Workspace& ws,
        cudaStream_t stream) {
    list_attention_with<NoBias>(kv, q, rows_per_head, n_sink, n_window, lists, NoBias::Params(),
                                out, lse, ws, stream);
}

void list_scores(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        const TokenLists& lists,
        float* scores,
        cudaStream_t stream) {
    check_view(kv, rows_per_head, "list_scores");
    const int64_t n_rows = int64_t(kv.n_heads) * rows_per_head;
    if (!lists.per_row || n_rows > 65535 || lists.stride < lists.max_len) {
        throw_gpu_error("list_scores: needs per-row lists of stride >= their bound, at most "
                        "65535 rows (" + std::to_string(n_rows) + ")");
    }
    if (lists.max_len == 0) {
        return;
    }
    const unsigned bx = unsigned(std::min<int64_t>(ceil_div(lists.max_len, kDecodeWarps), 1024));
    ListArgs la{lists.ids, lists.lens, lists.stride, 1};
    with_type_and_dim(kv.type, kv.d, [&](auto tag, auto dim) {
        using T = typename decltype(tag)::type;
        constexpr int D = decltype(dim)::value;
        list_scores_kernel<T, D><<<dim3(bx, unsigned(n_rows)), kDecodeThreads, 0, stream>>>(
                static_cast<const T*>(kv.keys), kv.head_stride, q, rows_per_head, la, scores);
        check_launch("list_scores_kernel");
    });
}

} // namespace gpu
} // namespace kvindex
