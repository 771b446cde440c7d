#pragma once

#include <cstddef>
#include <vector>

#include <kvindex/KVIndex.h>

namespace kvindex {

/// Keys and values of a run of tokens, row-major, as the indexes own them.
struct KVStorage {
    size_t d = 0;              ///< key dimension
    size_t d_value = 0;        ///< value dimension
    std::vector<float> keys;   ///< size size() * d
    std::vector<float> values; ///< size size() * d_value

    KVStorage() = default;
    KVStorage(size_t d, size_t d_value) : d(d), d_value(d_value) {}

    idx_t size() const {
        return d == 0 ? 0 : idx_t(keys.size() / d);
    }
    const float* key(idx_t i) const {
        return keys.data() + i * d;
    }
    const float* value(idx_t i) const {
        return values.data() + i * d_value;
    }
    void append(idx_t n, const float* k, const float* v);
    /// Drops the first n tokens (the oldest); the others move down.
    void erase_front(idx_t n);
    void clear();
    size_t memory_bytes() const;

    /// io: the keys, then the values (BufferWriter::vector).
    void write(BufferWriter& w) const;
    /** Reads what write wrote, for tokens of dimensions d and d_value (set
     * them first); refuses partial tokens and non-finite values, naming
     * `what`. */
    void read(BufferReader& r, const char* what);
};

} // namespace kvindex
