#include <kvindex/IndexRoarGraph.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/IndexTopK.h>
#include <kvindex/attention.h>
#include <kvindex/impl/growth.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>
#include <kvindex/kernels.h>

#include "checks.h"
#include "random.h"
#include "parallel.h"

namespace kvindex {

namespace {

constexpr int kMaxM = 512;          // degree bound 2M fits the uint16 degrees
constexpr idx_t kLinkBatch = 1024;  // keys searched in parallel per link step
constexpr int64_t kMaxBeam = 1000000000; // efSearch's range
constexpr int kMaxRepairRounds = 16;
constexpr idx_t kCheckEvery = 1024; // appended tokens between reachability checks
constexpr idx_t kKeysPerHub = 256;  // default hubs: 1 per 256 prompt keys
constexpr idx_t kLearnScanBlock = 1024; // keys scored for every query of a task while in L2
constexpr idx_t kLearnScanQueries = 8;  // learnt queries sharing one scan of the keys
// a search scores at most one anchor per 128 keys (and at least
// seed_anchors) to pick its seeds, and by default (keys_per_seed_list)
// takes the lists of at most one anchor per 4096 keys: <= 0.8% and <= 2.4%
// (Nq = 100) of the keys read, so that small contexts, where the beam
// alone reads a large part, do not pay for seeds they need less
constexpr idx_t kKeysPerSeedAnchor = 128;
// larger pools go through the anchors' k-means groups: sqrt(n_anchors)
// groups, the members of the nearest kAnchorGroupsProbed scored
constexpr size_t kAnchorGroupsProbed = 4;
constexpr int kAnchorKmeansIterations = 10;

/// A key and its inner product with a query (or with a key: a pivot, a key
/// being linked); larger = closer. In a beam, `expanded` marks the keys
/// whose neighbours were scored.
struct Candidate {
    float score;
    int32_t id;
    bool expanded = false;
};

inline bool ranks_before(const Candidate& a, const Candidate& b) {
    return a.score > b.score || (a.score == b.score && a.id < b.id);
}

/** Per-thread scratch of the beam search. The visited marks are stamped
 * with an epoch that changes every search, so nothing is cleared between
 * searches (only when the 16-bit epoch wraps, every 65535 searches). */
struct BeamScratch {
    std::vector<uint16_t> visited;
    uint16_t epoch = 0;
    std::vector<Candidate> beam;
    std::vector<int64_t> ids;
    std::vector<float> scores;
    std::vector<float> row; ///< a key as floats
    std::vector<float> code_query; ///< the query's side of KeyCodes8 scores
    std::vector<int> trade_slots;     ///< add_edge: the row slots it may trade
    std::vector<int64_t> trade_ids;   ///< add_edge: their keys
    // the anchor choice of a search
    std::vector<int32_t> seeds;
    std::vector<int64_t> anchor_ids;
    std::vector<float> anchor_scores;
    std::vector<std::pair<float, int64_t>> nearest;
    size_t list_bytes = 0; ///< of the neighbour lists the last walk expanded

    void begin(idx_t n) {
        if (visited.size() < size_t(n)) {
            visited.resize(size_t(n), 0);
        }
        if (++epoch == 0) {
            std::fill(visited.begin(), visited.end(), 0);
            epoch = 1;
        }
    }
    bool visit(int32_t id) {
        if (visited[id] == epoch) {
            return false;
        }
        visited[id] = epoch;
        return true;
    }
};

BeamScratch& beam_scratch() {
    static thread_local BeamScratch s;
    return s;
}

/// Prefetches every cache line of rows ids[0, n) of `row_bytes` bytes from base.
inline void prefetch_rows_by_ids(const void* base, size_t row_bytes, const int64_t* ids, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const char* p = static_cast<const char*>(base) + size_t(ids[i]) * row_bytes;
        for (size_t off = 0; off < row_bytes; off += 64) {
            __builtin_prefetch(p + off);
        }
    }
}

inline void prefetch_key_rows(const KVRows& rows, const int64_t* ids, size_t n) {
    prefetch_rows_by_ids(rows.data, rows.row_bytes(), ids, n);
}

} // namespace

// ---- construction, factory ---------------------------------------------------

IndexRoarGraph::IndexRoarGraph() : KVIndex(0, 0) {}

IndexRoarGraph::IndexRoarGraph(int d, int d_value, int M, KVType kv_type)
        : KVIndex(d, d_value, kv_type), M(M), storage(d, this->d_value, kv_type) {
    FAISS_THROW_IF_NOT_FMT(
            M >= 2 && M <= kMaxM, "IndexRoarGraph: M=%d must be in [2, %d]", M, kMaxM);
    index_codes(); // walk_bits 8: the ranges of no keys, as after reset
}

std::unique_ptr<KVIndex> IndexRoarGraph::from_factory(FactoryChain& chain) {
    idx_t m;
    if (!parse_factory_count(chain.peek(), "RoarGraph", &m)) {
        return nullptr;
    }
    FAISS_THROW_IF_NOT_FMT(
            m >= 2 && m <= kMaxM,
            "index_factory: '%s': RoarGraph<M> needs M in [2, %d], in \"%s\"",
            chain.peek().c_str(),
            kMaxM,
            chain.description().c_str());
    chain.take();
    return std::make_unique<IndexRoarGraph>(chain.d, chain.d_value, int(m), chain.kv_type);
}

// ---- tokens --------------------------------------------------------------------

void IndexRoarGraph::append_tokens(idx_t n, const float* keys, const float* values) {
    storage.append(n, keys, values);
    if (walk_bits == 8) {
        walk_codes.append(storage);
    }
    size_t n1 = size_t(storage.size());
    grow_to(neighbors, n1 * max_degree(), int32_t(-1));
    grow_to(degrees, n1, uint16_t(0));
    grow_to(in_degrees, n1, uint32_t(0));
}

namespace {

/// The key nearest the mean of keys [0, n).
idx_t medoid(const KVStorage& storage, idx_t n) {
    size_t d = storage.d;
    std::vector<double> mean(d, 0);
    std::vector<float> k(d);
    for (idx_t i = 0; i < n; i++) {
        storage.key(i, k.data());
        for (size_t j = 0; j < d; j++) {
            mean[j] += k[j];
        }
    }
    idx_t best = 0;
    double best_d2 = std::numeric_limits<double>::infinity();
    for (idx_t i = 0; i < n; i++) {
        storage.key(i, k.data());
        double d2 = 0;
        for (size_t j = 0; j < d; j++) {
            double t = double(k[j]) - mean[j] / double(n);
            d2 += t * t;
        }
        if (d2 < best_d2) {
            best_d2 = d2;
            best = i;
        }
    }
    return best;
}

} // namespace

void IndexRoarGraph::drop_tokens_from(idx_t n0) {
    ntotal = n0;
    storage.truncate(n0);
    walk_codes.truncate(size_t(n0));
    neighbors.resize(size_t(n0) * max_degree());
    degrees.resize(n0);
    int R = max_degree();
    for (idx_t i = 0; i < n0; i++) { // edges to the dropped keys
        int32_t* row = neighbors.data() + size_t(i) * R;
        int kept = 0;
        for (int j = 0; j < degrees[i]; j++) {
            if (row[j] < n0) {
                row[kept++] = row[j];
            }
        }
        std::fill(row + kept, row + R, -1);
        degrees[i] = uint16_t(kept);
    }
    count_in_degrees();
    if (n0 == 0) {
        entry_point = -1;
    }
}

void IndexRoarGraph::count_in_degrees() {
    in_degrees.assign(size_t(ntotal), 0);
    for (idx_t i = 0; i < ntotal; i++) {
        for (int j = 0; j < degrees[i]; j++) {
            in_degrees[neighbors_of(i)[j]]++;
        }
    }
}

void IndexRoarGraph::add_kv_impl(idx_t n, const float* keys, const float* values) {
    idx_t n0 = ntotal;
    // the older keys' rows and anchor lists are journaled before they
    // change, so that a throw (or undo_add_kv) restores them exactly
    undo = Undo();
    undo.active = true;
    undo.n0 = n0;
    try {
        append_tokens(n, keys, values);
        ntotal = n0 + n; // the link searches read ntotal
        if (n0 == 0) {
            entry_point = medoid(storage, n);
        }
        std::vector<idx_t> ids(n);
        std::iota(ids.begin(), ids.end(), n0);
        bool lost = link_keys(ids, n0 == 0);
        // Edges are only traded away from keys with another in-edge, and
        // each new key gets one, so a traversal per decode step is not
        // needed; one runs after a large add, after a link that could
        // not give its key an in-edge, and every kCheckEvery tokens
        // (a key whose other in-edges come only through itself).
        if (lost || n > kLinkBatch || (n0 + n) / kCheckEvery != n0 / kCheckEvery) {
            repair_reachability();
        }
        update_anchor_lists(n0);
    } catch (...) {
        undo.active = false;
        restore_journal();
        drop_tokens_from(n0);
        undo = Undo();
        throw;
    }
    undo.active = false;
    if (!keeping_undo()) {
        undo = Undo(); // nothing to take back later
    }
    ntotal = n0; // add_kv adds n after this returns
}

void IndexRoarGraph::journal_row(idx_t c) {
    if (!undo.active || c >= undo.n0 || undo.rows_saved.count(c)) {
        return; // a new key's row goes with it
    }
    const int R = max_degree();
    // row_keys last but the set: what restore_journal reads is complete
    // for every key it lists, whichever allocation throws
    undo.rows.insert(undo.rows.end(), neighbors_of(c), neighbors_of(c) + R);
    undo.degrees.push_back(degrees[c]);
    undo.row_keys.push_back(c);
    undo.rows_saved.insert(c);
}

