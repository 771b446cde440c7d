#include <kvindex/IndexIVFAsym.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/IndexTopK.h>
#include <kvindex/attention.h>
#include <kvindex/impl/growth.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>
#include <kvindex/kernels.h>

#include "checks.h"
#include "parallel.h"
#include "random.h"

namespace kvindex {

namespace {

constexpr int kMaxCentroids = 1 << 16;
constexpr idx_t kSelfTrainQueries = 4096; // candidate queries drawn at prefill
// the question the prompt ends with: its queries' rows count 8 times each
// (IVFAsymTrainingParams::recent_positions)
constexpr idx_t kSelfTrainRecentPositions = 128;
constexpr int kSelfTrainRecentWeight = 8;

const char* probe_suffix(IVFAsymProbe p) {
    switch (p) {
        case IVFAsymProbe::qmodel:
            return "";
        case IVFAsymProbe::centroid:
            return "_Centroid";
        case IVFAsymProbe::centroid_rope:
            return "_CentroidRoPE";
        case IVFAsymProbe::oracle:
            return "_Oracle";
        case IVFAsymProbe::moment:
            return "_Moment";
    }
    return "?";
}

/// Running merge of partial attention results by lse (attention.h).
struct MergedAttention {
    std::vector<float> out, part;
    float lse = -std::numeric_limits<float>::infinity();

    explicit MergedAttention(size_t dv) : out(dv, 0.0f), part(dv) {}

