// kvindex's side of the peer comparison (benchmarks/scripts/peers.py runs
// it, then times faiss-cpu and hnswlib on the files it writes).
//
//   ./build/benchmarks/bench_peers --out DIR [--tokens 32768,131072]
//       [--queries 30] [--repeats 3] [--ef 128] [--hnsw-max-tokens 131072]
//
// Same data as bench_scaling: one synthetic KV head (mixed preset, d = 128;
// a needle, a local and a flat query head, queries taken in turn). For each
// length N it writes DIR/N/keys.npy [N, d] f4, queries.npy [Q, d] f4 and
// truth.npy [Q, 100] i8 (the exact top-100 by inner product, sorted ids),
// then, one thread, builds each index once and times one query per call:
// attend (retrieve + attention, µs) and search (top-100 only, µs): each
// query's median over --repeats passes, averaged over the queries; the dense
// kernel (exact_attention) is timed the same way in the same run. Rows go
// to DIR/N/ours.tsv and to stdout.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <omp.h>

#include <boost/program_options.hpp>

#include <kvindex/attention.h>
#include <kvindex/index_factory.h>
#include <kvindex/kernels.h>
#include <kvindex/parameters.h>
#include <kvindex/trace.h>

#include "synthetic.h"
#include "blas_kernels.h"
#include "subcommand_options.h"

using namespace kvindex;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> x) {
    std::sort(x.begin(), x.end());
    size_t m = x.size() / 2;
    return x.size() % 2 ? x[m] : 0.5 * (x[m - 1] + x[m]);
}

/// µs of f(i) per query i: each query timed in `repeats` passes over all
/// queries, its median taken (robust to a busy machine), then the mean.
template <class F>
double time_queries(int repeats, int n_queries, F&& f) {
    std::vector<std::vector<double>> t(n_queries);
    for (int r = 0; r < repeats; r++) {
        for (int i = 0; i < n_queries; i++) {
            auto t0 = Clock::now();
            f(i);
            t[i].push_back(seconds_since(t0));
        }
    }
    double s = 0;
    for (auto& x : t) {
        s += median(x);
    }
    return 1e6 * s / n_queries;
}

} // namespace

