// kvdemo: a short tour of the API on one synthetic head (kvbench is the
// full benchmark, on traces).
//
// Builds one synthetic attention head with the geometry that troubles ANN
// indexes (keys share a large offset, queries sit on the other side, RoPE by
// position, low-rank structure, a few strongly attended "needle" keys), then
// for each index string: builds the index, attends the evaluation queries,
// and compares with exact attention computed in the same run.
//
//   ./build/benchmarks/kvdemo [--tokens 32768] [--dim 128] [--queries 50]
//        [--index "TopK(HNSW32)|efSearch=64" ...]   ("STRING|params", parameters.h)

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include "subcommand_options.h"

#include <kvindex/KVIndex.h>
#include <kvindex/index_factory.h>
#include <kvindex/kernels.h>
#include <kvindex/parameters.h>
#include <kvindex/rope.h>
#include "blas_kernels.h"

namespace po = boost::program_options;
using namespace kvindex;

namespace {

struct Head {
    int d;
    idx_t n, nq;
    std::vector<float> keys, values, queries;
};

Head synthetic_head(idx_t n, int d, idx_t nq, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> g(0.0f, 1.0f);
    Head h{d, n, nq, std::vector<float>(n * d), std::vector<float>(n * d), std::vector<float>(nq * d)};
    int rank = 8;
    std::vector<float> basis(rank * d), offset(d);
    for (auto& x : basis) {
        x = g(rng);
    }
    for (auto& x : offset) {
        x = 1.5f * g(rng);
    }
    for (idx_t i = 0; i < n; i++) {
        for (int r = 0; r < rank; r++) {
            float c = g(rng);
            for (int j = 0; j < d; j++) {
                h.keys[i * d + j] += c * basis[r * d + j] / std::sqrt(float(rank));
            }
        }
        for (int j = 0; j < d; j++) {
            h.keys[i * d + j] += offset[j] + 0.3f * g(rng);
            h.values[i * d + j] = 0.5f * offset[j] + g(rng);
        }
    }
    // queries: opposite the key offset, aligned with one "needle" key each
    std::uniform_int_distribution<idx_t> pick(0, n - 1);
    for (idx_t i = 0; i < nq; i++) {
        idx_t needle = pick(rng);
        for (int j = 0; j < d; j++) {
            h.queries[i * d + j] = -0.5f * offset[j] + 2.0f * (h.keys[needle * d + j] - offset[j]) +
                    0.5f * g(rng);
        }
    }
    std::vector<int64_t> pos(n);
    for (idx_t i = 0; i < n; i++) {
        pos[i] = i;
    }
    RopeParams rope;
    apply_rope(n, d, h.keys.data(), pos.data(), rope);
    std::vector<int64_t> qpos(nq, n - 1);
    apply_rope(nq, d, h.queries.data(), qpos.data(), rope);
    return h;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double rel_l2(const float* a, const float* b, int d) {
    double num = 0, den = 0;
    for (int j = 0; j < d; j++) {
        num += double(a[j] - b[j]) * (a[j] - b[j]);
        den += double(b[j]) * b[j];
    }
    return std::sqrt(num / std::max(den, 1e-30));
}

} // namespace

int main(int argc, char** argv) {
    kvtools::use_widest_blas_kernels(argv);
    idx_t n, nq;
    int d;
    uint64_t seed;
    std::vector<std::string> specs;
    po::options_description opts("kvdemo: compare KV indexes with exact attention on a synthetic head");
    opts.add_options()
            ("tokens", po::value<idx_t>(&n)->default_value(32768), "keys in the head")
            ("dim", po::value<int>(&d)->default_value(128), "head dimension")
            ("queries", po::value<idx_t>(&nq)->default_value(50), "evaluation queries")
            ("seed", po::value<uint64_t>(&seed)->default_value(1), "generator seed")
            ("index", po::value<std::vector<std::string>>(&specs)->multitoken(),
             "factory string[|param=value,...], repeatable");
    po::variables_map vm;
    try {
        // the tools' parser: --help, and "-1" refused for the unsigned seed
        if (!kvtools::parse_options(argc, argv, opts, vm)) {
            return 0;
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kvdemo: %s\n", e.what());
        return 2;
    }
    if (d < 2 || d > kMaxDimension || d % 2 != 0) {
        // RoPE pairs coordinates; the factory's bound
        std::fprintf(stderr, "kvdemo: --dim %d must be even, in [2, %d]\n", d, kMaxDimension);
        return 2;
    }
    if (n < 1 || nq < 1) {
        std::fprintf(stderr, "kvdemo: --tokens (%lld) and --queries (%lld) must be >= 1\n",
                     (long long)n, (long long)nq);
        return 2;
    }
    if (specs.empty()) {
        specs = {"Flat", "TopK(Flat)|k=100", "TopK(IVF32,Flat)|k=100,nprobe=8",
                 "TopK(HNSW16)|k=100,efSearch=128", "Sink4,Window64,TopK(IVF32,Flat)|k=100,nprobe=8"};
    }
    try {
        std::fprintf(stderr, "kvdemo: generating %zd keys, d=%d, %zd queries (SIMD %s)\n",
                     size_t(n), d, size_t(nq), simd_level_name(get_simd_level()));
        Head h = synthetic_head(n, d, nq, seed);

        // exact reference, timed one query at a time like every index below
        auto exact = index_factory(d, "Flat");
        exact->add_kv(n, h.keys.data(), h.values.data());
        std::vector<float> ref(nq * d);
        // one untimed call first, here and before every index below: the
        // first call's setup (thread pool, first touch) would otherwise be
        // charged to whichever runs first (Flat read 6x faster than itself
        // at --queries 3)
        exact->attend(1, h.queries.data(), ref.data(), nullptr);
        auto t0 = std::chrono::steady_clock::now();
        for (idx_t i = 0; i < nq; i++) {
            exact->attend(1, h.queries.data() + i * d, ref.data() + i * d, nullptr);
        }
        double dense_us = 1e6 * seconds_since(t0) / nq;

        std::printf("%-46s %10s %10s %10s %9s %8s %10s\n", "index", "rel_err", "rel_p95",
                    "us/query", "speedup", "build_s", "bytes/tok");
        for (const std::string& spec : specs) {
            IndexSpec parsed = parse_index_spec(spec);
            auto tb = std::chrono::steady_clock::now();
            auto index = index_factory(d, parsed.factory);
            // before prefill, so that prefill-time knobs (budget, epsilon) apply
            if (!parsed.params.empty()) {
                set_index_parameters(index.get(), resolve_percentages(parsed.params, n, index.get()));
            }
            PrefillInput in;
            in.n_tokens = n;
            in.keys = h.keys.data();
            in.values = h.values.data();
            index->prefill(in);
            double build_s = seconds_since(tb);
            std::vector<float> out(nq * d);
            index->attend(1, h.queries.data(), out.data(), nullptr);
            auto ta = std::chrono::steady_clock::now();
            for (idx_t i = 0; i < nq; i++) {
                index->attend(1, h.queries.data() + i * d, out.data() + i * d, nullptr);
            }
            double us = 1e6 * seconds_since(ta) / nq;
            std::vector<double> err(nq);
            for (idx_t i = 0; i < nq; i++) {
                err[i] = rel_l2(out.data() + i * d, ref.data() + i * d, d);
            }
            double mean = 0;
            for (double e : err) {
                mean += e / nq;
            }
            std::sort(err.begin(), err.end());
            double p95 = err[std::min<size_t>(nq - 1, size_t(0.95 * nq))];
            std::printf("%-46s %10.2e %10.2e %10.1f %9.2f %8.2f %10.0f\n", spec.c_str(), mean, p95,
                        us, dense_us / us, build_s, double(index->memory_bytes()) / n);
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kvdemo: %s\n", e.what());
        return 1;
    }
    return 0;
}