    void add(float part_lse) {
        const float* outs[2] = {out.data(), part.data()};
        float lses[2] = {lse, part_lse};
        lse = merge_attention(2, outs, lses, out.size(), out.data());
    }
};

} // namespace

// ---- construction, factory ---------------------------------------------------

IndexIVFAsym::IndexIVFAsym() : KVIndex(0, 0) {}

IndexIVFAsym::IndexIVFAsym(int d, int d_value, int n_centroids, IVFAsymProbe probe, KVType kv_type)
        : KVIndex(d, d_value, kv_type), n_centroids(n_centroids), probe(probe) {
    FAISS_THROW_IF_NOT_FMT(
            n_centroids >= 1 && n_centroids <= kMaxCentroids,
            "IndexIVFAsym: n_centroids=%d must be in [1, %d]",
            n_centroids,
            kMaxCentroids);
    FAISS_THROW_IF_NOT_FMT(d % 2 == 0, "IndexIVFAsym: d=%d must be even (RoPE pairs)", d);
    nprobe = std::min(nprobe, n_centroids);
    buckets.assign(n_centroids + 1, KVStorage(d, this->d_value, kv_type));
    bucket_ids.resize(n_centroids + 1);
}

std::string IndexIVFAsym::factory_string() const {
    return "IVFAsym" + std::to_string(n_centroids) + probe_suffix(probe);
}

std::unique_ptr<KVIndex> IndexIVFAsym::from_factory(FactoryChain& chain) {
    const std::string& s = chain.peek();
    for (IVFAsymProbe p :
         {IVFAsymProbe::centroid_rope, IVFAsymProbe::centroid, IVFAsymProbe::oracle, IVFAsymProbe::moment,
          IVFAsymProbe::qmodel}) {
        std::string suffix = probe_suffix(p);
        if (s.size() < suffix.size() || s.compare(s.size() - suffix.size(), suffix.size(), suffix)) {
            continue;
        }
        idx_t c;
        if (!parse_factory_count(s.substr(0, s.size() - suffix.size()), "IVFAsym", &c)) {
            continue;
        }
        FAISS_THROW_IF_NOT_FMT(
                c >= 1 && c <= kMaxCentroids,
                "index_factory: '%s': IVFAsym<C> needs C in [1, %d], in \"%s\"",
                s.c_str(),
                kMaxCentroids,
                chain.description().c_str());
        chain.take();
        return std::make_unique<IndexIVFAsym>(chain.d, chain.d_value, int(c), p, chain.kv_type);
    }
    return nullptr;
}

IndexIVFAsym* ivf_asym_in_chain(KVIndex* index) {
    return const_cast<IndexIVFAsym*>(ivf_asym_in_chain(static_cast<const KVIndex*>(index)));
}

const IndexIVFAsym* ivf_asym_in_chain(const KVIndex* index) {
    if (!index) {
        return nullptr;
    }
    if (auto self = dynamic_cast<const IndexIVFAsym*>(index)) {
        return self;
    }
    for (const KVIndex* c : index->children()) {
        if (const IndexIVFAsym* found = ivf_asym_in_chain(c)) {
            return found;
        }
    }
    return nullptr;
}

// ---- the trained models ----------------------------------------------------------

void IndexIVFAsym::check_set_trained(
        const std::vector<float>& new_centroids,
        const QModel& new_qmodel,
        const RopeParams& new_rope) const {
    FAISS_THROW_IF_NOT_FMT(
            ntotal == 0,
            "IndexIVFAsym: models can only be set on an empty index (it holds %zd tokens: reset first)",
            size_t(ntotal));
    FAISS_THROW_IF_NOT_FMT(
            new_centroids.size() == size_t(n_centroids) * d,
            "IndexIVFAsym: %zd centroid floats, expected C * d = %d * %d",
            new_centroids.size(),
            n_centroids,
            d);
    check_finite(new_centroids.data(), n_centroids, d, "IndexIVFAsym: centroids");
    if (!new_qmodel.empty()) {
        new_qmodel.check();
        FAISS_THROW_IF_NOT_FMT(
                new_qmodel.d == d && new_qmodel.n_classes == n_centroids,
                "IndexIVFAsym: the Q-model maps %d -> %d, the index needs %d -> %d",
                new_qmodel.d,
                new_qmodel.n_classes,
                d,
                n_centroids);
    }
    check_rope_params(new_rope, d);
}

void IndexIVFAsym::set_trained(
        const std::vector<float>& new_centroids,
        const QModel& new_qmodel,
        const RopeParams& new_rope) {
    check_set_trained(new_centroids, new_qmodel, new_rope);
    // copied first: a failed allocation leaves the old models whole
    std::vector<float> c = new_centroids;
    QModel q = new_qmodel;
    centroids.swap(c);
    qmodel = std::move(q);
    rope = new_rope;
    has_rope = true;
    adopted = true;
}

void IndexIVFAsym::check_adopt_trained(const KVIndex& trained) const {
    auto src = dynamic_cast<const IndexIVFAsym*>(&trained);
    FAISS_THROW_IF_NOT_FMT(
            src, "adopt_trained: expected an IndexIVFAsym to adopt from, got a %s",
            trained.type_name());
    FAISS_THROW_IF_NOT_FMT(
            src->d == d && src->n_centroids == n_centroids,
            "adopt_trained: the trained index has d=%d C=%d, this one d=%d C=%d",
            src->d,
            src->n_centroids,
            d,
            n_centroids);
    FAISS_THROW_IF_NOT_MSG(
            src->is_trained_models(), "adopt_trained: the trained IndexIVFAsym has no centroids");
    check_set_trained(src->centroids, src->qmodel, src->rope);
}

int IndexIVFAsym::adopt_trained(const KVIndex& trained) {
    check_adopt_trained(trained);
    auto& src = static_cast<const IndexIVFAsym&>(trained);
    set_trained(src.centroids, src.qmodel, src.rope);
    return 1;
}

bool IndexIVFAsym::self_train(const PrefillInput& in) {
    IVFAsymTrainingParams p;
    p.n_centroids = n_centroids;
    p.hidden = hidden;
    p.min_distance = min_distance >= 0 ? min_distance : in.n_after;
    p.n_sink = 1;
    p.queries_per_prompt = kSelfTrainQueries;
    p.recent_positions = kSelfTrainRecentPositions;
    p.recent_weight = kSelfTrainRecentWeight;
    p.held_out_fraction = 0; // every row trains: the prompt is all there is
    p.seed = stream_seed(seed, stream);
    p.adam.seed = p.seed;
    idx_t skip = std::max<idx_t>(0, p.n_sink - in.first_position);
    if (in.n_tokens - skip < n_centroids) {
        return false; // too few keys for k-means: tokens stay unassigned
    }
    IVFAsymTrainer trainer(d, p);
    if (probe == IVFAsymProbe::qmodel) {
        trainer.add_prompt(in);
    } else { // only the centroids are used: no Q-model rows
        PrefillInput keys_only = in;
        keys_only.n_queries = 0;
        keys_only.queries = nullptr;
        trainer.add_prompt(keys_only);
    }
    idx_t rows = trainer.n_rows();
    trainer.params.adam.iterations = train_iterations > 0
            ? train_iterations
            : int(std::clamp<idx_t>(10 * rows / trainer.params.adam.batch_size, 50, 2000));
    trainer.train();
    centroids = trainer.centroids;
    qmodel = trainer.qmodel;
    return true;
}

// ---- tokens --------------------------------------------------------------------

void IndexIVFAsym::prefill_impl(const PrefillInput& in) {
    check_prefill(in);
    try {
        first_position = in.first_position;
        n_after = in.n_after;
        group_size = in.n_queries > 0 ? in.n_query_heads : 1;
        rope = in.rope;
        has_rope = true;
        if (!adopted) {
            auto t0 = std::chrono::steady_clock::now();
            centroids.clear();
            qmodel = QModel();
            self_train(in);
            train_seconds =
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        }
        if (in.n_tokens > 0) {
            assign_tokens(in.n_tokens, in.keys, in.values);
            ntotal = in.n_tokens;
        }
    } catch (...) {
        reset_impl();
        throw;
    }
}

void IndexIVFAsym::add_kv_impl(idx_t n, const float* keys, const float* values) {
    assign_tokens(n, keys, values);
}

void IndexIVFAsym::undo_add_kv_impl(idx_t n) {
    // appended in token order: each token is the last row of its bucket
    const size_t n0 = token_bucket.size() - size_t(n);
    for (size_t i = token_bucket.size(); i-- > n0;) {
        const int32_t b = token_bucket[i];
        buckets[b].truncate(buckets[b].size() - 1);
        bucket_ids[b].pop_back();
    }
    if (probe == IVFAsymProbe::moment && !key_sum.empty()) {
        // summed again from the bucket's first token, in token order: the
        // sums the bucket had (add_moments adds in that order too)
        std::vector<float> scratch(d);
        std::vector<char> seen(buckets.size(), 0);
        bool any = false;
        for (size_t i = n0; i < token_bucket.size(); i++) {
            const int32_t b = token_bucket[i];
            if (b < n_centroids && !seen[b]) {
                seen[b] = 1;
                add_moments(b, 0, buckets[b].size(), scratch.data());
            }
        }
        for (int32_t b = 0; b < n_centroids; b++) {
            any = any || buckets[b].size() > 0;
        }
        if (!any) { // sized once a token is in a bucket, as before the append
            key_sum.clear();
            key_sq_sum.clear();
            bucket_mean.clear();
            bucket_var.clear();
        }
    }
    token_bucket.resize(n0);
}

void IndexIVFAsym::assign_tokens(idx_t n, const float* keys, const float* values) {
    std::vector<int32_t> assign(n, n_centroids); // the unassigned run until trained
    if (is_trained_models()) {
        assign_keys_to_buckets(
                keys, n, d, first_position + ntotal, rope, centroids.data(), n_centroids, assign.data());
    }
    // append bucket by bucket; undone on failure (a value the type cannot
    // hold, an allocation). What follows the loop allocates nothing: its
    // room is made here, before any bucket changes (writes_roll_back).
    std::vector<size_t> sizes(buckets.size());
    for (size_t b = 0; b < buckets.size(); b++) {
        sizes[b] = bucket_ids[b].size();
    }
    reserve_for_growth(token_bucket, token_bucket.size() + size_t(n));
    std::vector<float> scratch;
    const bool moments_were_empty = key_sum.empty();
    if (probe == IVFAsymProbe::moment &&
        std::any_of(assign.begin(), assign.end(), [&](int32_t b) { return b < n_centroids; })) {
        size_moments(); // sized once a token is in a bucket (check_invariants)
        scratch.resize(d);
    }
    try {
        for (idx_t i = 0; i < n; i++) {
            int32_t b = assign[i];
            buckets[b].append(1, keys + size_t(i) * d, values + size_t(i) * d_value);
            bucket_ids[b].push_back(ntotal + i);
        }
    } catch (...) {
        for (size_t b = 0; b < buckets.size(); b++) {
            buckets[b].truncate(idx_t(sizes[b]));
            bucket_ids[b].resize(sizes[b]);
        }
        if (moments_were_empty) {
            key_sum.clear();
            key_sq_sum.clear();
            bucket_mean.clear();
            bucket_var.clear();
        }
        throw;
    }
    token_bucket.insert(token_bucket.end(), assign.begin(), assign.end());
    if (probe == IVFAsymProbe::moment) {
        for (int32_t b = 0; b < n_centroids; b++) {
            idx_t added = idx_t(bucket_ids[b].size() - sizes[b]);
            if (added > 0) {
                add_moments(b, idx_t(sizes[b]), added, scratch.data());
            }
        }
    }
}

void IndexIVFAsym::size_moments() {
    const size_t C = size_t(n_centroids);
    if (key_sum.size() != C * d) {
        key_sum.assign(C * d, 0.0);
        key_sq_sum.assign(C * d, 0.0);
        bucket_mean.assign(C * d, 0.0f);
        bucket_var.assign(C * d, 0.0f);
    }
}

void IndexIVFAsym::add_moments(int32_t b, idx_t from, idx_t n, float* k) {
    double* s1 = key_sum.data() + size_t(b) * d;
    double* s2 = key_sq_sum.data() + size_t(b) * d;
    if (from == 0) {
        std::fill_n(s1, d, 0.0);
        std::fill_n(s2, d, 0.0);
    }
    // in token order, so that a bucket read back from a file gets the same sums
    for (idx_t i = from; i < from + n; i++) {
        buckets[b].key(i, k);
        for (int j = 0; j < d; j++) {
            s1[j] += k[j];
            s2[j] += double(k[j]) * k[j];
        }
    }
    const double count = double(buckets[b].size());
    for (int j = 0; j < d; j++) {
        double mean = count > 0 ? s1[j] / count : 0.0;
        bucket_mean[size_t(b) * d + j] = float(mean);
        // E[k^2] - mean^2 cancels to rounding for a constant coordinate
        bucket_var[size_t(b) * d + j] = float(count > 0 ? std::max(0.0, s2[j] / count - mean * mean) : 0.0);
    }
}

void IndexIVFAsym::clear_tokens() {
    for (size_t b = 0; b < buckets.size(); b++) {
        buckets[b].clear();
        bucket_ids[b].clear();
    }
    token_bucket.clear();
    key_sum.clear();
    key_sq_sum.clear();
    bucket_mean.clear();
    bucket_var.clear();
    ntotal = 0;
}

void IndexIVFAsym::reset_impl() {
    clear_tokens();
    first_position = 0;
    n_after = 0;
    group_size = 1;
    if (!adopted) { // models trained on the last prompt belong to it
        centroids.clear();
        qmodel = QModel();
    }
}

idx_t IndexIVFAsym::offset_in_bucket(idx_t key) const {
    const std::vector<idx_t>& ids = bucket_ids[token_bucket[key]];
    return idx_t(std::lower_bound(ids.begin(), ids.end(), key) - ids.begin());
}

void IndexIVFAsym::reconstruct_impl(idx_t key, float* recons) const {
    buckets[token_bucket[key]].key(offset_in_bucket(key), recons);
}

void IndexIVFAsym::reconstruct_value_impl(idx_t key, float* value) const {
    buckets[token_bucket[key]].value(offset_in_bucket(key), value);
}

size_t IndexIVFAsym::memory_bytes() const {
    size_t bytes = centroids.size() * sizeof(float) + qmodel.memory_bytes() +
            token_bucket.size() * sizeof(int32_t);
    for (size_t b = 0; b < buckets.size(); b++) {
        bytes += buckets[b].memory_bytes() + bucket_ids[b].size() * sizeof(idx_t);
    }
    return bytes;
}

// ---- probing -------------------------------------------------------------------

void IndexIVFAsym::check_probe_query(const float* q, idx_t position, const char* what) const {
    FAISS_THROW_IF_NOT_FMT(is_trained_models(), "IndexIVFAsym::%s: no centroids (not trained)", what);
    KVINDEX_CHECK_ARG(position >= 0, "IndexIVFAsym::%s: position=%zd must be >= 0", what, ssize_t(position));
    check_not_null(q, "IndexIVFAsym: query");
    check_input(q, 1, d, "IndexIVFAsym: query");
}

void IndexIVFAsym::bucket_scores(const float* q, idx_t position, float* scores) const {
    check_probe_query(q, position, "bucket_scores");
    check_not_null(scores, "IndexIVFAsym::bucket_scores: scores");
    bucket_scores_unchecked(q, position, scores);
}

void IndexIVFAsym::bucket_scores_unchecked(const float* q, idx_t position, float* scores) const {
    if (probe == IVFAsymProbe::oracle) {
        oracle_bucket_masses(q, scores);
        return;
    }
    if (probe == IVFAsymProbe::moment) {
        moment_bucket_masses(q, scores);
        return;
    }
    std::vector<float> x(q, q + d);
    if (probe != IVFAsymProbe::centroid_rope) {
        int64_t pos = std::max<idx_t>(0, position);
        invert_rope(1, d, x.data(), &pos, rope);
    }
    if (probe == IVFAsymProbe::qmodel && !qmodel.empty()) {
        qmodel.log_probs(1, x.data(), scores);
        for (int c = 0; c < n_centroids; c++) {
            scores[c] = std::exp(scores[c]); // probabilities: a group sums them
        }
    } else {
        inner_products_scaled(x.data(), centroids.data(), d, n_centroids, 1.0f, scores);
    }
}

void IndexIVFAsym::moment_log_masses(const float* q, float* log_masses) const {
    FAISS_THROW_IF_NOT_MSG(
            probe == IVFAsymProbe::moment, "IndexIVFAsym::moment_log_masses: needs the _Moment probe");
    check_probe_query(q, 0, "moment_log_masses");
    check_not_null(log_masses, "IndexIVFAsym::moment_log_masses: log_masses");
    moment_log_masses_unchecked(q, log_masses);
}

void IndexIVFAsym::moment_log_masses_unchecked(const float* q, float* log_masses) const {
    // log n_b + s <q, mean_b> + var_weight s^2 / 2 sum_j q_j^2 var_bj
    const float s = score_scale();
    std::vector<float> mean_dots(n_centroids, 0.0f), var_dots(n_centroids, 0.0f);
    if (!bucket_mean.empty()) {
        inner_products_scaled(q, bucket_mean.data(), d, n_centroids, s, mean_dots.data());
        if (var_weight > 0) {
            std::vector<float> q2(d);
            for (int j = 0; j < d; j++) {
                q2[j] = q[j] * q[j];
            }
            inner_products_scaled(
                    q2.data(), bucket_var.data(), d, n_centroids, 0.5f * var_weight * s * s, var_dots.data());
        }
    }
    for (int c = 0; c < n_centroids; c++) {
        idx_t n = buckets[c].size();
        log_masses[c] = n > 0 ? std::log(float(n)) + mean_dots[c] + var_dots[c]
                              : -std::numeric_limits<float>::infinity();
    }
}

void IndexIVFAsym::moment_bucket_masses(const float* q, float* masses) const {
    // shares of the estimated mass, which a GQA group can sum as it sums
    // the Q-model's probabilities
    moment_log_masses_unchecked(q, masses);
    if (std::any_of(masses, masses + n_centroids, [](float x) { return std::isfinite(x); })) {
        softmax_inplace(masses, nullptr, n_centroids);
    } else {
        std::fill_n(masses, n_centroids, 0.0f);
    }
}

void IndexIVFAsym::oracle_bucket_masses(const float* q, float* masses) const {
    // the lse of each bucket's scaled scores, then their softmax: the share
    // of q's attention (over this index's keys) in bucket b
    std::vector<float> lses(n_centroids, -std::numeric_limits<float>::infinity()), s;
    bool any = false;
    for (int c = 0; c < n_centroids; c++) {
        const KVStorage& st = buckets[c];
        if (st.size() > 0) {
            s.resize(size_t(st.size()));
            inner_products_scaled(q, st.key_rows(), s.size(), score_scale(), s.data());
            lses[c] = softmax_inplace(s.data(), nullptr, s.size());
            any = true;
        }
    }
    if (any) { // empty buckets (lse = -inf) get mass 0
        softmax_inplace(lses.data(), nullptr, lses.size());
        std::copy(lses.begin(), lses.end(), masses);
    } else {
        std::fill_n(masses, n_centroids, 0.0f);
    }
}

namespace {

/// The n best of C scores, best first, ties to the smaller bucket.
void top_buckets(const float* scores, int C, int n, int32_t* out) {
    std::vector<int32_t> order(C);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](int32_t a, int32_t b) {
        return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
    });
    std::copy(order.begin(), order.begin() + n, out);
}

} // namespace

