#pragma once

#include <cstddef>
#include <cstdint>

namespace kvindex {

/// One entry per kernel of kernels.h; one table per instruction set.
struct KernelTable {
    void (*inner_products_scaled)(const float*, const float*, size_t, size_t, float, float*);
    void (*inner_products_by_ids)(
            const float*, const float*, size_t, const int64_t*, size_t, float, float*);
    float (*softmax_inplace)(float*, const float*, size_t);
    void (*weighted_sum)(const float*, const float*, size_t, size_t, float*);
    void (*weighted_sum_by_ids)(const float*, const float*, size_t, const int64_t*, size_t, float*);
    float (*dense_attention)(
            const float*, const float*, const float*, size_t, size_t, size_t, float, float*);
    void (*topk_inner_products)(
            const float*, const float*, size_t, size_t, const int64_t*, int64_t, size_t,
            float*, int64_t*, size_t*);
    void (*dense_attention_group)(
            const float*, size_t, const float*, const float*, size_t, size_t, size_t, float,
            float*, float*);
};

namespace simd_generic {
extern const KernelTable table;
}
namespace simd_avx2 {
extern const KernelTable table;
}
namespace simd_avx512 {
extern const KernelTable table;
}

} // namespace kvindex
