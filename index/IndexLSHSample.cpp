#include <kvindex/IndexLSHSample.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <numeric>
#include <random>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/attention.h>
#include <kvindex/impl/gap_codes.h>
#include <kvindex/impl/growth.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>
#include <kvindex/kernels.h>

#include "checks.h"
#include "lsh_table_kernel.h"
#include "parallel.h"

namespace kvindex {

double lsh_inclusion_probability(double theta, int K, int L, int min_hits) {
    if (min_hits <= 0) {
        return 1.0;
    }
    if (min_hits > L) {
        return 0.0;
    }
    double p = 1.0 - theta / M_PI;
    double P = std::pow(std::min(std::max(p, 0.0), 1.0), K); // one table collides
    if (P >= 1.0) {
        return 1.0;
    }
    if (P <= 0.0) {
        return 0.0;
    }
    // binomial terms t_j = C(L, j) P^j (1-P)^(L-j) by their ratio recurrence
    double t = std::exp(L * std::log1p(-P)), ratio = P / (1.0 - P);
    double lower = 0;
    int j = 0;
    for (; j < min_hits; j++) {
        lower += t;
        t *= double(L - j) / (j + 1) * ratio;
    }
    if (lower < 0.5) {
        return 1.0 - lower;
    }
    // 1 - lower would cancel: sum the upper tail directly, t is t_{min_hits}
    double upper = 0;
    for (; j <= L; j++) {
        upper += t;
        if (t < 1e-18 * upper) {
            break;
        }
        t *= double(L - j) / (j + 1) * ratio;
    }
    return upper;
}

namespace {

/// log C(L, j) (exact sums of logs for small min(j, L - j), lgamma otherwise).
double log_binomial(int L, int j) {
    int k = std::min(j, L - j);
    if (k <= 64) {
        double s = 0;
        for (int i = 0; i < k; i++) {
            s += std::log(double(L - i) / double(i + 1));
        }
        return s;
    }
    return std::lgamma(L + 1.0) - std::lgamma(j + 1.0) - std::lgamma(L - j + 1.0);
}

/** log P[Binomial(L, P) >= m] - m K log_y with P = x^K, 0 < x <= 1, m >= 1,
 * in the log domain throughout (no underflow for tiny u, no cancellation
 * near u = 1): the tail that is summed is always the one whose terms
 * decrease away from its first term. The reference the tables are built from. */
double log_tail_shifted(double x, double log_y, int K, int L, int m, double log_c_m, double log_c_m1) {
    double log_x = std::log(x), log_p = K * log_x, P = std::exp(log_p);
    if (P >= 1.0) {
        return -m * K * log_y;
    }
    double log_q = std::log1p(-P), ratio = P / (1.0 - P);
    double mode = std::floor((L + 1) * P);
    if (m > mode) { // upper tail from t_m, terms decrease
        double sum = 1, t = 1;
        for (int j = m; j < L; j++) {
            t *= double(L - j) / double(j + 1) * ratio;
            sum += t;
            if (t < 1e-17 * sum) {
                break;
            }
        }
        return log_c_m + m * K * (log_x - log_y) + (L - m) * log_q + std::log(sum);
    }
    // lower tail backwards from t_{m-1} (m - 1 <= mode: terms decrease)
    double log_t = log_c_m1 + (m - 1) * log_p + (L - m + 1) * log_q;
    double sum = 1, t = 1;
    for (int j = m - 1; j > 0; j--) {
        t *= double(j) / double(L - j + 1) / ratio;
        sum += t;
        if (t < 1e-17 * sum) {
            break;
        }
    }
    double lower = std::min(1.0, std::exp(log_t) * sum);
    return std::log1p(-lower) - m * K * log_y;
}

/// Natural log of a positive normal double without libm: exponent bits and
/// an atanh series on the mantissa in [sqrt(1/2), sqrt(2)) (|error| < 1e-15).
inline double poly_log(double r) {
    uint64_t bits;
    std::memcpy(&bits, &r, sizeof(bits));
    int e = int((bits >> 52) & 0x7ff) - 1023;
    bits = (bits & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL;
    double mant;
    std::memcpy(&mant, &bits, sizeof(mant));
    if (mant > 1.4142135623730951) {
        mant *= 0.5;
        e++;
    }
    double z = (mant - 1.0) / (mant + 1.0), z2 = z * z; // |z| <= 0.1716
    double p = 1.0 / 17;
    p = p * z2 + 1.0 / 15;
    p = p * z2 + 1.0 / 13;
    p = p * z2 + 1.0 / 11;
    p = p * z2 + 1.0 / 9;
    p = p * z2 + 1.0 / 7;
    p = p * z2 + 1.0 / 5;
    p = p * z2 + 1.0 / 3;
    p = p * z2 + 1.0;
    return 2.0 * z * p + e * 0.6931471805599453;
}

constexpr double kHalfMax = 0.70710678118654752440; // sin(pi/4)

inline double eval_cubic(const double* a, double t) {
    return a[0] + t * (a[1] + t * (a[2] + t * a[3]));
}

/// Coefficients in t in [0, 1] of the cubic through f at t = 0, 1/3, 2/3, 1.
void cubic_through(double f0, double f1, double f2, double f3, double* a) {
    double d1 = f1 - f0, d2 = f2 - 2 * f1 + f0, d3 = f3 - 3 * f2 + 3 * f1 - f0;
    // Newton form in u = 3t: f0 + d1 u + d2 u(u-1)/2 + d3 u(u-1)(u-2)/6
    a[0] = f0;
    a[1] = 3 * (d1 - d2 / 2 + d3 / 3);
    a[2] = 9 * (d2 / 2 - d3 / 2);
    a[3] = 27 * (d3 / 6);
}

} // namespace

LSHInclusionTable::LSHInclusionTable(int K, int L, int min_hits) : K_(K), L_(L), m_(min_hits) {
    FAISS_THROW_IF_NOT_FMT(
            K >= 1 && K <= 16 && L >= 1 && L <= 4096 && min_hits >= 1 && min_hits <= L,
            "LSHInclusionTable: K=%d, L=%d, min_hits=%d outside K in [1, 16], "
            "1 <= min_hits <= L <= 4096", K, L, min_hits);
    int m = min_hits;
    mk_ = double(m) * K;
    log_floor_ = std::log(kMinInclusion);
    double lcm = log_binomial(L, m), lcm1 = log_binomial(L, m - 1);
    // near half: log u at s = sin(theta / 2)
    auto f_near = [&](double s) {
        double theta = 2 * std::asin(std::min(s, 1.0));
        double x = 1.0 - theta / M_PI;
        return log_tail_shifted(x, 0.0, K, L, m, lcm, lcm1);
    };
    // far half: log u - m K log r at r = cos(theta / 2); pi - theta = 2 asin(r)
    double g0 = lcm + mk_ * std::log(2.0 / M_PI);
    auto f_far = [&](double r) {
        if (r <= 0) {
            return g0;
        }
        double x = 2 * std::asin(std::min(r, 1.0)) / M_PI;
        return log_tail_shifted(x, std::log(r), K, L, m, lcm, lcm1);
    };
    std::vector<double> near, far;
    for (int n = 32;; n *= 2) {
        double h = kHalfMax / n, err = 0;
        auto build = [&](auto&& f, auto&& shift, std::vector<double>& coef) {
            std::vector<double> node(3 * size_t(n) + 1);
            for (size_t k = 0; k < node.size(); k++) {
                node[k] = f(std::min(kHalfMax, k * h / 3));
            }
            coef.resize(4 * size_t(n));
            for (int i = 0; i < n; i++) {
                const double* v = node.data() + 3 * size_t(i);
                cubic_through(v[0], v[1], v[2], v[3], coef.data() + 4 * size_t(i));
                for (double t : {1.0 / 6, 0.5, 5.0 / 6}) {
                    double at = (i + t) * h, sh = shift(at);
                    double exact = f(at), got = eval_cubic(coef.data() + 4 * size_t(i), t);
                    // only values above the floor matter (log u is clamped after)
                    if (exact + sh > log_floor_ - 1 || got + sh > log_floor_ - 1) {
                        err = std::max(err, std::fabs(exact - got));
                    }
                }
            }
        };
        build(f_near, [](double) { return 0.0; }, near);
        double err_near = err;
        err = 0;
        build(f_far, [&](double r) { return mk_ * std::log(r); }, far);
        n_ = n;
        inv_h_ = n / kHalfMax;
        max_err_ = std::max(err_near, err);
        if (max_err_ <= kBuildTarget || n >= (1 << 16)) {
            break;
        }
    }
    coef_ = std::move(near);
    coef_.insert(coef_.end(), far.begin(), far.end());
}


double LSHInclusionTable::log_inclusion(double c) const {
    c = std::min(1.0, std::max(-1.0, c));
    double v;
    if (c >= 0) {
        double t = std::sqrt((1.0 - c) * 0.5) * inv_h_;
        int i = std::min(int(t), n_ - 1);
        v = eval_cubic(coef_.data() + 4 * size_t(i), t - i);
    } else {
        double r = std::sqrt((1.0 + c) * 0.5);
        if (!(r > 1e-300)) {
            return log_floor_;
        }
        double t = r * inv_h_;
        int i = std::min(int(t), n_ - 1);
        v = eval_cubic(coef_.data() + 4 * size_t(n_ + i), t - i) + mk_ * poly_log(r);
    }
    return std::min(0.0, std::max(log_floor_, v));
}

void LSHInclusionTable::log_inclusion(const double* c, size_t n, float* out) const {
    if (get_simd_level() == SimdLevel::avx512) {
        LSHTableView view{coef_.data(), n_, inv_h_, mk_, log_floor_};
        lsh_log_inclusion_avx512(view, c, n, out);
        return;
    }
    for (size_t t = 0; t < n; t++) {
        out[t] = float(log_inclusion(c[t]));
    }
}

double LSHInclusionTable::inclusion(double c) const {
    return std::exp(log_inclusion(c));
}

std::shared_ptr<const LSHInclusionTable> LSHInclusionTable::get(int K, int L, int min_hits) {
    static std::mutex mu;
    static std::vector<std::shared_ptr<const LSHInclusionTable>> cache;
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& t : cache) {
        if (t->K_ == K && t->L_ == L && t->m_ == min_hits) {
            return t;
        }
    }
    auto t = std::make_shared<const LSHInclusionTable>(K, L, min_hits);
    if (cache.size() >= 64) { // bounded: drop the oldest
        cache.erase(cache.begin());
    }
    cache.push_back(t);
    return t;
}

IndexLSHSample::IndexLSHSample() : KVIndex(0, 0) {}

namespace {

/// Sizes the hyperplanes (K * L * d floats) and the tables (L * (2^K + 1)
/// offsets) take, bounded before anything is allocated.
void check_lsh_shape(int K, int L, int d, const char* what) {
    FAISS_THROW_IF_NOT_FMT(K >= 1 && K <= 16, "%s: K=%d bits must be in [1, 16]", what, K);
    FAISS_THROW_IF_NOT_FMT(L >= 1 && L <= 4096, "%s: L=%d tables must be in [1, 4096]", what, L);
    const int64_t kMaxFloats = int64_t(1) << 26; // 256 MiB of hyperplanes or offsets
    FAISS_THROW_IF_NOT_FMT(
            int64_t(K) * L * d <= kMaxFloats,
            "%s: K*L*d = %d*%d*%d hyperplane coordinates, more than %zd",
            what, K, L, d, size_t(kMaxFloats));
    FAISS_THROW_IF_NOT_FMT(
            int64_t(L) << K <= kMaxFloats,
            "%s: L*2^K = %d*2^%d bucket offsets, more than %zd",
            what, L, K, size_t(kMaxFloats));
}

/// Tokens past the tail's tables before they are rebuilt: the rebuild costs
/// L (tail + 2^K), each query scans the unindexed ones code by code.
idx_t recent_threshold(idx_t tail) {
    return std::max<idx_t>(256, idx_t(std::sqrt(double(tail))));
}

} // namespace

IndexLSHSample::IndexLSHSample(int d, int d_value, int K, int L, KVType kv_type)
        : KVIndex(d, d_value, kv_type), K(K), L(L), storage(d, this->d_value, kv_type) {
    FAISS_THROW_IF_NOT_FMT(d > 0, "LSHSample: d=%d must be > 0", d);
    check_lsh_shape(K, L, d, "LSHSample");
    // a key is sampled at its min_hits-th collision: fewer tables never sample
    FAISS_THROW_IF_NOT_FMT(
            L >= min_hits,
            "LSHSample%dx%d: L=%d tables cannot give min_hits=%d collisions",
            K, L, L, min_hits);
    set_seed(seed);
    refresh_table();
}

void IndexLSHSample::refresh_table() {
    table.reset();
    if (min_hits >= 1 && min_hits <= L && K >= 1 && K <= 16) {
        table = LSHInclusionTable::get(K, L, min_hits);
    }
}

std::shared_ptr<const LSHInclusionTable> IndexLSHSample::table_for(int hits) const {
    if (table && table->K() == K && table->L() == L && table->min_hits() == hits) {
        return table;
    }
    return LSHInclusionTable::get(K, L, hits);
}

std::unique_ptr<KVIndex> IndexLSHSample::from_factory(FactoryChain& chain) {
    const std::string& s = chain.peek();
    const std::string head = "LSHSample";
    size_t x = s.find('x');
    if (s.compare(0, head.size(), head) != 0 || x == std::string::npos) {
        return nullptr;
    }
    std::string ks = s.substr(head.size(), x - head.size()), ls = s.substr(x + 1);
    auto digits = [](const std::string& t) {
        return !t.empty() && t.size() <= 6 && t.find_first_not_of("0123456789") == std::string::npos;
    };
    if (!digits(ks) || !digits(ls)) {
        return nullptr;
    }
    chain.take();
    return std::make_unique<IndexLSHSample>(
            chain.d, chain.d_value, std::stoi(ks), std::stoi(ls), chain.kv_type);
}

void IndexLSHSample::set_seed(uint64_t new_seed) {
    FAISS_THROW_IF_NOT_MSG(
            ntotal == 0, "LSHSample: the hyperplanes can change only on an empty index");
    seed = new_seed;
    mean_projection.clear(); // of the old planes
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> g(0.0f, 1.0f);
    planes.resize(size_t(K) * L * d);
    for (auto& x : planes) {
        x = g(rng);
    }
}

namespace {

/// The L codes of K bits from one key's projections (size K * L) less the
/// centre's (nullptr: none).
void codes_from_projection(const float* proj, const float* cproj, int K, int L, uint16_t* out) {
    for (int l = 0; l < L; l++) {
        uint16_t c = 0;
        for (int b = 0; b < K; b++) {
            float v = proj[l * K + b] - (cproj ? cproj[l * K + b] : 0.0f);
            c |= uint16_t(v > 0) << b;
        }
        out[l] = c;
    }
}

} // namespace

void IndexLSHSample::hash(const float* x, const float* center, uint16_t* out) const {
    std::vector<float> cproj(center ? size_t(K) * L : 0);
    if (center) {
        inner_products_scaled(center, planes.data(), d, K * L, 1.0f, cproj.data());
    }
    hash_projected(x, center ? cproj.data() : nullptr, out);
}

void IndexLSHSample::hash_projected(const float* x, const float* cproj, uint16_t* out) const {
    std::vector<float> proj(size_t(K) * L);
    // the kernel add_kv hashes blocks of keys with: the same bits
    inner_products_multi(x, 1, planes.data(), d, size_t(K) * L, proj.data(), size_t(K) * L);
    codes_from_projection(proj.data(), cproj, K, L, out);
}

void IndexLSHSample::add_kv_impl(idx_t n, const float* keys, const float* values) {
    // the tokens first: a value the type cannot hold is refused before
    // the mean, codes and norms change
    append_or_check_shared(storage, shared_tokens, ntotal, n, keys, values, "IndexLSHSample");
    // A throw below (an allocation) takes every array back to its size
    // before the call; the tables are built aside and swapped in last.
    const bool had_mean = !mean.empty(), had_projection = !mean_projection.empty();
    const size_t n_codes = codes.size(), n_norms = norms.size();
    if (keeping_undo()) {
        undo.had_mean = had_mean;
        undo.had_projection = had_projection;
        undo.n_codes = n_codes;
        undo.n_norms = n_norms;
    }
    try {
        hash_new_keys(n, keys);
    } catch (...) {
        if (!shared_tokens) {
            storage.truncate(ntotal);
        }
        if (!had_mean) {
            mean.clear();
        }
        if (!had_projection) {
            mean_projection.clear();
        }
        codes.resize(n_codes); // shrinks: allocates nothing
        norms.resize(n_norms);
        throw;
    }
}

void IndexLSHSample::undo_add_kv_impl(idx_t n) {
    if (undo.main_saved) {
        offsets.swap(undo.offsets);
        table_begin.swap(undo.table_begin);
        table_words.swap(undo.table_words);
        codes.swap(undo.codes);
        n_indexed = undo.n_indexed;
    }
    if (undo.recent_saved) {
        recent_offsets.swap(undo.recent_offsets);
        recent_ids.swap(undo.recent_ids);
        n_recent = undo.n_recent;
    }
    codes.resize(undo.n_codes); // shrinks: allocates nothing
    norms.resize(undo.n_norms);
    if (!undo.had_mean) {
        mean.clear();
    }
    if (!undo.had_projection) {
        mean_projection.clear();
    }
    if (!shared_tokens) {
        storage.truncate(ntotal - n); // lent tokens are their owner's to take back
    }
}

void IndexLSHSample::forget_undo_impl() noexcept {
    undo = Undo();
}

void IndexLSHSample::hash_new_keys(idx_t n, const float* keys) {
    // hashed as stored, so that codes, norms and the scores agree
    std::vector<float> rounded;
    if (kv_type != KVType::f32) {
        rounded.resize(size_t(n) * d);
        round_to(kv_type, keys, rounded.size(), rounded.data());
        keys = rounded.data();
    }
    if (mean.empty()) {
        // centre by the mean of the first keys hashed; it never changes after,
        // so that the codes already computed stay valid
        mean.assign(d, 0.0f);
        std::vector<double> acc(d, 0.0);
        for (idx_t i = 0; i < n; i++) {
            for (int j = 0; j < d; j++) {
                acc[j] += keys[i * d + j];
            }
        }
        for (int j = 0; j < d; j++) {
            mean[j] = float(acc[j] / n);
        }
    }
    if (mean_projection.empty()) {
        mean_projection.resize(size_t(K) * L);
        inner_products_scaled(mean.data(), planes.data(), d, K * L, 1.0f, mean_projection.data());
    }
    const idx_t n0 = ntotal;
    grow_to(codes, size_t(n0 + n - n_indexed) * L);
    grow_to(norms, size_t(n0 + n));
    // hashed in blocks of keys: each tile of hyperplanes is scored against
    // the whole block while it sits in L1 (the planes, K * L * d floats,
    // are 768 KB at 10x150 and d = 128), to the codes hash_projected gives
    constexpr idx_t kKeysPerBlock = 8;
    const size_t r = size_t(K) * L;
    parallel_for((n + kKeysPerBlock - 1) / kKeysPerBlock, [&](idx_t block) {
        const idx_t i0 = block * kKeysPerBlock, g = std::min(kKeysPerBlock, n - i0);
        std::vector<float> proj(size_t(g) * r);
        inner_products_multi(keys + i0 * d, size_t(g), planes.data(), d, r, proj.data(), r);
        for (idx_t i = i0; i < i0 + g; i++) {
            codes_from_projection(proj.data() + size_t(i - i0) * r, mean_projection.data(), K, L,
                                  tail_codes(n0 + i));
            const float* k = keys + i * d;
            double s = 0;
            for (int j = 0; j < d; j++) {
                double c = double(k[j]) - mean[j];
                s += c * c;
            }
            norms[n0 + i] = float(std::sqrt(s));
        }
    });
    const idx_t n_all = n0 + n;
    idx_t tail = n_all - n_indexed;
    if (n_indexed == 0 || tail * 8 > n_indexed) {
        build_tables();
    } else if (n_all - std::max(n_recent, n_indexed) > recent_threshold(tail)) {
        build_recent_tables();
    }
}

namespace {

/// The first t tail tokens (n_indexed onwards) by their bucket in table l:
/// start (size 2^K + 1) gets the buckets' bounds in ids (size t), which
/// gets the ids bucket by bucket, ascending within each (a counting sort).
void sort_tail_by_bucket(const IndexLSHSample& s, int l, size_t t, uint32_t* start, uint32_t* ids) {
    const size_t B = size_t(1) << s.K;
    const uint16_t* c = s.codes.data() + l; // token n_indexed + i at c[i * L]
    std::fill(start, start + B + 1, 0u);
    for (size_t i = 0; i < t; i++) {
        start[c[i * s.L] + 1]++;
    }
    for (size_t b = 0; b < B; b++) {
        start[b + 1] += start[b];
    }
    std::vector<uint32_t> fill(start, start + B);
    for (size_t i = 0; i < t; i++) {
        ids[fill[c[i * s.L]]++] = uint32_t(s.n_indexed + i);
    }
}

} // namespace

void IndexLSHSample::build_recent_tables() {
    idx_t n = tokens().size(), t = n - n_indexed;
    std::vector<uint32_t> new_offsets, new_ids;
    if (t > 0) {
        // built aside, then swapped in: a failed allocation changes nothing
        size_t B = size_t(1) << K;
        new_offsets.assign(size_t(L) * (B + 1), 0);
        new_ids.resize(size_t(L) * t);
        for (int l = 0; l < L; l++) {
            sort_tail_by_bucket(*this, l, size_t(t), new_offsets.data() + size_t(l) * (B + 1),
                                new_ids.data() + size_t(l) * t);
        }
    }
    recent_offsets.swap(new_offsets);
    recent_ids.swap(new_ids);
    keep_recent_for_undo(new_offsets, new_ids); // the old ones, now
    n_recent = t > 0 ? n : n_indexed;
}

void IndexLSHSample::keep_recent_for_undo(std::vector<uint32_t>& old_offsets, std::vector<uint32_t>& old_ids) {
    if (keeping_undo() && !undo.recent_saved) {
        undo.recent_saved = true; // kept instead of freed
        undo.recent_offsets.swap(old_offsets);
        undo.recent_ids.swap(old_ids);
        undo.n_recent = n_recent;
    }
}

namespace {

/// A tail-table bucket: plain ids (IndexLSHSample::recent_ids).
struct PlainIds {
    const uint32_t* ids;
    size_t len;