void IndexIVFAsym::probe_buckets(const float* q, idx_t position, int n, int32_t* out) const {
    FAISS_THROW_IF_NOT_FMT(
            n >= 0 && n <= n_centroids && is_trained_models(),
            "IndexIVFAsym::probe_buckets: nprobe=%d outside [0, C=%d] or no centroids",
            n,
            n_centroids);
    check_probe_query(q, position, "probe_buckets");
    if (n > 0) {
        check_not_null(out, "IndexIVFAsym::probe_buckets: out");
    }
    std::vector<float> scores(n_centroids);
    bucket_scores_unchecked(q, position, scores.data());
    top_buckets(scores.data(), n_centroids, n, out);
}

int IndexIVFAsym::nprobe_for(const faiss::SearchParameters* params) const {
    if (auto p = dynamic_cast<const SearchParametersTopK*>(params)) {
        if (p->nprobe > 0) {
            KVINDEX_CHECK_ARG(
                    p->nprobe <= size_t(n_centroids),
                    "SearchParametersTopK: nprobe=%zd exceeds the C=%d buckets of IndexIVFAsym",
                    p->nprobe,
                    n_centroids);
            return int(p->nprobe);
        }
    }
    return nprobe;
}

std::vector<int32_t> IndexIVFAsym::buckets_to_read(const float* q, int n) const {
    std::vector<float> scores;
    if (is_trained_models() && n > 0) {
        scores.resize(n_centroids);
        bucket_scores_unchecked(q, query_position(), scores.data());
    }
    return buckets_of_scores(scores.empty() ? nullptr : scores.data(), n);
}

