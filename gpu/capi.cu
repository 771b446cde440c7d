// A C interface to the decode kernels, for benchmarks that bring their own
// device tensors (benchmarks/gpu/bench_decode.py drives it from PyTorch
// through ctypes, so that our kernels, PyTorch's SDPA and a device copy are
// timed on the same tensors in one run). It runs exactly what the GPU index
// types run (decode_attention.h) and needs neither Faiss nor BLAS, so that
// it loads on a GPU machine that has only the CUDA driver and PyTorch.
//
// Every pointer is device memory; `type` is a KVType (0 float32, 1 bfloat16,
// 2 fp16); `stream` is a cudaStream_t (nullptr: the default stream). The
// functions return 0, or -1 with kvgpu_last_error() saying why; the
// *_workspace functions return the bytes to pass as workspace, or -1.

#include <algorithm>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>

#include "decode_attention.h"
#include "gpu_error.h"
#include "proxy_scores.h"
#include "ivf_asym.h"
#include "lsh_sample.h"

namespace kvindex {
namespace gpu {

void throw_gpu_error(const std::string& msg) {
    throw std::runtime_error(msg);
}

} // namespace gpu
} // namespace kvindex

namespace {

thread_local std::string last_error;

kvindex::gpu::KVHeadsView view(const void* keys, const void* values, int64_t head_stride,
                               int64_t n_tokens, int n_heads, int d, int type) {
    if (type < 0 || type >= kvindex::kNumKVTypes) {
        throw std::runtime_error("unknown KV type " + std::to_string(type));
    }
    kvindex::gpu::KVHeadsView v;
    v.keys = keys;
    v.values = values;
    v.head_stride = head_stride;
    v.n_tokens = n_tokens;
    v.n_heads = n_heads;
    v.d = d;
    v.type = kvindex::KVType(type);
    return v;
}

/// The caller's workspace. A null one would put the kernels in sizing
/// mode (Workspace::counting): they would launch nothing and return 0, and
/// a negative size would wrap to 2^64 and defeat the overflow check.
kvindex::gpu::Workspace given_workspace(void* workspace, int64_t workspace_bytes) {
    if (!workspace || workspace_bytes < 0) {
        throw std::runtime_error(
                (workspace ? "workspace_bytes=" + std::to_string(workspace_bytes) + " is negative"
                           : std::string("workspace is NULL")) +
                ": pass a device buffer of the bytes the matching kvgpu_*_workspace returns");
    }
    return kvindex::gpu::Workspace(workspace, size_t(workspace_bytes));
}

template <class F>
int guarded(F&& f) {
    try {
        f();
        last_error.clear();
        return 0;
    } catch (const std::exception& e) {
        last_error = e.what();
        return -1;
    }
}

template <class F>
int64_t sized(F&& f) {
    kvindex::gpu::Workspace ws = kvindex::gpu::Workspace::sizing();
    if (guarded([&] { f(ws); }) != 0) {
        return -1;
    }
    return int64_t(ws.used);
}

} // namespace