void IndexRoarGraph::journal_anchor(size_t a) {
    if (!undo.active || undo.anchors_saved.count(a)) {
        return;
    }
    const size_t width = anchor_list_width();
    undo.lists.insert(undo.lists.end(), anchor_lists.begin() + a * width, anchor_lists.begin() + (a + 1) * width);
    undo.scores.insert(undo.scores.end(), anchor_list_scores.begin() + a * width,
                       anchor_list_scores.begin() + (a + 1) * width);
    undo.thresholds.push_back(anchor_thresholds[a]);
    undo.pivots.push_back(anchor_pivots[a]);
    undo.anchors.push_back(a);
    undo.anchors_saved.insert(a);
}

void IndexRoarGraph::undo_add_kv_impl(idx_t n) {
    restore_journal();
    // the new keys, and the edges to them (none left in the rows restored),
    // and in_degrees counted again from the edges
    drop_tokens_from(ntotal - n);
    ntotal += n; // undo_add_kv subtracts n after this returns
}

void IndexRoarGraph::restore_journal() noexcept {
    const int R = max_degree();
    for (size_t i = 0; i < undo.row_keys.size(); i++) {
        const idx_t c = undo.row_keys[i];
        std::copy_n(undo.rows.begin() + i * R, R, neighbors.begin() + size_t(c) * R);
        degrees[c] = undo.degrees[i];
    }
    const size_t width = anchor_list_width();
    for (size_t i = 0; i < undo.anchors.size(); i++) {
        const size_t a = undo.anchors[i];
        std::copy_n(undo.lists.begin() + i * width, width, anchor_lists.begin() + a * width);
        std::copy_n(undo.scores.begin() + i * width, width, anchor_list_scores.begin() + a * width);
        anchor_thresholds[a] = undo.thresholds[i];
        anchor_pivots[a] = undo.pivots[i];
    }
}

void IndexRoarGraph::forget_undo_impl() noexcept {
    undo = Undo();
}

// ---- the beam search -------------------------------------------------------

namespace {

/** Best-first beam of width L over the graph from the entry point. score(ids,
 * m, out) scores m keys. Leaves the beam in s.beam, best first, and the
 * bytes of the neighbour lists it read in s.list_bytes; returns the keys
 * scored. */
template <class Score>
size_t walk(
        const IndexRoarGraph& g,
        size_t L,
        const std::vector<int32_t>& hubs,
        const std::vector<int32_t>& seeds,
        BeamScratch& s,
        Score&& score,
        size_t max_expansions = std::numeric_limits<size_t>::max()) {
    // the entry point, the hubs and the seeds (search only), each scored
    // once, start the beam
    s.begin(g.ntotal);
    s.beam.clear();
    s.ids.clear();
    s.list_bytes = 0;
    s.visit(int32_t(g.entry_point));
    s.ids.push_back(g.entry_point);
    for (const std::vector<int32_t>* extra : {&hubs, &seeds}) {
        for (int32_t h : *extra) {
            if (s.visit(h)) {
                s.ids.push_back(h);
            }
        }
    }
    s.scores.resize(s.ids.size());
    score(s.ids.data(), s.ids.size(), s.scores.data());
    size_t scanned = s.ids.size();
    for (size_t j = 0; j < s.ids.size(); j++) {
        s.beam.push_back({s.scores[j], int32_t(s.ids[j]), false});
    }
    std::sort(s.beam.begin(), s.beam.end(), ranks_before);
    if (s.beam.size() > L) {
        s.beam.resize(L);
    }
    size_t i = 0, expansions = 0;
    while (i < s.beam.size() && expansions < max_expansions) {
        if (s.beam[i].expanded) {
            i++;
            continue;
        }
        s.beam[i].expanded = true;
        expansions++;
        int32_t node = s.beam[i].id;
        const int32_t* nb = g.neighbors_of(node);
        int deg = g.degrees[node];
        s.list_bytes += sizeof(g.degrees[node]) + size_t(deg) * sizeof(int32_t);
        s.ids.clear();
        for (int j = 0; j < deg; j++) {
            if (s.visit(nb[j])) {
                s.ids.push_back(nb[j]);
            }
        }
        size_t m = s.ids.size();
        if (m == 0) {
            i++;
            continue;
        }
        s.scores.resize(m);
        score(s.ids.data(), m, s.scores.data());
        scanned += m;
        size_t first_new = s.beam.size();
        for (size_t j = 0; j < m; j++) {
            Candidate c{s.scores[j], int32_t(s.ids[j]), false};
            if (s.beam.size() >= L && !ranks_before(c, s.beam.back())) {
                continue;
            }
            auto pos = std::upper_bound(s.beam.begin(), s.beam.end(), c, ranks_before);
            first_new = std::min(first_new, size_t(pos - s.beam.begin()));
            s.beam.insert(pos, c);
            if (s.beam.size() > L) {
                s.beam.pop_back();
            }
        }
        i = first_new <= i ? first_new : i + 1;
    }
    return scanned;
}

/// Scores by inner product with q (a query, or a key being linked).
struct InnerProductScore {
    const float* q;
    KVRows rows;
    void operator()(const int64_t* ids, size_t m, float* out) const {
        prefetch_key_rows(rows, ids, m);
        inner_products_by_ids(q, rows, ids, m, 1.0f, out);
    }
};

/// Scores by the keys' 8-bit codes: qs and base from KeyCodes8::prepare.
struct CodeScore {
    const KeyCodes8& codes;
    const float* qs;
    float base;
    void operator()(const int64_t* ids, size_t m, float* out) const {
        prefetch_rows_by_ids(codes.codes.data(), codes.d, ids, m); // d bytes a code
        codes.scores(qs, base, ids, m, out);
    }
};

/** A walk for q on the codes (8-bit scores order it), its beam then scored
 * on the stored keys and sorted again: s.beam holds exact scores. Returns
 * the codes scored. */
size_t walk_on_codes(
        const IndexRoarGraph& g,
        const KeyCodes8& codes,
        const float* q,
        size_t L,
        const std::vector<int32_t>& hubs,
        const std::vector<int32_t>& seeds,
        BeamScratch& s,
        size_t max_expansions = std::numeric_limits<size_t>::max()) {
    s.code_query.resize(size_t(g.d));
    float base = codes.prepare(q, s.code_query.data());
    size_t coded = walk(g, L, hubs, seeds, s, CodeScore{codes, s.code_query.data(), base},
                        max_expansions);
    s.ids.clear();
    for (const Candidate& c : s.beam) {
        s.ids.push_back(c.id);
    }
    s.scores.resize(s.ids.size());
    InnerProductScore{q, g.storage.key_rows()}(s.ids.data(), s.ids.size(), s.scores.data());
    for (size_t j = 0; j < s.beam.size(); j++) {
        s.beam[j].score = s.scores[j];
    }
    std::sort(s.beam.begin(), s.beam.end(), ranks_before);
    return coded;
}

} // namespace

// ---- the seeds -----------------------------------------------------------------

namespace {

/** Scores rows `ids` of `rows` (size * d) by L2 to q, up to |q|^2: |x|^2 -
 * 2 <q, x>, appended to `out` as (score, id). */
void add_l2_scores(
        const float* q,
        const float* rows,
        const float* sq_norms,
        size_t d,
        const std::vector<int64_t>& ids,
        std::vector<float>& ip,
        std::vector<std::pair<float, int64_t>>& out) {
    ip.resize(ids.size());
    inner_products_by_ids(q, rows, d, ids.data(), ids.size(), 1.0f, ip.data());
    for (size_t j = 0; j < ids.size(); j++) {
        out.push_back({sq_norms[ids[j]] - 2 * ip[j], ids[j]});
    }
}

} // namespace

void AnchorGroups::clear() {
    centroids.clear();
    sq_norms.clear();
    offsets.clear();
    members.clear();
}

void AnchorGroups::l2_to_centroids(const float* q, float* out) const {
    size_t G = n_groups();
    inner_products_scaled(q, centroids.data(), d, G, 1.0f, out);
    for (size_t g = 0; g < G; g++) {
        out[g] = sq_norms[g] - 2 * out[g];
    }
}

void AnchorGroups::build(const float* anchors, size_t na, size_t dim, size_t n_groups) {
    clear();
    d = dim;
    if (na == 0 || n_groups == 0) {
        return;
    }
    size_t G = std::min(n_groups, na);
    centroids.resize(G * d);
    for (size_t g = 0; g < G; g++) { // evenly spread: every head, every position range
        const float* a = anchors + (g * na / G) * d;
        std::copy(a, a + d, centroids.begin() + g * d);
    }
    std::vector<size_t> group(na);
    std::vector<float> dist(G);
    sq_norms.resize(G);
    auto assign = [&]() {
        for (size_t g = 0; g < G; g++) {
            sq_norms[g] = 0;
            inner_products_scaled(&centroids[g * d], &centroids[g * d], d, 1, 1.0f, &sq_norms[g]);
        }
        for (size_t a = 0; a < na; a++) { // the centroid nearest by L2, as searches score them
            l2_to_centroids(anchors + a * d, dist.data());
            group[a] = size_t(std::min_element(dist.begin(), dist.end()) - dist.begin());
        }
    };
    std::vector<double> sum(G * d);
    std::vector<size_t> count(G);
    for (int it = 0; it < kAnchorKmeansIterations; it++) {
        assign();
        std::fill(sum.begin(), sum.end(), 0.0);
        std::fill(count.begin(), count.end(), 0);
        for (size_t a = 0; a < na; a++) {
            count[group[a]]++;
            for (size_t j = 0; j < d; j++) {
                sum[group[a] * d + j] += anchors[a * d + j];
            }
        }
        for (size_t g = 0; g < G; g++) {
            for (size_t j = 0; count[g] > 0 && j < d; j++) { // an empty group keeps its centroid
                centroids[g * d + j] = float(sum[g * d + j] / double(count[g]));
            }
        }
    }
    assign(); // last: every anchor in its nearest centroid's group
    offsets.assign(G + 1, 0);
    for (size_t a = 0; a < na; a++) {
        offsets[group[a] + 1]++;
    }
    std::partial_sum(offsets.begin(), offsets.end(), offsets.begin());
    members.resize(na);
    std::vector<size_t> next(offsets.begin(), offsets.end() - 1);
    for (size_t a = 0; a < na; a++) {
        members[next[group[a]]++] = int64_t(a);
    }
}

