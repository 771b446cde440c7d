#pragma once

#include <algorithm>
#include <cstddef>

namespace kvindex {

/** Reserves room for `need` elements in an array that grows with the cache:
 * by 1/4 of its capacity rather than std::vector's doubling, because a KV
 * cache grows one token at a time and bytes per token is a figure we
 * report (a doubled array holds up to 2x what it uses). A bulk add (the
 * prompt) gets 1/16 of headroom on top: without it the first decoded
 * token reallocates and copies the whole prompt's array (kvllm e2e at 8k:
 * ~720 MB copied in the first decode step before this was done for the
 * token storage). Works for any std::vector-like `V`. */
template <class V>
void reserve_for_growth(V& v, size_t need) {
    if (need > v.capacity()) {
        v.reserve(std::max(need + need / 16, v.capacity() + v.capacity() / 4));
    }
}

/// resize() to `n` elements after reserve_for_growth(v, n).
template <class V, class... Fill>
void grow_to(V& v, size_t n, const Fill&... fill) {
    reserve_for_growth(v, n);
    v.resize(n, fill...);
}

/// Bytes an array holds: its capacity, not its size (what memory_bytes()
/// reports).
template <class V>
size_t capacity_bytes(const V& v) {
    return v.capacity() * sizeof(typename V::value_type);
}

} // namespace kvindex
