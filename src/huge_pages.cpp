#include <kvindex/impl/huge_pages.h>

#include <limits>
#include <new>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvindex {

namespace {

/// bytes rounded up to whole huge pages (bytes <= SIZE_MAX - kHugePageBytes)
size_t huge_page_rounded(size_t bytes) {
    return (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
}

} // namespace

void* allocate_rows(size_t bytes) {
    // through the global operator new, not malloc: a program that replaces
    // it (an allocation-failure test, a tracking allocator) sees these
    // arrays too, and it throws std::bad_alloc itself
    if (bytes < kHugePageMinBytes) {
        return ::operator new(bytes > 0 ? bytes : 1);
    }
    // whole huge pages: the last one is then the array's alone (a size
    // within a page of SIZE_MAX would round to 0)
    if (bytes > std::numeric_limits<size_t>::max() - kHugePageBytes) {
        throw std::bad_alloc();
    }
    const size_t rounded = huge_page_rounded(bytes);
    void* p = ::operator new(rounded, std::align_val_t(kHugePageBytes));
#if defined(MADV_HUGEPAGE)
    // advice only: where THP is off the pages stay small, which is correct
    madvise(p, rounded, MADV_HUGEPAGE);
#endif
    return p;
}

void free_rows(void* p, size_t bytes) noexcept {
    if (!p) {
        return;
    }
    if (bytes < kHugePageMinBytes) {
        ::operator delete(p);
    } else {
        ::operator delete(p, std::align_val_t(kHugePageBytes));
    }
}

} // namespace kvindex