extern "C" {

const char* kvgpu_last_error() {
    return last_error.c_str();
}

/// Blocks per multiprocessor the slicing aims at (decode_attention.h).
int kvgpu_set_slices_per_sm(int n) {
    return guarded([&] { kvindex::gpu::set_slices_per_sm(n); });
}

int64_t kvgpu_dense_workspace(int64_t n_tokens, int n_heads, int d, int type, int rows_per_head) {
    return sized([&](kvindex::gpu::Workspace& ws) {
        kvindex::gpu::dense_attention(view(nullptr, nullptr, n_tokens, n_tokens, n_heads, d, type),
                                      nullptr, rows_per_head, nullptr, nullptr, ws, nullptr);
    });
}

int kvgpu_dense_attention(
        const void* keys,
        const void* values,
        int64_t head_stride,
        int64_t n_tokens,
        int n_heads,
        int d,
        int type,
        const float* q,
        int rows_per_head,
        float* out,
        float* lse,
        void* workspace,
        int64_t workspace_bytes,
        void* stream) {
    return guarded([&] {
        kvindex::gpu::Workspace ws = given_workspace(workspace, workspace_bytes);
        kvindex::gpu::dense_attention(
                view(keys, values, head_stride, n_tokens, n_heads, d, type), q, rows_per_head,
                out, lse, ws, static_cast<cudaStream_t>(stream));
    });
}

int64_t kvgpu_topk_workspace(
        int64_t n_tokens,
        int n_heads,
        int d,
        int type,
        int rows_per_head,
        int64_t n_sink,
        int64_t n_window,
        int64_t k) {
    return sized([&](kvindex::gpu::Workspace& ws) {
        kvindex::gpu::topk_attention(view(nullptr, nullptr, n_tokens, n_tokens, n_heads, d, type),
                                     nullptr, rows_per_head, n_sink, n_window, k, nullptr,
                                     nullptr, ws, nullptr);
    });
}

int kvgpu_topk_attention(
        const void* keys,
        const void* values,
        int64_t head_stride,
        int64_t n_tokens,
        int n_heads,
        int d,
        int type,
        const float* q,
        int rows_per_head,
        int64_t n_sink,
        int64_t n_window,
        int64_t k,
        float* out,
        float* lse,
        void* workspace,
        int64_t workspace_bytes,
        void* stream) {
    return guarded([&] {
        kvindex::gpu::Workspace ws = given_workspace(workspace, workspace_bytes);
        kvindex::gpu::topk_attention(
                view(keys, values, head_stride, n_tokens, n_heads, d, type), q, rows_per_head,
                n_sink, n_window, k, out, lse, ws, static_cast<cudaStream_t>(stream));
    });
}

} // extern "C"

// ---- IVFAsym (ivf_asym.h) ------------------------------------------------------

namespace {

kvindex::gpu::IVFProbeModel ivf_model(
        int kind, int n_centroids, int hidden, const float* w1, const float* bn_scale,
        const float* bn_shift, const float* w2, const float* b2, const float* centroids,
        const float* log_sizes, int per_head, double rope_theta, int rope_half, float var_weight) {
    if (kind < 0 || kind > 3) {
        throw std::runtime_error("unknown IVF probe kind " + std::to_string(kind));
    }
    kvindex::gpu::IVFProbeModel m;
    m.kind = kvindex::gpu::IVFProbeKind(kind);
    m.n_centroids = n_centroids;
    m.hidden = hidden;
    m.w1 = w1;
    m.bn_scale = bn_scale;
    m.bn_shift = bn_shift;
    m.w2 = w2;
    m.b2 = b2;
    m.centroids = centroids;
    m.log_sizes = log_sizes;
    m.per_head = per_head != 0;
    m.rope_theta = rope_theta;
    m.rope_half = rope_half != 0;
    m.var_weight = var_weight;
    return m;
}

} // namespace

