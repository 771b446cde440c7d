#pragma once

#include <cstdint>

namespace kvindex {

/** The seed of one random stream (one per (layer, KV head), set by KVCache
 * through set_stream) of an index seeded with `seed`: streams differ by the
 * golden ratio's odd multiplier, so that heads draw independent samples. */
inline uint64_t stream_seed(uint64_t seed, uint64_t stream) {
    return seed + 0x9E3779B97F4A7C15ull * (stream + 1);
}

} // namespace kvindex
