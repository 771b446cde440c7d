#pragma once

// Golden files: small saved indexes, one per string of the conformance list,
// written once by the code of their format version and committed under
// tests/data/golden, with the answers that code gave. test_golden.cpp reads
// them back forever after: a reader must accept every version ever written.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>

namespace kvgolden {

using kvindex::idx_t;

constexpr int kDim = 8;
constexpr int kDimValue = 6;     ///< differs from kDim, so that mixing them shows
constexpr idx_t kPrefill = 64;   ///< prompt tokens, with their queries
constexpr int kGroup = 2;        ///< query heads of the GQA group at prefill
constexpr idx_t kDecode = 8;     ///< tokens appended one at a time after prefill
constexpr idx_t kQueries = 3;    ///< evaluation queries
constexpr idx_t kSearchK = 5;    ///< k of the saved search answers

/// The index of a golden file: prefill (queries included, interleaved RoPE
/// with theta 500000, so that losing the RoPE fields shows), kDecode
/// appends, then the case's knobs.
std::unique_ptr<kvindex::KVIndex> build_golden_index(
        const std::string& factory, const std::string& knobs);

/// The evaluation queries, size kQueries * kDim (not from the keys' seed).
std::vector<float> golden_queries();

/// What an index answers to the golden queries.
struct Answers {
    std::vector<idx_t> labels;     ///< search, size kQueries * kSearchK
    std::vector<float> distances;  ///< search, size kQueries * kSearchK
    std::vector<float> out;        ///< attend, size kQueries * d_value
    std::vector<float> lse;        ///< attend, size kQueries
};
Answers answer(const kvindex::KVIndex* index, const std::vector<float>& queries);

/// File name stem of case i: "07_Window8_TopK_IVF4_Flat_".
std::string golden_stem(size_t i, const std::string& factory);

/** The version a golden file of this chain is saved under: the container's
 * format version ("3"), followed by "+<Type>.v<n>" for each type of the
 * chain whose record is past version 1 ("3+ProxyEvict.v2"), so that a
 * type's record bump adds a new current file and keeps the old one as a
 * version the reader must still accept. */
std::string golden_version_key(const std::string& factory);

} // namespace kvgolden
