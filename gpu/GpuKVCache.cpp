#include <kvindex/gpu/GpuKVCache.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/KVCache.h>
#include <kvindex/gpu/GpuCloner.h>
#include <kvindex/index_factory.h>

#include "checks.h"
#include "device_memory.h"

namespace kvindex {

namespace {

/// s without a "GPU," element after its storage prefix: the CPU chain.
std::string without_gpu(const std::string& s) {
    std::string prefix;
    std::string rest = s;
    for (const char* p : {"BF16,", "FP16,"}) {
        if (rest.rfind(p, 0) == 0) {
            prefix = p;
            rest = rest.substr(prefix.size());
        }
    }
    if (rest.rfind("GPU,", 0) == 0) {
        rest = rest.substr(4);
    }
    return prefix + rest;
}

} // namespace

GpuKVCache::GpuKVCache(
        int n_layers,
        int n_q_heads,
        int n_kv_heads,
        int d,
        int d_value,
        const std::string& index_string,
        const std::string& dense_string,
        const std::vector<int>& dense_layers,
        std::shared_ptr<GpuResources> res)
        : n_layers(n_layers),
          n_q_heads(n_q_heads),
          n_kv_heads(n_kv_heads),
          d(d),
          d_value(d_value),
          index_string(index_string),
          dense_string(dense_string),
          dense_layers(dense_layers),
          resources(std::move(res)),
          // the shape first (before layer_calls is sized by it): a bad one
          // is named even where no device is present
          layer_calls((KVCache::check_shape("GpuKVCache", n_layers, n_q_heads, n_kv_heads, d,
                                            d_value, dense_layers),
                       size_t(n_layers))) {
    register_gpu_index_types();
    if (!resources) {
        resources = default_gpu_resources(0);
    }
    for (int l = 0; l < n_layers; l++) {
        // the layer's GPU type, from the CPU chain's twin: its knobs ("|k=")
        // come with it; it holds no tokens
        std::unique_ptr<KVIndex> cpu = index_factory(d, cpu_string(l), d_value);
        std::unique_ptr<GpuIndexKV> gpu = index_cpu_to_gpu(resources, cpu.get());
        FAISS_THROW_IF_NOT_FMT(
                gpu->shares_layer_storage(),
                "GpuKVCache: '%s' (layer %d) is answered by %s, which keeps per-head state "
                "(buckets, tables or evicted positions): use KVCache with the GPU string, one "
                "index per head",
                cpu_string(l).c_str(),
                l,
                gpu->type_name());
        layers.emplace_back(resources->device(), n_kv_heads, d, gpu->d_value, gpu->kv_type);
        layer_index.push_back(std::move(gpu));
    }
}

std::string GpuKVCache::cpu_string(int layer) const {
    bool dense = std::find(dense_layers.begin(), dense_layers.end(), layer) != dense_layers.end();
    return without_gpu(dense ? dense_string : index_string);
}

void GpuKVCache::check_layer(int layer, const char* what) const {
    FAISS_THROW_IF_NOT_FMT(
            layer >= 0 && layer < n_layers, "%s: layer %d out of [0, %d)", what, layer, n_layers);
}

void GpuKVCache::check_tokens(idx_t n, const float* keys, const float* values, const char* what)
        const {
    FAISS_THROW_IF_NOT_FMT(n >= 0, "%s: n=%zd must be >= 0", what, size_t(n));
    // as KVCache::check_tokens (n = 0 passes)
    check_head_tokens(n, n_kv_heads, d, d_value, keys, values, what);
}

idx_t GpuKVCache::n_tokens(int layer) const {
    check_layer(layer, "GpuKVCache::n_tokens");
    ReadScope calls(layer_calls[layer], "GpuKVCache::n_tokens", "this layer of the cache");
    return layers[layer].size;
}

void GpuKVCache::prefill(
        int layer,
        idx_t n,
        const float* keys,
        const float* values,
        idx_t n_queries,
        const float* queries,
        const idx_t*,
        const RopeParams& r) {
    check_layer(layer, "GpuKVCache::prefill");
    WriteScope calls(layer_calls[layer], "GpuKVCache::prefill", "this layer of the cache");
    // rope and has_rope belong to every layer: prefills of two layers run
    // one after the other here, so that the second sees the first's RoPE
    // (the copy to the device is all they would overlap)
    std::lock_guard<std::mutex> rope_lock(rope_mutex.mutex);
    check_rope_params(r, d);
    FAISS_THROW_IF_NOT_FMT(
            layers[layer].size == 0,
            "GpuKVCache::prefill: layer %d already holds %zd tokens",
            layer,
            size_t(layers[layer].size));
    FAISS_THROW_IF_NOT_FMT(
            !has_rope || (r.theta == rope.theta && r.style == rope.style),
            "GpuKVCache::prefill: layer %d's RoPE (theta %g) differs from the cache's (theta %g)",
            layer,
            r.theta,
            rope.theta);
    check_tokens(n, keys, values, "GpuKVCache::prefill");
    FAISS_THROW_IF_NOT_FMT(
            n_queries >= 0, "GpuKVCache::prefill: n_queries=%zd must be >= 0", size_t(n_queries));
    if (n_queries > 0) {
        check_input_size(n_queries, size_t(n_q_heads) * d, "GpuKVCache::prefill: queries");
        check_not_null(queries, "GpuKVCache::prefill: queries");
        check_input(queries, n_q_heads * n_queries, d, "GpuKVCache::prefill: queries");
    }
    layers[layer].append(n, keys, values, resources->stream());
    rope = r;
    has_rope = true;
}

void GpuKVCache::append(int layer, idx_t n, const float* keys, const float* values) {
    check_layer(layer, "GpuKVCache::append");
    WriteScope calls(layer_calls[layer], "GpuKVCache::append", "this layer of the cache");
    check_tokens(n, keys, values, "GpuKVCache::append");
    layers[layer].append(n, keys, values, resources->stream());
}

bool GpuKVCache::check_attend(
        int layer,
        idx_t n,
        const faiss::SearchParameters*& params,
        std::unique_ptr<SearchParametersKV>& copy) const {
    check_layer(layer, "GpuKVCache::attend");
    FAISS_THROW_IF_NOT_FMT(n >= 0, "GpuKVCache::attend: n=%zd must be >= 0", size_t(n));
    if (n == 0) {
        return false;
    }
    FAISS_THROW_IF_NOT_FMT(
            layers[layer].size > 0, "GpuKVCache::attend: layer %d is empty", layer);
    check_input_size(n, size_t(n_q_heads) * std::max(d, d_value), "GpuKVCache::attend");
    // the layer's index refuses what it would not read (an IDSelector, a
    // Faiss subclass, a knob of no layer), as each head's index does in
    // KVCache; a knob another layer reads is dropped for it
    std::vector<const KVIndex*> peers;
    for (const auto& index : layer_index) {
        peers.push_back(index.get());
    }
    params = KVIndex::params_among(*layer_index[layer], peers, params, copy);
    layer_index[layer]->check_params(params);
    return true;
}

void GpuKVCache::attend_device(
        int layer,
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    check_layer(layer, "GpuKVCache::attend");
    ReadScope calls(layer_calls[layer], "GpuKVCache::attend", "this layer of the cache");
    std::unique_ptr<SearchParametersKV> copy;
    if (!check_attend(layer, n, params, copy)) {
        return;
    }
    FAISS_THROW_IF_NOT_MSG(q && out && lse, "GpuKVCache::attend: an array is missing (nullptr)");
    DeviceScope scope(resources->device());
    layer_index[layer]->attend_heads(
            layers[layer], int(group_size() * n), q, out, lse, params, resources->stream());
}

void GpuKVCache::attend(
        int layer,
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    check_layer(layer, "GpuKVCache::attend");
    ReadScope calls(layer_calls[layer], "GpuKVCache::attend", "this layer of the cache");
    std::unique_ptr<SearchParametersKV> copy;
    if (!check_attend(layer, n, params, copy)) {
        return;
    }
    FAISS_THROW_IF_NOT_MSG(q && out, "GpuKVCache::attend: q or out missing (nullptr)");
    check_input(q, n_q_heads * n, d, "GpuKVCache::attend: queries");
    DeviceScope scope(resources->device());
    cudaStream_t stream = resources->stream();
    const size_t rows = size_t(n_q_heads) * n;
    gpu::DeviceScratch qd = gpu::upload(q, rows * d, stream, "GpuKVCache::attend: queries");
    gpu::DeviceScratch out_d(rows * d_value * sizeof(float), stream);
    gpu::DeviceScratch lse_d(rows * sizeof(float), stream);
    layer_index[layer]->attend_heads(layers[layer], int(group_size() * n), qd.as<float>(),
                                     out_d.as<float>(), lse_d.as<float>(), params, stream);
    gpu::download(out, out_d.get(), rows * d_value, stream, "GpuKVCache::attend: outputs");
    if (lse) {
        gpu::download(lse, lse_d.get(), rows, stream, "GpuKVCache::attend: lse");
    }
    resources->synchronize("GpuKVCache::attend");
}

std::unique_ptr<GpuKVCache> GpuKVCache::from_cpu(
        const KVCache& cpu, std::shared_ptr<GpuResources> resources) {
    auto gpu = std::make_unique<GpuKVCache>(cpu.n_layers, cpu.n_q_heads, cpu.n_kv_heads, cpu.d,
                                            cpu.d_value, cpu.index_string, cpu.dense_string,
                                            cpu.dense_layers, std::move(resources));
    for (int l = 0; l < cpu.n_layers; l++) {
        // the budget of the layer's chain (set per head on the CPU: the first head's)
        const KVIndex* first = cpu.index(l, 0);
        const idx_t budget = first->top_k_budget();
        gpu->layer_index[l]->k = budget > 0 ? budget : first->k;
        const idx_t n = cpu.n_tokens(l);
        if (n == 0) {
            continue;
        }
        std::vector<float> keys(size_t(cpu.n_kv_heads) * n * cpu.d);
        std::vector<float> values(size_t(cpu.n_kv_heads) * n * cpu.d_value);
        for (int h = 0; h < cpu.n_kv_heads; h++) {
            const KVIndex* index = cpu.index(l, h);
            for (idx_t i = 0; i < n; i++) {
                index->reconstruct(i, keys.data() + (size_t(h) * n + i) * cpu.d);
                index->reconstruct_value(i, values.data() + (size_t(h) * n + i) * cpu.d_value);
            }
        }
        gpu->prefill(l, n, keys.data(), values.data(), 0, nullptr, nullptr, cpu.rope);
    }
    gpu->rope = cpu.rope;
    gpu->has_rope = cpu.has_rope;
    return gpu;
}

std::unique_ptr<KVCache> GpuKVCache::to_cpu() const {
    auto cpu = std::make_unique<KVCache>(n_layers, n_q_heads, n_kv_heads, d, d_value,
                                         without_gpu(index_string), without_gpu(dense_string),
                                         dense_layers);
    for (int l = 0; l < n_layers; l++) {
        for (int h = 0; h < n_kv_heads; h++) {
            layer_index[l]->copy_knobs_to(cpu->index(l, h));
        }
        ReadScope calls(layer_calls[l], "GpuKVCache::to_cpu", "this layer of the cache");
        const idx_t n = layers[l].size;
        if (n == 0) {
            continue;
        }
        std::vector<float> keys(size_t(n_kv_heads) * n * d), values(size_t(n_kv_heads) * n * d_value);
        std::vector<float> k, v;
        for (int h = 0; h < n_kv_heads; h++) {
            layers[l].read(h, 0, n, &k, &v, resources->stream());
            std::copy(k.begin(), k.end(), keys.begin() + size_t(h) * n * d);
            std::copy(v.begin(), v.end(), values.begin() + size_t(h) * n * d_value);
        }
        if (has_rope) {
            cpu->prefill(l, n, keys.data(), values.data(), 0, nullptr, nullptr, rope);
        } else {
            cpu->append(l, n, keys.data(), values.data());
        }
    }
    return cpu;
}

size_t GpuKVCache::memory_bytes() const {
    size_t b = 0;
    for (const GpuKVStorage& s : layers) {
        b += s.memory_bytes();
    }
    return b;
}

} // namespace kvindex
