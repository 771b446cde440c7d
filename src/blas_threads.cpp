#include <kvindex/blas_threads.h>

// OpenBLAS's thread control, declared weak: the library links against any
// BLAS, and the calls become no-ops where these symbols do not exist.
extern "C" {
void openblas_set_num_threads(int) __attribute__((weak));
int openblas_get_num_threads(void) __attribute__((weak));
}

namespace kvindex {

ScopedBlasThreads::ScopedBlasThreads(int n) {
    if (n > 0 && openblas_set_num_threads && openblas_get_num_threads) {
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

} // namespace kvindex
