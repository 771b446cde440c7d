#pragma once

// Per-call device memory of the GPU index types: scratch from the
// stream-ordered pool, host <-> device copies of query and output arrays,
// and the workspace protocol of decode_attention.h.

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include <kvindex/gpu/GpuKVStorage.h>

#include "decode_attention.h"
#include "gpu_error.h"

namespace kvindex {
namespace gpu {

/// Device bytes for one call, taken from and given back to the device's
/// pool in stream order (cudaMallocAsync / cudaFreeAsync).
class DeviceScratch {
   public:
    DeviceScratch(size_t bytes, cudaStream_t stream) : stream_(stream) {
        if (bytes > 0) {
            check_cuda(cudaMallocAsync(&ptr_, bytes, stream), "GPU scratch memory");
        }
    }
    ~DeviceScratch() {
        if (ptr_) {
            cudaFreeAsync(ptr_, stream_);
        }
    }
    DeviceScratch(DeviceScratch&& o) noexcept : ptr_(o.ptr_), stream_(o.stream_) {
        o.ptr_ = nullptr;
    }
    DeviceScratch(const DeviceScratch&) = delete;
    DeviceScratch& operator=(const DeviceScratch&) = delete;
    DeviceScratch& operator=(DeviceScratch&&) = delete;

    void* get() const {
        return ptr_;
    }
    template <class T>
    T* as() const {
        return static_cast<T*>(ptr_);
    }

   private:
    void* ptr_ = nullptr;
    cudaStream_t stream_;
};

/// n elements of T copied to a fresh device array.
template <class T>
DeviceScratch upload(const T* host, size_t n, cudaStream_t stream, const char* what) {
    DeviceScratch d(n * sizeof(T), stream);
    if (n > 0) {
        check_cuda(cudaMemcpyAsync(d.get(), host, n * sizeof(T), cudaMemcpyHostToDevice, stream),
                   what);
    }
    return d;
}

/// n elements of T copied back to the host (enqueued; synchronise before use).
template <class T>
void download(T* host, const void* device, size_t n, cudaStream_t stream, const char* what) {
    if (n > 0) {
        check_cuda(cudaMemcpyAsync(host, device, n * sizeof(T), cudaMemcpyDeviceToHost, stream),
                   what);
    }
}

/// A persistent device array of `bytes` (cudaMalloc, freed by DeviceFree on
/// its device): an index's arrays. 0 bytes: empty.
inline DeviceArray device_alloc(int device, size_t bytes, const char* what) {
    void* p = nullptr;
    if (bytes > 0) {
        check_cuda(cudaMalloc(&p, bytes), what);
    }
    return DeviceArray(p, DeviceFree{device});
}

/// Enqueues a host -> device copy on the index's stream (stream-ordered
/// with the kernels that read it); the host buffer must live until the
/// stream is synchronised.
inline void upload_bytes(void* dst, const void* src, size_t bytes, cudaStream_t stream,
                         const char* what) {
    if (bytes > 0) {
        check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream), what);
    }
}

/** Grows `array` (holding `used` bytes worth keeping) to at least `need`
 * bytes, by doubling; `capacity` in bytes. The stream is drained before
 * the old array is freed. */
inline void grow(DeviceArray& array, size_t& capacity, size_t used, size_t need, int device,
                 cudaStream_t stream, const char* what) {
    if (need <= capacity) {
        return;
    }
    const size_t cap = std::max({need, 2 * capacity, size_t(4096)});
    DeviceArray fresh = device_alloc(device, cap, what);
    if (used > 0) {
        check_cuda(
                cudaMemcpyAsync(fresh.get(), array.get(), used, cudaMemcpyDeviceToDevice, stream),
                what);
        check_cuda(cudaStreamSynchronize(stream), what);
    }
    array = std::move(fresh);
    capacity = cap;
}

/// A persistent device copy of n elements of T, on the index's stream
/// (waits for it: the host array may die on return). n = 0: empty.
template <class T>
DeviceArray device_copy(int device, const T* host, size_t n, cudaStream_t stream,
                        const char* what) {
    DeviceArray a = device_alloc(device, n * sizeof(T), what);
    upload_bytes(a.get(), host, n * sizeof(T), stream, what);
    check_cuda(cudaStreamSynchronize(stream), what);
    return a;
}

template <class T>
DeviceArray device_copy(int device, const std::vector<T>& host, cudaStream_t stream,
                        const char* what) {
    return device_copy(device, host.data(), host.size(), stream, what);
}

/// Runs f(Workspace&) once to size its scratch, then on that much memory.
template <class F>
void with_workspace(cudaStream_t stream, F&& f) {
    Workspace sizing = Workspace::sizing();
    f(sizing);
    DeviceScratch memory(sizing.used, stream);
    Workspace ws(memory.get(), sizing.used);
    f(ws);
}

/// The kernels' view of a storage's heads.
inline KVHeadsView view_of(const GpuKVStorage& s) {
    KVHeadsView v;
    v.keys = s.keys.get();
    v.values = s.values.get();
    v.head_stride = s.capacity;
    v.n_tokens = s.size;
    v.n_heads = s.n_heads;
    v.d = s.d;
    v.type = s.type;
    return v;
}

} // namespace gpu
} // namespace kvindex
