#include <kvindex/attention.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/kernels.h>

namespace kvindex {

namespace {

/// The free functions read the caller's rows unchecked (the index API
/// checks its rows once, at add), so a NaN, an Inf or a score that
/// overflows float (|x| far above kMaxInputMagnitude) shows only in the
/// result: refuse it there, an O(dv) check, rather than return NaN. lse =
/// -inf with out = 0 is an empty set (every score -inf), not an error.
float checked_result(const char* what, float lse, const float* out, size_t dv) {
    bool finite = !std::isnan(lse) && lse != std::numeric_limits<float>::infinity();
    for (size_t j = 0; finite && j < dv; j++) {
        finite = std::isfinite(out[j]);
    }
    FAISS_THROW_IF_NOT_FMT(
            finite,
            "%s: the result is not finite (lse %g): the query, a key or a value "
            "holds NaN or Inf, or scores overflow float (the index API refuses "
            "|x| > %g)",
            what,
            double(lse),
            double(kMaxInputMagnitude));
    return lse;
}

/// attention_from_scores without the check of its result.
float weights_to_output(
        float* s, const float* log_u, KVRows values, const idx_t* ids, size_t n, float* out) {
    if (n == 0) {
        std::memset(out, 0, sizeof(float) * values.dim);
        return -std::numeric_limits<float>::infinity();
    }
    float lse = softmax_inplace(s, log_u, n);
    static_assert(sizeof(idx_t) == sizeof(int64_t), "token ids are 64-bit");
    weighted_sum_by_ids(s, values, reinterpret_cast<const int64_t*>(ids), n, out);
    return lse;
}

} // namespace

const char* estimator_name(Estimator e) {
    return e == Estimator::topk ? "topk" : "unbiased";
}

float estimate_attention(
        Estimator estimator,
        const float* q,
        const float* keys,
        const float* values,
        size_t d,
        size_t dv,
        const Selection& sel,
        float* out) {
    return estimate_attention(estimator, q, KVRows(keys, d), KVRows(values, dv), sel, out);
}

float estimate_attention(
        Estimator estimator,
        const float* q,
        KVRows keys,
        KVRows values,
        const Selection& sel,
        float* out) {
    size_t d = keys.dim, dv = values.dim;
    size_t n = sel.size();
    if (n == 0) {
        std::memset(out, 0, sizeof(float) * dv);
        return -std::numeric_limits<float>::infinity();
    }
    for (size_t i = 0; i < n; i++) {
        // the rows are the caller's, so only this bound can be checked here
        FAISS_THROW_IF_NOT_FMT(
                sel.ids[i] >= 0,
                "estimate_attention: sel.ids[%zd] = %lld is not a token (negative; -1 pads search results)",
                i,
                (long long)sel.ids[i]);
    }
    std::vector<float> w(n);
    inner_products_by_ids(
            q, keys, sel.ids.data(), n, float(1.0 / std::sqrt(double(d))), w.data());
    for (size_t i = 0; i < n; i++) {
        // here -inf is an overflow, not a mask, so the result's check would
        // miss a set whose scores all overflowed to -inf
        FAISS_THROW_IF_NOT_FMT(
                std::isfinite(w[i]),
                "estimate_attention: the score of token %lld is %g: the query or its key "
                "holds NaN or Inf, or the score overflows float (the index API refuses "
                "|x| > %g)",
                (long long)sel.ids[i],
                double(w[i]),
                double(kMaxInputMagnitude));
    }
    std::vector<float> log_u;
    if (estimator == Estimator::unbiased) {
        FAISS_THROW_IF_NOT_MSG(
                sel.inclusion.size() == n,
                "estimate_attention: selection has no inclusion probabilities");
        log_u.resize(n);
        for (size_t i = 0; i < n; i++) {
            float u = sel.inclusion[i];
            FAISS_THROW_IF_NOT_FMT(
                    u > 0 && u <= 1,
                    "estimate_attention: inclusion probability %g of token %zd "
                    "is not in (0, 1]",
                    double(u),
                    size_t(sel.ids[i]));
            log_u[i] = std::log(u);
        }
    }
    float lse = weights_to_output(
            w.data(), log_u.empty() ? nullptr : log_u.data(), values, sel.ids.data(), n, out);
    return checked_result("estimate_attention", lse, out, dv);
}

float attention_from_scores(
        float* s,
        const float* log_u,
        const float* values,
        size_t dv,
        const idx_t* ids,
        size_t n,
        float* out) {
    return attention_from_scores(s, log_u, KVRows(values, dv), ids, n, out);
}

float attention_from_scores(
        float* s, const float* log_u, KVRows values, const idx_t* ids, size_t n, float* out) {
    return checked_result(
            "attention_from_scores", weights_to_output(s, log_u, values, ids, n, out), out, values.dim);
}

float exact_attention(
        const float* q,
        const float* keys,
        const float* values,
        size_t d,
        size_t dv,
        size_t n,
        float* out) {
    return exact_attention(q, KVRows(keys, d), KVRows(values, dv), n, out);
}

float exact_attention(const float* q, KVRows keys, KVRows values, size_t n, float* out) {
    float lse = dense_attention(q, keys, values, n, float(1.0 / std::sqrt(double(keys.dim))), out);
    return checked_result("exact_attention", lse, out, values.dim);
}

double mean_relative_error(const float* out, const float* exact, size_t n, size_t dv) {
    double sum = 0;
    for (size_t i = 0; i < n; i++) {
        double diff = 0, norm = 0;
        for (size_t j = 0; j < dv; j++) {
            double o = exact[i * dv + j];
            double x = double(out[i * dv + j]) - o;
            diff += x * x;
            norm += o * o;
        }
        sum += norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
    }
    return n > 0 ? sum / double(n) : 0.0;
}

float merge_attention(
        size_t n_parts, const float* const* outs, const float* lses, size_t dv, float* out) {
    float m = -std::numeric_limits<float>::infinity();
    for (size_t j = 0; j < n_parts; j++) {
        // -inf is an empty part; NaN or +inf is no log-sum-exp at all, and
        // would be dropped (max) or make the output NaN
        FAISS_THROW_IF_NOT_FMT(
                lses[j] <= std::numeric_limits<float>::max(), // false for NaN and +inf
                "merge_attention: part %zu has lse %g (finite or -inf for an empty part)",
                j,
                double(lses[j]));
        m = std::max(m, lses[j]);
    }
    if (m == -std::numeric_limits<float>::infinity()) {
        std::memset(out, 0, sizeof(float) * dv);
        return m;
    }
    // Accumulate in double: the weights of the parts may differ by many
    // orders of magnitude, and out may alias outs[0].
    std::vector<double> acc(dv, 0.0);
    double z = 0;
    for (size_t j = 0; j < n_parts; j++) {
        if (lses[j] == -std::numeric_limits<float>::infinity()) {
            continue;
        }
        double w = std::exp(double(lses[j]) - double(m));
        z += w;
        for (size_t c = 0; c < dv; c++) {
            acc[c] += w * outs[j][c];
        }
    }
    for (size_t c = 0; c < dv; c++) {
        out[c] = float(acc[c] / z);
    }
    return float(double(m) + std::log(z));
}

} // namespace kvindex
