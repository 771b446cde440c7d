#pragma once

// Host side of SAAP's decode step on the device (kernels/ivf_asym.cuh):
// route each query (or GQA group) to its nprobe buckets, list the token
// rows of those buckets, and attend over them with the static part
// (list_attention). Every pointer here is device memory; the Workspace
// protocol is decode_attention.h's. Shared by GpuIndexIVFAsym and the
// benchmarks' C interface (capi.cu).

#include <cstdint>

#include <cuda_runtime_api.h>

#include "decode_attention.h"

namespace kvindex {
namespace gpu {

/// Most buckets the device routes among (kernels/ivf_asym.cuh).
int ivf_max_buckets();

/// The probes of IndexIVFAsym that run on the device.
enum class IVFProbeKind : int {
    qmodel = 0,        ///< SAAP: the Q-model's nprobe most probable buckets (de-RoPEd query)
    centroid = 1,      ///< nearest de-RoPEd centroids by inner product
    centroid_rope = 2, ///< the same on the post-RoPE query (the symmetric baseline)
    moment = 3,        ///< the buckets' key moments (IVFAsymProbe::moment)
};

/** The routing models of the n_heads heads of a call. Arrays hold one
 * model, shared by every head (per_head = false), or n_heads models back
 * to back (per_head = true). */
struct IVFProbeModel {
    IVFProbeKind kind = IVFProbeKind::centroid;
    int n_centroids = 0;              ///< C, <= ivf_max_buckets()
    int hidden = 0;                   ///< Q-model width
    const float* w1 = nullptr;        ///< qmodel: [hidden][d]
    const float* bn_scale = nullptr;  ///< qmodel: [hidden] gamma / sqrt(running var + eps)
    const float* bn_shift = nullptr;  ///< qmodel: [hidden] beta - running mean * bn_scale
    const float* w2 = nullptr;        ///< qmodel: [C][hidden]
    const float* b2 = nullptr;        ///< qmodel: [C]
    /// centroid probes: [C][d] (de-RoPEd key space); moment: [C][2 d], each
    /// bucket's key means then variances (keys as stored)
    const float* centroids = nullptr;
    const float* log_sizes = nullptr; ///< moment: [C] log of the bucket sizes (-inf: empty)
    bool per_head = false;
    double rope_theta = 10000;        ///< de-RoPE of qmodel / centroid
    bool rope_half = true;            ///< RoPE pairs (j, j + d/2); false: (2j, 2j + 1)
    float var_weight = 0;             ///< moment: weight of the variance term
};

/** Where each head's buckets lie in its token rows: bucket b (0..C) of
 * head h at rows [begin, end) of the bucket-sorted part (bucket C, the
 * unassigned run, is read by every query), then the tail: rows [tail_begin,
 * tail_end) appended since, each with its bucket (C: read by every query).
 * Rows outside both (the static part) are never listed. */
struct IVFBucketLayout {
    const int32_t* begin = nullptr;       ///< [n_heads][C + 1]
    const int32_t* end = nullptr;         ///< [n_heads][C + 1]
    const int32_t* tail_bucket = nullptr; ///< [n_heads][tail_stride], row t at t - tail_begin
    int64_t tail_stride = 0;
    int64_t tail_begin = 0;
    int64_t tail_end = 0;
};

/** The nprobe best buckets of each row (group_lists = false) or of each
 * head's rows together (group_lists = true: a GQA group sums its
 * probabilities), best first, ties to the smaller bucket, for queries at
 * `position` (de-RoPE).
 *
 * @param q       [n_heads][rows_per_head][d] float32
 * @param probed  [n_lists][nprobe] int32, n_lists = n_heads * rows_per_head or n_heads
 */
void ivf_probe(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        const IVFProbeModel& model,
        int64_t position,
        int nprobe,
        bool group_lists,
        int32_t* probed,
        Workspace& ws,
        cudaStream_t stream);

/** One decode step of IVFAsym: the probe (skipped when nprobe = 0: only
 * bucket C and the static part are read), the lists of the probed buckets
 * (max_list: a host bound on any list's length), and exact attention over
 * them and the first n_sink / last n_window rows of each head, merged by
 * lse. Shapes of q, out, lse as list_attention. */
void ivf_asym_attention(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        int64_t n_sink,
        int64_t n_window,
        const IVFProbeModel& model,
        const IVFBucketLayout& layout,
        int nprobe,
        bool group_lists,
        int64_t position,
        int64_t max_list,
        float* out,
        float* lse,
        Workspace& ws,
        cudaStream_t stream);

} // namespace gpu
} // namespace kvindex
