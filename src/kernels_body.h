// The attention kernels, written once with GCC vector extensions and
// compiled once per instruction set: kernels_generic.cpp (no -m flags),
// kernels_avx2.cpp (-mavx2 -mfma -mf16c), kernels_avx512.cpp (-mavx512f).
// The including file defines KVINDEX_SIMD_NS (namespace) and
// KVINDEX_SIMD_BYTES (vector width in bytes).
//
// Why vector extensions rather than intrinsics: one body serves every width,
// and the compiler still emits the fused multiply-adds and wide loads.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "kernels_internal.h"

#if KVINDEX_SIMD_BYTES >= 32 || defined(__SSE2__)
#include <immintrin.h>
#endif

namespace kvindex {
namespace KVINDEX_SIMD_NS {

namespace {

typedef float vf __attribute__((vector_size(KVINDEX_SIMD_BYTES)));
typedef int vi __attribute__((vector_size(KVINDEX_SIMD_BYTES)));
typedef unsigned vu __attribute__((vector_size(KVINDEX_SIMD_BYTES)));
/// W 16-bit elements: the stored bits of one vf's worth of bf16 / fp16
typedef uint16_t vh __attribute__((vector_size(KVINDEX_SIMD_BYTES / 2)));
constexpr size_t W = KVINDEX_SIMD_BYTES / sizeof(float);

template <class To, class From>
inline To bitcast(From x) {
    static_assert(sizeof(To) == sizeof(From), "same size");
    To y;
    std::memcpy(&y, &x, sizeof(y));
    return y;
}

// ---- loading stored rows as float vectors ---------------------------------
// Every kernel that reads keys or values is a template on the stored element
// type T (float, bf16_t, f16_t: kv_type.h); load(const T*) widens W
// elements to a float vector, to_float(T) one element (scalar tails).

inline vf load(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

/// 2W 16-bit elements, the size of a vf.
typedef uint16_t vh2 __attribute__((vector_size(KVINDEX_SIMD_BYTES)));

/// W stored 16-bit elements, zero-extended to 32-bit lanes: each element
/// interleaved with a zero (little endian). Written as a shuffle because
/// GCC 12 lowers __builtin_convertvector(vh, vu) to two half-width
/// extensions and an insert, where this gives one vpmovzxwd.
inline vu load_u16(const uint16_t* p) {
#if KVINDEX_SIMD_BYTES == 16 && defined(__SSE2__)
    // one movq and one punpcklwd: GCC 12 builds the generic shuffle below
    // at this width through general registers, 5x slower than float rows
    return bitcast<vu>(_mm_unpacklo_epi16(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)), _mm_setzero_si128()));
#elif KVINDEX_SIMD_BYTES == 16
    vh h;
    std::memcpy(&h, p, sizeof(h));
    const vh z = {};
    return bitcast<vu>(__builtin_shufflevector(h, z, 0, 4, 1, 4, 2, 4, 3, 4));
#elif KVINDEX_SIMD_BYTES == 32
    vh h;
    std::memcpy(&h, p, sizeof(h));
    const vh z = {};
    vh2 r = __builtin_shufflevector(h, z, 0, 8, 1, 8, 2, 8, 3, 8, 4, 8, 5, 8, 6, 8, 7, 8);
    return bitcast<vu>(r);
#elif KVINDEX_SIMD_BYTES == 64
    // one vpmovzxwd (AVX512F); the generic shuffles of a zmm would need
    // AVX512BW, and GCC builds this one from two halves and an insert
    return bitcast<vu>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
#error "KVINDEX_SIMD_BYTES must be 16, 32 or 64"
#endif
}

/// W stored 16-bit elements in the upper halves of 32-bit lanes (the lower
/// halves zero): load_u16 << 16, in one punpcklwd at the SSE2 width.
inline vu load_u16_high(const uint16_t* p) {
#if KVINDEX_SIMD_BYTES == 16 && defined(__SSE2__)
    return bitcast<vu>(_mm_unpacklo_epi16(
            _mm_setzero_si128(), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
    return load_u16(p) << 16;
#endif
}

/// bfloat16 is the upper half of a float.
inline vf load(const bf16_t* p) {
    return bitcast<vf>(load_u16_high(&p->bits));
}

/// IEEE half, as to_float(f16_t) in kv_type.h, whose integer steps keep it
/// exact under denormals-are-zero (vcvtph2ps ignores DAZ too).
inline vf load(const f16_t* p) {
#if KVINDEX_SIMD_BYTES == 64
    // AVX512F converts halves itself (vcvtph2ps), subnormals and inf / nan
    // included: one instruction for the bit work below
    return bitcast<vf>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(&p->bits))));
#elif KVINDEX_SIMD_BYTES == 32
    // F16C, which the avx2 level requires (kernels.cpp): the bit work below
    // costs ~2.5x the dense pass's time at 128k keys, vcvtph2ps nothing
    return bitcast<vf>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(&p->bits))));
