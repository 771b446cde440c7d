#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

namespace kvindex {

/// Blocks this large or larger are 2 MiB aligned and advised for
/// transparent huge pages; a smaller block would waste up to a huge page.
constexpr size_t kHugePageMinBytes = size_t(8) << 20;
constexpr size_t kHugePageBytes = size_t(2) << 20;

/** Allocates `bytes` for a large array that is read at scattered rows: from
 * kHugePageMinBytes on, 2 MiB aligned, rounded up to whole huge pages and
 * advised MADV_HUGEPAGE (Linux; elsewhere plain aligned memory). A
 * sampler's or a graph's reads touch a new 4 KiB page per row, and with a
 * 4 KiB page each is a TLB miss; under THP "madvise" (a common default)
 * only advised memory gets huge pages. The rounding costs at most 2 MiB
 * per array (<= 25% at the threshold), which memory_bytes(), counting
 * capacities, does not show. Throws std::bad_alloc. */
void* allocate_rows(size_t bytes);
/// Frees what allocate_rows(bytes) returned, given the same bytes (nullptr
/// is ignored).
void free_rows(void* p, size_t bytes) noexcept;

/// std::allocator for the large token arrays (allocate_rows): the same
/// vector semantics, huge pages underneath when the block is large.
template <class T>
struct HugePageAllocator {
    using value_type = T;
    HugePageAllocator() = default;
    template <class U>
    HugePageAllocator(const HugePageAllocator<U>&) noexcept {}
    T* allocate(size_t n) {
        if (n > size_t(-1) / sizeof(T)) {
            throw std::bad_alloc();
        }
        return static_cast<T*>(allocate_rows(n * sizeof(T)));
    }
    void deallocate(T* p, size_t n) noexcept {
        free_rows(p, n * sizeof(T));
    }
    template <class U>
    bool operator==(const HugePageAllocator<U>&) const noexcept {
        return true;
    }
    template <class U>
    bool operator!=(const HugePageAllocator<U>&) const noexcept {
        return false;
    }
};

/// A byte array of token rows (KVStorage's keys and values).
using RowBytes = std::vector<uint8_t, HugePageAllocator<uint8_t>>;

} // namespace kvindex
