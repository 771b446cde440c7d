#include "reference.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kvtest {

std::vector<float> gaussian(size_t n, size_t d, uint64_t seed, float scale, float offset) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::vector<float> x(n * d);
    for (auto& v : x) {
        v = offset + scale * g(rng);
    }
    return x;
}

std::vector<double> ref_scores(const float* q, const float* keys, size_t d, idx_t n) {
    std::vector<double> s(n);
    for (idx_t i = 0; i < n; i++) {
        double acc = 0;
        for (size_t j = 0; j < d; j++) {
            acc += double(q[j]) * keys[i * d + j];
        }
        s[i] = acc;
    }
    return s;
}

std::vector<idx_t> ref_topk(const float* q, const float* keys, size_t d, idx_t n, idx_t k) {
    std::vector<double> s = ref_scores(q, keys, d, n);
    std::vector<idx_t> ids(n);
    std::iota(ids.begin(), ids.end(), 0);
    std::stable_sort(ids.begin(), ids.end(), [&](idx_t a, idx_t b) { return s[a] > s[b]; });
    ids.resize(std::min(k, n));
    return ids;
}

double ref_attention(
        const float* q,
        const float* keys,
        const float* values,
        size_t d,
        size_t dv,
        const std::vector<idx_t>& ids,
        const std::vector<double>* u,
        std::vector<double>& out) {
    out.assign(dv, 0.0);
    if (ids.empty()) {
        return -INFINITY;
    }
    std::vector<double> logw(ids.size());
    double m = -INFINITY;
    for (size_t t = 0; t < ids.size(); t++) {
        double acc = 0;
        for (size_t j = 0; j < d; j++) {
            acc += double(q[j]) * keys[ids[t] * d + j];
        }
        logw[t] = acc / std::sqrt(double(d)) - (u ? std::log((*u)[t]) : 0.0);
        m = std::max(m, logw[t]);
    }
    double z = 0;
    for (size_t t = 0; t < ids.size(); t++) {
        double w = std::exp(logw[t] - m);
        z += w;
        for (size_t j = 0; j < dv; j++) {
            out[j] += w * values[ids[t] * dv + j];
        }
    }
    for (auto& o : out) {
        o /= z;
    }
    return m + std::log(z);
}

double ref_attention_all(
        const float* q,
        const float* keys,
        const float* values,
        size_t d,
        size_t dv,
        idx_t n,
        std::vector<double>& out) {
    std::vector<idx_t> ids(n);
    std::iota(ids.begin(), ids.end(), 0);
    return ref_attention(q, keys, values, d, dv, ids, nullptr, out);
}

double rel_max_err(const float* a, const std::vector<double>& b) {
    double err = 0, scale = 1;
    for (size_t i = 0; i < b.size(); i++) {
        err = std::max(err, std::abs(double(a[i]) - b[i]));
        scale = std::max(scale, std::abs(b[i]));
    }
    return err / scale;
}

} // namespace kvtest
