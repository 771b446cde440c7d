#pragma once

// The element type in which an index stores its keys and values: float32,
// bfloat16 or IEEE half (fp16). Chosen for a whole index chain by the factory
// string ("BF16,Flat", "FP16,Sink4,Window64,TopK(HNSW32)"); queries, outputs
// and every score stay float32, and the kernels widen stored rows to float
// on the fly (kernels.h).
//
// The conversions are written with integer bit operations (no compiler half
// type), so that they behave the same under every compiler and vectorise.

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvindex {

enum class KVType : uint8_t {
    f32 = 0,  ///< float32, exact
    bf16 = 1, ///< bfloat16: float32's range, 8 significant bits (unit roundoff 2^-8)
    f16 = 2,  ///< IEEE half: |x| <= 65504, 11 significant bits (unit roundoff 2^-11)
};

/// Number of storage types (valid KVType values are 0 .. this - 1).
constexpr int kNumKVTypes = 3;

/// Bytes per stored element.
constexpr size_t kv_type_size(KVType t) {
    return t == KVType::f32 ? 4 : 2;
}

/// "f32", "bf16", "f16".
const char* kv_type_name(KVType t);

/// The factory-string prefix selecting the type: "" (f32), "BF16,", "FP16,".
const char* kv_type_prefix(KVType t);

/// One bfloat16 / IEEE half value, as its bits (distinct types, so that
/// kernels can be overloaded on the stored type).
struct bf16_t {
    uint16_t bits;
};
struct f16_t {
    uint16_t bits;
};

inline uint32_t float_bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return u;
}
inline float bits_float(uint32_t u) {
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}

/// The bits of the smallest magnitude each 16-bit type rounds to infinity:
/// 0x1.ffp127 (bfloat16's largest, 0x1.fep127, plus half an ulp) and 65520
/// (half's largest, 65504, plus half an ulp).
constexpr uint32_t kBF16Limit = 0x7f7f8000u;
constexpr uint32_t kF16Limit = 0x477ff000u;

/// bfloat16 -> float: exact.
inline float to_float(bf16_t h) {
    return bits_float(uint32_t(h.bits) << 16);
}

/// Half -> float: exact (normals, subnormals, zeros, inf, nan), in integer
/// steps: a normal's exponent is rebiased (15 -> 127), a subnormal is its
/// mantissa times 2^-24 (a normal float), inf / nan get the float's all-ones
/// exponent. No float subnormal is read, so the result is the same under
/// MXCSR's denormals-are-zero (a host built with -ffast-math).
inline float to_float(f16_t h) {
    uint32_t sign = uint32_t(h.bits & 0x8000u) << 16;
    uint32_t em = h.bits & 0x7fffu;
    uint32_t bits = em < 0x400u    ? float_bits(float(em) * 0x1p-24f)
            : em >= 0x7c00u ? (em << 13) | 0x7f800000u
                            : (em << 13) + 0x38000000u;
    return bits_float(bits | sign);
}

inline float to_float(float x) {
    return x;
}

/** float -> bfloat16, rounded to nearest, ties to even. NaN stays NaN;
 * finite values of magnitude >= 0x1.ffp127 (above bfloat16's largest,
 * 0x1.fep127 = 3.3895e38, by half an ulp or more) round to infinity:
 * kv_type_fits tells the caller beforehand. */
inline bf16_t to_bf16(float x) {
    uint32_t u = float_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return bf16_t{uint16_t((u >> 16) | 0x40u)}; // quiet NaN, sign kept
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return bf16_t{uint16_t(u >> 16)};
}

/** float -> IEEE half, rounded to nearest, ties to even, subnormals
 * included (values under 2^-25 in magnitude round to a signed zero). NaN
 * stays NaN; |x| >= 65520 (half an ulp above 65504, the largest half)
 * rounds to infinity: kv_type_fits tells the caller beforehand. */
inline f16_t to_f16(float x) {
    uint32_t u = float_bits(x);
    uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) {
        return f16_t{uint16_t(sign | 0x7e00u)}; // quiet NaN
    }
    if (u >= kF16Limit) { // >= 65520: infinity
        return f16_t{uint16_t(sign | 0x7c00u)};
    }
    if (u < 0x38800000u) {
        // below 2^-14 (subnormal half): adding 0.5 puts the value's bits at
        // the half's subnormal ulp (2^-24 = float's ulp in [0.5, 1)), and
        // the float addition rounds to nearest even
        uint32_t r = float_bits(bits_float(u) + 0.5f) - 0x3f000000u;
        return f16_t{uint16_t(sign | r)};
    }
    // normal: rebias the exponent (127 -> 15), round the 13 dropped bits
    u += 0x0fffu + ((u >> 13) & 1u);
    return f16_t{uint16_t(sign | ((u - 0x38000000u) >> 13))};
}

/// x as type t stores it, back in float (x itself for f32).
inline float round_to(KVType t, float x) {
    switch (t) {
        case KVType::bf16:
            return to_float(to_bf16(x));
        case KVType::f16:
            return to_float(to_f16(x));
        default:
            return x;
    }
}

/// Whether finite x is stored in type t as a finite value (no overflow to
/// infinity): always for f32; |x| < 0x1.ffp127 for bf16; |x| < 65520 for f16.
inline bool kv_type_fits(KVType t, float x) {
    uint32_t a = float_bits(x) & 0x7fffffffu;
    switch (t) {
        case KVType::bf16:
            return a < kBF16Limit;
        case KVType::f16:
            return a < kF16Limit;
        default:
            return true;
    }
}

/** Throws naming `what`, the first value that does not fit type t
 * (kv_type_fits), its position (row, column of rows of row_dim elements)
 * and the type's range. */
void check_kv_type_fits(KVType t, const float* x, size_t n, size_t row_dim, const char* what);

/** Converts n floats to type t into dst (n * kv_type_size(t) bytes).
 * Throws naming `what`, the value, its position and the type's range when a
 * value does not fit (kv_type_fits); nothing is written then. Rows of
 * row_dim elements give the position as (row, column). */
void convert_from_float(
        KVType t, const float* src, size_t n, size_t row_dim, void* dst, const char* what);

/// dst[i] = round_to(t, src[i]), i < n (dst may be src).
void round_to(KVType t, const float* src, size_t n, float* dst);

/// Converts n elements of type t at src to floats (exact).
void convert_to_float(KVType t, const void* src, size_t n, float* dst);

/** Rows stored in one of the KV types, as the kernels read them: row i is
 * at data + i * dim * kv_type_size(type). */
struct KVRows {
    const void* data = nullptr;
    size_t dim = 0;
    KVType type = KVType::f32;
    /// every element is finite (KVStorage's rows: it refuses the others on
    /// append and read); lets the generic level widen fp16 in fewer steps
    bool finite = false;

    KVRows() = default;
    KVRows(const void* data, size_t dim, KVType type) : data(data), dim(dim), type(type) {}
    /// float32 rows
    KVRows(const float* data, size_t dim) : data(data), dim(dim), type(KVType::f32) {}

    size_t row_bytes() const {
        return dim * kv_type_size(type);
    }
    /// The rows from row i on.
    KVRows from(size_t i) const {
        KVRows r(static_cast<const uint8_t*>(data) + i * row_bytes(), dim, type);
        r.finite = finite;
        return r;
    }
};

} // namespace kvindex
