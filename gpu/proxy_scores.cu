// Host side of the eviction scoring kernels: argument checks, the split
// plan and the launches (proxy_scores.h).

#include "proxy_scores.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "gpu_error.h"
#include "kernels/proxy_scores.cuh"

namespace kvindex {
namespace gpu {

namespace {

/// Blocks a pass aims at, whatever the device (the workspace depends on
/// the plan, and its size must not depend on the device): a few waves of
/// an H100 (132 multiprocessors, 3-4 resident blocks each).
constexpr int64_t kTargetBlocks = 1024;
/// Longest key split of pass 1: each thread's float online sum then adds at
/// most kMaxSplitKeys / 16 terms before the splits are merged in double.
constexpr int64_t kMaxSplitKeys = 8192;
/// Longest row split of pass 2, for the same reason (at most 256 terms a
/// thread before the double sum over the splits).
constexpr int64_t kMaxSplitRows = 4096;
/// Grid y limit.
constexpr int64_t kMaxGridY = 65535;
/// Keys and rows are indexed as int inside the kernels (lims): this bound
/// leaves room for the last tile.
constexpr int64_t kMaxItems = int64_t(INT_MAX) - kProxyTile;

constexpr double kLog2e = 1.4426950408889634;

int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

/// A cut of n_items (keys or rows) into n splits of len items, len a
/// multiple of the tile.
struct Split {
    int64_t len = 0;
    int n = 0;
};

/** Cuts n_items > 0 into splits of whole tiles: enough splits that
 * other_tiles x splits blocks reach kTargetBlocks, none longer than
 * max_len items, at most one per tile and kMaxGridY in all. */
Split split_tiles(int64_t n_items, int64_t other_tiles, int64_t max_len) {
    const int64_t tiles = ceil_div(n_items, kProxyTile);
    int64_t want = std::max(ceil_div(kTargetBlocks, std::max<int64_t>(other_tiles, 1)),
                            ceil_div(n_items, max_len));
    want = std::min(std::max<int64_t>(want, 1), tiles);
    int64_t per = std::max(ceil_div(tiles, want), ceil_div(tiles, kMaxGridY));
    Split s;
    s.len = per * kProxyTile;
    s.n = int(ceil_div(tiles, per));
    return s;
}

bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

void check_shapes(int64_t n, int d, int n_heads, int64_t n_q, int64_t first_pos) {
    if (n < 0 || n > kMaxItems) {
        throw_gpu_error("proxy_scores: n=" + std::to_string(n) + " keys outside [0, " +
                        std::to_string(kMaxItems) + "]");
    }
    if (d < 4 || d % 4 != 0) {
        throw_gpu_error("proxy_scores: head dimension d=" + std::to_string(d) +
                        " must be a positive multiple of 4");
    }
    if (n_heads < 1) {
        throw_gpu_error("proxy_scores: n_heads=" + std::to_string(n_heads) + " must be >= 1");
    }
    if (n_q < 0 || n_q > kMaxItems / n_heads) {
        throw_gpu_error("proxy_scores: n_q=" + std::to_string(n_q) + " queries x " +
                        std::to_string(n_heads) + " heads outside [0, " +
                        std::to_string(kMaxItems) + "] rows");
    }
    if (first_pos < 0) {
        throw_gpu_error("proxy_scores: first_pos=" + std::to_string(first_pos) +
                        " must be >= 0");
    }
}

void check_pointers(const float* keys, const float* queries, const int64_t* q_pos, bool causal,
                    const float* scores) {
    if (!keys || !queries || !scores || (causal && !q_pos)) {
        throw_gpu_error(std::string("proxy_scores: ") +
                        (!keys ? "keys" : !queries ? "queries" : !scores ? "scores" : "q_pos") +
                        " is nullptr");
    }
    if (!aligned16(keys) || !aligned16(queries)) {
        throw_gpu_error(std::string("proxy_scores: ") + (!aligned16(keys) ? "keys" : "queries") +
                        " must be 16-byte aligned (read as float4)");
    }
}

} // namespace

void proxy_scores(
        const float* keys,
        int64_t n,
        int d,
        const float* queries,
        int n_heads,
        int64_t n_q,
        const int64_t* q_pos,
        int64_t first_pos,
        bool causal,
        float* scores,
        Workspace& ws,
        cudaStream_t stream) {
    check_shapes(n, d, n_heads, n_q, first_pos);
    const int64_t n_rows = int64_t(n_heads) * n_q;
    if (n == 0) {
        return; // nothing to score, nothing to write
    }
    if (n_rows == 0) { // no row to score with: F = 0
        // a token of workspace, so that the call on real memory is told
        // from the sizing call (a Workspace without memory only counts)
        ws.take<int>(1);
        if (ws.counting()) {
            return;
        }
        if (!scores) {
            throw_gpu_error("proxy_scores: scores is nullptr");
        }
        check_cuda(cudaMemsetAsync(scores, 0, size_t(n) * sizeof(float), stream),
                   "proxy_scores: zero scores");
        return;
    }
    const int64_t row_tiles = ceil_div(n_rows, kProxyTile);
    const int64_t key_tiles = ceil_div(n, kProxyTile);
    const Split key_split = split_tiles(n, row_tiles, kMaxSplitKeys);
    const Split row_split = split_tiles(n_rows, key_tiles, kMaxSplitRows);

    int* lims = ws.take<int>(size_t(n_rows));
    int* tile_max = ws.take<int>(size_t(row_tiles));
    float* part_m = ws.take<float>(size_t(key_split.n) * n_rows);
    float* part_l = ws.take<float>(size_t(key_split.n) * n_rows);
    float* lse = ws.take<float>(size_t(n_rows));
    float* part_f = ws.take<float>(size_t(row_split.n) * n);
    if (ws.counting()) {
        return;
    }
    check_pointers(keys, queries, q_pos, causal, scores);

    ProxyArgs a;
    a.keys = keys;
    a.queries = queries;
    a.n = n;
    a.n_rows = n_rows;
    a.d = d;
    a.q_scale = float(kLog2e / std::sqrt(double(d)));

    proxy_limits_kernel<<<unsigned(row_tiles), kProxyTile, 0, stream>>>(
            q_pos, n_q, n_rows, n, first_pos, causal, lims, tile_max);
    check_launch("proxy_limits_kernel");
    proxy_lse_kernel<<<dim3(unsigned(row_tiles), unsigned(key_split.n)), kProxyThreads, 0,
                       stream>>>(a, lims, tile_max, key_split.len, part_m, part_l);
    check_launch("proxy_lse_kernel");
    proxy_lse_merge_kernel<<<unsigned(ceil_div(n_rows, 256)), 256, 0, stream>>>(
            part_m, part_l, key_split.n, n_rows, lse);
    check_launch("proxy_lse_merge_kernel");
    proxy_colsum_kernel<<<dim3(unsigned(key_tiles), unsigned(row_split.n)), kProxyThreads, 0,
                          stream>>>(a, lims, tile_max, lse, row_split.len, part_f);
    check_launch("proxy_colsum_kernel");
    proxy_sum_kernel<<<unsigned(ceil_div(n, 256)), 256, 0, stream>>>(part_f, row_split.n, n,
                                                                      scores);
    check_launch("proxy_sum_kernel");
}

} // namespace gpu
} // namespace kvindex
