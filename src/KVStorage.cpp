#include <kvindex/KVStorage.h>

#include <algorithm>

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

} // namespace kvindex