    const uint32_t* data() const {
        return ids;
    }
    template <class F>
    void for_each(F&& f) const {
        for (size_t j = 0; j < len; j++) {
            f(ids[j]);
        }
    }
};

/// Bucket b of main table l (tables built: n_indexed > 0).
GapCodedIds main_bucket(const IndexLSHSample& s, int l, size_t b) {
    const uint32_t* off = s.offsets.data() + size_t(l) * ((size_t(1) << s.K) + 1);
    return {s.table_words.data() + s.table_begin[l] + off[b], size_t(off[b + 1] - off[b])};
}

/// Bucket b of tail table l (n_recent > n_indexed).
PlainIds recent_bucket(const IndexLSHSample& s, int l, size_t b) {
    const uint32_t* off = s.recent_offsets.data() + size_t(l) * ((size_t(1) << s.K) + 1);
    return {s.recent_ids.data() + size_t(l) * size_t(s.n_recent - s.n_indexed) + off[b],
            size_t(off[b + 1] - off[b])};
}

} // namespace

void IndexLSHSample::build_tables(idx_t n) {
    n = n < 0 ? tokens().size() : n;
    FAISS_THROW_IF_NOT_FMT(
            n >= n_indexed && n <= tokens().size(),
            "IndexLSHSample::build_tables: n=%zd outside [%zd, %zd]: the tables only grow",
            ssize_t(n),
            ssize_t(n_indexed),
            ssize_t(tokens().size()));
    // Each table's buckets are the old bucket's ids (all below n_indexed,
    // ascending) followed by the folded tail's (ascending): the layout a
    // build from every token's code gives, without keeping those codes.
    size_t B = size_t(1) << K, n_old = size_t(n_indexed), t = size_t(n - n_indexed);
    std::vector<uint32_t> new_offsets(size_t(L) * (B + 1), 0);
    std::vector<size_t> new_begin(size_t(L) + 1, 0);
    std::vector<uint16_t, HugePageAllocator<uint16_t>> new_words;
    new_words.reserve(size_t(L) * n); // and 2 more words per long gap, if any
    std::vector<uint32_t> tail_start(B + 1), tail_by_bucket(t);
    for (int l = 0; l < L; l++) {
        sort_tail_by_bucket(*this, l, t, tail_start.data(), tail_by_bucket.data());
        uint32_t* off = new_offsets.data() + size_t(l) * (B + 1);
        const size_t begin = new_words.size();
        new_begin[l] = begin;
        for (size_t b = 0; b < B; b++) {
            off[b] = uint32_t(new_words.size() - begin);
            uint32_t last = ~0u;
            if (n_old > 0) {
                main_bucket(*this, l, b).for_each([&](uint32_t id) { append_gap(new_words, last, id); });
            }
            for (uint32_t j = tail_start[b]; j < tail_start[b + 1]; j++) {
                append_gap(new_words, last, tail_by_bucket[j]);
            }
        }
        off[B] = uint32_t(new_words.size() - begin);
    }
    new_begin[L] = new_words.size();
    if (new_words.capacity() > new_words.size() + new_words.size() / 16) {
        new_words.shrink_to_fit(); // long gaps outgrew the reserve
    }
    // the folded tokens' codes now live in the tables; the rest stay. Made
    // before anything is swapped in: a failed allocation changes nothing.
    std::vector<uint16_t> rest(codes.begin() + t * L, codes.end());
    offsets.swap(new_offsets);
    table_begin.swap(new_begin);
    table_words.swap(new_words);
    codes.swap(rest);
    if (keeping_undo() && !undo.main_saved) {
        // an append's undo needs the tables this one replaces: kept instead
        // of freed (until forget_undo), with the tail's codes
        undo.main_saved = true;
        undo.offsets.swap(new_offsets);
        undo.table_begin.swap(new_begin);
        undo.table_words.swap(new_words);
        undo.codes.swap(rest);
        undo.n_indexed = n_indexed;
    }
    keep_recent_for_undo(recent_offsets, recent_ids);
    n_indexed = n;
    recent_offsets.clear();
    recent_ids.clear();
    n_recent = n;
}

std::vector<uint16_t> IndexLSHSample::all_codes() const {
    std::vector<uint16_t> all(size_t(ntotal) * L);
    const size_t B = size_t(1) << K;
    for (int l = 0; l < L && n_indexed > 0; l++) {
        for (size_t b = 0; b < B; b++) {
            main_bucket(*this, l, b).for_each([&](uint32_t id) { all[size_t(id) * L + l] = uint16_t(b); });
        }
    }
    std::copy(codes.begin(), codes.end(), all.begin() + size_t(n_indexed) * L);
    return all;
}

void IndexLSHSample::plain_tables(std::vector<uint32_t>& plain_offsets, std::vector<int32_t>& ids)
        const {
    const size_t B = size_t(1) << K, n = size_t(n_indexed);
    plain_offsets.assign(n > 0 ? size_t(L) * (B + 1) : 0, 0);
    ids.resize(size_t(L) * n);
    for (int l = 0; l < L && n > 0; l++) {
        uint32_t* off = plain_offsets.data() + size_t(l) * (B + 1);
        int32_t* out = ids.data() + size_t(l) * n;
        size_t at = 0;
        for (size_t b = 0; b < B; b++) {
            off[b] = uint32_t(at);
            main_bucket(*this, l, b).for_each([&](uint32_t id) { out[at++] = int32_t(id); });
        }
        off[B] = uint32_t(at);
    }
}

namespace {

/// Per-thread scratch of sample_one: zeroed collision counters and bitsets
/// (size >= ntotal, grown once) and buffers sized by the buckets walked.
struct SampleScratch {
    std::vector<uint8_t> count8;
    std::vector<uint16_t> count16;
    std::vector<uint64_t> seen1, seen2; ///< ids hit at least once / twice
    std::vector<uint32_t> touched, emitted, tmp;
    std::vector<uint32_t> hist;
    std::vector<double> cosines; ///< cos(query, centred key) of the sample
};

SampleScratch& sample_scratch() {
    thread_local SampleScratch s;
    return s;
}

/// Counts collisions of the ids of one bucket, branch-free: an id goes to
/// touched at its first hit and to emitted at its (hm1 + 1)-th.
template <class Count, class Bucket>
inline void walk_bucket(
        const Bucket& bucket,
        Count* count,
        unsigned hm1,
        uint32_t* touched,
        size_t& nt,
        uint32_t* emitted,
        size_t& ne) {
    constexpr unsigned kMax = std::numeric_limits<Count>::max();
    bucket.for_each([&](uint32_t id) {
        unsigned c = count[id];
        touched[nt] = id;
        nt += c == 0;
        emitted[ne] = id;
        ne += c == hm1;
        count[id] = Count(c + (c < kMax));
    });
}

/** Marks the ids of one bucket in two bitsets: seen1 = hit at least once,
 * seen2 = hit at least twice (min_hits <= 2, MagicPIG's setting). Two
 * L1/L2-resident words per id and no branch, against a counter, a touched
 * list and an emitted list for general min_hits; and the ids come out of
 * the bitset already sorted. */
template <class Bucket>
inline void mark_bucket(const Bucket& bucket, uint64_t* seen1, uint64_t* seen2) {
    bucket.for_each([&](uint32_t id) {
        size_t w = id >> 6;
        uint64_t bit = uint64_t(1) << (id & 63);
        uint64_t s1 = seen1[w];
        seen2[w] |= s1 & bit;
        seen1[w] = s1 | bit;
    });
}

/// Loads one element of each cache line of ids[0, len) (and the last), so
/// that the lines are on their way before the ids are used.
template <class Id>
inline void touch_lines(const Id* ids, size_t len) {
    constexpr size_t kPerLine = 64 / sizeof(Id);
    Id acc = 0;
    for (size_t j = 0; j < len; j += kPerLine) {
        acc |= ids[j];
    }
    if (len > 0) {
        acc |= ids[len - 1];
    }
    __asm__ volatile("" : : "r"(acc)); // the loads are the point: keep them
}

/// Appends the set bits of words[0, n_words) to out as ids, ascending.
size_t bits_to_ids(const uint64_t* words, size_t n_words, uint32_t* out) {
    size_t n = 0;
    for (size_t w = 0; w < n_words; w++) {
        for (uint64_t x = words[w]; x; x &= x - 1) {
            out[n++] = uint32_t(w * 64 + __builtin_ctzll(x));
        }
    }
    return n;
}

/// Sorts a[0, n) ascending (ids < 2^bits), LSD radix with <= 11-bit digits.
void sort_ids(uint32_t* a, size_t n, int bits, std::vector<uint32_t>& tmp, std::vector<uint32_t>& hist) {
    if (n < 256) {
        std::sort(a, a + n);
        return;
    }
    int passes = std::max(1, (bits + 10) / 11);
    int w = (bits + passes - 1) / passes;
    uint32_t mask = (1u << w) - 1;
    tmp.resize(std::max(tmp.size(), n));
    hist.resize(size_t(1) << w);
    uint32_t *src = a, *dst = tmp.data();
    for (int p = 0; p < passes; p++) {
        int shift = p * w;
        std::fill(hist.begin(), hist.end(), 0u);
        for (size_t i = 0; i < n; i++) {
            hist[(src[i] >> shift) & mask]++;
        }
        uint32_t sum = 0;
        for (auto& h : hist) {
            uint32_t c = h;
            h = sum;
            sum += c;
        }
        for (size_t i = 0; i < n; i++) {
            dst[hist[(src[i] >> shift) & mask]++] = src[i];
        }
        std::swap(src, dst);
    }
    if (src != a) {
        std::copy(src, src + n, a);
    }
}

/// Rows gathered per kernel call; the rows of the next block are prefetched
/// while this one is computed.
constexpr size_t kGatherBlock = 8;

inline void prefetch_rows(KVRows rows, const idx_t* ids, size_t n) {
    size_t bytes = rows.row_bytes();
    for (size_t t = 0; t < n; t++) {
        const char* p = static_cast<const char*>(rows.data) + size_t(ids[t]) * bytes;
        for (size_t b = 0; b < bytes; b += 64) {
            __builtin_prefetch(p + b);
        }
        __builtin_prefetch(p + bytes - 1);
    }
}

/// s[t] = <q, x_{ids[t]}>, ids ascending, rows prefetched a block ahead.
void gathered_dots(const float* q, KVRows x, const idx_t* ids, size_t m, float* s) {
    prefetch_rows(x, ids, std::min(m, kGatherBlock));
    for (size_t t0 = 0; t0 < m; t0 += kGatherBlock) {
        size_t nb = std::min(kGatherBlock, m - t0);
        if (t0 + nb < m) {
            prefetch_rows(x, ids + t0 + nb, std::min(kGatherBlock, m - t0 - nb));
        }
        inner_products_by_ids(q, x, ids + t0, nb, 1.0f, s + t0);
    }
}

/// out = sum_t w[t] v_{ids[t]}, rows prefetched a block ahead.
void gathered_weighted_sum(
        const float* w, KVRows v, const idx_t* ids, size_t m, float* out) {
    size_t dv = v.dim;
    constexpr size_t kBlock = 4 * kGatherBlock;
    std::vector<float> part(dv);
    std::fill(out, out + dv, 0.0f);
    prefetch_rows(v, ids, std::min(m, kGatherBlock));
    for (size_t t0 = 0; t0 < m; t0 += kBlock) {
        size_t nb = std::min(kBlock, m - t0);
        for (size_t t1 = 0; t1 < nb; t1 += kGatherBlock) {
            size_t next = t0 + t1 + kGatherBlock;
            if (next < m) {
                prefetch_rows(v, ids + next, std::min(kGatherBlock, m - next));
            }
        }
        weighted_sum_by_ids(w + t0, v, ids + t0, nb, part.data());
        for (size_t j = 0; j < dv; j++) {
            out[j] += part[j];
        }
    }
}

/// Keeps the cap best-scoring of the sampled keys (cap > 0), in ascending
/// id order: max_sample. The estimate is then no longer unbiased.
void keep_best_scoring(idx_t cap, Selection& sel, std::vector<float>& dots, std::vector<float>& log_u) {
    const size_t m = sel.ids.size();
    if (cap <= 0 || idx_t(m) <= cap) {
        return;
    }
    std::vector<size_t> order(m);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + cap, order.end(), [&](size_t a, size_t b) {
        return dots[a] > dots[b] || (dots[a] == dots[b] && a < b);
    });
    order.resize(cap);
    std::sort(order.begin(), order.end());
    for (idx_t t = 0; t < cap; t++) {
        sel.ids[t] = sel.ids[order[t]];
        dots[t] = dots[order[t]];
        log_u[t] = log_u[order[t]];
    }
    sel.ids.resize(cap);
    dots.resize(cap);
    log_u.resize(cap);
}

} // namespace

