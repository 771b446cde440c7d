#pragma once

#include <cstddef>
#include <cstdint>

namespace kvindex {

/** Ascending ids as 16-bit gaps: each id minus the one before it, the
 * first minus -1, so that no gap is 0. A gap of 2^16 or more is a 0 word
 * followed by its low and high 16 bits. IndexLSHSample's buckets are kept
 * this way: half the bytes of 32-bit ids, and the long form is rare while
 * a bucket holds more than one token in 2^16 on average. */
struct GapCodedIds {
    const uint16_t* words;
    size_t len; ///< words, not ids: a long gap takes 3

    const uint16_t* data() const {
        return words;
    }

    /// f(id) for each id, ascending
    template <class F>
    void for_each(F&& f) const {
        uint32_t id = ~0u; // the first gap counts from -1
        for (size_t j = 0; j < len; j++) {
            uint32_t gap = words[j];
            if (__builtin_expect(gap == 0, 0)) {
                gap = uint32_t(words[j + 1]) | uint32_t(words[j + 2]) << 16;
                j += 2;
            }
            id += gap;
            f(id);
        }
    }
};

/// Appends id to gap-coded words whose last id is `last` (~0u before the
/// first; id > last, id < 2^32 - 1), and makes id the last.
template <class Words>
void append_gap(Words& out, uint32_t& last, uint32_t id) {
    uint32_t gap = id - last;
    if (gap < 65536) {
        out.push_back(uint16_t(gap));
    } else {
        out.push_back(0);
        out.push_back(uint16_t(gap));
        out.push_back(uint16_t(gap >> 16));
    }
    last = id;
}

} // namespace kvindex
