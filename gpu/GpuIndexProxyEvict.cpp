#include <kvindex/gpu/GpuIndexProxyEvict.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/index_factory.h>

#include "decode_attention.h"
#include "device_memory.h"
#include "proxy_scores.h"

namespace kvindex {

namespace {

/// The policy and its prefill-time knobs (not the tokens, k or estimator).
void copy_policy(const IndexProxyEvict& from, IndexProxyEvict* to) {
    to->policy = from.policy;
    to->keep_percent = from.keep_percent;
    to->budget_tokens = from.budget_tokens;
    to->protect_percent = from.protect_percent;
    to->proxy_keep_percent = from.proxy_keep_percent;
    to->proxy_window_percent = from.proxy_window_percent;
    to->proxy_tokens = from.proxy_tokens;
    to->pool = from.pool;
    to->layer_vote = from.layer_vote;
    to->head_budget = from.head_budget;
    to->head_floor_percent = from.head_floor_percent;
    to->n_sink = from.n_sink;
    to->seed = from.seed;
    to->stream = from.stream;
}

/// Sets the RoPE record of an index and its children.
void set_rope(KVIndex* index, const RopeParams& rope, bool has_rope) {
    index->rope = rope;
    index->has_rope = has_rope;
    for (KVIndex* c : index->mutable_children()) {
        set_rope(c, rope, has_rope);
    }
}

/// A token-less IndexProxyEvict over an empty Flat of this shape.
std::unique_ptr<IndexProxyEvict> make_policy(
        EvictPolicy policy, double keep_percent, int d, int d_value, KVType kv_type) {
    return std::make_unique<IndexProxyEvict>(
            policy, keep_percent,
            index_factory(d, std::string(kv_type_prefix(kv_type)) + "Flat", d_value));
}

} // namespace

GpuIndexProxyEvict::GpuIndexProxyEvict(
        std::shared_ptr<GpuResources> resources,
        int d,
        int d_value,
        KVType kv_type,
        EvictPolicy policy,
        double keep_percent)
        : GpuIndexKV(std::move(resources), d, d_value, kv_type, "GpuIndexProxyEvict") {
    policy_ = make_policy(policy, keep_percent, this->d, this->d_value, kv_type);
    k = policy_->k;
}

GpuIndexProxyEvict::GpuIndexProxyEvict() = default;
GpuIndexProxyEvict::~GpuIndexProxyEvict() = default;

IndexProxyEvict& GpuIndexProxyEvict::checked_policy(const char* what) const {
    FAISS_THROW_IF_NOT_FMT(
            policy_, "GpuIndexProxyEvict::%s: no policy (an index made empty for the reader)",
            what);
    return *policy_;
}

const IndexProxyEvict& GpuIndexProxyEvict::policy() const {
    return checked_policy("policy");
}

std::string GpuIndexProxyEvict::cpu_factory_string() const {
    // "ProxyEvict<P>[_Policy]": the inner Flat is implied
    return policy_ ? policy_->factory_string() : std::string("ProxyEvict");
}

size_t GpuIndexProxyEvict::memory_bytes() const {
    return storage.memory_bytes() + positions.capacity() * sizeof(idx_t);
}

idx_t GpuIndexProxyEvict::stored_id(idx_t position) const {
    auto it = std::lower_bound(positions.begin(), positions.end(), position);
    return it != positions.end() && *it == position ? idx_t(it - positions.begin()) : -1;
}

// ---- prefill: scores on the device, the choice on the CPU -----------------

void GpuIndexProxyEvict::prefill_impl(const PrefillInput& in) {
    check_prefill(in);
    const IndexProxyEvict& pol = checked_policy("prefill");
    const GpuResources& res = device();
    DeviceScope scope(res.device());
    cudaStream_t stream = res.stream();

    // choose_kept calls this at most once, with the prompt's keys and the
    // proxy queries it picked (host arrays): the GEMM-sized part runs here
    const ProxyScorer on_device = [&](const float* keys, idx_t n, int dim, const float* queries,
                                      int n_heads, idx_t n_q, const idx_t* q_pos,
                                      idx_t first_pos, bool causal, double* scores) {
        gpu::DeviceScratch keys_d =
                gpu::upload(keys, size_t(n) * dim, stream, "ProxyEvict prefill: keys");
        gpu::DeviceScratch queries_d = gpu::upload(queries, size_t(n_heads) * n_q * dim, stream,
                                                   "ProxyEvict prefill: proxy queries");
        const std::vector<int64_t> pos(q_pos, q_pos + n_q);
        gpu::DeviceScratch pos_d =
                gpu::upload(pos.data(), pos.size(), stream, "ProxyEvict prefill: query positions");
        gpu::DeviceScratch scores_d(size_t(n) * sizeof(float), stream);
        gpu::with_workspace(stream, [&](gpu::Workspace& ws) {
            gpu::proxy_scores(keys_d.as<float>(), n, dim, queries_d.as<float>(), n_heads, n_q,
                              pos_d.as<int64_t>(), first_pos, causal, scores_d.as<float>(), ws,
                              stream);
        });
        std::vector<float> f(static_cast<size_t>(n));
        gpu::download(f.data(), scores_d.get(), f.size(), stream, "ProxyEvict prefill: scores");
        res.synchronize("GpuIndexProxyEvict prefill: scores");
        std::copy(f.begin(), f.end(), scores);
    };
    std::vector<idx_t> kept = pol.choose_kept(in, on_device);

    // only the kept tokens are ever stored
    std::vector<float> k_kept(kept.size() * d), v_kept(kept.size() * d_value);
    for (size_t i = 0; i < kept.size(); i++) {
        std::memcpy(&k_kept[i * d], in.keys + kept[i] * d, sizeof(float) * d);
        std::memcpy(&v_kept[i * d_value], in.values + kept[i] * d_value, sizeof(float) * d_value);
    }
    storage.append(idx_t(kept.size()), k_kept.data(), v_kept.data(), stream);
    positions = std::move(kept);
    ntotal = in.n_tokens;
    rope = in.rope;
    has_rope = true;
}

void GpuIndexProxyEvict::add_kv_impl(idx_t n, const float* keys, const float* values) {
    storage.append(n, keys, values, device().stream()); // generated tokens are never evicted
    for (idx_t i = 0; i < n; i++) {
        positions.push_back(ntotal + i);
    }
}

void GpuIndexProxyEvict::reset_impl() {
    storage.clear();
    positions.clear();
    ntotal = 0;
}

void GpuIndexProxyEvict::reconstruct_impl(idx_t key, float* recons) const {
    const idx_t i = stored_id(key);
    FAISS_THROW_IF_NOT_FMT(i >= 0, "reconstruct: token %zd was evicted", size_t(key));
    std::vector<float> k_row, v_row;
    storage.read(0, i, 1, &k_row, &v_row, device().stream());
    std::copy(k_row.begin(), k_row.end(), recons);
}

void GpuIndexProxyEvict::reconstruct_value_impl(idx_t key, float* value) const {
    const idx_t i = stored_id(key);
    FAISS_THROW_IF_NOT_FMT(i >= 0, "reconstruct_value: token %zd was evicted", size_t(key));
    std::vector<float> k_row, v_row;
    storage.read(0, i, 1, &k_row, &v_row, device().stream());
    std::copy(v_row.begin(), v_row.end(), value);
}

// ---- queries: the kept tokens, ids mapped to positions --------------------

void GpuIndexProxyEvict::attend_heads(
        const GpuKVStorage& kv,
        int rows_per_head,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters*,
        cudaStream_t stream) const {
    DeviceScope scope(kv.device);
    const gpu::KVHeadsView view = gpu::view_of(kv);
    gpu::with_workspace(stream, [&](gpu::Workspace& ws) {
        gpu::dense_attention(view, q, rows_per_head, out, lse, ws, stream);
    });
}

void GpuIndexProxyEvict::select_batch(
        idx_t n,
        const float*,
        Selection* sel,
        const faiss::SearchParameters*) const {
    for (idx_t i = 0; i < n; i++) { // every stored token, as the CPU twin's Flat
        sel[i].clear();
        sel[i].ids = positions;
        sel[i].inclusion.assign(positions.size(), 1.0f);
    }
}

// ---- knobs: the CPU policy's ----------------------------------------------

std::vector<ParameterInfo> GpuIndexProxyEvict::parameter_info() const {
    return checked_policy("parameter_info").parameter_info();
}

bool GpuIndexProxyEvict::set_parameter(const std::string& name, double value) {
    IndexProxyEvict& pol = checked_policy("set_parameter");
    // as set_index_parameter on the CPU chain: the eviction's own knobs,
    // then its Flat's, each checked by the CPU code (neither reads a k)
    bool found = pol.set_parameter(name, value);
    for (KVIndex* child : pol.mutable_children()) {
        found = child->set_parameter(name, value) || found;
    }
    return found;
}

bool GpuIndexProxyEvict::get_parameter(const std::string& name, double* value) const {
    const IndexProxyEvict& pol = checked_policy("get_parameter");
    if (pol.get_parameter(name, value)) {
        return true;
    }
    for (const KVIndex* child : pol.children()) {
        if (child->get_parameter(name, value)) {
            return true;
        }
    }
    return false;
}

void GpuIndexProxyEvict::set_stream(uint64_t s) {
    checked_policy("set_stream").set_stream(s);
}

// ---- the CPU twin -------------------------------------------------------

std::unique_ptr<KVIndex> GpuIndexProxyEvict::to_cpu() const {
    const IndexProxyEvict& pol = checked_policy("to_cpu");
    std::unique_ptr<IndexProxyEvict> cpu =
            make_policy(pol.policy, pol.keep_percent, d, d_value, kv_type);
    copy_policy(pol, cpu.get());
    cpu->k = k;
    cpu->estimator = estimator;
    cpu->inner->k = pol.inner->k;
    cpu->inner->estimator = pol.inner->estimator;
    if (storage.size > 0) {
        std::vector<float> keys, values;
        storage.read(0, 0, storage.size, &keys, &values, device().stream());
        cpu->inner->add_kv(storage.size, keys.data(), values.data());
    }
    cpu->positions = positions;
    cpu->ntotal = ntotal;
    set_rope(cpu.get(), rope, has_rope);
    cpu->check_invariants();
    return cpu;
}

bool GpuIndexProxyEvict::accepts_cpu(const KVIndex& cpu) {
    auto e = dynamic_cast<const IndexProxyEvict*>(&cpu);
    return e && e->inner && std::string(e->inner->type_name()) == "IndexKVFlat";
}

std::unique_ptr<GpuIndexKV> GpuIndexProxyEvict::from_cpu(
        const KVIndex& cpu, std::shared_ptr<GpuResources> resources) {
    FAISS_THROW_IF_NOT_FMT(
            accepts_cpu(cpu),
            "GpuIndexProxyEvict: no twin of %s (an IndexProxyEvict with a Flat inner index)",
            cpu.type_name());
    const auto& e = dynamic_cast<const IndexProxyEvict&>(cpu);
    const KVIndex& inner = *e.inner;
    FAISS_THROW_IF_NOT_FMT(
            idx_t(e.positions.size()) == inner.ntotal,
            "GpuIndexProxyEvict: the CPU index has %zd positions for %zd stored tokens",
            e.positions.size(),
            size_t(inner.ntotal));
    auto gpu = std::make_unique<GpuIndexProxyEvict>(
            std::move(resources), cpu.d, cpu.d_value, cpu.kv_type, e.policy, e.keep_percent);
    IndexProxyEvict& pol = *gpu->policy_;
    copy_policy(e, &pol);
    gpu->k = pol.k = e.k;
    gpu->estimator = pol.estimator = e.estimator;
    pol.inner->k = inner.k;
    pol.inner->estimator = inner.estimator;
    // the kept tokens in chunks, read back as floats (exact: stored values widen)
    constexpr idx_t chunk = 16384;
    std::vector<float> keys, values;
    cudaStream_t stream = gpu->device().stream();
    for (idx_t i0 = 0; i0 < inner.ntotal; i0 += chunk) {
        const idx_t n = std::min(chunk, inner.ntotal - i0);
        keys.resize(size_t(n) * cpu.d);
        values.resize(size_t(n) * cpu.d_value);
        for (idx_t i = 0; i < n; i++) {
            inner.reconstruct(i0 + i, keys.data() + i * cpu.d);
            inner.reconstruct_value(i0 + i, values.data() + i * cpu.d_value);
        }
        gpu->storage.append(n, keys.data(), values.data(), stream);
    }
    gpu->positions = e.positions;
    gpu->ntotal = e.ntotal;
    gpu->rope = cpu.rope;
    gpu->has_rope = cpu.has_rope;
    return gpu;
}

} // namespace kvindex