void IndexLSHSample::sample_one(
        const float* q,
        int hits,
        idx_t cap,
        bool count_reads,
        Selection& sel,
        std::vector<float>& dots,
        std::vector<float>& log_u) const {
    sel.clear();
    if (hits <= 0) {
        sel.set_all(ntotal);
        sel.inclusion.clear();
        dots.resize(ntotal);
        inner_products_scaled(q, tokens().key_rows(), ntotal, 1.0f, dots.data());
        log_u.assign(ntotal, 0.0f);
        keep_best_scoring(cap, sel, dots, log_u);
        sel.n_scanned = size_t(ntotal) - sel.ids.size(); // scored, then dropped by the cap
        return;
    }
    std::vector<uint16_t> qc(L);
    hash(q, nullptr, qc.data());
    bool recent = n_recent > n_indexed;
    // the buckets the query falls in, in both levels: the work is their size.
    // The first line of each is asked for now: the walk's L bucket starts
    // then miss together instead of one table after another.
    size_t total = 0;
    for (int l = 0; l < L; l++) { // words bound the ids
        GapCodedIds main = main_bucket(*this, l, qc[l]);
        total += main.len;
        __builtin_prefetch(main.words);
        total += recent ? recent_bucket(*this, l, qc[l]).len : 0;
    }
    SampleScratch& sc = sample_scratch();
    sc.emitted.resize(std::max(sc.emitted.size(), total + 1 + size_t(ntotal - std::max(n_recent, n_indexed))));
    // calls visit(ids, len) for the query's bucket in every table, both
    // levels. The buckets go in groups of kTouchGroup: each line of a group's
    // buckets is loaded once before they are visited, so that their misses
    // overlap; the visit's stores hold back the loads' run-ahead when both
    // are in one loop (walk at 128k keys: 58-61 -> 38-42 us; prefetch
    // instructions ahead of the walk gained nothing).
    auto for_each_bucket = [&](auto&& visit) {
        constexpr int kTouchGroup = 16;
        for (int l0 = 0; l0 < L; l0 += kTouchGroup) {
            int l1 = std::min(L, l0 + kTouchGroup);
            for (int pass = 0; pass < 2; pass++) {
                auto go = [&](const auto& bucket) {
                    pass == 0 ? touch_lines(bucket.data(), bucket.len) : visit(bucket);
                };
                for (int l = l0; l < l1; l++) {
                    go(main_bucket(*this, l, qc[l]));
                    if (recent) {
                        go(recent_bucket(*this, l, qc[l]));
                    }
                }
            }
        }
    };
    size_t ne = 0;
    if (hits <= 2) {
        // two bitsets over the table ids; scanning and clearing them costs
        // n / 64 words, ~1/4000 of the bytes of the keys
        size_t words = (size_t(std::max(n_recent, n_indexed)) + 63) / 64;
        if (sc.seen1.size() < words) {
            sc.seen1.resize(words, 0);
            sc.seen2.resize(words, 0);
        }
        uint64_t *seen1 = sc.seen1.data(), *seen2 = sc.seen2.data();
        for_each_bucket([&](const auto& bucket) { mark_bucket(bucket, seen1, seen2); });
        ne = bits_to_ids(hits == 1 ? seen1 : seen2, words, sc.emitted.data());
        std::fill_n(seen1, words, 0);
        std::fill_n(seen2, words, 0);
    } else {
        sc.touched.resize(std::max(sc.touched.size(), total + 1));
        size_t nt = 0;
        auto walk = [&](auto* count) {
            unsigned hm1 = unsigned(hits - 1);
            for_each_bucket([&](const auto& bucket) {
                walk_bucket(bucket, count, hm1, sc.touched.data(), nt, sc.emitted.data(), ne);
            });
            for (size_t t = 0; t < nt; t++) {
                count[sc.touched[t]] = 0;
            }
        };
        if (hits <= 254) { // uint8 counters saturate at 255
            if (sc.count8.size() < size_t(ntotal)) {
                sc.count8.resize(ntotal, 0);
            }
            walk(sc.count8.data());
        } else {
            if (sc.count16.size() < size_t(ntotal)) {
                sc.count16.resize(ntotal, 0);
            }
            walk(sc.count16.data());
        }
        int bits = 1;
        while (bits < 32 && (uint64_t(1) << bits) < uint64_t(ntotal)) {
            bits++;
        }
        sort_ids(sc.emitted.data(), ne, bits, sc.tmp, sc.hist);
    }
    for (idx_t i = std::max(n_recent, n_indexed); i < ntotal; i++) { // the last tokens, code by code
        int c = 0;
        for (int l = 0; l < L; l++) {
            c += tail_codes(i)[l] == qc[l];
        }
        if (c >= hits) {
            sc.emitted[ne++] = uint32_t(i);
        }
    }
    size_t m = ne;
    sel.ids.assign(sc.emitted.begin(), sc.emitted.begin() + m);
    dots.resize(m);
    gathered_dots(q, tokens().key_rows(), sel.ids.data(), m, dots.data());
    // inclusion probabilities from cos(q, centred key), through the table
    double qm = 0, qq = 0;
    for (int j = 0; j < d; j++) {
        qm += double(q[j]) * mean[j];
        qq += double(q[j]) * q[j];
    }
    double qn = std::sqrt(qq);
    std::vector<double>& cosines = sc.cosines;
    cosines.resize(m);
    for (size_t t = 0; t < m; t++) {
        // a zero vector hashes to all-zero codes: against a zero query a
        // zero (centred) key collides in every table (u = 1), against any
        // other vector in half the bits (the angle of orthogonal vectors)
        double kn = norms[sel.ids[t]];
        double den = qn * kn;
        cosines[t] = den > 0 ? (dots[t] - qm) / den : (qn == 0 && kn == 0 ? 1.0 : 0.0);
    }
    log_u.resize(m);
    table_for(hits)->log_inclusion(cosines.data(), m, log_u.data());
    keep_best_scoring(cap, sel, dots, log_u);
    if (count_reads) {
        sel.n_scanned = sample_reads(qc.data(), m) + (m - sel.ids.size());
    }
}

