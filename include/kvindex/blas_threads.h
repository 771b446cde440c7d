#pragma once

namespace kvindex {

/// Sets the BLAS thread count for a scope and restores it after; a no-op
/// when n <= 0 or when the BLAS in use has no thread control (reference BLAS).
class ScopedBlasThreads {
   public:
    explicit ScopedBlasThreads(int n);
    ~ScopedBlasThreads();
    ScopedBlasThreads(const ScopedBlasThreads&) = delete;
    ScopedBlasThreads& operator=(const ScopedBlasThreads&) = delete;

   private:
    int saved_ = 0;
};

} // namespace kvindex
