// The AVX-512 fused kernels (quant_kernels.h). Compiled with AVX-512 flags
// (benchmarks/CMakeLists.txt) and called only at kvindex's avx512 level;
// the intrinsics are AVX-512F, FMA and F16C.
//
// A tile of R weight rows times T input rows keeps R * T accumulators in
// registers. Each block of 32 weights is widened to two float vectors once
// per row (d * q + m, one rounding) and used by the T input rows, and each
// 32 values of an input row are loaded once for the R rows. Unpacking and
// FMAs share the same two vector ports, so the more input rows share a
// block the closer the loop gets to FMA speed. Input rows go in groups of
// at most 8, the outer loop, so that a group's x stays in L1 (groups of 16
// were no faster, and ffn_down's 16 x 1536 floats overflowed L1) while the
// weights of the chunk stream from L2.
//
// One thread, SmolLM2's 1536 x 576 Q4_1 matrices: 0.06 ms for one input
// row (sgemv on float32 rows: 0.8 ms), 0.8 ms for 32 (sgemm: 2.4 ms with
// OpenBLAS's SSE3 fallback, 1.3 ms with its SkylakeX kernels).

#include "quant_kernels.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "gguf.h"

namespace kvllm {
namespace quant_kernels {

namespace {

__m512 broadcast_half(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _mm512_set1_ps(_cvtsh_ss(h));
}

/** d, m, 16 bytes: byte j holds q_j in its low nibble and q_{j+16} in its
 * high one. The 16 values d * q + m of the block are made once (one FMA on
 * 0..15) and looked up with vpermps, which reads the low 4 bits of each
 * index: fewer instructions than masking and converting every nibble, on
 * the two ports that the FMAs need too. */
struct Q4_1 {
    static constexpr int64_t block_bytes = 20;
    static void load(const uint8_t* p, __m512& lo, __m512& hi) {
        uint32_t dm_bits;
        std::memcpy(&dm_bits, p, 4);
        // [d, m] repeated: halves to floats in one conversion
        const __m512 dm = _mm512_cvtph_ps(_mm256_set1_epi32(int(dm_bits)));
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 value = _mm512_fmadd_ps(iota, _mm512_moveldup_ps(dm), _mm512_movehdup_ps(dm));
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4)));
        lo = _mm512_permutexvar_ps(b, value);
        hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), value);
    }
};

/// d, 32 signed bytes q_j in order.
struct Q8_0 {
    static constexpr int64_t block_bytes = 34;
    static void load(const uint8_t* p, __m512& lo, __m512& hi) {
        const __m512 d = broadcast_half(p);
        const __m128i* q = reinterpret_cast<const __m128i*>(p + 2);
        lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
        hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
    }
};

/// y[t * ldy + r] (+)= <w row r, x_t> for r < R, t < T.
template <class Block, int R, int T>
void tile(const uint8_t* w, uint64_t row_bytes, int64_t nb, const float* x, int64_t ldx, float* y,
          int64_t ldy, bool accumulate) {
    __m512 acc[R][T];
    for (int r = 0; r < R; r++) {
        for (int t = 0; t < T; t++) {
            acc[r][t] = _mm512_setzero_ps();
        }
    }
    for (int64_t b = 0; b < nb; b++) {
        __m512 lo[R], hi[R];
        for (int r = 0; r < R; r++) {
            Block::load(w + r * row_bytes + b * Block::block_bytes, lo[r], hi[r]);
        }
        for (int t = 0; t < T; t++) {
            const __m512 x_lo = _mm512_loadu_ps(x + t * ldx + b * 32);
            const __m512 x_hi = _mm512_loadu_ps(x + t * ldx + b * 32 + 16);
            for (int r = 0; r < R; r++) {
                acc[r][t] = _mm512_fmadd_ps(lo[r], x_lo, acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(hi[r], x_hi, acc[r][t]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        for (int t = 0; t < T; t++) {
            const float s = _mm512_reduce_add_ps(acc[r][t]);
            float& out = y[t * ldy + r];
            out = accumulate ? out + s : s;
        }
    }
}

/// All rows against T input rows: tiles of R rows, then single rows. With
/// one or two input rows, 4 rows per tile give the FMAs enough independent
/// accumulators to hide their latency.
template <class Block, int T>
void rows_times_group(const uint8_t* w, uint64_t row_bytes, int64_t nrows, int64_t cols,
                      const float* x, float* y, int64_t ldy, bool accumulate) {
    constexpr int R = T <= 2 ? 4 : 2;
    const int64_t nb = cols / 32;
    int64_t i = 0;
    for (; i + R <= nrows; i += R) {
        tile<Block, R, T>(w + i * row_bytes, row_bytes, nb, x, cols, y + i, ldy, accumulate);
    }
    for (; i < nrows; i++) {
        tile<Block, 1, T>(w + i * row_bytes, row_bytes, nb, x, cols, y + i, ldy, accumulate);
    }
}

template <class Block>
void fused(const uint8_t* w, uint64_t row_bytes, int64_t nrows, int64_t cols, const float* x,
           int64_t n, float* y, int64_t ldy, bool accumulate) {
    constexpr int64_t group = 8;
    for (int64_t t0 = 0; t0 < n; t0 += group) {
        const float* xg = x + t0 * cols;
        float* yg = y + t0 * ldy;
        switch (std::min(group, n - t0)) {
#define KVLLM_GROUP_CASE(T)                                                                \
    case T:                                                                                \
        rows_times_group<Block, T>(w, row_bytes, nrows, cols, xg, yg, ldy, accumulate); \
        break;
            KVLLM_GROUP_CASE(1)
            KVLLM_GROUP_CASE(2)
            KVLLM_GROUP_CASE(3)
            KVLLM_GROUP_CASE(4)
            KVLLM_GROUP_CASE(5)
            KVLLM_GROUP_CASE(6)
            KVLLM_GROUP_CASE(7)
            KVLLM_GROUP_CASE(8)
#undef KVLLM_GROUP_CASE
        }
    }
}

} // namespace

void fused_avx512(uint32_t type, const uint8_t* w, uint64_t row_bytes, int64_t nrows, int64_t cols,
                  const float* x, int64_t n, float* y, int64_t ldy, bool accumulate) {
    switch (GgmlType(type)) {
        case GgmlType::Q4_1:
            return fused<Q4_1>(w, row_bytes, nrows, cols, x, n, y, ldy, accumulate);
        case GgmlType::Q8_0:
            return fused<Q8_0>(w, row_bytes, nrows, cols, x, n, y, ldy, accumulate);
        default:
            throw std::invalid_argument("no fused kernel for " + ggml_type_name(type));
    }
}

} // namespace quant_kernels
} // namespace kvllm
