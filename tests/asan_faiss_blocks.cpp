// Under AddressSanitizer only: Faiss's exhaustive search allocates a block
// of distance_compute_blas_query_bs x _database_bs inner products (4096 x
// 1024 floats, 16 MiB) at every call whatever its sizes, and ASan maps each
// such block afresh and poisons its 2 MiB of shadow, freed or not: in the
// k-means of the IVF and IVFAsym tests two thirds of the time went to page
// faults. The test binaries of an ASan build (the sanitizer build, whose
// tests' own code is not instrumented, says so by KVINDEX_SANITIZER_BUILD)
// use blocks of 256 x 64 (64 KiB): the same BLAS path and the same
// allocation, from ASan's size classes. Release builds keep Faiss's
// defaults.

#include <faiss/utils/distances.h>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVINDEX_TEST_UNDER_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(KVINDEX_SANITIZER_BUILD)
#define KVINDEX_TEST_UNDER_ASAN 1 // (the tests' own code is not instrumented there)
#endif

#ifdef KVINDEX_TEST_UNDER_ASAN
namespace {
const bool small_faiss_blocks = [] {
    faiss::distance_compute_blas_query_bs = 256;
    faiss::distance_compute_blas_database_bs = 64;
    return true;
}();
} // namespace
#endif
