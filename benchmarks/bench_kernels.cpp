// Micro-benchmarks of the attention kernels against the machine's own
// single-core read bandwidth, measured in the same run.
//
//   ./build/benchmarks/bench_kernels --benchmark_counters_tabular=true
//
// BM_StreamRead sums a 256 MiB array (twice the dense working set, so no
// cache helps) with a vectorised loop: the bandwidth one core can read.
// BM_DenseAttention runs exact attention of one query over N = 131072 keys
// and values of d = 128 (64 MiB each) with kvindex's fused kernel, at each
// SIMD level this CPU runs. bytes_per_second counts keys + values read.
// BM_DenseAttentionKV does the same with keys and values stored as float32,
// bfloat16 or fp16 (kv_type.h; args: SIMD level, KVType): tokens_per_s is
// the figure to compare across types (bf16 and fp16 read half the bytes).
//
//   ./build/benchmarks/bench_kernels --benchmark_filter=DenseAttentionKV
//
// Each benchmark fixes its own minimum time (1 or 2 s, for stable
// bandwidth figures), which --benchmark_min_time does not override.
//
// BM_GroupAttention: a GQA group attended head by head or in one pass.
// BM_ChildrenCheck: what KVIndex::check_children (run first by every call
// of the public API) costs on a leaf and on wrappers, beside one attend of
// the same index over 2048 keys of d = 64.
//
//   ./build/benchmarks/bench_kernels --benchmark_filter=ChildrenCheck
//
// BM_WindowAppend: one decode append to Sink4,Window<m>,Uniform (m = 0:
// plain Uniform) after 65536 tokens of d = 128: what the window costs per
// token beyond the append itself. 4000 appends stay within the storage's
// headroom (1/16 after a bulk add), so that no reallocation is timed.
//
//   ./build/benchmarks/bench_kernels --benchmark_filter=WindowAppend
//
// BM_DecodeAppend: 8192 decode appends of d = 64 after a prompt of 32768
// tokens (args: LSHSample10x150, TopK(HNSW16), TopK(IVF128,Flat), Flat):
// µs per append, folds and rebuilds included, and the bytes per token held
// after the prompt and after the appends (memory_bytes(): capacities).
//
//   ./build/benchmarks/bench_kernels --benchmark_filter=DecodeAppend
//
// BM_CacheAppend: one decode token appended to one layer of a KVCache of
// SmolLM2's shape (9 query heads over 3 KV heads, d = 64) after a prompt of
// 4096 tokens (args: Sink4,Window64,Uniform, FP16,Flat): the cache's own
// cost per append (layer checks, each head's input checks, the heads'
// loop) beside the heads' appends. One thread (OMP_NUM_THREADS=1) shows
// the checks; two add the OpenMP region's start.
//
//   OMP_NUM_THREADS=1 ./build/benchmarks/bench_kernels --benchmark_filter=CacheAppend
//
// BM_HashKeys: the projections of LSHSample10x150's hash (1500
// hyperplanes of d = 128) for 8 keys: inner_products_scaled one key at a
// time (the kernel before session 39) or inner_products_multi for one key
// at a time or the block (args: 0, 1, 8). items_per_second is keys.
//
//   ./build/benchmarks/bench_kernels --benchmark_filter=HashKeys
//
// BM_TopKSelect: a fresh exact top-k (topk_inner_products, then
// topk_heap_sort) over n keys of d = 64 (args: n, k, scores rising along
// the scan 0/1: a decode query's attention to recent tokens).
//
//   ./build/benchmarks/bench_kernels --benchmark_filter=TopKSelect

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include <kvindex/KVCache.h>
#include <kvindex/KVIndex.h>
#include <kvindex/index_factory.h>
#include <kvindex/kernels.h>

