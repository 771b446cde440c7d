#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include <kvindex/KVIndex.h>
#include <kvindex/KVStorage.h>
#include <kvindex/KeyCodes8.h>

namespace kvindex {

struct FactoryChain;

/** Exact top-n_neighbors keys by inner product of each of n_queries
 * queries, by blocked matrix products (BLAS) and a running selection, in
 * parallel over blocks of queries.
 *
 * @param keys         size n_keys * d
 * @param queries      size n_queries * d
 * @param n_neighbors  > 0; rows have min(n_neighbors, n_keys) entries
 * @param out          output, size n_queries * n_neighbors: ids, best
 *                     first (ties to the smaller id), -1 padded
 */
void exact_topk_blocked(
        const float* keys,
        idx_t n_keys,
        int d,
        const float* queries,
        idx_t n_queries,
        int n_neighbors,
        idx_t* out);

/** The anchors (training queries an IndexRoarGraph keeps) grouped by
 * k-means under L2, so that a search finds its nearest anchors scoring the
 * group centroids and the members of the nearest groups instead of every
 * anchor. Derived from the anchors (built at prefill and at read, never
 * written), deterministic: Lloyd iterations from evenly spread anchors,
 * sequential, ending with an assignment, so that every anchor is in the
 * group of its nearest centroid (ties to the lower group). */
struct AnchorGroups {
    size_t d = 0;
    std::vector<float> centroids;  ///< size n_groups * d
    std::vector<float> sq_norms;   ///< size n_groups: |centroid|^2
    /// size n_groups + 1: members[offsets[g], offsets[g + 1]) are group g
    std::vector<size_t> offsets;
    std::vector<int64_t> members;  ///< size n_anchor: the anchor ids, by group

