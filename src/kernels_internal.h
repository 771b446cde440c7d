#pragma once

#include <cstddef>
#include <cstdint>

#include <kvindex/kv_type.h>

namespace kvindex {

/** The kernels of kernels.h that read stored rows (keys, values), for one
 * storage type: the rows arrive untyped and are read as that type. A new
 * row-reading kernel gets an entry here and one template instance per type
 * (kernels_body.h, row_kernels). */
struct RowKernels {
    void (*inner_products_scaled)(const float*, const void*, size_t, size_t, float, float*);
    void (*inner_products_by_ids)(
            const float*, const void*, size_t, const int64_t*, size_t, float, float*);
    void (*weighted_sum)(const float*, const void*, size_t, size_t, float*);
    void (*weighted_sum_by_ids)(const float*, const void*, size_t, const int64_t*, size_t, float*);
    float (*dense_attention)(
            const float*, const void*, const void*, size_t, size_t, size_t, float, float*);
    void (*topk_inner_products)(
            const float*, const void*, size_t, size_t, const int64_t*, int64_t, size_t,
            float*, int64_t*, size_t*);
    void (*dense_attention_group)(
            const float*, size_t, const void*, const void*, size_t, size_t, size_t, float,
            float*, float*);
};

/// One table per instruction set.
struct KernelTable {
    float (*softmax_inplace)(float*, const float*, size_t);
    double (*inclusion_pass)(const float*, size_t, double, size_t*, size_t*);
    void (*inner_products_multi)(const float*, size_t, const float*, size_t, size_t, float*, size_t);
    RowKernels rows[kNumKVTypes]; ///< indexed by KVType
    /** fp16 rows known finite (KVRows::finite), read while denormals are
     * read as themselves (no DAZ): the generic level widens them in two
     * integer steps and a multiply; the others hold rows[f16] here. */
    RowKernels f16_finite;
    /// gathered rows of 8-bit codes (KeyCodes8): the RowKernels entry for uint8_t
    void (*inner_products_u8_by_ids)(
            const float*, const void*, size_t, const int64_t*, size_t, float, float*);
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