size_t IndexRoarGraph::learned_anchors() const {
    return decode_anchors > 0 ? size_t(std::min<idx_t>(n_learned, decode_anchors)) : 0;
}

size_t IndexRoarGraph::anchor_list_width() const {
    size_t na = anchor_pivots.size();
    return na > 0 ? anchor_lists.size() / na : size_t(Nq);
}

size_t IndexRoarGraph::anchor_pool() const {
    size_t na = prompt_anchors();
    if (seed_anchors <= 0 || na == 0 || anchor_lists.empty()) {
        return 0; // off, or read from a record without the lists
    }
    return std::min(na, size_t(std::max<idx_t>(seed_anchors, ntotal / kKeysPerSeedAnchor)));
}

size_t IndexRoarGraph::recent_anchors_scored() const {
    if (seed_anchors <= 0) {
        return 0;
    }
    return std::min(learned_anchors(),
                    size_t(std::max<idx_t>(seed_anchors, ntotal / kKeysPerSeedAnchor)));
}

bool IndexRoarGraph::seeds_by_group() const {
    size_t G = anchor_groups.n_groups();
    if (G == 0) {
        return false;
    }
    size_t probed = std::min(G, kAnchorGroupsProbed) * group_members_scored(prompt_anchors() / G);
    return G + probed < anchor_pool();
}

size_t IndexRoarGraph::anchors_scored(const float* q) const {
    BeamScratch& s = beam_scratch();
    size_t bytes;
    return anchor_seeds(q, s.seeds, &bytes);
}

size_t IndexRoarGraph::seeding_bytes(const float* q) const {
    BeamScratch& s = beam_scratch();
    size_t bytes;
    anchor_seeds(q, s.seeds, &bytes);
    return bytes;
}

size_t IndexRoarGraph::anchor_seeds(const float* q, std::vector<int32_t>& seeds, size_t* bytes)
        const {
    seeds.clear();
    *bytes = 0;
    size_t pool = anchor_pool(), recent = recent_anchors_scored();
    if (pool == 0 && recent == 0) {
        return 0;
    }
    BeamScratch& s = beam_scratch();
    size_t na = prompt_anchors();
    size_t scored = 0;
    s.anchor_ids.clear();
    if (pool == 0) {
        // the prompt left no anchors: the learned ones alone
    } else if (seeds_by_group()) {
        // the members of the groups whose centroids are nearest q
        const AnchorGroups& ag = anchor_groups;
        size_t G = ag.n_groups();
        s.anchor_scores.resize(G);
        ag.l2_to_centroids(q, s.anchor_scores.data());
        s.nearest.clear();
        for (size_t g = 0; g < G; g++) {
            s.nearest.push_back({s.anchor_scores[g], int64_t(g)});
        }
        size_t probe = std::min(G, kAnchorGroupsProbed);
        std::partial_sort(s.nearest.begin(), s.nearest.begin() + probe, s.nearest.end());
        for (size_t t = 0; t < probe; t++) {
            size_t g = size_t(s.nearest[t].second);
            size_t size = ag.offsets[g + 1] - ag.offsets[g];
            size_t taken = group_members_scored(size);
            for (size_t e = 0; e < taken; e++) { // evenly spread over the group
                s.anchor_ids.push_back(ag.members[ag.offsets[g] + e * size / taken]);
            }
        }
        scored = G;
    } else {
        // a pool evenly spread over the anchors (they are in sample order:
        // every query head and position range)
        for (size_t a = 0; a < pool; a++) {
            s.anchor_ids.push_back(int64_t(a * na / pool));
        }
    }
    // the most recent decode queries, newest first
    for (size_t t = 0; t < recent; t++) {
        size_t slot = size_t((n_learned - 1 - idx_t(t)) % decode_anchors);
        s.anchor_ids.push_back(int64_t(na + slot));
    }
    scored += s.anchor_ids.size();
    s.nearest.clear();
    add_l2_scores(q, anchor_queries.data(), anchor_sq_norms.data(), size_t(d), s.anchor_ids,
                  s.anchor_scores, s.nearest);
    size_t width = anchor_list_width();
    size_t take = std::min(s.nearest.size(), size_t(seed_anchors));
    if (keys_per_seed_list > 0) {
        take = std::min(take, size_t(std::max<idx_t>(1, ntotal / keys_per_seed_list)));
    }
    std::partial_sort(s.nearest.begin(), s.nearest.begin() + take, s.nearest.end());
    size_t entries = 0;
    for (size_t t = 0; t < take; t++) {
        const int32_t* list = anchor_lists.data() + size_t(s.nearest[t].second) * width;
        size_t j = 0;
        for (; j < width && list[j] >= 0; j++) {
            seeds.push_back(list[j]);
        }
        entries += std::min(j + 1, width); // and the -1 that ends a short list
    }
    // the anchor queries and centroids are float rows of d
    *bytes = scored * size_t(d) * sizeof(float) + entries * sizeof(int32_t);
    return scored;
}

size_t IndexRoarGraph::beam_search(
        const float* q,
        idx_t k,
        int beam,
        float* distances,
        idx_t* labels,
        size_t max_expansions) const {
    size_t found = 0, scanned = 0;
    if (ntotal > 0 && k > 0) {
        BeamScratch& s = beam_scratch();
        size_t L = size_t(std::min<idx_t>(std::max<idx_t>(beam, k), ntotal));
        size_t seeding = 0;
        anchor_seeds(q, s.seeds, &seeding);
        if (walk_bits == 8) {
            // the codes ordered the walk; the stored keys order the answer
            size_t coded = walk_on_codes(*this, walk_codes, q, L, hubs, s.seeds, s, max_expansions);
            scanned = keys_read(s.beam.size(), coded * size_t(d) + s.list_bytes + seeding);
        } else {
            InnerProductScore exact{q, storage.key_rows()};
            size_t rows = walk(*this, L, hubs, s.seeds, s, exact, max_expansions);
            scanned = keys_read(rows, s.list_bytes + seeding);
        }
        found = std::min(s.beam.size(), size_t(k));
        for (size_t j = 0; j < found; j++) {
            distances[j] = s.beam[j].score;
            labels[j] = s.beam[j].id;
        }
    }
    for (idx_t j = idx_t(found); j < k; j++) {
        distances[j] = std::numeric_limits<float>::lowest();
        labels[j] = -1;
    }
    return scanned;
}

size_t IndexRoarGraph::keys_read(size_t rows_scored, size_t other_bytes) const {
    return rows_scored + key_equivalents(other_bytes);
}

int IndexRoarGraph::beam_for(const faiss::SearchParameters* params, idx_t k) const {
    int ef = efSearch;
    if (auto p = dynamic_cast<const SearchParametersTopK*>(params)) {
        FAISS_THROW_IF_NOT_FMT(
                p->efSearch >= 0, "SearchParametersTopK: efSearch=%d must be >= 0",
                p->efSearch);
        if (p->efSearch > 0) {
            ef = p->efSearch;
        }
    }
    return int(std::min<idx_t>(std::max<idx_t>(ef, k), std::numeric_limits<int>::max()));
}

void IndexRoarGraph::search_one(
        const float* q,
        idx_t k,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters* params) const {
    beam_search(q, k, beam_for(params, k), distances, labels);
}

void IndexRoarGraph::select_one(
        const float* q,
        Selection& sel,
        const faiss::SearchParameters* params) const {
    idx_t kk = std::min(effective_k(params), ntotal);
    std::vector<float> dis(kk);
    std::vector<idx_t> ids(kk);
    sel.clear();
    sel.n_scanned = beam_search(q, kk, beam_for(params, kk), dis.data(), ids.data());
    for (idx_t id : ids) {
        if (id >= 0) {
            sel.push_back(id);
        }
    }
}

float IndexRoarGraph::attend_one(const float* q, float* out, const faiss::SearchParameters* params)
        const {
    idx_t kk = std::min(effective_k(params), ntotal);
    std::vector<float> s(kk);
    std::vector<idx_t> ids(kk);
    beam_search(q, kk, beam_for(params, kk), s.data(), ids.data());
    size_t found = 0;
    float scale = score_scale();
    while (found < size_t(kk) && ids[found] >= 0) {
        s[found] *= scale;
        found++;
    }
    // exact softmax over the keys found, their scores from the search
    return attention_from_scores(s.data(), nullptr, storage.value_rows(), ids.data(), found, out);
}

// ---- building: pruning and linking -------------------------------------------

