// Top-k by inner product with the selection fused into the scan (a template
// on the stored type T, as the kernels of kernels_body.h); part of
// kernels_body.h (same namespace, same helpers), compiled once per
// instruction set.
//
// Why fused: an exact top-k must read every key once, so it is bound by the
// read bandwidth only if nothing else touches memory. Scores of a block of
// rows stay in L1, are compared with the current k-th best there, and only
// the few that beat it enter the selection (a heap, or for a long scan with
// a large k a buffer cut to its best k: Reservoir); no n-sized score array
// is written and read back.

namespace {

/// (sa, ia) ranks below (sb, ib): a lower score, or an equal score and a
/// larger id (ties go to the smaller id, as in the reference).
inline bool ranks_below(float sa, int64_t ia, float sb, int64_t ib) {
    return sa < sb || (sa == sb && ia > ib);
}

/// Min-heap by ranks_below (the root is the worst kept): adds (s, id) to a
/// heap of `size` entries.
inline void heap_push(float* hs, int64_t* hi, size_t size, float s, int64_t id) {
    size_t i = size;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!ranks_below(s, id, hs[parent], hi[parent])) {
            break;
        }
        hs[i] = hs[parent];
        hi[i] = hi[parent];
        i = parent;
    }
    hs[i] = s;
    hi[i] = id;
}

/// Puts (s, id) at slot i of a heap of `size` entries and sifts it down.
inline void heap_sift_down(float* hs, int64_t* hi, size_t size, size_t i, float s, int64_t id) {
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= size) {
            break;
        }
        if (c + 1 < size && ranks_below(hs[c + 1], hi[c + 1], hs[c], hi[c])) {
            c++;
        }
        if (!ranks_below(hs[c], hi[c], s, id)) {
            break;
        }
        hs[i] = hs[c];
        hi[i] = hi[c];
        i = c;
    }
    hs[i] = s;
    hi[i] = id;
}

/// Replaces the root of a full heap by (s, id), which ranks above it.
inline void heap_replace_root(float* hs, int64_t* hi, size_t size, float s, int64_t id) {
    heap_sift_down(hs, hi, size, 0, s, id);
}

struct Scored {
    float s;
    int64_t id;
};

/// Rows ranked by their (score, id), best first.
inline bool scored_ranks_above(const Scored& a, const Scored& b) {
    return ranks_below(b.s, b.id, a.s, a.id);
}

/// size candidates into a heap of heap_push's order (the worst at the root).
inline void scored_to_heap(const Scored* c, size_t size, float* hs, int64_t* hi, size_t* heap_size) {
    for (size_t i = 0; i < size; i++) {
        hs[i] = c[i].s;
        hi[i] = c[i].id;
    }
    for (size_t i = size / 2; i-- > 0;) { // Floyd
        heap_sift_down(hs, hi, size, i, hs[i], hi[i]);
    }
    *heap_size = size;
}

/** The best k of a long scan without a heap: a candidate that ranks above
 * the threshold is appended to a buffer of 2k; a full buffer is cut to its
 * best k (nth_element) and the threshold raised to the k-th. A cut costs
 * O(k) and frees k slots, so a candidate costs O(1), where a heap pays an
 * O(log k) sift for each. That sift dominates when many candidates enter:
 * a large k, or scores that rise along the scan, as a decode query's
 * attention to recent tokens does (real trace, 7.7k keys, k = 1000: 210 us
 * scanning in order against 112 us shuffled). */
struct Reservoir {
    std::vector<Scored>& buf; ///< capacity 2k (thread-local scratch)
    size_t k;
    size_t size = 0;
    /// the k-th best after a cut; before the first, below every finite score
    Scored threshold{std::numeric_limits<float>::lowest(), std::numeric_limits<int64_t>::max()};

    Reservoir(std::vector<Scored>& buf, size_t k) : buf(buf), k(k) {
        buf.resize(2 * k);
    }
    bool admits(float s, int64_t id) const {
        return ranks_below(threshold.s, threshold.id, s, id);
    }
    void add(float s, int64_t id) {
        buf[size++] = {s, id};
        if (size == buf.size()) {
            cut();
        }
    }
    void cut() {
        std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.begin() + size, scored_ranks_above);
        size = k;
        threshold = buf[k - 1];
    }
    /// The best k (or all, if fewer) into a heap of heap_push's order.
    void to_heap(float* hs, int64_t* hi, size_t* heap_size) {
        if (size > k) {
            cut();
        }
        scored_to_heap(buf.data(), size, hs, hi, heap_size);
    }
};

/// Below this k a heap's sift is cheap; a call scanning fewer than
/// kReservoirScanPerK * k rows keeps the heap. So does a call that
/// continues a selection (an IVF list, a block of keys): its heap is warm,
/// and moving it into a buffer and back would cost O(k) a call.
constexpr size_t kReservoirMinK = 32;
constexpr size_t kReservoirScanPerK = 4;

/** A scan of at most kBufferMaxRows rows selects from a buffer of every
 * score (topk_from_scores) instead of a reservoir: the buffer stays in L2,
 * and a reservoir is cut again and again when scores rise along the scan,
 * as a decode query's attention to recent tokens does (BM_TopKSelect, d =
 * 64, rising scores: 8192 rows, k = 410, 62 against 37 us; 65536 rows,
 * k = 1024, 1150 against 290 us; with scores in random order it is faster
 * too, but for 65536 rows and k = 32: level to 9% slower). */
constexpr size_t kBufferMaxRows = 65536;

