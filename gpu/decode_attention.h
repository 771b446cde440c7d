#pragma once

// Host side of the decode kernels (gpu/kernels/): plans the launches and
// runs them on a stream. Every pointer here is device memory. Shared by the
// GPU index types, GpuKVCache and the benchmarks' C interface (capi.cu), so
// that what the benchmarks time is what the indexes run.
//
// Workspace: each call takes its scratch arrays from a Workspace. A
// Workspace without memory only counts, and the call then launches
// nothing: run a call once on Workspace::sizing() to learn its bytes, then
// again on that many bytes (workspace_bytes does the first step).

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include <kvindex/kv_type.h>

namespace kvindex {
namespace gpu {

/// Blocks per multiprocessor a decode launch aims at by default: enough
/// independent slices that every multiprocessor keeps loads in flight.
constexpr int kDefaultSlicesPerSm = 8;

/** Sets the blocks per multiprocessor the slicing aims at, for every later
 * call of this process (tuning and benchmarks; 1 .. 64). */
void set_slices_per_sm(int n);

/// Head dimensions the kernels are built for (keys and values alike).
bool supported_head_dim(int d);

/** The KV heads of one cache in device memory: key t of head h at
 * keys + (h * head_stride + t) * d elements of `type`, values alike. */
struct KVHeadsView {
    const void* keys = nullptr;
    const void* values = nullptr;
    int64_t head_stride = 0; ///< rows between heads (>= n_tokens)
    int64_t n_tokens = 0;    ///< tokens per head
    int n_heads = 1;
    int d = 0;               ///< head dimension of keys and values
    KVType type = KVType::f32;
};

/// Scratch arrays carved from one allocation (256-byte aligned each).
struct Workspace {
    char* base = nullptr;
    size_t size = 0;
    size_t used = 0;

    Workspace() = default;
    Workspace(void* base, size_t size) : base(static_cast<char*>(base)), size(size) {}
    static Workspace sizing() {
        return Workspace();
    }
    bool counting() const {
        return base == nullptr;
    }
    /// n elements of T; nullptr while counting.
    template <class T>
    T* take(size_t n) {
        size_t bytes = (n * sizeof(T) + 255) & ~size_t(255);
        T* p = counting() ? nullptr : reinterpret_cast<T*>(base + used);
        used += bytes;
        if (!counting() && used > size) {
            overflow();
        }
        return p;
    }

   private:
    [[noreturn]] void overflow() const;
};

/** Exact attention of rows_per_head query rows per head over every token
 * of its head: split-K over the tokens, each slice read once for the rows
 * of its head, slices merged by lse.
 *
 * @param q    [n_heads][rows_per_head][d] float32
 * @param out  [n_heads][rows_per_head][d] float32
 * @param lse  [n_heads][rows_per_head] float32, natural log (-inf: no token)
 */
void dense_attention(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        float* out,
        float* lse,
        Workspace& ws,
        cudaStream_t stream);

/** Top-k attention: tokens [0, n_sink) and the last n_window tokens read
 * exactly for all rows of a head (dense slices), plus for each row the k
 * tokens of the middle of largest <q, k_t> (ties by smaller id), gathered;
 * all slices merged by lse. k >= the middle's size means every token. */
void topk_attention(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        int64_t n_sink,
        int64_t n_window,
        int64_t k,
        float* out,
        float* lse,
        Workspace& ws,
        cudaStream_t stream);

/** The k tokens of [begin, end) of largest <q, k_t> per row (ties by
 * smaller id), k <= end - begin, in increasing id order.
 *
 * @param ids     [n_heads * rows_per_head][k] int32 token ids
 * @param scores  [n_heads * rows_per_head][k] their <q, k_t>, or nullptr
 */
void topk_select(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        int64_t begin,
        int64_t end,
        int64_t k,
        int32_t* ids,
        float* scores,
        Workspace& ws,
        cudaStream_t stream);

/** Token lists on the device, for the methods that read a different set of
 * tokens per query row or per KV head (IVF buckets, LSH samples), whose
 * lengths only the device knows: list l holds lens[l] token rows of its
 * head at ids + l * stride. Lists are per row (n_heads * rows_per_head
 * lists, row r reads list r) or per head (n_heads lists, the rows of a head
 * share its list, read once for all of them). */
struct TokenLists {
    const int32_t* ids = nullptr;  ///< [n_lists][stride] token rows within the head
    const int32_t* lens = nullptr; ///< [n_lists] (device), each <= max_len
    int64_t stride = 0;            ///< capacity of a list, >= max_len
    int64_t max_len = 0;           ///< a host-side bound on every length, for slicing
    bool per_row = false;          ///< one list per query row; false: one per head
};

/** Exact attention of each row over its list plus the static part (the
 * first n_sink and last n_window tokens of its head, read once for the
 * rows of the head), merged by lse: the attention of the sparse methods
 * whose selection is a set (IVF buckets). A list must not repeat a token
 * nor hold a static one.
 *
 * @param q    [n_heads][rows_per_head][d] float32
 * @param out  [n_heads][rows_per_head][d] float32
 * @param lse  [n_heads][rows_per_head] float32, natural log (-inf: nothing read)
 */
void list_attention(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        int64_t n_sink,
        int64_t n_window,
        const TokenLists& lists,
        float* out,
        float* lse,
        Workspace& ws,
        cudaStream_t stream);

/** <q_r, k_t> (unscaled) for every token of each row's list (per-row lists:
 * search over a selection).
 *
 * @param scores  [n_rows][lists.stride] float32; entries past lens[r] untouched
 */
void list_scores(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        const TokenLists& lists,
        float* scores,
        cudaStream_t stream);

} // namespace gpu
} // namespace kvindex
