#include <kvindex/gpu/GpuIndexLSHSample.h>

#include <algorithm>
#include <numeric>
#include <type_traits>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/IndexSinkWindow.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>

#include "device_memory.h"
#include "lsh_sample.h"
#include "twin_chain.h"

namespace kvindex {

namespace {

/// The IndexLSHSample of "LSHSample<K>x<L>" or "Sink<n>,Window<m>,LSHSample<K>x<L>".
const IndexLSHSample* lsh_of(const KVIndex& cpu, idx_t* n_sink, idx_t* n_window) {
    return static_chain_inner<IndexLSHSample>(cpu, n_sink, n_window);
}

/// Throws unless the twin's knobs can run on the device.
void check_twin(const IndexLSHSample& s) {
    FAISS_THROW_IF_NOT_FMT(
            s.max_sample == 0,
            "GpuIndexLSHSample: max_sample=%zd is not supported on the GPU (a capped sample is "
            "ranked by score, which the device path does not do): set it to 0",
            size_t(s.max_sample));
}

} // namespace

/** The device mirror of the twin's sampler: what a decode step reads
 * beside the tokens. Counters record the twin's state at the last upload,
 * so that sync_device uploads only what changed. */
struct GpuIndexLSHSample::Device {
    int device = 0;
    DeviceArray planes;          ///< K * L * d float32
    DeviceArray mean;            ///< d float32, valid when has_mean
    bool has_mean = false;
    DeviceArray norms;           ///< norms_bytes: |k_i - mean| of inner tokens [0, n_norms)
    size_t norms_bytes = 0;
    idx_t n_norms = 0;
    DeviceArray offsets;         ///< L * (2^K + 1) uint32 bucket starts, main level
    DeviceArray ids;             ///< ids_bytes: L * n_indexed int32, main level
    size_t ids_bytes = 0;
    idx_t n_indexed = -1;        ///< the twin's n_indexed at the upload (-1: none)
    DeviceArray recent_offsets;  ///< L * (2^K + 1) uint32, recent level
    DeviceArray recent_ids;      ///< recent_bytes: L * (n_recent - n_indexed) int32
    size_t recent_bytes = 0;
    idx_t n_recent = -1;         ///< the twin's n_recent at the upload (-1: none)
    DeviceArray tail_codes;      ///< tail_bytes: n_tail * L uint16, inner tokens tail_begin ..
    size_t tail_bytes = 0;
    idx_t tail_begin = -1;
    idx_t n_tail = 0;

    explicit Device(int device) : device(device) {}

    /// Forgets every token (planes stay): the next sync uploads anew.
    void clear() {
        has_mean = false;
        n_norms = 0;
        n_indexed = -1;
        n_recent = -1;
        tail_begin = -1;
        n_tail = 0;
    }

    size_t bytes(const IndexLSHSample& s) const {
        const size_t table = size_t(s.L) * ((size_t(1) << s.K) + 1) * sizeof(uint32_t);
        return size_t(s.K) * s.L * s.d * sizeof(float) + size_t(s.d) * sizeof(float) +
                norms_bytes + (offsets ? table : 0) + ids_bytes + (recent_offsets ? table : 0) +
                recent_bytes + tail_bytes;
    }

    void upload_planes(const IndexLSHSample& s, cudaStream_t stream) {
        const size_t bytes = s.planes.size() * sizeof(float);
        if (!planes) {
            planes = gpu::device_alloc(device, bytes, "GpuIndexLSHSample: hyperplanes");
        }
        gpu::upload_bytes(planes.get(), s.planes.data(), bytes, stream,
                          "GpuIndexLSHSample: hyperplanes");
        gpu::check_cuda(cudaStreamSynchronize(stream), "GpuIndexLSHSample: hyperplanes");
    }

