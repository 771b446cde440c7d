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

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>

#include "decode_attention.h"
#include "gpu_error.h"

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
        kvindex::gpu::Workspace ws(workspace, size_t(workspace_bytes));
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
        kvindex::gpu::Workspace ws(workspace, size_t(workspace_bytes));
        kvindex::gpu::topk_attention(
                view(keys, values, head_stride, n_tokens, n_heads, d, type), q, rows_per_head,
                n_sink, n_window, k, out, lse, ws, static_cast<cudaStream_t>(stream));
    });
}

} // extern "C"
