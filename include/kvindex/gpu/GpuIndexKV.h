#pragma once

#include <memory>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>
#include <kvindex/gpu/GpuKVStorage.h>
#include <kvindex/gpu/GpuResources.h>

namespace kvindex {

/** What every GPU index type shares, as faiss/gpu's GpuIndex: the tokens in
 * device memory (one head of a GpuKVStorage), the resources whose device
 * and stream its calls use, and the calls of KVIndex on host arrays
 * (queries go up, outputs come down; each call waits for its own work).
 *
 * A GPU type has a CPU twin, the CPU index of the same factory chain:
 * factory_string() is "GPU," + the twin's chain, index_gpu_to_cpu /
 * to_cpu() build the twin with the same tokens and knobs, and io writes
 * the twin's record (io_twin), so that a file written from a GPU index
 * reads on any machine, as the CPU type (index_cpu_to_gpu moves it back).
 *
 * Kernels: keys and values d == d_value in {64, 128, 256}, stored as
 * float32, bfloat16 or fp16 (kv_type); queries, outputs and scores float32.
 */
struct GpuIndexKV : KVIndex {
    /// device and stream of every call; nullptr only in an index made
    /// empty for the reader, which refuses GPU records anyway
    std::shared_ptr<GpuResources> resources;
    GpuKVStorage storage; ///< the tokens: one head

    GpuIndexKV(std::shared_ptr<GpuResources> resources, int d, int d_value, KVType kv_type,
               const char* type_for_errors);
    GpuIndexKV();

    size_t memory_bytes() const override;

    /// "GPU," + cpu_factory_string().
    std::string factory_string() const final;
    /// The CPU twin's chain, without the storage prefix.
    virtual std::string cpu_factory_string() const = 0;

    /** The CPU twin with the same tokens, knobs and RoPE (index_gpu_to_cpu).
     * The default rebuilds the twin's chain from cpu_factory_string and
     * adds the tokens in order; types with structures of their own
     * (eviction, trained models, hash tables) override it. */
    virtual std::unique_ptr<KVIndex> to_cpu() const;

    /** Whether attend_heads answers from any storage of this type's shape:
     * a GpuKVCache then holds each layer's heads in one storage and this
     * index only for its knobs. Types with per-head state (buckets, hash
     * tables, evicted positions) return false, and GpuKVCache refuses
     * them (use KVCache with the GPU string: one index per head). */
    virtual bool shares_layer_storage() const {
        return true;
    }
    /// KVIndex::check_params, for GpuKVCache, which calls attend_heads
    /// with the knobs of a whole layer.
    using KVIndex::check_params;
    /** Takes the tokens, the top-k budget, the estimator and the RoPE
     * record of `cpu`, its twin (index_cpu_to_gpu), into this empty index.
     * Throws when d, d_value or the storage type differ. */
    void load_from(const KVIndex& cpu);

    std::unique_ptr<KVIndex> io_twin() const final {
        return to_cpu();
    }
    /// Never called (io writes the twin); throws.
    void write_fields(BufferWriter& w) const final;
    /// GPU records are never written; a file that claims one is refused.
    void read_fields(BufferReader& r, uint32_t version) final;

    /** This type's attention over every head of `kv` (which may be this
     * index's storage or a GpuKVCache layer), on device arrays, enqueued on
     * `stream` without waiting:
     *
     * @param rows_per_head  query rows per KV head (a GQA group x queries)
     * @param q              [kv.n_heads][rows_per_head][d] float32, device
     * @param out            [kv.n_heads][rows_per_head][d_value] float32, device
     * @param lse            [kv.n_heads][rows_per_head] float32, device
     */
    virtual void attend_heads(
            const GpuKVStorage& kv,
            int rows_per_head,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params,
            cudaStream_t stream) const = 0;

    /// Gives a CPU twin this index's knobs (the top-k budget, ...); the
    /// tokens and RoPE are copied by to_cpu.
    virtual void copy_knobs_to(KVIndex* cpu) const;

   protected:
    /// Throws unless the index has resources (a readable device).
    const GpuResources& device() const;

    /// Query rows per device batch: the top-k scores of a batch
    /// ([rows][ntotal] floats) stay under 256 MB.
    idx_t rows_per_batch(idx_t n) const;

    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    void reset_impl() override;
    void reconstruct_impl(idx_t key, float* recons) const override;
    void reconstruct_value_impl(idx_t key, float* value) const override;
    /** Exact top-k over every stored row, on the device (the dense and
     * top-k types' search), labels through label_of_row. */
    void search_batch(
            idx_t n,
            const float* q,
            idx_t k,
            float* distances,
            idx_t* labels,
            const faiss::SearchParameters* params) const override;
    /// The label search reports for storage row `row` (default: the row,
    /// as a token position; eviction maps rows to the positions kept).
    virtual idx_t label_of_row(idx_t row) const {
        return row;
    }

    /** The exact top-k among each query's selected tokens, scored on the
     * device, larger score first, ties by smaller id, padded as Faiss
     * pads: the search of the types whose CPU twin searches its own
     * selection (sampled, probed).
     * @param sel           size n, ids are token positions
     * @param row_of_token  storage row of each token, nullptr: the same */
    void search_among(
            idx_t n,
            const float* q,
            const Selection* sel,
            idx_t k,
            float* distances,
            idx_t* labels,
            const std::vector<idx_t>* row_of_token) const;

    /// Queries up, attend_heads over this index's storage, outputs down.
    void attend_batch(
            idx_t n,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params) const override;
};

} // namespace kvindex
