#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <faiss/impl/FaissException.h>

#include <kvindex/KVIndex.h>
#include <kvindex/errors.h>

namespace kvindex {

/** Throws unless n_rows >= 0 rows of row_dim floats could be one buffer:
 * at most kMaxBufferBytes, above any address space, so that the products
 * n_rows * row_dim (and by a few heads more) cannot overflow. */
void check_input_size(idx_t n_rows, size_t row_dim, const char* what);

/// Bytes no buffer given to the library can reach (2^56: the 57-bit
/// virtual addresses of 5-level paging, halved for user space).
constexpr size_t kMaxBufferBytes = size_t(1) << 56;

/// Throws "<what>: non-finite value <v> at row r, column c" for NaN / Inf,
/// "too large a value" for |x| > max_abs; checks the size first.
void check_bounded(const float* x, idx_t n_rows, size_t row_dim, const char* what, float max_abs);

/// check_bounded's error for the value v at (row, column), for checks of
/// values that are not a float array (16-bit storage).
[[noreturn]] void throw_out_of_bounds(float v, size_t row, size_t column, const char* what, float max_abs);

/// Throws "<what>: non-finite value <v> at row r, column c" for NaN / Inf;
/// checks the size first (check_input_size).
void check_finite(const float* x, idx_t n_rows, size_t row_dim, const char* what);

/// check_finite, and |x| <= kMaxInputMagnitude (KVIndex.h): the check of
/// every key, value and query given to the library.
void check_input(const float* x, idx_t n_rows, size_t row_dim, const char* what);

/** The shape of a prompt, whoever reads it (KVIndex::check_prefill, the
 * IVFAsym trainer): counts >= 0, positions that cannot overflow, query
 * heads >= 1, finite queries within kMaxInputMagnitude and their
 * positions. Not the keys and values: each reader checks those it reads.
 * Messages start with `what`. */
void check_prompt(const PrefillInput& in, int d, const char* what);

/// Whether x is an integer in [1, 2^53], checked before any conversion
/// (converting inf or 1e300 to an integer is undefined behaviour).
bool is_positive_integer(double x);

/// Whether x is an integer in [0, 2^53]: a count, a seed.
bool is_count(double x);

/// value as a count (is_count); otherwise throws "parameter <name>=<value>
/// must be a non-negative integer". The check of set_parameter's counts.
uint64_t count_parameter(const std::string& name, double value);

/// value as a flag: 0 or 1, otherwise throws "parameter <name>=<value>
/// must be 0 or 1". The check of set_parameter's flags.
bool flag_parameter(const std::string& name, double value);

/// Throws unless excluded (size n_excluded) holds increasing ids in [0, n).
void check_excluded(const idx_t* excluded, size_t n_excluded, idx_t n, const char* what);

/** Throws unless a seed that is also a knob ("seed") is at most 2^53:
 * get_index_parameter returns it as a double, and set_index_parameters
 * sets it back through one when a later item is refused, so a larger seed
 * would come back changed. Messages start with `what`. */
void check_seed_knob(uint64_t seed, const char* what);

/** Throws unless the child `what` of the wrapper holds `expected` tokens
 * (KVIndex::check_children_in_step): a child written through a reference
 * is named, with the way back (reset the wrapper). */
void check_child_in_step(const KVIndex* child, idx_t expected, const char* wrapper, const char* what);

/** An index of the tree under `root` (root included) that takes a key's
 * position from its row (KVIndex::needs_contiguous_positions: IVFAsym
 * undoes RoPE with it), or nullptr: what eviction refuses, and what
 * IndexKVShards tells of the tokens appended after a shard. */
const KVIndex* find_position_reader(const KVIndex* root);

/** The tokens of an append to a cache's layer (KVCache, GpuKVCache): n
 * tokens of each of n_heads heads, keys of d and values of d_value floats.
 * The sizes first (n_heads * n must not overflow), then present, finite
 * and within kMaxInputMagnitude; nothing to check when n == 0. */
void check_head_tokens(
        idx_t n,
        int n_heads,
        int d,
        int d_value,
        const float* keys,
        const float* values,
        const char* what);

/// check_head_tokens' first part: the sizes, and the arrays present.
void check_head_arrays(
        idx_t n,
        int n_heads,
        int d,
        int d_value,
        const float* keys,
        const float* values,
        const char* what);

/// Throws unless ptr is non-null; names the argument.
void check_not_null(const void* ptr, const char* what);


} // namespace kvindex
