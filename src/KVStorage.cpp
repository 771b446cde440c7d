#include <kvindex/KVStorage.h>

#include <algorithm>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/impl/io.h>

#include "checks.h"

namespace kvindex {

void KVStorage::append(idx_t n, const float* k, const float* v) {
    // grow by 1/4 rather than std::vector's doubling: a KV cache is large
    // and grows one token at a time, and bytes per token is a figure we report
    size_t need = keys.size() + n * d;
    if (need > keys.capacity()) {
        keys.reserve(std::max(need, keys.capacity() + keys.capacity() / 4));
        values.reserve(std::max(values.size() + n * d_value,
                                values.capacity() + values.capacity() / 4));
    }
    keys.insert(keys.end(), k, k + n * d);
    values.insert(values.end(), v, v + n * d_value);
}

void KVStorage::erase_front(idx_t n) {
    keys.erase(keys.begin(), keys.begin() + n * d);
    values.erase(values.begin(), values.begin() + n * d_value);
}

void KVStorage::clear() {
    keys.clear();
    values.clear();
}

size_t KVStorage::memory_bytes() const {
    return (keys.capacity() + values.capacity()) * sizeof(float);
}

void KVStorage::write(BufferWriter& w) const {
    w.vector(keys);
    w.vector(values);
}

void KVStorage::read(BufferReader& r, const char* what) {
    FAISS_THROW_IF_NOT_FMT(d > 0 && d_value > 0, "read_index: %s: dimensions not set", what);
    keys = r.vector<float>(what);
    values = r.vector<float>(what);
    FAISS_THROW_IF_NOT_FMT(
            keys.size() % d == 0 && values.size() == keys.size() / d * d_value,
            "read_index: %s: %zd key floats and %zd value floats do not make "
            "whole tokens of d=%zd, d_value=%zd",
            what,
            keys.size(),
            values.size(),
            d,
            d_value);
    // refuse what add_kv would refuse
    check_finite(keys.data(), size(), d, "read_index: keys");
    check_finite(values.data(), size(), d_value, "read_index: values");
}

} // namespace kvindex
