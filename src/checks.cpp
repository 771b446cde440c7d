#include "checks.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>

#include <faiss/impl/FaissAssert.h>

namespace kvindex {

void throw_out_of_bounds(float v, size_t row, size_t column, const char* what, float max_abs) {
    const bool finite = std::isfinite(v);
    char bound[64] = "";
    if (finite && max_abs == kMaxInputMagnitude) {
        std::snprintf(bound, sizeof(bound), " (|x| must be <= 1e12, kMaxInputMagnitude)");
    } else if (finite) {
        std::snprintf(bound, sizeof(bound), " (|x| must be <= %g)", double(max_abs));
    }
    KVINDEX_THROW_FMT(
            InvalidArgument,
            "%s: %s value %g at row %zu, column %zu%s",
            what,
            finite ? "too large a" : "non-finite",
            double(v),
            row,
            column,
            bound);
}

void check_bounded(const float* x, idx_t n_rows, size_t row_dim, const char* what, float max_abs) {
    check_input_size(n_rows, row_dim, what);
    size_t n = size_t(n_rows) * row_dim;
    // one pass without branches first, which the compiler vectorizes
    // (every add_kv runs it); the loop below only finds the culprit
    unsigned bad = 0;
    for (size_t i = 0; i < n; i++) {
        bad |= !(std::fabs(x[i]) <= max_abs); // also NaN
    }
    if (bad == 0) {
        return;
    }
    for (size_t i = 0; i < n; i++) {
        if (!(std::fabs(x[i]) <= max_abs)) {
            throw_out_of_bounds(x[i], i / row_dim, i % row_dim, what, max_abs);
        }
    }
}

void check_input_size(idx_t n_rows, size_t row_dim, const char* what) {
    KVINDEX_CHECK_ARG(n_rows >= 0, "%s: n=%zd rows must be >= 0", what, ssize_t(n_rows));
    KVINDEX_CHECK_ARG(
            row_dim == 0 || size_t(n_rows) <= kMaxBufferBytes / sizeof(float) / row_dim,
            "%s: %zd rows of %zd floats are more than any buffer can hold (2^56 bytes)",
            what,
            ssize_t(n_rows),
            row_dim);
}

void check_finite(const float* x, idx_t n_rows, size_t row_dim, const char* what) {
    check_bounded(x, n_rows, row_dim, what, std::numeric_limits<float>::max());
}

void check_input(const float* x, idx_t n_rows, size_t row_dim, const char* what) {
    check_bounded(x, n_rows, row_dim, what, kMaxInputMagnitude);
}

bool is_positive_integer(double x) {
    return x >= 1 && x <= 9007199254740992.0 && x == std::floor(x);
}

bool is_count(double x) {
    return x == 0 || is_positive_integer(x);
}

uint64_t count_parameter(const std::string& name, double value) {
    KVINDEX_CHECK_ARG(
            is_count(value),
            "parameter %s=%g must be a non-negative integer",
            name.c_str(),
            value);
    return uint64_t(value);
}

bool flag_parameter(const std::string& name, double value) {
    KVINDEX_CHECK_ARG(value == 0 || value == 1, "parameter %s=%g must be 0 or 1", name.c_str(), value);
    return value == 1;
}

void check_excluded(const idx_t* excluded, size_t n_excluded, idx_t n, const char* what) {
    KVINDEX_CHECK_ARG(excluded || n_excluded == 0, "%s: excluded is nullptr", what);
    for (size_t j = 0; j < n_excluded; j++) {
        KVINDEX_CHECK_ARG(
                excluded[j] >= 0 && excluded[j] < n && (j == 0 || excluded[j] > excluded[j - 1]),
                "%s: excluded[%zd] = %zd: ids must be increasing, in [0, %zd)",
                what,
                j,
                size_t(excluded[j]),
                size_t(n));
    }
}

void check_seed_knob(uint64_t seed, const char* what) {
    KVINDEX_CHECK_ARG(
            seed <= (uint64_t(1) << 53),
            "%s: seed=%llu must be at most 2^53 (the seed knob is exact as a double up to there)",
            what,
            (unsigned long long)seed);
}

void check_child_in_step(const KVIndex* child, idx_t expected, const char* wrapper, const char* what) {
    FAISS_THROW_IF_NOT_FMT(child, "%s: %s index missing", wrapper, what);
    FAISS_THROW_IF_NOT_FMT(
            child->ntotal == expected,
            "%s: its %s index holds %zd tokens where the %s put %zd: it was written through a "
            "reference to it, which the %s cannot follow (add through the %s; reset() it to start over)",
            wrapper,
            what,
            size_t(child->ntotal),
            wrapper,
            size_t(expected),
            wrapper,
            wrapper);
}

const KVIndex* find_position_reader(const KVIndex* root) {
    std::vector<const KVIndex*> chain = {root};
    while (!chain.empty()) {
        const KVIndex* index = chain.back();
        chain.pop_back();
        if (index->needs_contiguous_positions()) {
            return index;
        }
        for (const KVIndex* child : index->children()) {
            chain.push_back(child);
        }
    }
    return nullptr;
}

void check_not_null(const void* ptr, const char* what) {
    KVINDEX_CHECK_ARG(ptr != nullptr, "%s is missing (nullptr)", what);
}

void check_head_arrays(
        idx_t n,
        int n_heads,
        int d,
        int d_value,
        const float* keys,
        const float* values,
        const char* what) {
    if (n == 0) {
        return;
    }
    check_input_size(n, size_t(n_heads) * std::max(d, d_value), what);
    if (!keys || !values) { // names built only for the error
        std::string w(what);
        check_not_null(keys, (w + ": keys").c_str());
        check_not_null(values, (w + ": values").c_str());
    }
}

void check_head_tokens(
        idx_t n,
        int n_heads,
        int d,
        int d_value,
        const float* keys,
        const float* values,
        const char* what) {
    if (n == 0) {
        return;
    }
    check_head_arrays(n, n_heads, d, d_value, keys, values, what);
    std::string w(what);
    check_input(keys, n_heads * n, d, (w + ": keys").c_str());
    check_input(values, n_heads * n, d_value, (w + ": values").c_str());
}

} // namespace kvindex