namespace {

/// Closeness of key x to each of `ids`: their inner products.
void similarities_to(
        const IndexRoarGraph& g,
        idx_t x,
        const int64_t* ids,
        size_t m,
        std::vector<float>& xf,
        float* out) {
    xf.resize(g.d);
    g.storage.key(x, xf.data());
    inner_products_by_ids(xf.data(), g.storage.key_rows(), ids, m, 1.0f, out);
}

/** The occlusion rule over candidates sorted closest first: c is dropped
 * when a kept r is closer to c than the pivot is (<c, r> > <c, pivot>);
 * then the list is filled back to max_keep with the dropped ones, closest
 * first. */
std::vector<int32_t> prune(
        const IndexRoarGraph& g,
        idx_t pivot,
        const std::vector<Candidate>& cands,
        int max_keep) {
    std::vector<int32_t> kept, dropped;
    std::vector<int64_t> kept64;
    std::vector<float> xf, sim(max_keep);
    for (const Candidate& c : cands) {
        if (kept.size() >= size_t(max_keep)) {
            break;
        }
        if (c.id == pivot) {
            continue;
        }
        similarities_to(g, c.id, kept64.data(), kept64.size(), xf, sim.data());
        bool occluded = false;
        for (size_t r = 0; r < kept.size() && !occluded; r++) {
            occluded = sim[r] > c.score;
        }
        if (occluded) {
            dropped.push_back(c.id);
        } else {
            kept.push_back(c.id);
            kept64.push_back(c.id);
        }
    }
    for (size_t j = 0; j < dropped.size() && kept.size() < size_t(max_keep); j++) {
        kept.push_back(dropped[j]);
    }
    return kept;
}

/// The candidates `ids` (distinct, pivot excluded) sorted closest to pivot first.
std::vector<Candidate> sorted_by_similarity(
        const IndexRoarGraph& g,
        idx_t pivot,
        const std::vector<int32_t>& ids) {
    std::vector<int64_t> ids64(ids.begin(), ids.end());
    std::vector<float> sim(ids.size()), xf;
    similarities_to(g, pivot, ids64.data(), ids64.size(), xf, sim.data());
    std::vector<Candidate> out(ids.size());
    for (size_t j = 0; j < ids.size(); j++) {
        out[j] = {sim[j], ids[j]};
    }
    std::sort(out.begin(), out.end(), ranks_before);
    return out;
}

void sort_unique(std::vector<int32_t>& v) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
}

} // namespace

void IndexRoarGraph::project(const std::vector<idx_t>& lists, idx_t n_lists, int width) {
    int R = max_degree();
    // the candidates of each pivot: the lists of the queries it heads
    std::vector<std::vector<int32_t>> cands(ntotal);
    for (idx_t q = 0; q < n_lists; q++) {
        const idx_t* list = lists.data() + q * width;
        if (list[0] < 0) {
            continue;
        }
        std::vector<int32_t>& c = cands[list[0]];
        for (int j = 1; j < width && list[j] >= 0; j++) {
            c.push_back(int32_t(list[j]));
        }
    }
    std::vector<idx_t> pivots;
    for (idx_t p = 0; p < ntotal; p++) {
        if (!cands[p].empty()) {
            pivots.push_back(p);
        }
    }
    auto set_row = [&](idx_t p, const std::vector<int32_t>& row) {
        int32_t* out = neighbors.data() + size_t(p) * R;
        std::copy(row.begin(), row.end(), out);
        std::fill(out + row.size(), out + R, -1);
        degrees[p] = uint16_t(row.size());
    };
    parallel_for(idx_t(pivots.size()), [&](idx_t i) {
        idx_t p = pivots[i];
        sort_unique(cands[p]);
        cands[p].erase(std::remove(cands[p].begin(), cands[p].end(), int32_t(p)), cands[p].end());
        set_row(p, prune(*this, p, sorted_by_similarity(*this, p, cands[p]), M));
    });
    // reverse edges, then every list over M pruned again
    std::vector<std::vector<int32_t>> reverse(ntotal);
    for (idx_t p = 0; p < ntotal; p++) {
        for (int j = 0; j < degrees[p]; j++) {
            reverse[neighbors_of(p)[j]].push_back(int32_t(p));
        }
    }
    parallel_for(ntotal, [&](idx_t c) {
        if (reverse[c].empty()) {
            return;
        }
        std::vector<int32_t> merged(neighbors_of(c), neighbors_of(c) + degrees[c]);
        merged.insert(merged.end(), reverse[c].begin(), reverse[c].end());
        sort_unique(merged);
        if (merged.size() > size_t(M)) {
            merged = prune(*this, c, sorted_by_similarity(*this, c, merged), M);
        }
        set_row(c, merged);
    });
    count_in_degrees();
}

IndexRoarGraph::LinkingSet::LinkingSet(const std::vector<idx_t>& keys) : sorted(keys) {
    if (keys.size() > size_t(kLinkBatch)) {
        marks.assign(size_t(keys.back()) + 1, 0);
        for (idx_t i : keys) {
            marks[i] = 1;
        }
    }
}

bool IndexRoarGraph::add_edge(idx_t c, idx_t x, bool force, const LinkingSet& keep) {
    int R = max_degree();
    int32_t* row = neighbors.data() + size_t(c) * R;
    int deg = degrees[c];
    if (std::find(row, row + deg, int32_t(x)) != row + deg) {
        return true;
    }
    if (deg < R) {
        journal_row(c);
        row[degrees[c]++] = int32_t(x);
        in_degrees[x]++;
        return true;
    }
    if (!force) {
        return false;
    }
    // x must get an in-edge: it replaces the least similar neighbour that
    // has another in-edge and is not being linked now (so that one stays
    // reachable). Only those are scored: when a prefill links most keys,
    // most rows have none (a row scored for nothing was ~4 a key at 128k)
    BeamScratch& s = beam_scratch();
    s.trade_slots.clear();
    s.trade_ids.clear();
    for (int j = 0; j < R; j++) {
        if (in_degrees[row[j]] >= 2 && !keep.contains(row[j])) {
            s.trade_slots.push_back(j);
            s.trade_ids.push_back(row[j]);
        }
    }
    if (s.trade_slots.empty()) {
        return false;
    }
    s.scores.resize(s.trade_ids.size());
    similarities_to(*this, c, s.trade_ids.data(), s.trade_ids.size(), s.row, s.scores.data());
    size_t worst = 0;
    for (size_t t = 1; t < s.trade_slots.size(); t++) {
        if (s.scores[t] < s.scores[worst]) {
            worst = t;
        }
    }
    const int slot = s.trade_slots[worst];
    journal_row(c);
    in_degrees[row[slot]]--;
    row[slot] = int32_t(x);
    in_degrees[x]++;
    return true;
}

bool IndexRoarGraph::link_keys(
        const std::vector<idx_t>& keys,
        bool growing,
        const KeyCodes8* codes) {
    bool lost = false;
    const LinkingSet linking(keys);
    std::vector<std::vector<int32_t>> found, reached, anchored;
    size_t pos = 0;
    while (pos < keys.size()) {
        size_t batch = growing ? std::max<size_t>(1, std::min<size_t>(pos, kLinkBatch))
                               : size_t(kLinkBatch);
        batch = std::min(batch, keys.size() - pos);
        found.assign(batch, {});
        reached.assign(batch, {});
        anchored.assign(batch, {});
        // searched in parallel on the graph as it is before the batch
        parallel_for(idx_t(batch), [&](idx_t j) {
            idx_t x = keys[pos + j];
            BeamScratch& s = beam_scratch();
            std::vector<float> xf(d);
            storage.key(x, xf.data());
            size_t L = size_t(std::min<idx_t>(build_L, ntotal));
            if (codes) {
                walk_on_codes(*this, *codes, xf.data(), L, {}, {}, s);
            } else {
                walk(*this, L, {}, {}, s, InnerProductScore{xf.data(), storage.key_rows()});
            }
            std::vector<Candidate> cands;
            for (const Candidate& c : s.beam) {
                if (c.id != x) {
                    cands.push_back(c);
                    reached[j].push_back(c.id);
                }
            }
            found[j] = prune(*this, x, cands, M);
            if (x >= n_prompt) {
                anchored[j] = anchor_pivots_of(xf.data(), x);
            }
        });
        // applied in key order: the graph does not depend on the threads
        for (size_t j = 0; j < batch; j++) {
            idx_t x = keys[pos + j];
            for (int32_t c : found[j]) {
                add_edge(x, c, false, linking); // while x's row has room
            }
            bool linked = x == entry_point; // needs an in-edge from a key the walk reached
            for (int32_t c : anchored[j]) {
                add_edge(x, c, false, linking);
                linked = add_edge(c, x, false, linking) || linked;
            }
            for (int32_t c : found[j]) {
                linked = add_edge(c, x, false, linking) || linked;
            }
            // no neighbour had room for x: the closest reached key with
            // room takes it, else the closest one that can trade an edge
            for (int force = 0; force < 2 && !linked; force++) {
                for (size_t r = 0; r < reached[j].size() && !linked; r++) {
                    linked = add_edge(reached[j][r], x, force == 1, linking);
                }
            }
            lost = lost || !linked;
        }
        pos += batch;
    }
    return lost;
}

