#pragma once

#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

#include <kvindex/KVIndex.h>
#include <kvindex/kv_type.h>

namespace kvindex {

/// Frees device memory on its device (the deleter of device arrays).
struct DeviceFree {
    int device = 0;
    void operator()(void* p) const;
};
using DeviceArray = std::unique_ptr<void, DeviceFree>;

/** Keys and values of n_heads KV heads in device memory, in one KVType
 * (float32, bfloat16 or fp16; converted on the host as KVStorage does, so
 * the stored bits equal the CPU twin's). Head h's token t is row
 * h * capacity + t of `keys` (d elements) and of `values` (d_value).
 *
 * Appends fill spare capacity; a full storage doubles its capacity (one
 * device copy per doubling, not per append), so a decode loop of n steps
 * copies O(n) rows in all. GpuIndexKV holds one head; GpuKVCache one
 * storage of n_kv_heads per layer, so that one launch reads every head.
 */
struct GpuKVStorage {
    int device = 0;        ///< where the arrays live
    int n_heads = 1;       ///< KV heads stored side by side
    int d = 0;             ///< key dimension
    int d_value = 0;       ///< value dimension
    KVType type = KVType::f32;
    idx_t size = 0;        ///< tokens per head
    idx_t capacity = 0;    ///< rows allocated per head (>= size)
    DeviceArray keys;      ///< n_heads * capacity * d elements of `type`
    DeviceArray values;    ///< n_heads * capacity * d_value elements of `type`

    GpuKVStorage() = default;
    GpuKVStorage(int device, int n_heads, int d, int d_value, KVType type);

    /** Appends n tokens to every head, given as floats head-major:
     * keys [n_heads][n][d], values [n_heads][n][d_value] (host memory).
     * The values must fit the type (KVIndex::add_kv checks); throws on a
     * device error, leaving the storage as it was. Synchronous. */
    void append(idx_t n, const float* keys, const float* values, cudaStream_t stream);

    /// Makes room for `rows` tokens per head (never shrinks).
    void reserve(idx_t rows, cudaStream_t stream);

    /// Tokens [i0, i0 + n) of `head` as floats (host; sizes n * d, n * d_value).
    void read(int head, idx_t i0, idx_t n, std::vector<float>* k, std::vector<float>* v,
              cudaStream_t stream) const;

    /// Drops every token and the memory.
    void clear();

    /// Bytes of device memory held (the capacity, not the size).
    size_t memory_bytes() const;

    size_t key_row_bytes() const {
        return size_t(d) * kv_type_size(type);
    }
    size_t value_row_bytes() const {
        return size_t(d_value) * kv_type_size(type);
    }
};

} // namespace kvindex
