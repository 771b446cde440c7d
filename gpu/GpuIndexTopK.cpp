#include <kvindex/gpu/GpuIndexTopK.h>

#include <algorithm>
#include <string>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/IndexSinkWindow.h>
#include <kvindex/IndexTopK.h>

#include "decode_attention.h"
#include "device_memory.h"
#include "twin_chain.h"

namespace kvindex {

GpuIndexTopK::GpuIndexTopK(
        std::shared_ptr<GpuResources> resources,
        int d,
        int d_value,
        KVType kv_type,
        idx_t n_sink,
        idx_t n_window)
        : GpuIndexKV(std::move(resources), d, d_value, kv_type, "GpuIndexTopK"),
          n_sink(n_sink),
          n_window(n_window) {
    FAISS_THROW_IF_NOT_FMT(
            n_sink >= 0 && n_window >= 0,
            "GpuIndexTopK: n_sink=%zd and n_window=%zd must be >= 0",
            size_t(n_sink),
            size_t(n_window));
}

std::string GpuIndexTopK::cpu_factory_string() const {
    std::string s;
    if (n_sink > 0) {
        s += "Sink" + std::to_string(n_sink) + ",";
    }
    if (n_window > 0) {
        s += "Window" + std::to_string(n_window) + ",";
    }
    return s + "TopK(Flat)";
}

void GpuIndexTopK::attend_heads(
        const GpuKVStorage& kv,
        int rows_per_head,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params,
        cudaStream_t stream) const {
    DeviceScope scope(kv.device);
    const gpu::KVHeadsView view = gpu::view_of(kv);
    const idx_t budget = effective_k(params);
    gpu::with_workspace(stream, [&](gpu::Workspace& ws) {
        gpu::topk_attention(view, q, rows_per_head, n_sink, n_window, budget, out, lse, ws,
                            stream);
    });
}

void GpuIndexTopK::select_batch(
        idx_t n,
        const float* q,
        Selection* sel,
        const faiss::SearchParameters* params) const {
    const idx_t budget = effective_k(params);
    const idx_t sink = std::min(n_sink, ntotal);
    const idx_t mid_end = std::max(sink, ntotal - n_window);
    const idx_t n_mid = mid_end - sink;
    auto kv_params = dynamic_cast<const SearchParametersKV*>(params);
    const bool count = kv_params && kv_params->count_scanned;
    if (budget >= n_mid) { // every token, as the CPU chain
        for (idx_t i = 0; i < n; i++) {
            sel[i].set_all(ntotal);
        }
        return;
    }
    const GpuResources& res = device();
    DeviceScope scope(res.device());
    cudaStream_t stream = res.stream();
    const gpu::KVHeadsView view = gpu::view_of(storage);
    const idx_t batch = rows_per_batch(n);
    std::vector<int32_t> ids;
    for (idx_t i0 = 0; i0 < n; i0 += batch) {
        const idx_t nb = std::min(batch, n - i0);
        gpu::DeviceScratch qd = gpu::upload(q + i0 * d, size_t(nb) * d, stream, "select: queries");
        gpu::DeviceScratch ids_d(size_t(nb) * budget * sizeof(int32_t), stream);
        gpu::with_workspace(stream, [&](gpu::Workspace& ws) {
            gpu::topk_select(view, qd.as<float>(), int(nb), sink, mid_end, budget,
                             ids_d.as<int32_t>(), nullptr, ws, stream);
        });
        ids.resize(size_t(nb) * budget);
        gpu::download(ids.data(), ids_d.get(), ids.size(), stream, "select: ids");
        res.synchronize("select");
        for (idx_t i = 0; i < nb; i++) {
            Selection& s = sel[i0 + i];
            s.clear();
            for (idx_t t = 0; t < sink; t++) {
                s.push_back(t);
            }
            for (idx_t j = 0; j < budget; j++) {
                s.push_back(ids[i * budget + j]);
            }
            for (idx_t t = mid_end; t < ntotal; t++) {
                s.push_back(t);
            }
            // the retrieval scored every key of the middle
            s.n_scanned = count ? size_t(n_mid) : 0;
        }
    }
}

namespace {

/// The IndexTopK of "TopK(Flat)" / "Sink<n>,Window<m>,TopK(Flat)", or nullptr.
const IndexTopK* flat_topk_of(const KVIndex& cpu, idx_t* n_sink, idx_t* n_window) {
    const IndexTopK* t = static_chain_inner<IndexTopK>(cpu, n_sink, n_window);
    return t && t->retriever_string == "Flat" ? t : nullptr; // exact top-k only
}

} // namespace

bool GpuIndexTopK::accepts_cpu(const KVIndex& cpu) {
    idx_t s, w;
    return flat_topk_of(cpu, &s, &w) != nullptr;
}

std::unique_ptr<GpuIndexKV> GpuIndexTopK::from_cpu(
        const KVIndex& cpu, std::shared_ptr<GpuResources> resources) {
    idx_t n_sink = 0, n_window = 0;
    FAISS_THROW_IF_NOT_FMT(
            flat_topk_of(cpu, &n_sink, &n_window), "GpuIndexTopK: no twin of %s", cpu.type_name());
    auto gpu = std::make_unique<GpuIndexTopK>(std::move(resources), cpu.d, cpu.d_value,
                                              cpu.kv_type, n_sink, n_window);
    gpu->load_from(cpu);
    return gpu;
}

} // namespace kvindex
