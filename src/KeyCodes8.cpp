#include <kvindex/KeyCodes8.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/impl/growth.h>
#include <kvindex/kernels.h>

#include "checks.h"

namespace kvindex {

void KeyCodes8::train(const KVStorage& keys) {
    d = keys.d;
    size_t n = size_t(keys.size());
    vmin.assign(d, 0.0f); // no keys: range [0, 0]
    step.assign(d, 0.0f);
    if (n > 0) {
        std::vector<float> vmax(d, std::numeric_limits<float>::lowest());
        std::fill(vmin.begin(), vmin.end(), std::numeric_limits<float>::max());
        std::vector<float> x(d);
        for (size_t i = 0; i < n; i++) {
            keys.key(idx_t(i), x.data());
            for (size_t j = 0; j < d; j++) {
                vmin[j] = std::min(vmin[j], x[j]);
                vmax[j] = std::max(vmax[j], x[j]);
            }
        }
        for (size_t j = 0; j < d; j++) {
            step[j] = (vmax[j] - vmin[j]) / 255.0f;
        }
    }
    n_trained = n;
    codes.clear();
    encode(keys, 0);
}

void KeyCodes8::append(const KVStorage& keys) {
    size_t n = size_t(keys.size());
    if (d != keys.d || n > 2 * n_trained) {
        train(keys); // first keys, or twice the keys the ranges saw
    } else if (n > size()) {
        encode(keys, size());
    }
}

void KeyCodes8::encode(const KVStorage& keys, size_t i0) {
    size_t n = size_t(keys.size());
    grow_to(codes, n * d);
    std::vector<float> x(d);
    for (size_t i = i0; i < n; i++) {
        keys.key(idx_t(i), x.data());
        uint8_t* c = codes.data() + i * d;
        for (size_t j = 0; j < d; j++) {
            float t = step[j] > 0 ? std::nearbyint((x[j] - vmin[j]) / step[j]) : 0.0f;
            c[j] = uint8_t(std::min(255.0f, std::max(0.0f, t)));
        }
    }
}

void KeyCodes8::truncate(size_t n) {
    codes.resize(std::min(n, size()) * d);
    // ranges taken from more keys still cover the kept ones; what counts is
    // that no more keys are claimed than there are (read refuses that)
    n_trained = std::min(n_trained, n);
}

void KeyCodes8::clear() {
    d = 0;
    vmin.clear();
    step.clear();
    codes.clear();
    n_trained = 0;
}

float KeyCodes8::prepare(const float* q, float* qs) const {
    double base = 0;
    for (size_t j = 0; j < d; j++) {
        qs[j] = q[j] * step[j];
        base += double(q[j]) * vmin[j];
    }
    return float(base);
}

void KeyCodes8::scores(const float* qs, float base, const int64_t* ids, size_t n, float* out)
        const {
    inner_products_by_ids(qs, codes.data(), d, ids, n, 1.0f, out);
    for (size_t i = 0; i < n; i++) {
        out[i] += base;
    }
}

float KeyCodes8::score_bound(const float* q) const {
    // half a step per dimension, plus float rounding: each term of
    // <q, vmin> + <q step, c> is at most |q_j| (|vmin_j| + 255 step_j) =: r_j,
    // and coding (x - vmin) / step, prepare's float base, the summed products
    // and the final add each round relative to sum_j r_j, d + 8 units of
    // 2^-23 in all (a constant dimension far from 0 makes this term count)
    double half_steps = 0, r = 0;
    for (size_t j = 0; j < d; j++) {
        const double aq = std::fabs(double(q[j]));
        half_steps += aq * step[j] / 2;
        r += aq * (std::fabs(double(vmin[j])) + 255.0 * step[j]);
    }
    const double rounding = double(d + 8) * std::ldexp(1.0, -23) * r;
    // rounded up to the next float, so that the bound holds as returned
    return std::nextafter(float(half_steps + rounding), std::numeric_limits<float>::infinity());
}

size_t KeyCodes8::memory_bytes() const {
    return capacity_bytes(codes) + capacity_bytes(vmin) + capacity_bytes(step);
}

void KeyCodes8::write(BufferWriter& w) const {
    w.vector(vmin);
    w.vector(step);
    w.value<uint64_t>(n_trained);
}

void KeyCodes8::read(BufferReader& r, const KVStorage& keys, const char* what) {
    clear();
    std::vector<float> lo = r.vector<float>(what);
    std::vector<float> st = r.vector<float>(what);
    uint64_t trained = r.value<uint64_t>(what);
    FAISS_THROW_IF_NOT_FMT(
            lo.size() == keys.d && st.size() == keys.d && trained <= uint64_t(keys.size()),
            "%s: ranges of %zd / %zd dimensions from %zd keys, for %zd keys of d=%zd",
            what,
            lo.size(),
            st.size(),
            size_t(trained),
            size_t(keys.size()),
            keys.d);
    check_finite(lo.data(), 1, lo.size(), what);
    check_finite(st.data(), 1, st.size(), what);
    FAISS_THROW_IF_NOT_FMT(
            std::all_of(st.begin(), st.end(), [](float x) { return x >= 0; }),
            "%s: a negative step", what);
    d = keys.d;
    vmin = std::move(lo);
    step = std::move(st);
    n_trained = size_t(trained);
    encode(keys, 0);
}

} // namespace kvindex
