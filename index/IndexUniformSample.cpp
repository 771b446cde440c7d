#include <kvindex/IndexUniformSample.h>

#include <algorithm>
#include <unordered_set>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>

#include "checks.h"
#include "random.h"

namespace kvindex {

namespace {

uint64_t splitmix64(uint64_t& state) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/// FNV-1a over the query's bytes: the draw depends on the query, so that
/// the heads of a GQA group and successive decode steps draw apart.
uint64_t hash_query(const float* q, int d) {
    uint64_t h = 0xcbf29ce484222325ull;
    const auto* b = reinterpret_cast<const unsigned char*>(q);
    for (size_t i = 0; i < size_t(d) * sizeof(float); i++) {
        h = (h ^ b[i]) * 0x100000001b3ull;
    }
    return h;
}

/// Uniform integer in [0, n) (Lemire's multiply-shift; the bias is below
/// n / 2^64, far under any sampling error here).
uint64_t below(uint64_t& state, uint64_t n) {
    return uint64_t((__uint128_t(splitmix64(state)) * n) >> 64);
}

} // namespace

IndexUniformSample::IndexUniformSample() : KVIndex(0, 0) {}

IndexUniformSample::IndexUniformSample(int d, int d_value, KVType kv_type)
        : KVIndex(d, d_value, kv_type), storage(d, this->d_value, kv_type) {}

std::unique_ptr<KVIndex> IndexUniformSample::from_factory(FactoryChain& chain) {
    if (chain.peek() != "Uniform") {
        return nullptr;
    }
    chain.take();
    return std::make_unique<IndexUniformSample>(chain.d, chain.d_value, chain.kv_type);
}

std::vector<idx_t> IndexUniformSample::draw(
        const float* q, idx_t n, idx_t budget, const idx_t* excluded, size_t n_excluded) const {
    const uint64_t n_free = uint64_t(n) - n_excluded;
    const uint64_t m = std::min<uint64_t>(uint64_t(std::max<idx_t>(budget, 0)), n_free);
    std::vector<idx_t> ranks;
    ranks.reserve(m);
    if (m == n_free) {
        for (uint64_t r = 0; r < n_free; r++) {
            ranks.push_back(idx_t(r));
        }
    } else {
        uint64_t state = stream_seed(seed, stream) ^ hash_query(q, d) ^ (uint64_t(n) << 1);
        // Floyd's algorithm: m distinct ranks, each m-subset equally likely
        std::unordered_set<uint64_t> taken;
        taken.reserve(m * 2);
        for (uint64_t j = n_free - m; j < n_free; j++) {
            uint64_t t = below(state, j + 1);
            uint64_t pick = taken.count(t) ? j : t;
            taken.insert(pick);
            ranks.push_back(idx_t(pick));
        }
        std::sort(ranks.begin(), ranks.end());
    }
    // rank r -> the r-th id not excluded (both lists increasing)
    size_t e = 0;
    for (idx_t& r : ranks) {
        idx_t id = r + idx_t(e);
        while (e < n_excluded && excluded[e] <= id) {
            e++;
            id = r + idx_t(e);
        }
        r = id;
    }
    return ranks;
}

void IndexUniformSample::select_outside_one(
        const float* q,
        const idx_t* excluded,
        size_t n_excluded,
        Selection& sel,
        const faiss::SearchParameters* params) const {
    sel.clear();
    sel.ids = draw(q, ntotal, effective_k(params), excluded, n_excluded);
    // u = m / (tokens outside), the same for every drawn token
    const float u = sel.ids.empty()
            ? 1.0f
            : float(double(sel.ids.size()) / double(uint64_t(ntotal) - n_excluded));
    sel.inclusion.assign(sel.ids.size(), u);
}

void IndexUniformSample::select_one(
        const float* q, Selection& sel, const faiss::SearchParameters* params) const {
    select_outside_one(q, nullptr, 0, sel, params);
}

void IndexUniformSample::add_kv_impl(idx_t n, const float* keys, const float* values) {
    storage.append(n, keys, values);
}

void IndexUniformSample::reset_impl() {
    storage.clear();
    ntotal = 0;
}

size_t IndexUniformSample::memory_bytes() const {
    return storage.memory_bytes();
}

std::vector<ParameterInfo> IndexUniformSample::parameter_info() const {
    std::vector<ParameterInfo> info = KVIndex::parameter_info();
    info.push_back({"seed", false, "seed of the draws (with the per-head stream), >= 0"});
    return info;
}

bool IndexUniformSample::set_parameter(const std::string& name, double value) {
    if (name != "seed") {
        return KVIndex::set_parameter(name, value);
    }
    FAISS_THROW_IF_NOT_FMT(
            value == 0 || is_positive_integer(value),
            "parameter seed=%g must be a non-negative integer",
            value);
    seed = uint64_t(value);
    return true;
}

bool IndexUniformSample::get_parameter(const std::string& name, double* value) const {
    if (name != "seed") {
        return KVIndex::get_parameter(name, value);
    }
    *value = double(seed);
    return true;
}

void IndexUniformSample::set_stream(uint64_t s) {
    stream = s;
}

void IndexUniformSample::write_fields(BufferWriter& w) const {
    w.value<uint64_t>(seed);
    w.value<uint64_t>(stream);
    storage.write(w);
}

void IndexUniformSample::read_fields(BufferReader& r, uint32_t) {
    seed = r.value<uint64_t>("seed");
    stream = r.value<uint64_t>("stream");
    storage = KVStorage(d, d_value, kv_type);
    storage.read(r, "Uniform storage");
}

void IndexUniformSample::check_invariants() const {
    KVIndex::check_invariants();
    FAISS_THROW_IF_NOT_FMT(
            storage.d == size_t(d) && storage.d_value == size_t(d_value) &&
                    storage.type == kv_type && storage.size() == ntotal,
            "IndexUniformSample: storage holds %zd tokens, ntotal is %zd",
            size_t(storage.size()),
            size_t(ntotal));
}

} // namespace kvindex
