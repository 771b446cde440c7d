#pragma once

// What the GPU tests share: the skip without a device, data with the
// geometry that troubles ANN indexes, and the comparison of an attention
// output against the CPU twin and the double-precision reference.

#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/KVIndex.h>
#include <kvindex/gpu/GpuResources.h>

#include "reference.h"

/// Skips the test (cleanly, as GTEST_SKIP) when no CUDA device exists.
#define KVINDEX_REQUIRE_GPU()                                             \
    do {                                                                  \
        if (kvindex::gpu_device_count() == 0) {                           \
            GTEST_SKIP() << "no CUDA device: GPU test skipped";           \
        }                                                                 \
    } while (0)

namespace kvtest {

/** Keys around a large common offset, queries on the far side of it (out
 * of distribution, as decode queries are for their keys), values Gaussian.
 * `ood` = false gives plain Gaussian keys and queries. */
struct KVData {
    std::vector<float> keys, values, queries;
};

inline KVData make_kv(size_t n, size_t n_queries, size_t d, uint64_t seed, bool ood) {
    KVData x;
    x.keys = gaussian(n, d, seed, 1.0f, ood ? 2.0f : 0.0f);
    x.values = gaussian(n, d, seed + 1);
    x.queries = gaussian(n_queries, d, seed + 2, ood ? 1.5f : 1.0f, ood ? -1.0f : 0.0f);
    return x;
}

/// Largest |a - b| over n elements, relative to max(1, max |b|).
inline double rel_err(const float* a, const float* b, size_t n) {
    double m = 1.0, e = 0.0;
    for (size_t i = 0; i < n; i++) {
        m = std::max(m, std::abs(double(b[i])));
        e = std::max(e, std::abs(double(a[i]) - double(b[i])));
    }
    return e / m;
}

/// Every element finite (no NaN slipped through a kernel).
inline bool all_finite(const std::vector<float>& x) {
    for (float v : x) {
        if (!std::isfinite(v)) {
            return false;
        }
    }
    return true;
}

} // namespace kvtest
