#include <kvindex/blas_threads.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include <strings.h>

// OpenBLAS's runtime control, declared weak: the library links against any
// BLAS, and the calls become no-ops where these symbols do not exist.
extern "C" {
void openblas_set_num_threads(int) __attribute__((weak));
int openblas_get_num_threads(void) __attribute__((weak));
int openblas_get_num_procs(void) __attribute__((weak));
char* openblas_get_corename(void) __attribute__((weak));
}

namespace kvindex {

ScopedBlasThreads::ScopedBlasThreads(int n) {
    if (n > 0 && openblas_set_num_threads && openblas_get_num_threads) {
        // More BLAS threads than cores never helps, and each one costs
        // OpenBLAS a buffer: 64 of them on 2 cores under `ulimit -v 4G`
        // hung in its thread shutdown at exit.
        int cores = int(std::thread::hardware_concurrency()); // 0: unknown
        if (openblas_get_num_procs) {
            const int procs = openblas_get_num_procs();
            cores = cores > 0 ? std::min(cores, procs) : procs;
        }
        if (cores > 0) {
            n = std::min(n, cores);
        }
        saved_ = openblas_get_num_threads();
        if (saved_ != n) {
            openblas_set_num_threads(n);
        } else {
            saved_ = 0;
        }
    }
}

ScopedBlasThreads::~ScopedBlasThreads() {
    if (saved_ > 0) {
        openblas_set_num_threads(saved_);
    }
}

int blas_num_threads() {
    return openblas_get_num_threads ? openblas_get_num_threads() : 0;
}

const char* blas_core_name() {
    return openblas_get_corename ? openblas_get_corename() : nullptr;
}

const char* blas_core_for_this_cpu() {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512cd")) {
        return "SkylakeX";
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        return "Haswell";
    }
#endif
    return nullptr;
}

bool blas_core_below_cpu() {
    const char* have = blas_core_name();
    const char* want = blas_core_for_this_cpu();
    if (!have || !want || strcasecmp(have, want) == 0) {
        return false;
    }
    // The x86 kernel sets OpenBLAS falls back to on CPUs it does not know:
    // SSE-only and first-generation AVX. Any other name (Zen, Cooperlake, a
    // newer release's own) is its own informed choice and stands.
    static const char* const kFallbacks[] = {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem",
                                             "Atom", "Barcelona", "Sandybridge", "Katmai", "Northwood",
                                             "Banias", "Opteron"};
    for (const char* f : kFallbacks) {
        if (strcasecmp(have, f) == 0) {
            return true;
        }
    }
    // A Haswell-level choice on an AVX-512 CPU is the same fallback one step up.
    return strcasecmp(want, "SkylakeX") == 0 && strcasecmp(have, "Haswell") == 0;
}

} // namespace kvindex
