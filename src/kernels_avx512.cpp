// Kernels for the avx512 instruction set; see kernels_body.h.
#define KVINDEX_SIMD_NS simd_avx512
#define KVINDEX_SIMD_BYTES 64
#include "kernels_body.h"