namespace {

constexpr size_t kTokens = 131072;
constexpr size_t kDim = 128;

std::vector<float> filled(size_t n, float base) {
    std::vector<float> x(n);
    for (size_t i = 0; i < n; i++) {
        x[i] = base + float((i * 2654435761u) % 1000) * 1e-3f;
    }
    return x;
}

typedef float v8 __attribute__((vector_size(32)));

__attribute__((target("avx2"))) float sum_avx2(const float* x, size_t n) {
    v8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (size_t i = 0; i + 32 <= n; i += 32) {
        v8 t0, t1, t2, t3;
        std::memcpy(&t0, x + i, 32);
        std::memcpy(&t1, x + i + 8, 32);
        std::memcpy(&t2, x + i + 16, 32);
        std::memcpy(&t3, x + i + 24, 32);
        a0 += t0;
        a1 += t1;
        a2 += t2;
        a3 += t3;
    }
    v8 a = a0 + a1 + a2 + a3;
    float s = 0;
    for (int i = 0; i < 8; i++) {
        s += a[i];
    }
    return s;
}

void BM_StreamRead(benchmark::State& state) {
    size_t n = 2 * 2 * kTokens * kDim; // 256 MiB
    if (!__builtin_cpu_supports("avx2")) {
        // the vector loop is AVX2 code: it would stop the process on an
        // older CPU
        state.SkipWithError("BM_StreamRead needs AVX2");
        return;
    }
    auto x = filled(n, 0.0f);
    for (auto _ : state) {
        benchmark::DoNotOptimize(sum_avx2(x.data(), n));
    }
    state.SetBytesProcessed(int64_t(state.iterations()) * n * sizeof(float));
}
BENCHMARK(BM_StreamRead)->Unit(benchmark::kMillisecond)->MinTime(2.0);

void BM_DenseAttention(benchmark::State& state) {
    auto level = kvindex::SimdLevel(state.range(0));
    auto keys = filled(kTokens * kDim, -0.5f);
    auto values = filled(kTokens * kDim, 0.1f);
    auto q = filled(kDim, 0.3f);
    std::vector<float> out(kDim);
    kvindex::SimdLevel saved = kvindex::get_simd_level();
    kvindex::set_simd_level(level);
    for (auto _ : state) {
        float lse = kvindex::dense_attention(
                q.data(), keys.data(), values.data(), kDim, kDim, kTokens,
                0.0883883f, out.data());
        benchmark::DoNotOptimize(lse);
        benchmark::DoNotOptimize(out.data());
    }
    kvindex::set_simd_level(saved);
    state.SetLabel(kvindex::simd_level_name(level));
    state.SetBytesProcessed(
            int64_t(state.iterations()) * 2 * kTokens * kDim * sizeof(float));
}

void dense_levels(benchmark::internal::Benchmark* b) {
    for (auto level : kvindex::available_simd_levels()) {
        b->Arg(int(level));
    }
}
BENCHMARK(BM_DenseAttention)->Apply(dense_levels)->Unit(benchmark::kMillisecond)->MinTime(2.0);

void BM_DenseAttentionKV(benchmark::State& state) {
    auto level = kvindex::SimdLevel(state.range(0));
    auto type = kvindex::KVType(state.range(1));
    size_t es = kvindex::kv_type_size(type);
    std::vector<uint8_t> keys(kTokens * kDim * es), values(kTokens * kDim * es);
    {
        auto kf = filled(kTokens * kDim, -0.5f);
        auto vf = filled(kTokens * kDim, 0.1f);
        kvindex::convert_from_float(type, kf.data(), kf.size(), kDim, keys.data(), "keys");
        kvindex::convert_from_float(type, vf.data(), vf.size(), kDim, values.data(), "values");
    }
    kvindex::KVRows k(keys.data(), kDim, type), v(values.data(), kDim, type);
    k.finite = v.finite = true; // converted from floats, as a KVStorage holds them
    auto q = filled(kDim, 0.3f);
    std::vector<float> out(kDim);
    kvindex::SimdLevel saved = kvindex::get_simd_level();
    kvindex::set_simd_level(level);
    for (auto _ : state) {
        float lse = kvindex::dense_attention(q.data(), k, v, kTokens, 0.0883883f, out.data());
        benchmark::DoNotOptimize(lse);
        benchmark::DoNotOptimize(out.data());
    }
    kvindex::set_simd_level(saved);
    state.SetLabel(std::string(kvindex::simd_level_name(level)) + " " +
                   kvindex::kv_type_name(type));
    state.SetBytesProcessed(int64_t(state.iterations()) * 2 * kTokens * kDim * es);
    state.counters["tokens_per_s"] = benchmark::Counter(
            double(state.iterations()) * kTokens, benchmark::Counter::kIsRate);
}

void dense_levels_types(benchmark::internal::Benchmark* b) {
    for (auto level : kvindex::available_simd_levels()) {
        for (int t = 0; t < kvindex::kNumKVTypes; t++) {
            b->Args({int(level), t});
        }
    }
}
BENCHMARK(BM_DenseAttentionKV)
        ->Apply(dense_levels_types)
        ->Unit(benchmark::kMillisecond)
        ->MinTime(2.0);

/// One GQA group (g query heads sharing a KV head of d = 64, SmolLM2-135M's
/// head) over n tokens: g dense_attention calls (args: n, g, fused = 0)
/// against one dense_attention_group call (fused = 1). Time is per group.
void BM_GroupAttention(benchmark::State& state) {
    size_t n = size_t(state.range(0)), g = size_t(state.range(1));
    bool fused = state.range(2) != 0;
    const size_t d = 64;
    auto keys = filled(n * d, -0.5f), values = filled(n * d, 0.1f);
    auto q = filled(g * d, 0.3f);
    std::vector<float> out(g * d), lse(g);
    for (auto _ : state) {
        if (fused) {
            kvindex::dense_attention_group(
                    q.data(), g, keys.data(), values.data(), d, d, n, 0.125f, out.data(),
                    lse.data());
        } else {
            for (size_t c = 0; c < g; c++) {
                lse[c] = kvindex::dense_attention(
                        q.data() + c * d, keys.data(), values.data(), d, d, n, 0.125f,
                        out.data() + c * d);
            }
        }
        benchmark::DoNotOptimize(out.data());
    }
    state.SetLabel(fused ? "one group pass" : "one pass per query head");
}
BENCHMARK(BM_GroupAttention)
        ->ArgsProduct({{8192, 131072}, {3, 4}, {0, 1}})
        ->Unit(benchmark::kMicrosecond)
        ->MinTime(1.0);

void BM_HashKeys(benchmark::State& state) {
    const size_t d = 128, r = 1500, g = 8, mode = size_t(state.range(0));
    auto planes = filled(r * d, 0.2f), keys = filled(g * d, -0.4f);
    std::vector<float> proj(g * r);
    for (auto _ : state) {
        for (size_t b = 0; b < g; b++) {
            if (mode == 0) {
                kvindex::inner_products_scaled(
                        keys.data() + b * d, planes.data(), d, r, 1.0f, proj.data() + b * r);
            } else if (mode == 1) {
                kvindex::inner_products_multi(
                        keys.data() + b * d, 1, planes.data(), d, r, proj.data() + b * r, r);
            }
        }
        if (mode == 8) {
            kvindex::inner_products_multi(keys.data(), g, planes.data(), d, r, proj.data(), r);
        }
        benchmark::DoNotOptimize(proj.data());
    }
    state.SetItemsProcessed(int64_t(state.iterations() * g));
    state.SetLabel(mode == 0 ? "inner_products_scaled, a key at a time"
                             : mode == 1 ? "inner_products_multi, a key at a time"
                                         : "inner_products_multi, 8 keys");
}
BENCHMARK(BM_HashKeys)->Arg(0)->Arg(1)->Arg(8)->Unit(benchmark::kMicrosecond)->MinTime(1.0);

/// check_children (args: chain, 0) against a whole attend (chain, 1).
void BM_ChildrenCheck(benchmark::State& state) {
    static const char* const kChains[] = {
            "Flat", "Sink4,Window64,Flat", "Sink4,Window8,Hybrid(TopK(Flat),Uniform)"};
    const char* chain = kChains[state.range(0)];
    const bool attend = state.range(1) != 0;
    const int d = 64;
    const size_t n = 2048;
    auto kv = filled(n * d, -0.5f), q = filled(d, 0.3f);
    std::vector<float> out(d);
    auto index = kvindex::index_factory(d, chain);
    index->add_kv(n, kv.data(), kv.data());
    for (auto _ : state) {
        if (attend) {
            index->attend(1, q.data(), out.data(), nullptr);
        } else {
            index->check_children();
        }
        benchmark::DoNotOptimize(out.data());
    }
    state.SetLabel(std::string(chain) + (attend ? ": attend" : ": check_children"));
}
BENCHMARK(BM_ChildrenCheck)->ArgsProduct({{0, 1, 2}, {0, 1}})->Unit(benchmark::kNanosecond);

/// One append (arg: the window, 0 for none) to an index of 65536 tokens.
void BM_WindowAppend(benchmark::State& state) {
    const int64_t window = state.range(0);
    const std::string chain =
            window == 0 ? "Uniform" : "Sink4,Window" + std::to_string(window) + ",Uniform";
    const int d = 128;
    const size_t n = 65536, n_new = 4000;
    auto kv = filled((n + n_new) * d, -0.5f);
    auto index = kvindex::index_factory(d, chain);
    index->add_kv(n, kv.data(), kv.data());
    size_t i = 0;
    for (auto _ : state) {
        const float* x = kv.data() + (n + i) * d;
        index->add_kv(1, x, x);
        i++;
    }
    state.SetLabel(chain);
}
BENCHMARK(BM_WindowAppend)
        ->Arg(0)
        ->Arg(64)
        ->Arg(512)
        ->Arg(2048)
        ->Iterations(4000)
        ->Unit(benchmark::kMicrosecond);

/// Decode appends after a prompt (arg: the chain): the time of one append
/// (folds and table rebuilds included, as a decode loop pays them) and the
/// bytes per token the index holds after them (memory_bytes(), capacities).
void BM_DecodeAppend(benchmark::State& state) {
    static const char* const kChains[] = {
            "LSHSample10x150", "TopK(HNSW16)", "TopK(IVF128,Flat)", "Flat"};
    const char* chain = kChains[state.range(0)];
    const int d = 64;
    const size_t n = 32768, n_new = 8192;
    auto kv = filled((n + n_new) * d, -0.5f);
    auto index = kvindex::index_factory(d, chain);
    index->add_kv(n, kv.data(), kv.data());
    const double prompt_bytes = double(index->memory_bytes()) / double(n);
    size_t i = 0;
    for (auto _ : state) {
        const float* x = kv.data() + (n + i) * d;
        index->add_kv(1, x, x);
        i++;
    }
    state.counters["bytes_per_token_prompt"] = prompt_bytes;
    state.counters["bytes_per_token_after"] = double(index->memory_bytes()) / double(index->ntotal);
    state.SetLabel(chain);
}
BENCHMARK(BM_DecodeAppend)
        ->DenseRange(0, 3)
        ->Iterations(8192)
        ->Unit(benchmark::kMicrosecond);

/// Decode appends to one layer of a cache (arg: the chain).
void BM_CacheAppend(benchmark::State& state) {
    static const char* const kChains[] = {"Sink4,Window64,Uniform", "FP16,Flat"};
    const char* chain = kChains[state.range(0)];
    const int q_heads = 9, kv_heads = 3, d = 64;
    const size_t n = 4096, n_new = 8192;
    kvindex::KVCache cache(1, q_heads, kv_heads, d, d, chain);
    auto prompt = filled(kv_heads * n * d, -0.5f);
    cache.prefill(0, n, prompt.data(), prompt.data(), 0, nullptr, nullptr, kvindex::RopeParams{});
    auto kv = filled(n_new * kv_heads * d, 0.25f); // token i: [kv_heads, 1, d] at i * kv_heads * d
    size_t i = 0;
    for (auto _ : state) {
        const float* x = kv.data() + i * kv_heads * d;
        cache.append(0, 1, x, x);
        i++;
    }
    state.SetLabel(chain);
}
BENCHMARK(BM_CacheAppend)
        ->DenseRange(0, 1)
        ->Iterations(8192)
        ->Unit(benchmark::kMicrosecond);

/// A fresh top-k of (n, k) over random keys, their scores rising along
/// the scan or not.
void BM_TopKSelect(benchmark::State& state) {
    const size_t n = size_t(state.range(0)), k = size_t(state.range(1)), d = 64;
    const bool rising = state.range(2) != 0;
    auto x = filled(n * d, -0.5f), q = filled(d, 0.1f);
    for (size_t i = 0; i < n; i++) { // a trend along q, scaled by the position
        for (size_t j = 0; j < d; j++) {
            x[i * d + j] += rising ? 4.0f * float(i) / float(n) * q[j] : 0.0f;
        }
    }
    // the same keys in a scrambled order, for the flat case
    if (!rising) {
        for (size_t i = 0; i < n; i++) {
            size_t j = (i * 2654435761u) % n;
            std::swap_ranges(x.begin() + i * d, x.begin() + (i + 1) * d, x.begin() + j * d);
        }
    }
    std::vector<float> hs(k);
    std::vector<int64_t> hi(k);
    for (auto _ : state) {
        size_t filled_size = 0;
        kvindex::topk_inner_products(q.data(), x.data(), d, n, nullptr, 0, k, hs.data(), hi.data(), &filled_size);
        kvindex::topk_heap_sort(hs.data(), hi.data(), filled_size);
        benchmark::DoNotOptimize(hi.data());
    }
    state.SetLabel(rising ? "rising" : "scrambled");
}
BENCHMARK(BM_TopKSelect)
        ->ArgsProduct({{8192}, {100, 410}, {0, 1}})
        ->ArgsProduct({{65536}, {32, 1024}, {0, 1}})
        ->Unit(benchmark::kMicrosecond);

} // namespace

BENCHMARK_MAIN();
