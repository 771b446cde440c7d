// The OpenBLAS kernel query (blas_threads.h): what the scripts and tools rely
// on to leave the SSE3 fallback. The widest set is checked against the
// kernels' own CPU detection, and a core named in OPENBLAS_CORETYPE (as
// scripts/blas_env.sh exports it) must be the one OpenBLAS loaded.

#include <algorithm>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <strings.h>

#include <gtest/gtest.h>

#include <kvindex/blas_threads.h>
#include <kvindex/kernels.h>

namespace test_blas_core {

using namespace kvindex;

TEST(BlasCore, WidestSetFollowsTheCpu) {
    const char* want = blas_core_for_this_cpu();
#if defined(__x86_64__)
    // Every CPU with AVX-512 F/BW/DQ/VL/CD also runs kvindex's avx512 level
    // (F + DQ); a CPU with AVX2 + FMA runs at least the avx2 level.
    const std::vector<SimdLevel> levels = available_simd_levels();
    auto runs = [&](SimdLevel l) { return std::find(levels.begin(), levels.end(), l) != levels.end(); };
    if (want && std::string(want) == "SkylakeX") {
        EXPECT_TRUE(runs(SimdLevel::avx512));
    } else if (want && std::string(want) == "Haswell") {
        EXPECT_TRUE(runs(SimdLevel::avx2));
    }
#else
    EXPECT_EQ(want, nullptr);
#endif
}

TEST(BlasCore, AnExportedCoreIsTheOneLoaded) {
    const char* env = std::getenv("OPENBLAS_CORETYPE");
    const char* have = blas_core_name();
    if (!env || !have) {
        GTEST_SKIP() << "OPENBLAS_CORETYPE unset or the BLAS is not OpenBLAS";
    }
    const char* want = blas_core_for_this_cpu();
    if (!want || strcasecmp(env, want) != 0) {
        GTEST_SKIP() << "OPENBLAS_CORETYPE=" << env << " is not this CPU's widest set";
    }
    EXPECT_EQ(strcasecmp(have, env), 0) << "OpenBLAS loaded " << have << ", not " << env;
    EXPECT_FALSE(blas_core_below_cpu());
}

// A scope asks for more BLAS threads than there are cores: it gets the
// cores (more only cost OpenBLAS buffers), and the count comes back after.
TEST(BlasThreads, AScopeIsClampedToTheCoresAndRestored) {
    const int before = blas_num_threads();
    if (before == 0) {
        GTEST_SKIP() << "the BLAS in use has no thread control";
    }
    const int cores = int(std::thread::hardware_concurrency());
    {
        ScopedBlasThreads many(1 << 20);
        EXPECT_GE(blas_num_threads(), 1);
        if (cores > 0) {
            EXPECT_LE(blas_num_threads(), cores);
        }
        {
            ScopedBlasThreads one(1);
            EXPECT_EQ(blas_num_threads(), 1);
        }
        EXPECT_LE(blas_num_threads(), std::max(cores, 1));
    }
    EXPECT_EQ(blas_num_threads(), before);
    ScopedBlasThreads none(0); // a no-op
    EXPECT_EQ(blas_num_threads(), before);
}

}  // namespace test_blas_core
