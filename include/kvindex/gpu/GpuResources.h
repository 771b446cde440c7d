#pragma once

#include <cstddef>
#include <memory>

#include <cuda_runtime_api.h>

namespace kvindex {

/// Number of CUDA devices this process can use; 0 without a device or a
/// driver (never throws: the GPU tests skip themselves on 0).
int gpu_device_count();

/** The device a GPU index lives on and the stream its calls run on, as
 * faiss/gpu's GpuResources, reduced to what decode needs. Scratch memory of
 * a call comes from the device's stream-ordered pool (cudaMallocAsync),
 * which this object keeps from giving memory back between calls, so that a
 * decode step allocates in microseconds.
 *
 * One object may serve many indexes; calls from several host threads on
 * indexes sharing it are safe (each call takes its own scratch and waits
 * for its own work). Not copyable.
 */
class GpuResources {
   public:
    /// Throws naming the device when it does not exist.
    explicit GpuResources(int device = 0);
    ~GpuResources();
    GpuResources(const GpuResources&) = delete;
    GpuResources& operator=(const GpuResources&) = delete;

    int device() const {
        return device_;
    }
    /// The stream every call of the indexes using this object runs on.
    cudaStream_t stream() const {
        return stream_;
    }
    /// Waits for the stream; throws naming `what` on a device error.
    void synchronize(const char* what) const;

   private:
    int device_;
    cudaStream_t stream_ = nullptr;
};

/// One shared GpuResources per device, made on first use: what the factory
/// ("GPU,...") and index_cpu_to_gpu without resources use.
std::shared_ptr<GpuResources> default_gpu_resources(int device = 0);

/** Makes `device` current for its lifetime and restores the previous one:
 * every GPU call runs on its index's device, whichever the caller's
 * thread had current. */
class DeviceScope {
   public:
    explicit DeviceScope(int device);
    ~DeviceScope();
    DeviceScope(const DeviceScope&) = delete;
    DeviceScope& operator=(const DeviceScope&) = delete;

   private:
    int previous_ = -1;
};

} // namespace kvindex
