// Host side of the IVFAsym decode step (ivf_asym.h): launch plans of the
// probe, the list building and the attention.

#include "ivf_asym.h"

#include <algorithm>
#include <string>

#include "kernels/ivf_asym.cuh"
#include "launch_plan.cuh"

namespace kvindex {
namespace gpu {

namespace {

int next_pow2(int x) {
    int p = 1;
    while (p < x) {
        p *= 2;
    }
    return p;
}

/// Throws for sizes out of range, and (unless only counting) for missing
/// model arrays.
void check_model(const KVHeadsView& kv, const IVFProbeModel& m, int nprobe, bool arrays) {
    const int C = m.n_centroids;
    if (C < 1 || C > kMaxProbeBuckets || nprobe < 0 || nprobe > C) {
        throw_gpu_error("IVFAsym probe: C=" + std::to_string(C) + " buckets (1.." +
                        std::to_string(kMaxProbeBuckets) + " on the GPU) or nprobe=" +
                        std::to_string(nprobe) + " out of range");
    }
    if (nprobe == 0 || !arrays) {
        return; // nothing is routed, or only sizes are asked
    }
    const bool qm = m.kind == IVFProbeKind::qmodel;
    if ((qm && (!m.w1 || !m.bn_scale || !m.bn_shift || !m.w2 || !m.b2 || m.hidden < 1)) ||
        (!qm && !m.centroids) || (m.kind == IVFProbeKind::moment && !m.log_sizes) ||
        (m.kind != IVFProbeKind::centroid_rope && kv.d % 2 != 0)) {
        throw_gpu_error("IVFAsym probe: the model arrays of probe kind " +
                        std::to_string(int(m.kind)) + " are missing");
    }
}

/// y = act(x W^T * scale + shift) for every head's rows.
template <bool kRelu>
void matmul(const float* x, int rows, int din, const float* w, int c_out, const float* scale,
            const float* shift, bool per_head, int n_heads, float* y, cudaStream_t stream) {
    MatmulArgs a;
    a.x = x;
    a.w = w;
    a.w_head_stride = per_head ? int64_t(c_out) * din : 0;
    a.scale = scale;
    a.shift = shift;
    a.v_head_stride = per_head ? c_out : 0;
    a.y = y;
    a.rows = rows;
    a.din = din;
    a.c_out = c_out;
    // the row tile: the rows a head has, up to 8
    auto launch = [&](auto rt) {
        constexpr int RT = decltype(rt)::value;
        dim3 grid(unsigned(ceil_div(c_out, kMatCols)), unsigned(ceil_div(rows, RT)),
                  unsigned(n_heads));
        rows_matmul_kernel<kRelu, RT><<<grid, kMatThreads, 0, stream>>>(a);
    };
    if (rows <= 1) {
        launch(std::integral_constant<int, 1>());
    } else if (rows <= 2) {
        launch(std::integral_constant<int, 2>());
    } else if (rows <= 4) {
        launch(std::integral_constant<int, 4>());
    } else {
        launch(std::integral_constant<int, 8>());
    }
    check_launch("rows_matmul_kernel");
}

} // namespace

int ivf_max_buckets() {
    return kMaxProbeBuckets;
}

namespace {

/** The probe of ivf_probe, and with `lists` the token lists of the probed
 * buckets written by the same kernel (ivf_asym_attention). */
void probe(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        const IVFProbeModel& m,
        int64_t position,
        int nprobe,
        bool group_lists,
        int32_t* probed,
        const ListBuildArgs* lists,
        Workspace& ws,
        cudaStream_t stream) {
    check_view(kv, rows_per_head, "ivf_probe");
    check_model(kv, m, nprobe, !ws.counting());
    const int C = m.n_centroids;
    const int d = kv.d;
    const int64_t n_rows = int64_t(kv.n_heads) * rows_per_head;
    const bool qm = m.kind == IVFProbeKind::qmodel;
    const int din = m.kind == IVFProbeKind::moment ? 2 * d : d;
    float* x = ws.take<float>(size_t(n_rows) * din);
    float* h = qm ? ws.take<float>(size_t(n_rows) * m.hidden) : nullptr;
    float* y = ws.take<float>(size_t(n_rows) * C);
    if (ws.counting() || nprobe == 0) {
        return;
    }
    ProbeInputArgs pa;
    pa.q = q;
    pa.x = x;
    pa.d = d;
    pa.kind = m.kind == IVFProbeKind::moment
            ? ProbeInput::moments
            : m.kind == IVFProbeKind::centroid_rope ? ProbeInput::as_is : ProbeInput::rope_inverted;
    pa.position = std::max<int64_t>(0, position);
    pa.theta = m.rope_theta;
    pa.half_style = m.rope_half ? 1 : 0;
    // the moment probe's log-mass: log n_b + s <q, mean_b> + w s^2 / 2 <q^2, var_b>
    const float s = 1.0f / std::sqrt(float(d));
    pa.mean_scale = s;
    pa.var_scale = 0.5f * m.var_weight * s * s;
    probe_input_kernel<<<unsigned(n_rows), 64, 0, stream>>>(pa);
    check_launch("probe_input_kernel");
    if (qm) {
        matmul<true>(x, rows_per_head, d, m.w1, m.hidden, m.bn_scale, m.bn_shift, m.per_head,
                     kv.n_heads, h, stream);
        matmul<false>(h, rows_per_head, m.hidden, m.w2, C, nullptr, m.b2, m.per_head, kv.n_heads,
                      y, stream);
    } else {
        matmul<false>(x, rows_per_head, din, m.centroids, C, nullptr,
                      m.kind == IVFProbeKind::moment ? m.log_sizes : nullptr, m.per_head,
                      kv.n_heads, y, stream);
    }
    ProbeTopArgs ta;
    ta.y = y;
    ta.n_centroids = C;
    ta.padded = next_pow2(C);
    ta.rows_per_list = group_lists ? rows_per_head : 1;
    ta.softmax = qm || m.kind == IVFProbeKind::moment; // probabilities, as the CPU side sums them
    ta.nprobe = nprobe;
    ta.probed = probed;
    ta.lists = lists != nullptr;
    if (lists) {
        ta.list_args = *lists;
    }
    const int64_t n_lists = group_lists ? kv.n_heads : n_rows;
    probe_top_kernel<<<unsigned(n_lists), kTopThreads, size_t(ta.padded) * 8, stream>>>(ta);
    check_launch("probe_top_kernel");
}

} // namespace

void ivf_probe(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        const IVFProbeModel& m,
        int64_t position,
        int nprobe,
        bool group_lists,
        int32_t* probed,
        Workspace& ws,
        cudaStream_t stream) {
    probe(kv, q, rows_per_head, m, position, nprobe, group_lists, probed, nullptr, ws, stream);
}

void ivf_asym_attention(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        int64_t n_sink,
        int64_t n_window,
        const IVFProbeModel& m,
        const IVFBucketLayout& layout,
        int nprobe,
        bool group_lists,
        int64_t position,
        int64_t max_list,
        float* out,
        float* lse,
        Workspace& ws,
        cudaStream_t stream) {
    check_view(kv, rows_per_head, "ivf_asym_attention");
    check_model(kv, m, nprobe, !ws.counting());
    if (max_list < 0 || max_list > kv.n_tokens || layout.tail_begin < 0 ||
        layout.tail_end < layout.tail_begin || layout.tail_end > kv.n_tokens ||
        (layout.tail_end > layout.tail_begin &&
         layout.tail_stride < layout.tail_end - layout.tail_begin)) {
        throw_gpu_error("ivf_asym_attention: list bound " + std::to_string(max_list) +
                        " or tail [" + std::to_string(layout.tail_begin) + ", " +
                        std::to_string(layout.tail_end) + ") outside the " +
                        std::to_string(kv.n_tokens) + " tokens");
    }
    const int64_t n_rows = int64_t(kv.n_heads) * rows_per_head;
    const int64_t n_lists = group_lists ? kv.n_heads : n_rows;
    const int64_t stride = std::max<int64_t>(max_list, 1);
    int32_t* ids = ws.take<int32_t>(size_t(n_lists) * stride);
    int32_t* lens = ws.take<int32_t>(size_t(n_lists));
    ListBuildArgs la;
    la.n_centroids = m.n_centroids;
    la.begin = layout.begin;
    la.end = layout.end;
    la.tail_bucket = layout.tail_bucket;
    la.tail_stride = layout.tail_stride;
    la.tail_begin = layout.tail_begin;
    la.tail_end = layout.tail_end;
    la.rows_per_list = group_lists ? rows_per_head : 1;
    la.rows_per_head = rows_per_head;
    la.ids = ids;
    la.lens = lens;
    la.stride = stride;
    // the probe writes the lists in its last kernel; without a probe, the
    // lists are the unassigned run alone
    probe(kv, q, rows_per_head, m, position, nprobe, group_lists, nullptr, &la, ws, stream);
    if (!ws.counting() && nprobe == 0) {
        unprobed_lists_kernel<<<unsigned(n_lists), kListThreads, 0, stream>>>(la);
        check_launch("unprobed_lists_kernel");
    }
    TokenLists lists;
    lists.ids = ids;
    lists.lens = lens;
    lists.stride = stride;
    lists.max_len = max_list;
    lists.per_row = !group_lists;
    list_attention(kv, q, rows_per_head, n_sink, n_window, lists, out, lse, ws, stream);
}

} // namespace gpu
} // namespace kvindex
