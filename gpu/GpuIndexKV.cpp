#include <kvindex/gpu/GpuIndexKV.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/index_factory.h>
#include <kvindex/parameters.h>

#include "decode_attention.h"
#include "device_memory.h"

namespace kvindex {

namespace {

/// Scores of one device batch of top-k ([rows][ntotal] floats) stay under this.
constexpr idx_t kMaxBatchScores = idx_t(64) << 20;
/// Query rows of one device batch.
constexpr idx_t kMaxBatchRows = 4096;

/// Sets the RoPE record of every index of a chain.
void set_rope(KVIndex* index, const RopeParams& rope, bool has_rope) {
    index->rope = rope;
    index->has_rope = has_rope;
    for (KVIndex* c : index->mutable_children()) {
        set_rope(c, rope, has_rope);
    }
}

} // namespace

GpuIndexKV::GpuIndexKV(
        std::shared_ptr<GpuResources> res,
        int d,
        int d_value,
        KVType kv_type,
        const char* type_for_errors)
        : KVIndex(d, d_value, kv_type), resources(std::move(res)) {
    FAISS_THROW_IF_NOT_FMT(resources, "%s: resources are nullptr", type_for_errors);
    FAISS_THROW_IF_NOT_FMT(
            gpu::supported_head_dim(d) && this->d_value == d,
            "%s: head dimensions d=%d, d_value=%d have no GPU kernel (d = d_value in 64, 128, 256)",
            type_for_errors,
            d,
            this->d_value);
    storage = GpuKVStorage(resources->device(), 1, d, this->d_value, kv_type);
}

GpuIndexKV::GpuIndexKV() = default;

size_t GpuIndexKV::memory_bytes() const {
    return storage.memory_bytes();
}

std::string GpuIndexKV::factory_string() const {
    return "GPU," + cpu_factory_string();
}

const GpuResources& GpuIndexKV::device() const {
    FAISS_THROW_IF_NOT_FMT(
            resources, "%s: no GPU resources (an index made empty for the reader)", type_name());
    return *resources;
}

idx_t GpuIndexKV::rows_per_batch(idx_t n) const {
    idx_t by_scores = kMaxBatchScores / std::max<idx_t>(ntotal, 1);
    return std::max<idx_t>(1, std::min({n, by_scores, kMaxBatchRows}));
}

void GpuIndexKV::copy_knobs_to(KVIndex* cpu) const {
    cpu->k = k; // kept by io even where nothing reads it
    if (cpu->reads_search_knob("k")) {
        set_index_parameter(cpu, "k", double(k)); // the whole chain's
    }
}

std::unique_ptr<KVIndex> GpuIndexKV::to_cpu() const {
    std::unique_ptr<KVIndex> cpu =
            index_factory(d, std::string(kv_type_prefix(kv_type)) + cpu_factory_string(), d_value);
    copy_knobs_to(cpu.get());
    cpu->estimator = estimator;
    if (ntotal > 0) {
        std::vector<float> keys, values;
        storage.read(0, 0, ntotal, &keys, &values, device().stream());
        cpu->add_kv(ntotal, keys.data(), values.data());
    }
    set_rope(cpu.get(), rope, has_rope);
    return cpu;
}

void GpuIndexKV::load_from(const KVIndex& cpu) {
    FAISS_THROW_IF_NOT_FMT(
            cpu.d == d && cpu.d_value == d_value && cpu.kv_type == kv_type,
            "%s: the CPU index (d=%d, d_value=%d, %s) differs from this one (d=%d, d_value=%d, %s)",
            type_name(),
            cpu.d,
            cpu.d_value,
            kv_type_name(cpu.kv_type),
            d,
            d_value,
            kv_type_name(kv_type));
    FAISS_THROW_IF_NOT_FMT(ntotal == 0, "%s::load_from: the index is not empty", type_name());
    // tokens in chunks, read back as floats (exact: the stored values widen)
    constexpr idx_t chunk = 16384;
    std::vector<float> keys, values;
    for (idx_t i0 = 0; i0 < cpu.ntotal; i0 += chunk) {
        const idx_t n = std::min(chunk, cpu.ntotal - i0);
        keys.resize(size_t(n) * d);
        values.resize(size_t(n) * d_value);
        for (idx_t i = 0; i < n; i++) {
            cpu.reconstruct(i0 + i, keys.data() + i * d);
            cpu.reconstruct_value(i0 + i, values.data() + i * d_value);
        }
        add_kv(n, keys.data(), values.data());
    }
    // the budget the chain uses is its top-k index's (a wrapper's own k is unused)
    const idx_t budget = cpu.top_k_budget();
    k = budget > 0 ? budget : cpu.k;
    estimator = cpu.estimator;
    rope = cpu.rope;
    has_rope = cpu.has_rope;
}

void GpuIndexKV::write_fields(BufferWriter&) const {
    FAISS_THROW_FMT("%s: io writes the CPU twin's record (io_twin), never this one", type_name());
}

void GpuIndexKV::read_fields(BufferReader&, uint32_t) {
    FAISS_THROW_FMT(
            "read_index: a %s record: GPU indexes are written as their CPU twin, so the file "
            "is forged or corrupt",
            type_name());
}

void GpuIndexKV::add_kv_impl(idx_t n, const float* keys, const float* values) {
    storage.append(n, keys, values, device().stream());
}

void GpuIndexKV::reset_impl() {
    storage.clear();
    ntotal = 0; // reset_impl's contract (KVIndex::reset does not clear it)
}

void GpuIndexKV::reconstruct_impl(idx_t key, float* recons) const {
    std::vector<float> k, v;
    storage.read(0, key, 1, &k, &v, device().stream());
    std::copy(k.begin(), k.end(), recons);
}

void GpuIndexKV::reconstruct_value_impl(idx_t key, float* value) const {
    std::vector<float> k, v;
    storage.read(0, key, 1, &k, &v, device().stream());
    std::copy(v.begin(), v.end(), value);
}

void GpuIndexKV::search_batch(
        idx_t n,
        const float* q,
        idx_t k_search,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters*) const {
    const GpuResources& res = device();
    DeviceScope scope(res.device());
    cudaStream_t stream = res.stream();
    const idx_t n_rows = storage.size; // ntotal, or fewer for eviction
    const idx_t kk = std::min(k_search, n_rows);
    const gpu::KVHeadsView view = gpu::view_of(storage);
    const idx_t batch = rows_per_batch(n);
    std::vector<int32_t> ids;
    std::vector<float> scores;
    std::vector<idx_t> order(kk);
    for (idx_t i0 = 0; i0 < n; i0 += batch) {
        const idx_t nb = std::min(batch, n - i0);
        if (kk > 0) {
            gpu::DeviceScratch qd =
                    gpu::upload(q + i0 * d, size_t(nb) * d, stream, "search: queries");
            gpu::DeviceScratch ids_d(size_t(nb) * kk * sizeof(int32_t), stream);
            gpu::DeviceScratch scores_d(size_t(nb) * kk * sizeof(float), stream);
            gpu::with_workspace(stream, [&](gpu::Workspace& ws) {
                gpu::topk_select(view, qd.as<float>(), int(nb), 0, n_rows, kk,
                                 ids_d.as<int32_t>(), scores_d.as<float>(), ws, stream);
            });
            ids.resize(size_t(nb) * kk);
            scores.resize(size_t(nb) * kk);
            gpu::download(ids.data(), ids_d.get(), ids.size(), stream, "search: ids");
            gpu::download(scores.data(), scores_d.get(), scores.size(), stream, "search: scores");
            res.synchronize("search");
        }
        // the device selects in row order; search answers by decreasing
        // score, ties by smaller row (= smaller label: rows and labels
        // increase together), as the CPU indexes
        for (idx_t i = 0; i < nb; i++) {
            const int32_t* row_ids = ids.data() + i * kk;
            const float* row_scores = scores.data() + i * kk;
            std::iota(order.begin(), order.end(), idx_t(0));
            std::sort(order.begin(), order.end(), [&](idx_t a, idx_t b) {
                return row_scores[a] > row_scores[b] ||
                        (row_scores[a] == row_scores[b] && row_ids[a] < row_ids[b]);
            });
            float* dis = distances + (i0 + i) * k_search;
            idx_t* lab = labels + (i0 + i) * k_search;
            for (idx_t j = 0; j < k_search; j++) {
                if (j < kk) {
                    dis[j] = row_scores[order[j]];
                    lab[j] = label_of_row(row_ids[order[j]]);
                } else { // padding as Faiss does for inner product
                    dis[j] = std::numeric_limits<float>::lowest();
                    lab[j] = -1;
                }
            }
        }
    }
}

void GpuIndexKV::search_among(
        idx_t n,
        const float* q,
        const Selection* sel,
        idx_t k_search,
        float* distances,
        idx_t* labels,
        const std::vector<idx_t>* row_of_token) const {
    const GpuResources& res = device();
    DeviceScope scope(res.device());
    cudaStream_t stream = res.stream();
    constexpr idx_t kBatch = 1024; // queries scored at once
    std::vector<size_t> order;
    for (idx_t i0 = 0; i0 < n; i0 += kBatch) {
        const idx_t nb = std::min(kBatch, n - i0);
        size_t stride = 1;
        for (idx_t i = 0; i < nb; i++) {
            stride = std::max(stride, sel[i0 + i].size());
        }
        // one list of storage rows per query, scored by gpu::list_scores
        std::vector<int32_t> ids(size_t(nb) * stride, 0), lens(nb);
        for (idx_t i = 0; i < nb; i++) {
            const Selection& s = sel[i0 + i];
            lens[i] = int32_t(s.size());
            for (size_t j = 0; j < s.size(); j++) {
                ids[i * stride + j] =
                        int32_t(row_of_token ? (*row_of_token)[s.ids[j]] : s.ids[j]);
            }
        }
        gpu::DeviceScratch qd = gpu::upload(q + i0 * d, size_t(nb) * d, stream, "search: queries");
        gpu::DeviceScratch idd = gpu::upload(ids.data(), ids.size(), stream, "search: ids");
        gpu::DeviceScratch lend = gpu::upload(lens.data(), lens.size(), stream, "search: ids");
        gpu::DeviceScratch sd(ids.size() * sizeof(float), stream);
        gpu::TokenLists lists;
        lists.ids = idd.as<int32_t>();
        lists.lens = lend.as<int32_t>();
        lists.stride = idx_t(stride);
        lists.max_len = idx_t(stride);
        lists.per_row = true;
        gpu::list_scores(gpu::view_of(storage), qd.as<float>(), int(nb), lists, sd.as<float>(),
                         stream);
        std::vector<float> scores(ids.size());
        gpu::download(scores.data(), sd.get(), scores.size(), stream, "search: scores");
        res.synchronize("search");
        for (idx_t i = 0; i < nb; i++) {
            const Selection& s = sel[i0 + i];
            const float* sc = scores.data() + i * stride;
            order.resize(s.size());
            std::iota(order.begin(), order.end(), size_t(0));
            const size_t kk = std::min(size_t(k_search), s.size());
            std::partial_sort(order.begin(), order.begin() + kk, order.end(),
                              [&](size_t a, size_t b) {
                                  return sc[a] > sc[b] || (sc[a] == sc[b] && s.ids[a] < s.ids[b]);
                              });
            float* dis = distances + (i0 + i) * k_search;
            idx_t* lab = labels + (i0 + i) * k_search;
            for (idx_t j = 0; j < k_search; j++) {
                const bool has = size_t(j) < kk;
                dis[j] = has ? sc[order[j]] : std::numeric_limits<float>::lowest();
                lab[j] = has ? s.ids[order[j]] : -1;
            }
        }
    }
}

void GpuIndexKV::attend_batch(
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    const GpuResources& res = device();
    DeviceScope scope(res.device());
    cudaStream_t stream = res.stream();
    const idx_t batch = rows_per_batch(n);
    for (idx_t i0 = 0; i0 < n; i0 += batch) {
        const idx_t nb = std::min(batch, n - i0);
        gpu::DeviceScratch qd = gpu::upload(q + i0 * d, size_t(nb) * d, stream, "attend: queries");
        gpu::DeviceScratch out_d(size_t(nb) * d_value * sizeof(float), stream);
        gpu::DeviceScratch lse_d(size_t(nb) * sizeof(float), stream);
        attend_heads(storage, int(nb), qd.as<float>(), out_d.as<float>(), lse_d.as<float>(),
                     params, stream);
        gpu::download(out + i0 * d_value, out_d.get(), size_t(nb) * d_value, stream,
                      "attend: outputs");
        gpu::download(lse + i0, lse_d.get(), size_t(nb), stream, "attend: lse");
        res.synchronize("attend");
    }
}

} // namespace kvindex
