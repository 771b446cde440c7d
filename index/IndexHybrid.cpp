#include <kvindex/IndexHybrid.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/IndexLSHSample.h>
#include <kvindex/attention.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>

#include "checks.h"
#include "parallel.h"
#include "query_rows.h"

namespace kvindex {

namespace {

/// sum over j < n of term(j), in double, over 8 independent running sums:
/// one sum waits on its own last addition, and the predictor's sums run
/// over every key of every calibration query
template <class Term>
double sum_in_lanes(int n, Term term) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        for (int u = 0; u < 8; u++) {
            acc[u] += term(j + u);
        }
    }
    for (; j < n; j++) {
        acc[0] += term(j);
    }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

} // namespace

double normal_two_sided_quantile(double delta) {
    FAISS_THROW_IF_NOT_FMT(delta > 0 && delta < 1, "delta=%g must be in (0, 1)", delta);
    // bisection on erfc: called once per prefill, 100 halvings reach double precision
    double lo = 0, hi = 40;
    for (int it = 0; it < 100; it++) {
        double mid = 0.5 * (lo + hi);
        (std::erfc(mid / std::sqrt(2.0)) > delta ? lo : hi) = mid;
    }
    return 0.5 * (lo + hi);
}

double TailStatistics::predicted_error(double m) const {
    if (m <= 0) {
        return topk_error;
    }
    if (m >= n_tail) {
        return 0;
    }
    return std::sqrt(std::max(0.0, variance_factor * (1 / m - 1 / n_tail)));
}

double TailStatistics::sample_for_error(double epsilon, double z) const {
    if (n_tail <= 0) {
        return 0;
    }
    // z^2 A (1/m - 1/n) <= eps^2  <=>  m >= z^2 A / (eps^2 + z^2 A / n)
    double a = z * z * variance_factor;
    if (a <= 0) {
        // every tail token contributes alike: one draw is exact, none
        // leaves the top-k error
        return z * topk_error <= epsilon ? 0 : 1;
    }
    return std::min(n_tail, a / (epsilon * epsilon + a / n_tail));
}

std::vector<TailStatistics> tail_statistics(
        const float* keys,
        const float* values,
        idx_t n,
        int d,
        int dv,
        const float* queries,
        idx_t n_q,
        const idx_t* n_keys,
        const std::vector<idx_t>& ks) {
    FAISS_THROW_IF_NOT_MSG(
            std::is_sorted(ks.begin(), ks.end()), "tail_statistics: ks must be increasing");
    const double scale = 1.0 / std::sqrt(double(d));
    const size_t nk_sizes = ks.size();
    std::vector<TailStatistics> stats(size_t(n_q) * nk_sizes);
    parallel_for(n_q, [&](idx_t qi) {
        const idx_t nk = std::min(n_keys[qi], n);
        const float* q = queries + qi * d;
        std::vector<double> s(nk);
        for (idx_t i = 0; i < nk; i++) {
            const float* key = keys + i * d;
            s[i] = sum_in_lanes(d, [&](int j) { return double(q[j]) * double(key[j]); }) * scale;
        }
        // the heaviest max(ks) tokens in order (ties by position); the rest
        // need none
        std::vector<idx_t> order(nk);
        std::iota(order.begin(), order.end(), idx_t(0));
        auto heavier = [&](idx_t a, idx_t b) {
            return s[a] > s[b] || (s[a] == s[b] && a < b);
        };
        const idx_t top = std::min<idx_t>(nk, ks.empty() ? 0 : ks.back());
        std::nth_element(order.begin(), order.begin() + top, order.end(), heavier);
        std::sort(order.begin(), order.begin() + top, heavier);
        const double mx = nk > 0 ? *std::max_element(s.begin(), s.end()) : 0;
        std::vector<double> w(nk), o(dv, 0.0);
        double total = 0;
        for (idx_t i = 0; i < nk; i++) {
            w[i] = std::exp(s[i] - mx);
            total += w[i];
            for (int j = 0; j < dv; j++) {
                o[j] += w[i] * values[i * dv + j];
            }
        }
        double o2 = 0;
        for (int j = 0; j < dv; j++) {
            o[j] /= std::max(total, 1e-300);
            o2 += o[j] * o[j];
        }
        // c_i = w_i (v_i - o): sum_i c_i = 0, so the tail's sum is minus
        // the heavy part's; the tail's sum of |c_i|^2 is the total minus it
        std::vector<double> c2(nk);
        double c2_total = 0;
        for (idx_t i = 0; i < nk; i++) {
            const float* v = values + i * dv;
            c2[i] = w[i] * w[i] * sum_in_lanes(dv, [&](int j) {
                        const double e = double(v[j]) - o[j];
                        return e * e;
                    });
            c2_total += c2[i];
        }
        std::vector<double> head_sum(dv, 0.0);
        double head_w = 0, head_c2 = 0;
        idx_t r = 0;
        for (size_t t = 0; t < nk_sizes; t++) {
            const idx_t k = std::min(ks[t], nk);
            for (; r < k; r++) {
                idx_t i = order[r];
                head_w += w[i];
                head_c2 += c2[i];
                for (int j = 0; j < dv; j++) {
                    head_sum[j] += w[i] * (values[i * dv + j] - o[j]);
                }
            }
            double p2 = 0;
            for (int j = 0; j < dv; j++) {
                p2 += head_sum[j] * head_sum[j];
            }
            TailStatistics& st = stats[size_t(qi) * nk_sizes + t];
            st.k = ks[t];
            st.n_tail = double(nk - k);
            const double norm = std::max(total * total * o2, 1e-300);
            if (st.n_tail > 1) {
                // the tail's c_i variance with n_R - 1, as sampling without
                // replacement wants it: Var(n_R mean_S c) = n_R^2 S^2 (1/m - 1/n_R)
                double ss = (c2_total - head_c2) - p2 / st.n_tail; // sum (c_i - mean c)^2
                double var = ss / (st.n_tail - 1);
                st.variance_factor = st.n_tail * st.n_tail * std::max(var, 0.0) / norm;
            }
            st.topk_error = head_w > 0 ? std::sqrt(p2 / std::max(o2, 1e-300)) / head_w
                                       : (o2 > 0 ? 1.0 : 0.0);
        }
    });
    return stats;
}

