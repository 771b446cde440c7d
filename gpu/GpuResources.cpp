#include <kvindex/gpu/GpuResources.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include <faiss/impl/FaissAssert.h>

#include "gpu_error.h"

namespace kvindex {

int gpu_device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); // clear the sticky "no driver" error
        return 0;
    }
    return n;
}

GpuResources::GpuResources(int device) : device_(device) {
    int n = gpu_device_count();
    FAISS_THROW_IF_NOT_MSG(n > 0, "GpuResources: no CUDA device (the GPU index types need one)");
    FAISS_THROW_IF_NOT_FMT(
            device >= 0 && device < n,
            "GpuResources: device %d does not exist (%d CUDA devices)",
            device,
            n);
    DeviceScope scope(device);
    // keep freed scratch in the pool instead of returning it to the driver
    // at every synchronisation
    cudaMemPool_t pool;
    gpu::check_cuda(cudaDeviceGetDefaultMemPool(&pool, device), "GpuResources: memory pool");
    uint64_t keep = UINT64_MAX;
    gpu::check_cuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep),
                    "GpuResources: memory pool release threshold");
    // the stream last: a throw above would leak it (no destructor runs for
    // a constructor that throws)
    gpu::check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                    "GpuResources: cudaStreamCreate");
}

GpuResources::~GpuResources() {
    if (stream_) {
        DeviceScope scope(device_);
        cudaStreamSynchronize(stream_);
        cudaStreamDestroy(stream_);
    }
}

void GpuResources::synchronize(const char* what) const {
    gpu::check_cuda(cudaStreamSynchronize(stream_), what);
}

std::shared_ptr<GpuResources> default_gpu_resources(int device) {
    static std::mutex mutex;
    static std::map<int, std::shared_ptr<GpuResources>> by_device;
    std::lock_guard<std::mutex> lock(mutex);
    std::shared_ptr<GpuResources>& r = by_device[device];
    if (!r) {
        r = std::make_shared<GpuResources>(device);
    }
    return r;
}

DeviceScope::DeviceScope(int device) {
    gpu::check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) {
        gpu::check_cuda(cudaSetDevice(device), "cudaSetDevice");
    }
}

DeviceScope::~DeviceScope() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) {
        cudaSetDevice(previous_);
    }
}

} // namespace kvindex
