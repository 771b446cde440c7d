#pragma once

#include <memory>
#include <string>
#include <vector>

#include <kvindex/KVCache.h>
#include <kvindex/gpu/GpuIndexKV.h>
#include <kvindex/gpu/GpuKVStorage.h>
#include <kvindex/gpu/GpuResources.h>

namespace kvindex {

/** The KV cache of a model on the GPU, the twin of KVCache for the GPU
 * types: each layer's KV heads in one GpuKVStorage, so that a decode step
 * of a layer is one set of launches for every head (KVCache runs one index
 * per head), answered by the GPU type its factory string names.
 *
 * Strings are KVCache's, "GPU," optional: "Flat", "BF16,Sink4,Window64,TopK(Flat)|k=64".
 * Layouts are KVCache's (head-major, GQA by repeat_interleave): keys
 * [n_kv_heads, n, d], queries [n_q_heads, n, d], outputs [n_q_heads, n,
 * d_value]. attend / prefill / append take host arrays and wait;
 * attend_device takes device arrays and only enqueues, for a decode loop
 * that keeps its tensors on the device.
 */
struct GpuKVCache {
    int n_layers;
    int n_q_heads;
    int n_kv_heads;
    int d;        ///< head dimension of queries and keys
    int d_value;  ///< head dimension of values (= d for the GPU kernels)
    std::string index_string;       ///< factory string of the sparse layers
    std::string dense_string;       ///< factory string of the dense layers
    std::vector<int> dense_layers;  ///< layers built from dense_string
    std::shared_ptr<GpuResources> resources;
    /// size n_layers: the GPU type answering each layer (its knobs; it holds no tokens)
    std::vector<std::unique_ptr<GpuIndexKV>> layer_index;
    /// size n_layers: the keys and values of each layer's n_kv_heads heads
    std::vector<GpuKVStorage> layers;
    RopeParams rope;       ///< fixed by the first prefill
    bool has_rope = false;
    /// size n_layers: the calls running on each layer, for the
    /// thread-safety contract of KVCache (reads alone or together, a write
    /// alone: an append may move the layer's arrays)
    mutable std::vector<AccessCount> layer_calls;
    /// held by prefill, which reads and fixes rope / has_rope for every layer
    OwnMutex rope_mutex;

    /** Throws naming the string when it has no GPU twin (GpuCloner.h), and
     * for shapes the kernels lack (d = d_value in 64, 128, 256).
     * @param resources  nullptr: default_gpu_resources(0) */
    GpuKVCache(int n_layers,
               int n_q_heads,
               int n_kv_heads,
               int d,
               int d_value,
               const std::string& index_string,
               const std::string& dense_string = "Flat",
               const std::vector<int>& dense_layers = {},
               std::shared_ptr<GpuResources> resources = nullptr);

    int group_size() const {
        return n_q_heads / n_kv_heads;
    }
    idx_t n_tokens(int layer) const;

    /** Prefill of one (empty) layer, as KVCache::prefill; the GPU types do
     * not learn from the queries, which are checked and otherwise unused. */
    void prefill(
            int layer,
            idx_t n,
            const float* keys,
            const float* values,
            idx_t n_queries,
            const float* queries,
            const idx_t* positions,
            const RopeParams& rope);

    /// Appends n tokens to every KV head of a layer (KVCache::append).
    void append(int layer, idx_t n, const float* keys, const float* values);

    /** Attention of n queries per query head of one layer, every KV head in
     * one pass (KVCache::attend; host arrays, waits).
     * @param q    size n_q_heads * n * d
     * @param out  size n_q_heads * n * d_value
     * @param lse  size n_q_heads * n, or nullptr */
    void attend(
            int layer,
            idx_t n,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params = nullptr) const;

    /// attend on device arrays (same sizes, lse required), enqueued on
    /// resources->stream() without waiting.
    void attend_device(
            int layer,
            idx_t n,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params = nullptr) const;

    /** The GPU twin of a CPU cache (index_cpu_to_gpu for a whole cache):
     * the same strings, tokens, knobs of its first head per layer, and RoPE.
     * Throws naming the string when a layer's chain has no GPU twin. */
    static std::unique_ptr<GpuKVCache> from_cpu(
            const KVCache& cpu, std::shared_ptr<GpuResources> resources = nullptr);

    /// The CPU KVCache of the same strings, tokens and knobs (for io:
    /// write_cache(*to_cpu()), and for checking against the CPU side).
    std::unique_ptr<KVCache> to_cpu() const;

    /// Bytes of device memory held.
    size_t memory_bytes() const;

   private:
    void check_layer(int layer, const char* what) const;
    /** Checks an attend call's layer, count and parameters; false for n = 0.
     * `params` becomes what the layer's index takes (a knob another layer
     * reads is dropped, as in KVCache::attend; `copy` holds the copy). */
    bool check_attend(
            int layer,
            idx_t n,
            const faiss::SearchParameters*& params,
            std::unique_ptr<SearchParametersKV>& copy) const;
    void check_tokens(idx_t n, const float* keys, const float* values, const char* what) const;
    /// The CPU string of a layer (without "GPU,").
    std::string cpu_string(int layer) const;
};

} // namespace kvindex