std::vector<idx_t> IndexRoarGraph::unreachable_keys() const {
    std::vector<idx_t> out;
    if (ntotal == 0) {
        return out;
    }
    std::vector<uint8_t> seen(ntotal, 0);
    std::vector<int32_t> queue = {int32_t(entry_point)};
    seen[entry_point] = 1;
    for (size_t h = 0; h < queue.size(); h++) {
        const int32_t* row = neighbors_of(queue[h]);
        for (int j = 0; j < degrees[queue[h]]; j++) {
            if (!seen[row[j]]) {
                seen[row[j]] = 1;
                queue.push_back(row[j]);
            }
        }
    }
    for (idx_t i = 0; i < ntotal; i++) {
        if (!seen[i]) {
            out.push_back(i);
        }
    }
    return out;
}

idx_t IndexRoarGraph::count_reachable() const {
    return ntotal - idx_t(unreachable_keys().size());
}

void IndexRoarGraph::repair_reachability(const KeyCodes8* codes) {
    for (int round = 0; round < kMaxRepairRounds; round++) {
        std::vector<idx_t> lost = unreachable_keys();
        if (lost.empty()) {
            return;
        }
        link_keys(lost, false, codes);
    }
    FAISS_THROW_FMT(
            "IndexRoarGraph: %zd keys stay unreachable after %d linking rounds",
            unreachable_keys().size(),
            kMaxRepairRounds);
}

// ---- prefill -------------------------------------------------------------------

std::vector<idx_t> IndexRoarGraph::training_sample(idx_t n_queries, int n_heads) const {
    // rows are head-major: row h * n_queries + p is head h at position p
    idx_t n_all = n_queries * n_heads;
    std::vector<idx_t> pick, rest;
    if (n_all <= max_train_queries) {
        pick.resize(n_all);
        std::iota(pick.begin(), pick.end(), idx_t(0));
        return pick;
    }
    // the recent positions take at most half of the budget: the sample
    // still covers the whole prompt
    idx_t recent = std::min(recent_queries, max_train_queries / (2 * idx_t(n_heads)));
    for (idx_t i = 0; i < n_all; i++) {
        (i % n_queries >= n_queries - recent ? pick : rest).push_back(i);
    }
    idx_t want = max_train_queries - idx_t(pick.size());
    idx_t nr = idx_t(rest.size());
    std::mt19937_64 rng(stream_seed(seed, stream));
    for (idx_t i = 0; i < want; i++) { // partial Fisher-Yates
        std::uniform_int_distribution<idx_t> u(i, nr - 1);
        std::swap(rest[i], rest[u(rng)]);
    }
    pick.insert(pick.end(), rest.begin(), rest.begin() + want);
    std::sort(pick.begin(), pick.end());
    return pick;
}

void IndexRoarGraph::prefill_impl(const PrefillInput& in) {
    check_prefill(in);
    if (in.n_tokens > 0 && in.n_queries == 0) {
        add_kv_impl(in.n_tokens, in.keys, in.values); // linked by step 4 alone
        ntotal = in.n_tokens;
    } else if (in.n_tokens > 0) {
        idx_t n = in.n_tokens;
        append_tokens(n, in.keys, in.values);
        ntotal = n;
        try {
            entry_point = medoid(storage, n);
            // 1. the training queries: all, or the recent ones and a seeded
            // sample of the others
            std::vector<idx_t> pick = training_sample(in.n_queries, in.n_query_heads);
            idx_t nq = idx_t(pick.size());
            std::vector<float> train(size_t(nq) * d);
            for (idx_t i = 0; i < nq; i++) {
                std::memcpy(&train[size_t(i) * d], in.queries + pick[i] * d, sizeof(float) * d);
            }
            // 2. their exact lists, over the keys as stored
            std::vector<float> keys(size_t(n) * d);
            for (idx_t i = 0; i < n; i++) {
                storage.key(i, &keys[size_t(i) * d]);
            }
            // (no wider than the keys: Nq = 100000 over 2k keys would
            // allocate lists of padding, gigabytes of it)
            const int width = int(std::min<idx_t>(Nq, n));
            std::vector<idx_t> lists(size_t(nq) * width);
            exact_topk_blocked(keys.data(), n, d, train.data(), nq, width, lists.data());
            keys = std::vector<float>();
            // 3. projection
            project(lists, nq, width);
            choose_hubs(lists, n);
            choose_anchors(train, lists, nq, width);
            n_prompt = n;
            // 4. connectivity: the keys the projection left with few edges
            // (most keys are in no query's list) are linked by search; the
            // others already have the queries' edges
            std::vector<idx_t> sparse;
            for (idx_t i = 0; i < n; i++) {
                if (degrees[i] < link_degree()) {
                    sparse.push_back(i);
                }
            }
            // their walks score 8-bit codes of the keys, a quarter of the
            // bytes (at 128k keys of d = 128 the float rows no longer fit
            // in L3), and each beam is scored again on the stored keys
            KeyCodes8 own_codes; // under walk_bits 0, made for the build alone
            const KeyCodes8* codes = &walk_codes;
            if (walk_bits != 8) {
                own_codes.train(storage);
                codes = &own_codes;
            }
            link_keys(sparse, false, codes);
            repair_reachability(codes);
            n_train_queries = nq;
        } catch (...) {
            reset_impl();
            throw;
        }
    }
    rope = in.rope;
    has_rope = true;
}

void IndexRoarGraph::choose_hubs(const std::vector<idx_t>& lists, idx_t n) {
    // the keys in the most training lists: where attention goes most often
    std::vector<uint32_t> count(n, 0);
    for (idx_t id : lists) {
        if (id >= 0) {
            count[id]++;
        }
    }
    idx_t nh = std::min(n_hubs >= 0 ? n_hubs : n / kKeysPerHub, n);
    std::vector<int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + nh, order.end(), [&](int32_t a, int32_t b) {
        return count[a] > count[b] || (count[a] == count[b] && a < b);
    });
    hubs.assign(order.begin(), order.begin() + nh);
    std::sort(hubs.begin(), hubs.end());
}

void IndexRoarGraph::choose_anchors(
        const std::vector<float>& train,
        const std::vector<idx_t>& lists,
        idx_t n_lists,
        int width) {
    // evenly spread over the (sorted) sample: every head and position range
    idx_t na = std::min(n_anchors, n_lists);
    resize_anchors(size_t(na), size_t(width));
    std::vector<float> k(d);
    for (idx_t a = 0; a < na; a++) {
        idx_t src = a * n_lists / na;
        const float* q = train.data() + src * d;
        std::copy(q, q + d, anchor_queries.begin() + a * d);
        const idx_t* list = lists.data() + src * width;
        int last = 0;
        while (last + 1 < width && list[last + 1] >= 0) {
            last++;
        }
        anchor_pivots[a] = int32_t(list[0]);
        for (int j = 0; j < width; j++) {
            anchor_lists[size_t(a) * width + j] = int32_t(list[j]);
        }
        storage.key(list[last], k.data());
        float t = 0;
        for (int j = 0; j < d; j++) {
            t += q[j] * k[j];
        }
        anchor_thresholds[a] = t; // the score of its Nq-th key
    }
    index_anchors();
}

namespace {

/// f(array, entries per anchor) for each array that holds one row per
/// anchor, lists `width` wide: one list, so that none is sized apart.
template <class F>
void for_each_anchor_array(IndexRoarGraph& g, size_t width, F&& f) {
    f(g.anchor_queries, size_t(g.d));
    f(g.anchor_sq_norms, size_t(1));
    f(g.anchor_thresholds, size_t(1));
    f(g.anchor_pivots, size_t(1));
    f(g.anchor_lists, width);
    f(g.anchor_list_scores, width);
}

} // namespace

void IndexRoarGraph::resize_anchors(size_t na, size_t width) {
    for_each_anchor_array(*this, width, [na](auto& v, size_t per) { v.resize(na * per); });
}

void IndexRoarGraph::reserve_anchors(size_t na, size_t width) {
    for_each_anchor_array(*this, width, [na](auto& v, size_t per) { v.reserve(na * per); });
}

void IndexRoarGraph::index_anchors() {
    size_t na = anchor_pivots.size();
    anchor_sq_norms.resize(na);
    for (size_t a = 0; a < na; a++) {
        const float* x = anchor_queries.data() + a * d;
        anchor_sq_norms[a] = 0;
        inner_products_scaled(x, KVRows(x, size_t(d)), 1, 1.0f, &anchor_sq_norms[a]);
    }
    score_anchor_lists();
    // the prompt's anchors in sqrt(np) groups (the centroids and the groups
    // probed cost about the same); the learned ones change every step and
    // are scored apart
    size_t np = prompt_anchors();
    anchor_groups.build(anchor_queries.data(), np, size_t(d),
                        size_t(std::lround(std::sqrt(double(np)))));
}

float IndexRoarGraph::anchor_score(size_t a, idx_t key) const {
    // one row at a time: a batch kernel may round a row by its place in
    // the batch, and a list must order the same keys the same way on
    // every path (learn, append, read)
    int64_t id = key;
    float s;
    inner_products_by_ids(anchor_queries.data() + a * d, storage.key_rows(), &id, 1, 1.0f, &s);
    return s;
}

void IndexRoarGraph::list_scores_of(size_t a, const int32_t* list, float* scores) const {
    for (size_t j = 0, width = anchor_list_width(); j < width; j++) {
        scores[j] = list[j] >= 0 ? anchor_score(a, list[j]) : -std::numeric_limits<float>::infinity();
    }
}

void IndexRoarGraph::score_anchor_lists() {
    size_t na = anchor_pivots.size(), width = anchor_lists.empty() ? 0 : anchor_list_width();
    anchor_list_scores.resize(na * width);
    for (size_t a = 0; a < na && width > 0; a++) {
        list_scores_of(a, anchor_lists.data() + a * width, anchor_list_scores.data() + a * width);
    }
}