IndexHybrid::IndexHybrid() : KVIndex(0, 0) {}

IndexHybrid::IndexHybrid(std::unique_ptr<KVIndex> heavy_index, std::unique_ptr<KVIndex> tail_index)
        : KVIndex(heavy_index ? heavy_index->d : 0,
                  heavy_index ? heavy_index->d_value : 0,
                  heavy_index ? heavy_index->kv_type : KVType::f32),
          heavy(std::move(heavy_index)),
          tail(std::move(tail_index)),
          storage(d, d_value, kv_type) {
    FAISS_THROW_IF_NOT_MSG(heavy && tail, "IndexHybrid: heavy or tail index missing (nullptr)");
    FAISS_THROW_IF_NOT_FMT(
            tail->d == d && tail->d_value == d_value && tail->kv_type == kv_type,
            "IndexHybrid: tail %s has d=%d, d_value=%d; heavy %s has d=%d, d_value=%d",
            tail->factory_string().c_str(),
            tail->d,
            tail->d_value,
            heavy->factory_string().c_str(),
            d,
            d_value);
    FAISS_THROW_IF_NOT_MSG(
            heavy->ntotal == 0 && tail->ntotal == 0, "IndexHybrid: heavy and tail must be empty");
    check_heavy_is_deterministic();
    lend_tokens();
}

void IndexHybrid::lend_tokens() {
    if (const KVStorage* t = heavy->stored_tokens()) {
        tail->share_tokens(t); // false, changing nothing, for a tail that keeps its own
    }
}

const KVStorage& IndexHybrid::tokens() const {
    if (const KVStorage* t = heavy->stored_tokens()) {
        return *t;
    }
    if (const KVStorage* t = tail->stored_tokens()) {
        return *t;
    }
    return storage;
}

bool IndexHybrid::holds_own_tokens() const {
    return &tokens() == &storage;
}

void IndexHybrid::check_heavy_is_deterministic() const {
    // the estimate adds the tail's sample to a set counted in full: a
    // sampled heavy part would be weighted as if read whole (refused here,
    // not at the first select, which a prompt shorter than k never reaches)
    FAISS_THROW_IF_NOT_FMT(
            heavy->selects_deterministically(),
            "IndexHybrid: the heavy part %s samples its keys; it must select "
            "deterministically (TopK, RoarGraph, IVFAsym, ...)",
            heavy->factory_string().c_str());
}

