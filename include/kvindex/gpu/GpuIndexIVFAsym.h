#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kvindex/IndexIVFAsym.h>
#include <kvindex/gpu/GpuIndexHostTwin.h>

namespace kvindex {

/** SAAP's asymmetric partitions on the GPU ("Inference-time sparse
 * attention with asymmetric indexing", arXiv 2502.08246, Appendix F): the
 * twin of "IVFAsym<C>[_Centroid|_CentroidRoPE|_Moment]", bare or with the
 * static part "Sink<n>,Window<m>,IVFAsym<C>...", as "GPU,<chain>".
 *
 * Where things live. The CPU twin chain is kept on the host (`host`,
 * GpuIndexHostTwin): it is the record of the index (io writes it,
 * index_gpu_to_cpu copies it, knobs are its) and does what runs once per
 * token or per prompt, by the CPU code:
 * training at prefill (k-means and the Q-model, or an adopted offline
 * model), bucket assignment, the moment probe's statistics. The device
 * holds what a decode step reads, laid out for it:
 *  - the tokens in bucket order (GpuIndexKV::storage, row = slot): the
 *    sink, then each bucket's keys contiguous (bucket 0 .. C-1, then the
 *    unassigned run C), then the tail: every token appended since (the
 *    window at prefill included), in arrival order, each with its bucket;
 *    the window is the last rows. Appends never move a row; a tail that
 *    grows long is read through its bucket ids (4 bytes a token), and
 *    index_cpu_to_gpu of the twin re-sorts it;
 *  - the routing model of the probe: the Q-model (batch normalisation
 *    folded into a scale and shift, as the CPU inference does), or the
 *    centroids, or the buckets' key means, variances and log sizes.
 *
 * A decode step (gpu::ivf_asym_attention): each query de-RoPEd at its
 * position (the twin's query_position()), the classifier as two small
 * batched products for all rows, the nprobe best buckets per row (or per
 * GQA group with group_probe: summed probabilities, one list read once
 * for the group's rows), the probed buckets' rows listed, and one split-K
 * attention over the lists and the static part, merged by lse: exact
 * softmax over every key of the probed buckets, as the CPU.
 *
 * select: the device probe per query, the ids of the probed buckets from
 * the twin (ascending, u = 1), n_scanned as the CPU's; search: the exact
 * top-k among the selected tokens, scored on the device. The _Oracle
 * probe (a diagnostic that scores every key) has no GPU twin; C is at
 * most gpu::ivf_max_buckets() (4096). Per-head state: GpuKVCache refuses
 * the type (KVCache with the GPU string runs one index per head).
 *
 * Knobs are the twin's (set_index_parameter and SearchParametersTopK
 * reach it): nprobe, group_probe, var_weight; prefill-time: hidden,
 * train_iterations, min_distance, seed.
 */
struct GpuIndexIVFAsym : GpuIndexHostTwin {
    /// An empty index of the twin `cpu_chain` (a factory string without
    /// "GPU,"); throws when the chain has no GPU twin.
    GpuIndexIVFAsym(std::shared_ptr<GpuResources> resources, int d, const std::string& cpu_chain,
                    KVType kv_type = KVType::f32);
    /// Empty and without a device: only for the registry's reader.
    GpuIndexIVFAsym();
    ~GpuIndexIVFAsym() override;

    const char* type_name() const override {
        return "GpuIndexIVFAsym";
    }
    size_t memory_bytes() const override;
    int adopt_trained(const KVIndex& trained) override;
    void check_adopt_trained(const KVIndex& trained) const override;

    /// The IndexIVFAsym of the twin chain.
    const IndexIVFAsym& ivf() const;

    /** The nprobe buckets each query reads, best first, from the device
     * probe (per query, as select): for tests and analysis.
     * @param probed  output, size n * nprobe (nprobe: params or the twin's) */
    void probe(idx_t n, const float* q, int32_t* probed,
               const faiss::SearchParameters* params = nullptr) const;

    void attend_heads(
            const GpuKVStorage& kv,
            int rows_per_head,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params,
            cudaStream_t stream) const override;

    /// Whether `cpu` has this type as its GPU twin (see above).
    static bool accepts_cpu(const KVIndex& cpu);
    /// The twin of an index accepts_cpu accepts: its models, knobs and
    /// tokens (a copy of it becomes `host`).
    static std::unique_ptr<GpuIndexKV> from_cpu(
            const KVIndex& cpu, std::shared_ptr<GpuResources> resources);

   protected:
    void prefill_impl(const PrefillInput& input) override;
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    void reset_impl() override;
    void reconstruct_impl(idx_t key, float* recons) const override;
    void reconstruct_value_impl(idx_t key, float* value) const override;
    void search_batch(
            idx_t n,
            const float* q,
            idx_t k,
            float* distances,
            idx_t* labels,
            const faiss::SearchParameters* params) const override;
    void select_batch(
            idx_t n,
            const float* q,
            Selection* sel,
            const faiss::SearchParameters* params) const override;
    void attend_batch(
            idx_t n,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params) const override;

   private:
    struct Device; ///< the device arrays beside the tokens (GpuIndexIVFAsym.cpp)
    std::unique_ptr<Device> dev_;
    std::vector<idx_t> slot_token_; ///< size ntotal: token at each storage row
    std::vector<idx_t> token_slot_; ///< size ntotal: storage row of each token
    idx_t tail_begin_ = 0;          ///< first tail row

    /// nprobe of a call: SearchParametersTopK::nprobe or the twin's.
    int nprobe_for(const faiss::SearchParameters* params) const;
    /** The buckets of n tokens arriving as tokens first .. first + n - 1,
     * as the twin will assign them (C: read by every query: untrained, or
     * a sink token); the first n_raw reach its inner index as given, the
     * others as stored (through the window). */
    std::vector<int32_t> arrival_buckets(idx_t first, idx_t n, const float* keys,
                                         idx_t n_raw) const;
    /// How many of n tokens appended now go to the twin's inner index (or
    /// its sink) at once rather than through its window.
    idx_t direct_to_inner(idx_t n) const;

    /// Lays the device out anew from the twin: models, sorted buckets, tail.
    void rebuild_device();
    /// Uploads the routing model (and the moment statistics) of the twin.
    void upload_model();
    /// Moment probe: refreshes the statistics of buckets whose size changed.
    void refresh_moments();
    /// Host bound on the tokens a list can hold for nprobe buckets.
    idx_t list_bound(int nprobe) const;
    /// Runs the probe for n queries on the device; probed: n * nprobe.
    void probe_device(idx_t n, const float* q, int nprobe, std::vector<int32_t>* probed) const;
};

} // namespace kvindex
