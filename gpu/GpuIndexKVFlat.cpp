#include <kvindex/gpu/GpuIndexKVFlat.h>

#include <string>

#include <faiss/impl/FaissAssert.h>

#include "decode_attention.h"
#include "device_memory.h"

namespace kvindex {

GpuIndexKVFlat::GpuIndexKVFlat(
        std::shared_ptr<GpuResources> resources, int d, int d_value, KVType kv_type)
        : GpuIndexKV(std::move(resources), d, d_value, kv_type, "GpuIndexKVFlat") {}

void GpuIndexKVFlat::attend_heads(
        const GpuKVStorage& kv,
        int rows_per_head,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters*,
        cudaStream_t stream) const {
    DeviceScope scope(kv.device);
    const gpu::KVHeadsView view = gpu::view_of(kv);
    gpu::with_workspace(stream, [&](gpu::Workspace& ws) {
        gpu::dense_attention(view, q, rows_per_head, out, lse, ws, stream);
    });
}

void GpuIndexKVFlat::select_batch(
        idx_t n,
        const float*,
        Selection* sel,
        const faiss::SearchParameters*) const {
    for (idx_t i = 0; i < n; i++) {
        sel[i].set_all(ntotal);
    }
}

bool GpuIndexKVFlat::accepts_cpu(const KVIndex& cpu) {
    return std::string(cpu.type_name()) == "IndexKVFlat";
}

std::unique_ptr<GpuIndexKV> GpuIndexKVFlat::from_cpu(
        const KVIndex& cpu, std::shared_ptr<GpuResources> resources) {
    FAISS_THROW_IF_NOT_FMT(accepts_cpu(cpu), "GpuIndexKVFlat: no twin of %s", cpu.type_name());
    auto gpu = std::make_unique<GpuIndexKVFlat>(std::move(resources), cpu.d, cpu.d_value, cpu.kv_type);
    gpu->load_from(cpu);
    return gpu;
}

} // namespace kvindex
