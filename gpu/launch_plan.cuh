#pragma once

// How the decode launches are planned, shared by the host code of every
// kernel family (decode_attention.cu, list_attention.cuh, ivf_asym.cu,
// lsh_sample.cu): dispatch on the stored type and head dimension, the cut
// of a token list into slices, the common kernel arguments and the merge.
// Private to gpu/: included by .cu files only.

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "decode_attention.h"
#include "gpu_error.h"
#include "kernels/decode_attention.cuh"

namespace kvindex {
namespace gpu {

/// Fewest tokens a slice reads: below this the merge costs more than the
/// parallelism gains.
constexpr int64_t kMinSliceTokens = 128;
/// Fewest tokens a slice of a gathered list reads.
constexpr int64_t kMinGather = 64;

template <class T>
struct TypeTag {
    using type = T;
};
template <int D>
using Dim = std::integral_constant<int, D>;

/// Calls f(TypeTag<T>, Dim<D>) for the stored type and head dimension.
template <class F>
void with_type_and_dim(KVType type, int d, F&& f) {
    auto by_dim = [&](auto tag) {
        switch (d) {
            case 64:
                f(tag, Dim<64>{});
                return;
            case 128:
                f(tag, Dim<128>{});
                return;
            case 256:
                f(tag, Dim<256>{});
                return;
            default:
                throw_gpu_error(
                        "head dimension " + std::to_string(d) +
                        " has no GPU kernel (supported: 64, 128, 256)");
        }
    };
    switch (type) {
        case KVType::f32:
            by_dim(TypeTag<float>{});
            return;
        case KVType::bf16:
            by_dim(TypeTag<__nv_bfloat16>{});
            return;
        case KVType::f16:
            by_dim(TypeTag<__half>{});
            return;
    }
    throw_gpu_error("unknown KV storage type " + std::to_string(int(type)));
}

inline int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

/// Query rows one block handles: the smallest of 1, 2, 4, 8 covering
/// rows_per_head (tiles of 8 beyond).
inline int rows_tile(int rows_per_head) {
    int t = 1;
    while (t < rows_per_head && t < 8) {
        t *= 2;
    }
    return t;
}

/// How a list of n_tokens is cut into slices when `units` independent
/// (head, row tile) pairs share the device.
struct Slicing {
    int n_splits = 0;
    int64_t split_len = 0;
};

/** Cuts n_tokens into slices for `units` independent (head, row tile)
 * pairs: target_blocks blocks in all, no slice under min_len tokens, at
 * most max_splits. */
inline Slicing slice(int64_t n_tokens, int64_t units, int64_t target_blocks, int64_t min_len,
                     int64_t max_splits) {
    Slicing s;
    if (n_tokens <= 0) {
        return s;
    }
    int64_t want = ceil_div(std::max<int64_t>(target_blocks, 1), std::max<int64_t>(units, 1));
    int64_t most = std::min(ceil_div(n_tokens, min_len), max_splits);
    int64_t n = std::max<int64_t>(1, std::min(want, most));
    s.split_len = ceil_div(n_tokens, n);
    s.n_splits = int(ceil_div(n_tokens, s.split_len));
    return s;
}

/// The most slices slice() can return for these tokens, whatever the device.
inline int max_slices(int64_t n_tokens, int64_t min_len, int64_t max_splits) {
    return n_tokens <= 0 ? 0 : int(std::min(ceil_div(n_tokens, min_len), max_splits));
}

/// Blocks the slicing aims at on the current device (multiprocessors x
/// set_slices_per_sm).
int64_t target_blocks();

template <class T, int D>
void launch_dense_slices(const DecodeKernelArgs& a, int nq, dim3 grid, cudaStream_t stream) {
    switch (nq) {
        case 1:
            dense_slices_kernel<T, D, 1><<<grid, kDecodeThreads, 0, stream>>>(a);
            break;
        case 2:
            dense_slices_kernel<T, D, 2><<<grid, kDecodeThreads, 0, stream>>>(a);
            break;
        case 4:
            dense_slices_kernel<T, D, 4><<<grid, kDecodeThreads, 0, stream>>>(a);
            break;
        default:
            dense_slices_kernel<T, D, 8><<<grid, kDecodeThreads, 0, stream>>>(a);
            break;
    }
    check_launch("dense_slices_kernel");
}

inline DecodeKernelArgs kernel_args(const KVHeadsView& kv, const float* q, int rows_per_head) {
    DecodeKernelArgs a{};
    a.keys = kv.keys;
    a.values = kv.values;
    a.head_stride = kv.head_stride;
    a.q = q;
    a.rows_per_head = rows_per_head;
    a.q_scale = kLog2e / std::sqrt(float(kv.d));
    return a;
}

/// Merges the total_splits slices of each of n_rows rows by their lse.
inline void merge(const float* part_out, const float* part_lse, int total_splits, int64_t n_rows,
                  int d, float* out, float* lse, cudaStream_t stream) {
    auto launch = [&](auto kernel) {
        kernel<<<unsigned(n_rows), kMergeThreads, 0, stream>>>(part_out, part_lse, total_splits,
                                                               out, lse);
    };
    switch (d) {
        case 64:
            launch(merge_slices_kernel<64>);
            break;
        case 128:
            launch(merge_slices_kernel<128>);
            break;
        default:
            launch(merge_slices_kernel<256>);
            break;
    }
    check_launch("merge_slices_kernel");
}

/// Throws naming `what` for a head dimension without kernels or a shape
/// the grids cannot hold.
inline void check_view(const KVHeadsView& kv, int rows_per_head, const char* what) {
    if (!supported_head_dim(kv.d)) {
        throw_gpu_error(std::string(what) + ": head dimension " + std::to_string(kv.d) +
                        " has no GPU kernel (supported: 64, 128, 256)");
    }
    if (kv.n_heads < 1 || kv.n_heads > 65535 || rows_per_head < 1 ||
        ceil_div(rows_per_head, 8) > 65535 || kv.n_tokens < 0 ||
        kv.n_tokens > int64_t(INT32_MAX) || kv.head_stride < kv.n_tokens) {
        throw_gpu_error(std::string(what) + ": invalid shape (heads " +
                        std::to_string(kv.n_heads) + ", rows per head " +
                        std::to_string(rows_per_head) + ", tokens " +
                        std::to_string(kv.n_tokens) + ", head stride " +
                        std::to_string(kv.head_stride) + ")");
    }
}

/** The static part every sparse method keeps: the first n_sink and the
 * last n_window rows of each head, clamped to its n_tokens (the window
 * never overlaps the sink), as one list of ranges. */
inline TokenRanges static_ranges(int64_t n_tokens, int64_t n_sink, int64_t n_window) {
    TokenRanges r;
    const int64_t sink = std::min(n_sink, n_tokens);
    const int64_t window = std::min(n_window, n_tokens - sink);
    r.b0 = 0;
    r.n0 = sink;
    r.b1 = n_tokens - window;
    r.n1 = window;
    return r;
}

} // namespace gpu
} // namespace kvindex
