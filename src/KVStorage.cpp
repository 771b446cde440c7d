#include <kvindex/KVStorage.h>

namespace kvindex {

void KVStorage::append(idx_t n, const float* k, const float* v) {
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