std::unique_ptr<KVIndex> IndexHybrid::from_factory(FactoryChain& chain) {
    const std::string e = chain.peek();
    const std::string open = "Hybrid(";
    if (e.compare(0, open.size(), open) != 0) {
        return nullptr;
    }
    FAISS_THROW_IF_NOT_FMT(
            e.back() == ')',
            "index_factory: '%s' in '%s': expected Hybrid(<heavy>,<tail>)",
            e.c_str(),
            chain.description().c_str());
    chain.take();
    FactoryChain parts(
            chain.d, chain.d_value, e.substr(open.size(), e.size() - open.size() - 1), chain.kv_type);
    FAISS_THROW_IF_NOT_FMT(
            !parts.at_end() && !parts.peek().empty(),
            "index_factory: '%s': the heavy index is missing",
            e.c_str());
    // each part is one element (the grammar's `inner`): a wrapper would take
    // the tail as its inner index, and its printed string would not say
    // where the heavy part ends ("Hybrid(ProxyEvict20,Flat,Uniform)")
    auto one_element = [&](const char* part) {
        const size_t start = parts.position();
        const std::string first = parts.peek();
        std::unique_ptr<KVIndex> index = parts.parse_next();
        FAISS_THROW_IF_NOT_FMT(
                parts.position() == start + 1,
                "index_factory: '%s': the %s index must be one element (Hybrid(<inner>,<inner>)); "
                "'%s' wraps what follows it",
                e.c_str(),
                part,
                first.c_str());
        return index;
    };
    std::unique_ptr<KVIndex> heavy = one_element("heavy");
    FAISS_THROW_IF_NOT_FMT(
            !parts.at_end() && !parts.peek().empty(),
            "index_factory: '%s': the tail index is missing (Hybrid(<heavy>,<tail>))",
            e.c_str());
    std::unique_ptr<KVIndex> tail = one_element("tail");
    FAISS_THROW_IF_NOT_FMT(
            parts.at_end(),
            "index_factory: '%s': '%s' follows the tail (Hybrid takes two indexes)",
            e.c_str(),
            parts.peek().c_str());
    return std::make_unique<IndexHybrid>(std::move(heavy), std::move(tail));
}

void IndexHybrid::add_kv_impl(idx_t n, const float* keys, const float* values) {
    // the heavy part first (a tail it lends its tokens to checks them),
    // undoably where it can: a tail that throws then leaves both as they
    // were (appends_roll_back; with tokens of its own, which come last, a
    // throw marks the index failed)
    const bool heavy_undoable = heavy->can_undo_add();
    if (heavy_undoable) {
        heavy->add_kv_undoable(n, keys, values);
    } else {
        heavy->add_kv(n, keys, values);
    }
    try {
        add_kv_to(*tail, n, keys, values);
        if (holds_own_tokens()) {
            storage.append(n, keys, values);
        }
    } catch (...) {
        if (heavy_undoable) {
            heavy->undo_add_kv();
        }
        throw;
    }
    if (!keeping_undo()) {
        heavy->forget_undo();
    }
}

void IndexHybrid::undo_add_kv_impl(idx_t n) {
    if (holds_own_tokens()) {
        storage.truncate(ntotal - n);
    }
    tail->undo_add_kv(); // before the heavy part, which may lend it its tokens
    heavy->undo_add_kv();
}

bool IndexHybrid::appends_roll_back() const {
    // the heavy part's append is taken back when the tail's throws
    return heavy && tail && heavy->can_undo_add() && heavy->appends_roll_back() &&
            tail->appends_roll_back() && !holds_own_tokens();
}

bool IndexHybrid::can_undo_add() const {
    return heavy && tail && heavy->can_undo_add() && tail->can_undo_add();
}