void IndexRoarGraph::index_codes() {
    walk_codes.clear();
    if (walk_bits == 8) {
        walk_codes.train(storage);
    }
}

std::vector<int32_t> IndexRoarGraph::anchor_pivots_of(const float* key, idx_t x) const {
    idx_t na = idx_t(anchor_pivots.size());
    std::vector<float> s(na);
    inner_products_scaled(key, anchor_queries.data(), d, size_t(na), 1.0f, s.data());
    std::vector<std::pair<float, int32_t>> hits; // (margin, pivot)
    for (idx_t a = 0; a < na; a++) {
        if (s[a] >= anchor_thresholds[a] && anchor_pivots[a] != x) {
            hits.push_back({s[a] - anchor_thresholds[a], anchor_pivots[a]});
        }
    }
    std::sort(hits.begin(), hits.end(), [](const auto& u, const auto& v) {
        return u.first > v.first || (u.first == v.first && u.second < v.second);
    });
    std::vector<int32_t> out;
    for (const auto& h : hits) {
        if (out.size() < size_t(M) && std::find(out.begin(), out.end(), h.second) == out.end()) {
            out.push_back(h.second);
        }
    }
    return out;
}

void IndexRoarGraph::update_anchor_lists(idx_t n0) {
    size_t na = anchor_pivots.size(), width = anchor_list_width();
    if (na == 0 || width == 0) {
        return;
    }
    // everything allocated first: a failure leaves the lists as they were
    std::vector<float> x(d), s(na);
    for (idx_t key = n0; key < ntotal; key++) {
        storage.key(key, x.data());
        inner_products_scaled(x.data(), anchor_queries.data(), d, na, 1.0f, s.data());
        for (size_t a = 0; a < na; a++) {
            int32_t* list = anchor_lists.data() + a * width;
            float* scores = anchor_list_scores.data() + a * width;
            bool full = list[width - 1] >= 0;
            if (full && s[a] < anchor_thresholds[a]) {
                continue; // below the list's bar
            }
            size_t len = full ? width : size_t(std::find(list, list + width, -1) - list);
            // key's place: after every listed key of at least its score
            float sa = anchor_score(a, key);
            size_t pos = 0;
            while (pos < len && scores[pos] >= sa) {
                pos++;
            }
            if (pos == width) {
                continue; // a tie with the bar, after every listed key
            }
            journal_anchor(a);
            size_t kept = std::min(len + 1, width);
            std::copy_backward(list + pos, list + kept - 1, list + kept);
            std::copy_backward(scores + pos, scores + kept - 1, scores + kept);
            list[pos] = int32_t(key);
            scores[pos] = sa;
            anchor_thresholds[a] = scores[kept - 1];
            anchor_pivots[a] = list[0];
        }
    }
}

void IndexRoarGraph::scan_lists(
        const float* q, idx_t m, size_t width, float* scores, idx_t* ids) const {
    std::vector<size_t> filled(m, 0);
    static_assert(sizeof(idx_t) == sizeof(int64_t), "the heap's ids are idx_t");
    auto heap_ids = reinterpret_cast<int64_t*>(ids);
    for (idx_t k0 = 0; k0 < ntotal; k0 += kLearnScanBlock) {
        size_t nk = size_t(std::min(kLearnScanBlock, ntotal - k0));
        KVRows block = storage.key_rows().from(size_t(k0));
        for (idx_t i = 0; i < m; i++) {
            topk_inner_products(q + size_t(i) * d, block, nk, nullptr, k0, width,
                                scores + size_t(i) * width, heap_ids + size_t(i) * width,
                                &filled[i]);
        }
    }
    for (idx_t i = 0; i < m; i++) {
        topk_heap_sort(scores + size_t(i) * width, heap_ids + size_t(i) * width, filled[i]);
        std::fill(ids + size_t(i) * width + filled[i], ids + size_t(i + 1) * width, idx_t(-1));
    }
}

void IndexRoarGraph::add_queries_impl(idx_t n, const float* queries) {
    size_t width = anchor_list_width();
    if (decode_anchors <= 0 || ntotal == 0 || width == 0) {
        return; // none kept, nothing to search, or a version-1 record (no lists)
    }
    // only the last decode_anchors would stay in the ring
    idx_t first = std::max<idx_t>(0, n - decode_anchors), m = n - first;
    std::vector<float> scores(size_t(m) * width);
    std::vector<idx_t> ids(size_t(m) * width);
    // listed in parallel on the index as it was before the call, kept in
    // order: the anchors do not depend on the thread count
    if (ntotal <= learn_scan_keys) {
        // few keys: one pass over them for a task's queries costs less than
        // their beams (and the lists are exact)
        idx_t n_tasks = (m + kLearnScanQueries - 1) / kLearnScanQueries;
        parallel_for(n_tasks, [&](idx_t t) {
            idx_t i0 = t * kLearnScanQueries, i1 = std::min(m, i0 + kLearnScanQueries);
            scan_lists(queries + size_t(first + i0) * d, i1 - i0, width,
                       scores.data() + size_t(i0) * width, ids.data() + size_t(i0) * width);
        });
    } else {
        SearchParametersTopK learning; // the learning beam: later searches start from these lists
        learning.efSearch = learn_efSearch > 0
                ? learn_efSearch
                : int(std::min<int64_t>(2 * int64_t(efSearch), kMaxBeam));
        int beam = beam_for(&learning, idx_t(width));
        parallel_for(m, [&](idx_t i) {
            beam_search(queries + size_t(first + i) * d, idx_t(width), beam,
                        scores.data() + size_t(i) * width, ids.data() + size_t(i) * width,
                        std::numeric_limits<size_t>::max());
        });
    }
    for (idx_t i = 0; i < m; i++) {
        keep_decode_anchor(queries + size_t(first + i) * d, ids.data() + size_t(i) * width,
                           scores.data() + size_t(i) * width);
    }
}

void IndexRoarGraph::keep_decode_anchor(const float* q, const idx_t* ids, const float* scores) {
    size_t width = anchor_list_width();
    size_t slot = prompt_anchors() + size_t(n_learned % decode_anchors);
    if (slot == anchor_pivots.size()) { // the ring is not full yet
        if (slot + 1 > anchor_pivots.capacity()) {
            // grown by 1/4 as the token arrays are, never past the full ring
            size_t ring_end = prompt_anchors() + size_t(decode_anchors);
            reserve_anchors(std::min(ring_end, std::max(slot + 1, slot + slot / 4)), width);
        }
        resize_anchors(slot + 1, width);
    }
    std::copy(q, q + d, anchor_queries.begin() + slot * d);
    inner_products_scaled(q, KVRows(q, size_t(d)), 1, 1.0f, &anchor_sq_norms[slot]);
    size_t found = 0;
    for (size_t j = 0; j < width; j++) {
        anchor_lists[slot * width + j] = int32_t(ids[j]);
        found += ids[j] >= 0;
    }
    list_scores_of(slot, anchor_lists.data() + slot * width, anchor_list_scores.data() + slot * width);
    anchor_pivots[slot] = int32_t(ids[0]); // a non-empty index finds a key
    anchor_thresholds[slot] = scores[found - 1];
    n_learned++;
}

void IndexRoarGraph::reset_impl() {
    storage.clear();
    neighbors.clear();
    degrees.clear();
    in_degrees.clear();
    hubs.clear();
    anchor_queries.clear();
    anchor_thresholds.clear();
    anchor_pivots.clear();
    anchor_lists.clear();
    anchor_list_scores.clear();
    anchor_sq_norms.clear();
    anchor_groups.clear();
    index_codes(); // under walk_bits 8, the ranges of no keys (d dimensions): what io reads back
    n_learned = 0;
    n_prompt = 0;
    entry_point = -1;
    n_train_queries = 0;
    ntotal = 0;
}

size_t IndexRoarGraph::graph_bytes() const {
    return capacity_bytes(neighbors) + capacity_bytes(degrees);
}

size_t IndexRoarGraph::memory_bytes() const {
    // capacities: what the arrays hold, headroom for appends included
    return storage.memory_bytes() + graph_bytes() + capacity_bytes(in_degrees) +
            capacity_bytes(hubs) + capacity_bytes(anchor_queries) +
            capacity_bytes(anchor_thresholds) + capacity_bytes(anchor_sq_norms) +
            capacity_bytes(anchor_list_scores) + capacity_bytes(anchor_pivots) +
            capacity_bytes(anchor_lists) + capacity_bytes(anchor_groups.centroids) +
            capacity_bytes(anchor_groups.sq_norms) + capacity_bytes(anchor_groups.offsets) +
            capacity_bytes(anchor_groups.members) + walk_codes.memory_bytes();
}

// ---- parameters ----------------------------------------------------------------

bool IndexRoarGraph::reads_search_knob(const std::string& name) const {
    return name == "k" || name == "efSearch";
}

