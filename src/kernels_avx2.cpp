// Kernels for the avx2 instruction set; see kernels_body.h.
#define KVINDEX_SIMD_NS simd_avx2
#define KVINDEX_SIMD_BYTES 32
#include "kernels_body.h"