void IndexHybrid::prefill_impl(const PrefillInput& in) {
    check_prefill(in);
    // the knobs checked before anything is added: a refused prefill fixes nothing
    KVINDEX_CHECK_ARG(
            !(epsilon > 0 && budget > 0),
            "IndexHybrid: epsilon=%g and budget=%zd are two calibrations: set one",
            epsilon,
            size_t(budget));
    KVINDEX_CHECK_ARG(
            epsilon == 0 || tail->samples_uniformly(),
            "IndexHybrid: epsilon sets the sample of a uniform tail, and %s does not sample "
            "uniformly (use Uniform, or budget, which any tail takes)",
            tail->factory_string().c_str());
    // both calibrations model the heavy part as the exact top-k of its k
    KVINDEX_CHECK_ARG(
            (epsilon == 0 && budget <= 0) || heavy->reads_search_knob("k"),
            "IndexHybrid: epsilon and budget calibrate the tail against the heavy part's "
            "top-k, and the heavy part %s has no k (use a top-k: TopK, RoarGraph)",
            heavy->factory_string().c_str());
    heavy->prefill(in);
    tail->prefill(in);
    if (holds_own_tokens()) {
        storage.append(in.n_tokens, in.keys, in.values);
    }
    ntotal = in.n_tokens;
    rope = in.rope;
    has_rope = true;
    if (epsilon > 0 || budget > 0 || splits_by_default()) {
        calibrate(in);
    }
}

bool IndexHybrid::splits_by_default() const {
    return budget < 0 && epsilon == 0 && !split_given && heavy->reads_search_knob("k");
}

void IndexHybrid::calibrate(const PrefillInput& in) {
    // the split's knobs as they were: a calibration that throws part-way (an
    // allocation), having set some split to measure it, gives them back, as
    // a refused prefill fixes nothing
    const idx_t k0 = k, sample0 = sample, calibrated_k0 = calibrated_k, calibrated_sample0 = calibrated_sample;
    const bool heavy_k = heavy->reads_search_knob("k");
    const double heavy_k0 = heavy_k ? get_index_parameter(heavy.get(), "k") : 0;
    const bool capped = tail->reads_search_knob("max_sample");
    const double cap0 = capped ? get_index_parameter(tail.get(), "max_sample") : 0;
    try {
        calibrate_split(in);
    } catch (...) {
        if (heavy_k) {
            set_index_parameter(heavy.get(), "k", heavy_k0);
        }
        if (capped) {
            set_index_parameter(tail.get(), "max_sample", cap0);
        }
        k = k0;
        sample = sample0;
        calibrated_k = calibrated_k0;
        calibrated_sample = calibrated_sample0;
        throw;
    }
}

void IndexHybrid::calibrate_split(const PrefillInput& in) {
    // the last n_calibration query positions of every head of the group,
    // each attending causally to the keys at or before it
    const idx_t n_use = std::min(n_calibration, in.n_queries);
    const int g = in.n_query_heads;
    std::vector<idx_t> last(n_use);
    std::iota(last.begin(), last.end(), in.n_queries - n_use);
    std::vector<float> queries = gather_query_rows(in.queries, g, in.n_queries, last, d);
    std::vector<idx_t> n_keys(size_t(n_use) * g);
    for (int h = 0; h < g; h++) {
        for (idx_t j = 0; j < n_use; j++) {
            idx_t pos = in.query_position(last[j]);
            n_keys[size_t(h) * n_use + j] = std::clamp<idx_t>(pos - in.first_position + 1, 0, in.n_tokens);
        }
    }
    const idx_t n_rows = idx_t(n_keys.size());
    if (n_rows == 0) {
        return; // no queries: the knobs stay as given
    }
    auto stats_for = [&](const std::vector<idx_t>& ks) {
        return tail_statistics(
                in.keys, in.values, in.n_tokens, d, d_value, queries.data(), n_rows,
                n_keys.data(), ks);
    };
    idx_t k_heavy = heavy->top_k_budget(), m = 0;
    if (k_heavy == 0) {
        // the heavy part as prefilled has no top-k (a Choose that chose
        // Flat: every token read): nothing to calibrate, the knobs stay as
        // given; prefill refused heavy types without any
        calibrated_k = -1;
        calibrated_sample = -1;
        return;
    }
    // the reads to split: the budget given, or (-1) what the hybrid as
    // given reads on these queries, its heavy k and its tail's own sample
    idx_t total = budget;
    if (epsilon == 0 && budget < 0) {
        std::vector<Selection> sel(n_rows);
        select_batch(n_rows, queries.data(), sel.data(), nullptr);
        double read = 0;
        for (const Selection& s : sel) {
            read += double(s.size());
        }
        total = std::max<idx_t>(1, idx_t(std::llround(read / double(n_rows))));
    }
    if (epsilon > 0) {
        const double z = normal_two_sided_quantile(delta);
        std::vector<TailStatistics> st = stats_for({k_heavy});
        std::vector<double> need;
        for (const TailStatistics& x : st) {
            need.push_back(x.sample_for_error(epsilon, z));
        }
        // nearest-rank (1 - delta) quantile over the calibration queries
        std::sort(need.begin(), need.end());
        size_t rank = size_t(std::ceil((1 - delta) * double(need.size())));
        m = idx_t(std::ceil(need[std::clamp<size_t>(rank, 1, need.size()) - 1]));
    } else if (!tail->samples_uniformly()) {
        // a tail whose error has no closed form (LSH, weighted): the split
        // with the lowest error measured on the same queries
        measure_split(queries.data(), n_rows, total);
        return;
    } else {
        // the split of `total` with the lowest mean predicted error
        constexpr int kSteps = 8;
        std::vector<idx_t> ks;
        for (int f = 0; f <= kSteps; f++) {
            ks.push_back(std::max<idx_t>(1, total * f / kSteps));
        }
        std::vector<TailStatistics> st = stats_for(ks);
        double best = std::numeric_limits<double>::infinity();
        for (size_t t = 0; t < ks.size(); t++) {
            double err = 0;
            for (idx_t row = 0; row < n_rows; row++) {
                err += st[size_t(row) * ks.size() + t].predicted_error(double(total - ks[t]));
            }
            if (err < best) {
                best = err;
                k_heavy = ks[t];
                m = total - ks[t];
            }
        }
        // through the chain walk, as "k=..." would: the heavy part's whole chain
        set_index_parameter(heavy.get(), "k", double(k_heavy));
        k = k_heavy;
    }
    sample = m;
    calibrated_k = k_heavy;
    calibrated_sample = m;
}

