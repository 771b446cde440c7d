#include <kvindex/attention.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/kernels.h>

namespace kvindex {

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
    return attention_from_scores(
            w.data(), log_u.empty() ? nullptr : log_u.data(), values, sel.ids.data(), n, out);
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
    size_t dv = values.dim;
    if (n == 0) {
        std::memset(out, 0, sizeof(float) * dv);
        return -std::numeric_limits<float>::infinity();
    }
    float lse = softmax_inplace(s, log_u, n);
    static_assert(sizeof(idx_t) == sizeof(int64_t), "token ids are 64-bit");
    weighted_sum_by_ids(s, values, reinterpret_cast<const int64_t*>(ids), n, out);
    return lse;
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
    return dense_attention(q, keys, values, n, float(1.0 / std::sqrt(double(keys.dim))), out);
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
