#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <kvindex/KVStorage.h>
#include <kvindex/impl/io.h>

namespace kvindex {

/** 8-bit codes of stored keys, one uniform range per dimension (Faiss's
 * QT_8bit scalar quantizer), for a search that walks on a quarter of
 * float32's bytes and rescores its best candidates on the stored rows
 * (IndexRoarGraph::walk_bits).
 *
 * Key x is coded c_j = round((x_j - vmin_j) / step_j), clamped to 0..255,
 * and read back as vmin_j + step_j c_j: within step_j / 2 of x_j for
 * every value inside the range (in exact arithmetic), so a score is
 * within sum_j |q_j| step_j / 2 of <q, x>, plus float rounding
 * (score_bound states both). The ranges are those of
 * the keys when they were last trained; the keys appended later are
 * clamped to them until the keys have doubled and the codes are trained
 * again (append). The codes are derived from the keys and never written;
 * the ranges are (write), so that a copy read back codes the keys, the
 * appended ones too, as the original did. */
struct KeyCodes8 {
    size_t d = 0;
    std::vector<float> vmin;     ///< size d: lowest value of each dimension
    std::vector<float> step;     ///< size d: (highest - lowest) / 255, 0 for a constant one
    std::vector<uint8_t> codes;  ///< size n * d: row i = the code of key i
    size_t n_trained = 0;        ///< keys the ranges were taken from

    size_t size() const {
        return d == 0 ? 0 : codes.size() / d;
    }
    const uint8_t* code(size_t i) const {
        return codes.data() + i * d;
    }
    /// Ranges from every key of `keys`, then the codes of all of them.
    void train(const KVStorage& keys);
    /** Codes of keys.size() - size() keys appended to `keys` (the codes
     * then cover them all); retrains first when the keys have doubled
     * since the ranges were taken. */
    void append(const KVStorage& keys);
    /// Keeps the codes of the first n keys (their ranges stay; n_trained
    /// is capped at n).
    void truncate(size_t n);
    void clear();

    /** The query's side of the scores: qs = q * step (size d), returned
     * <q, vmin>; then score(i) = <q, vmin> + <qs, c_i>. */
    float prepare(const float* q, float* qs) const;
    /// out[i] = the score of key ids[i] from its code (size n each).
    void scores(const float* qs, float base, const int64_t* ids, size_t n, float* out) const;
    /** The largest |score - <q, x>| for a key in range: sum_j |q_j| step_j
     * / 2, plus the float rounding of coding and scoring, (d + 8) 2^-23
     * sum_j |q_j| (|vmin_j| + 255 step_j). */
    float score_bound(const float* q) const;
    size_t memory_bytes() const;

    /** io: the ranges and n_trained (the codes follow from them and the
     * keys). read sets them, refusing ranges of another dimension than
     * the keys', non-finite or negative steps, or n_trained beyond the
     * keys, naming `what`, then codes every key of `keys`. */
    void write(BufferWriter& w) const;
    void read(BufferReader& r, const KVStorage& keys, const char* what);

   private:
    void encode(const KVStorage& keys, size_t i0);
};

} // namespace kvindex
