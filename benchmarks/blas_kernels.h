#pragma once

// The tools (kvbench, kvllm, bench_*) start with the widest OpenBLAS kernels
// the CPU runs. OpenBLAS picks its kernels when it loads, before main, and
// Debian 12's 0.3.21 picks its SSE3 set on CPUs newer than it knows
// (Sapphire/Emerald Rapids): prefill, k-means and the graph builds' sgemm
// then run 2-3x slower. The only switch is OPENBLAS_CORETYPE in the
// environment at load, so a tool that finds the fallback sets it and
// re-executes itself once. A user's own OPENBLAS_CORETYPE is never touched.

#include <cstdio>
#include <cstdlib>

#include <unistd.h>

#include <kvindex/blas_threads.h>

namespace kvtools {

inline void use_widest_blas_kernels(char** argv) {
    if (std::getenv("OPENBLAS_CORETYPE") || !kvindex::blas_core_below_cpu()) {
        return;
    }
    const char* want = kvindex::blas_core_for_this_cpu();
    std::fprintf(stderr, "[OpenBLAS chose its %s kernels on a CPU that runs %s: restarting with OPENBLAS_CORETYPE=%s]\n",
                 kvindex::blas_core_name(), want, want);
    std::fflush(stderr);
    setenv("OPENBLAS_CORETYPE", want, 1);
    execv("/proc/self/exe", argv);
    // exec failed (no /proc): go on with the kernels loaded.
    std::fprintf(stderr, "[restart failed; going on with %s]\n", kvindex::blas_core_name());
}

} // namespace kvtools
