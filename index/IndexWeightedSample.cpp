#include <kvindex/IndexWeightedSample.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/index_factory.h>
#include <kvindex/kernels.h>

#include "random.h"

namespace kvindex {

namespace {

/// u_i = min(1, c w_i) over weights w_i >= 0 (0: never drawn); every token
/// of positive weight gets u = 1 when `all` is set.
struct InclusionRule {
    double c = 0;
    bool all = false;

    double operator()(float w) const {
        if (!(w > 0)) {
            return 0;
        }
        return all ? 1.0 : std::min(1.0, c * double(w));
    }
};

/// c of the rule by sorting: exact in at most m steps, O(n + m log m).
double inclusion_constant_sorted(const float* w, size_t n, size_t m) {
    std::vector<size_t> avail;
    avail.reserve(n);
    for (size_t i = 0; i < n; i++) {
        if (w[i] > 0) {
            avail.push_back(i);
        }
    }
    // The m heaviest, in decreasing order: u = 1 can only go to them. The
    // heavy set is the first j of them, j the smallest with
    // w_(j) c_j < 1 where c_j = (m - j) / (w_(j) + w_(j+1) + ...); c_j
    // grows with j while the heavier ones stay >= 1 / c_j, so the set is
    // consistent (every u = 1 token has c w >= 1, no other has).
    auto heavier = [&](size_t a, size_t b) { return w[a] > w[b] || (w[a] == w[b] && a < b); };
    std::nth_element(avail.begin(), avail.begin() + (m - 1), avail.end(), heavier);
    std::sort(avail.begin(), avail.begin() + m, heavier);
    // the weight left after the first j, summed from the light end: a
    // difference total - heavy would cancel when a sink dominates
    std::vector<double> rest(m + 1, 0.0);
    for (size_t t = m; t < avail.size(); t++) {
        rest[m] += w[avail[t]];
    }
    for (size_t j = m; j-- > 0;) {
        rest[j] = rest[j + 1] + w[avail[j]];
    }
    for (size_t j = 0; j + 1 < m; j++) {
        double c = double(m - j) / rest[j];
        if (double(w[avail[j]]) * c < 1) {
            return c;
        }
    }
    // j = m - 1: w c = w / (w + rest[m]) < 1 since rest[m] > 0 (m is below
    // the tokens of positive weight), but it rounds to 1 when the tail
    // weighs below a double's epsilon of w (a score gap of ~37): the c is
    // right all the same, the m-th heaviest is sure to rounding
    return 1.0 / rest[m - 1];
}

/// The rule of sum u = min(m, tokens of positive weight), for weights in
/// any common scale (the softmax's or e^{s - max}).
InclusionRule inclusion_rule(const float* w, size_t n, size_t m) {
    InclusionRule rule;
    size_t n_avail = 0;
    const double total = inclusion_pass(w, n, 0.0, nullptr, &n_avail); // c = 0: all summed
    if (m == 0 || n_avail == 0) {
        return rule; // c = 0: nothing drawn
    }
    if (m >= n_avail) {
        rule.all = true;
        return rule;
    }
    // Fixed point, in passes over the weights (no sort): start from no
    // token sure, c = m / total; each pass makes sure the tokens with
    // c w >= 1 and sets c = (m - sure) / (weight of the others). c only
    // grows, so the sure set only grows; when a pass adds none, the set
    // and c agree (the one solution: sum_i min(1, c w_i) increases in c).
    // Attention has a few sinks above a long tail: 2-4 passes. A weight
    // profile that adds one token per pass goes to the sorted rule.
    constexpr int kMaxPasses = 12;
    double c = double(m) / total;
    size_t sure_before = 0;
    for (int pass = 0; pass < kMaxPasses; pass++) {
        // light summed directly: total - sure's would cancel under a sink
        size_t sure = 0;
        const double light = inclusion_pass(w, n, c, &sure, nullptr);
        if (sure == sure_before) {
            rule.c = c;
            return rule;
        }
        if (sure >= m || !(light > 0)) {
            break;
        }
        sure_before = sure;
        c = double(m - sure) / light;
    }
    rule.c = inclusion_constant_sorted(w, n, m);
    return rule;
}

/** Systematic sampling over increasing ids with thresholds r, r + 1, ...:
 * token i is drawn when a threshold falls in [acc, acc + u_i) (u = 1:
 * always). Writes the draws' ids and u, and returns their number, or
 * cap + 1 when more than cap would be drawn. No call in the loop: acc and
 * the next threshold stay in registers (a loop pushing into vectors kept
 * them in memory, a store and a reload a token). */
size_t systematic_draw(
        const float* w,
        size_t n,
        const InclusionRule& rule,
        double r,
        size_t cap,
        idx_t* ids,
        float* inclusion) {
    double next = r, acc = 0;
    size_t count = 0;
    for (size_t i = 0; i < n; i++) {
        double u = rule(w[i]);
        float drawn_u;
        if (u >= 1) {
            drawn_u = 1.0f;
        } else if (u > 0) {
            acc += u;
            if (!(acc > next)) {
                continue;
            }
            next += 1;
            // a drawn token's u is > 0; floats below FLT_MIN would make
            // log u infinite for an event of probability < 1e-38
            drawn_u = std::max(float(u), FLT_MIN);
        } else {
            continue;
        }
        if (count == cap) {
            return cap + 1;
        }
        ids[count] = idx_t(i);
        inclusion[count++] = drawn_u;
    }
    return count;
}

} // namespace

size_t weighted_inclusion(const float* s, size_t n, size_t m, double* u) {
    FAISS_THROW_IF_NOT_MSG(n == 0 || (s && u), "weighted_inclusion: nullptr array");
    float mx = -std::numeric_limits<float>::infinity();
    for (size_t i = 0; i < n; i++) {
        FAISS_THROW_IF_NOT_FMT(
                !std::isnan(s[i]) && s[i] != std::numeric_limits<float>::infinity(),
                "weighted_inclusion: score %zd is %g",
                i,
                s[i]);
        mx = std::max(mx, s[i]);
    }
    std::vector<float> w(n);
    for (size_t i = 0; i < n; i++) {
        w[i] = float(std::exp(double(s[i]) - double(mx))); // -inf: 0
    }
    InclusionRule rule = inclusion_rule(w.data(), n, m);
    size_t heavy = 0;
    for (size_t i = 0; i < n; i++) {
        u[i] = rule(w[i]);
        heavy += u[i] >= 1;
    }
    return heavy;
}

IndexWeightedSample::IndexWeightedSample() = default;

IndexWeightedSample::IndexWeightedSample(int d, int d_value, KVType kv_type)
        : IndexSampleBase(d, d_value, kv_type) {}

std::unique_ptr<KVIndex> IndexWeightedSample::from_factory(FactoryChain& chain) {
    if (chain.peek() != "Weighted") {
        return nullptr;
    }
    chain.take();
    return std::make_unique<IndexWeightedSample>(chain.d, chain.d_value, chain.kv_type);
}

void IndexWeightedSample::select_outside_one(
        const float* q,
        const idx_t* excluded,
        size_t n_excluded,
        Selection& sel,
        const faiss::SearchParameters* params) const {
    const size_t n = size_t(ntotal);
    // w = softmax of the scores (vectorised exp; the rule is invariant to
    // the common scale); the excluded tokens get weight 0. A token whose
    // weight underflows float (below e^-87 of the heaviest) is never drawn.
    std::vector<float> w(n);
    inner_products_scaled(q, tokens().key_rows(), n, score_scale(), w.data());
    softmax_inplace(w.data(), nullptr, n);
    for (size_t j = 0; j < n_excluded; j++) {
        w[excluded[j]] = 0;
    }
    const size_t m = size_t(effective_k(params));
    const InclusionRule rule = inclusion_rule(w.data(), n, m);

    sel.clear();
    sel.n_scanned = n; // every key scored
    uint64_t state = draw_state(q, n);
    const double r = random_unit(state);
    // the draws are the u = 1 tokens and one per threshold below
    // sum u = min(m, ...): at most m + 2 with rounding, n when every token
    // is drawn; past the room given the draw is made again with room for n
    size_t cap = rule.all ? n : std::min(n, m + 2);
    for (;;) {
        sel.ids.resize(cap);
        sel.inclusion.resize(cap);
        size_t count = systematic_draw(w.data(), n, rule, r, cap, sel.ids.data(), sel.inclusion.data());
        if (count <= cap) {
            sel.ids.resize(count);
            sel.inclusion.resize(count);
            return;
        }
        cap = n;
    }
}

} // namespace kvindex
