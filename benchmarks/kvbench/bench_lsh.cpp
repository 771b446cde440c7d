// LSHSample grid: sampled fraction (measured and predicted by the inclusion
// formula on the same keys) and error, beside exact top-k at the same
// selected fraction, for K in 7..11 and L in 75..300.
//
//   ./build/benchmarks/bench_lsh --trace data/flat [--queries 16] [--layer 0 --kv-head 0]
//
// Keys: the prompt [0, n_ctx) of one (layer, KV head); queries: evenly spread
// evaluation positions of every query head of that KV head, attending to
// the prompt. Timings: one thread, one query per call.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include <kvindex/IndexLSHSample.h>
#include <kvindex/IndexKVFlat.h>
#include <kvindex/attention.h>
#include <kvindex/kernels.h>
#include <kvindex/trace.h>

#include "run.h"
#include "blas_kernels.h"
#include "subcommand_options.h"

using namespace kvindex;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

double rel_l2(const float* a, const float* b, int d) {
    double num = 0, den = 0;
    for (int j = 0; j < d; j++) {
        num += double(a[j] - b[j]) * (a[j] - b[j]);
        den += double(b[j]) * b[j];
    }
    return std::sqrt(num / den);
}

} // namespace

int run_bench(int argc, char** argv) {
    kvtools::use_widest_blas_kernels(argv);
    std::string trace;
    int n_q, layer_id, kv_head;
    boost::program_options::options_description opts("bench_lsh");
    opts.add_options()("trace", boost::program_options::value(&trace)->required(), "trace directory")(
            "queries", boost::program_options::value(&n_q)->default_value(16), "positions per query head")(
            "layer", boost::program_options::value(&layer_id)->default_value(0), "layer")(
            "kv-head", boost::program_options::value(&kv_head)->default_value(0), "KV head");
    boost::program_options::variables_map vm;
    if (!kvtools::parse_options(argc, argv, opts, vm)) {
        return 0;
    }

    if (n_q < 1) { // evaluation_positions reads 0 as "every position"
        throw std::invalid_argument("--queries " + std::to_string(n_q) + " must be >= 1");
    }
    TraceMeta meta = read_trace_meta(trace);
    TraceLayer layer = read_trace_layer(trace, meta, layer_id);
    int d = meta.head_dim, g = meta.n_q_heads / meta.n_kv_heads;
    idx_t n = meta.n_ctx, nt = meta.n_tokens;
    if (kv_head < 0 || kv_head >= meta.n_kv_heads) {
        throw std::invalid_argument("--kv-head " + std::to_string(kv_head) + " outside [0, " +
                                    std::to_string(meta.n_kv_heads) + ")");
    }
    const float* keys = layer.keys.data() + size_t(kv_head) * nt * d;
    const float* values = layer.values.data() + size_t(kv_head) * nt * d;
    std::vector<const float*> qs;
    for (idx_t p : kvbench::evaluation_positions(meta.n_ctx, nt, n_q)) {
        for (int j = 0; j < g; j++) {
            qs.push_back(layer.queries.data() + (size_t(kv_head * g + j) * nt + p) * d);
        }
    }
    size_t nq = qs.size();
    std::vector<float> exact(nq * d);
    double dense_s = 0;
    for (size_t i = 0; i < nq; i++) {
        auto t0 = Clock::now();
        exact_attention(qs[i], keys, values, d, d, n, exact.data() + i * d);
        dense_s += seconds_since(t0);
    }
    // how flat the head is: attention entropy / log(n), 1 = uniform
    double entropy = 0;
    std::vector<float> p(n);
    for (size_t i = 0; i < nq; i++) {
        inner_products_scaled(qs[i], keys, d, n, 1.0f / std::sqrt(float(d)), p.data());
        softmax_inplace(p.data(), nullptr, n);
        for (idx_t j = 0; j < n; j++) {
            entropy -= p[j] > 0 ? double(p[j]) * std::log(double(p[j])) : 0.0;
        }
    }
    entropy /= double(nq) * std::log(double(n));
    std::printf("trace %s (%s), layer %d KV head %d: %zd keys, %zu queries, entropy H/log(n) %.3f, "
                "dense %.1f us/query\n", trace.c_str(), meta.source.c_str(), layer_id, kv_head,
                size_t(n), nq, entropy, 1e6 * dense_s / nq);
    std::printf("%-18s %9s %9s %10s %10s %9s %10s %12s %10s\n", "index", "sel_frac", "predicted",
                "rel_err", "topk_err", "us/query", "speedup", "hash_keys/s", "table_B/tok");
    for (int K : {7, 8, 9, 10, 11}) {
        for (int L : {75, 150, 300}) {
            IndexLSHSample h(d, d, K, L);
            auto tb = Clock::now();
            h.add_kv(n, keys, values);
            double build = seconds_since(tb);
            double sel = 0, pred = 0, err = 0, topk_err = 0, attend_s = 0;
            std::vector<float> out(d), tk(d);
            for (size_t i = 0; i < nq; i++) {
                h.attend(1, qs[i], out.data(), nullptr); // warm
                auto t0 = Clock::now();
                h.attend(1, qs[i], out.data(), nullptr);
                attend_s += seconds_since(t0);
                err += rel_l2(out.data(), exact.data() + i * d, d);
                Selection s;
                h.select(1, qs[i], &s);
                sel += double(s.size()) / n;
                // predicted sample size: the sum of u_i over every key
                double qq = 0, qm = 0;
                for (int j = 0; j < d; j++) {
                    qq += double(qs[i][j]) * qs[i][j];
                    qm += double(qs[i][j]) * h.mean[j];
                }
                std::vector<float> dots(n);
                inner_products_scaled(qs[i], keys, d, n, 1.0f, dots.data());
                double su = 0;
                for (idx_t t = 0; t < n; t++) {
                    double c = (dots[t] - qm) / (std::sqrt(qq) * h.norms[t]);
                    su += lsh_inclusion_probability(std::acos(std::max(-1.0, std::min(1.0, c))), K, L, 2);
                }
                pred += su / n;
                // exact top-k attention at the same number of keys
                idx_t k = std::max<idx_t>(1, idx_t(s.size()));
                std::vector<float> dd(k);
                std::vector<idx_t> ids(k);
                exact_topk_inner_product(qs[i], keys, d, n, k, dd.data(), ids.data());
                Selection top;
                for (idx_t id : ids) {
                    top.push_back(id);
                }
                estimate_attention(Estimator::topk, qs[i], keys, values, d, d, top, tk.data());
                topk_err += rel_l2(tk.data(), exact.data() + i * d, d);
            }
            char name[32];
            std::snprintf(name, sizeof(name), "LSHSample%dx%d", K, L);
            std::printf("%-18s %8.2f%% %8.2f%% %10.3f %10.3f %9.1f %10.2f %12.0f %10.0f\n", name,
                        100 * sel / nq, 100 * pred / nq, err / nq, topk_err / nq,
                        1e6 * attend_s / nq, dense_s / attend_s, n / build,
                        double(h.table_bytes()) / n);
            std::fflush(stdout);
        }
    }
    return 0;
}

int main(int argc, char** argv) {
    return kvtools::run_tool("bench_lsh", [&] { return run_bench(argc, argv); });
}
