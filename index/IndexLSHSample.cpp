#include <kvindex/IndexLSHSample.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/attention.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>
#include <kvindex/kernels.h>

#include "checks.h"
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
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> g(0.0f, 1.0f);
    planes.resize(size_t(K) * L * d);
    for (auto& x : planes) {
        x = g(rng);
    }
}

void IndexLSHSample::hash(const float* x, const float* center, uint16_t* out) const {
    int r = K * L;
    std::vector<float> proj(r), cproj(center ? r : 0);
    inner_products_scaled(x, planes.data(), d, r, 1.0f, proj.data());
    if (center) {
        inner_products_scaled(center, planes.data(), d, r, 1.0f, cproj.data());
    }
    for (int l = 0; l < L; l++) {
        uint16_t c = 0;
        for (int b = 0; b < K; b++) {
            float v = proj[l * K + b] - (center ? cproj[l * K + b] : 0.0f);
            c |= uint16_t(v > 0) << b;
        }
        out[l] = c;
    }
}

void IndexLSHSample::add_kv_impl(idx_t n, const float* keys, const float* values) {
    // hashed as stored, so that codes, norms and the scores agree
    std::vector<float> rounded;
    const float* input_keys = keys;
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
    idx_t n0 = storage.size();
    codes.resize((n0 + n) * L);
    norms.resize(n0 + n);
    parallel_for(n, [&](idx_t i) {
        const float* k = keys + i * d;
        hash(k, mean.data(), codes.data() + (n0 + i) * L);
        double s = 0;
        for (int j = 0; j < d; j++) {
            double c = double(k[j]) - mean[j];
            s += c * c;
        }
        norms[n0 + i] = float(std::sqrt(s));
    });
    storage.append(n, input_keys, values);
    idx_t tail = storage.size() - n_indexed;
    if (n_indexed == 0 || tail * 8 > n_indexed) {
        build_tables();
    }
}

void IndexLSHSample::build_tables(idx_t n) {
    n = n < 0 ? storage.size() : n;
    size_t B = size_t(1) << K;
    offsets.assign(size_t(L) * (B + 1), 0);
    bool narrow = n <= 65536;
    ids16.clear();
    ids32.clear();
    (narrow ? ids16.resize(size_t(L) * n) : ids32.resize(size_t(L) * n));
    for (int l = 0; l < L; l++) {
        uint32_t* off = offsets.data() + size_t(l) * (B + 1);
        for (idx_t i = 0; i < n; i++) {
            off[codes[i * L + l] + 1]++;
        }
        for (size_t b = 0; b < B; b++) {
            off[b + 1] += off[b];
        }
        std::vector<uint32_t> fill(off, off + B);
        for (idx_t i = 0; i < n; i++) { // ids ascending within each bucket
            size_t at = size_t(l) * n + fill[codes[i * L + l]]++;
            if (narrow) {
                ids16[at] = uint16_t(i);
            } else {
                ids32[at] = uint32_t(i);
            }
        }
    }
    n_indexed = n;
}

void IndexLSHSample::sample_one(
        const float* q,
        int hits,
        idx_t cap,
        Selection& sel,
        std::vector<float>& dots,
        std::vector<uint8_t>& count) const {
    sel.clear();
    if (hits <= 0) {
        sel.set_all(ntotal);
        dots.resize(ntotal);
        inner_products_scaled(q, storage.key_rows(), ntotal, 1.0f, dots.data());
        sel.n_scanned = size_t(K) * L;
        return;
    }
    sel.n_scanned = size_t(K) * L; // the query's projections, in key reads
    std::vector<uint16_t> qc(L);
    hash(q, nullptr, qc.data());
    size_t B = size_t(1) << K;
    count.resize(std::max<size_t>(count.size(), ntotal));
    std::vector<idx_t> touched;
    // a token is emitted at its hits-th collision (saturating uint8 counter)
    auto hit = [&](idx_t id) {
        uint8_t& c = count[id];
        if (c == 0) {
            touched.push_back(id);
        }
        if (c < 255) {
            c++;
        }
        if (c == hits) {
            sel.ids.push_back(id);
        }
    };
    for (int l = 0; l < L; l++) {
        const uint32_t* off = offsets.data() + size_t(l) * (B + 1);
        size_t base = size_t(l) * n_indexed;
        for (uint32_t j = off[qc[l]]; j < off[qc[l] + 1]; j++) {
            hit(ids16.empty() ? idx_t(ids32[base + j]) : idx_t(ids16[base + j]));
        }
    }
    for (idx_t i : touched) {
        count[i] = 0;
    }
    for (idx_t i = n_indexed; i < ntotal; i++) { // the tail, code by code
        int c = 0;
        for (int l = 0; l < L; l++) {
            c += codes[i * L + l] == qc[l];
        }
        if (c >= hits) {
            sel.ids.push_back(i);
        }
    }
    // inclusion probabilities from the angle between q and the centred key
    size_t m = sel.ids.size();
    dots.resize(m);
    inner_products_by_ids(q, storage.key_rows(), sel.ids.data(), m, 1.0f, dots.data());
    double qm = 0, qq = 0;
    for (int j = 0; j < d; j++) {
        qm += double(q[j]) * mean[j];
        qq += double(q[j]) * q[j];
    }
    double qn = std::sqrt(qq);
    sel.inclusion.resize(m);
    for (size_t t = 0; t < m; t++) {
        double den = qn * norms[sel.ids[t]];
        double cosv = den > 0 ? (dots[t] - qm) / den : 0.0;
        double theta = std::acos(std::min(1.0, std::max(-1.0, cosv)));
        double u = lsh_inclusion_probability(theta, K, L, hits);
        sel.inclusion[t] = float(std::max(u, 1e-30));
    }
    if (cap > 0 && idx_t(m) > cap) {
        // keep the best-scoring keys (the estimate is then no longer unbiased)
        std::vector<size_t> order(m);
        std::iota(order.begin(), order.end(), 0);
        std::partial_sort(order.begin(), order.begin() + cap, order.end(),
                          [&](size_t a, size_t b) { return dots[a] > dots[b]; });
        Selection kept;
        kept.n_scanned = sel.n_scanned;
        std::vector<float> kept_dots(cap);
        for (idx_t t = 0; t < cap; t++) {
            kept.push_back(sel.ids[order[t]], sel.inclusion[order[t]]);
            kept_dots[t] = dots[order[t]];
        }
        sel = std::move(kept);
        dots = std::move(kept_dots);
    }
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
    thread_local std::vector<uint8_t> count;
    std::vector<float> dots;
    sample_one(q, hits, cap, sel, dots, count);
}

