// bf16 / fp16 storage (kv_type.h): the conversions against an independent
// reference, the kernels at every SIMD level against a double reference on
// the converted values, and every index type stored in bf16 / fp16 against
// the same index in float32, within a bound derived from the rounding.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include <kvindex/KVStorage.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/impl/io.h>
#include <kvindex/kernels.h>
#include <kvindex/kv_type.h>
#include <kvindex/parameters.h>

#include "expect_throw.h"
#include "reference.h"
#include "simd_levels.h"

namespace test_kv_type {

using namespace kvindex;
using kvtest::gaussian;

namespace {

const KVType kHalfTypes[] = {KVType::bf16, KVType::f16};

uint16_t bits_of(KVType t, float x) {
    return t == KVType::bf16 ? to_bf16(x).bits : to_f16(x).bits;
}
float value_of(KVType t, uint16_t b) {
    return t == KVType::bf16 ? to_float(bf16_t{b}) : to_float(f16_t{b});
}

/// The value of 16-bit pattern b of type t computed from its fields in
/// double, independently of kv_type.h: sign, exponent, mantissa.
double decode_ref(KVType t, uint16_t b) {
    int mbits = t == KVType::bf16 ? 7 : 10;
    int ebits = 15 - mbits;
    int bias = (1 << (ebits - 1)) - 1;
    int e = (b >> mbits) & ((1 << ebits) - 1);
    int m = b & ((1 << mbits) - 1);
    double sign = (b & 0x8000) ? -1.0 : 1.0;
    if (e == (1 << ebits) - 1) {
        return m ? std::nan("") : sign * INFINITY;
    }
    if (e == 0) {
        return sign * std::ldexp(double(m), 1 - bias - mbits); // subnormal
    }
    return sign * std::ldexp(double((1 << mbits) + m), e - bias - mbits);
}

/// Round to nearest, ties to even, by search over every finite positive
/// value of the type (in double): the reference of to_bf16 / to_f16.
struct NearestRef {
    KVType t;
    std::vector<std::pair<double, uint16_t>> table; // ascending