    /// Uploads what changed in `s` since the last call (the header's protocol).
    void sync(const IndexLSHSample& s, cudaStream_t stream) {
        const idx_t n = s.ntotal;
        if (n == 0) {
            clear();
            return;
        }
        const int L = s.L;
        const size_t table_bytes = size_t(L) * ((size_t(1) << s.K) + 1) * sizeof(uint32_t);
        if (!has_mean) { // fixed at the first add, never changes after
            if (!mean) {
                mean = gpu::device_alloc(device, size_t(s.d) * sizeof(float),
                                         "GpuIndexLSHSample: mean");
            }
            gpu::upload_bytes(mean.get(), s.mean.data(), size_t(s.d) * sizeof(float), stream,
                              "GpuIndexLSHSample: mean");
            has_mean = true;
        }
        if (n > n_norms) { // norms only grow: append
            gpu::grow(norms, norms_bytes, size_t(n_norms) * sizeof(float),
                      size_t(n) * sizeof(float), device, stream, "GpuIndexLSHSample: norms");
            gpu::upload_bytes(static_cast<float*>(norms.get()) + n_norms, s.norms.data() + n_norms,
                              size_t(n - n_norms) * sizeof(float), stream,
                              "GpuIndexLSHSample: norms");
            n_norms = n;
        }
        if (s.n_indexed != n_indexed) { // the main level was rebuilt
            // the CPU tables' gaps decoded to plain ids, which the kernels
            // walk in parallel; the uploads complete before the vectors die
            std::vector<uint32_t> plain_offsets;
            std::vector<int32_t> plain_ids;
            s.plain_tables(plain_offsets, plain_ids);
            if (!offsets) {
                offsets =
                        gpu::device_alloc(device, table_bytes, "GpuIndexLSHSample: bucket offsets");
            }
            gpu::upload_bytes(offsets.get(), plain_offsets.data(), table_bytes, stream,
                              "GpuIndexLSHSample: bucket offsets");
            const size_t count = plain_ids.size();
            gpu::grow(ids, ids_bytes, 0, count * sizeof(int32_t), device, stream,
                      "GpuIndexLSHSample: table ids");
            gpu::upload_bytes(ids.get(), plain_ids.data(), count * sizeof(int32_t), stream,
                              "GpuIndexLSHSample: table ids");
            gpu::check_cuda(cudaStreamSynchronize(stream), "GpuIndexLSHSample: table ids");
            n_indexed = s.n_indexed;
            n_recent = -1; // the recent level was cleared with it
        }
        if (s.n_recent != n_recent) {
            const idx_t n_rec = s.n_recent - s.n_indexed;
            if (n_rec > 0) {
                if (!recent_offsets) {
                    recent_offsets = gpu::device_alloc(device, table_bytes,
                                                       "GpuIndexLSHSample: recent offsets");
                }
                gpu::upload_bytes(recent_offsets.get(), s.recent_offsets.data(), table_bytes,
                                  stream, "GpuIndexLSHSample: recent offsets");
                const size_t count = size_t(L) * n_rec;
                gpu::grow(recent_ids, recent_bytes, 0, count * sizeof(int32_t), device, stream,
                          "GpuIndexLSHSample: recent ids");
                gpu::upload_bytes(recent_ids.get(), s.recent_ids.data(), count * sizeof(int32_t),
                                  stream, "GpuIndexLSHSample: recent ids");
            }
            n_recent = s.n_recent;
        }
        // the tail: tokens in neither level; a rebuild of either level moves
        // its start, which uploads it anew, else its new codes are appended
        const idx_t begin = std::max(s.n_recent, s.n_indexed), count = n - begin;
        if (begin != tail_begin) {
            tail_begin = begin;
            n_tail = 0;
        }
        FAISS_THROW_IF_NOT_FMT(count >= n_tail, "GpuIndexLSHSample: the tail shrank (%zd < %zd)",
                               size_t(count), size_t(n_tail));
        if (count > n_tail) {
            const size_t row = size_t(L) * sizeof(uint16_t);
            gpu::grow(tail_codes, tail_bytes, size_t(n_tail) * row, size_t(count) * row, device,
                      stream, "GpuIndexLSHSample: tail codes");
            gpu::upload_bytes(static_cast<uint16_t*>(tail_codes.get()) + size_t(n_tail) * L,
                              s.tail_codes(begin + n_tail),
                              size_t(count - n_tail) * row, stream,
                              "GpuIndexLSHSample: tail codes");
            n_tail = count;
        }
        gpu::check_cuda(cudaStreamSynchronize(stream), "GpuIndexLSHSample: uploading the tables");
    }