#else
    vu h = load_u16(&p->bits);
    vu sign = (h & 0x8000u) << 16;
    vi em = bitcast<vi>(h & 0x7fffu);
    // em < 2^15: signed compares are exact and cheaper
    vu subnormal = bitcast<vu>(em < 0x400);
    vu special = bitcast<vu>(em > 0x7bff); // inf / nan
    // exponent rebiased (15 -> 127); inf / nan rebiased once more to the
    // all-ones exponent; a subnormal m * 2^-24 is read as the normal
    // 2^-14 + m * 2^-24, less 2^-14 (both normal floats: exact, DAZ-proof)
    vu bits = (bitcast<vu>(em) << 13) + 0x38000000u + (special & 0x38000000u) +
            (subnormal & 0x00800000u);
    vf mag = bitcast<vf>(bits) - bitcast<vf>(subnormal & 0x38800000u);
    return bitcast<vf>(bitcast<vu>(mag) | sign);
#endif
}
/// fp16 rows known to be finite (KVRows::finite: KVStorage refuses
/// non-finite values on append and read), read while denormals-are-zero is
/// off: kernels.cpp picks these kernels only then. Same bits as f16_t.
struct f16_finite_t {
    uint16_t bits;
};

inline vf load(const f16_finite_t* p) {
#if KVINDEX_SIMD_BYTES >= 32
    // the hardware conversion costs nothing more for any half
    return load(reinterpret_cast<const f16_t*>(p));
#else
    // The half in the upper 16 bits, shifted right 3 with its sign: the
    // sign stays in bit 31, its copies in bits 30-28 are cleared, and
    // exponent and mantissa sit where a float has them. Those bits are the
    // float half * 2^-112 (a float subnormal for a subnormal half); one
    // multiply rescales it exactly. Two integer steps where
    // load(const f16_t*) takes twelve. An exponent of 31 (inf / nan) would
    // read as a finite value, and DAZ would read a subnormal half as zero:
    // hence the two conditions above.
    vi x = bitcast<vi>(load_u16_high(&p->bits)) >> 3;
    return bitcast<vf>(bitcast<vu>(x) & 0x8fffffffu) * (vf{} + 0x1p112f);
#endif
}
inline float to_float(f16_finite_t h) {
    return kvindex::to_float(f16_t{h.bits});
}

/// W 8-bit codes (unsigned), widened to floats 0..255.
inline vf load(const uint8_t* p) {
#if KVINDEX_SIMD_BYTES == 64
    // one vpmovzxbd and one vcvtdq2ps
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif KVINDEX_SIMD_BYTES == 32
    // one vpmovzxbd and one vcvtdq2ps: GCC 12 converts the generic vector
    // below byte by byte through general registers (the 8-bit walk of
    // RoarGraph ran at half the speed of its float walk)
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#elif KVINDEX_SIMD_BYTES == 16 && defined(__SSE2__)
    int32_t four;
    std::memcpy(&four, p, sizeof(four));
    const __m128i z = _mm_setzero_si128();
    return _mm_cvtepi32_ps(_mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(four), z), z));
#else
    typedef uint8_t vb __attribute__((vector_size(W)));
    vb b;
    std::memcpy(&b, p, sizeof(b));
    return __builtin_convertvector(b, vf);
#endif
}
using kvindex::to_float; // the stored types' (kv_type.h), beside this one
inline float to_float(uint8_t c) {
    return float(c);
}

