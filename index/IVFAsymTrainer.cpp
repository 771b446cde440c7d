// SAAP's offline training (saap.txt §4, Appendix A): k-means buckets for
// de-RoPEd keys, and rows (de-RoPEd long-range query, its attention mass
// per bucket) for the Q-model.

#include <kvindex/IVFAsymTrainer.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include <faiss/Clustering.h>
#include <faiss/IndexFlat.h>
#include <faiss/impl/FaissAssert.h>

#include <kvindex/rope.h>

#include "blas.h"
#include "checks.h"

namespace kvindex {

namespace {

constexpr idx_t kCandidateBlock = 128; // candidate queries per score block
constexpr idx_t kMinQModelRows = 16;   // fewer long-range rows: no Q-model

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// x (n rows at positions first + i) rotated back to position 0.
std::vector<float> de_rope(const float* x, idx_t n, int d, idx_t first, const RopeParams& rope) {
    std::vector<float> out(x, x + size_t(n) * d);
    std::vector<int64_t> pos(n);
    std::iota(pos.begin(), pos.end(), first);
    invert_rope(n, d, out.data(), pos.data(), rope);
    return out;
}

/// Nearest centroid (L2) of each of n vectors x (size n * d), ties to the smaller index.
void assign_to_centroids(
        const float* x, idx_t n, int d, const float* centroids, int n_centroids, int32_t* out) {
    // argmin_c |x - c|^2 = argmin_c |c|^2 - 2 <x, c>, the products by BLAS
    std::vector<float> norms(n_centroids);
    for (int c = 0; c < n_centroids; c++) {
        const float* v = centroids + size_t(c) * d;
        norms[c] = std::inner_product(v, v + d, v, 0.0f);
    }
    constexpr idx_t kBlock = 1024;
    std::vector<float> ip(size_t(std::min(n, kBlock)) * n_centroids);
    for (idx_t i0 = 0; i0 < n; i0 += kBlock) {
        idx_t m = std::min(kBlock, n - i0);
        gemm_abt(int(m), n_centroids, d, x + i0 * d, d, centroids, d, ip.data(), n_centroids);
        for (idx_t i = 0; i < m; i++) {
            const float* row = ip.data() + i * n_centroids;
            int best = 0;
            float best_v = norms[0] - 2 * row[0];
            for (int c = 1; c < n_centroids; c++) {
                float v = norms[c] - 2 * row[c];
                if (v < best_v) {
                    best_v = v;
                    best = c;
                }
            }
            out[i0 + i] = best;
        }
    }
}

} // namespace

void assign_keys_to_buckets(
        const float* keys,
        idx_t n,
        int d,
        idx_t first_position,
        const RopeParams& rope,
        const float* centroids,
        int n_centroids,
        int32_t* out) {
    // public, so checked like any entry point (O(n d) beside the O(n d C) products)
    FAISS_THROW_IF_NOT_FMT(
            d > 0 && n_centroids >= 1 && first_position >= 0,
            "assign_keys_to_buckets: d=%d, n_centroids=%d, first_position=%zd (need d > 0, "
            "n_centroids >= 1, first_position >= 0)",
            d,
            n_centroids,
            ssize_t(first_position));
    check_input_size(n, d, "assign_keys_to_buckets: keys");
    if (n == 0) {
        return;
    }
    check_not_null(keys, "assign_keys_to_buckets: keys");
    check_not_null(centroids, "assign_keys_to_buckets: centroids");
    check_not_null(out, "assign_keys_to_buckets: out");
    check_input(keys, n, d, "assign_keys_to_buckets: keys");
    // a NaN centroid wins no comparison: every key would land in bucket 0
    check_finite(centroids, n_centroids, d, "assign_keys_to_buckets: centroids");
    std::vector<float> k = de_rope(keys, n, d, first_position, rope);
    assign_to_centroids(k.data(), n, d, centroids, n_centroids, out);
}

IVFAsymTrainer::IVFAsymTrainer(int d, const IVFAsymTrainingParams& p)
        : d(d), params(p), rng_state_(p.seed) {
    FAISS_THROW_IF_NOT_FMT(d > 0 && d % 2 == 0, "IVFAsymTrainer: d=%d must be even and > 0", d);
    FAISS_THROW_IF_NOT_FMT(
            p.n_centroids >= 1 && p.n_centroids <= (1 << 16) && p.hidden >= 1 &&
                    p.hidden <= (1 << 16),
            "IVFAsymTrainer: n_centroids=%d and hidden=%d must be in [1, 65536]",
            p.n_centroids,
            p.hidden);
    FAISS_THROW_IF_NOT_FMT(
            p.kmeans_iterations >= 1 && p.kmeans_points_per_centroid >= 1 &&
                    p.kmeans_points_per_centroid <= kMaxKmeansPointsPerCentroid &&
                    p.min_distance >= 0 && p.n_sink >= 0 && p.queries_per_prompt >= 1 &&
                    p.max_samples >= 1 && p.held_out_fraction >= 0 && p.held_out_fraction < 1,
            "IVFAsymTrainer: invalid parameters (kmeans_iterations=%d "
            "kmeans_points_per_centroid=%zd (at most %zd) min_distance=%zd "
            "queries_per_prompt=%zd held_out_fraction=%g)",
            p.kmeans_iterations,
            ssize_t(p.kmeans_points_per_centroid),
            ssize_t(kMaxKmeansPointsPerCentroid),
            size_t(p.min_distance),
            size_t(p.queries_per_prompt),
            p.held_out_fraction);
    FAISS_THROW_IF_NOT_FMT(
            p.recent_positions >= 0 && p.recent_weight >= 1 && p.recent_weight <= 1024,
            "IVFAsymTrainer: recent_positions=%zd must be >= 0 and recent_weight=%d in [1, 1024]",
            ssize_t(p.recent_positions),
            p.recent_weight);
    // checked here, not after every prompt has been read
    check_qmodel_train_params(p.adam, "IVFAsymTrainer: adam");
}

void IVFAsymTrainer::add_prompt(const PrefillInput& in) {
    check_prompt(in, d, "IVFAsymTrainer::add_prompt");
    FAISS_THROW_IF_NOT_FMT(
            in.n_tokens >= 1 && in.keys, "IVFAsymTrainer::add_prompt: a prompt needs tokens (n_tokens=%zd)",
            size_t(in.n_tokens));
    check_rope_params(in.rope, d);
    FAISS_THROW_IF_NOT_MSG(
            !has_rope_ || in.rope == rope,
            "IVFAsymTrainer::add_prompt: every prompt must have the same RoPE parameters");
    check_input(in.keys, in.n_tokens, d, "IVFAsymTrainer::add_prompt: keys");
    rope = in.rope;
    has_rope_ = true;
    report.n_prompts++;

    // keys for k-means: those of the first prompts, sinks left out
    idx_t skip = std::max<idx_t>(0, std::min(in.n_tokens, params.n_sink - in.first_position));
    report.n_keys += in.n_tokens - skip;
    idx_t cap = params.kmeans_points_per_centroid * params.n_centroids;
    if (centroids.empty() && idx_t(kmeans_sample_.size() / d) < cap) {
        idx_t take = std::min(in.n_tokens - skip, cap - idx_t(kmeans_sample_.size() / d));
        std::vector<float> k =
                de_rope(in.keys + skip * d, take, d, in.first_position + skip, rope);
        kmeans_sample_.insert(kmeans_sample_.end(), k.begin(), k.end());
    }

    // candidate queries: those with at least one far key after the sinks.
    // A query past these keys (the window's, when they are the middle of a
    // sink/window chain) sees them all, as a decode query does.
    PendingPrompt p;
    p.first_position = in.first_position;
    p.keys.assign(in.keys, in.keys + size_t(in.n_tokens) * d);
    if (in.n_queries > 0) { // checked by check_prompt
        const idx_t first_far = std::max(params.n_sink, in.first_position);
        idx_t last = 0; // the prompt's last query position
        for (idx_t i = 0; i < in.n_queries; i++) {
            last = std::max(last, in.query_position(i));
        }
        std::vector<std::pair<int, idx_t>> eligible, recent; // (head, query)
        for (int h = 0; h < in.n_query_heads; h++) {
            for (idx_t i = 0; i < in.n_queries; i++) {
                idx_t pos = in.query_position(i);
                if (pos - params.min_distance > first_far) {
                    (pos > last - params.recent_positions ? recent : eligible).push_back({h, i});
                }
            }
        }
        auto add = [&](std::pair<int, idx_t> hi, int weight) {
            const float* q = in.queries + (size_t(hi.first) * in.n_queries + hi.second) * d;
            p.queries.insert(p.queries.end(), q, q + d);
            p.positions.push_back(in.query_position(hi.second));
            p.weights.push_back(weight);
        };
        std::mt19937_64 rng(rng_state_++);
        idx_t take = std::min<idx_t>(params.queries_per_prompt, idx_t(eligible.size()));
        for (idx_t j = 0; j < take; j++) { // partial Fisher-Yates: a uniform sample
            std::uniform_int_distribution<size_t> pick(j, eligible.size() - 1);
            std::swap(eligible[j], eligible[pick(rng)]);
            add(eligible[j], 1);
        }
        // the question: every recent query (the latest first, up to the cap)
        idx_t n_recent = std::min<idx_t>(params.queries_per_prompt, idx_t(recent.size()));
        std::stable_sort(recent.begin(), recent.end(), [&](const auto& a, const auto& b) {
            return in.query_position(a.second) > in.query_position(b.second);
        });
        for (idx_t j = 0; j < n_recent; j++) {
            add(recent[j], params.recent_weight);
        }
        report.n_candidates += take + n_recent;
    }
    if (centroids.empty()) {
        pending_.push_back(std::move(p));
        if (idx_t(kmeans_sample_.size() / d) >= cap) {
            run_kmeans();
        }
    } else {
        make_rows(p);
    }
}

void IVFAsymTrainer::run_kmeans() {
    idx_t n = idx_t(kmeans_sample_.size() / d);
    FAISS_THROW_IF_NOT_FMT(
            n >= params.n_centroids,
            "IVFAsymTrainer: %zd training keys cannot make %d centroids",
            size_t(n),
            params.n_centroids);
    auto t0 = std::chrono::steady_clock::now();
    faiss::ClusteringParameters cp;
    cp.niter = params.kmeans_iterations;
    cp.seed = int(params.seed & 0x7fffffff);
    cp.min_points_per_centroid = 1; // the caller sized the sample
    cp.max_points_per_centroid = int(params.kmeans_points_per_centroid);
    faiss::Clustering clus(d, params.n_centroids, cp);
    faiss::IndexFlatL2 quantizer(d);
    clus.train(n, kmeans_sample_.data(), quantizer);
    centroids = clus.centroids;
    kmeans_sample_ = std::vector<float>();
    report.kmeans_seconds += seconds_since(t0);
    for (const PendingPrompt& p : pending_) {
        make_rows(p);
    }
    pending_.clear();
}

void IVFAsymTrainer::make_rows(const PendingPrompt& p) {
    auto t0 = std::chrono::steady_clock::now();
    const int C = params.n_centroids;
    idx_t n = idx_t(p.keys.size() / d);
    std::vector<int32_t> bucket(n);
    assign_keys_to_buckets(p.keys.data(), n, d, p.first_position, rope, centroids.data(), C, bucket.data());

    const float scale = 1.0f / std::sqrt(float(d));
    idx_t nc = idx_t(p.positions.size());
    std::vector<float> s(size_t(std::min(nc, kCandidateBlock)) * n);
    std::vector<double> target(C);
    std::vector<float> row_x(d), row_t(C);
    std::mt19937_64 rng(rng_state_++);
    for (idx_t c0 = 0; c0 < nc; c0 += kCandidateBlock) {
        idx_t m = std::min(kCandidateBlock, nc - c0);
        gemm_abt(int(m), int(n), d, p.queries.data() + c0 * d, d, p.keys.data(), d, s.data(), int(n), scale);
        for (idx_t r = 0; r < m; r++) {
            const float* row = s.data() + r * n;
            idx_t pos = p.positions[c0 + r];
            // keys j at positions first + j: sinks out, causal, far = more
            // than min_distance back
            idx_t j0 = std::max<idx_t>(0, params.n_sink - p.first_position);
            idx_t j_end = std::min(n, pos - p.first_position + 1);
            idx_t far_end = std::min(n, pos - params.min_distance - p.first_position);
            if (far_end <= j0) {
                continue;
            }
            idx_t best = j0;
            for (idx_t j = j0 + 1; j < j_end; j++) {
                if (row[j] > row[best]) {
                    best = j;
                }
            }
            if (best >= far_end) {
                continue; // its best key is near: not a long-range query
            }
            report.n_long_range++;
            float mx = row[best]; // the best key is far: the max of the far keys
            std::fill(target.begin(), target.end(), 0.0);
            double z = 0;
            for (idx_t j = j0; j < far_end; j++) {
                double e = std::exp(double(row[j] - mx));
                target[bucket[j]] += e;
                z += e;
            }
            // the row, once: the de-RoPEd query and its target
            const float* q = p.queries.data() + (c0 + r) * d;
            std::copy(q, q + d, row_x.data());
            int64_t qpos = pos;
            invert_rope(1, d, row_x.data(), &qpos, rope);
            for (int c = 0; c < C; c++) {
                row_t[c] = float(target[c] / z);
            }
            for (int rep = 0; rep < p.weights[c0 + r]; rep++) {
                // reservoir sampling keeps a uniform max_samples of all rows
                idx_t slot = idx_t(rows_x_.size() / d);
                if (slot >= params.max_samples) {
                    std::uniform_int_distribution<idx_t> pick(0, rows_seen_);
                    slot = pick(rng);
                }
                rows_seen_++;
                if (slot >= params.max_samples) {
                    continue;
                }
                if (slot == idx_t(rows_x_.size() / d)) {
                    rows_x_.resize(rows_x_.size() + d);
                    rows_t_.resize(rows_t_.size() + C);
                }
                std::copy(row_x.begin(), row_x.end(), rows_x_.begin() + slot * d);
                std::copy(row_t.begin(), row_t.end(), rows_t_.begin() + slot * C);
            }
        }
    }
    report.targets_seconds += seconds_since(t0);
}

const IVFAsymTrainingReport& IVFAsymTrainer::train(
        const std::function<void(const QModelLossPoint&)>& progress) {
    if (centroids.empty()) {
        run_kmeans();
    }
    const int C = params.n_centroids;
    idx_t n = idx_t(rows_x_.size() / d);
    // held-out rows: a seeded shuffle, the last fraction aside
    std::vector<idx_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::mt19937_64 rng(params.seed ^ 0x51ed27d3a5b4c6e1ULL);
    std::shuffle(order.begin(), order.end(), rng);
    idx_t n_held = idx_t(std::floor(n * params.held_out_fraction));
    idx_t n_train = n - n_held;
    report.n_train = n_train;
    report.n_held = n_held;
    if (n_train < kMinQModelRows) {
        qmodel = QModel();
        return report;
    }
    std::vector<float> x(size_t(n) * d), t(size_t(n) * C);
    for (idx_t i = 0; i < n; i++) {
        std::copy_n(rows_x_.data() + order[i] * d, d, x.data() + i * d);
        std::copy_n(rows_t_.data() + order[i] * C, C, t.data() + i * C);
    }
    auto t0 = std::chrono::steady_clock::now();
    // trained aside: a failed run (or a throwing `progress`) leaves the
    // trainer's model as it was, not a random one that looks trained
    QModel m(d, params.hidden, C, params.seed);
    const float* hx = x.data() + n_train * d;
    const float* ht = t.data() + n_train * C;
    double initial = n_held > 0 ? qmodel_eval_loss(m, n_held, hx, ht) : std::nan("");
    auto curve = train_qmodel(m, n_train, x.data(), t.data(), n_held, hx, ht, params.adam, progress);
    qmodel = std::move(m);
    report.initial_held_out_loss = initial;
    report.curve = std::move(curve);
    report.qmodel_seconds = seconds_since(t0);
    return report;
}

} // namespace kvindex