    /// The kernels' view of the mirror (one head); the static part's sink
    /// precedes the inner tokens.
    gpu::LSHTables tables(const IndexLSHSample& s, idx_t n_sink) const {
        gpu::LSHTables t;
        t.K = s.K;
        t.L = s.L;
        t.planes = static_cast<const float*>(planes.get());
        t.mean = static_cast<const float*>(mean.get());
        t.norms = static_cast<const float*>(norms.get());
        t.n_inner = s.ntotal;
        t.first_inner = s.ntotal > 0 ? n_sink : 0;
        if (s.ntotal > 0) {
            t.main.offsets = static_cast<const uint32_t*>(offsets.get());
            t.main.ids = static_cast<const int32_t*>(ids.get());
            t.main.n_per_table = n_indexed;
            if (n_recent > n_indexed) {
                t.recent.offsets = static_cast<const uint32_t*>(recent_offsets.get());
                t.recent.ids = static_cast<const int32_t*>(recent_ids.get());
                t.recent.n_per_table = n_recent - n_indexed;
            }
            t.tail_codes = static_cast<const uint16_t*>(tail_codes.get());
        }
        return t;
    }
};

GpuIndexLSHSample::GpuIndexLSHSample() = default;
GpuIndexLSHSample::~GpuIndexLSHSample() = default;

GpuIndexLSHSample::GpuIndexLSHSample(
        std::shared_ptr<GpuResources> res,
        int d,
        const std::string& cpu_chain,
        KVType kv_type)
        : GpuIndexHostTwin(std::move(res), d, d, kv_type, "GpuIndexLSHSample") {
    host = index_factory(d, std::string(kv_type_prefix(kv_type)) + cpu_chain, d);
    const IndexLSHSample* s = lsh_of(*host, &n_sink, &n_window);
    FAISS_THROW_IF_NOT_FMT(
            s, "GpuIndexLSHSample: '%s' is not [Sink<n>,][Window<m>,]LSHSample<K>x<L>",
            cpu_chain.c_str());
    check_twin(*s);
    k = host->k;
    dev_ = std::make_unique<Device>(resources->device());
    DeviceScope scope(resources->device());
    dev_->upload_planes(*s, resources->stream());
}

const IndexLSHSample& GpuIndexLSHSample::lsh() const {
    idx_t s, w;
    return *lsh_of(twin(), &s, &w);
}

size_t GpuIndexLSHSample::memory_bytes() const {
    size_t b = storage.memory_bytes();
    if (host) {
        b += host->memory_bytes() + (dev_ ? dev_->bytes(lsh()) : 0);
    }
    return b;
}

void GpuIndexLSHSample::set_seed(uint64_t seed) {
    WriteScope scope(*this, "set_seed");
    FAISS_THROW_IF_NOT_FMT(
            ntotal == 0, "GpuIndexLSHSample: the hyperplanes can change only on an empty index "
            "(it holds %zd tokens)", size_t(ntotal));
    const_cast<IndexLSHSample&>(lsh()).set_seed(seed);
    DeviceScope dev_scope(device().device());
    dev_->upload_planes(lsh(), device().stream());
}

void GpuIndexLSHSample::check_device_knob(const std::string& name, double value) const {
    FAISS_THROW_IF_NOT_FMT(
            name != "max_sample" || value == 0,
            "GpuIndexLSHSample: max_sample=%g is not supported on the GPU (a capped sample is "
            "ranked by score, which the device path does not do): keep 0",
            value);
}

int GpuIndexLSHSample::hits_for(const faiss::SearchParameters* params) const {
    const IndexLSHSample& s = lsh();
    auto p = dynamic_cast<const SearchParametersLSH*>(params);
    const int hits = p && p->min_hits >= 0 ? p->min_hits : s.min_hits;
    const idx_t cap = p && p->max_sample >= 0 ? p->max_sample : s.max_sample;
    FAISS_THROW_IF_NOT_FMT(
            cap == 0,
            "GpuIndexLSHSample: max_sample=%zd is not supported on the GPU (a capped sample is "
            "ranked by score, which the device path does not do): use 0",
            size_t(cap));
    FAISS_THROW_IF_NOT_FMT(
            hits <= s.L, "GpuIndexLSHSample: min_hits=%d exceeds the %d tables", hits, s.L);
    return hits;
}

// ---- writes: the twin first builds, then the device mirrors ------------------------

void GpuIndexLSHSample::sync_device() {
    DeviceScope scope(device().device());
    dev_->sync(lsh(), device().stream());
}

void GpuIndexLSHSample::prefill_impl(const PrefillInput& input) {
    check_prefill(input);
    const idx_t before = storage.size;
    storage.append(input.n_tokens, input.keys, input.values, device().stream());
    try {
        host->prefill(input); // codes, norms, mean and tables, by the CPU code
    } catch (...) {
        storage.size = before; // the rows past it are unused
        throw;
    }
    ntotal = host->ntotal;
    rope = input.rope;
    has_rope = true;
    sync_device();
}

void GpuIndexLSHSample::add_kv_impl(idx_t n, const float* keys, const float* values) {
    const idx_t before = storage.size;
    storage.append(n, keys, values, device().stream());
    try {
        host->add_kv(n, keys, values);
    } catch (...) {
        storage.size = before;
        throw;
    }
    // KVIndex::add_kv counts ntotal after this returns
    sync_device();
}

void GpuIndexLSHSample::reset_impl() {
    host->reset();
    storage.clear();
    ntotal = 0;
    dev_->clear();
}

// ---- reads: sample on the device, finish on the host --------------------------------

void GpuIndexLSHSample::attend_heads(
        const GpuKVStorage& kv,
        int rows_per_head,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params,
        cudaStream_t stream) const {
    // the tables describe this index's tokens: another storage (a
    // GpuKVCache layer) has other keys
    FAISS_THROW_IF_NOT_MSG(
            kv.keys.get() == storage.keys.get() && kv.size == storage.size && kv.n_heads == 1,
            "GpuIndexLSHSample: attend_heads reads the index's own storage (its hash tables are "
            "per head; GpuKVCache refuses the type)");
    const int hits = hits_for(params);
    DeviceScope scope(kv.device);
    const gpu::KVHeadsView view = gpu::view_of(kv);
    const gpu::LSHTables t = dev_->tables(lsh(), n_sink);
    gpu::with_workspace(stream, [&](gpu::Workspace& ws) {
        gpu::lsh_attention(view, q, rows_per_head, n_sink, n_window, t, hits, out, lse, ws,
                           stream);
    });
}

void GpuIndexLSHSample::sample_rows(
        idx_t n,
        const float* q,
        int hits,
        std::vector<std::vector<int32_t>>* ids,
        std::vector<std::vector<float>>* inclusion) const {
    const GpuResources& res = device();
    DeviceScope scope(res.device());
    cudaStream_t stream = res.stream();
    const gpu::KVHeadsView view = gpu::view_of(storage);
    const gpu::LSHTables t = dev_->tables(lsh(), n_sink);
    const idx_t n_inner = t.n_inner;
    ids->assign(n, {});
    if (inclusion) {
        inclusion->assign(n, {});
    }
    const idx_t batch = rows_per_batch(n);
    std::vector<int32_t> lens, id_rows;
    std::vector<float> u_rows;
    for (idx_t i0 = 0; i0 < n; i0 += batch) {
        const idx_t nb = std::min(batch, n - i0);
        gpu::DeviceScratch qd = gpu::upload(q + i0 * d, size_t(nb) * d, stream, "select: queries");
        gpu::DeviceScratch ids_d(size_t(nb) * n_inner * sizeof(int32_t), stream);
        gpu::DeviceScratch lens_d(size_t(nb) * sizeof(int32_t), stream);
        gpu::DeviceScratch u_d(inclusion ? size_t(nb) * n_inner * sizeof(float) : 0, stream);
        gpu::with_workspace(stream, [&](gpu::Workspace& ws) {
            gpu::lsh_select(view, qd.as<float>(), int(nb), t, hits, ids_d.as<int32_t>(),
                            lens_d.as<int32_t>(), nullptr, u_d.as<float>(), ws,
                            stream);
        });
        lens.resize(nb);
        gpu::download(lens.data(), lens_d.get(), size_t(nb), stream, "select: sample sizes");
        res.synchronize("select: sampling");
        const idx_t width = nb > 0 ? *std::max_element(lens.begin(), lens.end()) : 0;
        FAISS_THROW_IF_NOT_FMT(width <= n_inner, "GpuIndexLSHSample: a sample of %zd tokens "
                               "out of %zd", size_t(width), size_t(n_inner));
        // the used prefix of every row in one strided copy
        auto fetch = [&](auto& host_rows, const gpu::DeviceScratch& dev, const char* what) {
            using T = typename std::decay_t<decltype(host_rows)>::value_type;
            host_rows.resize(size_t(nb) * width);
            if (width > 0) {
                gpu::check_cuda(cudaMemcpy2DAsync(host_rows.data(), width * sizeof(T), dev.get(),
                                                  n_inner * sizeof(T), width * sizeof(T), nb,
                                                  cudaMemcpyDeviceToHost, stream),
                                what);
            }
        };
        fetch(id_rows, ids_d, "select: sampled ids");
        if (inclusion) {
            fetch(u_rows, u_d, "select: inclusion probabilities");
        }
        res.synchronize("select: downloading the sample");
        // the device appends in the order of its atomics: ids ascending here
        std::vector<idx_t> order;
        for (idx_t i = 0; i < nb; i++) {
            const size_t len = size_t(lens[i]), base = size_t(i) * width;
            order.resize(len);
            std::iota(order.begin(), order.end(), idx_t(0));
            std::sort(order.begin(), order.end(), [&](idx_t a, idx_t b) {
                return id_rows[base + a] < id_rows[base + b];
            });
            std::vector<int32_t>& out_ids = (*ids)[i0 + i];
            out_ids.resize(len);
            for (size_t j = 0; j < len; j++) {
                out_ids[j] = id_rows[base + order[j]];
            }
            if (inclusion) {
                std::vector<float>& u = (*inclusion)[i0 + i];
                u.resize(len);
                for (size_t j = 0; j < len; j++) {
                    u[j] = u_rows[base + order[j]];
                }
            }
        }
    }
}

void GpuIndexLSHSample::select_batch(
        idx_t n,
        const float* q,
        Selection* sel,
        const faiss::SearchParameters* params) const {
    const int hits = hits_for(params);
    const IndexLSHSample& s = lsh();
    const idx_t n_inner = s.ntotal;
    const idx_t sink = std::min(n_sink, ntotal);
    const idx_t window_start = sink + n_inner;
    if (hits == 0 || n_inner == 0) { // every token, u = 1, nothing hashed
        for (idx_t i = 0; i < n; i++) {
            sel[i].set_all(ntotal);
        }
        return;
    }
    std::vector<std::vector<int32_t>> ids;
    std::vector<std::vector<float>> u;
    sample_rows(n, q, hits, &ids, &u);
    for (idx_t i = 0; i < n; i++) {
        Selection& out = sel[i];
        out.clear();
        for (idx_t t = 0; t < sink; t++) {
            out.push_back(t);
        }
        for (size_t j = 0; j < ids[i].size(); j++) {
            out.push_back(ids[i][j], u[i][j]);
        }
        for (idx_t t = window_start; t < ntotal; t++) {
            out.push_back(t);
        }
        // what the device read besides the sample's rows, counted as the
        // CPU counts it: the same tables, the query's codes hashed again
        std::vector<uint16_t> qc(size_t(s.L));
        s.hash(q + i * d, nullptr, qc.data());
        out.n_scanned = s.sample_reads(qc.data(), ids[i].size());
    }
}

void GpuIndexLSHSample::search_batch(
        idx_t n,
        const float* q,
        idx_t k_search,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters* params) const {
    if (hits_for(params) == 0 || lsh().ntotal == 0) {
        // every token is selected: the exact top-k over all of them
        GpuIndexKV::search_batch(n, q, k_search, distances, labels, params);
        return;
    }
    // the CPU chain's answer: the exact top-k of the sample and the static
    // tokens (its select), scored on the device
    std::vector<Selection> sel(n);
    select_batch(n, q, sel.data(), params);
    search_among(n, q, sel.data(), k_search, distances, labels, nullptr);
}

// ---- conversion --------------------------------------------------------------------

bool GpuIndexLSHSample::accepts_cpu(const KVIndex& cpu) {
    idx_t s, w;
    return lsh_of(cpu, &s, &w) != nullptr;
}

std::unique_ptr<GpuIndexKV> GpuIndexLSHSample::from_cpu(
        const KVIndex& cpu, std::shared_ptr<GpuResources> resources) {
    idx_t s, w;
    const IndexLSHSample* sampler = lsh_of(cpu, &s, &w);
    FAISS_THROW_IF_NOT_FMT(sampler, "GpuIndexLSHSample: no twin of %s", cpu.type_name());
    check_twin(*sampler);
    FAISS_THROW_IF_NOT_FMT(
            cpu.d_value == cpu.d, "GpuIndexLSHSample: d_value=%d must equal d=%d", cpu.d_value,
            cpu.d);
    auto gpu = std::make_unique<GpuIndexLSHSample>(std::move(resources), cpu.d,
                                                   cpu.factory_string(), cpu.kv_type);
    gpu->host = clone_index(cpu);
    gpu->k = cpu.k;
    gpu->estimator = cpu.estimator;
    gpu->rope = cpu.rope;
    gpu->has_rope = cpu.has_rope;
    // the tokens in position order, read back as floats (exact: the
    // stored values widen) in chunks
    const GpuResources& res = gpu->device();
    constexpr idx_t chunk = 16384;
    std::vector<float> keys, values;
    for (idx_t i0 = 0; i0 < cpu.ntotal; i0 += chunk) {
        const idx_t n = std::min(chunk, cpu.ntotal - i0);
        keys.resize(size_t(n) * cpu.d);
        values.resize(size_t(n) * cpu.d_value);
        for (idx_t i = 0; i < n; i++) {
            cpu.reconstruct(i0 + i, keys.data() + i * cpu.d);
            cpu.reconstruct_value(i0 + i, values.data() + i * cpu.d_value);
        }
        gpu->storage.append(n, keys.data(), values.data(), res.stream());
    }
    gpu->ntotal = cpu.ntotal;
    {
        DeviceScope scope(res.device());
        gpu->dev_->upload_planes(gpu->lsh(), res.stream()); // the twin's seed
    }
    gpu->sync_device();
    return gpu;
}

} // namespace kvindex
