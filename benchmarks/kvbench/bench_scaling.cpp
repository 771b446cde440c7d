// Scaling benchmark: exact dense attention vs top-k retrieval at growing
// context, one synthetic head (mixed preset: a needle, a local and a flat
// query head sharing one KV head), d = 128.
//
//   ./build/benchmarks/bench_scaling [--tokens 32768,131072,1048576] [--queries 30] [--repeat 1]
//
// For each length: build each index on all keys (seconds), then for each
// query time attend one query at a time (µs, one thread), recall@100 of the
// exact top-100, and the speed-up over the dense kernel timed in the same run.
// --repeat R times R passes over the queries (dense and every index alike):
// the first pass of an index meets its data cold, the later ones warm.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include <kvindex/attention.h>
#include <kvindex/index_factory.h>
#include <kvindex/kernels.h>
#include <kvindex/parameters.h>

#include "synthetic.h"
#include "blas_kernels.h"
#include "subcommand_options.h"

using namespace kvindex;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

} // namespace

int run_bench(int argc, char** argv) {
    kvtools::use_widest_blas_kernels(argv);
    std::string tokens_list;
    int n_queries, repeat;
    std::vector<std::string> extra;
    boost::program_options::options_description opts("bench_scaling");
    opts.add_options()
            ("tokens", boost::program_options::value(&tokens_list)->default_value("32768,131072,1048576"), "context lengths")
            ("queries", boost::program_options::value(&n_queries)->default_value(30), "queries per length")
            ("repeat", boost::program_options::value(&repeat)->default_value(1), "timed passes over the queries")
            ("index", boost::program_options::value(&extra), "factory strings to run instead of the default set");
    boost::program_options::variables_map vm;
    if (!kvtools::parse_options(argc, argv, opts, vm)) {
        return 0;
    }
    std::vector<idx_t> lengths = kvtools::parse_list<idx_t>(tokens_list);
    const int d = 128, k = 100;
    kvbench::check_scaling_options(lengths, n_queries, 1, k); // --queries, --tokens
    if (repeat < 1) {
        throw std::invalid_argument("--repeat " + std::to_string(repeat) + " must be >= 1");
    }
    std::printf("%-24s %9s %10s %10s %9s %9s %8s %10s\n", "index", "tokens", "us/query",
                "dense_us", "speedup", "recall", "build_s", "bytes/tok");
    for (idx_t n : lengths) {
        kvbench::ScalingHead head = kvbench::scaling_head(n, n_queries, d);
        const TraceLayer& layer = head.layer;
        const std::vector<const float*>& queries = head.queries;
        long nlist = std::max(1L, long(std::ceil(n / 1000.0)));
        std::vector<std::string> specs = {
                "Flat", "TopK(Flat)", "TopK(IVF" + std::to_string(nlist) + ",Flat)", "TopK(HNSW16)"};
        if (!extra.empty()) {
            specs = extra;
        }
        // exact reference and its timing
        std::vector<float> exact(n_queries * d);
        std::vector<std::vector<idx_t>> truth(n_queries);
        double dense_s = 0;
        for (int r = 0; r < repeat; r++) { // pass after pass over the queries
            for (int i = 0; i < n_queries; i++) {
                auto t0 = Clock::now();
                exact_attention(queries[i], layer.keys.data(), layer.values.data(), d, d, n,
                                exact.data() + i * d);
                dense_s += seconds_since(t0);
            }
        }
        for (int i = 0; i < n_queries; i++) {
            std::vector<float> s(n);
            inner_products_scaled(queries[i], layer.keys.data(), d, n, 1.0f, s.data());
            std::vector<idx_t> ids(n);
            std::iota(ids.begin(), ids.end(), 0);
            std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                              [&](idx_t a, idx_t b) { return s[a] > s[b]; });
            truth[i].assign(ids.begin(), ids.begin() + k);
            std::sort(truth[i].begin(), truth[i].end());
        }
        double dense_us = 1e6 * dense_s / (double(n_queries) * repeat);
        for (const auto& spec : specs) {
            auto index = index_factory(d, spec);
            auto tb = Clock::now();
            index->add_kv(n, layer.keys.data(), layer.values.data());
            double build_s = seconds_since(tb);
            if (spec.find("HNSW") != std::string::npos) {
                set_index_parameters(index.get(), "efSearch=128");
            }
            std::vector<float> out(d);
            double attend_s = 0, recall = 0;
            for (int r = 0; r < repeat; r++) {
                for (int i = 0; i < n_queries; i++) {
                    auto t0 = Clock::now();
                    index->attend(1, queries[i], out.data(), nullptr);
                    attend_s += seconds_since(t0);
                }
            }
            for (int i = 0; i < n_queries; i++) {
                std::vector<float> dis(k);
                std::vector<idx_t> ids(k);
                index->search(1, queries[i], k, dis.data(), ids.data());
                for (idx_t id : ids) {
                    recall += std::binary_search(truth[i].begin(), truth[i].end(), id);
                }
            }
            double us = 1e6 * attend_s / (double(n_queries) * repeat);
            std::printf("%-24s %9zd %10.1f %10.1f %9.2f %9.3f %8.2f %10.0f\n", spec.c_str(),
                        size_t(n), us, dense_us, dense_us / us, recall / (k * n_queries),
                        build_s, double(index->memory_bytes()) / n);
            std::fflush(stdout);
        }
    }
    return 0;
}

int main(int argc, char** argv) {
    return kvtools::run_tool("bench_scaling", [&] { return run_bench(argc, argv); });
}