size_t IndexLSHSample::sample_reads(const uint16_t* qc, size_t sampled) const {
    size_t bytes = planes.size() * sizeof(float);
    bool recent = n_recent > n_indexed;
    for (int l = 0; l < L; l++) { // per level: the bucket's bounds and ids
        bytes += 2 * sizeof(uint32_t) + sizeof(size_t) +
                main_bucket(*this, l, qc[l]).len * sizeof(uint16_t); // and table_begin[l]
        if (recent) {
            bytes += 2 * sizeof(uint32_t) + recent_bucket(*this, l, qc[l]).len * sizeof(uint32_t);
        }
    }
    bytes += size_t(ntotal - std::max(n_recent, n_indexed)) * L * sizeof(uint16_t);
    bytes += sampled * sizeof(float); // norms
    return key_equivalents(bytes);
}

void IndexLSHSample::knobs(const faiss::SearchParameters* params, int* hits, idx_t* cap) const {
    auto p = dynamic_cast<const SearchParametersLSH*>(params);
    *hits = p && p->min_hits >= 0 ? p->min_hits : min_hits;
    *cap = p && p->max_sample >= 0 ? p->max_sample : max_sample;
    FAISS_THROW_IF_NOT_FMT(
            *hits <= L, "LSHSample: min_hits=%d exceeds the %d tables", *hits, L);
}

