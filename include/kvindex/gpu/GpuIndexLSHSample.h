#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kvindex/IndexLSHSample.h>
#include <kvindex/gpu/GpuIndexHostTwin.h>

namespace kvindex {

/** MagicPIG on the GPU ("MagicPIG: LSH Sampling for Efficient LLM
 * Generation", arXiv 2410.16179): LSH sampling with the unbiased
 * estimator, the twin of "LSHSample<K>x<L>", bare or with the static part
 * "Sink<n>,Window<m>,LSHSample<K>x<L>" (either count may be 0), as
 * "GPU,<chain>".
 *
 * Where things live. The CPU twin chain is kept on the host (`host`,
 * GpuIndexHostTwin): it is the record of the index (io writes it,
 * index_gpu_to_cpu copies it, knobs are its),
 * and prefill, add_kv and reset go to it, so that the codes of the keys,
 * their norms, the centring mean and the CSR tables (main level, recent
 * level) are built by the CPU code, exactly the CPU's; MagicPIG itself
 * keeps its tables in CPU memory. The device holds what a decode step
 * reads: every token in position order (GpuIndexKV::storage), the
 * hyperplanes, the mean, the norms, both table levels and the codes of
 * the last tokens, which are in neither level. They are mirrored after
 * each write by comparing the host's n_indexed / n_recent / ntotal with
 * what was uploaded: a level is uploaded only when it was rebuilt (the
 * main level every time the tail passes 1/8 of it, the recent level every
 * few hundred tokens), norms and tail codes are appended. Inner (middle)
 * token i is token n_sink + i: the sink is full whenever the inner index
 * holds tokens.
 *
 * A decode step (gpu::lsh_attention, all on the device, no host wait):
 *  1. hash: the K L projections of each query row on the hyperplanes (rows
 *     sharing the planes read each plane once per 8 rows), packed into L
 *     codes as IndexLSHSample::hash does, plus <q, mean> and |q|;
 *  2. count: per row, the query's bucket in each table of both levels is
 *     walked, each id one collision: min_hits 1 or 2 mark two bitsets
 *     (hit once, hit twice) with atomicOr, larger min_hits count in 16-bit
 *     counters; a token enters the row's list at its min_hits-th collision,
 *     exactly once (atomicAdd on the list length); the last tokens are
 *     compared code by code. min_hits = 0 is exact attention (u = 1);
 *  3. attend: the static part exactly and the list with the weights
 *     e^{s_t} / u_t, u_t the inclusion probability of the angle between
 *     the query and the centred key (MagicPIG's formula, computed in float
 *     on the device: relative error <= (0.5 K min_hits + 4) 1e-6, see
 *     gpu::lsh_inclusion; the attention reads it from a table over the
 *     angle, 16384 cells built once per (K, L, min_hits) in double,
 *     within 2e-5 more: an acosf, a log2f and two loads per sampled key
 *     instead of the binomial tail), all merged by lse: the estimator of
 *     "Sink<n>,Window<m>,LSHSample<K>x<L>" on the CPU.
 * The list is a set whose order follows the atomics: outputs agree across
 * calls to float rounding, not bit for bit.
 *
 * Costs per query row (n middle tokens, sample m, head dim d, bf16 KV): the
 * hash reads K L d floats of planes (a few hundred KB, L2-resident); the
 * walk reads the query's L buckets, about 4 L n / 2^K bytes of ids (ids
 * are int32 on the device), with as many atomics on a per-row bitset of n
 * / 8 bytes zeroed each call (16-bit counters: 2 n bytes); the attention
 * reads 4 d m bytes of keys and values, plus the static part. Device
 * memory of a head: the tokens, 4 d n bytes; the main level, 4 L n bytes
 * (L = 150, d = 128: 600 bytes a token against the cache's 512); norms 4 n;
 * planes 4 K L d. A call's workspace holds a list of 4 n bytes per row.
 * The twin keeps its own copy of the tokens, codes (2 L n bytes) and
 * tables in host memory: it is the record, and the CPU code that hashes
 * each appended key and rebuilds the levels reads them there.
 *
 * select: the device sample plus the static tokens, ids increasing, with
 * the device's inclusion probabilities (1 for static tokens); n_scanned
 * as the CPU counts it (IndexLSHSample::sample_reads). search: the exact top-k among the selected tokens,
 * scored on the device, ties by smaller id. Knobs are the twin's:
 * min_hits (SearchParametersLSH::min_hits per call); max_sample must stay
 * 0: a capped sample is ranked by score (and no longer unbiased), which
 * the device path does not do. Per-head state: GpuKVCache refuses the type
 * (KVCache with the GPU string runs one index per head).
 */
struct GpuIndexLSHSample : GpuIndexHostTwin {
    /// An empty index of the twin `cpu_chain` (a factory string without
    /// "GPU,"); throws when the chain has no GPU twin.
    GpuIndexLSHSample(std::shared_ptr<GpuResources> resources, int d,
                      const std::string& cpu_chain, KVType kv_type = KVType::f32);
    /// Empty and without a device: only for the registry's reader.
    GpuIndexLSHSample();
    ~GpuIndexLSHSample() override;

    const char* type_name() const override {
        return "GpuIndexLSHSample";
    }
    size_t memory_bytes() const override;

    /// The IndexLSHSample of the twin chain (codes, tables, knobs).
    const IndexLSHSample& lsh() const;

    /// Draws new hyperplanes from `seed` in the twin (empty index only).
    void set_seed(uint64_t seed);

    void attend_heads(
            const GpuKVStorage& kv,
            int rows_per_head,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params,
            cudaStream_t stream) const override;

    /// Whether `cpu` has this type as its GPU twin: an IndexLSHSample, bare
    /// or as the inner index of an IndexSinkWindow.
    static bool accepts_cpu(const KVIndex& cpu);
    /// The twin of an index accepts_cpu accepts: a copy of it becomes
    /// `host`, its tokens and tables go to the device. Throws for
    /// max_sample != 0 and head dimensions without a kernel.
    static std::unique_ptr<GpuIndexKV> from_cpu(
            const KVIndex& cpu, std::shared_ptr<GpuResources> resources);

   protected:
    /// max_sample != 0 is refused: the device path does not rank a capped sample.
    void check_device_knob(const std::string& name, double value) const override;
    void prefill_impl(const PrefillInput& input) override;
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    void reset_impl() override;
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

   private:
    struct Device; ///< the mirror of the twin's tables (GpuIndexLSHSample.cpp)
    std::unique_ptr<Device> dev_;

    /// min_hits of a call (SearchParametersLSH or the twin's); throws for
    /// max_sample != 0 and min_hits > L.
    int hits_for(const faiss::SearchParameters* params) const;
    /// Uploads what changed in the twin since the last call (see above).
    void sync_device();
    /** The sample of n query rows on the device, ids increasing per row,
     * with u_t (inclusion) when asked; the rows of one device batch at a
     * time. */
    void sample_rows(idx_t n, const float* q, int hits, std::vector<std::vector<int32_t>>* ids,
                     std::vector<std::vector<float>>* inclusion) const;
};

} // namespace kvindex