int run_bench(int argc, char** argv) {
    kvtools::use_widest_blas_kernels(argv);
    std::string tokens_list, out_dir;
    int n_queries, repeats, ef;
    long hnsw_max;
    std::vector<std::string> extra;
    namespace po = boost::program_options;
    po::options_description opts("bench_peers");
    opts.add_options()
            ("out", po::value(&out_dir)->required(), "directory for keys/queries/truth .npy and ours.tsv")
            ("tokens", po::value(&tokens_list)->default_value("32768,131072"), "context lengths")
            ("queries", po::value(&n_queries)->default_value(30), "queries per length")
            ("repeats", po::value(&repeats)->default_value(3), "timed passes over the queries (median per query)")
            ("ef", po::value(&ef)->default_value(128), "HNSW efSearch")
            ("hnsw-max-tokens", po::value(&hnsw_max)->default_value(131072), "skip HNSW above this length (build time)")
            ("index", po::value(&extra), "factory strings to run instead of the default set");
    po::variables_map vm;
    if (!kvtools::parse_options(argc, argv, opts, vm)) {
        return 0;
    }
    std::vector<idx_t> lengths = kvtools::parse_list<idx_t>(tokens_list);
    const int d = 128, k = 100;
    kvbench::check_scaling_options(lengths, n_queries, 1, k);
    if (repeats < 1) { // the median of no pass
        throw std::invalid_argument("--repeats " + std::to_string(repeats) + " must be >= 1");
    }
    // builds may use every core; every timed call runs on one thread
    const int build_threads = omp_get_max_threads();
    std::printf("%-34s %9s %10s %10s %10s %9s %9s %8s %10s\n", "index", "tokens", "us/query",
                "search_us", "dense_us", "speedup", "recall", "build_s", "bytes/tok");
    for (idx_t n : lengths) {
        kvbench::ScalingHead head = kvbench::scaling_head(n, n_queries, d);
        const TraceLayer& layer = head.layer;
        std::vector<float> queries(size_t(n_queries) * d); // contiguous, for queries.npy
        for (int i = 0; i < n_queries; i++) {
            std::copy_n(head.queries[i], d, queries.data() + size_t(i) * d);
        }
        auto query = [&](int i) { return queries.data() + size_t(i) * d; };
        // exact top-100 (sorted ids) for recall
        std::vector<int64_t> truth(size_t(n_queries) * k);
        {
            std::vector<float> s(n);
            std::vector<idx_t> ids(n);
            for (int i = 0; i < n_queries; i++) {
                inner_products_scaled(query(i), layer.keys.data(), d, n, 1.0f, s.data());
                std::iota(ids.begin(), ids.end(), 0);
                std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                                  [&](idx_t a, idx_t b) { return s[a] > s[b]; });
                std::sort(ids.begin(), ids.begin() + k);
                std::copy_n(ids.begin(), k, truth.begin() + size_t(i) * k);
            }
        }
        std::string dir = out_dir + "/" + std::to_string(n);
        std::filesystem::create_directories(dir);
        write_npy(dir + "/keys.npy", "<f4", {size_t(n), size_t(d)}, layer.keys.data());
        write_npy(dir + "/queries.npy", "<f4", {size_t(n_queries), size_t(d)}, queries.data());
        write_npy(dir + "/truth.npy", "<i8", {size_t(n_queries), size_t(k)}, truth.data());
        FILE* tsv = std::fopen((dir + "/ours.tsv").c_str(), "w");
        if (!tsv) {
            std::perror(dir.c_str());
            return 1;
        }
        std::fprintf(tsv, "index\ttokens\tus\tsearch_us\tdense_us\trecall\tbuild_s\tbytes_per_tok\n");

        omp_set_num_threads(1);
        std::vector<float> out(d);
        double dense_us = time_queries(repeats, n_queries, [&](int i) {
            exact_attention(query(i), layer.keys.data(), layer.values.data(), d, d, n,
                            out.data());
        });

        long nlist = std::max(1L, long(std::ceil(n / 1000.0)));
        std::vector<std::string> specs = {"Flat", "TopK(Flat)",
                                          "TopK(IVF" + std::to_string(nlist) + ",Flat)",
                                          "Sink4,Window64,LSHSample10x150",
                                          // the same paths over bf16 storage (half the bytes)
                                          "BF16,Flat", "BF16,TopK(Flat)",
                                          "BF16,Sink4,Window64,LSHSample10x150"};
        if (n <= hnsw_max) {
            specs.push_back("TopK(HNSW32)");
        }
        if (!extra.empty()) {
            specs = extra;
        }
        for (const auto& spec : specs) {
            auto index = index_factory(d, spec);
            omp_set_num_threads(build_threads);
            auto tb = Clock::now();
            index->add_kv(n, layer.keys.data(), layer.values.data());
            double build_s = seconds_since(tb);
            omp_set_num_threads(1);
            bool hnsw = spec.find("HNSW") != std::string::npos;
            if (hnsw) {
                set_index_parameters(index.get(), "efSearch=" + std::to_string(ef));
            }
            std::vector<float> dis(k);
            std::vector<idx_t> ids(k);
            double recall = 0;
            for (int i = 0; i < n_queries; i++) {
                index->search(1, query(i), k, dis.data(), ids.data());
                const int64_t* t = truth.data() + size_t(i) * k;
                for (idx_t id : ids) {
                    recall += std::binary_search(t, t + k, int64_t(id));
                }
            }
            recall /= double(k) * n_queries;
            double us = time_queries(repeats, n_queries, [&](int i) {
                index->attend(1, query(i), out.data(), nullptr);
            });
            double search_us = time_queries(repeats, n_queries, [&](int i) {
                index->search(1, query(i), k, dis.data(), ids.data());
            });
            std::string name = hnsw ? spec + " efSearch=" + std::to_string(ef) : spec;
            double bpt = double(index->memory_bytes()) / n;
            std::printf("%-34s %9zd %10.1f %10.1f %10.1f %9.2f %9.3f %8.2f %10.0f\n",
                        name.c_str(), size_t(n), us, search_us, dense_us, dense_us / us, recall,
                        build_s, bpt);
            std::fprintf(tsv, "%s\t%zd\t%.2f\t%.2f\t%.2f\t%.4f\t%.3f\t%.0f\n", name.c_str(),
                         size_t(n), us, search_us, dense_us, recall, build_s, bpt);
            std::fflush(stdout);
            std::fflush(tsv);
        }
        std::fclose(tsv);
    }
    return 0;
}

int main(int argc, char** argv) {
    return kvtools::run_tool("bench_peers", [&] { return run_bench(argc, argv); });
}