void IndexLSHSample::select_one(
        const float* q,
        Selection& sel,
        const faiss::SearchParameters* params) const {
    int hits;
    idx_t cap;
    knobs(params, &hits, &cap);
    std::vector<float> dots, log_u;
    sample_one(q, hits, cap, true, sel, dots, log_u);
    sel.inclusion.resize(sel.ids.size());
    for (size_t t = 0; t < sel.ids.size(); t++) {
        sel.inclusion[t] = std::exp(log_u[t]);
    }
}

float IndexLSHSample::attend_one(const float* q, float* out, const faiss::SearchParameters* params)
        const {
    int hits;
    idx_t cap;
    knobs(params, &hits, &cap);
    // the unbiased estimator on the sample, softmax(s_i - log u_i), from the
    // inner products sampling computed for u, and log u from the table
    Selection sel;
    std::vector<float> s, log_u;
    sample_one(q, hits, cap, false, sel, s, log_u);
    size_t m = sel.size();
    if (m == 0) {
        std::fill(out, out + d_value, 0.0f);
        return -std::numeric_limits<float>::infinity();
    }
    float scale = score_scale();
    for (size_t t = 0; t < m; t++) {
        s[t] *= scale;
    }
    float lse = softmax_inplace(s.data(), log_u.data(), m);
    gathered_weighted_sum(s.data(), tokens().value_rows(), sel.ids.data(), m, out);
    return lse;
}

