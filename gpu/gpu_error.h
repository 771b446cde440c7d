#pragma once

// Errors of the CUDA layer. The kernels' host code (gpu/decode_*.cu) is
// shared by kvindex_gpu, whose errors are faiss::FaissException like the
// rest of the library, and by the Faiss-free kernel library of the
// benchmarks (capi.cu), whose errors are std::runtime_error: each links its
// own definition of throw_gpu_error (gpu_error_faiss.cpp, capi.cu).

#include <string>

#include <cuda_runtime_api.h>

namespace kvindex {
namespace gpu {

/// Throws the library's exception with this message.
[[noreturn]] void throw_gpu_error(const std::string& msg);

/// Throws naming `what` and CUDA's message when err is not cudaSuccess.
inline void check_cuda(cudaError_t err, const char* what) {
    if (err != cudaSuccess) {
        throw_gpu_error(std::string(what) + ": CUDA error " + cudaGetErrorName(err) + " (" +
                        cudaGetErrorString(err) + ")");
    }
}

/// After a launch: the launch's own error (bad configuration, no kernel
/// image for this device), named.
inline void check_launch(const char* kernel) {
    check_cuda(cudaGetLastError(), kernel);
}

} // namespace gpu
} // namespace kvindex