inline void store(float* p, vf v) {
    std::memcpy(p, &v, sizeof(v));
}
inline vf splat(float x) {
    return vf{} + x;
}
inline float hsum(vf v) {
    float s = 0;
    for (size_t i = 0; i < W; i++) {
        s += v[i];
    }
    return s;
}
inline float hmax(vf v) {
    float m = v[0];
    for (size_t i = 1; i < W; i++) {
        m = v[i] > m ? v[i] : m;
    }
    return m;
}

/// exp(x) for a vector, relative error ~2e-7 (Cephes polynomial on
/// [-ln2/2, ln2/2] times 2^n). Inputs below -87.3 give 0, which is what
/// the softmax needs for scores far under the maximum; -inf gives 0.
inline vf exp_v(vf x) {
    const vf hi = splat(88.3762626647949f);
    const vf lo = splat(-87.3365447504f);
    vi underflow = x < lo;
    x = x > hi ? hi : x;
    x = x < lo ? lo : x;
    vf fx = x * splat(1.44269504088896341f) + splat(0.5f);
    vi n = __builtin_convertvector(fx, vi);
    vf fn = __builtin_convertvector(n, vf);
    fn = fn > fx ? fn - splat(1.0f) : fn; // floor
    n = __builtin_convertvector(fn, vi);
    x = x - fn * splat(0.693359375f) - fn * splat(-2.12194440e-4f);
    vf y = splat(1.9875691500e-4f);
    y = y * x + splat(1.3981999507e-3f);
    y = y * x + splat(8.3334519073e-3f);
    y = y * x + splat(4.1665795894e-2f);
    y = y * x + splat(1.6666665459e-1f);
    y = y * x + splat(5.0000001201e-1f);
    y = y * x * x + x + splat(1.0f);
    vi e = (n + 127) << 23;
    vf scale;
    std::memcpy(&scale, &e, sizeof(scale));
    vf r = y * scale;
    return underflow ? vf{} : r;
}

inline float exp_s(float x) {
    return std::exp(x);
}

/// <q, x> for one row of stored type T, summed in exactly dot4's order
/// (one accumulator, then the tail): a key scores the same whether it
/// falls in a group of four or among the rows left over, so identical keys
/// tie wherever they sit and break the tie by id.
template <class T>
inline float dot(const float* q, const T* x, size_t d) {
    vf a = {};
    size_t j = 0;
    for (; j + W <= d; j += W) {
        a += load(q + j) * load(x + j);
    }
    float s = hsum(a);
    for (; j < d; j++) {
        s += q[j] * to_float(x[j]);
    }
    return s;
}

/// <q, x_r> for four rows at once: the query is loaded once per chunk and
/// four independent accumulators keep the FMA units busy. Each row is
/// summed as dot sums it (keep the two in step).
template <class T>
inline void dot4(
        const float* q,
        const T* x0,
        const T* x1,
        const T* x2,
        const T* x3,
        size_t d,
        float* s) {
    vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
    size_t j = 0;
    for (; j + W <= d; j += W) {
        vf qv = load(q + j);
        a0 += qv * load(x0 + j);
        a1 += qv * load(x1 + j);
        a2 += qv * load(x2 + j);
        a3 += qv * load(x3 + j);
    }
    float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
    for (; j < d; j++) {
        s0 += q[j] * to_float(x0[j]);
        s1 += q[j] * to_float(x1[j]);
        s2 += q[j] * to_float(x2[j]);
        s3 += q[j] * to_float(x3[j]);
    }
    s[0] = s0;
    s[1] = s1;
    s[2] = s2;
    s[3] = s3;
}

/// Prefetch distance for contiguous scans. A core keeps only a few misses
/// in flight on its own; asking for lines this far ahead lets the two
/// streams of attention (keys, values) run near the read bandwidth.
constexpr size_t kPrefetchBytes = 8192;

/// One prefetch per cache line of [p, p + n_bytes).
inline void prefetch_lines(const void* p, size_t n_bytes) {
    const char* c = static_cast<const char*>(p);
    for (size_t i = 0; i < n_bytes; i += 64) {
        __builtin_prefetch(c + i);
    }
}

