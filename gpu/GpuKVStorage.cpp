#include <kvindex/gpu/GpuKVStorage.h>

#include <algorithm>
#include <cstdint>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/gpu/GpuResources.h>

#include "device_memory.h"
#include "gpu_error.h"

namespace kvindex {

namespace {

/// Smallest capacity a storage allocates: appends of single tokens should
/// not reallocate for a while.
constexpr idx_t kMinCapacity = 256;

} // namespace

void DeviceFree::operator()(void* p) const {
    if (p) {
        int previous = -1;
        cudaGetDevice(&previous);
        cudaSetDevice(device);
        cudaFree(p);
        cudaSetDevice(previous);
    }
}

GpuKVStorage::GpuKVStorage(int device, int n_heads, int d, int d_value, KVType type)
        : device(device), n_heads(n_heads), d(d), d_value(d_value), type(type) {
    FAISS_THROW_IF_NOT_FMT(
            n_heads >= 1 && d >= 1 && d_value >= 1,
            "GpuKVStorage: invalid shape (heads %d, d %d, d_value %d)",
            n_heads,
            d,
            d_value);
}

void GpuKVStorage::reserve(idx_t rows, cudaStream_t stream) {
    if (rows <= capacity) {
        return;
    }
    DeviceScope scope(device);
    const size_t kb = key_row_bytes(), vb = value_row_bytes();
    DeviceArray new_keys =
            gpu::device_alloc(device, size_t(n_heads) * rows * kb, "GpuKVStorage: keys");
    DeviceArray new_values =
            gpu::device_alloc(device, size_t(n_heads) * rows * vb, "GpuKVStorage: values");
    if (size > 0) {
        // every head's rows move to its new place in one 2-D copy
        gpu::check_cuda(cudaMemcpy2DAsync(new_keys.get(), rows * kb, keys.get(), capacity * kb,
                                          size * kb, n_heads, cudaMemcpyDeviceToDevice, stream),
                        "GpuKVStorage: moving keys");
        gpu::check_cuda(cudaMemcpy2DAsync(new_values.get(), rows * vb, values.get(),
                                          capacity * vb, size * vb, n_heads,
                                          cudaMemcpyDeviceToDevice, stream),
                        "GpuKVStorage: moving values");
        gpu::check_cuda(cudaStreamSynchronize(stream), "GpuKVStorage: moving tokens");
    }
    keys = std::move(new_keys);
    values = std::move(new_values);
    capacity = rows;
}

void GpuKVStorage::append(idx_t n, const float* k, const float* v, cudaStream_t stream) {
    if (n <= 0) {
        return;
    }
    // convert first: a value the type cannot hold throws before anything moves
    const size_t kb = key_row_bytes(), vb = value_row_bytes();
    std::vector<uint8_t> kbuf(size_t(n_heads) * n * kb), vbuf(size_t(n_heads) * n * vb);
    convert_from_float(type, k, size_t(n_heads) * n * d, d, kbuf.data(), "GpuKVStorage: keys");
    convert_from_float(type, v, size_t(n_heads) * n * d_value, d_value, vbuf.data(),
                       "GpuKVStorage: values");
    DeviceScope scope(device);
    if (size + n > capacity) {
        reserve(std::max({size + n, 2 * capacity, kMinCapacity}), stream);
    }
    auto* kdst = static_cast<uint8_t*>(keys.get()) + size * kb;
    auto* vdst = static_cast<uint8_t*>(values.get()) + size * vb;
    gpu::check_cuda(cudaMemcpy2DAsync(kdst, capacity * kb, kbuf.data(), n * kb, n * kb, n_heads,
                                      cudaMemcpyHostToDevice, stream),
                    "GpuKVStorage: appending keys");
    gpu::check_cuda(cudaMemcpy2DAsync(vdst, capacity * vb, vbuf.data(), n * vb, n * vb, n_heads,
                                      cudaMemcpyHostToDevice, stream),
                    "GpuKVStorage: appending values");
    // the host buffers die here: the copies must be done
    gpu::check_cuda(cudaStreamSynchronize(stream), "GpuKVStorage: appending tokens");
    size += n;
}

void GpuKVStorage::read(
        int head,
        idx_t i0,
        idx_t n,
        std::vector<float>* k,
        std::vector<float>* v,
        cudaStream_t stream) const {
    FAISS_THROW_IF_NOT_FMT(
            head >= 0 && head < n_heads && i0 >= 0 && n >= 0 && i0 + n <= size,
            "GpuKVStorage::read: head %d, tokens [%zd, %zd) out of %d heads x %zd tokens",
            head,
            size_t(i0),
            size_t(i0 + n),
            n_heads,
            size_t(size));
    const size_t kb = key_row_bytes(), vb = value_row_bytes();
    std::vector<uint8_t> kbuf(n * kb), vbuf(n * vb);
    k->resize(size_t(n) * d);
    v->resize(size_t(n) * d_value);
    if (n == 0) {
        return;
    }
    DeviceScope scope(device);
    const auto* ksrc = static_cast<const uint8_t*>(keys.get()) + (head * capacity + i0) * kb;
    const auto* vsrc = static_cast<const uint8_t*>(values.get()) + (head * capacity + i0) * vb;
    gpu::check_cuda(cudaMemcpyAsync(kbuf.data(), ksrc, n * kb, cudaMemcpyDeviceToHost, stream),
                    "GpuKVStorage: reading keys");
    gpu::check_cuda(cudaMemcpyAsync(vbuf.data(), vsrc, n * vb, cudaMemcpyDeviceToHost, stream),
                    "GpuKVStorage: reading values");
    gpu::check_cuda(cudaStreamSynchronize(stream), "GpuKVStorage: reading tokens");
    convert_to_float(type, kbuf.data(), size_t(n) * d, k->data());
    convert_to_float(type, vbuf.data(), size_t(n) * d_value, v->data());
}

void GpuKVStorage::clear() {
    keys.reset();
    values.reset();
    size = 0;
    capacity = 0;
}

size_t GpuKVStorage::memory_bytes() const {
    return size_t(n_heads) * capacity * (key_row_bytes() + value_row_bytes());
}

} // namespace kvindex