std::vector<int32_t> IndexIVFAsym::buckets_of_scores(const float* scores, int n) const {
    std::vector<int32_t> read;
    if (scores) {
        read.resize(n);
        top_buckets(scores, n_centroids, n, read.data());
    }
    if (!bucket_ids[n_centroids].empty()) {
        read.push_back(n_centroids); // tokens from before any training: always read
    }
    return read;
}

size_t IndexIVFAsym::probe_cost() const {
    if (!is_trained_models()) {
        return 0;
    }
    // float weights and centroids, as their bytes in stored keys (twice as
    // many under BF16 / FP16)
    if (probe == IVFAsymProbe::qmodel && !qmodel.empty()) {
        return key_equivalents(qmodel.flops_per_query() * sizeof(float)); // a weight per multiply-add
    }
    if (probe == IVFAsymProbe::oracle) {
        return size_t(ntotal); // every key scored
    }
    size_t rows = probe == IVFAsymProbe::moment && var_weight > 0
            ? 2 * size_t(n_centroids) // the means and the variances
            : size_t(n_centroids);
    return key_equivalents(rows * size_t(d) * sizeof(float));
}

void IndexIVFAsym::select_one(
        const float* q,
        Selection& sel,
        const faiss::SearchParameters* params) const {
    sel.clear();
    for (int32_t b : buckets_to_read(q, nprobe_for(params))) {
        for (idx_t id : bucket_ids[b]) {
            sel.push_back(id);
        }
    }
    sel.n_scanned = probe_cost();
}