/// Prefetches the lines kPrefetchBytes ahead of n_rows rows from row.
template <class T>
inline void prefetch_ahead(const T* row, size_t n_rows, size_t dim) {
    prefetch_lines(reinterpret_cast<const char*>(row) + kPrefetchBytes, n_rows * dim * sizeof(T));
}

/// s[i] = scale * <q, row(i)> for any row accessor (returning const T*);
/// Contiguous rows are prefetched ahead.
template <bool Contiguous = false, class RowOf>
inline void inner_products_rows(
        const float* q, size_t d, size_t n, float scale, float* s, RowOf row) {
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        if (Contiguous) {
            prefetch_ahead(row(i), 4, d);
        }
        dot4(q, row(i), row(i + 1), row(i + 2), row(i + 3), d, s + i);
        for (size_t r = 0; r < 4; r++) {
            s[i + r] *= scale;
        }
    }
    for (; i < n; i++) {
        s[i] = scale * dot(q, row(i), d);
    }
}

/// out += w * v (one row).
template <class T>
inline void axpy(float w, const T* v, size_t dv, float* out) {
    vf wv = splat(w);
    size_t j = 0;
    for (; j + W <= dv; j += W) {
        store(out + j, load(out + j) + wv * load(v + j));
    }
    for (; j < dv; j++) {
        out[j] += w * to_float(v[j]);
    }
}

/// out += sum_r w[r] * v_r over four rows: one load / store of out per
/// four rows keeps the loop bound by reading the values.
template <class T>
inline void axpy4(
        const float* w,
        const T* v0,
        const T* v1,
        const T* v2,
        const T* v3,
        size_t dv,
        float* out) {
    vf w0 = splat(w[0]), w1 = splat(w[1]), w2 = splat(w[2]), w3 = splat(w[3]);
    size_t j = 0;
    for (; j + W <= dv; j += W) {
        vf o = load(out + j);
        o += w0 * load(v0 + j);
        o += w1 * load(v1 + j);
        o += w2 * load(v2 + j);
        o += w3 * load(v3 + j);
        store(out + j, o);
    }
    for (; j < dv; j++) {
        out[j] += w[0] * to_float(v0[j]) + w[1] * to_float(v1[j]) + w[2] * to_float(v2[j]) +
                w[3] * to_float(v3[j]);
    }
}

/// out += sum_i w[i] * row(i), i < n (row returning const T*).
template <bool Contiguous = false, class RowOf>
inline void accumulate_rows(const float* w, size_t dv, size_t n, float* out, RowOf row) {
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        if (Contiguous) {
            prefetch_ahead(row(i), 4, dv);
        }
        axpy4(w + i, row(i), row(i + 1), row(i + 2), row(i + 3), dv, out);
    }
    for (; i < n; i++) {
        axpy(w[i], row(i), dv, out);
    }
}

template <class RowOf>
inline void weighted_sum_rows(
        const float* w, size_t dv, size_t n, float* out, RowOf row) {
    std::memset(out, 0, sizeof(float) * dv);
    accumulate_rows(w, dv, n, out, row);
}

inline float max_of(const float* s, size_t n) {
    float m = -std::numeric_limits<float>::infinity();
    size_t i = 0;
    if (n >= W) {
        vf mv = load(s);
        for (i = W; i + W <= n; i += W) {
            vf x = load(s + i);
            mv = x > mv ? x : mv;
        }
        m = hmax(mv);
    }
    for (; i < n; i++) {
        m = s[i] > m ? s[i] : m;
    }
    return m;
}

/// s[i] <- exp(s[i] - m) in place; returns the sum.
inline float exp_shift_sum(float* s, size_t n, float m) {
    vf acc = {};
    vf mv = splat(m);
    size_t i = 0;
    for (; i + W <= n; i += W) {
        vf e = exp_v(load(s + i) - mv);
        store(s + i, e);
        acc += e;
    }
    float sum = hsum(acc);
    for (; i < n; i++) {
        s[i] = exp_s(s[i] - m);
        sum += s[i];
    }
    return sum;
}

// ---- the kernels of the table, one instance per stored type T --------------
// Rows arrive as const void* (the table is type-erased) and are read as T.

