#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <kvindex/KVIndex.h>
#include <kvindex/impl/huge_pages.h>
#include <kvindex/kv_type.h>

namespace kvindex {

/** Keys and values of a run of tokens, row-major, as the indexes own them,
 * stored in one KVType (float32, bfloat16 or fp16): append converts from
 * float (rounding to nearest even, refusing values the type cannot hold),
 * the kernels read the rows in their type (key_rows, value_rows), and
 * key / value give floats back. */
struct KVStorage {
    size_t d = 0;                   ///< key dimension
    size_t d_value = 0;             ///< value dimension
    KVType type = KVType::f32;      ///< element type of keys and values
    RowBytes keys;                  ///< size() * d elements of `type` (huge pages when large)
    RowBytes values;                ///< size() * d_value elements of `type`

    KVStorage() = default;
    KVStorage(size_t d, size_t d_value, KVType type = KVType::f32)
            : d(d), d_value(d_value), type(type) {}

    idx_t size() const {
        return d == 0 ? 0 : idx_t(keys.size() / key_bytes());
    }
    /// Bytes of one stored key / value.
    size_t key_bytes() const {
        return d * kv_type_size(type);
    }
    size_t value_bytes() const {
        return d_value * kv_type_size(type);
    }
    /// The stored rows, for the kernels (kernels.h); finite, as append and
    /// read make them.
    KVRows key_rows() const {
        return finite_rows(KVRows(keys.data(), d, type));
    }
    KVRows value_rows() const {
        return finite_rows(KVRows(values.data(), d_value, type));
    }
    /// Key / value of token i as floats (exact: the stored value widened).
    /// Every method below throws on tokens outside [0, size()) or n < 0.
    void key(idx_t i, float* out) const;
    void value(idx_t i, float* out) const;
    /** Appends n tokens given as floats, converted to `type`; throws naming
     * the first value the type cannot hold, and then adds nothing. */
    void append(idx_t n, const float* k, const float* v);
    /** Room for `rows` tokens in all (as append grows, by at least a
     * quarter): appends up to that many then allocate nothing, so that a
     * caller can allocate before a step that must not fail part-way. */
    void reserve(idx_t rows);
    /** Overwrites tokens [i0, i0 + n) with n tokens given as floats
     * (converted as append does); throws naming the first value the type
     * cannot hold, and then changes nothing. */
    void assign(idx_t i0, idx_t n, const float* k, const float* v);
    /// Appends tokens [i0, i0 + n) of `other` (same d, d_value and type) as stored.
    void append_from(const KVStorage& other, idx_t i0, idx_t n);
    /// The keys and values of tokens [i0, i0 + n) as floats (sizes n * d, n * d_value).
    void to_float(idx_t i0, idx_t n, std::vector<float>* k, std::vector<float>* v) const;
    /// Drops the first n tokens (the oldest); the others move down.
    void erase_front(idx_t n);
    /// Keeps the first n tokens.
    void truncate(idx_t n);
    void clear();
    size_t memory_bytes() const;

    /** io: the keys, then the values, each as a u64 element count and the
     * elements in `type` (float32 storage: BufferWriter::vector<float>).
     * The type itself is the index's (KVIndex::kv_type), written with the
     * KVIndex fields. */
    void write(BufferWriter& w) const;
    /** Reads what write wrote, for tokens of dimensions d and d_value and
     * type `type` (set them first); refuses partial tokens and the values
     * add_kv refuses (non-finite, |x| > kMaxInputMagnitude), naming `what`. */
    void read(BufferReader& r, const char* what);

   private:
    static KVRows finite_rows(KVRows r) {
        r.finite = true;
        return r;
    }
    /// Throws unless [i0, i0 + n) is a range of stored tokens.
    void check_range(idx_t i0, idx_t n, const char* what) const;
};

/** For an index that can read its tokens from a parent's copy
 * (KVIndex::share_tokens): checks that `shared` holds the index's ntotal
 * tokens with the dimensions and type of `own`, and, unless `own` is
 * already empty, the same bytes; then empties `own`. Throws naming `who`. */
void drop_for_shared(KVStorage& own, const KVStorage& shared, idx_t ntotal, const char* who);

/** add_kv of n tokens for such an index holding ntotal: appends them to
 * `own`, or, with `shared` tokens, checks that their owner has appended
 * them already (they hold ntotal + n). Throws naming `who`. */
void append_or_check_shared(
        KVStorage& own,
        const KVStorage* shared,
        idx_t ntotal,
        idx_t n,
        const float* keys,
        const float* values,
        const char* who);

} // namespace kvindex