void IndexIVFAsym::search_one(
        const float* q,
        idx_t k,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters* params) const {
    size_t heap_size = 0;
    for (int32_t b : buckets_to_read(q, nprobe_for(params))) {
        topk_inner_products(
                q, buckets[b].key_rows(), bucket_ids[b].size(), bucket_ids[b].data(), 0,
                size_t(k), distances, labels, &heap_size);
    }
    topk_heap_sort(distances, labels, heap_size);
    std::fill(distances + heap_size, distances + k, std::numeric_limits<float>::lowest());
    std::fill(labels + heap_size, labels + k, idx_t(-1));
}

float IndexIVFAsym::attend_one(const float* q, float* out, const faiss::SearchParameters* params)
        const {
    // exact attention over every key of the buckets read, merged by lse
    MergedAttention m(d_value);
    for (int32_t b : buckets_to_read(q, nprobe_for(params))) {
        const KVStorage& s = buckets[b];
        m.add(dense_attention(q, s.key_rows(), s.value_rows(), size_t(s.size()), score_scale(), m.part.data()));
    }
    std::copy(m.out.begin(), m.out.end(), out);
    return m.lse;
}

void IndexIVFAsym::attend_batch(
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    const idx_t g = group_size;
    if (!group_probe || g <= 1 || n % g != 0) {
        KVIndex::attend_batch(n, q, out, lse, params);
        return;
    }
    // one bucket set per position for the g heads (head-major: query
    // h * m + i is head h at position i), each bucket read once for all
    const idx_t m = n / g;
    const int np = nprobe_for(params);
    parallel_for(m, [&](idx_t i) {
        std::vector<float> qg(size_t(g) * d), scores(n_centroids, 0.0f), s(n_centroids);
        for (idx_t h = 0; h < g; h++) {
            std::copy_n(q + (h * m + i) * d, d, qg.data() + h * d);
        }
        const bool probing = is_trained_models() && np > 0;
        if (probing) {
            for (idx_t h = 0; h < g; h++) {
                bucket_scores_unchecked(qg.data() + h * d, query_position(), s.data());
                for (int c = 0; c < n_centroids; c++) {
                    scores[c] += s[c];
                }
            }
        }
        std::vector<int32_t> read = buckets_of_scores(probing ? scores.data() : nullptr, np);
        std::vector<MergedAttention> merged(g, MergedAttention(d_value));
        std::vector<float> part_out(size_t(g) * d_value), part_lse(g);
        for (int32_t b : read) {
            const KVStorage& st = buckets[b];
            dense_attention_group(
                    qg.data(), size_t(g), st.key_rows(), st.value_rows(), size_t(st.size()),
                    score_scale(), part_out.data(), part_lse.data());
            for (idx_t h = 0; h < g; h++) {
                std::copy_n(part_out.data() + h * d_value, d_value, merged[h].part.data());
                merged[h].add(part_lse[h]);
            }
        }
        for (idx_t h = 0; h < g; h++) {
            std::copy(merged[h].out.begin(), merged[h].out.end(), out + (h * m + i) * d_value);
            lse[h * m + i] = merged[h].lse;
        }
    });
}