extern "C" {

/// Workspace bytes of kvgpu_ivf_attention (the model pointers may be null).
int64_t kvgpu_ivf_workspace(int64_t n_tokens, int n_heads, int d, int type, int rows_per_head,
                            int64_t n_sink, int64_t n_window, int kind, int n_centroids,
                            int hidden, int nprobe, int group, int64_t max_list) {
    return sized([&](kvindex::gpu::Workspace& ws) {
        kvindex::gpu::IVFProbeModel m = ivf_model(kind, n_centroids, hidden, nullptr, nullptr,
                                                  nullptr, nullptr, nullptr, nullptr, nullptr, 1,
                                                  10000, 1, 0);
        kvindex::gpu::IVFBucketLayout layout;
        kvindex::gpu::ivf_asym_attention(
                view(nullptr, nullptr, n_tokens, n_tokens, n_heads, d, type), nullptr,
                rows_per_head, n_sink, n_window, m, layout, nprobe, group != 0, 0, max_list,
                nullptr, nullptr, ws, nullptr);
    });
}

/** One IVFAsym decode step for n_heads heads whose tokens are sorted by
 * bucket (ivf_asym.h): the model arrays hold one model per head
 * (per_head = 1) or one shared; begin / end [n_heads][C + 1]; tail_bucket
 * may be null with tail_begin = tail_end. */
int kvgpu_ivf_attention(
        const void* keys, const void* values, int64_t head_stride, int64_t n_tokens, int n_heads,
        int d, int type, const float* q, int rows_per_head, int64_t n_sink, int64_t n_window,
        int kind, int n_centroids, int hidden, const float* w1, const float* bn_scale,
        const float* bn_shift, const float* w2, const float* b2, const float* centroids,
        const float* log_sizes, int per_head, double rope_theta, int rope_half, float var_weight,
        const int32_t* begin, const int32_t* end, const int32_t* tail_bucket, int64_t tail_stride,
        int64_t tail_begin, int64_t tail_end, int nprobe, int group, int64_t position,
        int64_t max_list, float* out, float* lse, void* workspace, int64_t workspace_bytes,
        void* stream) {
    return guarded([&] {
        kvindex::gpu::Workspace ws = given_workspace(workspace, workspace_bytes);
        kvindex::gpu::IVFBucketLayout layout;
        layout.begin = begin;
        layout.end = end;
        layout.tail_bucket = tail_bucket;
        layout.tail_stride = tail_stride;
        layout.tail_begin = tail_begin;
        layout.tail_end = tail_end;
        kvindex::gpu::ivf_asym_attention(
                view(keys, values, head_stride, n_tokens, n_heads, d, type), q, rows_per_head,
                n_sink, n_window,
                ivf_model(kind, n_centroids, hidden, w1, bn_scale, bn_shift, w2, b2, centroids,
                          log_sizes, per_head, rope_theta, rope_half, var_weight),
                layout, nprobe, group != 0, position, max_list, out, lse, ws,
                static_cast<cudaStream_t>(stream));
    });
}

/// The probe alone: probed [n_lists][nprobe] (for the benchmark's share of
/// keys read); the workspace of kvgpu_ivf_workspace suffices.
int kvgpu_ivf_probe(
        int64_t n_tokens, int n_heads, int d, int type, const float* q, int rows_per_head,
        int kind, int n_centroids, int hidden, const float* w1, const float* bn_scale,
        const float* bn_shift, const float* w2, const float* b2, const float* centroids,
        const float* log_sizes, int per_head, double rope_theta, int rope_half, float var_weight,
        int nprobe, int group, int64_t position, int32_t* probed, void* workspace,
        int64_t workspace_bytes, void* stream) {
    return guarded([&] {
        kvindex::gpu::Workspace ws = given_workspace(workspace, workspace_bytes);
        kvindex::gpu::ivf_probe(
                view(nullptr, nullptr, n_tokens, n_tokens, n_heads, d, type), q, rows_per_head,
                ivf_model(kind, n_centroids, hidden, w1, bn_scale, bn_shift, w2, b2, centroids,
                          log_sizes, per_head, rope_theta, rope_half, var_weight),
                position, nprobe, group != 0, probed, ws, static_cast<cudaStream_t>(stream));
    });
}

} // extern "C"

// ---- eviction scores (proxy_scores.h) -------------------------------------

extern "C" {

/// Bytes of workspace kvgpu_proxy_scores needs for these shapes (the same
/// on every device), or -1.
int64_t kvgpu_proxy_scores_workspace(int64_t n, int d, int n_heads, int64_t n_q, int causal) {
    return sized([&](kvindex::gpu::Workspace& ws) {
        kvindex::gpu::proxy_scores(nullptr, n, d, nullptr, n_heads, n_q, nullptr, 0, causal != 0,
                                   nullptr, ws, nullptr);
    });
}

/** IndexProxyEvict's scores F_j = sum over the n_heads * n_q query rows of
 * softmax(q . K / sqrt(d))_j, float32 (proxy_scores.h): keys [n][d],
 * queries [n_heads * n_q][d] head-major, both 16-byte aligned; q_pos [n_q]
 * int64 (read when causal); scores [n]. */
int kvgpu_proxy_scores(
        const float* keys,
        int64_t n,
        int d,
        const float* queries,
        int n_heads,
        int64_t n_q,
        const int64_t* q_pos,
        int64_t first_pos,
        int causal,
        float* scores,
        void* workspace,
        int64_t workspace_bytes,
        void* stream) {
    return guarded([&] {
        kvindex::gpu::Workspace ws = given_workspace(workspace, workspace_bytes);
        kvindex::gpu::proxy_scores(keys, n, d, queries, n_heads, n_q, q_pos, first_pos,
                                   causal != 0, scores, ws, static_cast<cudaStream_t>(stream));
    });
}

} // extern "C"