bool IndexLSHSample::share_tokens(const KVStorage* lent) {
    FAISS_THROW_IF_NOT_MSG(lent, "IndexLSHSample::share_tokens: no tokens (nullptr)");
    drop_for_shared(storage, *lent, ntotal, "IndexLSHSample");
    shared_tokens = lent;
    return true;
}

void IndexLSHSample::reset_impl() {
    storage.clear(); // lent tokens are the owner's to clear
    mean.clear();
    mean_projection.clear();
    norms.clear();
    codes.clear();
    offsets.clear();
    table_begin.clear();
    table_words.clear();
    recent_offsets.clear();
    recent_ids.clear();
    n_indexed = 0;
    n_recent = 0;
    ntotal = 0;
}

size_t IndexLSHSample::table_bytes() const {
    return codes.capacity() * sizeof(uint16_t) + offsets.capacity() * sizeof(uint32_t) +
            capacity_bytes(table_begin) + capacity_bytes(table_words) +
            recent_offsets.capacity() * sizeof(uint32_t) +
            recent_ids.capacity() * sizeof(uint32_t) + norms.capacity() * sizeof(float);
}

size_t IndexLSHSample::memory_bytes() const {
    return storage.memory_bytes() + table_bytes() +
            (planes.size() + mean.size() + mean_projection.size()) * sizeof(float);
}