// ---- parameters ----------------------------------------------------------------

bool IndexIVFAsym::reads_search_knob(const std::string& name) const {
    return name == "nprobe";
}

std::vector<ParameterInfo> IndexIVFAsym::parameter_info() const {
    std::vector<ParameterInfo> info = KVIndex::parameter_info();
    using P = ParameterInfo;
    info.push_back(P::integer("nprobe", 0, n_centroids, "buckets read per query (ell); C reads every key; 0 reads none (under a sink and window: those alone; bare: out = 0, lse = -inf)"));
    info.push_back(P::flag("group_probe", "1: one bucket set per GQA group in attend (summed classifier outputs), 0: per query"));
    info.push_back(P::real("var_weight", 0, 1, "_Moment: weight of the variance term (0: mean only, 1: Gaussian)"));
    info.push_back(P::integer("hidden", 1, 65536, "width of the self-trained Q-model").prefill());
    info.push_back(P::integer("train_iterations", 1, 1e7, "Adam steps of self-training; -1: 10 epochs of its rows, between 50 and 2000").prefill().also(-1));
    info.push_back(P::integer("min_distance", 0, P::kNoBound, "self-training: long range = more than this many tokens back; -1: the window (n_after)").prefill().also(-1));
    info.push_back(P::integer("seed", 0, P::kNoBound, "seed of self-training (with the per-head stream)").prefill());
    info.erase(std::remove_if(info.begin(), info.end(),
                              [&](const ParameterInfo& p) { return !probe_reads(p.name); }),
               info.end());
    return info;
}

bool IndexIVFAsym::probe_reads(const std::string& name) const {
    // a knob of another probe is not one of this index's: it would be taken
    // without effect, and a Choose of two probes hands it to both
    if (name == "var_weight") {
        return probe == IVFAsymProbe::moment;
    }
    if (name == "hidden" || name == "train_iterations" || name == "min_distance") {
        return probe == IVFAsymProbe::qmodel; // the Q-model's training
    }
    return true;
}

bool IndexIVFAsym::set_parameter(const std::string& name, double value) {
    if (!probe_reads(name)) {
        return false;
    }
    if (name == "nprobe") {
        FAISS_THROW_IF_NOT_FMT(
                is_count(value) && value <= n_centroids,
                "parameter nprobe=%g must be an integer in [0, C=%d]",
                value,
                n_centroids);
        nprobe = int(value);
    } else if (name == "group_probe") {
        group_probe = flag_parameter(name, value);
    } else if (name == "var_weight") {
        FAISS_THROW_IF_NOT_FMT(
                std::isfinite(value) && value >= 0 && value <= 1,
                "parameter var_weight=%g must be in [0, 1]",
                value);
        var_weight = float(value);
    } else if (name == "hidden") {
        FAISS_THROW_IF_NOT_FMT(
                is_positive_integer(value) && value <= 65536,
                "parameter hidden=%g must be an integer in [1, 65536]",
                value);
        hidden = int(value);
    } else if (name == "train_iterations") {
        FAISS_THROW_IF_NOT_FMT(
                value == -1 || (is_positive_integer(value) && value <= 1e7),
                "parameter train_iterations=%g must be -1 or in [1, 1e7]",
                value);
        train_iterations = int(value);
    } else if (name == "min_distance") {
        FAISS_THROW_IF_NOT_FMT(
                value == -1 || is_count(value),
                "parameter min_distance=%g must be -1 or an integer >= 0",
                value);
        min_distance = idx_t(value);
    } else if (name == "seed") {
        seed = count_parameter(name, value);
    } else {
        return KVIndex::set_parameter(name, value);
    }
    return true;
}

bool IndexIVFAsym::get_parameter(const std::string& name, double* value) const {
    if (!probe_reads(name)) {
        return false;
    }
    if (name == "nprobe") {
        *value = nprobe;
    } else if (name == "group_probe") {
        *value = group_probe ? 1 : 0;
    } else if (name == "var_weight") {
        *value = var_weight;
    } else if (name == "hidden") {
        *value = hidden;
    } else if (name == "train_iterations") {
        *value = train_iterations;
    } else if (name == "min_distance") {
        *value = double(min_distance);
    } else if (name == "seed") {
        *value = double(seed);
    } else {
        return KVIndex::get_parameter(name, value);
    }
    return true;
}

