// Kernels for the generic instruction set; see kernels_body.h.
#define KVINDEX_SIMD_NS simd_generic
#define KVINDEX_SIMD_BYTES 16
#include "kernels_body.h"
