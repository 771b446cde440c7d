#pragma once

namespace kvindex {

/// Sets the BLAS thread count for a scope and restores it after; a no-op
/// when n <= 0 or when the BLAS in use has no thread control (reference BLAS).
/// n is clamped to the cores this process may use.
class ScopedBlasThreads {
   public:
    explicit ScopedBlasThreads(int n);
    ~ScopedBlasThreads();
    ScopedBlasThreads(const ScopedBlasThreads&) = delete;
    ScopedBlasThreads& operator=(const ScopedBlasThreads&) = delete;

   private:
    int saved_ = 0;
};

/// The kernel set OpenBLAS chose at load ("SkylakeX", "Haswell",
/// "Prescott", ...), or nullptr when the BLAS in use is not OpenBLAS.
const char* blas_core_name();

/// The BLAS's thread count now, or 0 when the BLAS in use has no thread
/// control.
int blas_num_threads();

/// The OpenBLAS kernel set this CPU can run at its widest: "SkylakeX"
/// (AVX-512 F/BW/DQ/VL/CD), "Haswell" (AVX2 + FMA), or nullptr (older CPUs,
/// where OpenBLAS's own choice stands).
const char* blas_core_for_this_cpu();

/// True when OpenBLAS runs kernels older than blas_core_for_this_cpu() says
/// the CPU can run. OpenBLAS 0.3.21 (Debian 12) does not know recent Xeons
/// (Sapphire/Emerald Rapids) and falls back to its SSE3 "Prescott" kernels,
/// 2-3x slower in sgemm; the choice is made when the library loads, so only
/// OPENBLAS_CORETYPE set before the process starts changes it.
bool blas_core_below_cpu();

} // namespace kvindex