    size_t n_groups() const {
        return sq_norms.size();
    }
    /** out[g] = |centroid_g|^2 - 2 <q, centroid_g>: the L2 to q up to
     * |q|^2, the one measure of both the grouping and the searches (so an
     * anchor's own group is the nearest to it). out: size n_groups. */
    void l2_to_centroids(const float* q, float* out) const;
    /** Groups the na anchors (size na * d) into min(n_groups, na) groups;
     * n_groups = 0 or na = 0 leaves none. */
    void build(const float* anchors, size_t na, size_t d, size_t n_groups);
    void clear();
};

/** The attention-aware graph of RetrievalAttention ("RetrievalAttention:
 * Accelerating Long-Context LLM Inference via Vector Retrieval", arXiv
 * 2409.10516), built like RoarGraph (arXiv 2408.08933) from the queries
 * the prompt itself produced, so that out-of-distribution attention
 * queries find their top keys touching a small fraction of them.
 *
 * Build (prefill), per KV head, from the prefill queries of its GQA group:
 *  1. training queries: all of them, or, when there are more than
 *     max_train_queries (4096), the last recent_queries (1024; at most
 *     half of the budget) positions of every query head and a seeded
 *     sample of the others: decode queries resemble the latest prompt
 *     queries most (the question, the needle just read), and a uniform
 *     sample holds few of those. Their exact lists cost n_train * n * d
 *     multiply-adds; more of them sample the prompt's bulk more and its
 *     question less (RESULTS "RoarGraph's defaults");
 *  2. each one's exact top-Nq keys by inner product, over every key of the
 *     prompt (not causally: the graph serves decode queries, which see
 *     them all), by blocked matrix products (exact_topk_blocked);
 *  3. projection: pivot = the query's best key; the rest of its list are
 *     the pivot's candidates (the lists of all queries sharing a pivot are
 *     merged), ordered by closeness to the pivot and pruned by the
 *     occlusion rule (c is dropped when a kept r is closer to c than the
 *     pivot is), then filled back to M with the pruned ones; reverse edges
 *     are added and every list over M is pruned again the same way;
 *  4. connectivity: the keys the projection left with fewer than M/4
 *     out-edges (most keys are in no query's list) are searched for from
 *     the entry point (the key nearest the mean of the keys) with a beam of
 *     build_L, walking on 8-bit codes of the keys (walk_codes, or codes
 *     made for the build alone under walk_bits = 0: the graph does not
 *     depend on walk_bits), each beam then scored on the stored keys;
 *     the pruned result becomes their out-edges and they are
 *     added to each of those neighbours' rows that has room (degree <=
 *     2M); a key no row took goes to the closest reached key with room, or
 *     trades away an edge whose target has another in-edge. Keys the
 *     entry point still does not reach are linked again until it reaches
 *     every key. (Keeping each full row's 2M closest instead costs 2M
 *     inner products per refused edge, in the serial part of the build.)
 * Closeness between keys is their inner product, as between queries and
 * keys (as the official RoarGraph does for inner-product data; Euclidean
 * pruning and linking found fewer of the top keys at the same beam).
 * The links of a batch of keys are searched in parallel on the graph as it
 * was before the batch and applied in key order, so the graph depends on
 * the seed only, not on the thread count.
 *
 * Tokens added later (add_kv: decode steps, or a prompt without queries)
 * are linked by step 4, walking on the stored keys (the codes' ranges are
 * the prompt's, which an appended key may leave), each given an in-edge,
 * so they are reachable at once; a breadth-first check runs every 1024 tokens and after large adds.
 * Step 4 alone links a key by its inner products with keys, which is not
 * how queries find it; so prefill keeps n_anchors training queries
 * (anchors) with their pivot and the score of their Nq-th key, and an
 * appended key that would have entered an anchor's list is linked both
 * ways with that anchor's pivot too (the projection, done for one key),
 * so that the queries that would rank it find it (the DecodeAppends and
 * LearntDecodeQueries tests of test_roar_graph.cpp).
 *
 * The anchors' lists follow the appends: a key that enters an anchor's
 * list (its score at least the bar) is put in its place, the last one
 * leaves, and the bar and pivot become the new list's, so that a prompt
 * anchor's list stays the exact top-Nq of every key held (tested).
 *
 * Decode queries (add_queries, after their step was answered) are
 * learned: each one's beam search (learn_efSearch, wider than a search's:
 * these lists seed the next searches), or below learn_scan_keys keys an
 * exact scan shared by the call's queries, gives its list, best key and bar,
 * and it is kept as an anchor in a ring of the decode_anchors most recent
 * ones after the prompt's anchors. One learnt query costs about one search. Decode queries resemble the decode queries
 * just before them more than any prompt query, so a search is seeded by
 * the nearest of those too, and an appended key that enters a recent
 * query's list is linked with its pivot. Searches score the ring's most
 * recent anchors, at most one per 128 keys (kKeysPerSeedAnchor), beside
 * the prompt's.
 *
 * Search: best-first beam of max(efSearch, k) from the entry point, the
 * hubs (the keys in the most training lists, one per 256 prompt keys:
 * scored first, they start the beam near where attention usually goes)
 * and the seeds: the exact lists of the seed_anchors (32) anchors nearest
 * the query, at most one per keys_per_seed_list (4096) keys (L2 between queries, over a pool
 * of at most one anchor per 128 keys, spread over them; when the pool
 * would be larger than that, the anchors are grouped by k-means into
 * sqrt(n_anchors) groups and the search scores the centroids and the
 * members of the 4 nearest groups: about 2 sqrt(pool) vectors instead of
 * the whole pool). A query's top
 * keys are mostly in the lists of the prompt queries that resemble it,
 * which the projection has pruned to M per pivot; the seeds give them back
 * at the start. Scored by inner product; Selection::n_scanned counts, in
 * stored keys, the keys whose score was computed (hubs and seeds
 * included) and the bytes of the neighbour lists expanded, of the anchors
 * and group centroids scored and of the seed lists. The visited marks are epoch-stamped per thread, so
 * nothing is cleared between queries.
 *
 * walk_bits = 8 (the default): the walk scores 8-bit codes of the keys (KeyCodes8: one
 * range per dimension, a score within sum_j |q_j| step_j / 2 of the
 * exact one) instead of the stored rows, and the whole beam is then
 * scored on the stored keys, which order the answer. The walk is where
 * the bytes go (it scores tens of keys for each one it keeps), and a
 * graph neighbour's code is one or two cache lines instead of eight; the
 * path is nearly the same (RESULTS.md, "RoarGraph", has the recall and the
 * bytes of both walks).
 * Selection::n_scanned then counts the codes as their share of a stored
 * key's bytes (keys_read). The codes cost d bytes per token, are derived
 * from the keys (at prefill, on append, when the knob is set) and only
 * their ranges are written. attend = exact
 * softmax over the k keys found (their scores are reused); compose with
 * the static part, as the paper does: "Sink128,Window512,RoarGraph32"
 * (640 static tokens).
 *
 * Per call: SearchParametersTopK (IndexTopK.h), whose efSearch is the
 * beam width of graph retrievers, HNSW's and this one's alike.
 * Factory string: "RoarGraph<M>". Knobs: k, efSearch, seed_anchors,
 * keys_per_seed_list, anchors_per_group, max_expansions,
 * walk_bits, decode_anchors, learn_efSearch, learn_scan_keys; prefill-time: M, Nq, build_L, max_train_queries,
 * recent_queries, n_hubs, n_anchors, seed. Record version 2 adds
 * recent_queries, seed_anchors and the anchors' lists; a version-1 record
 * reads with seed_anchors = 0 (no lists), searches as it did and learns
 * no decode queries. Version 3 adds walk_bits and, when it is 8, the
 * codes' ranges; older records read with walk_bits = 0. Version 4 adds
 * decode_anchors, learn_efSearch and n_learned (the learned anchors are among the
 * anchors); older records read with the default ring and none learned.
 * Version 5 adds learn_scan_keys; older records read with 0 (they learn
 * by the beam, as they did). Version 6 adds keys_per_seed_list,
 * anchors_per_group and max_expansions; older records read with their
 * defaults (4096, 0, -1: the search they had).
 *
 * Seeds and a short walk (long contexts): a walk that expands its whole
 * beam scores every neighbour of every key it returns, ~2.5% of the keys
 * at 128k for M = 32 (bench_recall --walk-floor). With every training
 * query kept as an anchor, the lists of the query's nearest anchors
 * already hold most of its top-k (RoarGraph's query-to-key bipartite
 * graph, read directly), so a few expansions from them finish the search
 * (n_anchors = max_train_queries, keys_per_seed_list = 0, max_expansions:
 * RESULTS.md, "Issue 14's point", has the string and its figures). The
 * defaults stay those of short contexts, where 64 lists of 100 would be
 * most of the keys.
 */
struct IndexRoarGraph : KVIndex {
    int M = 32;                      ///< out-degree of the projection; degree bound 2M
    /// exact neighbours per training query; a prompt of fewer keys lists
    /// them all (the build's lists are min(Nq, keys) wide)
    int Nq = 100;
    int build_L = 16;                ///< beam of the connectivity searches and inserts
    idx_t max_train_queries = 4096;  ///< training queries at most (seeded sample)
    int efSearch = 256;              ///< beam of the searches (at least k)
    uint64_t seed = 1234;            ///< with `stream`, seeds the query sample; <= 2^53 (a knob)
    uint64_t stream = 0;             ///< one stream per (layer, head): set by KVCache
    idx_t n_hubs = -1;               ///< hubs to keep at prefill; -1: one per 256 prompt keys
    idx_t n_anchors = 1024;          ///< training queries kept as anchors (appends, seeds)
    idx_t recent_queries = 1024;     ///< last positions of every query head always trained on
    int seed_anchors = 32;           ///< nearest anchors whose lists seed a search (0: none)
    /// at most one seed list per this many keys (0: no cap: seed_anchors
    /// lists at any context length)
    idx_t keys_per_seed_list = 4096;
    /// members of each probed anchor group scored at most, evenly spread
    /// over the group (0: all). k-means leaves a few groups large where
    /// the queries are alike (flat heads: ~900 of 32768 anchors each)
    idx_t anchors_per_group = 0;
    /// beam members a search expands at most (-1: until every member of
    /// the beam is expanded; 0: the answer is the best of the entry point,
    /// hubs and seeds). Searches only: the build, the appends and the
    /// learning of decode queries always expand their whole beam
    int max_expansions = -1;
    /// 0: the beam scores the stored keys; 8: it walks on 8-bit codes of
    /// the keys (walk_codes) and the whole beam is scored again on the
    /// stored keys before the best k are kept
    int walk_bits = 8;
    /// decode queries kept as anchors (add_queries), the most recent ones,
    /// in a ring after the prompt's anchors; 0: none are learned. Setting
    /// it drops those learned.
    int decode_anchors = 256;
    /// beam of the searches that learn decode queries; 0: twice efSearch
    /// (their lists seed every later search, so a wider beam than a
    /// search's pays back)
    int learn_efSearch = 0;
    /// while the index holds at most this many keys, a decode query's list
    /// is the exact top-Nq of a scan of the keys (scan_lists, one pass
    /// shared by the call's queries: a GQA group) instead of a beam search:
    /// the scan's cost grows with the keys, a beam's hardly, so the scan is
    /// the cheaper while they are few. 0: always the beam
    idx_t learn_scan_keys = 4096;
    /// decode queries learned since the prefill; the next one goes to ring
    /// slot n_learned % decode_anchors
    idx_t n_learned = 0;

