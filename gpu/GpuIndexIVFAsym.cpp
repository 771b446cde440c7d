#include <kvindex/gpu/GpuIndexIVFAsym.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/IVFAsymTrainer.h>
#include <kvindex/IndexTopK.h>
#include <kvindex/index_factory.h>

#include "device_memory.h"
#include "ivf_asym.h"
#include "twin_chain.h"

namespace kvindex {

namespace {

/// The IndexIVFAsym of "IVFAsym<C>..." or "Sink<n>,Window<m>,IVFAsym<C>...".
const IndexIVFAsym* ivf_of(const KVIndex& cpu, idx_t* n_sink, idx_t* n_window) {
    return static_chain_inner<IndexIVFAsym>(cpu, n_sink, n_window);
}

/// Throws unless the twin can run on the device.
void check_twin(const IndexIVFAsym& ivf) {
    FAISS_THROW_IF_NOT_MSG(
            ivf.probe != IVFAsymProbe::oracle,
            "GpuIndexIVFAsym: the _Oracle probe scores every key (a diagnostic) and has no GPU "
            "twin");
    FAISS_THROW_IF_NOT_FMT(
            ivf.n_centroids <= gpu::ivf_max_buckets(),
            "GpuIndexIVFAsym: C=%d buckets; the device probe routes among at most %d",
            ivf.n_centroids,
            gpu::ivf_max_buckets());
}

} // namespace

/// The device arrays beside the tokens.
struct GpuIndexIVFAsym::Device {
    int device = 0;
    // routing model (see gpu::IVFProbeModel; pointers into these arrays)
    DeviceArray w1, bn_scale, bn_shift, w2, b2, centroids, log_sizes;
    gpu::IVFProbeModel model;
    bool has_model = false;        ///< trained: queries are routed
    std::vector<idx_t> moment_sizes; ///< moment probe: bucket sizes the statistics were sent for
    // layout
    DeviceArray begin, end;        ///< int32 [C + 1]: sorted runs
    DeviceArray tail_bucket;       ///< int32 [tail_bytes / 4]
    size_t tail_bytes = 0;
    idx_t tail_size = 0;
    idx_t sink_rows = 0;           ///< first rows: the sink at the last layout
    std::vector<idx_t> bucket_rows; ///< size C + 1: rows of each bucket (sorted + tail)

    size_t model_bytes = 0;

    Device(int device, cudaStream_t stream) : device(device), stream(stream) {}

    /// Room for `rows` tail buckets (capacity doubling; keeps the content).
    void reserve_tail(idx_t rows) {
        gpu::grow(tail_bucket, tail_bytes, size_t(tail_size) * sizeof(int32_t),
                  size_t(rows) * sizeof(int32_t), device, stream, "GpuIndexIVFAsym: tail");
    }

    void append_tail(const std::vector<int32_t>& buckets) {
        reserve_tail(tail_size + idx_t(buckets.size()));
        gpu::upload_bytes(static_cast<int32_t*>(tail_bucket.get()) + tail_size, buckets.data(),
                          buckets.size() * sizeof(int32_t), stream,
                          "GpuIndexIVFAsym: tail buckets");
        gpu::check_cuda(cudaStreamSynchronize(stream), "GpuIndexIVFAsym: tail buckets");
        tail_size += idx_t(buckets.size());
        for (int32_t b : buckets) {
            bucket_rows[b]++;
        }
    }