std::vector<SearchKnob> SearchParametersLSH::set_knobs() const {
    std::vector<SearchKnob> knobs;
    if (min_hits >= 0) { // < 0: the index's own
        knobs.push_back({"min_hits", double(min_hits)});
    }
    if (max_sample >= 0) {
        knobs.push_back({"max_sample", double(max_sample)});
    }
    return knobs;
}

std::unique_ptr<SearchParametersKV> SearchParametersLSH::without_knob(const std::string& name) const {
    auto copy = std::make_unique<SearchParametersLSH>(*this);
    if (name == "k") {
        copy->k = 0;
    } else if (name == "min_hits") {
        copy->min_hits = -1;
    } else if (name == "max_sample") {
        copy->max_sample = -1;
    } else {
        return SearchParametersKV::without_knob(name);
    }
    return copy;
}

bool IndexLSHSample::reads_search_knob(const std::string& name) const {
    return name == "min_hits" || name == "max_sample";
}

std::vector<ParameterInfo> IndexLSHSample::parameter_info() const {
    std::vector<ParameterInfo> info = KVIndex::parameter_info();
    info.push_back(ParameterInfo::integer("min_hits", 0, L, "tables a key must collide in to be sampled (0: every token)"));
    info.push_back(ParameterInfo::integer("max_sample", 0, ParameterInfo::kNoBound, "keep at most this many sampled keys, by score (0: all)").tokens());
    return info;
}