std::vector<ParameterInfo> IndexRoarGraph::parameter_info() const {
    using P = ParameterInfo;
    std::vector<ParameterInfo> info = KVIndex::parameter_info();
    info.push_back(P::integer("efSearch", 1, kMaxBeam, "beam width of the search (the beam is max(efSearch, k))").tokens());
    info.push_back(P::integer("M", 2, kMaxM, "out-degree of the projection (degree bound 2M); empty index only").prefill());
    info.push_back(P::integer("Nq", 1, 100000, "exact neighbours per training query").prefill());
    info.push_back(P::integer("build_L", 1, kMaxBeam, "beam of the linking searches (build and appends)").prefill());
    info.push_back(P::integer("max_train_queries", 1, P::kNoBound, "training queries at most (a seeded sample beyond)").prefill());
    info.push_back(P::integer("n_hubs", 0, P::kNoBound, "keys scored as extra entry points of every search (the keys in most training lists); -1: one per 256 prompt keys").prefill().tokens().also(-1));
    info.push_back(P::integer("n_anchors", 0, P::kNoBound, "training queries kept to link decode-time keys (0: none)").prefill());
    info.push_back(P::integer("recent_queries", 0, P::kNoBound, "the last positions of every query head always in the training queries").prefill());
    info.push_back(P::integer("seed_anchors", 0, 1e6, "the anchors nearest the query whose lists seed the search (0: none)"));
    info.push_back(P::integer("keys_per_seed_list", 0, P::kNoBound, "at most one seed list per this many keys (0: seed_anchors lists at any length)"));
    info.push_back(P::integer("anchors_per_group", 0, P::kNoBound, "members of each probed anchor group scored at most, evenly spread (0: all)"));
    info.push_back(P::integer("max_expansions", -1, kMaxBeam, "beam members a search expands at most (-1: the whole beam; 0: the best of the seeds)"));
    info.push_back(P::integer("walk_bits", 0, 0, "0: the search scores the stored keys; 8: it walks on 8-bit codes of the keys and scores its beam again on them").also(8));
    info.push_back(P::integer("learn_efSearch", 0, kMaxBeam, "beam of the searches that learn decode queries (add_queries); 0: twice efSearch"));
    info.push_back(P::integer("learn_scan_keys", 0, P::kNoBound, "add_queries lists a decode query by an exact scan of the keys while the index holds at most this many, by a beam of learn_efSearch above").tokens());
    info.push_back(P::integer("decode_anchors", 0, 1e6, "decode queries (add_queries) kept as anchors, the most recent; 0: none; setting it drops those learned"));
    info.push_back(P::integer("seed", 0, P::kNoBound, "seed of the training sample (with the per-head stream)").prefill());
    return info;
}

bool IndexRoarGraph::set_parameter(const std::string& name, double value) {
    if (name == "seed") {
        seed = count_parameter(name, value);
        return true;
    }
    if (name == "n_anchors") {
        n_anchors = idx_t(count_parameter(name, value));
        return true;
    }
    if (name == "recent_queries") {
        recent_queries = idx_t(count_parameter(name, value));
        return true;
    }
    if (name == "seed_anchors") {
        FAISS_THROW_IF_NOT_FMT(
                is_count(value) && value <= 1e6,
                "parameter seed_anchors=%g must be an integer in 0..1000000", value);
        seed_anchors = int(value);
        return true;
    }
    if (name == "keys_per_seed_list") {
        keys_per_seed_list = idx_t(count_parameter(name, value));
        return true;
    }
    if (name == "anchors_per_group") {
        anchors_per_group = idx_t(count_parameter(name, value));
        return true;
    }
    if (name == "max_expansions") {
        FAISS_THROW_IF_NOT_FMT(
                value == -1 || (is_count(value) && value <= kMaxBeam),
                "parameter max_expansions=%g must be -1 (the whole beam) or an integer in 0..1e9",
                value);
        max_expansions = int(value);
        return true;
    }
    if (name == "walk_bits") {
        FAISS_THROW_IF_NOT_FMT(
                value == 0 || value == 8,
                "parameter walk_bits=%g must be 0 (the stored keys) or 8 (8-bit codes)", value);
        if (int(value) != walk_bits) {
            walk_bits = int(value);
            index_codes();
        }
        return true;
    }
    if (name == "learn_scan_keys") {
        learn_scan_keys = idx_t(count_parameter(name, value));
        return true;
    }
    if (name == "learn_efSearch") {
        FAISS_THROW_IF_NOT_FMT(
                is_count(value) && value <= kMaxBeam,
                "parameter learn_efSearch=%g must be an integer in 0..1e9 (0: twice efSearch)",
                value);
        learn_efSearch = int(value);
        return true;
    }
    if (name == "decode_anchors") {
        FAISS_THROW_IF_NOT_FMT(
                is_count(value) && value <= 1e6,
                "parameter decode_anchors=%g must be an integer in 0..1000000", value);
        if (int(value) != decode_anchors) { // the ring's slots change: start it again
            resize_anchors(prompt_anchors(), anchor_list_width()); // 0 wide without lists
            n_learned = 0;
            decode_anchors = int(value);
        }
        return true;
    }
    if (name == "n_hubs") {
        FAISS_THROW_IF_NOT_FMT(
                value == -1 || is_count(value),
                "parameter n_hubs=%g must be -1 (one per %zd prompt keys) or a count >= 0",
                value,
                size_t(kKeysPerHub));
        n_hubs = idx_t(value);
        return true;
    }
    int* int_knob = name == "efSearch" ? &efSearch
            : name == "M"              ? &M
            : name == "Nq"             ? &Nq
            : name == "build_L"        ? &build_L
                                       : nullptr;
    if (!int_knob && name != "max_train_queries") {
        return KVIndex::set_parameter(name, value);
    }
    FAISS_THROW_IF_NOT_FMT(
            is_positive_integer(value), "parameter %s=%g must be a positive integer",
            name.c_str(), value);
    if (name == "max_train_queries") {
        max_train_queries = idx_t(value);
        return true;
    }
    double limit = name == "M" ? kMaxM : name == "Nq" ? 100000 : 1e9;
    FAISS_THROW_IF_NOT_FMT(
            value <= limit && (name != "M" || value >= 2),
            "parameter %s=%g out of range (%s)",
            name.c_str(),
            value,
            name == "M" ? "2..512" : name == "Nq" ? "1..100000" : "1..1e9");
    FAISS_THROW_IF_NOT_FMT(
            name != "M" || ntotal == 0 || int(value) == M,
            "parameter M=%g: the graph of %zd keys was built with M=%d; set M "
            "before prefill (or reset)",
            value,
            size_t(ntotal),
            M);
    *int_knob = int(value);
    return true;
}

bool IndexRoarGraph::get_parameter(const std::string& name, double* value) const {
    if (name == "efSearch") {
        *value = efSearch;
    } else if (name == "M") {
        *value = M;
    } else if (name == "Nq") {
        *value = Nq;
    } else if (name == "build_L") {
        *value = build_L;
    } else if (name == "max_train_queries") {
        *value = double(max_train_queries);
    } else if (name == "seed") {
        *value = double(seed);
    } else if (name == "n_hubs") {
        *value = double(n_hubs);
    } else if (name == "n_anchors") {
        *value = double(n_anchors);
    } else if (name == "recent_queries") {
        *value = double(recent_queries);
    } else if (name == "seed_anchors") {
        *value = seed_anchors;
    } else if (name == "keys_per_seed_list") {
        *value = double(keys_per_seed_list);
    } else if (name == "anchors_per_group") {
        *value = double(anchors_per_group);
    } else if (name == "max_expansions") {
        *value = max_expansions;
    } else if (name == "walk_bits") {
        *value = walk_bits;
    } else if (name == "decode_anchors") {
        *value = decode_anchors;
    } else if (name == "learn_efSearch") {
        *value = learn_efSearch;
    } else if (name == "learn_scan_keys") {
        *value = double(learn_scan_keys);
    } else {
        return KVIndex::get_parameter(name, value);
    }
    return true;
}

void IndexRoarGraph::set_stream(uint64_t s) {
    stream = s;
    KVIndex::set_stream(s);
}

// ---- io ------------------------------------------------------------------------

void IndexRoarGraph::write_fields(BufferWriter& w) const {
    w.value<int32_t>(M);
    w.value<int32_t>(Nq);
    w.value<int32_t>(build_L);
    w.value<int64_t>(max_train_queries);
    w.value<int32_t>(efSearch);
    w.value<uint64_t>(seed);
    w.value<uint64_t>(stream);
    w.value<int64_t>(n_train_queries);
    w.value<int64_t>(entry_point);
    w.value<int64_t>(n_hubs);
    w.vector(hubs);
    w.value<int64_t>(n_anchors);
    w.value<int64_t>(n_prompt);
    w.vector(anchor_queries);
    w.vector(anchor_thresholds);
    w.vector(anchor_pivots);
    // record version 2
    w.value<int64_t>(recent_queries);
    w.value<int32_t>(seed_anchors);
    w.vector(anchor_lists);
    // record version 3
    w.value<int32_t>(walk_bits);
    storage.write(w);
    w.vector(degrees);
    w.vector(neighbors); // the in-degrees are counted from the edges
    if (walk_bits == 8) {
        walk_codes.write(w); // the ranges: the codes of appended keys depend on them
    }
    // record version 4
    w.value<int32_t>(decode_anchors);
    w.value<int32_t>(learn_efSearch);
    w.value<int64_t>(n_learned);
    // record version 5
    w.value<int64_t>(learn_scan_keys);
    // record version 6
    w.value<int64_t>(keys_per_seed_list);
    w.value<int64_t>(anchors_per_group);
    w.value<int32_t>(max_expansions);
}

