#pragma once

// Helpers shared by the decode kernels: how a key / value row is split
// across the lanes of a warp, 16-byte loads, and the widening of stored
// elements (float32, bfloat16, fp16) to float.
//
// A row of D elements is read as D * sizeof(T) / 16 vectors of 16 bytes.
// LPK lanes ("lanes per key") share one row, each holding VPL vectors, so a
// warp reads G = 32 / LPK rows at once, every load 16 bytes wide and the
// warp's loads coalesced. For D = 128 in bf16: 16 lanes a row, 2 rows a warp.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kvindex {
namespace gpu {

constexpr unsigned kFullMask = 0xffffffffu;

/// How rows of D elements of type T are spread over a warp (see above).
template <typename T, int D>
struct RowLayout {
    static constexpr int VEC = 16 / int(sizeof(T)); ///< elements per 16-byte vector
    static_assert(D % VEC == 0, "the head dimension must fill whole 16-byte vectors");
    static constexpr int NV = D / VEC;              ///< vectors per row
    static constexpr int LPK = NV < 32 ? NV : 32;   ///< lanes sharing a row
    static_assert(32 % LPK == 0 && NV % LPK == 0, "row vectors must tile the warp");
    static constexpr int VPL = NV / LPK;            ///< vectors per lane
    static constexpr int G = 32 / LPK;              ///< rows a warp reads at once
    static constexpr int EPL = VPL * VEC;           ///< elements per lane

    /// First element of vector v (< VPL) of a lane at position `lane_in_row`.
    __device__ static int element(int lane_in_row, int v) {
        return (lane_in_row + v * LPK) * VEC;
    }
};

/// 16 bytes read through the read-only path (the KV cache is not written
/// during a decode step).
__device__ __forceinline__ uint4 load16(const void* p) {
    return __ldg(static_cast<const uint4*>(p));
}

/// The VEC elements of a 16-byte vector of T, widened to float.
__device__ __forceinline__ void widen(uint4 raw, const float*, float* out) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
}

__device__ __forceinline__ void widen(uint4 raw, const __nv_bfloat16*, float* out) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        // bfloat16 -> float is a shift: exact, no conversion unit needed
        out[2 * i] = __uint_as_float(w[i] << 16);
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ void widen(uint4 raw, const __half*, float* out) {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        __half2 h = *reinterpret_cast<const __half2*>(&w[i]);
        float2 f = __half22float2(h);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

/// One stored element as float (scalar paths; the hot loops use widen).
__device__ __forceinline__ float to_float(float x) {
    return x;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 x) {
    return __bfloat162float(x);
}
__device__ __forceinline__ float to_float(__half x) {
    return __half2float(x);
}

/// Sum over the LPK lanes that share a row (all of them get the sum).
template <int LPK>
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
    for (int off = LPK / 2; off >= 1; off /= 2) {
        x += __shfl_xor_sync(kFullMask, x, off);
    }
    return x;
}

/// -infinity: the max of an empty set, the lse of nothing.
constexpr float kNegInf = -__builtin_huge_valf();

/// log2(e): the kernels work in base 2 (exp2f is one instruction).
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

} // namespace gpu
} // namespace kvindex
