#pragma once

#include <memory>

#include <kvindex/gpu/GpuIndexKV.h>

namespace kvindex {

/** Exact attention on the GPU: the twin of IndexKVFlat ("GPU,Flat").
 *
 * attend runs the split-K ("flash-decoding") kernel: the tokens are cut
 * into slices, each slice read once for every query row of the call (the
 * query heads of a GQA group share one pass, up to 8 rows a block), an
 * online softmax per row, and the slices merged by lse. search is the exact
 * top-k on the device; select returns every token.
 */
struct GpuIndexKVFlat : GpuIndexKV {
    GpuIndexKVFlat(std::shared_ptr<GpuResources> resources, int d, int d_value = -1,
                   KVType kv_type = KVType::f32);
    /// Empty and without a device: only for the registry's reader, which
    /// refuses GPU records.
    GpuIndexKVFlat() = default;

    const char* type_name() const override {
        return "GpuIndexKVFlat";
    }
    std::string cpu_factory_string() const override {
        return "Flat";
    }

    void attend_heads(
            const GpuKVStorage& kv,
            int rows_per_head,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params,
            cudaStream_t stream) const override;

    /// Whether `cpu` has this type as its GPU twin: an IndexKVFlat.
    static bool accepts_cpu(const KVIndex& cpu);
    /// The twin of an index accepts_cpu accepts, with its tokens and knobs.
    static std::unique_ptr<GpuIndexKV> from_cpu(
            const KVIndex& cpu, std::shared_ptr<GpuResources> resources);

   protected:
    void select_batch(
            idx_t n,
            const float* q,
            Selection* sel,
            const faiss::SearchParameters* params) const override;
};

} // namespace kvindex
