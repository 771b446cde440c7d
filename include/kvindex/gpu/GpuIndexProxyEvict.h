#pragma once

#include <memory>
#include <string>
#include <vector>

#include <kvindex/IndexProxyEvict.h>
#include <kvindex/gpu/GpuIndexKV.h>

namespace kvindex {

/** One-shot eviction at prefill on the GPU: the twin of
 * "ProxyEvict<P>[_H2O|_TOVA|_StreamingLLM|_Random]" with a Flat inner index
 * (bare "ProxyEvict20" or "ProxyEvict20,Flat"), as "GPU,ProxyEvict20...".
 *
 * What runs where:
 *  - prefill uploads the prompt's keys and the proxy queries and computes
 *    the scores F (gpu::proxy_scores, two tiled float32 passes on the
 *    device: the GEMM-sized part, ~1.5 TMAC for a GQA group of 4 at 128k
 *    tokens with NaCl's window) through IndexProxyEvict's ProxyScorer hook;
 *    the budget, the proxy window and the choice of the kept tokens (top
 *    by F, the sample from softmax(F)) are the CPU code of a private,
 *    token-less IndexProxyEvict that holds the policy and its knobs, so
 *    they cannot drift from the CPU type. Only the kept tokens go to the
 *    device storage.
 *  - attend is the dense split-K kernel over the kept tokens (as
 *    GpuIndexKVFlat); search the exact top-k over them; select returns
 *    them all. Ids are positions, as on the CPU: ntotal counts every
 *    position seen, `positions` maps a stored token to its position, and
 *    reconstruct of an evicted position throws.
 *  - add_kv appends generated tokens, never evicted.
 *
 * The device scores are float32 sums (the CPU's double sums of float
 * softmaxes), within ~1e-5 relative of the CPU's: the kept set equals the
 * CPU twin's except where candidates' scores tie within that error. NaCl's
 * random part assigns its draws in the order the top-part selection leaves
 * the candidates, so such a near-tie may also change which sample is drawn
 * (still a sample from softmax(F)); fed the same scores, the choice is the
 * CPU's exactly.
 *
 * Knobs (get / set / parameter_info) are the CPU type's, forwarded to the
 * policy object: budget, protect, proxy_keep, proxy_window, proxy_tokens,
 * pool, layer_vote, n_sink, seed (each where the mode reads it); set_stream keeps the
 * per-head stream of the random part. to_cpu / io write the CPU
 * IndexProxyEvict with the same knobs, kept tokens and positions.
 *
 * Eviction keeps different tokens in every head, so this type cannot
 * answer a GpuKVCache layer from one shared storage
 * (shares_layer_storage() is false): use KVCache with the "GPU,..." string,
 * one index per head.
 */
struct GpuIndexProxyEvict : GpuIndexKV {
    /// size storage.size: position of each stored (kept or generated) token, increasing
    std::vector<idx_t> positions;

    GpuIndexProxyEvict(
            std::shared_ptr<GpuResources> resources,
            int d,
            int d_value,
            KVType kv_type,
            EvictPolicy policy,
            double keep_percent);
    /// Empty and without a device: only for the registry's reader, which
    /// refuses GPU records.
    GpuIndexProxyEvict();
    ~GpuIndexProxyEvict() override;

    /// The policy and its knobs (a CPU IndexProxyEvict that holds no token).
    const IndexProxyEvict& policy() const;

    const char* type_name() const override {
        return "GpuIndexProxyEvict";
    }
    /// The CPU twin's chain, "ProxyEvict<P>[_Policy]".
    std::string cpu_factory_string() const override;
    bool shares_layer_storage() const override {
        return false;
    }
    size_t memory_bytes() const override;

    /// Dense attention over every head of `kv` (the kept tokens).
    void attend_heads(
            const GpuKVStorage& kv,
            int rows_per_head,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params,
            cudaStream_t stream) const override;

    std::vector<ParameterInfo> parameter_info() const override;
    bool set_parameter(const std::string& name, double value) override;
    bool get_parameter(const std::string& name, double* value) const override;
    /// Keeps the stream of the random part (KVCache sets one per head).
    void set_stream(uint64_t stream) override;

    /// The CPU IndexProxyEvict with the same knobs, kept tokens (in its
    /// Flat inner index), positions and RoPE record.
    std::unique_ptr<KVIndex> to_cpu() const override;

    /// Whether `cpu` has this type as its GPU twin: an IndexProxyEvict whose
    /// inner index is an IndexKVFlat.
    static bool accepts_cpu(const KVIndex& cpu);
    /// The twin of an index accepts_cpu accepts (prefilled or empty), with
    /// its knobs, kept tokens and positions.
    static std::unique_ptr<GpuIndexKV> from_cpu(
            const KVIndex& cpu, std::shared_ptr<GpuResources> resources);

   protected:
    /// Scores on the device, chooses with the CPU policy, stores the kept tokens.
    void prefill_impl(const PrefillInput& input) override;
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    void reset_impl() override;
    void reconstruct_impl(idx_t key, float* recons) const override;
    void reconstruct_value_impl(idx_t key, float* value) const override;
    /// search (GpuIndexKV's, over the stored tokens) reports positions.
    idx_t label_of_row(idx_t row) const override {
        return positions[row];
    }
    void select_batch(
            idx_t n,
            const float* q,
            Selection* sel,
            const faiss::SearchParameters* params) const override;

   private:
    /// the policy and knobs: a CPU IndexProxyEvict over an empty Flat,
    /// never given a token (its inner index's k and estimator are the
    /// twin's inner's, so that to_cpu / from_cpu round-trip every field)
    std::unique_ptr<IndexProxyEvict> policy_;

    /// Stored index of a position, or -1 if it was evicted.
    idx_t stored_id(idx_t position) const;
    /// policy_, or a throw naming the call (an index made for the reader).
    IndexProxyEvict& checked_policy(const char* what) const;
};

} // namespace kvindex