    KVStorage storage;               ///< keys and values of all tokens
    std::vector<int32_t> neighbors;  ///< size ntotal * 2M: row i = out-edges of i, -1 padded
    std::vector<uint16_t> degrees;   ///< size ntotal: edges in use in each row
    /// size ntotal: edges into each key (counted from the edges, not written)
    std::vector<uint32_t> in_degrees;
    idx_t entry_point = -1;          ///< start of every search, -1 when empty
    /// size <= ntotal, ascending: extra entry points of every search (the
    /// keys in the most training lists), scored before the walk
    std::vector<int32_t> hubs;
    /// size n_anchor * d: training queries kept for linking decode-time keys,
    /// then the learned decode queries (n_anchor = prompt_anchors() +
    /// learned_anchors(); the same for the four arrays below)
    std::vector<float> anchor_queries;
    /// size n_anchor: the score of each anchor's Nq-th key (its list's bar)
    std::vector<float> anchor_thresholds;
    /// size n_anchor: each anchor's best key
    std::vector<int32_t> anchor_pivots;
    /// size n_anchor * Nq (Nq of the build), or empty: each anchor's exact
    /// list, best first, -1 padded (the seeds of the searches)
    std::vector<int32_t> anchor_lists;
    /// size n_anchor * Nq, as anchor_lists: the listed keys' scores, so that
    /// an appended key finds its place without scoring the list again
    /// (derived: scored at prefill and read, kept at learn and append; not
    /// written)
    std::vector<float> anchor_list_scores;
    /// size n_anchor: |anchor|^2 (counted from anchor_queries, not written)
    std::vector<float> anchor_sq_norms;
    /// the anchors by k-means group (derived from anchor_queries, not written)
    AnchorGroups anchor_groups;
    /// 8-bit codes of the keys when walk_bits = 8, else empty (derived
    /// from the keys; only their ranges are written)
    KeyCodes8 walk_codes;
    idx_t n_prompt = 0;              ///< keys the last prefill built from; later ones are appended
    idx_t n_train_queries = 0;       ///< training queries the last prefill used

