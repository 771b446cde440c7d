#include <kvindex/impl/huge_pages.h>

#include <cstdlib>
#include <limits>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvindex {

void* allocate_rows(size_t bytes) {
    if (bytes < kHugePageMinBytes) {
        void* p = std::malloc(bytes > 0 ? bytes : 1);
        if (!p) {
            throw std::bad_alloc();
        }
        return p;
    }
    // whole huge pages: the last one is then the array's alone (a size
    // within a page of SIZE_MAX would round to 0)
    if (bytes > std::numeric_limits<size_t>::max() - kHugePageBytes) {
        throw std::bad_alloc();
    }
    const size_t rounded = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    void* p = nullptr;
    if (posix_memalign(&p, kHugePageBytes, rounded) != 0) {
        throw std::bad_alloc();
    }
#if defined(MADV_HUGEPAGE)
    // advice only: where THP is off the pages stay small, which is correct
    madvise(p, rounded, MADV_HUGEPAGE);
#endif
    return p;
}

void free_rows(void* p) noexcept {
    std::free(p);
}

} // namespace kvindex
