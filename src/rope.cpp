#include <kvindex/rope.h>

#include <cmath>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/errors.h>

namespace kvindex {

const char* rope_style_name(RopeStyle style) {
    return style == RopeStyle::half ? "half" : "interleaved";
}

RopeStyle rope_style_from_name(const std::string& name) {
    if (name == "half") {
        return RopeStyle::half;
    }
    if (name == "interleaved") {
        return RopeStyle::interleaved;
    }
    KVINDEX_THROW_FMT(
            InvalidArgument,
            "unknown RoPE style '%s' (expected 'half' or 'interleaved')", name.c_str());
}

void check_rope_params(const RopeParams& rope, int d) {
    KVINDEX_CHECK_ARG(
            std::isfinite(rope.theta) && rope.theta > 0,
            "RoPE theta=%g must be finite and > 0",
            rope.theta);
    KVINDEX_CHECK_ARG(
            d > 0 && d % 2 == 0, "RoPE needs an even head dimension, got d=%d", d);
    KVINDEX_CHECK_ARG(
            rope.style == RopeStyle::half || rope.style == RopeStyle::interleaved,
            "RoPE style %d is not half or interleaved",
            int(rope.style));
}

namespace {

/// Rotates every pair of x by sign * the angle of position pos.
void rotate(int64_t n, int d, float* x, const int64_t* pos, const RopeParams& rope, double sign) {
    check_rope_params(rope, d);
    KVINDEX_CHECK_ARG(n >= 0, "RoPE: n=%zd must be >= 0", size_t(n));
    if (n > 0) {
        KVINDEX_CHECK_ARG(x && pos, "%s", "RoPE: vectors or positions missing (nullptr)");
    }
    // every position first: a refused call leaves x as it was
    for (int64_t i = 0; i < n; i++) {
        KVINDEX_CHECK_ARG(
                pos[i] >= 0, "RoPE: position %zd at row %zd must be >= 0",
                size_t(pos[i]), size_t(i));
    }
    int half = d / 2;
    for (int64_t i = 0; i < n; i++) {
        float* v = x + i * d;
        for (int j = 0; j < half; j++) {
            double freq = std::pow(rope.theta, -2.0 * j / d);
            double angle = sign * double(pos[i]) * freq;
            double c = std::cos(angle), s = std::sin(angle);
            int a = rope.style == RopeStyle::half ? j : 2 * j;
            int b = rope.style == RopeStyle::half ? j + half : 2 * j + 1;
            double xa = v[a], xb = v[b];
            v[a] = float(xa * c - xb * s);
            v[b] = float(xa * s + xb * c);
        }
    }
}

} // namespace

void apply_rope(int64_t n, int d, float* x, const int64_t* pos, const RopeParams& rope) {
    rotate(n, d, x, pos, rope, 1.0);
}

void invert_rope(int64_t n, int d, float* x, const int64_t* pos, const RopeParams& rope) {
    rotate(n, d, x, pos, rope, -1.0);
}

} // namespace kvindex
