#pragma once

// The sanitizer run (scripts/run_sanitizers.sh: the library under ASan +
// UBSan, 3-20x slower than Release) runs the same tests as ctest. A few
// exhaustive loops there take a spread of their cases instead of all of
// them: every truncation of a file, every failing allocation of a write,
// hundreds of random byte flips. Each case still runs its whole check, so
// the code paths are the same; the Release ctest run keeps every case, and
// the fuzzers (scripts/run_fuzzers.sh) keep mutating files under ASan.
// tests/CMakeLists.txt defines KVINDEX_SANITIZER_BUILD in that build only.

namespace kvtest {

#ifdef KVINDEX_SANITIZER_BUILD
constexpr bool kSanitizerBuild = true;
#else
constexpr bool kSanitizerBuild = false;
#endif

/// `release` cases in the Release build, `sanitized` in the sanitizer build.
template <class T>
constexpr T release_or_sanitized(T release, T sanitized) {
    return kSanitizerBuild ? sanitized : release;
}

} // namespace kvtest
