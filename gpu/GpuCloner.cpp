#include <kvindex/gpu/GpuCloner.h>

#include <mutex>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/gpu/GpuIndexIVFAsym.h>
#include <kvindex/gpu/GpuIndexKVFlat.h>
#include <kvindex/gpu/GpuIndexLSHSample.h>
#include <kvindex/gpu/GpuIndexProxyEvict.h>
#include <kvindex/gpu/GpuIndexTopK.h>
#include <kvindex/index_factory.h>
#include <kvindex/registry.h>

namespace kvindex {

namespace {

struct TwinTable {
    std::mutex mutex;
    std::vector<GpuTwinInfo> rows = {
            {"GpuIndexKVFlat", "Flat", GpuIndexKVFlat::accepts_cpu, GpuIndexKVFlat::from_cpu},
            {"GpuIndexTopK", "TopK(Flat), Sink<n>,Window<m>,TopK(Flat)", GpuIndexTopK::accepts_cpu,
             GpuIndexTopK::from_cpu},
            {"GpuIndexProxyEvict", "ProxyEvict<P>[_H2O|_TOVA|_StreamingLLM|_Random][,Flat]",
             GpuIndexProxyEvict::accepts_cpu, GpuIndexProxyEvict::from_cpu},
            {"GpuIndexIVFAsym", "[Sink<n>,][Window<m>,]IVFAsym<C>[_Centroid|_CentroidRoPE|_Moment]",
             GpuIndexIVFAsym::accepts_cpu, GpuIndexIVFAsym::from_cpu},
            {"GpuIndexLSHSample", "[Sink<n>,][Window<m>,]LSHSample<K>x<L>",
             GpuIndexLSHSample::accepts_cpu, GpuIndexLSHSample::from_cpu},
    };
};

TwinTable& twins() {
    static TwinTable t;
    return t;
}

/// "GPU,<chain>": the GPU twin of the chain that follows.
std::unique_ptr<KVIndex> parse_gpu(FactoryChain& chain) {
    if (chain.peek() != "GPU") {
        return nullptr;
    }
    chain.take();
    std::unique_ptr<KVIndex> cpu = chain.build_rest("GPU");
    return index_cpu_to_gpu(nullptr, cpu.get());
}

template <class T>
std::unique_ptr<KVIndex> make_empty() {
    return std::make_unique<T>();
}

} // namespace

void register_gpu_twin(const GpuTwinInfo& row) {
    FAISS_THROW_IF_NOT_FMT(
            !row.name.empty() && row.accepts && row.make,
            "register_gpu_twin: row '%s' needs a name, accepts and make",
            row.name.c_str());
    TwinTable& t = twins();
    std::lock_guard<std::mutex> lock(t.mutex);
    for (const GpuTwinInfo& r : t.rows) {
        FAISS_THROW_IF_NOT_FMT(
                r.name != row.name, "register_gpu_twin: '%s' is registered", row.name.c_str());
    }
    t.rows.push_back(row);
}

void register_gpu_index_types() {
    static std::once_flag once;
    std::call_once(once, [] {
        register_index_type(
                {"GpuIndexKVFlat", fourcc("KGfl"), 1, "GPU,<chain>",
                 "the GPU twin of the chain that follows (Flat, TopK(Flat), "
                 "Sink<n>,Window<m>,TopK(Flat)); io writes the CPU twin",
                 parse_gpu, make_empty<GpuIndexKVFlat>,
                 /*examples=*/{}});
        // built by the "GPU," row above; listed for io and the tools
        register_index_type(
                {"GpuIndexTopK", fourcc("KGtk"), 1, "GPU,[Sink<n>,][Window<m>,]TopK(Flat)",
                 "exact top-k attention on the GPU with an exact sink and window, merged by lse",
                 nullptr, make_empty<GpuIndexTopK>,
                 /*examples=*/{}});
        register_index_type(
                {"GpuIndexProxyEvict", fourcc("KGpe"), 1,
                 "GPU,ProxyEvict<P>[_H2O|_TOVA|_StreamingLLM|_Random]",
                 "one-shot eviction at prefill: proxy scores on the GPU, the CPU policy's choice, "
                 "dense attention over the kept tokens",
                 nullptr, make_empty<GpuIndexProxyEvict>,
                 /*examples=*/{}});
        register_index_type(
                {"GpuIndexIVFAsym", fourcc("KGia"), 1,
                 "GPU,[Sink<n>,][Window<m>,]IVFAsym<C>[_Centroid|_CentroidRoPE|_Moment]",
                 "SAAP's buckets on the GPU: keys sorted by bucket, the probe as batched "
                 "products, one attention over the probed buckets and the static part",
                 nullptr, make_empty<GpuIndexIVFAsym>,
                 /*examples=*/{}});
        register_index_type(
                {"GpuIndexLSHSample", fourcc("KGls"), 1,
                 "GPU,[Sink<n>,][Window<m>,]LSHSample<K>x<L>",
                 "MagicPIG on the GPU: the query hashed, the CSR tables walked and the "
                 "unbiased estimator over the sample, merged with the static part by lse",
                 nullptr, make_empty<GpuIndexLSHSample>,
                 /*examples=*/{}});
    });
}

namespace {
// Registers the rows when this file is linked in (any use of the
// converters or GpuKVCache links it); register_gpu_index_types stays the
// documented call for a program that only uses index_factory.
const bool gpu_rows_registered = (register_gpu_index_types(), true);
} // namespace

std::unique_ptr<GpuIndexKV> index_cpu_to_gpu(
        std::shared_ptr<GpuResources> resources, const KVIndex* index) {
    FAISS_THROW_IF_NOT_MSG(index, "index_cpu_to_gpu: index is nullptr");
    register_gpu_index_types();
    std::vector<GpuTwinInfo> rows;
    {
        TwinTable& t = twins();
        std::lock_guard<std::mutex> lock(t.mutex);
        rows = t.rows;
    }
    std::string known;
    for (const GpuTwinInfo& r : rows) {
        if (r.accepts(*index)) {
            if (!resources) {
                resources = default_gpu_resources(0);
            }
            return r.make(*index, std::move(resources));
        }
        known += (known.empty() ? "" : "; ") + r.cpu_chains;
    }
    FAISS_THROW_FMT(
            "index_cpu_to_gpu: %s ('%s') has no GPU twin (GPU types exist for: %s)",
            index->type_name(),
            index_factory_string(index).c_str(),
            known.c_str());
}

std::unique_ptr<GpuIndexKV> index_cpu_to_gpu(int device, const KVIndex* index) {
    FAISS_THROW_IF_NOT_MSG(index, "index_cpu_to_gpu: index is nullptr");
    return index_cpu_to_gpu(default_gpu_resources(device), index);
}

std::unique_ptr<KVIndex> index_gpu_to_cpu(const KVIndex* index) {
    FAISS_THROW_IF_NOT_MSG(index, "index_gpu_to_cpu: index is nullptr");
    std::unique_ptr<KVIndex> cpu = index->io_twin();
    FAISS_THROW_IF_NOT_FMT(
            cpu, "index_gpu_to_cpu: %s is not a GPU index", index->type_name());
    return cpu;
}

} // namespace kvindex