template <class T>
void inner_products_scaled_t(
        const float* q, const void* xv, size_t d, size_t n, float scale, float* s) {
    const T* x = static_cast<const T*>(xv);
    inner_products_rows<true>(q, d, n, scale, s, [=](size_t i) { return x + i * d; });
}

template <class T>
void inner_products_by_ids_t(
        const float* q,
        const void* xv,
        size_t d,
        const int64_t* ids,
        size_t n,
        float scale,
        float* s) {
    const T* x = static_cast<const T*>(xv);
    inner_products_rows(
            q, d, n, scale, s, [=](size_t i) { return x + size_t(ids[i]) * d; });
}

template <class T>
void weighted_sum_t(const float* w, const void* vv, size_t dv, size_t n, float* out) {
    const T* v = static_cast<const T*>(vv);
    weighted_sum_rows(w, dv, n, out, [=](size_t i) { return v + i * dv; });
}

template <class T>
void weighted_sum_by_ids_t(
        const float* w,
        const void* vv,
        size_t dv,
        const int64_t* ids,
        size_t n,
        float* out) {
    const T* v = static_cast<const T*>(vv);
    weighted_sum_rows(
            w, dv, n, out, [=](size_t i) { return v + size_t(ids[i]) * dv; });
}

template <class T>
float dense_attention_t(
        const float* q,
        const void* keys_v,
        const void* values_v,
        size_t d,
        size_t dv,
        size_t n,
        float scale,
        float* out) {
    const T* keys = static_cast<const T*>(keys_v);
    const T* values = static_cast<const T*>(values_v);
    // Online softmax over blocks: a block of scores stays in L1 while its
    // values are summed, so keys and values are each read exactly once.
    constexpr size_t B = 256;
    alignas(64) float s[B];
    float m = -std::numeric_limits<float>::infinity();
    float sum = 0;
    std::memset(out, 0, sizeof(float) * dv);
    for (size_t i0 = 0; i0 < n; i0 += B) {
        size_t nb = n - i0 < B ? n - i0 : B;
        const T* kb = keys + i0 * d;
        inner_products_rows<true>(q, d, nb, scale, s, [=](size_t i) { return kb + i * d; });
        float mb = max_of(s, nb);
        if (mb > m) {
            // rescale what was accumulated under the old maximum
            float r = exp_s(m - mb);
            sum *= r;
            if (r != 1.0f) {
                for (size_t j = 0; j < dv; j++) {
                    out[j] *= r;
                }
            }
            m = mb;
        }
        sum += exp_shift_sum(s, nb, m);
        const T* vb = values + i0 * dv;
        accumulate_rows<true>(s, dv, nb, out, [=](size_t i) { return vb + i * dv; });
    }
    if (n == 0) {
        return m;
    }
    float inv = 1.0f / sum;
    for (size_t j = 0; j < dv; j++) {
        out[j] *= inv;
    }
    return m + std::log(sum);
}

float softmax_inplace(float* s, const float* bias, size_t n) {
    if (n == 0) {
        return -std::numeric_limits<float>::infinity();
    }
    if (bias) {
        for (size_t i = 0; i < n; i++) {
            s[i] -= bias[i];
        }
    }
    float m = max_of(s, n);
    if (m == -std::numeric_limits<float>::infinity()) {
        // every score -inf (all masked): the empty set, weights 0 and lse
        // -inf, as merge_attention reads it, rather than 0/0. max_of skips
        // NaN, so a NaN among them still makes the result NaN.
        float fill = 0.0f;
        for (size_t i = 0; i < n; i++) {
            fill = std::isnan(s[i]) ? s[i] : fill;
        }
        std::fill(s, s + n, fill);
        return fill == 0.0f ? m : fill;
    }
    float sum = exp_shift_sum(s, n, m);
    float inv = 1.0f / sum;
    vf iv = splat(inv);
    size_t i = 0;
    for (; i + W <= n; i += W) {
        store(s + i, load(s + i) * iv);
    }
    for (; i < n; i++) {
        s[i] *= inv;
    }
    return m + std::log(sum);
}

/// W / 2 doubles: a vf's worth of floats, widened
typedef double vd __attribute__((vector_size(KVINDEX_SIMD_BYTES)));
typedef long long vl __attribute__((vector_size(KVINDEX_SIMD_BYTES)));
typedef float vfh __attribute__((vector_size(KVINDEX_SIMD_BYTES / 2)));
constexpr size_t WD = KVINDEX_SIMD_BYTES / sizeof(double);

