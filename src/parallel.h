#pragma once

#include <exception>
#include <mutex>

#include <omp.h>

#include <kvindex/KVIndex.h>

#include <kvindex/blas_threads.h>

namespace kvindex {

/** Runs body(i) for 0 <= i < n on OpenMP threads (when parallel and n > 1).
 * An exception thrown by any body is captured and the first one rethrown
 * after the loop, since an exception escaping an OpenMP region aborts the
 * process. BLAS is held to one thread inside the region so that Faiss's
 * batched searches do not oversubscribe the cores.
 */
template <class Body>
void parallel_for(idx_t n, Body&& body, bool parallel = true) {
    std::exception_ptr error;
    std::mutex error_mutex;
    bool run_parallel = parallel && n > 1 && !omp_in_parallel() &&
            omp_get_max_threads() > 1;
    ScopedBlasThreads one_blas_thread(run_parallel ? 1 : 0);
#pragma omp parallel for schedule(dynamic) if (run_parallel)
    for (idx_t i = 0; i < n; i++) {
        try {
            body(i);
        } catch (...) {
            std::lock_guard<std::mutex> lock(error_mutex);
            if (!error) {
                error = std::current_exception();
            }
        }
    }
    if (error) {
        std::rethrow_exception(error);
    }
}

} // namespace kvindex