void IndexIVFAsym::set_stream(uint64_t s) {
    stream = s;
    KVIndex::set_stream(s);
}

// ---- io ------------------------------------------------------------------------

void IndexIVFAsym::write_fields(BufferWriter& w) const {
    w.value<int32_t>(n_centroids);
    w.value<int32_t>(int32_t(probe));
    w.value<int32_t>(nprobe);
    w.value<uint8_t>(group_probe);
    w.value<int32_t>(hidden);
    w.value<int32_t>(train_iterations);
    w.value<int64_t>(min_distance);
    w.value<uint64_t>(seed);
    w.value<uint64_t>(stream);
    w.value<uint8_t>(adopted);
    // train_seconds is not written (from record version 3): two saves of
    // one index give the same bytes whatever the clock said
    w.value<int64_t>(first_position);
    w.value<int64_t>(n_after);
    w.value<int32_t>(group_size);
    w.value<float>(var_weight); // from record version 2
    w.vector(centroids);
    w.value<uint8_t>(!qmodel.empty());
    if (!qmodel.empty()) {
        qmodel.write(w);
    }
    for (size_t b = 0; b < buckets.size(); b++) {
        w.vector(bucket_ids[b]);
        buckets[b].write(w);
    }
}

void IndexIVFAsym::read_fields(BufferReader& r, uint32_t version) {
    n_centroids = r.value<int32_t>("IVFAsym C");
    int32_t p = r.value<int32_t>("IVFAsym probe");
    nprobe = r.value<int32_t>("IVFAsym nprobe");
    uint8_t gp = r.value<uint8_t>("IVFAsym group_probe");
    hidden = r.value<int32_t>("IVFAsym hidden");
    train_iterations = r.value<int32_t>("IVFAsym train_iterations");
    min_distance = r.value<int64_t>("IVFAsym min_distance");
    seed = r.value<uint64_t>("IVFAsym seed");
    stream = r.value<uint64_t>("IVFAsym stream");
    uint8_t ad = r.value<uint8_t>("IVFAsym adopted");
    if (version <= 2) {
        r.value<double>("IVFAsym train_seconds"); // a timing, not the index's: dropped
    }
    train_seconds = 0;
    first_position = r.value<int64_t>("IVFAsym first_position");
    n_after = r.value<int64_t>("IVFAsym n_after");
    group_size = r.value<int32_t>("IVFAsym group_size");
    var_weight = version >= 2 ? r.value<float>("IVFAsym var_weight") : 0.0f; // v1: no moment probe
    FAISS_THROW_IF_NOT_FMT(
            n_centroids >= 1 && n_centroids <= kMaxCentroids && p >= 0 && p <= int32_t(IVFAsymProbe::moment) && gp <= 1 &&
                    ad <= 1 && d % 2 == 0 && std::isfinite(var_weight) && var_weight >= 0 && var_weight <= 1,
            "read_index: invalid IVFAsym header (C=%d probe=%d group_probe=%d adopted=%d d=%d var_weight=%g)",
            n_centroids,
            p,
            int(gp),
            int(ad),
            d,
            double(var_weight));
    probe = IVFAsymProbe(p);
    group_probe = gp == 1;
    adopted = ad == 1;
    centroids = r.vector<float>("IVFAsym centroids");
    uint8_t has_model = r.value<uint8_t>("IVFAsym has Q-model");
    FAISS_THROW_IF_NOT_FMT(has_model <= 1, "read_index: invalid IVFAsym Q-model flag %d", int(has_model));
    qmodel = QModel();
    if (has_model) {
        qmodel.read(r);
    }
    FAISS_THROW_IF_NOT_FMT(
            ntotal <= idx_t(std::numeric_limits<int32_t>::max()),
            "read_index: IVFAsym ntotal=%zd too large",
            size_t(ntotal));
    buckets.assign(n_centroids + 1, KVStorage(d, d_value, kv_type));
    bucket_ids.assign(n_centroids + 1, {});
    // the buckets first (each bounded by the bytes left), so that a forged
    // ntotal cannot make token_bucket allocate what the file does not hold
    size_t in_buckets = 0;
    for (int b = 0; b <= n_centroids; b++) {
        bucket_ids[b] = r.vector<idx_t>("IVFAsym bucket ids");
        buckets[b].read(r, "IVFAsym bucket");
        in_buckets += bucket_ids[b].size();
    }
    FAISS_THROW_IF_NOT_FMT(
            in_buckets == size_t(ntotal),
            "read_index: IVFAsym buckets hold %zd tokens, ntotal is %zd",
            in_buckets,
            size_t(ntotal));
    token_bucket.assign(ntotal, -1);
    for (int b = 0; b <= n_centroids; b++) {
        for (idx_t id : bucket_ids[b]) { // before any token_bucket lookup
            FAISS_THROW_IF_NOT_FMT(
                    id >= 0 && id < ntotal && token_bucket[id] == -1,
                    "read_index: IVFAsym bucket %d holds token %zd (out of [0, %zd) or twice)",
                    b,
                    size_t(id),
                    size_t(ntotal));
            token_bucket[id] = b;
        }
    }
    if (probe == IVFAsymProbe::moment) {
        std::vector<float> scratch(d);
        for (int b = 0; b < n_centroids; b++) {
            if (buckets[b].size() > 0) { // as assign_tokens does
                size_moments();
                add_moments(b, 0, buckets[b].size(), scratch.data());
            }
        }
    }
}

