#pragma once

#include <memory>

#include <kvindex/gpu/GpuIndexKV.h>

namespace kvindex {

/** Top-k attention on the GPU, with the static part every sparse method
 * keeps: the twin of "Sink<n>,Window<m>,TopK(Flat)" (either count may be
 * 0: "TopK(Flat)"), as "GPU,Sink<n>,Window<m>,TopK(Flat)".
 *
 * attend: the first n_sink and last n_window tokens exactly (dense slices,
 * shared by the rows of a head), the k tokens of the middle of largest
 * <q, k_t> per row (one pass of scores over the middle's keys, a radix
 * select on the device, ties by smaller id as on the CPU), gathered; all
 * slices merged by lse. A budget k covering the middle means every token.
 * search is the exact top-k over every token (as the CPU chain's); select
 * returns the static tokens and the middle's top-k, in increasing order.
 * Knob: k (SearchParametersKV::k per call).
 */
struct GpuIndexTopK : GpuIndexKV {
    idx_t n_sink = 0;   ///< first tokens attended exactly
    idx_t n_window = 0; ///< last tokens attended exactly

    GpuIndexTopK(std::shared_ptr<GpuResources> resources, int d, int d_value = -1,
                 KVType kv_type = KVType::f32, idx_t n_sink = 0, idx_t n_window = 0);
    /// Empty and without a device: only for the registry's reader.
    GpuIndexTopK() = default;

    const char* type_name() const override {
        return "GpuIndexTopK";
    }
    std::string cpu_factory_string() const override;
    bool reads_search_knob(const std::string& name) const override {
        return name == "k";
    }
    idx_t top_k_budget() const override {
        return k;
    }

    void attend_heads(
            const GpuKVStorage& kv,
            int rows_per_head,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params,
            cudaStream_t stream) const override;

    /// Whether `cpu` has this type as its GPU twin: "TopK(Flat)" or
    /// "Sink<n>,Window<m>,TopK(Flat)" (an IndexTopK with a Flat retriever,
    /// bare or in an IndexSinkWindow).
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