inline bool any_lane(vi mask) {
    vi zero = {};
    return std::memcmp(&mask, &zero, sizeof(mask)) != 0;
}

/// Rows scored per block: a block's scores stay in L1.
constexpr size_t kScoreBlock = 256;

/// Unscaled scores of rows [i0, i0 + nb) of x into s: the one scoring of
/// both selections, so that they rank the same scores, bit for bit.
template <class T>
inline void score_block(const float* q, const T* x, size_t d, size_t i0, size_t nb, float* s) {
    const T* xb = x + i0 * d;
    inner_products_rows<true>(q, d, nb, 1.0f, s, [=](size_t i) { return xb + i * d; });
}

/** Scores the n rows of x block by block (the block's scores stay in L1)
 * and calls offer(score, id) for each row scoring at least bar(), the
 * selection's entry score (equal: it may win the tie on its id): a vector
 * test first, since once the selection is warm almost no lane passes. */
template <class T, class Bar, class Offer>
void offer_rows(
        const float* q,
        const T* x,
        size_t d,
        size_t n,
        const int64_t* ids,
        int64_t id0,
        Bar&& bar,
        Offer&& offer) {
    alignas(64) float s[kScoreBlock];
    for (size_t i0 = 0; i0 < n; i0 += kScoreBlock) {
        size_t nb = n - i0 < kScoreBlock ? n - i0 : kScoreBlock;
        score_block(q, x, d, i0, nb, s);
        auto one = [&](size_t r) { offer(s[r], ids ? ids[i0 + r] : id0 + int64_t(i0 + r)); };
        size_t i = 0;
        for (; i + W <= nb; i += W) {
            if (any_lane(load(s + i) >= splat(bar()))) {
                for (size_t r = i; r < i + W; r++) {
                    one(r);
                }
            }
        }
        for (; i < nb; i++) {
            one(i);
        }
    }
}

/** The best k of n >= k rows, ranked by (score, id), into an empty heap:
 * every score into a buffer, a threshold from a strided sample of them set
 * a margin below the sample's estimate of the k-th (so that at least k
 * rows pass it, the best k among them: otherwise every row passes), the
 * rows at or above it collected, and their best k kept (nth_element). */
template <class T>
void topk_from_scores(
        const float* q,
        const T* x,
        size_t d,
        size_t n,
        const int64_t* ids,
        int64_t id0,
        size_t k,
        float* hs,
        int64_t* hi,
        size_t* heap_size) {
    thread_local std::vector<float> scores, sample;
    thread_local std::vector<Scored> cand;
    scores.resize(n);
    for (size_t i0 = 0; i0 < n; i0 += kScoreBlock) {
        score_block(q, x, d, i0, n - i0 < kScoreBlock ? n - i0 : kScoreBlock, scores.data() + i0);
    }
    const size_t stride = n / 512 > 1 ? n / 512 : 1;
    sample.clear();
    for (size_t i = 0; i < n; i += stride) {
        sample.push_back(scores[i]);
    }
    // the sample's expected count above the k-th, plus 4 standard deviations
    const double m = double(sample.size()) * double(k) / double(n);
    const size_t r = std::min(sample.size() - 1, size_t(m + 4 * std::sqrt(m) + 4));
    std::nth_element(sample.begin(), sample.begin() + r, sample.end(), std::greater<float>());
    float threshold = sample[r];
    auto id_of = [&](size_t i) { return ids ? ids[i] : id0 + int64_t(i); };
    cand.resize(n);
    size_t c = 0;
    for (int pass = 0; pass < 2 && c < k; pass++) {
        c = 0;
        for (size_t i = 0; i < n; i++) { // branch-free: written always, kept when it passes
            cand[c] = {scores[i], id_of(i)};
            c += scores[i] >= threshold;
        }
        threshold = std::numeric_limits<float>::lowest(); // the sample missed: every row
    }
    std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.begin() + c, scored_ranks_above);
    scored_to_heap(cand.data(), k, hs, hi, heap_size);
}

template <class T>
void topk_inner_products_t(
        const float* q,
        const void* xv,
        size_t d,
        size_t n,
        const int64_t* ids,
        int64_t id0,
        size_t k,
        float* heap_scores,
        int64_t* heap_ids,
        size_t* heap_size) {
    if (k == 0) {
        return;
    }
    const T* x = static_cast<const T*>(xv);
    float* hs = heap_scores;
    int64_t* hi = heap_ids;
    size_t size = *heap_size;
    if (size == 0 && k >= kReservoirMinK && n >= kReservoirScanPerK * k && n <= kBufferMaxRows) {
        topk_from_scores(q, x, d, n, ids, id0, k, hs, hi, heap_size);
        return;
    }
    if (size == 0 && k >= kReservoirMinK && n >= kReservoirScanPerK * k) {
        thread_local std::vector<Scored> scratch;
        Reservoir res(scratch, k);
        offer_rows(
                q, x, d, n, ids, id0, [&] { return res.threshold.s; },
                [&](float sc, int64_t id) {
                    if (res.admits(sc, id)) {
                        res.add(sc, id);
                    }
                });
        res.to_heap(hs, hi, heap_size);
        return;
    }
    offer_rows(
            q, x, d, n, ids, id0,
            [&] { return size < k ? std::numeric_limits<float>::lowest() : hs[0]; },
            [&](float sc, int64_t id) {
                if (size < k) {
                    heap_push(hs, hi, size++, sc, id);
                } else if (ranks_below(hs[0], hi[0], sc, id)) {
                    heap_replace_root(hs, hi, size, sc, id);
                }
            });
    *heap_size = size;
}

} // namespace