/** The LSH tables of n_heads heads for kvgpu_lsh_* (lsh_sample.h): the
 * middle [n_sink, n_tokens - n_window) of each head is sampled, inner token
 * i being row n_sink + i; n_inner = n_tokens - n_sink - n_window when
 * positive, else 0. Per head h (strides implicit where not given):
 * planes + h * planes_head_stride [K * L][d] (stride 0: shared), mean + h *
 * mean_head_stride [d], norms + h * norms_head_stride [n_inner], main level
 * offsets + h * L (2^K + 1) [L][2^K + 1] uint32 and ids + h * L n_indexed
 * [L][n_indexed] int32 inner ids; the recent level alike over n_recent
 * tokens (nullptr / 0: none); the codes of the other n_inner - n_indexed -
 * n_recent tokens at tail_codes + h * n_tail L [n_tail][L] uint16 (nullptr
 * when there are none). */
static kvindex::gpu::LSHTables lsh_tables(
        int64_t n_tokens, int64_t n_sink, int64_t n_window, int K, int L,
        const float* planes, int64_t planes_head_stride, const float* mean,
        int64_t mean_head_stride, const float* norms, int64_t norms_head_stride,
        const uint32_t* offsets, const int32_t* ids, int64_t n_indexed,
        const uint32_t* recent_offsets, const int32_t* recent_ids, int64_t n_recent,
        const uint16_t* tail_codes) {
    if (K < 1 || K > 16 || L < 1 || L > 4096 || n_indexed < 0 || n_recent < 0 || n_sink < 0 ||
        n_window < 0) {
        throw std::runtime_error("kvgpu_lsh: K=" + std::to_string(K) + ", L=" +
                                 std::to_string(L) + ", n_indexed=" + std::to_string(n_indexed) +
                                 ", n_recent=" + std::to_string(n_recent) + " or the static part "
                                 "out of range");
    }
    kvindex::gpu::LSHTables t;
    t.K = K;
    t.L = L;
    t.planes = planes;
    t.planes_head_stride = planes_head_stride;
    t.mean = mean;
    t.mean_head_stride = mean_head_stride;
    t.norms = norms;
    t.norms_head_stride = norms_head_stride;
    t.n_inner = std::max<int64_t>(0, n_tokens - n_sink - n_window);
    t.first_inner = t.n_inner > 0 ? n_sink : 0;
    const int64_t table = int64_t(L) * ((int64_t(1) << K) + 1);
    t.main.offsets = offsets;
    t.main.offsets_head_stride = table;
    t.main.ids = ids;
    t.main.ids_head_stride = int64_t(L) * n_indexed;
    t.main.n_per_table = n_indexed;
    if (n_recent > 0) {
        t.recent.offsets = recent_offsets;
        t.recent.offsets_head_stride = table;
        t.recent.ids = recent_ids;
        t.recent.ids_head_stride = int64_t(L) * n_recent;
        t.recent.n_per_table = n_recent;
    }
    t.tail_codes = tail_codes;
    t.tail_head_stride = std::max<int64_t>(0, t.n_tail()) * L;
    return t;
}

