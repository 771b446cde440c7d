// The portable fused kernels: one dot product per (row, input row), the
// weights of a row read from L1 for every input row after the first.

#include "quant_kernels.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <kvindex/trace.h> // half_to_float

#include "gguf.h"

namespace kvllm {
namespace quant_kernels {

namespace {

float load_half(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return kvindex::half_to_float(h);
}

/** A Q4_1 weight is d * q + m (q in 0..15), so a block's share of the dot
 * product is d * sum_j q_j x_j + m * sum_j x_j: the integer weights are
 * multiplied as they are and the block sums of x (xsum) are computed once
 * per input row. Byte j of a block holds q_j (low nibble) and q_{j+16}.
 * The sums run in 16 lanes (lane j gathers weights j and j + 16 of every
 * block) that the compiler maps to vectors without reordering a float sum;
 * a single running sum stays scalar, and so did this loop with the scale
 * inside it (GCC 12): s[] first, then the lanes, is what vectorizes. Not
 * inlined: in the caller, whose vector has a destructor, the calls of
 * half_to_float (which may throw, as far as GCC knows) split the region
 * the vectorizer works on. */
[[gnu::noinline]] float dot_q4_1(const uint8_t* row, const float* x, const float* xsum, int64_t nb) {
    float lane[16] = {};
    float m_sum = 0;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* p = row + b * 20;
        const uint8_t* q = p + 4;
        const float* xb = x + b * 32;
        const float d = load_half(p), m = load_half(p + 2);
        float s[16];
        for (int j = 0; j < 16; j++) {
            s[j] = float(q[j] & 0x0f) * xb[j] + float(q[j] >> 4) * xb[j + 16];
        }
        for (int j = 0; j < 16; j++) {
            lane[j] += d * s[j];
        }
        m_sum += m * xsum[b];
    }
    float acc = m_sum;
    for (int j = 0; j < 16; j++) {
        acc += lane[j];
    }
    return acc;
}

/// A Q8_0 weight is d * q (q signed): d * sum_j q_j x_j per block, in lanes as above.
[[gnu::noinline]] float dot_q8_0(const uint8_t* row, const float* x, int64_t nb) {
    float lane[16] = {};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* p = row + b * 34;
        const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
        const float* xb = x + b * 32;
        const float d = load_half(p);
        float s[16];
        for (int j = 0; j < 16; j++) {
            s[j] = float(q[j]) * xb[j] + float(q[j + 16]) * xb[j + 16];
        }
        for (int j = 0; j < 16; j++) {
            lane[j] += d * s[j];
        }
    }
    float acc = 0;
    for (int j = 0; j < 16; j++) {
        acc += lane[j];
    }
    return acc;
}

} // namespace

void fused_generic(uint32_t type, const uint8_t* w, uint64_t row_bytes, int64_t nrows, int64_t cols,
                   const float* x, int64_t n, float* y, int64_t ldy, bool accumulate) {
    const int64_t nb = cols / 32;
    std::vector<float> xsum; // [n][nb], Q4_1 only
    if (GgmlType(type) == GgmlType::Q4_1) {
        xsum.resize(size_t(n * nb));
        for (int64_t t = 0; t < n; t++) {
            for (int64_t b = 0; b < nb; b++) {
                float s = 0;
                for (int j = 0; j < 32; j++) {
                    s += x[t * cols + b * 32 + j];
                }
                xsum[t * nb + b] = s;
            }
        }
    } else if (GgmlType(type) != GgmlType::Q8_0) {
        throw std::invalid_argument("no fused kernel for " + ggml_type_name(type));
    }
    for (int64_t i = 0; i < nrows; i++) {
        const uint8_t* row = w + i * row_bytes;
        for (int64_t t = 0; t < n; t++) {
            const float* xt = x + t * cols;
            float d = GgmlType(type) == GgmlType::Q4_1 ? dot_q4_1(row, xt, xsum.data() + t * nb, nb)
                                                       : dot_q8_0(row, xt, nb);
            float& out = y[t * ldy + i];
            out = accumulate ? out + d : d;
        }
    }
}

} // namespace quant_kernels
} // namespace kvllm