    explicit NearestRef(KVType t) : t(t) {
        for (uint32_t b = 0; b < 0x8000; b++) {
            double v = decode_ref(t, uint16_t(b));
            if (std::isfinite(v)) {
                table.emplace_back(v, uint16_t(b));
            }
        }
        std::sort(table.begin(), table.end());
    }
    /// bits of the nearest value to finite x (x must not overflow)
    uint16_t operator()(float x) const {
        double a = std::fabs(double(x));
        auto hi = std::lower_bound(
                table.begin(), table.end(), std::make_pair(a, uint16_t(0)));
        uint16_t b;
        if (hi == table.end()) {
            b = table.back().second; // above the largest, below the overflow threshold
        } else if (hi == table.begin()) {
            b = hi->second;
        } else {
            auto lo = hi - 1;
            double dl = a - lo->first, dh = hi->first - a;
            b = dl < dh ? lo->second : dh < dl ? hi->second
                                               : ((lo->second & 1) ? hi->second : lo->second);
        }
        return uint16_t(b | (std::signbit(x) ? 0x8000 : 0));
    }
};

} // namespace

// ---- conversions -----------------------------------------------------------

TEST(KVType, EveryFiniteValueRoundTripsExactly) {
    for (KVType t : kHalfTypes) {
        for (uint32_t b = 0; b < 0x10000; b++) {
            double ref = decode_ref(t, uint16_t(b));
            if (std::isnan(ref)) {
                EXPECT_TRUE(std::isnan(value_of(t, uint16_t(b)))) << b;
                continue;
            }
            float x = value_of(t, uint16_t(b));
            ASSERT_EQ(double(x), ref) << kv_type_name(t) << " bits " << b;
            ASSERT_EQ(std::signbit(x), (b & 0x8000) != 0);
            if (std::isfinite(ref)) {
                ASSERT_EQ(bits_of(t, x), b) << kv_type_name(t) << " bits " << b;
                ASSERT_TRUE(kv_type_fits(t, x));
            }
        }
    }
}

TEST(KVType, RoundsToNearestEven) {
    // ties between two neighbours go to the even mantissa
    EXPECT_EQ(to_bf16(bits_float(0x3f808000u)).bits, 0x3f80); // 1 + 2^-8: down to 1
    EXPECT_EQ(to_bf16(bits_float(0x3f818000u)).bits, 0x3f82); // 1 + 3 * 2^-8: up
    EXPECT_EQ(to_bf16(bits_float(0x3f808001u)).bits, 0x3f81); // just above the tie: up
    EXPECT_EQ(to_f16(1.0f + 0x1p-11f).bits, 0x3c00);           // tie: down to 1
    EXPECT_EQ(to_f16(1.0f + 3 * 0x1p-11f).bits, 0x3c02);       // tie: up
    EXPECT_EQ(to_f16(2048.0f + 1.0f).bits, 0x6800);            // 2049: tie, down to 2048
    // subnormal halves: ulp 2^-24
    EXPECT_EQ(to_f16(0x1p-24f).bits, 0x0001);
    EXPECT_EQ(to_f16(0x1p-25f).bits, 0x0000);                  // tie with 0: even is 0
    EXPECT_EQ(to_f16(3 * 0x1p-25f).bits, 0x0002);              // tie 1 / 2: even is 2
    EXPECT_EQ(to_f16(0x1p-26f).bits, 0x0000);
    EXPECT_EQ(to_f16(-0x1p-24f).bits, 0x8001);
    EXPECT_EQ(to_f16(0x1p-14f).bits, 0x0400);                  // smallest normal
    EXPECT_EQ(to_f16(0x1p-14f - 0x1p-25f).bits, 0x0400);       // tie below it: even is 0x400
    EXPECT_EQ(to_f16(-0.0f).bits, 0x8000);
    EXPECT_EQ(to_f16(65504.0f).bits, 0x7bff);
    EXPECT_EQ(to_f16(65519.0f).bits, 0x7bff);

    // random floats of every magnitude each type holds, against the search
    for (KVType t : kHalfTypes) {
        NearestRef ref(t);
        std::mt19937 rng(7 + int(t));
        std::uniform_real_distribution<float> mant(1.0f, 2.0f);
        int e_lo = t == KVType::bf16 ? -133 : -26, e_hi = t == KVType::bf16 ? 127 : 15;
        std::uniform_int_distribution<int> ex(e_lo, e_hi);
        for (int i = 0; i < 200000; i++) {
            float x = std::ldexp(mant(rng), ex(rng)) * (i % 2 ? -1.0f : 1.0f);
            if (!kv_type_fits(t, x)) {
                continue;
            }
            ASSERT_EQ(bits_of(t, x), ref(x)) << kv_type_name(t) << " x=" << x;
        }
    }
}

TEST(KVType, OverflowIsRefusedNamingTheValueAndRange) {
    EXPECT_TRUE(kv_type_fits(KVType::f16, 65519.99f));
    EXPECT_FALSE(kv_type_fits(KVType::f16, 65520.0f));
    EXPECT_FALSE(kv_type_fits(KVType::f16, -1e6f));
    EXPECT_EQ(to_f16(65520.0f).bits, 0x7c00);                   // what it would become
    EXPECT_TRUE(kv_type_fits(KVType::bf16, 3.3895e38f));
    EXPECT_FALSE(kv_type_fits(KVType::bf16, std::numeric_limits<float>::max()));
    EXPECT_TRUE(kv_type_fits(KVType::f32, std::numeric_limits<float>::max()));

    std::vector<float> x = {1.0f, 2.0f, 70000.0f, 3.0f};
    std::vector<uint16_t> out(4, 0xabcd);
    EXPECT_THROW_MSG(convert_from_float(KVType::f16, x.data(), 4, 2, out.data(), "test"),
                     "70000 at row 1, column 0 does not fit f16");
    EXPECT_EQ(out[0], 0xabcd); // nothing written

    for (const char* s : {"FP16,Flat", "FP16,Sink2,Window4,TopK(Flat)", "FP16,LSHSample4x8"}) {
        SCOPED_TRACE(s);
        auto index = index_factory(4, s);
        auto k = gaussian(10, 4, 1), v = gaussian(10, 4, 2);
        index->add_kv(10, k.data(), v.data());
        v[13] = -1e5f;
        EXPECT_THROW_MSG(index->add_kv(10, k.data(), v.data()), "65504");
        EXPECT_THROW_MSG(index->add_kv(10, k.data(), v.data()), "-100000");
        EXPECT_EQ(index->ntotal, 10); // nothing added
    }
    auto bf = index_factory(4, "BF16,Flat");
    std::vector<float> big(4, 3.4e38f), v(4, 0.0f);
    // refused before bfloat16's range (3.39e38) is reached: kMaxInputMagnitude
    EXPECT_THROW_MSG(bf->add_kv(1, big.data(), v.data()), "kMaxInputMagnitude");
}

TEST(KVType, ArrayChecksAgreeWithTheValueTestsAtEveryPosition) {
    // check_kv_type_fits and add_kv's input check scan the whole array
    // without branches first (vectorized, with a tail): whatever the
    // length and the position of one bad value, they must refuse exactly
    // what the per-value tests refuse, and name its row and column
    const float inf = std::numeric_limits<float>::infinity();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const size_t lengths[] = {1, 3, 4, 5, 8, 15, 16, 17, 33};
    int refused = 0;
    for (KVType t : {KVType::bf16, KVType::f16}) {
        SCOPED_TRACE(kv_type_name(t));
        const uint32_t lim = t == KVType::bf16 ? kBF16Limit : kF16Limit;
        const float edges[] = {bits_float(lim - 1), bits_float(lim), bits_float(lim + 1),
                               -bits_float(lim - 1), -bits_float(lim), inf, -inf, nan,
                               -nan, 0.0f, -0.0f, 1e-40f, std::numeric_limits<float>::max()};
        for (size_t n : lengths) {
            for (size_t at = 0; at < n; at++) {
                for (float e : edges) {
                    std::vector<float> x(n, 0.5f);
                    x[at] = e;
                    if (kv_type_fits(t, e)) {
                        EXPECT_NO_THROW(check_kv_type_fits(t, x.data(), n, 3, "t")) << e;
                    } else {
                        char where[64];
                        std::snprintf(where, sizeof(where), "at row %zu, column %zu", at / 3, at % 3);
                        EXPECT_THROW_MSG(check_kv_type_fits(t, x.data(), n, 3, "t"), where);
                        refused++;
                    }
                }
            }
        }
    }
    EXPECT_GT(refused, 0);
    // add_kv's own check: finite and |x| <= kMaxInputMagnitude
    const float edges[] = {kMaxInputMagnitude, std::nextafter(kMaxInputMagnitude, inf),
                           -kMaxInputMagnitude, -std::nextafter(kMaxInputMagnitude, inf),
                           inf, -inf, nan, 0.0f, 1e-40f};
    for (size_t d : {1, 3, 4, 17}) {
        auto index = index_factory(int(d), "Flat");
        for (size_t rows : {1, 2, 5}) {
            for (size_t at = 0; at < rows * d; at++) {
                for (float e : edges) {
                    std::vector<float> k(rows * d, 0.25f), v(rows * d, 0.5f);
                    k[at] = e;
                    const idx_t before = index->ntotal;
                    if (std::fabs(e) <= kMaxInputMagnitude) {
                        EXPECT_NO_THROW(index->add_kv(idx_t(rows), k.data(), v.data())) << e;
                    } else {
                        char where[64];
                        std::snprintf(where, sizeof(where), "at row %zu, column %zu", at / d, at % d);
                        EXPECT_THROW_MSG(index->add_kv(idx_t(rows), k.data(), v.data()), where);
                        EXPECT_EQ(index->ntotal, before);
                    }
                }
            }
        }
    }
}

// ---- kernels at every SIMD level on stored rows ----------------------------

namespace {

/// n rows of dimension d stored as type t (with zeros, signed zeros and
/// values that are fp16 subnormals mixed in), and the same rows as floats.
struct StoredRows {
    KVStorage st;
    std::vector<float> f; // the stored values, widened