void IndexRoarGraph::read_fields(BufferReader& r, uint32_t version) {
    M = r.value<int32_t>("M");
    Nq = r.value<int32_t>("Nq");
    build_L = r.value<int32_t>("build_L");
    max_train_queries = r.value<int64_t>("max_train_queries");
    efSearch = r.value<int32_t>("efSearch");
    seed = r.value<uint64_t>("seed");
    stream = r.value<uint64_t>("stream");
    n_train_queries = r.value<int64_t>("n_train_queries");
    entry_point = r.value<int64_t>("entry_point");
    n_hubs = r.value<int64_t>("n_hubs");
    hubs = r.vector<int32_t>("RoarGraph hubs");
    n_anchors = r.value<int64_t>("n_anchors");
    n_prompt = r.value<int64_t>("n_prompt");
    anchor_queries = r.vector<float>("RoarGraph anchor queries");
    anchor_thresholds = r.vector<float>("RoarGraph anchor thresholds");
    anchor_pivots = r.vector<int32_t>("RoarGraph anchor pivots");
    if (version >= 2) {
        recent_queries = r.value<int64_t>("recent_queries");
        seed_anchors = r.value<int32_t>("seed_anchors");
        anchor_lists = r.vector<int32_t>("RoarGraph anchor lists");
    } else {
        // built before: a uniform sample, searches without seeds
        recent_queries = 0;
        seed_anchors = 0;
        anchor_lists.clear();
    }
    walk_bits = version >= 3 ? r.value<int32_t>("walk_bits") : 0;
    check_knobs("read_index");
    storage = KVStorage(d, d_value, kv_type);
    storage.read(r, "RoarGraph storage");
    degrees = r.vector<uint16_t>("RoarGraph degrees");
    neighbors = r.vector<int32_t>("RoarGraph edges");
    walk_codes.clear();
    if (walk_bits == 8) {
        walk_codes.read(r, storage, "RoarGraph key code ranges");
    }
    if (version >= 4) {
        decode_anchors = r.value<int32_t>("decode_anchors");
        learn_efSearch = r.value<int32_t>("learn_efSearch");
        n_learned = r.value<int64_t>("n_learned");
    } else {
        IndexRoarGraph defaults;
        decode_anchors = defaults.decode_anchors;
        learn_efSearch = defaults.learn_efSearch;
        n_learned = 0;
    }
    // older records learn as they did: by the beam alone
    learn_scan_keys = version >= 5 ? r.value<int64_t>("learn_scan_keys") : 0;
    if (version >= 6) {
        keys_per_seed_list = r.value<int64_t>("keys_per_seed_list");
        anchors_per_group = r.value<int64_t>("anchors_per_group");
        max_expansions = r.value<int32_t>("max_expansions");
    } else { // the search older records had
        IndexRoarGraph defaults;
        keys_per_seed_list = defaults.keys_per_seed_list;
        anchors_per_group = defaults.anchors_per_group;
        max_expansions = defaults.max_expansions;
    }
    check_knobs("read_index");
    check_graph(); // before the edges are followed
    count_in_degrees();
    index_anchors();
}

void IndexRoarGraph::check_graph() const {
    idx_t n = ntotal;
    int R = max_degree();
    FAISS_THROW_IF_NOT_FMT(
            M >= 2 && M <= kMaxM && storage.size() == n && degrees.size() == size_t(n) &&
                    neighbors.size() == size_t(n) * R &&
                    (n == 0 ? entry_point == -1 : entry_point >= 0 && entry_point < n),
            "IndexRoarGraph: %zd tokens, %zd rows, %zd edges (2M = %d), entry %zd disagree "
            "with ntotal=%zd",
            size_t(storage.size()),
            degrees.size(),
            neighbors.size(),
            R,
            size_t(entry_point),
            size_t(n));
    FAISS_THROW_IF_NOT_FMT(
            hubs.size() <= size_t(n) && std::is_sorted(hubs.begin(), hubs.end()) &&
                    std::adjacent_find(hubs.begin(), hubs.end()) == hubs.end() &&
                    std::all_of(hubs.begin(), hubs.end(),
                                [n](int32_t h) { return h >= 0 && h < n; }),
            "IndexRoarGraph: %zd hubs, not distinct ids in [0, ntotal=%zd)",
            hubs.size(),
            size_t(n));
    size_t na = anchor_pivots.size();
    FAISS_THROW_IF_NOT_FMT(
            n_prompt >= 0 && n_prompt <= n && anchor_queries.size() == na * size_t(d) &&
                    anchor_thresholds.size() == na &&
                    std::all_of(anchor_pivots.begin(), anchor_pivots.end(),
                                [n](int32_t p) { return p >= 0 && p < n; }),
            "IndexRoarGraph: %zd anchors (%zd query floats, %zd thresholds, d=%d) or "
            "n_prompt=%zd disagree with ntotal=%zd",
            na,
            anchor_queries.size(),
            anchor_thresholds.size(),
            d,
            size_t(n_prompt),
            size_t(n));
    FAISS_THROW_IF_NOT_FMT(
            (anchor_lists.empty() || (na > 0 && anchor_lists.size() % na == 0)) &&
                    std::all_of(anchor_lists.begin(), anchor_lists.end(),
                                [n](int32_t id) { return id >= -1 && id < n; }),
            "IndexRoarGraph: %zd anchor list entries are not a list per anchor (%zd), or hold "
            "an id outside [-1, ntotal=%zd)",
            anchor_lists.size(),
            na,
            size_t(n));
    FAISS_THROW_IF_NOT_FMT(
            decode_anchors >= 0 && decode_anchors <= 1000000 && learn_efSearch >= 0 &&
                    learn_scan_keys >= 0 && n_learned >= 0 &&
                    learned_anchors() <= na && (learned_anchors() == 0 || !anchor_lists.empty()),
            "IndexRoarGraph: %zd decode queries learned (ring of decode_anchors=%d, "
            "learn_efSearch=%d, learn_scan_keys=%zd) disagree with %zd anchors%s",
            size_t(n_learned),
            decode_anchors,
            learn_efSearch,
            size_t(learn_scan_keys),
            na,
            anchor_lists.empty() ? " without lists" : "");
    check_finite(anchor_queries.data(), idx_t(na), size_t(d), "IndexRoarGraph: anchor queries");
    check_finite(anchor_thresholds.data(), idx_t(na), 1, "IndexRoarGraph: anchor thresholds");
    for (idx_t i = 0; i < n; i++) {
        const int32_t* row = neighbors_of(i);
        FAISS_THROW_IF_NOT_FMT(
                degrees[i] <= R, "IndexRoarGraph: key %zd has degree %d > 2M = %d",
                size_t(i), int(degrees[i]), R);
        for (int j = 0; j < R; j++) {
            bool ok = j < degrees[i] ? row[j] >= 0 && row[j] < n && row[j] != i : row[j] == -1;
            FAISS_THROW_IF_NOT_FMT(
                    ok, "IndexRoarGraph: edge %d of key %zd is %d (ntotal %zd, degree %d)", j,
                    size_t(i), row[j], size_t(n), int(degrees[i]));
        }
    }
}

void IndexRoarGraph::check_knobs(const char* what) const {
    FAISS_THROW_IF_NOT_FMT(
            M >= 2 && M <= kMaxM && Nq >= 1 && build_L >= 1 && max_train_queries >= 1 &&
                    efSearch >= 1 && n_train_queries >= 0 && n_hubs >= -1 && n_anchors >= 0 &&
                    recent_queries >= 0 && seed_anchors >= 0 && (walk_bits == 0 || walk_bits == 8) &&
                    keys_per_seed_list >= 0 && anchors_per_group >= 0 && max_expansions >= -1,
            "%s: invalid RoarGraph parameters M=%d Nq=%d build_L=%d efSearch=%d "
            "recent_queries=%zd seed_anchors=%d walk_bits=%d keys_per_seed_list=%zd "
            "anchors_per_group=%zd max_expansions=%d",
            what,
            M,
            Nq,
            build_L,
            efSearch,
            ssize_t(recent_queries),
            seed_anchors,
            walk_bits,
            ssize_t(keys_per_seed_list),
            ssize_t(anchors_per_group),
            max_expansions);
}

void IndexRoarGraph::check_invariants() const {
    KVIndex::check_invariants();
    check_knobs("IndexRoarGraph");
    check_seed_knob(seed, "IndexRoarGraph");
    FAISS_THROW_IF_NOT_FMT(
            storage.d == size_t(d) && storage.d_value == size_t(d_value) &&
                    storage.type == kv_type,
            "IndexRoarGraph: storage of d=%zd d_value=%zd disagrees with the index",
            storage.d,
            storage.d_value);
    check_graph();
    std::vector<uint32_t> counted(size_t(ntotal), 0);
    for (idx_t i = 0; i < ntotal; i++) {
        for (int j = 0; j < degrees[i]; j++) {
            counted[neighbors_of(i)[j]]++;
        }
    }
    FAISS_THROW_IF_NOT_MSG(
            counted == in_degrees, "IndexRoarGraph: in-degrees disagree with the edges");
    const KeyCodes8& wc = walk_codes;
    FAISS_THROW_IF_NOT_FMT(
            walk_bits == 0 ? wc.size() == 0 && wc.vmin.empty()
                           : walk_bits == 8 && wc.size() == size_t(ntotal) &&
                            wc.vmin.size() == size_t(d) && wc.step.size() == size_t(d) &&
                            wc.n_trained <= size_t(ntotal),
            "IndexRoarGraph: %zd key codes for %zd keys, ranges of %zd dimensions "
            "(walk_bits=%d, d=%d)",
            wc.size(),
            size_t(ntotal),
            wc.vmin.size(),
            walk_bits,
            d);
}

} // namespace kvindex