bool IndexLSHSample::set_parameter(const std::string& name, double value) {
    if (name != "min_hits" && name != "max_sample") {
        return KVIndex::set_parameter(name, value);
    }
    count_parameter(name, value);
    FAISS_THROW_IF_NOT_FMT(
            name != "min_hits" || value <= L,
            "parameter min_hits=%g exceeds the %d tables",
            value,
            L);
    if (name == "min_hits") {
        min_hits = int(value);
        refresh_table();
    } else {
        max_sample = idx_t(value);
    }
    return true;
}

bool IndexLSHSample::get_parameter(const std::string& name, double* value) const {
    if (name == "min_hits") {
        *value = min_hits;
        return true;
    }
    if (name == "max_sample") {
        *value = double(max_sample);
        return true;
    }
    return KVIndex::get_parameter(name, value);
}

void IndexLSHSample::write_fields(BufferWriter& w) const {
    w.value<int32_t>(K);
    w.value<int32_t>(L);
    w.value<int32_t>(min_hits);
    w.value<int64_t>(max_sample);
    w.value<uint64_t>(seed);
    w.vector(planes);
    w.vector(mean);
    w.vector(norms);
    w.vector(all_codes()); // the record keeps every token's codes (version 1)
    tokens().write(w);
    w.value<int64_t>(n_indexed); // the tables are rebuilt from the codes
}

void IndexLSHSample::read_fields(BufferReader& r, uint32_t) {
    K = r.value<int32_t>("K");
    L = r.value<int32_t>("L");
    min_hits = r.value<int32_t>("min_hits");
    max_sample = r.value<int64_t>("max_sample");
    seed = r.value<uint64_t>("seed");
    check_lsh_shape(K, L, d, "read_index: LSHSample");
    FAISS_THROW_IF_NOT_FMT(
            min_hits >= 0 && min_hits <= L && max_sample >= 0,
            "read_index: invalid LSHSample parameters K=%d L=%d min_hits=%d",
            K,
            L,
            min_hits);
    planes = r.vector<float>("hyperplanes");
    mean = r.vector<float>("centring mean");
    mean_projection.clear(); // projected again at the next add
    norms = r.vector<float>("key norms");
    codes = r.vector<uint16_t>("codes");
    shared_tokens = nullptr;
    storage = KVStorage(d, d_value, kv_type);
    storage.read(r, "LSHSample storage");
    idx_t n_tables = r.value<int64_t>("n_indexed");
    idx_t n = ntotal;
    bool codes_ok = true;
    for (uint16_t c : codes) {
        codes_ok = codes_ok && c < (1u << K);
    }
    // checked before the tables are built from them
    FAISS_THROW_IF_NOT_MSG(
            planes.size() == size_t(K) * L * d && mean.size() == (n > 0 ? size_t(d) : 0) &&
                    norms.size() == size_t(n) && codes.size() == size_t(n) * L &&
                    storage.size() == n && n_tables >= 0 && n_tables <= n &&
                    (n == 0 || n_tables > 0) && codes_ok,
            "read_index: LSHSample tables inconsistent with its tokens");
    check_finite(planes.data(), 1, planes.size(), "read_index: hyperplanes");
    check_finite(mean.data(), 1, mean.size(), "read_index: centring mean");
    check_finite(norms.data(), 1, norms.size(), "read_index: key norms");
    // every token's codes were read: none is in a table yet
    n_indexed = 0;
    n_recent = 0;
    offsets.clear();
    table_begin.clear();
    table_words.clear();
    if (n > 0) {
        build_tables(n_tables);
        build_recent_tables();
    }
    refresh_table();
}

void IndexLSHSample::check_invariants() const {
    KVIndex::check_invariants();
    idx_t n = ntotal;
    size_t B = size_t(1) << K;
    FAISS_THROW_IF_NOT_FMT(
            K >= 1 && K <= 16 && L >= 1 && L <= 4096 && min_hits >= 0 && min_hits <= L &&
                    planes.size() == size_t(K) * L * d &&
                    mean.size() == (n > 0 ? size_t(d) : 0) && norms.size() == size_t(n) &&
                    codes.size() == size_t(n - n_indexed) * L && tokens().size() == n &&
                    tokens().d == size_t(d) && tokens().d_value == size_t(d_value) &&
                    tokens().type == kv_type && (!shared_tokens || storage.size() == 0) &&
                    n_indexed >= 0 && n_indexed <= n &&
                    (n == 0 || offsets.size() == size_t(L) * (B + 1)) &&
                    (n == 0 || (table_begin.size() == size_t(L) + 1 &&
                                table_words.size() == table_begin[L] &&
                                table_words.size() >= size_t(L) * n_indexed)) &&
                    n_recent >= n_indexed && n_recent <= n &&
                    recent_ids.size() == size_t(L) * (n_recent - n_indexed) &&
                    (n_recent == n_indexed || recent_offsets.size() == size_t(L) * (B + 1)),
            "IndexLSHSample: tables, codes and ntotal=%zd disagree",
            size_t(n));
}

} // namespace kvindex