    StoredRows(KVType t, size_t n, size_t d, uint64_t seed, float scale = 1.0f)
            : st(d, d, t) {
        std::vector<float> x = gaussian(n, d, seed, scale);
        for (size_t i = 0; i < x.size(); i += 7) {
            x[i] *= i % 3 == 0 ? 1e-6f : i % 3 == 1 ? 0.0f : -0.0f;
        }
        st.append(idx_t(n), x.data(), x.data());
        st.to_float(0, idx_t(n), &f, nullptr);
    }
};

double dot_ref(const float* a, const float* b, size_t d) {
    double s = 0;
    for (size_t j = 0; j < d; j++) {
        s += double(a[j]) * b[j];
    }
    return s;
}

} // namespace

class KVTypeKernels : public kvtest::SimdLevelTest {};

TEST_P(KVTypeKernels, RowKernelsMatchDoubleReferenceOnStoredValues) {
    for (KVType t : {KVType::f32, KVType::bf16, KVType::f16}) {
        for (size_t d : {1, 3, 8, 17, 64, 128, 130}) {
            for (size_t n : {0, 1, 5, 257, 1000}) {
                SCOPED_TRACE(std::string(kv_type_name(t)) + " d=" + std::to_string(d) +
                             " n=" + std::to_string(n));
                StoredRows x(t, n, d, 1 + n + d);
                KVRows rows = x.st.key_rows();
                auto q = gaussian(1, d, 99 + d);
                std::vector<int64_t> ids(n);
                for (size_t i = 0; i < n; i++) {
                    ids[i] = int64_t((i * 7919) % n);
                }
                std::vector<float> s(n), sg(n);
                inner_products_scaled(q.data(), rows, n, 0.5f, s.data());
                inner_products_by_ids(q.data(), rows, ids.data(), n, 0.5f, sg.data());
                // float accumulation over d terms of magnitude ~1
                double tol = 1e-5 * std::sqrt(double(d)) + 1e-6;
                for (size_t i = 0; i < n; i++) {
                    ASSERT_NEAR(s[i], 0.5 * dot_ref(q.data(), &x.f[i * d], d), tol);
                    ASSERT_NEAR(sg[i], 0.5 * dot_ref(q.data(), &x.f[ids[i] * d], d), tol);
                }
                auto w = gaussian(1, n, 4 + n);
                std::vector<float> out(d, 1.0f), outg(d, 2.0f);
                weighted_sum(w.data(), rows, n, out.data());
                weighted_sum_by_ids(w.data(), rows, ids.data(), n, outg.data());
                for (size_t j = 0; j < d; j++) {
                    double r = 0, rg = 0;
                    for (size_t i = 0; i < n; i++) {
                        r += double(w[i]) * x.f[i * d + j];
                        rg += double(w[i]) * x.f[ids[i] * d + j];
                    }
                    double tol_w = 1e-5 * std::sqrt(double(n)) + 1e-6;
                    ASSERT_NEAR(out[j], r, tol_w);
                    ASSERT_NEAR(outg[j], rg, tol_w);
                }
                // attention: values are the same rows
                std::vector<float> att(d);
                float lse = dense_attention(
                        q.data(), rows, x.st.value_rows(), n, float(1 / std::sqrt(double(d))),
                        att.data());
                if (n > 0) {
                    std::vector<double> ref;
                    double ref_lse = kvtest::ref_attention_all(
                            q.data(), x.f.data(), x.f.data(), d, d, idx_t(n), ref);
                    EXPECT_NEAR(lse, ref_lse, 2e-6 * std::abs(ref_lse) + 1e-4);
                    EXPECT_LT(kvtest::rel_max_err(att.data(), ref), 1e-4);
                } else {
                    EXPECT_EQ(lse, -std::numeric_limits<float>::infinity());
                }
                // fused top-k: the k best by the reference, ties to the smaller id
                size_t k = std::min<size_t>(n, 10);
                std::vector<float> hs(k);
                std::vector<int64_t> hi(k);
                size_t filled = 0;
                topk_inner_products(q.data(), rows, n, nullptr, 0, k, hs.data(), hi.data(), &filled);
                topk_heap_sort(hs.data(), hi.data(), filled);
                ASSERT_EQ(filled, k);
                std::vector<kvtest::idx_t> ref_ids = kvtest::ref_topk(
                        q.data(), x.f.data(), d, idx_t(n), idx_t(k));
                for (size_t j = 0; j < k; j++) {
                    // equal up to float rounding of near-ties: compare scores
                    EXPECT_NEAR(hs[j], dot_ref(q.data(), &x.f[ref_ids[j] * d], d), 2 * tol);
                }
            }
        }
    }
}

TEST_P(KVTypeKernels, HalfLoadHandlesInfNanAndSubnormals) {
    // every 16-bit pattern, in rows of 130 (vector body and scalar tail),
    // weighted by one-hot weights: the kernel's widening equals to_float
    for (KVType t : kHalfTypes) {
        size_t d = 130;
        std::vector<uint16_t> bits(0x10000 + d);
        for (size_t i = 0; i < bits.size(); i++) {
            bits[i] = uint16_t(i);
        }
        size_t n = 0x10000 / d;
        float one = 1.0f;
        for (size_t i = 0; i < n; i++) {
            std::vector<float> out(d);
            weighted_sum(&one, KVRows(bits.data() + i * d, d, t), 1, out.data());
            for (size_t j = 0; j < d; j++) {
                float want = value_of(t, bits[i * d + j]);
                if (std::isnan(want)) {
                    ASSERT_TRUE(std::isnan(out[j]));
                } else {
                    ASSERT_EQ(out[j], want) << kv_type_name(t) << " bits " << bits[i * d + j];
                }
            }
        }
    }
}

namespace {
/// Every finite half (subnormals, zeros and normals of both signs) and its
/// value, computed from the IEEE layout rather than by to_float.
struct FiniteHalves {
    std::vector<f16_t> row;
    std::vector<float> value;
    FiniteHalves() {
        for (uint32_t bits = 0; bits < 0x10000; bits++) {
            uint32_t e = (bits >> 10) & 0x1f, m = bits & 0x3ff;
            if (e == 0x1f) {
                continue;
            }
            float mag = e == 0 ? std::ldexp(float(m), -24)
                               : std::ldexp(1.0f + float(m) / 1024, int(e) - 15);
            row.push_back(f16_t{uint16_t(bits)});
            value.push_back(bits & 0x8000 ? -mag : mag);
        }
    }
};
} // namespace

#if defined(__x86_64__) || defined(__i386__)
namespace {
/// Sets MXCSR's denormals-are-zero and flush-to-zero bits, as a host built
/// with -ffast-math runs, and gives the caller's MXCSR back on scope exit.
struct DenormalsAreZero {
    unsigned saved = _mm_getcsr();
    DenormalsAreZero() {
        _mm_setcsr(saved | 0x8040u);
    }
    ~DenormalsAreZero() {
        _mm_setcsr(saved);
    }
};
} // namespace
#endif

// A half below 2^-14 (subnormal) is a normal float: widening it must not go
// through a float subnormal, which DAZ reads as zero. Every finite half is
// checked, so this is also the exhaustive test of the vector widening.
TEST_P(KVTypeKernels, Fp16SubnormalsWidenExactlyUnderDenormalsAreZero) {
#if defined(__x86_64__) || defined(__i386__)
    // every finite half, and the smallest subnormal again for an odd
    // length: the scalar tails run
    FiniteHalves halves;
    std::vector<f16_t>& row = halves.row;
    std::vector<float>& expected = halves.value;
    row.push_back(f16_t{0x0001});
    expected.push_back(std::ldexp(1.0f, -24));
    size_t d = row.size();
    ASSERT_EQ(d % 2, 1u);

    std::vector<float> summed(d), converted(d), scalar(d);
    const float one = 1.0f;
    {
        DenormalsAreZero daz;
        weighted_sum(&one, KVRows(row.data(), d, KVType::f16), 1, summed.data());
        convert_to_float(KVType::f16, row.data(), d, converted.data());
        for (size_t j = 0; j < d; j++) {
            scalar[j] = to_float(row[j]);
        }
    }
    for (size_t j = 0; j < d; j++) {
        char name[16];
        std::snprintf(name, sizeof(name), "half 0x%04x", unsigned(row[j].bits));
        SCOPED_TRACE(name);
        ASSERT_EQ(summed[j], expected[j]); // a sum's zero may lose its sign
        ASSERT_EQ(float_bits(converted[j]), float_bits(expected[j]));
        ASSERT_EQ(float_bits(scalar[j]), float_bits(expected[j]));
    }
#else
    GTEST_SKIP() << "MXCSR is x86 only";
#endif
}

// Rows known finite (KVStorage's) take a shorter widening at the generic
// level (kernels_body.h, f16_finite_t), while DAZ is off. Every finite half
// must still read as itself, with DAZ on or off, and every kernel must give
// the bits it gives on the same rows not marked finite.
TEST_P(KVTypeKernels, FiniteFp16RowsReadExactlyAndAsUnmarkedRows) {
    const FiniteHalves halves;
    const std::vector<f16_t>& row = halves.row;
    const std::vector<float>& expected = halves.value;
    const float one = 1.0f;
    for (bool daz : {false, true}) {
        SCOPED_TRACE(daz ? "DAZ on" : "DAZ off");
        KVRows r(row.data(), row.size(), KVType::f16);
        r.finite = true;
        std::vector<float> summed(row.size());
#if defined(__x86_64__) || defined(__i386__)
        std::unique_ptr<DenormalsAreZero> guard(daz ? new DenormalsAreZero : nullptr);
#else
        if (daz) {
            continue;
        }
#endif
        weighted_sum(&one, r, 1, summed.data());
        for (size_t j = 0; j < row.size(); j++) {
            ASSERT_EQ(summed[j], expected[j]) << "half 0x" << std::hex << row[j].bits;
        }
    }

    const size_t n = 1000, g = 3;
    for (size_t d : {3, 64, 130}) {
        SCOPED_TRACE("d=" + std::to_string(d));
        StoredRows x(KVType::f16, n, d, 7 + d, 4.0f); // subnormals among them
        KVRows marked = x.st.key_rows(), values = x.st.value_rows();
        ASSERT_TRUE(marked.finite && values.finite);
        KVRows plain = marked, plain_values = values;
        plain.finite = plain_values.finite = false;
        auto q = gaussian(g, d, 11 + d);
        std::vector<int64_t> ids(n);
        for (size_t i = 0; i < n; i++) {
            ids[i] = int64_t((i * 7919) % n);
        }
        auto w = gaussian(1, n, 13);
        auto both = [&](auto run) {
            std::vector<float> a = run(marked, values), b = run(plain, plain_values);
            ASSERT_EQ(a.size(), b.size());
            for (size_t i = 0; i < a.size(); i++) {
                ASSERT_EQ(float_bits(a[i]), float_bits(b[i])) << "element " << i;
            }
        };
        both([&](KVRows k, KVRows) {
            std::vector<float> s(n);
            inner_products_scaled(q.data(), k, n, 0.5f, s.data());
            return s;
        });
        both([&](KVRows k, KVRows) {
            std::vector<float> s(n);
            inner_products_by_ids(q.data(), k, ids.data(), n, 0.5f, s.data());
            return s;
        });
        both([&](KVRows, KVRows v) {
            std::vector<float> o(d);
            weighted_sum(w.data(), v, n, o.data());
            return o;
        });
        both([&](KVRows, KVRows v) {
            std::vector<float> o(d);
            weighted_sum_by_ids(w.data(), v, ids.data(), n, o.data());
            return o;
        });
        both([&](KVRows k, KVRows v) {
            std::vector<float> o(d + 1);
            o[d] = dense_attention(q.data(), k, v, n, 0.125f, o.data());
            return o;
        });
        both([&](KVRows k, KVRows v) {
            std::vector<float> o(g * d + g);
            dense_attention_group(q.data(), g, k, v, n, 0.125f, o.data(), o.data() + g * d);
            return o;
        });
        both([&](KVRows k, KVRows) {
            size_t kk = 10, filled = 0;
            std::vector<float> hs(kk);
            std::vector<int64_t> hi(kk);
            topk_inner_products(q.data(), k, n, nullptr, 0, kk, hs.data(), hi.data(), &filled);
            topk_heap_sort(hs.data(), hi.data(), filled);
            for (size_t j = 0; j < filled; j++) {
                hs.push_back(float(hi[j]));
            }
            return hs;
        });
    }
}

KVTEST_AT_EVERY_SIMD_LEVEL(KVTypeKernels);

// ---- every index type: bf16 / fp16 storage vs the same index in float32 ----

namespace {

constexpr int kD = 64;
constexpr int kDv = 48;
constexpr idx_t kN = 1500;
constexpr idx_t kQ = 8;

struct TypeCase {
    const char* factory;
    const char* full_budget; ///< parameters that make every token selected
};

// Every registry type, with the knobs that make it read every token (so
// that rounding cannot change the selection, only the scores and values).
const TypeCase kTypeCases[] = {
        {"Flat", ""},
        {"TopK(Flat)", "k=1000000"},
        {"TopK(IVF16,Flat)", "k=1000000"},
        {"TopK(HNSW16)", "k=1000000"},
        {"LSHSample8x20", "min_hits=0"},
        {"Sink4,Window64,Flat", ""},
        {"Sink4,Window64,TopK(HNSW16)", "k=1000000"},
        {"ProxyEvict30_H2O,TopK(Flat)", "budget=1000000,k=1000000"},
        {"ProxyEvict20,Sink4,Window64,LSHSample8x20", "budget=1000000,min_hits=0"},
};

struct Tokens {
    // keys with a shared offset (LLM-like); queries from another seed
    std::vector<float> keys = gaussian(kN, kD, 501, 1.0f, 0.5f);
    std::vector<float> values = gaussian(kN, kDv, 502);
    std::vector<float> prefill_q = gaussian(kN, kD, 503, 1.5f);
    std::vector<float> q = gaussian(kQ, kD, 504, 2.0f);
};

const Tokens& tokens() {
    static const Tokens t;
    return t;
}

std::unique_ptr<KVIndex> build_index(const std::string& s, const char* params) {
    const Tokens& t = tokens();
    auto index = index_factory(kD, s, kDv);
    if (params && *params) {
        set_index_parameters(index.get(), params);
    }
    idx_t n_prompt = kN - 100;
    PrefillInput in;
    in.n_tokens = n_prompt;
    in.keys = t.keys.data();
    in.values = t.values.data();
    in.n_queries = 64;
    in.queries = t.prefill_q.data();
    index->prefill(in);
    for (idx_t i = n_prompt; i < kN; i++) { // decode appends
        index->add_kv(1, t.keys.data() + i * kD, t.values.data() + i * kDv);
    }
    return index;
}

/** The bound on |o~_c - o_c| for attention over keys and values rounded
 * with unit roundoff u (bf16 2^-8, fp16 2^-11):
 *   each stored element is x (1 + delta), |delta| <= u, so the score error
 *   is |ds_i| <= u * sum_j |q_j k_ij| / sqrt(d) <= eps := u * max_i a_i;
 *   the softmax weights then move by a factor within e^{+-2 eps}, so
 *   |p~_i - p_i| <= (e^{2 eps} - 1) p_i (summing to e^{2 eps} - 1), and the
 *   values add u |v_ic|:
 *   |o~_c - o_c| <= (e^{2 eps} - 1 + u (1 + e^{2 eps} - 1)) max_i |v_ic|,
 *   and |lse~ - lse| <= eps;
 * plus float32 arithmetic in both (1e-5 relative, as the other tests).
 * The bound is for attention over the same set of tokens: the test gives
 * every type its full budget. */
struct Bound {
    double out, lse;
};
Bound rounding_bound(KVType t, const float* q) {
    const Tokens& tk = tokens();
    double u = t == KVType::bf16 ? 0x1p-8 : 0x1p-11;
    double amax = 0, vmax = 0;
    for (idx_t i = 0; i < kN; i++) {
        double a = 0;
        for (int j = 0; j < kD; j++) {
            a += std::fabs(double(q[j]) * tk.keys[i * kD + j]);
        }
        amax = std::max(amax, a / std::sqrt(double(kD)));
    }
    for (float v : tk.values) {
        vmax = std::max(vmax, double(std::fabs(v)));
    }
    double eps = u * amax;
    double g = std::expm1(2 * eps);
    return {(g + u * (1 + g)) * vmax + 1e-5 * vmax, eps + 1e-5 * std::max(1.0, eps)};
}

} // namespace

TEST(KVTypeIndexes, HalfStorageWithinRoundingBoundOfFloat32) {
    const Tokens& t = tokens();
    std::printf("%-48s %5s %12s %12s %12s\n", "index (full budget)", "type", "max|do|",
                "bound", "max|dlse|");
    for (const TypeCase& c : kTypeCases) {
        auto ref = build_index(c.factory, c.full_budget);
        std::vector<float> ref_out(kQ * kDv), ref_lse(kQ);
        ref->attend(kQ, t.q.data(), ref_out.data(), ref_lse.data());
        for (KVType type : kHalfTypes) {
            std::string s = std::string(kv_type_prefix(type)) + c.factory;
            SCOPED_TRACE(s);
            auto index = build_index(s, c.full_budget);
            EXPECT_EQ(index_factory_string(index.get()), s);
            EXPECT_EQ(index->kv_type, type);
            std::vector<float> out(kQ * kDv), lse(kQ);
            index->attend(kQ, t.q.data(), out.data(), lse.data());
            double worst = 0, worst_lse = 0, worst_bound = 0;
            for (idx_t i = 0; i < kQ; i++) {
                Bound b = rounding_bound(type, t.q.data() + i * kD);
                for (int c2 = 0; c2 < kDv; c2++) {
                    double e = std::fabs(double(out[i * kDv + c2]) - ref_out[i * kDv + c2]);
                    EXPECT_LE(e, b.out) << "query " << i << " column " << c2;
                    worst = std::max(worst, e);
                }
                double el = std::fabs(double(lse[i]) - ref_lse[i]);
                EXPECT_LE(el, b.lse) << "query " << i;
                worst_lse = std::max(worst_lse, el);
                worst_bound = std::max(worst_bound, b.out);
            }
            std::printf("%-48s %5s %12.3e %12.3e %12.3e\n", c.factory, kv_type_name(type),
                        worst, worst_bound, worst_lse);
            // keys read back as stored: the float key rounded
            std::vector<float> key(kD);
            index->reconstruct(kN - 1, key.data());
            for (int j = 0; j < kD; j++) {
                EXPECT_EQ(key[j], round_to(type, t.keys[(kN - 1) * kD + j]));
            }
        }
    }
}

TEST(KVTypeIndexes, ErrorVsFloat32ExactPerIndex) {
    // Reported, not asserted (approximate indexes at their default budgets):
    // relative error of each index vs exact float32 attention in double,
    // stored in float32, bf16 and fp16. The storage's share is the
    // difference between the columns.
    const Tokens& t = tokens();
    std::vector<double> ref_all(kQ * kDv);
    for (idx_t i = 0; i < kQ; i++) {
        std::vector<double> r;
        kvtest::ref_attention_all(t.q.data() + i * kD, t.keys.data(), t.values.data(), kD, kDv,
                                  kN, r);
        std::copy(r.begin(), r.end(), ref_all.begin() + i * kDv);
    }
    std::printf("relative L2 error vs fp32-exact attention (mean over %d queries)\n", int(kQ));
    std::printf("%-48s %12s %12s %12s\n", "index (default knobs)", "f32", "bf16", "f16");
    for (const TypeCase& c : kTypeCases) {
        std::printf("%-48s", c.factory);
        for (KVType type : {KVType::f32, KVType::bf16, KVType::f16}) {
            auto index = build_index(std::string(kv_type_prefix(type)) + c.factory, "");
            std::vector<float> out(kQ * kDv);
            index->attend(kQ, t.q.data(), out.data(), nullptr);
            double mean = 0;
            for (idx_t i = 0; i < kQ; i++) {
                double num = 0, den = 0;
                for (int j = 0; j < kDv; j++) {
                    double r = ref_all[i * kDv + j];
                    num += (out[i * kDv + j] - r) * (out[i * kDv + j] - r);
                    den += r * r;
                }
                mean += std::sqrt(num / den) / kQ;
            }
            std::printf(" %12.3e", mean);
            EXPECT_TRUE(std::isfinite(mean));
        }
        std::printf("\n");
    }
}

TEST(KVTypeIndexes, MemoryIsTwoBytesPerElement) {
    for (const char* s : {"Flat", "TopK(HNSW16)", "Sink4,Window64,Flat", "LSHSample8x20"}) {
        SCOPED_TRACE(s);
        auto f32 = build_index(s, "");
        auto bf16 = build_index(std::string("BF16,") + s, "");
        auto f16 = build_index(std::string("FP16,") + s, "");
        size_t token_bytes = size_t(kN) * (kD + kDv) * 2; // saved by halving
        EXPECT_LE(bf16->memory_bytes() + token_bytes, f32->memory_bytes() + token_bytes / 4);
        EXPECT_EQ(bf16->memory_bytes(), f16->memory_bytes());
    }
}

TEST(KVTypeIndexes, FactoryPrefixAndIo) {
    for (const char* s : {"BF16,Flat", "FP16,Sink4,Window8,TopK(IVF4,Flat)",
                          "BF16,ProxyEvict20", "FP16,ProxyEvict20,LSHSample6x20"}) {
        SCOPED_TRACE(s);
        auto index = index_factory(8, s);
        EXPECT_EQ(index_factory_string(index.get()), s);
        for (const KVIndex* c : index->children()) {
            EXPECT_EQ(c->kv_type, index->kv_type); // the whole chain
        }
        auto again = index_factory(8, index_factory_string(index.get()));
        EXPECT_EQ(index_factory_string(again.get()), s);
        std::vector<uint8_t> buf;
        write_index(index.get(), &buf);
        EXPECT_EQ(index_factory_string(read_index(buf).get()), s);
    }
    // ProxyEvict's default inner Flat gets the type too
    EXPECT_EQ(index_factory(8, "BF16,ProxyEvict20")->children()[0]->kv_type, KVType::bf16);
    // the prefix leads the string, once
    EXPECT_THROW_MSG(index_factory(8, "Flat,BF16"), "BF16");
    EXPECT_THROW_MSG(index_factory(8, "BF16,FP16,Flat"), "FP16");
    EXPECT_THROW_MSG(index_factory(8, "Sink4,BF16,Flat"), "BF16");
    EXPECT_THROW_MSG(index_factory(8, "BF16"), "BF16");
    // parameters follow as usual
    auto p = index_factory(8, "FP16,TopK(IVF4,Flat)|k=5,nprobe=2");
    EXPECT_EQ(index_factory_string(p.get()), "FP16,TopK(IVF4,Flat)");
    EXPECT_EQ(get_index_parameter(p.get(), "k"), 5);
}

TEST(KVTypeIndexes, ForgedStorageTypeRefused) {
    auto index = index_factory(4, "BF16,Flat");
    auto k = gaussian(3, 4, 1), v = gaussian(3, 4, 2);
    index->add_kv(3, k.data(), v.data());
    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);
    // the storage type byte is the last KVIndex field: header 20, fourcc 4,
    // record version 4, then 4 + 4 + 8 + 8 + 1 + 1 + 8 + 1 bytes
    size_t at = 20 + 8 + 35;
    ASSERT_EQ(buf[at], uint8_t(KVType::bf16));
    for (uint8_t forged : {uint8_t(KVType::f32), uint8_t(3), uint8_t(255)}) {
        std::vector<uint8_t> bad = buf;
        bad[at] = forged;
        // fix the checksum so that the parser has to catch it
        uint32_t crc = crc32(bad.data() + 20, bad.size() - 20);
        std::memcpy(bad.data() + 16, &crc, 4);
        EXPECT_ANY_THROW(read_index(bad)) << int(forged);
    }
}