void IndexHybrid::set_split(idx_t k_heavy, idx_t m) {
    // through the chain walk, as "k=..." would: the heavy part's whole chain
    set_index_parameter(heavy.get(), "k", double(k_heavy));
    k = k_heavy;
    sample = m;
    if (m > 0 && tail->reads_search_knob("max_sample")) {
        // an LSH tail's sample is set by its tables: capped at m, by score
        set_index_parameter(tail.get(), "max_sample", double(m));
    }
    calibrated_k = k_heavy;
    calibrated_sample = m;
}

void IndexHybrid::measure_split(const float* queries, idx_t n_rows, idx_t total) {
    // the reference: exact attention over the tokens this index holds (the
    // queries are the prompt's last: they see a few tokens after theirs,
    // as every candidate does)
    const KVStorage& t = tokens();
    std::vector<float> exact(size_t(n_rows) * d_value);
    parallel_for(n_rows, [&](idx_t i) {
        exact_attention(queries + size_t(i) * d, t.key_rows(), t.value_rows(), size_t(ntotal),
                        &exact[size_t(i) * d_value]);
    });
    // an LSH tail's own cap, given back where the split reads no tail
    double own_cap = 0;
    const bool capped = tail->reads_search_knob("max_sample");
    if (capped) {
        own_cap = get_index_parameter(tail.get(), "max_sample");
    }
    constexpr int kSteps = 8;
    std::vector<float> out(size_t(n_rows) * d_value), lse(n_rows);
    double best = std::numeric_limits<double>::infinity();
    idx_t best_k = total, best_m = 0;
    for (int f = kSteps; f >= 0; f--) { // from plain top-k: it wins ties
        const idx_t k_f = std::max<idx_t>(1, total * f / kSteps);
        set_split(k_f, total - k_f);
        attend_batch(n_rows, queries, out.data(), lse.data(), nullptr);
        const double err = mean_relative_error(out.data(), exact.data(), size_t(n_rows), size_t(d_value));
        if (err < best) {
            best = err;
            best_k = k_f;
            best_m = total - k_f;
        }
    }
    set_split(best_k, best_m);
    if (capped && best_m == 0) {
        set_index_parameter(tail.get(), "max_sample", own_cap);
    }
}

void IndexHybrid::search_batch(
        idx_t n,
        const float* q,
        idx_t k,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters* params) const {
    std::unique_ptr<SearchParametersKV> copy; // without the tail's knobs
    heavy->search(n, q, k, distances, labels, params_for(*heavy, params, copy));
}

