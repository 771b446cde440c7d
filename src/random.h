#pragma once

#include <cstddef>
#include <cstdint>

namespace kvindex {

/** The seed of one random stream (one per (layer, KV head), set by KVCache
 * through set_stream) of an index seeded with `seed`: streams differ by the
 * golden ratio's odd multiplier, so that heads draw independent samples. */
inline uint64_t stream_seed(uint64_t seed, uint64_t stream) {
    return seed + 0x9E3779B97F4A7C15ull * (stream + 1);
}

/// SplitMix64: advances `state` and returns the next 64 random bits.
inline uint64_t splitmix64(uint64_t& state) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/// FNV-1a over a query's bytes: samplers seed each draw with it, so that
/// the heads of a GQA group and successive decode steps draw apart while
/// the same query on the same index draws the same sample.
inline uint64_t hash_query(const float* q, int d) {
    uint64_t h = 0xcbf29ce484222325ull;
    const auto* b = reinterpret_cast<const unsigned char*>(q);
    for (size_t i = 0; i < size_t(d) * sizeof(float); i++) {
        h = (h ^ b[i]) * 0x100000001b3ull;
    }
    return h;
}

/// Uniform integer in [0, n) (Lemire's multiply-shift; the bias is below
/// n / 2^64, far under any sampling error here).
inline uint64_t random_below(uint64_t& state, uint64_t n) {
    return uint64_t((__uint128_t(splitmix64(state)) * n) >> 64);
}

/// Uniform double in [0, 1) with 53 random bits.
inline double random_unit(uint64_t& state) {
    return double(splitmix64(state) >> 11) * 0x1.0p-53;
}

} // namespace kvindex