    IndexRoarGraph(int d, int d_value, int M, KVType kv_type = KVType::f32);
    IndexRoarGraph();

    /// Largest out-degree: 2M.
    int max_degree() const {
        return 2 * M;
    }
    /// Out-edges of key i (degrees[i] ids).
    const int32_t* neighbors_of(idx_t i) const {
        return neighbors.data() + size_t(i) * max_degree();
    }

    /** Best-first beam search for the `k` keys of largest inner product
     * with q, beam max(beam, k), at most max_expansions (the knob) of its
     * members expanded. Returns the keys read (keys_read). distances /
     * labels: size k, best first, (lowest, -1) padded.
     */
    size_t beam_search(const float* q, idx_t k, int beam, float* distances, idx_t* labels) const {
        return beam_search(q, k, beam, distances, labels, expansion_limit());
    }
    /// The same, expanding at most max_expansions beam members (learning
    /// a decode query walks its whole beam: its list seeds later searches).
    size_t beam_search(const float* q, idx_t k, int beam, float* distances, idx_t* labels,
                       size_t max_expansions) const;

    /** Step 1: the rows of the prefill queries trained on (row h *
     * n_queries + p: query head h at position p), ascending: all of them,
     * or the last recent_queries positions of every head and a sample of
     * the others seeded by (seed, stream), max_train_queries in all. */
    std::vector<idx_t> training_sample(idx_t n_queries, int n_heads) const;
    /// Decode queries held as anchors: min(n_learned, decode_anchors).
    size_t learned_anchors() const;
    /// The prompt's anchors: the first ones of the anchor arrays.
    size_t prompt_anchors() const {
        return anchor_pivots.size() - learned_anchors();
    }
    /// Entries of an anchor's list: min(Nq, keys) of the build (Nq when there are no
    /// anchors yet; 0 for a version-1 record, which has no lists).
    size_t anchor_list_width() const;
    /** Anchors and group centroids a search for q scores to pick its
     * seeds (0: no seeding). */
    size_t anchors_scored(const float* q) const;
    /** Bytes the seeding of a search for q reads: those anchors and
     * centroids (float rows of d) and the seed lists taken.
     * Selection::n_scanned counts them with the keys (keys_read). */
    size_t seeding_bytes(const float* q) const;
    /// The lists of the seed_anchors anchors nearest q, in `seeds` (the
    /// keys a search starts from, repeats included); returns the anchors
    /// and centroids scored, and in *bytes what the seeding read
    /// (seeding_bytes).
    size_t anchor_seeds(const float* q, std::vector<int32_t>& seeds, size_t* bytes) const;
    /// Members of a probed anchor group of `size` a search scores
    /// (anchors_per_group; 0: all of them).
    size_t group_members_scored(size_t size) const {
        return anchors_per_group > 0 ? std::min(size, size_t(anchors_per_group)) : size;
    }
    /** Whether the searches pick their seeds through anchor_groups: when
     * scoring the centroids and the members of the groups probed costs
     * less than the flat pool of one anchor per 128 keys. */
    bool seeds_by_group() const;
    /** What a search reads, in stored keys (Selection::n_scanned): the
     * keys scored on their rows, plus `other_bytes` as their share of a
     * stored key's bytes, rounded up: the codes scored with walk_bits = 8
     * (d bytes each), the neighbour lists of the nodes expanded (degree
     * and ids) and the seeding (seeding_bytes). */
    size_t keys_read(size_t rows_scored, size_t other_bytes) const;
    /// Keys reachable from the entry point (breadth-first), for checks.
    idx_t count_reachable() const;

