// Host side of MagicPIG's LSH sampling (lsh_sample.h): argument checks, the
// scratch arrays of the sampler, the launches of the hash, the collision
// count and the code-by-code tail, then list_attention with the
// importance-weight bias (list_attention.cuh) or the per-entry fill of
// select.

#include "lsh_sample.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "gpu_error.h"
#include "kernels/lsh_sample.cuh"
#include "launch_plan.cuh"
#include "list_attention.cuh"

namespace kvindex {
namespace gpu {

namespace {

/// Throws naming the first argument the sampler cannot use.
void check_tables(const KVHeadsView& kv, int rows_per_head, const LSHTables& t, int min_hits,
                  bool check_pointers, const char* what) {
    check_view(kv, rows_per_head, what);
    const std::string w = what;
    if (t.K < 1 || t.K > 16 || t.L < 1 || t.L > 4096) {
        throw_gpu_error(w + ": K=" + std::to_string(t.K) + " bits and L=" + std::to_string(t.L) +
                        " tables must be in [1, 16] and [1, 4096]");
    }
    if (min_hits < 0 || min_hits > t.L) {
        throw_gpu_error(w + ": min_hits=" + std::to_string(min_hits) + " outside [0, L=" +
                        std::to_string(t.L) + "]");
    }
    const int64_t n_rows = int64_t(kv.n_heads) * rows_per_head;
    if (n_rows > 65535) {
        throw_gpu_error(w + ": " + std::to_string(n_rows) +
                        " query rows exceed a grid's 65535 (run them in batches)");
    }
    if (t.n_inner < 0 || t.first_inner < 0 || t.first_inner + t.n_inner > kv.n_tokens) {
        throw_gpu_error(w + ": inner tokens [" + std::to_string(t.first_inner) + ", " +
                        std::to_string(t.first_inner + t.n_inner) + ") outside the " +
                        std::to_string(kv.n_tokens) + " tokens of a head");
    }
    if (t.main.n_per_table < 0 || t.recent.n_per_table < 0 || t.n_tail() < 0) {
        throw_gpu_error(w + ": the levels hold " + std::to_string(t.main.n_per_table) + " + " +
                        std::to_string(t.recent.n_per_table) + " tokens, the middle " +
                        std::to_string(t.n_inner));
    }
    if (t.n_inner == 0 || min_hits == 0 || !check_pointers) {
        return; // nothing is hashed nor looked up (or only counting)
    }
    if (!t.planes || !t.mean || !t.norms) {
        throw_gpu_error(w + ": hyperplanes, mean or norms missing (nullptr)");
    }
    if ((t.main.n_per_table > 0 && (!t.main.offsets || !t.main.ids)) ||
        (t.recent.n_per_table > 0 && (!t.recent.offsets || !t.recent.ids))) {
        throw_gpu_error(w + ": a level with tokens has no offsets or ids (nullptr)");
    }
    if (t.n_tail() > 0 && !t.tail_codes) {
        throw_gpu_error(w + ": " + std::to_string(t.n_tail()) +
                        " tokens are in no level and have no codes (tail_codes is nullptr)");
    }
}

/// set_lsh_shared_walk's switch (process-wide; take_scratch reads it once per call).
std::atomic<bool> shared_walk_enabled{true};

/// The most words of a bitset one block of lsh_range_walk_kernel holds
/// (16 KB: two bitsets stay under the default 48 KB of shared memory).
constexpr int64_t kRangeWalkMaxWords = 4096;
/// Blocks per row at least: a decode step has few rows, and a block's
/// bound searches are a fixed cost that more blocks share out.
constexpr int64_t kRangeWalkMinParts = 8;

/** The words per block of lsh_range_walk_kernel for rows of `words` words,
 * or 0 where it does not run: min_hits >= 3 (16-bit counters) or
 * disabled (set_lsh_shared_walk). */
int64_t range_walk_words(int mode, int64_t words) {
    if (mode > 2 || !shared_walk_enabled.load(std::memory_order_relaxed)) {
        return 0;
    }
    const int64_t parts = std::max(kRangeWalkMinParts, ceil_div(words, kRangeWalkMaxWords));
    return std::max<int64_t>(1, ceil_div(words, parts));
}

/// The sampler's scratch, carved from a Workspace (the same takes while
/// counting and for real).
struct SampleScratch {
    uint16_t* q_codes = nullptr; ///< [n_rows][L]
    float* q_mean = nullptr;     ///< [n_rows]
    float* q_norm = nullptr;     ///< [n_rows]
    uint32_t* seen1 = nullptr;   ///< [n_rows][words] (min_hits 1, 2)
    uint32_t* seen2 = nullptr;   ///< [n_rows][words] (min_hits 2)
    uint32_t* counts = nullptr;  ///< [n_rows][words] (min_hits >= 3)
    int64_t words = 0;
    int mode = 0;                ///< 1, 2: bitsets; 3: 16-bit counters
    /// words per block of lsh_range_walk_kernel, whose bitsets live in
    /// shared memory (seen1 and seen2 are then not taken); 0: the walk
    /// runs on the arrays above
    int64_t range_wpb = 0;
};

SampleScratch take_scratch(Workspace& ws, int64_t n_rows, const LSHTables& t, int min_hits) {
    SampleScratch s;
    s.q_codes = ws.take<uint16_t>(size_t(n_rows) * t.L);
    s.q_mean = ws.take<float>(size_t(n_rows));
    s.q_norm = ws.take<float>(size_t(n_rows));
    const int64_t n_levels = t.main.n_per_table + t.recent.n_per_table;
    s.mode = std::min(min_hits, 3);
    if (s.mode <= 2) {
        s.words = (n_levels + 31) / 32;
        // read once here, so that counting and the run agree even if
        // set_lsh_shared_walk is called between them
        s.range_wpb = range_walk_words(s.mode, s.words);
        if (s.range_wpb == 0) {
            s.seen1 = ws.take<uint32_t>(size_t(n_rows) * s.words);
            if (s.mode == 2) {
                s.seen2 = ws.take<uint32_t>(size_t(n_rows) * s.words);
            }
        }
    } else {
        s.words = (n_levels + 1) / 2;
        s.counts = ws.take<uint32_t>(size_t(n_rows) * s.words);
    }
    return s;
}

template <int D>
void launch_hash(const LSHHashArgs& a, int nr, dim3 grid, cudaStream_t stream) {
    const unsigned threads = unsigned(a.K) * 32; // a warp per bit
    switch (nr) {
        case 1:
            lsh_hash_kernel<D, 1><<<grid, threads, 0, stream>>>(a);
            break;
        case 2:
            lsh_hash_kernel<D, 2><<<grid, threads, 0, stream>>>(a);
            break;
        case 4:
            lsh_hash_kernel<D, 4><<<grid, threads, 0, stream>>>(a);
            break;
        default:
            lsh_hash_kernel<D, 8><<<grid, threads, 0, stream>>>(a);
            break;
    }
    check_launch("lsh_hash_kernel");
}

template <int kMode>
void launch_range_walk(const LSHWalkArgs& w, int64_t wpb, int64_t n_rows, cudaStream_t stream) {
    const dim3 grid(unsigned(ceil_div(w.words, wpb)), unsigned(n_rows));
    const size_t bytes = size_t(wpb) * kMode * sizeof(uint32_t);
    lsh_range_walk_kernel<kMode><<<grid, kRangeWalkThreads, bytes, stream>>>(w, wpb);
    check_launch("lsh_range_walk_kernel");
}

/** Hashes the queries and appends each row's sample to out (lens zeroed
 * here first): the hash, the walk over both levels, the tail. */
void run_sampler(const KVHeadsView& kv, const float* q, int rows_per_head, const LSHTables& t,
                 int min_hits, const SampleScratch& s, const LSHListOut& out,
                 cudaStream_t stream) {
    const int64_t n_rows = int64_t(kv.n_heads) * rows_per_head;
    check_cuda(cudaMemsetAsync(out.lens, 0, size_t(n_rows) * sizeof(int32_t), stream),
               "lsh: zeroing the sample sizes");
    // the codes of the queries, <q, mean>, |q|: rows that share the planes
    // share each plane's read
    LSHHashArgs h;
    h.q = q;
    h.n_rows = n_rows;
    h.rows_per_head = rows_per_head;
    h.rows_per_group = t.planes_head_stride == 0 ? n_rows : rows_per_head;
    h.planes = t.planes;
    h.planes_head_stride = t.planes_head_stride;
    h.mean = t.mean;
    h.mean_head_stride = t.mean_head_stride;
    h.K = t.K;
    h.L = t.L;
    h.q_codes = s.q_codes;
    h.q_mean = s.q_mean;
    h.q_norm = s.q_norm;
    const int nr = rows_tile(int(std::min<int64_t>(h.rows_per_group, 8)));
    const dim3 hash_grid(unsigned(t.L + 1), unsigned(n_rows / h.rows_per_group),
                         unsigned(ceil_div(h.rows_per_group, nr)));
    switch (kv.d) {
        case 64:
            launch_hash<64>(h, nr, hash_grid, stream);
            break;
        case 128:
            launch_hash<128>(h, nr, hash_grid, stream);
            break;
        default:
            launch_hash<256>(h, nr, hash_grid, stream);
            break;
    }

    const int64_t n_levels = t.main.n_per_table + t.recent.n_per_table;
    if (n_levels > 0) {
        // the bitsets in shared memory, split by token range over blocks,
        // else (16-bit counters, or the shared walk switched off) in the
        // scratch arrays, zeroed here
        const int64_t wpb = s.range_wpb;
        if (wpb == 0) {
            const size_t bytes = size_t(n_rows) * s.words * sizeof(uint32_t);
            for (uint32_t* p : {s.seen1, s.seen2, s.counts}) {
                if (p) {
                    check_cuda(cudaMemsetAsync(p, 0, bytes, stream),
                               "lsh: zeroing the collision counts");
                }
            }
        }
        LSHWalkArgs w;
        w.q_codes = s.q_codes;
        w.rows_per_head = rows_per_head;
        w.K = t.K;
        w.L = t.L;
        w.min_hits = min_hits;
        w.main = {t.main.offsets, t.main.offsets_head_stride, t.main.ids, t.main.ids_head_stride,
                  t.main.n_per_table};
        w.recent = {t.recent.offsets, t.recent.offsets_head_stride, t.recent.ids,
                    t.recent.ids_head_stride, t.recent.n_per_table};
        w.seen1 = s.seen1;
        w.seen2 = s.seen2;
        w.counts = s.counts;
        w.words = s.words;
        w.out = out;
        if (wpb > 0) {
            if (s.mode == 1) {
                launch_range_walk<1>(w, wpb, n_rows, stream);
            } else {
                launch_range_walk<2>(w, wpb, n_rows, stream);
            }
        } else {
            // blocks of the recent level only when it holds tokens
            const dim3 grid(unsigned(t.recent.n_per_table > 0 ? 2 * t.L : t.L),
                            unsigned(n_rows));
            switch (s.mode) {
                case 1:
                    lsh_walk_kernel<1><<<grid, kWalkThreads, 0, stream>>>(w);
                    break;
                case 2:
                    lsh_walk_kernel<2><<<grid, kWalkThreads, 0, stream>>>(w);
                    break;
                default:
                    lsh_walk_kernel<3><<<grid, kWalkThreads, 0, stream>>>(w);
                    break;
            }
            check_launch("lsh_walk_kernel");
        }
    }

    if (t.n_tail() > 0) {
        LSHTailArgs a;
        a.q_codes = s.q_codes;
        a.rows_per_head = rows_per_head;
        a.L = t.L;
        a.min_hits = min_hits;
        a.tail_codes = t.tail_codes;
        a.tail_head_stride = t.tail_head_stride;
        a.tail_begin = t.tail_begin();
        a.n_tail = t.n_tail();
        a.out = out;
        const dim3 grid(unsigned(ceil_div(t.n_tail(), kTailWarps)), unsigned(n_rows));
        lsh_tail_kernel<<<grid, kTailWarps * 32, 0, stream>>>(a);
        check_launch("lsh_tail_kernel");
    }
}

/** The table over p of (K, L, m) on the current device
 * (lsh_table_kernel), built on first use and kept for the process: 64 KB
 * each, never freed (a device array freed at exit could outlive the
 * context). The first build waits for its kernel, so that any stream may
 * read it after; later calls only look it up (a CUDA graph captures
 * calls after a warm-up has built it). */
const float* inclusion_table(int K, int L, int m, cudaStream_t stream) {
    static std::mutex mutex;
    static std::map<std::tuple<int, int, int, int>, float*> tables;
    int device = 0;
    check_cuda(cudaGetDevice(&device), "lsh: the current device");
    std::lock_guard<std::mutex> lock(mutex);
    float*& t = tables[std::make_tuple(device, K, L, m)];
    if (!t) {
        float* p = nullptr;
        check_cuda(cudaMalloc(reinterpret_cast<void**>(&p), (kLSHTableCells + 1) * sizeof(float)),
                   "lsh: the inclusion table");
        lsh_table_kernel<<<unsigned(kLSHTableCells + 1), kLSHTableThreads, 0, stream>>>(K, L, m,
                                                                                         p);
        check_launch("lsh_table_kernel");
        check_cuda(cudaStreamSynchronize(stream), "lsh: building the inclusion table");
        t = p;
    }
    return t;
}

LSHBias::Params bias_params(const KVHeadsView& kv, const LSHTables& t, int min_hits,
                            const SampleScratch& s) {
    LSHBias::Params p;
    p.q_mean = s.q_mean;
    p.q_norm = s.q_norm;
    p.norms = t.norms;
    p.norms_head_stride = t.norms_head_stride;
    p.first_inner = t.first_inner;
    // the exact inverse of the scale kernel_args gives the query
    p.inv_q_scale = 1.0f / (kLog2e / std::sqrt(float(kv.d)));
    p.K = t.K;
    p.L = t.L;
    p.min_hits = min_hits;
    return p;
}

} // namespace

void lsh_attention(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        int64_t n_sink,
        int64_t n_window,
        const LSHTables& tables,
        int min_hits,
        float* out,
        float* lse,
        Workspace& ws,
        cudaStream_t stream) {
    check_tables(kv, rows_per_head, tables, min_hits, !ws.counting(), "lsh_attention");
    if (n_sink < 0 || n_window < 0) {
        throw_gpu_error("lsh_attention: n_sink=" + std::to_string(n_sink) + " and n_window=" +
                        std::to_string(n_window) + " must be >= 0");
    }
    if (min_hits == 0) { // u = 1 for every token: exact attention
        dense_attention(kv, q, rows_per_head, out, lse, ws, stream);
        return;
    }
    // the middle the static part leaves must be the sampled one
    const TokenRanges r = static_ranges(kv.n_tokens, n_sink, n_window);
    const int64_t mid_begin = r.n0, mid_size = r.b1 - r.n0;
    if (tables.n_inner != mid_size || (mid_size > 0 && tables.first_inner != mid_begin)) {
        throw_gpu_error("lsh_attention: the tables hold inner tokens [" +
                        std::to_string(tables.first_inner) + ", " +
                        std::to_string(tables.first_inner + tables.n_inner) +
                        ") but the middle between sink and window is [" +
                        std::to_string(mid_begin) + ", " + std::to_string(mid_begin + mid_size) +
                        ")");
    }
    const int64_t n_rows = int64_t(kv.n_heads) * rows_per_head;
    TokenLists lists;
    lists.per_row = true;
    if (tables.n_inner == 0) { // only the static part
        list_attention_with<NoBias>(kv, q, rows_per_head, n_sink, n_window, lists,
                                    NoBias::Params(), out, lse, ws, stream);
        return;
    }
    const SampleScratch s = take_scratch(ws, n_rows, tables, min_hits);
    int32_t* ids = ws.take<int32_t>(size_t(n_rows) * tables.n_inner);
    int32_t* lens = ws.take<int32_t>(size_t(n_rows));
    lists.ids = ids;
    lists.lens = lens;
    lists.stride = tables.n_inner; // a token is sampled at most once
    lists.max_len = tables.n_inner;
    LSHBias::Params bias = bias_params(kv, tables, min_hits, s);
    if (!ws.counting()) {
        // the attention reads u from the table (a key costs an acosf and
        // two loads, not the binomial tail); select's u stays exact
        bias.log2u_table = inclusion_table(tables.K, tables.L, min_hits, stream);
        run_sampler(kv, q, rows_per_head, tables, min_hits, s,
                    LSHListOut{ids, lens, tables.n_inner, tables.first_inner}, stream);
    }
    // while counting, this only takes its part of the workspace
    list_attention_with<LSHBias>(kv, q, rows_per_head, n_sink, n_window, lists, bias, out, lse,
                                 ws, stream);
}

void lsh_select(
        const KVHeadsView& kv,
        const float* q,
        int rows_per_head,
        const LSHTables& tables,
        int min_hits,
        int32_t* ids,
        int32_t* lens,
        float* scores,
        float* u,
        Workspace& ws,
        cudaStream_t stream) {
    check_tables(kv, rows_per_head, tables, min_hits, !ws.counting(), "lsh_select");
    if (min_hits < 1) {
        throw_gpu_error("lsh_select: min_hits=0 samples nothing: every token is read (u = 1)");
    }
    const int64_t n_rows = int64_t(kv.n_heads) * rows_per_head;
    if (tables.n_inner == 0) {
        if (!ws.counting()) {
            check_cuda(cudaMemsetAsync(lens, 0, size_t(n_rows) * sizeof(int32_t), stream),
                       "lsh_select: zeroing the sample sizes");
        }
        return;
    }
    const SampleScratch s = take_scratch(ws, n_rows, tables, min_hits);
    if (ws.counting()) {
        return;
    }
    run_sampler(kv, q, rows_per_head, tables, min_hits, s,
                LSHListOut{ids, lens, tables.n_inner, tables.first_inner}, stream);
    if (!scores && !u) {
        return;
    }
    const LSHBias::Params bias = bias_params(kv, tables, min_hits, s);
    const unsigned bx = unsigned(std::min<int64_t>(ceil_div(tables.n_inner, kFillWarps), 512));
    with_type_and_dim(kv.type, kv.d, [&](auto tag, auto dim) {
        using T = typename decltype(tag)::type;
        constexpr int D = decltype(dim)::value;
        lsh_fill_kernel<T, D><<<dim3(bx, unsigned(n_rows)), kFillWarps * 32, 0, stream>>>(
                static_cast<const T*>(kv.keys), kv.head_stride, q, rows_per_head, ids, lens,
                tables.n_inner, bias, scores, u);
        check_launch("lsh_fill_kernel");
    });
}

void set_lsh_shared_walk(bool enabled) {
    shared_walk_enabled.store(enabled, std::memory_order_relaxed);
}

void lsh_inclusion_eval(const float* c, int64_t n, int K, int L, int min_hits, float* u,
                        cudaStream_t stream, bool from_table) {
    if (n < 0 || K < 1 || K > 16 || L < 1 || L > 4096 || min_hits < 0 || min_hits > L) {
        throw_gpu_error("lsh_inclusion_eval: n=" + std::to_string(n) + ", K=" +
                        std::to_string(K) + ", L=" + std::to_string(L) + ", min_hits=" +
                        std::to_string(min_hits) + " out of range");
    }
    if (n == 0) {
        return;
    }
    const unsigned blocks = unsigned(std::min<int64_t>(ceil_div(n, 256), 4096));
    const float* table = from_table && min_hits > 0 ? inclusion_table(K, L, min_hits, stream)
                                                    : nullptr;
    lsh_inclusion_kernel<<<blocks, 256, 0, stream>>>(c, n, K, L, min_hits, table, u);
    check_launch("lsh_inclusion_kernel");
}

} // namespace gpu
} // namespace kvindex