    cudaStream_t stream; ///< the index's: uploads are ordered with its kernels
};

GpuIndexIVFAsym::GpuIndexIVFAsym() = default;
GpuIndexIVFAsym::~GpuIndexIVFAsym() = default;

GpuIndexIVFAsym::GpuIndexIVFAsym(
        std::shared_ptr<GpuResources> res,
        int d,
        const std::string& cpu_chain,
        KVType kv_type)
        : GpuIndexHostTwin(std::move(res), d, d, kv_type, "GpuIndexIVFAsym") {
    host = index_factory(d, std::string(kv_type_prefix(kv_type)) + cpu_chain, d);
    const IndexIVFAsym* ivf = ivf_of(*host, &n_sink, &n_window);
    FAISS_THROW_IF_NOT_FMT(
            ivf, "GpuIndexIVFAsym: '%s' is not [Sink<n>,][Window<m>,]IVFAsym<C>[_probe]",
            cpu_chain.c_str());
    check_twin(*ivf);
    dev_ = std::make_unique<Device>(resources->device(), resources->stream());
    rebuild_device();
}

const IndexIVFAsym& GpuIndexIVFAsym::ivf() const {
    idx_t s, w;
    return *ivf_of(twin(), &s, &w);
}

size_t GpuIndexIVFAsym::memory_bytes() const {
    size_t b = storage.memory_bytes() + (host ? host->memory_bytes() : 0);
    if (dev_ && host) {
        b += dev_->model_bytes + dev_->tail_bytes + 2 * (ivf().n_centroids + 1) * sizeof(int32_t);
    }
    return b + (slot_token_.capacity() + token_slot_.capacity()) * sizeof(idx_t);
}

void GpuIndexIVFAsym::check_adopt_trained(const KVIndex& trained) const {
    auto g = dynamic_cast<const GpuIndexIVFAsym*>(&trained);
    host->check_adopt_trained(g ? *g->host : trained);
}

int GpuIndexIVFAsym::adopt_trained(const KVIndex& trained) {
    // a GPU index adopts from a CPU one or from another GPU index's twin
    auto g = dynamic_cast<const GpuIndexIVFAsym*>(&trained);
    int adopted = host->adopt_trained(g ? *g->host : trained);
    // the device holds its own copy of the model and of the buckets: made
    // again from the twin, as after a prefill (before, it kept probing no
    // bucket while the twin routed every new token into one)
    rebuild_device();
    return adopted;
}

// ---- layout ----------------------------------------------------------------------

int GpuIndexIVFAsym::nprobe_for(const faiss::SearchParameters* params) const {
    const IndexIVFAsym& v = ivf();
    if (auto p = dynamic_cast<const SearchParametersTopK*>(params)) {
        if (p->nprobe > 0) {
            FAISS_THROW_IF_NOT_FMT(
                    p->nprobe <= size_t(v.n_centroids),
                    "SearchParametersTopK: nprobe=%zd exceeds the C=%d buckets of IndexIVFAsym",
                    p->nprobe,
                    v.n_centroids);
            return dev_->has_model ? int(p->nprobe) : 0;
        }
    }
    return dev_->has_model ? v.nprobe : 0;
}

std::vector<int32_t> GpuIndexIVFAsym::arrival_buckets(
        idx_t first, idx_t n, const float* keys, idx_t n_raw) const {
    const IndexIVFAsym& v = ivf();
    const int C = v.n_centroids;
    std::vector<int32_t> out(n, C);
    // a token of the sink (the wrapper fills it first) is static: read by every query
    const idx_t first_middle = std::min(n, std::max<idx_t>(0, n_sink - first));
    if (!v.is_trained_models() || first_middle >= n) {
        return out;
    }
    // the bucket the CPU twin gives the token when it reaches the inner
    // index: the nearest de-RoPEd centroid at inner position
    // first_position + (token - n_sink), from the key the inner index is
    // handed: as given for the first n_raw tokens (they go there at once),
    // as stored for the others (they pass through the wrapper's window)
    const idx_t m = n - first_middle;
    std::vector<float> k(keys + first_middle * d, keys + n * d);
    const idx_t raw = std::max<idx_t>(0, n_raw - first_middle);
    if (kv_type != KVType::f32 && raw < m) {
        round_to(kv_type, k.data() + raw * d, size_t(m - raw) * d, k.data() + raw * d);
    }
    assign_keys_to_buckets(k.data(), m, d, v.first_position + (first + first_middle - n_sink),
                           v.rope, v.centroids.data(), C, out.data() + first_middle);
    return out;
}

idx_t GpuIndexIVFAsym::direct_to_inner(idx_t n) const {
    if (n_window == 0) {
        return n; // no window: every token reaches the inner index as given
    }
    // IndexSinkWindow::add_kv_impl: the oldest tokens past a full window go
    // to the inner index, those of this call as given
    const idx_t sink = std::min(ntotal, n_sink);
    const idx_t to_sink = std::min(n, n_sink - sink);
    const idx_t window = ntotal - sink - ivf().ntotal;
    const idx_t overflow = std::max<idx_t>(0, window + (n - to_sink) - n_window);
    const idx_t from_new = overflow - std::min(overflow, window);
    return to_sink + from_new;
}

void GpuIndexIVFAsym::upload_model() {
    const IndexIVFAsym& v = ivf();
    Device& D = *dev_;
    const int dev = D.device;
    D.w1.reset();
    D.bn_scale.reset();
    D.bn_shift.reset();
    D.w2.reset();
    D.b2.reset();
    D.centroids.reset();
    D.log_sizes.reset();
    D.moment_sizes.clear();
    D.model = gpu::IVFProbeModel();
    D.model.n_centroids = v.n_centroids;
    D.model.rope_theta = v.rope.theta;
    D.model.rope_half = v.rope.style == RopeStyle::half;
    D.model_bytes = 0;
    D.has_model = v.is_trained_models();
    if (!D.has_model) {
        return;
    }
    const int C = v.n_centroids;
    if (v.probe == IVFAsymProbe::qmodel && !v.qmodel.empty()) {
        const QModel& m = v.qmodel;
        // batch normalisation with running statistics, folded as the CPU
        // inference folds it (qmodel.cpp), float for float
        std::vector<float> scale(m.hidden), shift(m.hidden);
        for (int j = 0; j < m.hidden; j++) {
            scale[j] = m.bn_gamma[j] / std::sqrt(m.bn_var[j] + m.bn_eps);
            shift[j] = m.bn_beta[j] - m.bn_mean[j] * scale[j];
        }
        D.w1 = gpu::device_copy(dev, m.w1, D.stream, "GpuIndexIVFAsym: Q-model");
        D.bn_scale = gpu::device_copy(dev, scale, D.stream, "GpuIndexIVFAsym: Q-model");
        D.bn_shift = gpu::device_copy(dev, shift, D.stream, "GpuIndexIVFAsym: Q-model");
        D.w2 = gpu::device_copy(dev, m.w2, D.stream, "GpuIndexIVFAsym: Q-model");
        D.b2 = gpu::device_copy(dev, m.b2, D.stream, "GpuIndexIVFAsym: Q-model");
        D.model.kind = gpu::IVFProbeKind::qmodel;
        D.model.hidden = m.hidden;
        D.model.w1 = static_cast<const float*>(D.w1.get());
        D.model.bn_scale = static_cast<const float*>(D.bn_scale.get());
        D.model.bn_shift = static_cast<const float*>(D.bn_shift.get());
        D.model.w2 = static_cast<const float*>(D.w2.get());
        D.model.b2 = static_cast<const float*>(D.b2.get());
        D.model_bytes = (m.w1.size() + m.w2.size() + m.b2.size() + 2 * size_t(m.hidden)) *
                sizeof(float);
    } else if (v.probe == IVFAsymProbe::moment) {
        // the statistics follow the buckets: sent by refresh_moments
        D.model.kind = gpu::IVFProbeKind::moment;
        std::vector<float> zeros(size_t(C) * 2 * d, 0.0f);
        std::vector<float> empty(C, -std::numeric_limits<float>::infinity());
        D.centroids = gpu::device_copy(dev, zeros, D.stream, "GpuIndexIVFAsym: moments");
        D.log_sizes = gpu::device_copy(dev, empty, D.stream, "GpuIndexIVFAsym: moments");
        D.model.centroids = static_cast<const float*>(D.centroids.get());
        D.model.log_sizes = static_cast<const float*>(D.log_sizes.get());
        D.moment_sizes.assign(C, 0);
        D.model_bytes = (zeros.size() + empty.size()) * sizeof(float);
        refresh_moments();
    } else {
        // the centroid baselines, and a Q-model probe whose model is empty
        // (the CPU side then routes by de-RoPEd centroids too)
        D.model.kind = v.probe == IVFAsymProbe::centroid_rope ? gpu::IVFProbeKind::centroid_rope
                                                              : gpu::IVFProbeKind::centroid;
        D.centroids = gpu::device_copy(dev, v.centroids, D.stream, "GpuIndexIVFAsym: centroids");
        D.model.centroids = static_cast<const float*>(D.centroids.get());
        D.model_bytes = v.centroids.size() * sizeof(float);
    }
}

void GpuIndexIVFAsym::refresh_moments() {
    Device& D = *dev_;
    if (!D.has_model || D.model.kind != gpu::IVFProbeKind::moment) {
        return;
    }
    const IndexIVFAsym& v = ivf();
    std::vector<float> row(2 * size_t(d));
    for (int c = 0; c < v.n_centroids; c++) {
        const idx_t size = v.buckets[c].size();
        if (size == D.moment_sizes[c]) {
            continue;
        }
        // log n_b + s <q, mean_b> + w s^2/2 <q^2, var_b>: the scales ride on
        // the query (gpu::ivf_probe), the bucket sends its means, variances
        // and log size
        const bool stats = v.bucket_mean.size() == size_t(v.n_centroids) * d;
        for (int j = 0; j < d; j++) {
            row[j] = stats ? v.bucket_mean[size_t(c) * d + j] : 0.0f;
            row[d + j] = stats ? v.bucket_var[size_t(c) * d + j] : 0.0f;
        }
        const float log_size = size > 0 ? std::log(float(size))
                                        : -std::numeric_limits<float>::infinity();
        gpu::upload_bytes(static_cast<float*>(D.centroids.get()) + size_t(c) * 2 * d, row.data(),
                          row.size() * sizeof(float), D.stream, "GpuIndexIVFAsym: moments");
        gpu::upload_bytes(static_cast<float*>(D.log_sizes.get()) + c, &log_size, sizeof(float),
                          D.stream, "GpuIndexIVFAsym: moments");
        // row and log_size are rewritten by the next bucket
        gpu::check_cuda(cudaStreamSynchronize(D.stream), "GpuIndexIVFAsym: moments");
        D.moment_sizes[c] = size;
    }
}

void GpuIndexIVFAsym::rebuild_device() {
    DeviceScope scope(resources->device());
    cudaStream_t stream = resources->stream();
    const IndexIVFAsym& v = ivf();
    const int C = v.n_centroids;
    storage.clear();
    slot_token_.clear();
    token_slot_.assign(host->ntotal, -1);
    dev_ = std::make_unique<Device>(resources->device(), resources->stream());
    Device& D = *dev_;
    upload_model();

    // rows: the sink, the buckets of the inner index (its ids are tokens
    // n_sink + j once it holds any), then the window as the tail's start
    const idx_t n = host->ntotal;
    const idx_t inner_offset = n_sink;
    D.sink_rows = std::min(n, n_sink);
    std::vector<int32_t> begin(C + 1), end(C + 1);
    for (idx_t t = 0; t < D.sink_rows; t++) {
        slot_token_.push_back(t);
    }
    D.bucket_rows.assign(C + 1, 0);
    for (int b = 0; b <= C; b++) {
        begin[b] = int32_t(slot_token_.size());
        for (idx_t j : v.bucket_ids[b]) {
            slot_token_.push_back(j + inner_offset);
        }
        end[b] = int32_t(slot_token_.size());
        D.bucket_rows[b] = end[b] - begin[b];
    }
    D.begin = gpu::device_copy(D.device, begin, D.stream, "GpuIndexIVFAsym: buckets");
    D.end = gpu::device_copy(D.device, end, D.stream, "GpuIndexIVFAsym: buckets");
    tail_begin_ = idx_t(slot_token_.size());
    const idx_t window_first = D.sink_rows + v.ntotal;
    std::vector<float> wk;
    for (idx_t t = window_first; t < n; t++) {
        slot_token_.push_back(t);
    }
    FAISS_THROW_IF_NOT_FMT(
            idx_t(slot_token_.size()) == n,
            "GpuIndexIVFAsym: the twin's %zd tokens do not lay out (%zd rows; internal error)",
            size_t(n),
            slot_token_.size());
    for (idx_t s = 0; s < n; s++) {
        token_slot_[slot_token_[s]] = s;
    }
    // tokens in row order, read back from the twin as floats (exact)
    constexpr idx_t chunk = 16384;
    std::vector<float> keys, values;
    for (idx_t s0 = 0; s0 < n; s0 += chunk) {
        const idx_t m = std::min(chunk, n - s0);
        keys.resize(size_t(m) * d);
        values.resize(size_t(m) * d_value);
        for (idx_t i = 0; i < m; i++) {
            host->reconstruct(slot_token_[s0 + i], keys.data() + i * d);
            host->reconstruct_value(slot_token_[s0 + i], values.data() + i * d_value);
        }
        storage.append(m, keys.data(), values.data(), stream);
    }
    // the window's buckets: where the twin puts each token once it leaves
    // the window (nearest centroid at its position)
    keys.resize(size_t(n - window_first) * d);
    for (idx_t t = window_first; t < n; t++) {
        host->reconstruct(t, keys.data() + (t - window_first) * d);
    }
    D.append_tail(arrival_buckets(window_first, n - window_first, keys.data(), 0));
}

idx_t GpuIndexIVFAsym::list_bound(int nprobe) const {
    const Device& D = *dev_;
    const int C = ivf().n_centroids;
    std::vector<idx_t> rows(D.bucket_rows.begin(), D.bucket_rows.begin() + C);
    const int np = std::min(nprobe, C);
    std::nth_element(rows.begin(), rows.begin() + np, rows.end(), std::greater<idx_t>());
    idx_t bound = D.bucket_rows[C];
    for (int i = 0; i < np; i++) {
        bound += rows[i];
    }
    return std::min(bound, storage.size);
}

// ---- writes ----------------------------------------------------------------------

void GpuIndexIVFAsym::prefill_impl(const PrefillInput& input) {
    check_prefill(input);
    host->prefill(input); // trains (or adopts) and assigns, by the CPU code
    try {
        ntotal = host->ntotal;
        rope = input.rope;
        has_rope = true;
        rebuild_device();
    } catch (...) {
        host->reset();
        ntotal = 0;
        rebuild_device();
        throw;
    }
}

void GpuIndexIVFAsym::add_kv_impl(idx_t n, const float* keys, const float* values) {
    DeviceScope scope(resources->device());
    std::vector<int32_t> buckets = arrival_buckets(ntotal, n, keys, direct_to_inner(n));
    dev_->reserve_tail(dev_->tail_size + n); // so that nothing can fail after the twin took them
    storage.append(n, keys, values, resources->stream());
    try {
        host->add_kv(n, keys, values);
    } catch (...) {
        storage.size -= n; // the rows were appended last: drop them
        throw;
    }
    dev_->append_tail(buckets);
    for (idx_t i = 0; i < n; i++) {
        slot_token_.push_back(ntotal + i);
        token_slot_.push_back(storage.size - n + i);
    }
    refresh_moments();
}

void GpuIndexIVFAsym::reset_impl() {
    host->reset();
    ntotal = 0;
    rebuild_device();
}

void GpuIndexIVFAsym::reconstruct_impl(idx_t key, float* recons) const {
    std::vector<float> k, v;
    storage.read(0, token_slot_[key], 1, &k, &v, device().stream());
    std::copy(k.begin(), k.end(), recons);
}

void GpuIndexIVFAsym::reconstruct_value_impl(idx_t key, float* value) const {
    std::vector<float> k, v;
    storage.read(0, token_slot_[key], 1, &k, &v, device().stream());
    std::copy(v.begin(), v.end(), value);
}

// ---- the decode step -------------------------------------------------------------

void GpuIndexIVFAsym::attend_heads(
        const GpuKVStorage& kv,
        int rows_per_head,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params,
        cudaStream_t stream) const {
    FAISS_THROW_IF_NOT_MSG(
            &kv == &storage,
            "GpuIndexIVFAsym: attends its own bucket-sorted rows only (GpuKVCache refuses the "
            "type)");
    DeviceScope scope(kv.device);
    const IndexIVFAsym& v = ivf();
    const Device& D = *dev_;
    const int nprobe = D.has_model ? nprobe_for(params) : 0;
    // a GQA group (group_probe; KVCache sends the g heads of one position)
    // reads one bucket set, summed over its rows
    const bool group = v.group_probe && v.group_size > 1 && rows_per_head == v.group_size;
    const idx_t n_sink_rows = D.sink_rows;
    // the window: the last min(n_window, tokens after the sink) rows
    const idx_t w = std::min(n_window, ntotal - std::min(ntotal, n_sink));
    gpu::IVFBucketLayout layout;
    layout.begin = static_cast<const int32_t*>(D.begin.get());
    layout.end = static_cast<const int32_t*>(D.end.get());
    layout.tail_bucket = static_cast<const int32_t*>(D.tail_bucket.get());
    layout.tail_stride = idx_t(D.tail_bytes / sizeof(int32_t));
    layout.tail_begin = tail_begin_;
    layout.tail_end = storage.size - w;
    gpu::IVFProbeModel model = D.model;
    model.var_weight = v.var_weight;
    const idx_t bound = std::min(list_bound(nprobe), storage.size - n_sink_rows - w);
    const gpu::KVHeadsView view = gpu::view_of(kv);
    gpu::with_workspace(stream, [&](gpu::Workspace& ws) {
        gpu::ivf_asym_attention(view, q, rows_per_head, n_sink_rows, w, model, layout, nprobe,
                                group, v.query_position(), std::max<idx_t>(bound, 0), out, lse,
                                ws, stream);
    });
}

void GpuIndexIVFAsym::attend_batch(
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    const IndexIVFAsym& v = ivf();
    const idx_t g = v.group_size;
    if (!v.group_probe || g <= 1 || n % g != 0 || n == g) {
        GpuIndexKV::attend_batch(n, q, out, lse, params);
        return;
    }
    // several positions of a group (head-major: query h * m + i is head h
    // at position i): one call per position, its g rows together
    const idx_t m = n / g;
    std::vector<float> qg(size_t(g) * d), og(size_t(g) * d_value), lg(g);
    for (idx_t i = 0; i < m; i++) {
        for (idx_t h = 0; h < g; h++) {
            std::copy_n(q + (h * m + i) * d, d, qg.data() + h * d);
        }
        GpuIndexKV::attend_batch(g, qg.data(), og.data(), lg.data(), params);
        for (idx_t h = 0; h < g; h++) {
            std::copy_n(og.data() + h * d_value, d_value, out + (h * m + i) * d_value);
            lse[h * m + i] = lg[h];
        }
    }
}

void GpuIndexIVFAsym::probe_device(
        idx_t n,
        const float* q,
        int nprobe,
        std::vector<int32_t>* probed) const {
    const GpuResources& res = device();
    DeviceScope scope(res.device());
    cudaStream_t stream = res.stream();
    probed->assign(size_t(n) * nprobe, 0);
    if (nprobe == 0 || n == 0) {
        return;
    }
    gpu::IVFProbeModel model = dev_->model;
    model.var_weight = ivf().var_weight;
    const gpu::KVHeadsView view = gpu::view_of(storage);
    constexpr idx_t kBatch = 4096;
    for (idx_t i0 = 0; i0 < n; i0 += kBatch) {
        const idx_t nb = std::min(kBatch, n - i0);
        gpu::DeviceScratch qd = gpu::upload(q + i0 * d, size_t(nb) * d, stream, "probe: queries");
        gpu::DeviceScratch pd(size_t(nb) * nprobe * sizeof(int32_t), stream);
        gpu::with_workspace(stream, [&](gpu::Workspace& ws) {
            gpu::ivf_probe(view, qd.as<float>(), int(nb), model, ivf().query_position(), nprobe,
                           false, pd.as<int32_t>(), ws, stream);
        });
        gpu::download(probed->data() + i0 * nprobe, pd.get(), size_t(nb) * nprobe, stream,
                      "probe: buckets");
        res.synchronize("GpuIndexIVFAsym::probe");
    }
}

void GpuIndexIVFAsym::probe(
        idx_t n,
        const float* q,
        int32_t* probed,
        const faiss::SearchParameters* params) const {
    ReadScope scope(*this, "probe");
    check_query_args(n, q, "GpuIndexIVFAsym::probe");
    const int nprobe = nprobe_for(params);
    FAISS_THROW_IF_NOT_MSG(
            nprobe == 0 || dev_->has_model, "GpuIndexIVFAsym::probe: the index has no model yet");
    std::vector<int32_t> p;
    probe_device(n, q, nprobe, &p);
    std::copy(p.begin(), p.end(), probed);
}

void GpuIndexIVFAsym::select_batch(
        idx_t n,
        const float* q,
        Selection* sel,
        const faiss::SearchParameters* params) const {
    const IndexIVFAsym& v = ivf();
    const int C = v.n_centroids;
    const int nprobe = dev_->has_model ? nprobe_for(params) : 0;
    std::vector<int32_t> probed;
    if (v.ntotal > 0) {
        probe_device(n, q, nprobe, &probed);
    }
    // the twin's layout: sink, inner tokens (n_sink + inner id), window
    const idx_t sink = std::min(ntotal, n_sink);
    const idx_t window_first = sink + v.ntotal;
    const size_t scanned = v.ntotal > 0 ? v.probe_cost() : 0;
    for (idx_t i = 0; i < n; i++) {
        Selection& s = sel[i];
        s.clear();
        for (idx_t t = 0; t < sink; t++) {
            s.push_back(t);
        }
        if (v.ntotal > 0) {
            std::vector<idx_t> mid;
            auto take = [&](int32_t b) {
                for (idx_t j : v.bucket_ids[b]) {
                    mid.push_back(j + n_sink);
                }
            };
            for (int e = 0; e < nprobe; e++) {
                take(probed[size_t(i) * nprobe + e]);
            }
            take(C); // the unassigned run: always read
            std::sort(mid.begin(), mid.end());
            for (idx_t t : mid) {
                s.push_back(t);
            }
        }
        for (idx_t t = window_first; t < ntotal; t++) {
            s.push_back(t);
        }
        s.n_scanned = scanned;
    }
}

void GpuIndexIVFAsym::search_batch(
        idx_t n,
        const float* q,
        idx_t k_search,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters* params) const {
    // the CPU chain's answer: the exact top-k of the static tokens and the
    // probed buckets
    std::vector<Selection> sel(n);
    select_batch(n, q, sel.data(), params);
    search_among(n, q, sel.data(), k_search, distances, labels, &token_slot_);
}

// ---- CPU <-> GPU -----------------------------------------------------------------

bool GpuIndexIVFAsym::accepts_cpu(const KVIndex& cpu) {
    idx_t s, w;
    return ivf_of(cpu, &s, &w) != nullptr;
}

std::unique_ptr<GpuIndexKV> GpuIndexIVFAsym::from_cpu(
        const KVIndex& cpu, std::shared_ptr<GpuResources> resources) {
    idx_t s, w;
    const IndexIVFAsym* ivf = ivf_of(cpu, &s, &w);
    FAISS_THROW_IF_NOT_FMT(ivf, "GpuIndexIVFAsym: no twin of %s", cpu.type_name());
    check_twin(*ivf);
    auto gpu = std::make_unique<GpuIndexIVFAsym>(std::move(resources), cpu.d,
                                                 cpu.factory_string(), cpu.kv_type);
    FAISS_THROW_IF_NOT_FMT(
            cpu.d_value == cpu.d, "GpuIndexIVFAsym: d_value=%d must equal d=%d", cpu.d_value,
            cpu.d);
    gpu->host = clone_index(cpu);
    gpu->ntotal = cpu.ntotal;
    gpu->k = cpu.k;
    gpu->estimator = cpu.estimator;
    gpu->rope = cpu.rope;
    gpu->has_rope = cpu.has_rope;
    gpu->rebuild_device();
    return gpu;
}

} // namespace kvindex
