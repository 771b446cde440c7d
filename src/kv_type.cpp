#include <kvindex/kv_type.h>

#include <cmath>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/errors.h>

namespace kvindex {

const char* kv_type_name(KVType t) {
    switch (t) {
        case KVType::bf16:
            return "bf16";
        case KVType::f16:
            return "f16";
        default:
            return "f32";
    }
}

const char* kv_type_prefix(KVType t) {
    switch (t) {
        case KVType::bf16:
            return "BF16,";
        case KVType::f16:
            return "FP16,";
        default:
            return "";
    }
}

namespace {

const char* kv_type_range(KVType t) {
    return t == KVType::bf16 ? "|x| < 0x1.ffp127 = 3.3962e38; bfloat16's largest is 3.3895e38"
                             : "|x| < 65520; fp16's largest is 65504";
}

template <class Convert>
void convert_all(const float* src, size_t n, uint16_t* dst, Convert convert) {
    for (size_t i = 0; i < n; i++) {
        dst[i] = convert(src[i]).bits;
    }
}

} // namespace

void check_kv_type_fits(KVType t, const float* x, size_t n, size_t row_dim, const char* what) {
    if (t == KVType::f32) {
        return;
    }
    // One pass without branches first, which the compiler vectorizes
    // (every add_kv of a 16-bit index runs it): |x| < limit is
    // kv_type_fits' test on the bits (positive floats order as their
    // bits; NaN and infinity compare false). The loop below only finds
    // the culprit.
    const float limit = bits_float(t == KVType::bf16 ? kBF16Limit : kF16Limit);
    unsigned bad = 0;
    for (size_t i = 0; i < n; i++) {
        bad |= !(std::fabs(x[i]) < limit);
    }
    if (bad == 0) {
        return;
    }
    size_t dim = row_dim ? row_dim : 1;
    for (size_t i = 0; i < n; i++) {
        if (!kv_type_fits(t, x[i])) {
            KVINDEX_THROW_FMT(
                    InvalidArgument,
                    "%s: value %g at row %zd, column %zd does not fit %s storage "
                    "(%s): use float32 storage (no BF16/FP16 prefix) or rescale",
                    what,
                    double(x[i]),
                    i / dim,
                    i % dim,
                    kv_type_name(t),
                    kv_type_range(t));
        }
    }
}

void convert_from_float(
        KVType t, const float* src, size_t n, size_t row_dim, void* dst, const char* what) {
    switch (t) {
        case KVType::f32:
            if (n > 0) {
                std::memcpy(dst, src, n * sizeof(float));
            }
            return;
        case KVType::bf16:
            check_kv_type_fits(t, src, n, row_dim, what); // before writing anything
            convert_all(src, n, static_cast<uint16_t*>(dst), [](float x) { return to_bf16(x); });
            return;
        case KVType::f16:
            check_kv_type_fits(t, src, n, row_dim, what);
            convert_all(src, n, static_cast<uint16_t*>(dst), [](float x) { return to_f16(x); });
            return;
    }
    FAISS_THROW_FMT("%s: invalid KV storage type %d", what, int(t));
}

void round_to(KVType t, const float* src, size_t n, float* dst) {
    for (size_t i = 0; i < n; i++) {
        dst[i] = round_to(t, src[i]);
    }
}

void convert_to_float(KVType t, const void* src, size_t n, float* dst) {
    switch (t) {
        case KVType::f32:
            if (n > 0) {
                std::memcpy(dst, src, n * sizeof(float));
            }
            return;
        case KVType::bf16: {
            const uint16_t* s = static_cast<const uint16_t*>(src);
            for (size_t i = 0; i < n; i++) {
                dst[i] = to_float(bf16_t{s[i]});
            }
            return;
        }
        case KVType::f16: {
            const uint16_t* s = static_cast<const uint16_t*>(src);
            for (size_t i = 0; i < n; i++) {
                dst[i] = to_float(f16_t{s[i]});
            }
            return;
        }
    }
    FAISS_THROW_FMT("convert_to_float: invalid KV storage type %d", int(t));
}

} // namespace kvindex
