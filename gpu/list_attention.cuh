#pragma once

// Host side of the attention over token lists (decode_attention.h,
// list_attention): the static part as dense slices, each list cut into
// slices on the device (list_slices_kernel), all merged by lse. A template
// on the score bias, so that a sampler (lsh_sample.cu) instantiates it with
// its importance weights and every other caller with NoBias. Private to
// gpu/: included by .cu files only.

#include <string>
#include <type_traits>

#include "launch_plan.cuh"

namespace kvindex {
namespace gpu {

template <class T, int D, class Bias>
void launch_list_slices(const DecodeKernelArgs& a, const ListArgs& lists,
                        const typename Bias::Params& bias, int nq, dim3 grid,
                        cudaStream_t stream) {
    if constexpr (!std::is_same<Bias, NoBias>::value) { // per-row bias: one row a block
        list_slices_kernel<T, D, 1, Bias><<<grid, kDecodeThreads, 0, stream>>>(a, lists, bias);
    } else {
        switch (nq) {
            case 1:
                list_slices_kernel<T, D, 1, Bias><<<grid, kDecodeThreads, 0, stream>>>(a, lists,
                                                                                     bias);
                break;
            case 2:
                list_slices_kernel<T, D, 2, Bias><<<grid, kDecodeThreads, 0, stream>>>(a, lists,
                                                                                     bias);
                break;
            case 4:
                list_slices_kernel<T, D, 4, Bias><<<grid, kDecodeThreads, 0, stream>>>(a, lists,
                                                                                     bias);
                break;
            default:
                list_slices_kernel<T, D, 8, Bias><<<grid, kDecodeThreads, 0, stream>>>(a, lists,
                                                                                     bias);
                break;
        }
    }
    check_launch("list_slices_kernel");
}

template <class T, int D, class Bias, int NQS>
void launch_static_and_lists_nqs(const DecodeKernelArgs& s, dim3 static_grid,
                                 const DecodeKernelArgs& g, const ListArgs& lists,
                                 const typename Bias::Params& bias, int nq_list, dim3 list_grid,
                                 cudaStream_t stream) {
    const unsigned blocks = static_grid.x * static_grid.y * static_grid.z +
            list_grid.x * list_grid.y * list_grid.z;
    if (nq_list == 1) {
        static_and_list_slices_kernel<T, D, NQS, 1, Bias><<<blocks, kDecodeThreads, 0, stream>>>(
                s, static_grid, g, lists, bias, list_grid);
    } else if constexpr (std::is_same<Bias, NoBias>::value && NQS > 1) {
        // a list shared by a head's rows: the static part's row tile
        static_and_list_slices_kernel<T, D, NQS, NQS, Bias>
                <<<blocks, kDecodeThreads, 0, stream>>>(s, static_grid, g, lists, bias, list_grid);
    }
    check_launch("static_and_list_slices_kernel");
}

/// The static part's slices and the lists' slices as one launch
/// (static_and_list_slices_kernel): nq_list is 1 or nq_static.
template <class T, int D, class Bias>
void launch_static_and_lists(const DecodeKernelArgs& s, int nq_static, dim3 static_grid,
                             const DecodeKernelArgs& g, const ListArgs& lists,
                             const typename Bias::Params& bias, int nq_list, dim3 list_grid,
                             cudaStream_t stream) {
    if (nq_list != 1 && nq_list != nq_static) {
        throw_gpu_error("list_attention: a list's row tile " + std::to_string(nq_list) +
                        " is neither 1 nor the static part's " + std::to_string(nq_static));
    }
    switch (nq_static) {
        case 1:
            launch_static_and_lists_nqs<T, D, Bias, 1>(s, static_grid, g, lists, bias, nq_list,
                                                       list_grid, stream);
            break;
        case 2:
            launch_static_and_lists_nqs<T, D, Bias, 2>(s, static_grid, g, lists, bias, nq_list,
                                                       list_grid, stream);
            break;
        case 4:
            launch_static_and_lists_nqs<T, D, Bias, 4>(s, static_grid, g, lists, bias, nq_list,
                                                       list_grid, stream);
            break;
        default:
            launch_static_and_lists_nqs<T, D, Bias, 8>(s, static_grid, g, lists, bias, nq_list,
                                                       list_grid, stream);
            break;
    }
}

/** list_attention with a score bias (attend_slice): a per-row bias needs
 * per-row lists. See decode_attention.h for the arguments. */
template <class Bias>
void list_attention_with(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        int64_t n_sink,
        int64_t n_window,
        const TokenLists& lists,
        const typename Bias::Params& bias,
        float* out,
        float* lse,
        Workspace& ws,
        cudaStream_t stream) {
    check_view(kv, rows_per_head, "list_attention");
    constexpr bool kPlain = std::is_same<Bias, NoBias>::value;
    if (n_sink < 0 || n_window < 0 || lists.max_len < 0 || lists.stride < lists.max_len ||
        (!kPlain && !lists.per_row)) {
        throw_gpu_error("list_attention: invalid n_sink " + std::to_string(n_sink) +
                        ", n_window " + std::to_string(n_window) + ", list bound " +
                        std::to_string(lists.max_len) + " or stride " +
                        std::to_string(lists.stride) +
                        (kPlain ? "" : " (a biased attention needs per-row lists)"));
    }
    const int64_t n_rows = int64_t(kv.n_heads) * rows_per_head;
    const int rows_per_list = lists.per_row ? 1 : rows_per_head;
    const int64_t n_lists = lists.per_row ? n_rows : kv.n_heads;
    if (n_lists > 65535) {
        throw_gpu_error("list_attention: " + std::to_string(n_lists) +
                        " lists exceed a grid's 65535");
    }
    const int nq_static = rows_tile(rows_per_head);
    const int64_t static_tiles = ceil_div(rows_per_head, nq_static);
    const int nq_list = rows_tile(rows_per_list);
    const int64_t list_tiles = ceil_div(rows_per_list, nq_list);
    const TokenRanges ranges = static_ranges(kv.n_tokens, n_sink, n_window);
    // the static slices and the list slices share the merge: half its slots each
    constexpr int64_t kHalf = kMaxSplits / 2;
    const int cap = max_slices(ranges.size(), kMinSliceTokens, kHalf) +
            max_slices(lists.max_len, kMinGather, kHalf);
    float* part_out = ws.take<float>(size_t(n_rows) * cap * kv.d);
    float* part_lse = ws.take<float>(size_t(n_rows) * cap);
    if (ws.counting()) {
        return;
    }
    const Slicing st = slice(ranges.size(), kv.n_heads * static_tiles, target_blocks(),
                             kMinSliceTokens, kHalf);
    const Slicing ls = slice(lists.max_len, n_lists * list_tiles, target_blocks(), kMinGather,
                             kHalf);
    const int total = st.n_splits + ls.n_splits;
    DecodeKernelArgs a = kernel_args(kv, q, rows_per_head);
    a.total_splits = total;
    a.part_out = part_out;
    a.part_lse = part_lse;
    with_type_and_dim(kv.type, kv.d, [&](auto tag, auto dim) {
        using T = typename decltype(tag)::type;
        constexpr int D = decltype(dim)::value;
        DecodeKernelArgs s = a;
        s.ranges = ranges;
        s.split_len = st.split_len;
        s.n_splits = st.n_splits;
        s.split_offset = 0;
        const dim3 static_grid(st.n_splits, kv.n_heads, unsigned(static_tiles));
        DecodeKernelArgs g = a;
        g.n_splits = ls.n_splits;
        g.split_offset = st.n_splits;
        const ListArgs la{lists.ids, lists.lens, lists.stride, rows_per_list};
        const dim3 list_grid(ls.n_splits, unsigned(n_lists), unsigned(list_tiles));
        const int nq_l = kPlain ? nq_list : 1;
        if (st.n_splits > 0 && ls.n_splits > 0) {
            launch_static_and_lists<T, D, Bias>(s, nq_static, static_grid, g, la, bias, nq_l,
                                                list_grid, stream);
        } else if (st.n_splits > 0) {
            launch_dense_slices<T, D>(s, nq_static, static_grid, stream);
        } else if (ls.n_splits > 0) {
            launch_list_slices<T, D, Bias>(g, la, bias, nq_l, list_grid, stream);
        }
    });
    merge(part_out, part_lse, total, n_rows, kv.d, out, lse, stream);
}

} // namespace gpu
} // namespace kvindex