float IndexLSHSample::attend_one(const float* q, float* out, const faiss::SearchParameters* params)
        const {
    int hits;
    idx_t cap;
    knobs(params, &hits, &cap);
    // the unbiased estimator on the sample, softmax(s_i - log u_i), from the
    // inner products sampling computed for u
    thread_local std::vector<uint8_t> count;
    Selection sel;
    std::vector<float> s;
    sample_one(q, hits, cap, sel, s, count);
    size_t m = sel.size();
    float scale = score_scale();
    std::vector<float> log_u(m);
    for (size_t t = 0; t < m; t++) {
        s[t] *= scale;
        log_u[t] = std::log(sel.inclusion[t]);
    }
    return attention_from_scores(
            s.data(), log_u.data(), storage.value_rows(), sel.ids.data(), m, out);
}

void IndexLSHSample::reset_impl() {
    storage.clear();
    mean.clear();
    norms.clear();
    codes.clear();
    offsets.clear();
    ids16.clear();
    ids32.clear();
    n_indexed = 0;
    ntotal = 0;
}

size_t IndexLSHSample::table_bytes() const {
    return codes.capacity() * sizeof(uint16_t) + offsets.capacity() * sizeof(uint32_t) +
            ids16.capacity() * sizeof(uint16_t) + ids32.capacity() * sizeof(uint32_t) +
            norms.capacity() * sizeof(float);
}

size_t IndexLSHSample::memory_bytes() const {
    return storage.memory_bytes() + table_bytes() + (planes.size() + mean.size()) * sizeof(float);
}

std::vector<ParameterInfo> IndexLSHSample::parameter_info() const {
    std::vector<ParameterInfo> info = KVIndex::parameter_info();
    info.push_back({"min_hits", false, "tables a key must collide in to be sampled, 0..L (0: every token)"});
    info.push_back({"max_sample", false, "keep at most this many sampled keys, by score (0: all)"});
    return info;
}

bool IndexLSHSample::set_parameter(const std::string& name, double value) {
    if (name != "min_hits" && name != "max_sample") {
        return KVIndex::set_parameter(name, value);
    }
    FAISS_THROW_IF_NOT_FMT(
            value == 0 || is_positive_integer(value),
            "parameter %s=%g must be a non-negative integer",
            name.c_str(),
            value);
    FAISS_THROW_IF_NOT_FMT(
            name != "min_hits" || value <= L,
            "parameter min_hits=%g exceeds the %d tables",
            value,
            L);
    if (name == "min_hits") {
        min_hits = int(value);
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
    w.vector(codes);
    storage.write(w);
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
    norms = r.vector<float>("key norms");
    codes = r.vector<uint16_t>("codes");
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
    if (n > 0) {
        build_tables(n_tables);
    }
}

void IndexLSHSample::check_invariants() const {
    KVIndex::check_invariants();
    idx_t n = ntotal;
    size_t B = size_t(1) << K;
    FAISS_THROW_IF_NOT_FMT(
            K >= 1 && K <= 16 && L >= 1 && L <= 4096 && min_hits >= 0 && min_hits <= L &&
                    planes.size() == size_t(K) * L * d &&
                    mean.size() == (n > 0 ? size_t(d) : 0) && norms.size() == size_t(n) &&
                    codes.size() == size_t(n) * L && storage.size() == n &&
                    storage.d == size_t(d) && storage.d_value == size_t(d_value) &&
                    storage.type == kv_type &&
                    n_indexed >= 0 && n_indexed <= n &&
                    (n == 0 || offsets.size() == size_t(L) * (B + 1)) &&
                    ids16.size() + ids32.size() == size_t(L) * n_indexed,
            "IndexLSHSample: tables, codes and ntotal=%zd disagree",
            size_t(n));
}

} // namespace kvindex
