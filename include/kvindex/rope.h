#pragma once

#include <cstdint>
#include <string>

namespace kvindex {

/// How rotary position embedding pairs the coordinates of a head.
enum class RopeStyle {
    half,        ///< pairs (i, i + d/2): Llama / GPT-NeoX as in HF transformers
    interleaved, ///< pairs (2i, 2i + 1): the original RoFormer / GPT-J layout
};

const char* rope_style_name(RopeStyle style);
/// Parses "half" or "interleaved"; throws naming the string otherwise.
RopeStyle rope_style_from_name(const std::string& name);

/// The RoPE parameters of a model. Queries and keys handed to kvindex are
/// post-RoPE; indexes that work in de-rotated space (SAAP) undo it with these.
struct RopeParams {
    double theta = 10000.0;              ///< base of the frequencies, > 0
    RopeStyle style = RopeStyle::half;   ///< coordinate pairing

    bool operator==(const RopeParams& o) const {
        return theta == o.theta && style == o.style;
    }
    bool operator!=(const RopeParams& o) const {
        return !(*this == o);
    }
};

/// Throws unless theta is finite and > 0 and d is even and > 0.
void check_rope_params(const RopeParams& rope, int d);

/** Rotates n vectors in place: x[i] by the angles of position pos[i].
 *
 * Pair j (0 <= j < d/2) turns by pos * theta^(-2j/d); angles are computed in
 * double so that positions up to millions keep full float accuracy.
 *
 * @param x    vectors, size n * d
 * @param pos  positions, size n, each >= 0
 */
void apply_rope(int64_t n, int d, float* x, const int64_t* pos, const RopeParams& rope);

/// Undoes apply_rope: invert_rope(apply_rope(x, p), p) = x up to rounding.
void invert_rope(int64_t n, int d, float* x, const int64_t* pos, const RopeParams& rope);

} // namespace kvindex