extern "C" {

int64_t kvgpu_lsh_workspace(int64_t n_tokens, int n_heads, int d, int type, int rows_per_head,
                            int64_t n_sink, int64_t n_window, int K, int L, int min_hits,
                            int64_t n_indexed, int64_t n_recent) {
    return sized([&](kvindex::gpu::Workspace& ws) {
        kvindex::gpu::lsh_attention(
                view(nullptr, nullptr, n_tokens, n_tokens, n_heads, d, type), nullptr,
                rows_per_head, n_sink, n_window,
                lsh_tables(n_tokens, n_sink, n_window, K, L, nullptr, 0, nullptr, 0, nullptr, 0,
                           nullptr, nullptr, n_indexed, nullptr, nullptr, n_recent, nullptr),
                min_hits, nullptr, nullptr, ws, nullptr);
    });
}

/** MagicPIG's attention (gpu::lsh_attention): per query row, the static
 * part exactly plus the inner tokens colliding with the query in at least
 * min_hits tables, weighted by 1 / u, merged by lse (natural log); min_hits
 * 0 is exact attention. Tables as lsh_tables above. */
int kvgpu_lsh_attention(
        const void* keys,
        const void* values,
        int64_t head_stride,
        int64_t n_tokens,
        int n_heads,
        int d,
        int type,
        const float* q,
        int rows_per_head,
        int64_t n_sink,
        int64_t n_window,
        int K,
        int L,
        int min_hits,
        const float* planes,
        int64_t planes_head_stride,
        const float* mean,
        int64_t mean_head_stride,
        const float* norms,
        int64_t norms_head_stride,
        const uint32_t* offsets,
        const int32_t* ids,
        int64_t n_indexed,
        const uint32_t* recent_offsets,
        const int32_t* recent_ids,
        int64_t n_recent,
        const uint16_t* tail_codes,
        float* out,
        float* lse,
        void* workspace,
        int64_t workspace_bytes,
        void* stream) {
    return guarded([&] {
        kvindex::gpu::Workspace ws = given_workspace(workspace, workspace_bytes);
        kvindex::gpu::lsh_attention(
                view(keys, values, head_stride, n_tokens, n_heads, d, type), q, rows_per_head,
                n_sink, n_window,
                lsh_tables(n_tokens, n_sink, n_window, K, L, planes, planes_head_stride, mean,
                           mean_head_stride, norms, norms_head_stride, offsets, ids, n_indexed,
                           recent_offsets, recent_ids, n_recent, tail_codes),
                min_hits, out, lse, ws, static_cast<cudaStream_t>(stream));
    });
}

/** The sample of each row (gpu::lsh_select), for the benchmark's reference
 * and sample statistics: ids [n_heads * rows_per_head][n_inner] int32 token
 * rows in no particular order, lens [n_rows], u [n_rows][n_inner] (or
 * nullptr); workspace from kvgpu_lsh_select_workspace. */
int64_t kvgpu_lsh_select_workspace(int64_t n_tokens, int n_heads, int d, int type,
                                   int rows_per_head, int64_t n_sink, int64_t n_window, int K,
                                   int L, int min_hits, int64_t n_indexed, int64_t n_recent) {
    return sized([&](kvindex::gpu::Workspace& ws) {
        kvindex::gpu::lsh_select(
                view(nullptr, nullptr, n_tokens, n_tokens, n_heads, d, type), nullptr,
                rows_per_head,
                lsh_tables(n_tokens, n_sink, n_window, K, L, nullptr, 0, nullptr, 0, nullptr, 0,
                           nullptr, nullptr, n_indexed, nullptr, nullptr, n_recent, nullptr),
                min_hits, nullptr, nullptr, nullptr, nullptr, ws, nullptr);
    });
}

int kvgpu_lsh_select(
        const void* keys,
        const void* values,
        int64_t head_stride,
        int64_t n_tokens,
        int n_heads,
        int d,
        int type,
        const float* q,
        int rows_per_head,
        int64_t n_sink,
        int64_t n_window,
        int K,
        int L,
        int min_hits,
        const float* planes,
        int64_t planes_head_stride,
        const float* mean,
        int64_t mean_head_stride,
        const float* norms,
        int64_t norms_head_stride,
        const uint32_t* offsets,
        const int32_t* ids,
        int64_t n_indexed,
        const uint32_t* recent_offsets,
        const int32_t* recent_ids,
        int64_t n_recent,
        const uint16_t* tail_codes,
        int32_t* sample_ids,
        int32_t* sample_lens,
        float* sample_u,
        void* workspace,
        int64_t workspace_bytes,
        void* stream) {
    return guarded([&] {
        kvindex::gpu::Workspace ws = given_workspace(workspace, workspace_bytes);
        kvindex::gpu::lsh_select(
                view(keys, values, head_stride, n_tokens, n_heads, d, type), q, rows_per_head,
                lsh_tables(n_tokens, n_sink, n_window, K, L, planes, planes_head_stride, mean,
                           mean_head_stride, norms, norms_head_stride, offsets, ids, n_indexed,
                           recent_offsets, recent_ids, n_recent, tail_codes),
                min_hits, sample_ids, sample_lens, nullptr, sample_u, ws,
                static_cast<cudaStream_t>(stream));
    });
}

} // extern "C"