    size_t memory_bytes() const override;
    /// Bytes of the graph alone (edges and degrees), by capacity.
    size_t graph_bytes() const;

    const char* type_name() const override {
        return "IndexRoarGraph";
    }
    std::string factory_string() const override {
        return "RoarGraph" + std::to_string(M);
    }
    /// efSearch, its beam (SearchParametersTopK)
    bool reads_search_knob(const std::string& name) const override;
    std::vector<ParameterInfo> parameter_info() const override;
    bool set_parameter(const std::string& name, double value) override;
    bool get_parameter(const std::string& name, double* value) const override;
    void set_stream(uint64_t stream) override;
    idx_t top_k_budget() const override {
        return k;
    }
    void write_fields(BufferWriter& w) const override;
    void read_fields(BufferReader& r, uint32_t version) override;
    void check_invariants() const override;

    /// Registry parser: "RoarGraph<M>".
    static std::unique_ptr<KVIndex> from_factory(FactoryChain& chain);

    /// an append journals the older keys' rows and anchor lists before it
    /// changes them: a throw restores them, as undo_add_kv does
    bool can_undo_add() const override {
        return true;
    }
    bool appends_roll_back() const override {
        return true;
    }

   protected:
    void prefill_impl(const PrefillInput& input) override;
    void reset_impl() override;
    const KVStorage* token_storage() const override {
        return &storage;
    }
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    void undo_add_kv_impl(idx_t n) override;
    void forget_undo_impl() noexcept override;
    /// each query searched, then kept as an anchor (decode_anchors)
    void add_queries_impl(idx_t n, const float* queries) override;
    void search_one(
            const float* q,
            idx_t k,
            float* distances,
            idx_t* labels,
            const faiss::SearchParameters* params) const override;
    void select_one(const float* q, Selection& sel, const faiss::SearchParameters* params)
            const override;
    /// the beam's scores are reused: no second pass over the keys
    float attend_one(const float* q, float* out, const faiss::SearchParameters* params)
            const override;