// A half-precision record whose stored bits add_kv could not have made (an
// all-ones exponent: Inf or NaN; a bf16 above kMaxInputMagnitude) is refused
// by read, naming the row, the column and the type; an in-range record reads.
TEST(KVTypeIndexes, StoredHalfValuesAreCheckedOnRead) {
    struct Case {
        KVType type;
        uint16_t bits;
        const char* part;
    };
    const Case cases[] = {
            {KVType::bf16, 0x7f80, "non-finite value inf"},
            {KVType::bf16, 0x7fc1, "non-finite value nan"},
            {KVType::bf16, 0x5f80, "too large a value"}, // 2^64 > 1e12
            {KVType::f16, 0x7c00, "non-finite value inf"},
            {KVType::f16, 0xfc00, "non-finite value -inf"},
            {KVType::bf16, 0x3f80, nullptr}, // 1.0 reads back
            {KVType::f16, 0x7bff, nullptr},  // 65504, the largest finite fp16
    };
    const size_t d = 4, n = 3;
    for (const Case& c : cases) {
        // keys: 3 tokens of 1.0 but for row 2, column 1; values all 1.0
        const uint16_t one = c.type == KVType::bf16 ? 0x3f80 : 0x3c00;
        std::vector<uint16_t> keys(n * d, one), values(n * d, one);
        keys[2 * d + 1] = c.bits;
        std::vector<uint8_t> buf;
        BufferWriter w(&buf);
        w.value<uint64_t>(keys.size());
        w.bytes(keys.data(), keys.size() * 2);
        w.value<uint64_t>(values.size());
        w.bytes(values.data(), values.size() * 2);
        BufferReader r(buf.data(), buf.size());
        KVStorage back(d, d, c.type);
        SCOPED_TRACE(std::string(kv_type_name(c.type)) + " bits " + std::to_string(c.bits));
        if (c.part == nullptr) {
            back.read(r, "test");
            std::vector<float> k(d);
            back.key(2, k.data());
            EXPECT_EQ(k[1], c.type == KVType::bf16 ? 1.0f : 65504.0f);
            continue;
        }
        std::string msg = kvtest::faiss_error([&] { back.read(r, "test"); });
        EXPECT_NE(msg.find(c.part), std::string::npos) << msg;
        EXPECT_NE(msg.find(std::string("(") + kv_type_name(c.type) + ")"), std::string::npos) << msg;
        EXPECT_NE(msg.find("row 2, column 1"), std::string::npos) << msg;
    }
}

