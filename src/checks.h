#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <kvindex/KVIndex.h>

namespace kvindex {

/// Throws "<what>: non-finite value <v> at row r, column c" for NaN / Inf.
void check_finite(const float* x, idx_t n_rows, size_t row_dim, const char* what);

/// check_finite, and |x| <= kMaxInputMagnitude (KVIndex.h): the check of
/// every key, value and query given to the library.
void check_input(const float* x, idx_t n_rows, size_t row_dim, const char* what);

/// Whether x is an integer in [1, 2^53], checked before any conversion
/// (converting inf or 1e300 to an integer is undefined behaviour).
bool is_positive_integer(double x);

/// Whether x is an integer in [0, 2^53]: a count, a seed.
bool is_count(double x);

/// value as a count (is_count); otherwise throws "parameter <name>=<value>
/// must be a non-negative integer". The check of set_parameter's counts.
uint64_t count_parameter(const std::string& name, double value);

/** Throws unless the child `what` of the wrapper holds `expected` tokens
 * (KVIndex::check_children_in_step): a child written through a reference
 * is named, with the way back (reset the wrapper). */
void check_child_in_step(const KVIndex* child, idx_t expected, const char* wrapper, const char* what);

/// Throws unless ptr is non-null; names the argument.
void check_not_null(const void* ptr, const char* what);

} // namespace kvindex