   private:
    /** What an append that can be taken back (keeping_undo) changed in the
     * older keys, each saved before its first change: the edge rows of the
     * keys it relinked, the anchors whose lists it entered. */
    struct Undo {
        bool active = false;
        idx_t n0 = 0;                    ///< ntotal before the append
        std::unordered_set<idx_t> rows_saved;        ///< the keys of row_keys
        std::vector<int32_t> rows;       ///< max_degree() per saved row
        std::vector<uint16_t> degrees;   ///< per saved row
        std::vector<idx_t> row_keys;     ///< per saved row
        std::unordered_set<size_t> anchors_saved;    ///< the anchors of `anchors`
        std::vector<int32_t> lists;      ///< anchor_list_width() per saved anchor
        std::vector<float> scores;       ///< anchor_list_width() per saved anchor
        std::vector<float> thresholds;   ///< per saved anchor
        std::vector<int32_t> pivots;     ///< per saved anchor
        std::vector<size_t> anchors;     ///< per saved anchor
    };
    Undo undo;
    /// Saves key c's edge row before an append changes it (undo.active).
    void journal_row(idx_t c);
    /// Saves anchor a's list before an append changes it (undo.active).
    void journal_anchor(size_t a);
    /// Puts back every row and anchor list the journal saved.
    void restore_journal() noexcept;
    /// The beam for one call: max(params' or own efSearch, k).
    int beam_for(const faiss::SearchParameters* params, idx_t k) const;
    /// The expansions a search may make (max_expansions; -1: no limit).
    size_t expansion_limit() const {
        return max_expansions < 0 ? std::numeric_limits<size_t>::max() : size_t(max_expansions);
    }
    /// Appends keys and values, their norms and empty edge rows.
    void append_tokens(idx_t n, const float* keys, const float* values);
    /// Drops the tokens from n0 on and every edge to them (a failed add).
    void drop_tokens_from(idx_t n0);
    /// Step 3: the projected graph from the training queries' lists
    /// (size n_lists * width).
    void project(const std::vector<idx_t>& lists, idx_t n_lists, int width);
    /** Step 4 for `keys` (ascending), in batches: search, prune, link both ways.
     * growing: the keys are the graph's first ones (batches grow with the
     * keys already linked instead of starting at kLinkBatch). Returns
     * whether an edge was replaced (a full row had to take a key that got
     * no other in-edge), after which reachability must be checked.
     * codes: the searches walk on these codes of every key, their beams
     * then scored on the stored keys (nullptr: on the stored keys). */
    bool link_keys(const std::vector<idx_t>& keys, bool growing, const KeyCodes8* codes = nullptr);
    /// Links the keys the entry point does not reach, until none is left
    /// (codes: as link_keys').
    void repair_reachability(const KeyCodes8* codes = nullptr);
    /// Keys the entry point does not reach (breadth-first).
    std::vector<idx_t> unreachable_keys() const;
    /** The keys being linked (link_keys), asked "is key i one of them" by
     * add_edge: a mark per key when they are many (a repair after a
     * prefill can link tens of thousands: a binary search of them was most
     * of the serial part of the build), the sorted list searched when they
     * are few (an append links a few keys among up to millions). */
    struct LinkingSet {
        const std::vector<idx_t>& sorted; ///< the keys, ascending
        /// size the largest key + 1 when they are many, else empty
        std::vector<uint8_t> marks;
        explicit LinkingSet(const std::vector<idx_t>& keys);
        bool contains(idx_t i) const {
            return marks.empty() ? std::binary_search(sorted.begin(), sorted.end(), i)
                                 : size_t(i) < marks.size() && marks[i] != 0;
        }
    };
    /** Adds the edge c -> x if c's row has room, or, when `force`, in place
     * of c's least similar neighbour that has another in-edge and is not in
     * `keep` (the keys being linked, whose in-edges may be their only ones
     * from the reachable graph). Returns whether c now links to x. */
    bool add_edge(idx_t c, idx_t x, bool force, const LinkingSet& keep);
    /// Hubs from the training lists of a prompt of n keys.
    void choose_hubs(const std::vector<idx_t>& lists, idx_t n);
    /// Keeps n_anchors of the training queries, with their pivots and bars
    /// (lists: size n_lists * width).
    void choose_anchors(
            const std::vector<float>& train,
            const std::vector<idx_t>& lists,
            idx_t n_lists,
            int width);
    /** The pivots of the anchors whose exact lists key x would have
     * entered (score >= bar), best margin first, at most M. */
    std::vector<int32_t> anchor_pivots_of(const float* key, idx_t x) const;
    /** The exact lists of m queries (q: size m * d): the top width keys
     * of each (scores, ids: size m * width, best first, -1 padded), in one
     * pass over the keys, a block of them scored for every query while it
     * sits in cache. */
    void scan_lists(const float* q, idx_t m, size_t width, float* scores, idx_t* ids) const;
    /** Keeps decode query q as an anchor in the ring: its list (ids,
     * scores: size anchor_list_width(), best first, -1 padded, from its
     * search), pivot and bar. */
    void keep_decode_anchor(const float* q, const idx_t* ids, const float* scores);
    /** Puts the keys from n0 on into the lists of the anchors whose bar
     * they reach, in key order. Allocates before it changes anything. */
    void update_anchor_lists(idx_t n0);
    /// Learned anchors a search scores: the most recent, one per 128 keys.
    size_t recent_anchors_scored() const;
    /// The flat pool: anchors a search would score without groups.
    size_t anchor_pool() const;
    /// anchor_list_scores from the lists and the stored keys.
    void score_anchor_lists();
    /// <anchor a, key>, computed the same way on every path.
    float anchor_score(size_t a, idx_t key) const;
    /// The scores of anchor a's list (size anchor_list_width()), -inf padded.
    void list_scores_of(size_t a, const int32_t* list, float* scores) const;
    /// The anchor arrays sized for na anchors with lists of `width`.
    void resize_anchors(size_t na, size_t width);
    /// Room in the anchor arrays for na anchors with lists of `width`.
    void reserve_anchors(size_t na, size_t width);
    /// anchor_sq_norms and anchor_groups from anchor_queries.
    void index_anchors();
    /// walk_codes from the keys (walk_bits = 8), or none.
    void index_codes();
    /// Counts in_degrees from the edges.
    void count_in_degrees();
    /// Keys the projection left with fewer out-edges than this are linked
    /// by search at prefill.
    int link_degree() const {
        return std::max(1, M / 4);
    }
    /// Throws naming the first inconsistency of the edges (read, invariants).
    void check_graph() const;
    /// Throws (messages start with `what`) unless the knobs are in the
    /// ranges the reader accepts: read_fields and check_invariants.
    void check_knobs(const char* what) const;
};

} // namespace kvindex