void IndexIVFAsym::check_invariants() const {
    KVIndex::check_invariants();
    check_seed_knob(seed, "IndexIVFAsym");
    FAISS_THROW_IF_NOT_FMT(
            n_centroids >= 1 && n_centroids <= kMaxCentroids && nprobe >= 0 &&
                    nprobe <= n_centroids && hidden >= 1 && hidden <= 65536 &&
                    (train_iterations == -1 || train_iterations >= 1) && min_distance >= -1 &&
                    first_position >= 0 && n_after >= 0 && group_size >= 1,
            "IndexIVFAsym: invalid knobs (C=%d nprobe=%d hidden=%d train_iterations=%d "
            "min_distance=%zd first_position=%zd n_after=%zd group_size=%d)",
            n_centroids,
            nprobe,
            hidden,
            train_iterations,
            size_t(min_distance),
            size_t(first_position),
            size_t(n_after),
            group_size);
    // what the reader refuses in the header (the fields are public)
    FAISS_THROW_IF_NOT_FMT(
            int(probe) >= 0 && int(probe) <= int(IVFAsymProbe::moment) && d % 2 == 0 &&
                    std::isfinite(var_weight) && var_weight >= 0 && var_weight <= 1,
            "IndexIVFAsym: invalid probe=%d, d=%d or var_weight=%g",
            int(probe),
            d,
            double(var_weight));
    // positions first_position .. + ntotal + n_after must not wrap
    FAISS_THROW_IF_NOT_FMT(
            first_position <= kMaxPosition && n_after <= kMaxPosition &&
                    ntotal <= kMaxPosition - first_position - n_after,
            "IndexIVFAsym: first_position=%zd + ntotal=%zd + n_after=%zd must be <= 2^62",
            ssize_t(first_position),
            ssize_t(ntotal),
            ssize_t(n_after));
    FAISS_THROW_IF_NOT_FMT(
            centroids.empty() || centroids.size() == size_t(n_centroids) * d,
            "IndexIVFAsym: %zd centroid floats, expected 0 or C * d = %d * %d",
            centroids.size(),
            n_centroids,
            d);
    check_finite(centroids.data(), idx_t(centroids.size() / std::max(d, 1)), d, "IndexIVFAsym: centroids");
    FAISS_THROW_IF_NOT_MSG(
            qmodel.empty() || (!centroids.empty() && qmodel.d == d && qmodel.n_classes == n_centroids),
            "IndexIVFAsym: a Q-model without centroids, or of the wrong shape");
    FAISS_THROW_IF_NOT_MSG(
            !is_trained_models() || has_rope, "IndexIVFAsym: trained models without RoPE parameters");
    FAISS_THROW_IF_NOT_FMT(
            buckets.size() == size_t(n_centroids) + 1 && bucket_ids.size() == buckets.size() &&
                    token_bucket.size() == size_t(ntotal),
            "IndexIVFAsym: %zd buckets / %zd id lists / %zd token buckets disagree with C=%d, ntotal=%zd",
            buckets.size(),
            bucket_ids.size(),
            token_bucket.size(),
            n_centroids,
            size_t(ntotal));
    const size_t assigned = size_t(ntotal) - bucket_ids[n_centroids].size();
    const bool moments = probe == IVFAsymProbe::moment && assigned > 0;
    FAISS_THROW_IF_NOT_FMT(
            bucket_mean.size() == (moments ? size_t(n_centroids) * d : 0) &&
                    bucket_var.size() == bucket_mean.size() && key_sum.size() == bucket_mean.size() &&
                    key_sq_sum.size() == bucket_mean.size(),
            "IndexIVFAsym: %zd bucket-mean floats, expected %zd (moment probe with assigned tokens: C * d)",
            bucket_mean.size(),
            moments ? size_t(n_centroids) * d : size_t(0));
    size_t total = 0;
    for (size_t b = 0; b < buckets.size(); b++) {
        const std::vector<idx_t>& ids = bucket_ids[b];
        const KVStorage& s = buckets[b];
        FAISS_THROW_IF_NOT_FMT(
                s.d == size_t(d) && s.d_value == size_t(d_value) && s.type == kv_type &&
                        s.size() == idx_t(ids.size()) && std::is_sorted(ids.begin(), ids.end()) &&
                        (is_trained_models() || b == size_t(n_centroids) || ids.empty()),
                "IndexIVFAsym: bucket %zd: %zd tokens stored, %zd ids (sorted ids, matching "
                "storage, and no bucket before training expected)",
                b,
                size_t(s.size()),
                ids.size());
        for (idx_t id : ids) {
            FAISS_THROW_IF_NOT_FMT(
                    id >= 0 && id < ntotal && token_bucket[id] == int32_t(b),
                    "IndexIVFAsym: bucket %zd lists token %zd, which is not in it",
                    b,
                    size_t(id));
        }
        total += ids.size();
    }
    FAISS_THROW_IF_NOT_FMT(
            total == size_t(ntotal),
            "IndexIVFAsym: the buckets hold %zd tokens, ntotal=%zd",
            total,
            size_t(ntotal));
}

} // namespace kvindex