double inclusion_pass(const float* w, size_t n, double c, size_t* sure, size_t* positive) {
    // two accumulators of WD lanes: the double adds do not wait on each
    // other (a single chain is ~4 cycles a token)
    vd light0 = {}, light1 = {};
    vl sure_v = {}, pos_v = {};
    const vd cv = vd{} + c, one = vd{} + 1.0, zero = {};
    auto step = [&](const float* p, vd& light) {
        vfh h;
        std::memcpy(&h, p, sizeof(h));
        vd x = __builtin_convertvector(h, vd);
        vl pos = x > zero;                // -1 where true
        vl heavy = pos & (x * cv >= one);
        light += (vd)((vl)x & (pos & ~heavy)); // the light ones' weights, else +0.0
        sure_v -= heavy;
        pos_v -= pos;
    };
    size_t i = 0;
    for (; i + 2 * WD <= n; i += 2 * WD) {
        step(w + i, light0);
        step(w + i + WD, light1);
    }
    vd lv = light0 + light1;
    double light = 0;
    size_t s = 0, p = 0;
    for (size_t j = 0; j < WD; j++) {
        light += lv[j];
        s += size_t(sure_v[j]);
        p += size_t(pos_v[j]);
    }
    for (; i < n; i++) {
        double x = w[i];
        bool pos = x > 0, heavy = pos && x * c >= 1;
        p += pos;
        s += heavy;
        light += pos && !heavy ? x : 0.0;
    }
    *sure = s;
    *positive = p;
    return light;
}

} // namespace

#include "kernels_topk_body.h"

#include "kernels_group_body.h"

namespace {

/** s[b * ld + i] = <q_b, x_i> for g queries q_b = q + b * d and n float rows
 * x_i = x + i * d: tiles of W rows, each scored against every query while
 * it sits in L1, W scores summed by the group kernel's transposing fold
 * (dot_tile: a few shuffles a score where a horizontal sum takes W - 1
 * dependent adds, which at d = 128 cost more than the products). A row's
 * bits depend only on the row and the query, not on g, n or where the row
 * falls in its tile: the last rows are scored from a zero-padded tile. The
 * LSH hash of one key and of a block of keys. */
void inner_products_multi(
        const float* q, size_t g, const float* x, size_t d, size_t n, float* s, size_t ld) {
    size_t i0 = 0;
    for (; i0 + W <= n; i0 += W) {
        for (size_t b = 0; b < g; b++) {
            dot_tile(q + b * d, x + i0 * d, d, 1.0f, s + b * ld + i0);
        }
    }
    if (i0 < n && g > 0) {
        std::vector<float> tile(W * d, 0.0f);
        std::copy(x + i0 * d, x + n * d, tile.begin());
        float part[W];
        for (size_t b = 0; b < g; b++) {
            dot_tile(q + b * d, tile.data(), d, 1.0f, part);
            std::copy(part, part + (n - i0), s + b * ld + i0);
        }
    }
}

/// The row-reading kernels for stored type T. A new kernel that reads keys
/// or values is written as a template on T and gets one entry here.
template <class T>
constexpr RowKernels row_kernels() {
    return {
            inner_products_scaled_t<T>,
            inner_products_by_ids_t<T>,
            weighted_sum_t<T>,
            weighted_sum_by_ids_t<T>,
            dense_attention_t<T>,
            topk_inner_products_t<T>,
            dense_attention_group_t<T>,
    };
}

} // namespace

// indexed by KVType: f32, bf16, f16
const KernelTable table = {
        softmax_inplace,
        inclusion_pass,
        inner_products_multi,
        {row_kernels<float>(), row_kernels<bf16_t>(), row_kernels<f16_t>()},
#if KVINDEX_SIMD_BYTES == 16
        row_kernels<f16_finite_t>(),
#else
        row_kernels<f16_t>(), // vcvtph2ps reads every half at one cost
#endif
        inner_products_by_ids_t<uint8_t>,
};

} // namespace KVINDEX_SIMD_NS
} // namespace kvindex
