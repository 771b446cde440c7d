#include <kvindex/kernels.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <cstdlib>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__SSE2__)
#include <xmmintrin.h>
#endif

#include <faiss/impl/FaissAssert.h>

#include "kernels_internal.h"

namespace kvindex {

namespace {

#if defined(__x86_64__) || defined(__i386__)
/// CPUID leaf 1, ECX bit 29: clang's __builtin_cpu_supports (the fuzz
/// build) does not know "f16c"
bool cpu_has_f16c() {
    unsigned eax, ebx, ecx, edx;
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
}
#endif

bool cpu_supports(SimdLevel level) {
    switch (level) {
        case SimdLevel::generic:
            return true;
#if defined(__x86_64__) || defined(__i386__)
        case SimdLevel::avx2:
            // F16C converts stored fp16 rows; every AVX2 CPU has it
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    cpu_has_f16c();
        case SimdLevel::avx512:
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
#endif
        default:
            return false;
    }
}

SimdLevel parse_level(const std::string& s) {
    if (s == "generic") {
        return SimdLevel::generic;
    }
    if (s == "avx2") {
        return SimdLevel::avx2;
    }
    if (s == "avx512") {
        return SimdLevel::avx512;
    }
    FAISS_THROW_FMT(
            "KVINDEX_SIMD=%s: expected generic, avx2 or avx512", s.c_str());
}

SimdLevel best_level() {
    if (const char* env = std::getenv("KVINDEX_SIMD")) {
        SimdLevel level = parse_level(env);
        FAISS_THROW_IF_NOT_FMT(
                cpu_supports(level),
                "KVINDEX_SIMD=%s: this CPU cannot run it",
                env);
        return level;
    }
    for (SimdLevel l : {SimdLevel::avx512, SimdLevel::avx2}) {
        if (cpu_supports(l)) {
            return l;
        }
    }
    return SimdLevel::generic;
}

const KernelTable* table_of(SimdLevel level) {
    switch (level) {
        case SimdLevel::avx512:
            return &simd_avx512::table;
        case SimdLevel::avx2:
            return &simd_avx2::table;
        default:
            return &simd_generic::table;
    }
}

std::atomic<int> current_level{-1};

const KernelTable& kernels() {
    int l = current_level.load(std::memory_order_relaxed);
    if (l < 0) {
        l = int(best_level());
        current_level.store(l, std::memory_order_relaxed);
    }
    return *table_of(SimdLevel(l));
}

} // namespace

const char* simd_level_name(SimdLevel level) {
    switch (level) {
        case SimdLevel::avx2:
            return "avx2";
        case SimdLevel::avx512:
            return "avx512";
        default:
            return "generic";
    }
}

std::vector<SimdLevel> available_simd_levels() {
    std::vector<SimdLevel> levels;
    for (SimdLevel l : {SimdLevel::generic, SimdLevel::avx2, SimdLevel::avx512}) {
        if (cpu_supports(l)) {
            levels.push_back(l);
        }
    }
    return levels;
}

SimdLevel get_simd_level() {
    kernels();
    return SimdLevel(current_level.load());
}

void set_simd_level(SimdLevel level) {
    FAISS_THROW_IF_NOT_FMT(
            level == SimdLevel::generic || level == SimdLevel::avx2 || level == SimdLevel::avx512,
            "set_simd_level: %d is no SimdLevel",
            int(level));
    FAISS_THROW_IF_NOT_FMT(
            cpu_supports(level),
            "set_simd_level: this CPU cannot run %s",
            simd_level_name(level));
    current_level.store(int(level));
}

namespace {

/// Whether the FPU reads float subnormals as themselves: MXCSR's
/// denormals-are-zero bit clear (x86; elsewhere unknown, so no).
bool denormals_read_exactly() {
#if defined(__SSE2__)
    return (_mm_getcsr() & 0x0040u) == 0;
#else
    return false;
#endif
}

/// The kernels for rows x (and y, read in the same call).
const RowKernels& row_kernels(const KVRows& x, const KVRows* y = nullptr) {
    FAISS_THROW_IF_NOT_FMT(
            unsigned(x.type) < unsigned(kNumKVTypes),
            "kernels: invalid KV storage type %d",
            int(x.type));
    const KernelTable& t = kernels();
    if (x.type == KVType::f16 && x.finite && (!y || y->finite) && denormals_read_exactly()) {
        return t.f16_finite;
    }
    return t.rows[int(x.type)];
}

const RowKernels& f32_kernels() {
    return kernels().rows[int(KVType::f32)];
}

} // namespace

void inner_products_scaled(
        const float* q, const float* x, size_t d, size_t n, float scale, float* s) {
    f32_kernels().inner_products_scaled(q, x, d, n, scale, s);
}

void inner_products_by_ids(
        const float* q,
        const float* x,
        size_t d,
        const int64_t* ids,
        size_t n,
        float scale,
        float* s) {
    f32_kernels().inner_products_by_ids(q, x, d, ids, n, scale, s);
}

void inner_products_by_ids(
        const float* q,
        const uint8_t* codes,
        size_t d,
        const int64_t* ids,
        size_t n,
        float scale,
        float* s) {
    kernels().inner_products_u8_by_ids(q, codes, d, ids, n, scale, s);
}

void inner_products_multi(
        const float* q, size_t g, const float* x, size_t d, size_t n, float* s, size_t ld) {
    kernels().inner_products_multi(q, g, x, d, n, s, ld);
}

float softmax_inplace(float* s, const float* bias, size_t n) {
    return kernels().softmax_inplace(s, bias, n);
}

double inclusion_pass(const float* w, size_t n, double c, size_t* sure, size_t* positive) {
    size_t s = 0, p = 0;
    double light = kernels().inclusion_pass(w, n, c, &s, &p);
    if (sure) {
        *sure = s;
    }
    if (positive) {
        *positive = p;
    }
    return light;
}

void weighted_sum(const float* w, const float* v, size_t dv, size_t n, float* out) {
    f32_kernels().weighted_sum(w, v, dv, n, out);
}

void weighted_sum_by_ids(
        const float* w,
        const float* v,
        size_t dv,
        const int64_t* ids,
        size_t n,
        float* out) {
    f32_kernels().weighted_sum_by_ids(w, v, dv, ids, n, out);
}

float dense_attention(
        const float* q,
        const float* keys,
        const float* values,
        size_t d,
        size_t dv,
        size_t n,
        float scale,
        float* out) {
    return f32_kernels().dense_attention(q, keys, values, d, dv, n, scale, out);
}

void dense_attention_group(
        const float* q,
        size_t g,
        const float* keys,
        const float* values,
        size_t d,
        size_t dv,
        size_t n,
        float scale,
        float* out,
        float* lse) {
    f32_kernels().dense_attention_group(q, g, keys, values, d, dv, n, scale, out, lse);
}

void topk_inner_products(
        const float* q,
        const float* x,
        size_t d,
        size_t n,
        const int64_t* ids,
        int64_t id0,
        size_t k,
        float* heap_scores,
        int64_t* heap_ids,
        size_t* heap_size) {
    f32_kernels().topk_inner_products(q, x, d, n, ids, id0, k, heap_scores, heap_ids, heap_size);
}

void inner_products_scaled(const float* q, KVRows x, size_t n, float scale, float* s) {
    row_kernels(x).inner_products_scaled(q, x.data, x.dim, n, scale, s);
}

void inner_products_by_ids(
        const float* q, KVRows x, const int64_t* ids, size_t n, float scale, float* s) {
    row_kernels(x).inner_products_by_ids(q, x.data, x.dim, ids, n, scale, s);
}

void weighted_sum(const float* w, KVRows v, size_t n, float* out) {
    row_kernels(v).weighted_sum(w, v.data, v.dim, n, out);
}

void weighted_sum_by_ids(const float* w, KVRows v, const int64_t* ids, size_t n, float* out) {
    row_kernels(v).weighted_sum_by_ids(w, v.data, v.dim, ids, n, out);
}

float dense_attention(
        const float* q, KVRows keys, KVRows values, size_t n, float scale, float* out) {
    FAISS_THROW_IF_NOT_FMT(
            keys.type == values.type,
            "dense_attention: keys stored as %s, values as %s; one type expected",
            kv_type_name(keys.type),
            kv_type_name(values.type));
    return row_kernels(keys, &values).dense_attention(
            q, keys.data, values.data, keys.dim, values.dim, n, scale, out);
}

void dense_attention_group(
        const float* q,
        size_t g,
        KVRows keys,
        KVRows values,
        size_t n,
        float scale,
        float* out,
        float* lse) {
    FAISS_THROW_IF_NOT_FMT(
            keys.type == values.type,
            "dense_attention_group: keys stored as %s, values as %s; one type expected",
            kv_type_name(keys.type),
            kv_type_name(values.type));
    row_kernels(keys, &values).dense_attention_group(
            q, g, keys.data, values.data, keys.dim, values.dim, n, scale, out, lse);
}

void topk_inner_products(
        const float* q,
        KVRows x,
        size_t n,
        const int64_t* ids,
        int64_t id0,
        size_t k,
        float* heap_scores,
        int64_t* heap_ids,
        size_t* heap_size) {
    row_kernels(x).topk_inner_products(
            q, x.data, x.dim, n, ids, id0, k, heap_scores, heap_ids, heap_size);
}

void topk_heap_sort(float* heap_scores, int64_t* heap_ids, size_t heap_size) {
    std::vector<size_t> order(heap_size);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return heap_scores[a] > heap_scores[b] ||
                (heap_scores[a] == heap_scores[b] && heap_ids[a] < heap_ids[b]);
    });
    std::vector<float> s(heap_size);
    std::vector<int64_t> ids(heap_size);
    for (size_t j = 0; j < heap_size; j++) {
        s[j] = heap_scores[order[j]];
        ids[j] = heap_ids[order[j]];
    }
    std::copy(s.begin(), s.end(), heap_scores);
    std::copy(ids.begin(), ids.end(), heap_ids);
}

} // namespace kvindex