void IndexHybrid::select_batch(
        idx_t n,
        const float* q,
        Selection* sel,
        const faiss::SearchParameters* params) const {
    std::unique_ptr<SearchParametersKV> copy; // without the tail's knobs
    heavy->select(n, q, sel, params_for(*heavy, params, copy));
    // the tail's k is `sample`; the caller's LSH knobs are the tail's
    // (the heavy part has none), the rest are the heavy part's
    SearchParametersLSH tail_params;
    if (auto p = dynamic_cast<const SearchParametersLSH*>(params)) {
        tail_params = *p;
    }
    tail_params.k = std::max<idx_t>(sample, 0); // 0: the tail's own k
    std::unique_ptr<SearchParametersKV> tail_copy; // a uniform tail reads none
    const faiss::SearchParameters* tail_knobs = params_for(*tail, &tail_params, tail_copy);
    parallel_for(n, [&](idx_t i) {
        Selection& s = sel[i];
        for (float u : s.inclusion) {
            FAISS_THROW_IF_NOT_FMT(
                    u == 1.0f,
                    "IndexHybrid: the heavy part %s must select deterministically (u = 1), "
                    "got u = %g",
                    heavy->factory_string().c_str(),
                    u);
        }
        std::sort(s.ids.begin(), s.ids.end());
        if (sample == 0) {
            return;
        }
        Selection t;
        tail->select_outside(q + i * d, s.ids.data(), s.ids.size(), t, tail_knobs);
        s.ids.insert(s.ids.end(), t.ids.begin(), t.ids.end());
        s.inclusion.insert(s.inclusion.end(), t.inclusion.begin(), t.inclusion.end());
        s.n_scanned += t.n_scanned;
    });
}

void IndexHybrid::attend_batch(
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    std::vector<Selection> sel(n);
    select_batch(n, q, sel.data(), params);
    estimate_batch(n, q, sel.data(), out, lse);
}

void IndexHybrid::reset_impl() {
    heavy->reset();
    tail->reset();
    storage.clear();
    ntotal = 0;
    calibrated_k = -1;
    calibrated_sample = -1;
}

size_t IndexHybrid::memory_bytes() const {
    return storage.memory_bytes() + heavy->memory_bytes() + tail->memory_bytes();
}

bool IndexHybrid::reads_search_knob(const std::string& name) const {
    const bool lsh_knob = name == "min_hits" || name == "max_sample";
    return heavy->reads_search_knob(name) || (lsh_knob && tail->reads_search_knob(name));
}

std::vector<ParameterInfo> IndexHybrid::parameter_info() const {
    using P = ParameterInfo;
    return {P::integer("sample", 0, P::kNoBound,
                       "tail budget, its k (tokens a uniform tail draws); 0: no tail; -1: the tail's own k (default)")
                    .tokens()
                    .also(-1),
            P::real("epsilon", 0, 1e6, "relative error target of a uniform tail: > 0 sets its sample per head at prefill, 0: off")
                    .prefill(),
            P::integer("budget", 0, P::kNoBound,
                       "tokens per query (k + sample) split per head at prefill by predicted (uniform tail) or measured error; "
                       "0: off; -1 (default): what the hybrid reads as given, unless k, sample or epsilon is set")
                    .prefill()
                    .tokens()
                    .also(-1),
            P::real("delta", 0, 1, "failure probability of the epsilon target").prefill().open_min().open_max(),
            P::integer("n_calibration", 1, P::kNoBound, "last prompt positions whose queries set the tail budget").prefill(),
            P::reported("calibrated_k", "the heavy k the last prefill chose (-1: none)"),
            P::reported("calibrated_sample", "the tail sample the last prefill chose (-1: none)")};
}

bool IndexHybrid::set_parameter(const std::string& name, double value) {
    if (name == "sample") {
        // -1 (the default, which get_parameter reports): the tail's own k
        sample = value == -1 ? -1 : idx_t(count_parameter(name, value));
        split_given = true;
    } else if (name == "epsilon") {
        FAISS_THROW_IF_NOT_FMT(
                value >= 0 && value <= 1e6, "parameter epsilon=%g must be >= 0", value);
        epsilon = value;
    } else if (name == "delta") {
        FAISS_THROW_IF_NOT_FMT(
                value > 0 && value < 1, "parameter delta=%g must be in (0, 1)", value);
        delta = value;
    } else if (name == "n_calibration") {
        FAISS_THROW_IF_NOT_FMT(
                is_positive_integer(value),
                "parameter n_calibration=%g must be a positive integer",
                value);
        n_calibration = idx_t(value);
    } else if (name == "budget") {
        budget = value == -1 ? -1 : idx_t(count_parameter(name, value));
    } else if (name == "calibrated_sample" || name == "calibrated_k") {
        FAISS_THROW_FMT(
                "parameter %s is read-only (set by prefill when it calibrates)",
                name.c_str());
    } else {
        // k belongs to the heavy part (a child, which reports it); the
        // hybrid's own field mirrors it for readers of KVIndex::k
        if (name == "k") {
            KVIndex::set_parameter(name, value);
            split_given = true;
        }
        return false;
    }
    return true;
}

