#include <kvindex/IndexProxyEvict.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <unordered_map>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/impl/growth.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/kernels.h>

#include "checks.h"
#include "query_rows.h"
#include "random.h"

namespace kvindex {

const char* evict_policy_name(EvictPolicy p) {
    switch (p) {
        case EvictPolicy::h2o:
            return "H2O";
        case EvictPolicy::tova:
            return "TOVA";
        case EvictPolicy::streaming:
            return "StreamingLLM";
        case EvictPolicy::random:
            return "Random";
        default:
            return "NaCl";
    }
}

void proxy_scores(
        const float* keys,
        idx_t n,
        int d,
        const float* queries,
        int n_heads,
        idx_t n_q,
        const idx_t* q_pos,
        idx_t first_pos,
        bool causal,
        double* scores) {
    std::fill(scores, scores + n, 0.0);
    std::vector<float> s(n);
    float scale = float(1.0 / std::sqrt(double(d)));
    for (int h = 0; h < n_heads; h++) {
        for (idx_t i = 0; i < n_q; i++) {
            // causal: the query at position p sees keys at positions <= p
            idx_t m = causal ? std::min<idx_t>(n, q_pos[i] - first_pos + 1) : n;
            if (m <= 0) {
                continue;
            }
            const float* q = queries + (size_t(h) * n_q + i) * d;
            inner_products_scaled(q, keys, d, m, scale, s.data());
            softmax_inplace(s.data(), nullptr, m);
            for (idx_t j = 0; j < m; j++) {
                scores[j] += s[j];
            }
        }
    }
}

namespace {

/// The policies that keep tokens by attention scores.
bool scores_tokens(EvictPolicy p) {
    return p == EvictPolicy::nacl || p == EvictPolicy::h2o || p == EvictPolicy::tova;
}

/// Table 4 of the NaCl paper: (protect, proxy-keep, random-keep, proxy
/// window) in percent of the length, for a budget of `keep` percent.
void table4(double keep, double* protect, double* proxy_keep, double* window) {
    if (keep == 10) {
        *protect = 1, *proxy_keep = 2, *window = 3;
    } else if (keep == 30) {
        *protect = 1.5, *proxy_keep = 10.5, *window = 20;
    } else { // the 20% row, scaled
        double r = keep / 20;
        *protect = 2 * r, *proxy_keep = 6 * r, *window = 18 * r;
    }
}

} // namespace

IndexProxyEvict::IndexProxyEvict() : KVIndex(0, 0) {}

namespace {

const std::pair<const char*, EvictPolicy> kPolicyNames[] = {
        {"H2O", EvictPolicy::h2o},
        {"TOVA", EvictPolicy::tova},
        {"StreamingLLM", EvictPolicy::streaming},
        {"Random", EvictPolicy::random}};

/// Smallest keep percent: below it every prompt keeps its one token anyway,
/// and the percent prints as a plain decimal of a few digits.
constexpr double kMinKeepPercent = 1e-6;

/// Whether s is a plain decimal: digits, optionally '.' and more digits.
bool is_plain_decimal(const std::string& s) {
    size_t dot = s.find('.');
    std::string whole = s.substr(0, dot);
    std::string frac = dot == std::string::npos ? "1" : s.substr(dot + 1);
    auto digits = [](const std::string& t) {
        return !t.empty() && t.find_first_not_of("0123456789") == std::string::npos;
    };
    return digits(whole) && digits(frac);
}

/// "ProxyEvict<P>[_Policy]": stores the policy and percent, returns true.
bool parse_proxy_evict(const std::string& s, EvictPolicy* policy, double* percent) {
    const std::string head = "ProxyEvict";
    if (s.compare(0, head.size(), head) != 0) {
        return false;
    }
    size_t us = s.find('_');
    std::string num = s.substr(
            head.size(), us == std::string::npos ? std::string::npos : us - head.size());
    if (num.size() > 32 || !is_plain_decimal(num)) {
        return false;
    }
    *percent = std::strtod(num.c_str(), nullptr);
    if (us == std::string::npos) {
        *policy = EvictPolicy::nacl;
        return true;
    }
    const std::string name = s.substr(us + 1);
    for (auto& [n, p] : kPolicyNames) {
        if (name == n) {
            *policy = p;
            return true;
        }
    }
    return false;
}

/// The shortest plain decimal that reads back as `percent` exactly (the
/// factory string must rebuild the same budget; "%g" would round it or
/// print an exponent the parser refuses).
std::string percent_text(double percent) {
    char buf[64];
    for (int decimals = 0; decimals <= 30; decimals++) {
        std::snprintf(buf, sizeof(buf), "%.*f", decimals, percent);
        if (std::strtod(buf, nullptr) == percent) {
            break;
        }
    }
    return buf;
}

} // namespace

std::unique_ptr<KVIndex> IndexProxyEvict::from_factory(FactoryChain& chain) {
    EvictPolicy policy;
    double percent;
    if (!parse_proxy_evict(chain.peek(), &policy, &percent)) {
        return nullptr;
    }
    std::string element = chain.take();
    // the kept tokens go to the rest of the chain, exact attention if none
    std::unique_ptr<KVIndex> kept = chain.at_end()
            ? index_factory(chain.d, std::string(kv_type_prefix(chain.kv_type)) + "Flat",
                            chain.d_value)
            : chain.build_rest(element);
    return std::make_unique<IndexProxyEvict>(policy, percent, std::move(kept));
}

std::string IndexProxyEvict::factory_string() const {
    std::string s = "ProxyEvict" + percent_text(keep_percent);
    if (policy != EvictPolicy::nacl) {
        s += std::string("_") + evict_policy_name(policy);
    }
    std::string rest = inner->factory_string();
    return rest == "Flat" ? s : s + "," + rest;
}

IndexProxyEvict::IndexProxyEvict(
        EvictPolicy policy, double keep_percent, std::unique_ptr<KVIndex> inner_index)
        : KVIndex(inner_index ? inner_index->d : 0,
                  inner_index ? inner_index->d_value : 0,
                  inner_index ? inner_index->kv_type : KVType::f32),
          policy(policy),
          keep_percent(keep_percent),
          inner(std::move(inner_index)) {
    FAISS_THROW_IF_NOT_MSG(inner, "IndexProxyEvict: inner index missing (nullptr)");
    FAISS_THROW_IF_NOT_FMT(
            keep_percent >= kMinKeepPercent && keep_percent <= 100,
            "IndexProxyEvict: keep percent %g not in [1e-6, 100]",
            keep_percent);
    FAISS_THROW_IF_NOT_MSG(inner->ntotal == 0, "IndexProxyEvict: inner index must be empty");
    // the kept tokens reach the inner index as consecutive rows, so a type
    // that reads a key's position from its row would undo RoPE at the wrong
    // positions and route silently worse
    const KVIndex* reader = find_position_reader(inner.get());
    FAISS_THROW_IF_NOT_FMT(
            !reader,
            "IndexProxyEvict: %s cannot follow eviction: it takes a key's position "
            "from its row, and the kept tokens are not contiguous",
            reader ? reader->factory_string().c_str() : "");
}

void IndexProxyEvict::check_scoring_knobs(const char* where) const {
    FAISS_THROW_IF_NOT_FMT(
            proxy_tokens >= 0 && (proxy_tokens == 0 || policy == EvictPolicy::nacl),
            "%s: proxy_tokens=%lld must be >= 0, and 0 unless the policy is NaCl "
            "(ProxyEvict%g is %s)",
            where, (long long)proxy_tokens, keep_percent, evict_policy_name(policy));
    FAISS_THROW_IF_NOT_FMT(
            pool == 0 || (pool > 0 && pool % 2 == 1 && scores_tokens(policy)),
            "%s: pool=%lld must be 0, or odd for a policy that scores: NaCl, H2O, TOVA "
            "(ProxyEvict%g is %s)",
            where, (long long)pool, keep_percent, evict_policy_name(policy));
    FAISS_THROW_IF_NOT_FMT(
            !layer_vote || scores_tokens(policy),
            "%s: layer_vote=1 needs a policy that scores: NaCl, H2O, TOVA (ProxyEvict%g is %s)",
            where, keep_percent, evict_policy_name(policy));
    FAISS_THROW_IF_NOT_FMT(
            !head_budget || scores_tokens(policy),
            "%s: head_budget=1 needs a policy that scores: NaCl, H2O, TOVA (ProxyEvict%g is %s)",
            where, keep_percent, evict_policy_name(policy));
    FAISS_THROW_IF_NOT_FMT(
            !(head_budget && layer_vote),
            "%s: head_budget=1 with layer_vote=1: the layer's vote gives every head the same scores, "
            "there is nothing to share by; set one of them",
            where);
    FAISS_THROW_IF_NOT_FMT(
            head_floor_percent >= 0 && head_floor_percent <= 100,
            "%s: head_floor=%g must be a percent in [0, 100]", where, head_floor_percent);
}

EvictBudget IndexProxyEvict::budget_for(idx_t n) const {
    EvictBudget b;
    if (n <= 0) {
        return b;
    }
    b.n_keep = budget_tokens > 0 ? std::min(budget_tokens, n)
                                 : std::min(n, idx_t(std::llround(keep_percent / 100 * n)));
    b.n_keep = std::max<idx_t>(b.n_keep, 1); // never evict the whole prompt
    // the fields are public: refuse what set_parameter would have refused
    check_scoring_knobs("ProxyEvict");
    idx_t B = b.n_keep;
    switch (policy) {
        case EvictPolicy::nacl: {
            double protect, proxy_keep, window;
            table4(keep_percent, &protect, &proxy_keep, &window);
            protect = protect_percent >= 0 ? protect_percent : protect;
            proxy_keep = proxy_keep_percent >= 0 ? proxy_keep_percent : proxy_keep;
            window = proxy_window_percent >= 0 ? proxy_window_percent : window;
            FAISS_THROW_IF_NOT_FMT(
                    protect + proxy_keep <= keep_percent + 1e-9,
                    "ProxyEvict: protect %g%% + proxy-keep %g%% exceed the budget %g%%",
                    protect, proxy_keep, keep_percent);
            // the split is a share of B, so an absolute budget keeps its shape
            idx_t n_protect = std::min(B, idx_t(std::llround(B * protect / keep_percent)));
            b.n_top = std::min(B - n_protect, idx_t(std::llround(B * proxy_keep / keep_percent)));
            b.n_random = B - n_protect - b.n_top;
            b.n_sink = std::min(n_sink, n_protect);
            b.n_recent = n_protect - b.n_sink;
            if (proxy_tokens > 0) { // the question: a count of tokens
                b.n_proxy = std::min(proxy_tokens, n);
            } else { // the paper's window: a share of the prompt, protected included
                double proxy = std::llround(n * (protect + window) / 100);
                b.n_proxy = std::min<idx_t>(n, std::max<idx_t>(1, idx_t(proxy)));
            }
            break;
        }
        case EvictPolicy::h2o:
            b.n_recent = B / 2; // H2O: half recent window, half heavy hitters
            b.n_top = B - b.n_recent;
            b.n_proxy = 0;      // every prompt query
            break;
        case EvictPolicy::tova:
            b.n_top = B;
            b.n_proxy = 1;      // the last query
            break;
        case EvictPolicy::streaming:
            b.n_sink = std::min(n_sink, B);
            b.n_recent = B - b.n_sink;
            break;
        case EvictPolicy::random:
            b.n_random = B;
            break;
    }
    return b;
}

namespace {

/// out[j] = max of x over [j - r, j + r] (clamped to the array)
std::vector<double> max_pooled(const std::vector<double>& x, idx_t r) {
    const idx_t n = idx_t(x.size());
    std::vector<double> out(n);
    for (idx_t j = 0; j < n; j++) {
        const idx_t lo = std::max<idx_t>(0, j - r), hi = std::min<idx_t>(n, j + r + 1);
        out[j] = *std::max_element(x.begin() + lo, x.begin() + hi);
    }
    return out;
}

/** The scores of each KV head of the layer: `scorer` run for each KV head
 * g of `layer` on its keys over the same positions as `in`'s and its query
 * heads' queries at the positions `pos` (which must be among the layer's
 * queries); out has size n_kv_heads * in.n_tokens, head g's at g * n.
 * Computed once per layer and prefill where the layer shares results
 * (LayerPrompt::shared: every head of a KVCache layer scores alike), else
 * by each head. `what` names the knob in messages. */
std::vector<double> head_scores(
        const ProxyScorer& scorer,
        const PrefillInput& in,
        int d,
        const std::vector<idx_t>& pos,
        bool causal,
        const char* what) {
    const LayerPrompt& L = *in.layer;
    const idx_t n = in.n_tokens;
    auto score = [&] {
        KVINDEX_CHECK_ARG(
                L.keys && in.first_position >= L.first_position &&
                        in.first_position + n <= L.first_position + L.n_tokens,
                "ProxyEvict %s: positions [%zd, %zd) are not in the layer's prompt [%zd, %zd)",
                what, size_t(in.first_position), size_t(in.first_position + n), size_t(L.first_position),
                size_t(L.first_position + L.n_tokens));
        // the layer's query of each scoring position
        std::unordered_map<idx_t, idx_t> row;
        for (idx_t i = 0; i < L.n_queries; i++) {
            row.emplace(L.query_position(i), i);
        }
        std::vector<idx_t> rows;
        for (idx_t p : pos) {
            auto it = row.find(p);
            KVINDEX_CHECK_ARG(
                    it != row.end(), "ProxyEvict %s: the layer has no query at position %zd", what, size_t(p));
            rows.push_back(it->second);
        }
        const int g = L.n_query_heads;
        const idx_t m = idx_t(rows.size());
        std::vector<double> out(size_t(L.n_kv_heads) * n);
        for (int kv = 0; kv < L.n_kv_heads; kv++) {
            std::vector<float> q =
                    gather_query_rows(L.queries + size_t(kv) * g * L.n_queries * d, g, L.n_queries, rows, d);
            const float* keys = L.keys + (size_t(kv) * L.n_tokens + (in.first_position - L.first_position)) * d;
            scorer(keys, n, d, q.data(), g, m, pos.data(), in.first_position, causal, out.data() + size_t(kv) * n);
        }
        return out;
    };
    if (!L.shared) {
        return score();
    }
    std::string key = "ProxyEvict head scores " + std::to_string(in.first_position) + " " + std::to_string(n) +
            (causal ? " causal" : " all");
    for (idx_t p : pos) {
        key += " " + std::to_string(p);
    }
    std::lock_guard<std::mutex> lock(L.shared->mutex);
    auto it = L.shared->entries.find(key);
    if (it == L.shared->entries.end()) {
        it = L.shared->entries.emplace(std::move(key), score()).first;
    }
    return it->second;
}

/** The layer's vote (layer_vote): the scores of every query head of the
 * layer, head_scores summed over the KV heads in order (every head sums
 * alike). */
void layer_scores(
        const ProxyScorer& scorer,
        const PrefillInput& in,
        int d,
        const std::vector<idx_t>& pos,
        bool causal,
        double* F) {
    const idx_t n = in.n_tokens;
    std::vector<double> S = head_scores(scorer, in, d, pos, causal, "layer_vote");
    std::fill(F, F + n, 0.0);
    for (int kv = 0; kv < in.layer->n_kv_heads; kv++) {
        for (idx_t j = 0; j < n; j++) {
            F[j] += S[size_t(kv) * n + j];
        }
    }
}

/** AdaKV's allocation (head_budget): how many of the candidates `cand`
 * (the same positions in every head) each of the H heads keeps by score,
 * given every head's scores S (size H * n). Each head first takes its own
 * top `n_floor`; the layer's other H * (n_top - n_floor) picks go to the
 * highest remaining scores of any head (ties: the lower head, then the
 * earlier token), at most `cap` in one head. Within a head the picks are
 * its top by (score, earlier token), the order choose_kept keeps. */
std::vector<idx_t> head_budgets(
        const std::vector<double>& S,
        int H,
        idx_t n,
        const std::vector<idx_t>& cand,
        idx_t n_top,
        idx_t n_floor,
        idx_t cap) {
    std::vector<std::vector<idx_t>> order(H, cand);
    for (int h = 0; h < H; h++) {
        const double* F = S.data() + size_t(h) * n;
        std::sort(order[h].begin(), order[h].end(),
                  [&](idx_t x, idx_t y) { return F[x] > F[y] || (F[x] == F[y] && x < y); });
    }
    std::vector<idx_t> count(H, n_floor);
    // a merge of the heads' orders: the next best of every head that has room
    auto next = [&](int h) { return S[size_t(h) * n + order[h][count[h]]]; };
    for (idx_t left = idx_t(H) * (n_top - n_floor); left > 0; left--) {
        int best = -1;
        for (int h = 0; h < H; h++) {
            if (count[h] < cap && (best < 0 || next(h) > next(best))) {
                best = h;
            }
        }
        count[best]++; // room remains: H * cap >= H * n_top
    }
    return count;
}

} // namespace

std::vector<idx_t> IndexProxyEvict::choose_kept(const PrefillInput& in) const {
    return choose_kept(in, proxy_scores);
}

std::vector<idx_t> IndexProxyEvict::choose_kept(
        const PrefillInput& in, const ProxyScorer& scorer) const {
    FAISS_THROW_IF_NOT_MSG(scorer, "ProxyEvict::choose_kept: scorer is empty");
    idx_t n = in.n_tokens;
    EvictBudget b = budget_for(n);
    std::vector<char> taken(n, 0);
    std::vector<idx_t> kept;
    auto keep = [&](idx_t j) {
        taken[j] = 1;
        kept.push_back(j);
    };
    for (idx_t j = 0; j < b.n_sink; j++) {
        keep(j);
    }
    for (idx_t j = n - b.n_recent; j < n; j++) {
        keep(j);
    }

    // the tokens left to choose from: the same positions in every head
    std::vector<idx_t> cand;
    for (idx_t j = 0; j < n; j++) {
        if (!taken[j]) {
            cand.push_back(j);
        }
    }
    // scores from the proxy queries, for the policies that use them
    std::vector<double> F(n, 0.0);
    idx_t n_top = b.n_top; // this head's share of the layer's under head_budget
    if (scores_tokens(policy) && b.n_top + b.n_random > 0) {
        // The caller's prompt ends n_after tokens after this index's last
        // one (a wrapper's window, when this index holds the middle): the
        // question (NaCl's proxy_tokens), TOVA's last query and H2O's
        // queries are those of the whole prompt. NaCl's percent window is a
        // share of this index's own tokens and ends with them.
        const bool percent_window = policy == EvictPolicy::nacl && proxy_tokens == 0;
        idx_t end = in.first_position + n + (percent_window ? 0 : in.n_after);
        idx_t from = b.n_proxy > 0 ? end - b.n_proxy : in.first_position;
        if (policy == EvictPolicy::nacl && proxy_tokens > 0) {
            from = end - std::min(proxy_tokens, end);
        }
        std::vector<idx_t> pick, pos;
        for (idx_t i = 0; i < in.n_queries; i++) {
            idx_t p = in.query_position(i);
            if (p >= from && p < end) {
                pick.push_back(i);
                pos.push_back(p);
            }
        }
        KVINDEX_CHECK_ARG(
                !pick.empty(),
                "%s: prefill has no queries at positions [%zd, %zd) to "
                "score the prompt with",
                factory_string().c_str(), size_t(from), size_t(end));
        KVINDEX_CHECK_ARG(
                !(layer_vote || head_budget) || in.layer,
                "%s: %s scores with every head of the layer: prefill it through a "
                "KVCache, which hands each head the layer's prompt",
                factory_string().c_str(), layer_vote ? "layer_vote=1" : "head_budget=1");
        const bool causal = policy == EvictPolicy::h2o;
        if (layer_vote) {
            layer_scores(scorer, in, d, pos, causal, F.data());
        } else if (head_budget) {
            const int H = in.layer->n_kv_heads, h = in.layer_kv_head;
            KVINDEX_CHECK_ARG(
                    h >= 0 && h < H, "%s: head_budget=1: this head's place in the layer (%d) is not one of its %d",
                    factory_string().c_str(), h, H);
            std::vector<double> S = head_scores(scorer, in, d, pos, causal, "head_budget");
            if (pool > 1) {
                for (int g = 0; g < H; g++) {
                    std::vector<double> f(S.begin() + size_t(g) * n, S.begin() + size_t(g + 1) * n);
                    f = max_pooled(f, pool / 2);
                    std::copy(f.begin(), f.end(), S.begin() + size_t(g) * n);
                }
            }
            // a head keeps at most what leaves room for its random part
            const idx_t cap = idx_t(cand.size()) - b.n_random;
            const idx_t n_floor = std::min(b.n_top, idx_t(std::floor(b.n_top * head_floor_percent / 100)));
            n_top = head_budgets(S, H, n, cand, b.n_top, n_floor, cap)[h];
            std::copy(S.begin() + size_t(h) * n, S.begin() + size_t(h + 1) * n, F.begin());
        } else {
            std::vector<float> q = gather_query_rows(in.queries, in.n_query_heads, in.n_queries, pick, d);
            scorer(in.keys, n, d, q.data(), in.n_query_heads, idx_t(pick.size()), pos.data(),
                   in.first_position, causal, F.data());
        }
        if (pool > 1 && !head_budget) {
            F = max_pooled(F, pool / 2);
        }
    }

    // top by score (ties to the earlier token)
    std::partial_sort(cand.begin(), cand.begin() + n_top, cand.end(), [&](idx_t x, idx_t y) {
        return F[x] > F[y] || (F[x] == F[y] && x < y);
    });
    for (idx_t i = 0; i < n_top; i++) {
        keep(cand[i]);
    }
    // random part: n_random of the rest without replacement, with
    // probabilities softmax(F) (uniform for Random, where F = 0). Gumbel-top-k:
    // the largest F_j + G_j are a sample without replacement from softmax(F).
    std::vector<idx_t> rest(cand.begin() + n_top, cand.end());
    std::mt19937_64 rng(stream_seed(seed, stream));
    std::uniform_real_distribution<double> unif(0.0, 1.0);
    std::vector<double> key(n);
    for (idx_t j : rest) {
        double u = std::max(unif(rng), 1e-300);
        key[j] = F[j] - std::log(-std::log(u));
    }
    std::partial_sort(rest.begin(), rest.begin() + b.n_random, rest.end(),
                      [&](idx_t x, idx_t y) { return key[x] > key[y]; });
    for (idx_t i = 0; i < b.n_random; i++) {
        keep(rest[i]);
    }
    std::sort(kept.begin(), kept.end());
    // the split sums to the budget by construction (budget_for); a head's
    // share of the layer's scored part moves it (head_budget)
    FAISS_THROW_IF_NOT_FMT(
            idx_t(kept.size()) == b.n_keep - b.n_top + n_top,
            "ProxyEvict: kept %zd tokens for a budget of %zd (internal error)",
            kept.size(),
            size_t(b.n_keep - b.n_top + n_top));
    return kept;
}

void IndexProxyEvict::prefill_impl(const PrefillInput& in) {
    check_prefill(in);
    std::vector<idx_t> kept = choose_kept(in);
    // only the kept tokens are ever stored
    std::vector<float> k(kept.size() * d), v(kept.size() * d_value);
    for (size_t i = 0; i < kept.size(); i++) {
        std::memcpy(&k[i * d], in.keys + kept[i] * d, sizeof(float) * d);
        std::memcpy(&v[i * d_value], in.values + kept[i] * d_value, sizeof(float) * d_value);
    }
    PrefillInput sub = in;
    sub.n_tokens = idx_t(kept.size());
    sub.keys = k.data();
    sub.values = v.data();
    std::vector<idx_t> qpos = in.implicit_query_positions(); // made explicit
    if (!qpos.empty()) {
        sub.query_positions = qpos.data();
    }
    inner->prefill(sub);
    positions = std::move(kept);
    ntotal = in.n_tokens;
    rope = in.rope;
    has_rope = true;
}

void IndexProxyEvict::add_kv_impl(idx_t n, const float* keys, const float* values) {
    reserve_for_growth(positions, positions.size() + size_t(n)); // before: push_back cannot throw
    add_kv_to(*inner, n, keys, values); // generated tokens are never evicted
    for (idx_t i = 0; i < n; i++) {
        positions.push_back(ntotal + i);
    }
}

void IndexProxyEvict::undo_add_kv_impl(idx_t n) {
    inner->undo_add_kv();
    positions.resize(positions.size() - size_t(n));
}

idx_t IndexProxyEvict::inner_id(idx_t position) const {
    auto it = std::lower_bound(positions.begin(), positions.end(), position);
    return it != positions.end() && *it == position ? idx_t(it - positions.begin()) : -1;
}

void IndexProxyEvict::search_batch(
        idx_t n,
        const float* q,
        idx_t k,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters* params) const {
    inner->search(n, q, k, distances, labels, params); // pads with -1 if it is empty
    for (idx_t i = 0; i < n * k; i++) {
        labels[i] = labels[i] >= 0 ? positions[labels[i]] : -1;
    }
}

void IndexProxyEvict::select_batch(
        idx_t n,
        const float* q,
        Selection* sel,
        const faiss::SearchParameters* params) const {
    inner->select(n, q, sel, params);
    for (idx_t i = 0; i < n; i++) {
        for (auto& id : sel[i].ids) {
            id = positions[id];
        }
    }
}

void IndexProxyEvict::attend_batch(
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    inner->attend(n, q, out, lse, params);
}

void IndexProxyEvict::reset_impl() {
    inner->reset();
    positions.clear();
    ntotal = 0;
}

bool IndexProxyEvict::writes_roll_back() const {
    return inner && inner->writes_roll_back();
}

void IndexProxyEvict::reconstruct_impl(idx_t key, float* recons) const {
    idx_t i = inner_id(key);
    FAISS_THROW_IF_NOT_FMT(i >= 0, "reconstruct: token %zd was evicted", size_t(key));
    inner->reconstruct(i, recons);
}

void IndexProxyEvict::reconstruct_value_impl(idx_t key, float* value) const {
    idx_t i = inner_id(key);
    FAISS_THROW_IF_NOT_FMT(i >= 0, "reconstruct_value: token %zd was evicted", size_t(key));
    inner->reconstruct_value(i, value);
}

size_t IndexProxyEvict::memory_bytes() const {
    return inner->memory_bytes() + positions.capacity() * sizeof(idx_t);
}

std::vector<ParameterInfo> IndexProxyEvict::parameter_info() const {
    std::vector<ParameterInfo> info = KVIndex::parameter_info();
    using P = ParameterInfo;
    info.push_back(P::integer("budget", 0, P::kNoBound, "tokens kept at prefill (overrides the percent of the string); 0 = the percent (default)").prefill().tokens());
    info.push_back(P::real("protect", 0, 100, "NaCl: sinks + recent tokens kept, percent of the prompt; -1 = Table 4 (default)").prefill().also(-1));
    info.push_back(P::real("proxy_keep", 0, 100, "NaCl: tokens kept by proxy score, percent of the prompt; -1 = Table 4 (default)").prefill().also(-1));
    info.push_back(P::real("proxy_window", 0, 100, "NaCl: proxy queries beyond the protected ones, percent of the prompt; -1 = Table 4 (default)").prefill().also(-1));
    info.push_back(P::integer("proxy_tokens", 0, policy == EvictPolicy::nacl ? P::kNoBound : 0,
                              "NaCl: proxy queries = the last N prompt positions (the question), in tokens, clamped "
                              "to the prompt; 0 = the proxy_window percent (default); other policies: 0 only")
                           .prefill()
                           .tokens());
    const std::string pool_doc =
            "NaCl, H2O, TOVA: scores max-pooled over this many tokens centred on each before keeping "
            "(SnapKV); 0 = off (default)";
    info.push_back((scores_tokens(policy) ? P::integer("pool", 1, P::kNoBound - 1, pool_doc).odd().also(0)
                                          : P::integer("pool", 0, 0, pool_doc))
                           .prefill());
    const std::string vote_doc =
            "NaCl, H2O, TOVA: 1 scores with every query head of the layer (through a KVCache), so its KV heads "
            "keep the same positions; 0 = this KV head's query heads (default)";
    info.push_back((scores_tokens(policy) ? P::flag("layer_vote", vote_doc) : P::integer("layer_vote", 0, 0, vote_doc))
                           .prefill());
    const std::string head_doc =
            "NaCl, H2O, TOVA: 1 shares the layer's tokens kept by score among its KV heads by score (AdaKV; "
            "through a KVCache; not with layer_vote); 0 = the same count per head (default)";
    info.push_back((scores_tokens(policy) ? P::flag("head_budget", head_doc) : P::integer("head_budget", 0, 0, head_doc))
                           .prefill());
    info.push_back(P::real("head_floor", 0, 100, "head_budget: percent of its by-score tokens a head keeps by its own scores first (AdaKV's safeguard)").prefill());
    info.push_back(P::integer("n_sink", 0, P::kNoBound, "first tokens among the protected ones (NaCl, StreamingLLM)").prefill());
    info.push_back(P::integer("seed", 0, P::kNoBound, "seed of the random part (with the per-head stream)").prefill());
    info.erase(std::remove_if(info.begin(), info.end(),
                              [&](const ParameterInfo& p) { return !policy_reads(p.name); }),
               info.end());
    return info;
}

bool IndexProxyEvict::policy_reads(const std::string& name) const {
    // a knob of another policy is not one of this index's: it would be
    // taken without effect ("ProxyEvict50_Random|protect=1" ran as before),
    // and a chain hands each name to every index that has it (a seed meant
    // for a sibling sampler stays the sibling's)
    if (name == "protect" || name == "proxy_keep" || name == "proxy_window") {
        return policy == EvictPolicy::nacl;
    }
    if (name == "n_sink") {
        return policy == EvictPolicy::nacl || policy == EvictPolicy::streaming;
    }
    if (name == "seed") {
        return policy == EvictPolicy::nacl || policy == EvictPolicy::random;
    }
    if (name == "head_floor") {
        return scores_tokens(policy);
    }
    return true;
}

bool IndexProxyEvict::set_parameter(const std::string& name, double value) {
    if (!policy_reads(name)) {
        return false;
    }
    if (name == "proxy_tokens") {
        FAISS_THROW_IF_NOT_FMT(
                is_count(value),
                "parameter proxy_tokens=%g must be a non-negative integer (tokens)",
                value);
        // only NaCl scores with a proxy window; running the plain baseline
        // under a question-aware setting would mislabel its results
        FAISS_THROW_IF_NOT_FMT(
                value == 0 || policy == EvictPolicy::nacl,
                "parameter proxy_tokens=%g: only NaCl has a proxy window (%s %s); "
                "use ProxyEvict%g or proxy_tokens=0",
                value,
                evict_policy_name(policy),
                policy == EvictPolicy::h2o    ? "scores with every prompt query"
                        : policy == EvictPolicy::tova ? "scores with the last prompt query"
                                                      : "keeps tokens without scores",
                keep_percent);
        proxy_tokens = idx_t(value);
        return true;
    }
    if (name == "pool") {
        FAISS_THROW_IF_NOT_FMT(
                value == 0 || (is_positive_integer(value) && std::fmod(value, 2) == 1),
                "parameter pool=%g must be 0 or an odd number of tokens",
                value);
        FAISS_THROW_IF_NOT_FMT(
                value == 0 || scores_tokens(policy),
                "parameter pool=%g: %s keeps tokens without scores, there is nothing to pool",
                value,
                evict_policy_name(policy));
        pool = idx_t(value);
        return true;
    }
    if (name == "layer_vote") {
        const bool vote = flag_parameter(name, value);
        FAISS_THROW_IF_NOT_FMT(
                !vote || scores_tokens(policy),
                "parameter layer_vote=1: %s keeps tokens without scores, there is nothing to vote on",
                evict_policy_name(policy));
        FAISS_THROW_IF_NOT_MSG(
                !vote || !head_budget,
                "parameter layer_vote=1: head_budget=1 is set, and the layer's vote would give every head the "
                "same scores; set head_budget=0 first");
        layer_vote = vote;
        return true;
    }
    if (name == "head_budget") {
        const bool share = flag_parameter(name, value);
        FAISS_THROW_IF_NOT_FMT(
                !share || scores_tokens(policy),
                "parameter head_budget=1: %s keeps tokens without scores, there is nothing to share by",
                evict_policy_name(policy));
        FAISS_THROW_IF_NOT_MSG(
                !share || !layer_vote,
                "parameter head_budget=1: layer_vote=1 is set, and gives every head the same scores; set "
                "layer_vote=0 first");
        head_budget = share;
        return true;
    }
    if (name == "head_floor") {
        FAISS_THROW_IF_NOT_FMT(
                value >= 0 && value <= 100, "parameter head_floor=%g must be a percent in [0, 100]", value);
        head_floor_percent = value;
        return true;
    }
    if (name == "budget" || name == "n_sink" || name == "seed") {
        // budget=0 is the default, "off": back to the percent of the string
        FAISS_THROW_IF_NOT_FMT(
                is_positive_integer(value) || value == 0,
                "parameter %s=%g must be a non-negative integer",
                name.c_str(),
                value);
        if (name == "budget") {
            budget_tokens = idx_t(value);
        } else if (name == "n_sink") {
            n_sink = idx_t(value);
        } else {
            seed = uint64_t(value);
        }
        return true;
    }
    double* pct = name == "protect"      ? &protect_percent
            : name == "proxy_keep"   ? &proxy_keep_percent
            : name == "proxy_window" ? &proxy_window_percent
                                     : nullptr;
    if (!pct) {
        return KVIndex::set_parameter(name, value);
    }
    // -1 (the default, which get_parameter reports) restores Table 4's value
    FAISS_THROW_IF_NOT_FMT(
            value == -1 || (value >= 0 && value <= 100),
            "parameter %s=%g must be a percent in [0, 100], or -1 for Table 4's value",
            name.c_str(),
            value);
    *pct = value;
    return true;
}

bool IndexProxyEvict::get_parameter(const std::string& name, double* value) const {
    if (!policy_reads(name)) {
        return false;
    }
    const std::pair<const char*, double> knobs[] = {
            {"budget", double(budget_tokens)},
            {"protect", protect_percent},
            {"proxy_keep", proxy_keep_percent},
            {"proxy_window", proxy_window_percent},
            {"proxy_tokens", double(proxy_tokens)},
            {"pool", double(pool)},
            {"layer_vote", layer_vote ? 1.0 : 0.0},
            {"head_budget", head_budget ? 1.0 : 0.0},
            {"head_floor", head_floor_percent},
            {"n_sink", double(n_sink)},
            {"seed", double(seed)}};
    for (auto& [n, v] : knobs) {
        if (name == n) {
            *value = v;
            return true;
        }
    }
    return KVIndex::get_parameter(name, value);
}

void IndexProxyEvict::set_stream(uint64_t s) {
    stream = s;
    KVIndex::set_stream(s);
}

void IndexProxyEvict::write_fields(BufferWriter& w) const {
    w.value<uint8_t>(uint8_t(policy));
    w.value<double>(keep_percent);
    w.value<int64_t>(budget_tokens);
    w.value<double>(protect_percent);
    w.value<double>(proxy_keep_percent);
    w.value<double>(proxy_window_percent);
    w.value<int64_t>(proxy_tokens); // from record version 2
    w.value<int64_t>(pool);         // from record version 3
    w.value<uint8_t>(uint8_t(layer_vote)); // from record version 4
    w.value<uint8_t>(uint8_t(head_budget)); // from record version 5
    w.value<double>(head_floor_percent);    // from record version 5
    w.value<int64_t>(n_sink);
    w.value<uint64_t>(seed);
    w.value<uint64_t>(stream);
    w.vector(positions);
    write_index_record(inner.get(), w);
}

void IndexProxyEvict::read_fields(BufferReader& r, uint32_t version) {
    uint8_t p = r.value<uint8_t>("eviction policy");
    FAISS_THROW_IF_NOT_FMT(p <= 4, "read_index: invalid eviction policy %d", int(p));
    policy = EvictPolicy(p);
    keep_percent = r.value<double>("keep percent");
    budget_tokens = r.value<int64_t>("budget");
    protect_percent = r.value<double>("protect percent");
    proxy_keep_percent = r.value<double>("proxy-keep percent");
    proxy_window_percent = r.value<double>("proxy window percent");
    // version 1 had no token window: the percent window
    proxy_tokens = version >= 2 ? r.value<int64_t>("proxy tokens") : 0;
    pool = version >= 3 ? r.value<int64_t>("pool") : 0; // no pooling before v3
    if (version >= 4) { // each head voted alone before v4
        uint8_t vote = r.value<uint8_t>("layer vote");
        FAISS_THROW_IF_NOT_FMT(vote <= 1, "read_index: invalid layer vote %d", int(vote));
        layer_vote = vote == 1;
    } else {
        layer_vote = false;
    }
    if (version >= 5) { // every head kept the same count before v5
        uint8_t share = r.value<uint8_t>("head budget");
        FAISS_THROW_IF_NOT_FMT(share <= 1, "read_index: invalid head budget flag %d", int(share));
        head_budget = share == 1;
        head_floor_percent = r.value<double>("head floor percent");
    } else {
        head_budget = false;
        head_floor_percent = 20;
    }
    n_sink = r.value<int64_t>("n_sink");
    seed = r.value<uint64_t>("seed");
    stream = r.value<uint64_t>("stream");
    positions = r.vector<idx_t>("kept positions");
    inner = read_index_record(r);
}

void IndexProxyEvict::check_children_in_step() const {
    check_child_in_step(inner.get(), idx_t(positions.size()), "IndexProxyEvict", "inner");
}

void IndexProxyEvict::check_invariants() const {
    KVIndex::check_invariants();
    check_seed_knob(seed, "IndexProxyEvict");
    FAISS_THROW_IF_NOT_MSG(inner, "IndexProxyEvict: inner index missing");
    FAISS_THROW_IF_NOT_FMT(
            int(policy) >= 0 && int(policy) <= int(EvictPolicy::random),
            "IndexProxyEvict: invalid eviction policy %d",
            int(policy));
    check_scoring_knobs("IndexProxyEvict: record inconsistent");
    bool sorted = true;
    for (size_t i = 0; i < positions.size(); i++) {
        sorted = sorted && positions[i] >= 0 && positions[i] < ntotal &&
                (i == 0 || positions[i] > positions[i - 1]);
    }
    FAISS_THROW_IF_NOT_MSG(
            keep_percent >= kMinKeepPercent && keep_percent <= 100 && budget_tokens >= 0 &&
                    n_sink >= 0 &&
                    sorted && idx_t(positions.size()) == inner->ntotal,
            "IndexProxyEvict: record inconsistent (budget, kept positions)");
}

} // namespace kvindex
