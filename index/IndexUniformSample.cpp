#include <kvindex/IndexUniformSample.h>

#include <algorithm>
#include <unordered_set>
#include <vector>

#include <kvindex/index_factory.h>

#include <faiss/impl/FaissAssert.h>

#include "checks.h"
#include "random.h"

namespace kvindex {

IndexUniformSample::IndexUniformSample() = default;

IndexUniformSample::IndexUniformSample(int d, int d_value, KVType kv_type)
        : IndexSampleBase(d, d_value, kv_type) {}

std::unique_ptr<KVIndex> IndexUniformSample::from_factory(FactoryChain& chain) {
    if (chain.peek() != "Uniform") {
        return nullptr;
    }
    chain.take();
    return std::make_unique<IndexUniformSample>(chain.d, chain.d_value, chain.kv_type);
}

std::vector<idx_t> IndexUniformSample::draw(
        const float* q, idx_t n, idx_t budget, const idx_t* excluded, size_t n_excluded) const {
    FAISS_THROW_IF_NOT_FMT(n >= 0, "IndexUniformSample::draw: n=%zd must be >= 0", size_t(n));
    check_excluded(excluded, n_excluded, n, "IndexUniformSample::draw");
    const uint64_t n_free = uint64_t(n) - n_excluded;
    const uint64_t m = std::min<uint64_t>(uint64_t(std::max<idx_t>(budget, 0)), n_free);
    std::vector<idx_t> ranks;
    ranks.reserve(m);
    if (m == n_free) {
        for (uint64_t r = 0; r < n_free; r++) {
            ranks.push_back(idx_t(r));
        }
    } else {
        uint64_t state = draw_state(q, n);
        // Floyd's algorithm: m distinct ranks, each m-subset equally likely.
        // The ranks taken are marked in a bitset when it is small beside the
        // sample (hashing each of m ranks cost ~50 ns, 20 us at m = 410),
        // else kept in a hash set; the draws are the same either way.
        auto floyd = [&](auto&& is_taken, auto&& take) {
            for (uint64_t j = n_free - m; j < n_free; j++) {
                uint64_t t = random_below(state, j + 1);
                uint64_t pick = is_taken(t) ? j : t;
                take(pick);
                ranks.push_back(idx_t(pick));
            }
        };
        const uint64_t words = (n_free + 63) / 64;
        if (words <= 8 * m + 1024) {
            std::vector<uint64_t> taken(words, 0);
            floyd([&](uint64_t t) { return (taken[t / 64] >> (t % 64)) & 1; },
                  [&](uint64_t p) { taken[p / 64] |= uint64_t(1) << (p % 64); });
        } else {
            std::unordered_set<uint64_t> taken;
            taken.reserve(m * 2);
            floyd([&](uint64_t t) { return taken.count(t) > 0; },
                  [&](uint64_t p) { taken.insert(p); });
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

} // namespace kvindex