bool IndexHybrid::get_parameter(const std::string& name, double* value) const {
    if (name == "sample") {
        *value = double(sample);
    } else if (name == "epsilon") {
        *value = epsilon;
    } else if (name == "delta") {
        *value = delta;
    } else if (name == "n_calibration") {
        *value = double(n_calibration);
    } else if (name == "budget") {
        *value = double(budget);
    } else if (name == "calibrated_k") {
        *value = double(calibrated_k);
    } else if (name == "calibrated_sample") {
        *value = double(calibrated_sample);
    } else {
        return false;
    }
    return true;
}

void IndexHybrid::write_fields(BufferWriter& w) const {
    w.value<int64_t>(sample);
    w.value<double>(epsilon);
    w.value<int64_t>(budget);
    w.value<double>(delta);
    w.value<int64_t>(n_calibration);
    w.value<int64_t>(calibrated_k);
    w.value<int64_t>(calibrated_sample);
    w.value<uint8_t>(split_given ? 1 : 0);
    tokens().write(w); // the record holds the tokens whichever index keeps them
    write_index_record(heavy.get(), w);
    write_index_record(tail.get(), w);
}

void IndexHybrid::read_fields(BufferReader& r, uint32_t version) {
    sample = r.value<int64_t>("sample");
    epsilon = r.value<double>("epsilon");
    budget = r.value<int64_t>("budget");
    delta = r.value<double>("delta");
    n_calibration = r.value<int64_t>("n_calibration");
    calibrated_k = r.value<int64_t>("calibrated_k");
    calibrated_sample = r.value<int64_t>("calibrated_sample");
    // version 1 had no default budget: its 0 is off, and nothing was given
    split_given = version >= 2 ? r.value<uint8_t>("split_given") != 0 : false;
    storage = KVStorage(d, d_value, kv_type);
    storage.read(r, "Hybrid storage");
    heavy = read_index_record(r);
    tail = read_index_record(r);
    // each child read its own copy: keep one, after checking that they agree
    lend_tokens();
    if (!holds_own_tokens()) {
        drop_for_shared(storage, tokens(), ntotal, "read_index: IndexHybrid");
    }
}

void IndexHybrid::check_children_in_step() const {
    check_child_in_step(heavy.get(), ntotal, "IndexHybrid", "heavy");
    check_child_in_step(tail.get(), ntotal, "IndexHybrid", "tail");
}

void IndexHybrid::check_invariants() const {
    KVIndex::check_invariants();
    FAISS_THROW_IF_NOT_MSG(heavy && tail, "IndexHybrid: heavy or tail index missing");
    check_heavy_is_deterministic();
    FAISS_THROW_IF_NOT_FMT(
            sample >= -1 && std::isfinite(epsilon) && epsilon >= 0 && budget >= -1 &&
                    delta > 0 && delta < 1 && n_calibration >= 1 && calibrated_k >= -1 &&
                    calibrated_sample >= -1,
            "IndexHybrid: sample=%zd, epsilon=%g, budget=%zd, delta=%g, n_calibration=%zd or "
            "calibrated_sample=%zd out of range",
            size_t(sample),
            epsilon,
            size_t(budget),
            delta,
            size_t(n_calibration),
            size_t(calibrated_sample));
    const KVStorage& st = tokens();
    FAISS_THROW_IF_NOT_FMT(
            st.d == size_t(d) && st.d_value == size_t(d_value) && st.type == kv_type &&
                    st.size() == ntotal && (holds_own_tokens() || storage.size() == 0) &&
                    heavy->ntotal == ntotal && tail->ntotal == ntotal,
            "IndexHybrid: storage (%zd), heavy (%zd) and tail (%zd) disagree with ntotal %zd",
            size_t(st.size()),
            size_t(heavy->ntotal),
            size_t(tail->ntotal),
            size_t(ntotal));
}

} // namespace kvindex