// Large token arrays sit on 2 MiB-aligned blocks advised for huge pages; the
// rows survive growth across the small / large boundary, and the front and
// back trims, exactly (compared with the floats appended).
TEST(KVStorage, LargeArraysAreHugePageAlignedAndKeepTheirRows) {
    void* small = allocate_rows(100);
    void* large = allocate_rows(kHugePageMinBytes + 1);
    ASSERT_NE(small, nullptr);
    ASSERT_NE(large, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(large) % kHugePageBytes, 0u);
    std::memset(large, 1, kHugePageMinBytes + 1); // every byte is ours
    free_rows(small, 100);
    free_rows(large, kHugePageMinBytes + 1);
    free_rows(nullptr, 0);
    // a size within a page of SIZE_MAX used to round to 0 and return a block
    EXPECT_THROW(allocate_rows(std::numeric_limits<size_t>::max()), std::bad_alloc);
    EXPECT_THROW(allocate_rows(std::numeric_limits<size_t>::max() - kHugePageBytes / 2),
                 std::bad_alloc);

    const size_t d = 64, dv = 32, per_key = d * sizeof(float);
    const idx_t n = idx_t(kHugePageMinBytes / per_key) * 3 / 2; // crosses the threshold
    std::vector<float> k = gaussian(size_t(n), d, 11), v = gaussian(size_t(n), dv, 12);
    KVStorage s(d, dv, KVType::f32);
    for (idx_t i0 = 0; i0 < n; i0 += 5000) {
        idx_t m = std::min<idx_t>(5000, n - i0);
        s.append(m, k.data() + i0 * d, v.data() + i0 * dv);
    }
    ASSERT_EQ(s.size(), n);
    EXPECT_GE(s.keys.capacity(), kHugePageMinBytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(s.keys.data()) % kHugePageBytes, 0u);
    EXPECT_EQ(std::memcmp(s.keys.data(), k.data(), size_t(n) * per_key), 0);
    EXPECT_EQ(std::memcmp(s.values.data(), v.data(), size_t(n) * dv * sizeof(float)), 0);
    s.erase_front(1000);
    s.truncate(n - 2000);
    ASSERT_EQ(s.size(), n - 2000);
    std::vector<float> row(d);
    for (idx_t i : {idx_t(0), n / 2, n - 2001}) {
        s.key(i, row.data());
        EXPECT_EQ(std::memcmp(row.data(), k.data() + (i + 1000) * d, per_key), 0) << i;
    }
}

}  // namespace test_kv_type
