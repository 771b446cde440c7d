// kvbench: how far each sparse-attention index is from exact attention, and
// how much less it reads, on any trace (format: include/kvindex/trace.h).
//
//   kvbench gen --out DIR --preset mixed --seed 1 [--tokens N --head-dim D
//               --kv-heads H --group G --layers L --eval Q --dtype float16]
//               (--preset ood: [--needles 4 --question 64 --topic-tokens 2048])
//   kvbench run --trace DIR --index S [--index S ...] [--params "k=100,..."]
//               [--layers 0,2] [--max-queries N] [--json FILE] [--dump DIR]
//               [--timed-calls 3]   (timings per query; the median counts)
//               [--trained FILE]   (models of `kvllm train` adopted by every index)
//               [--report chosen,calibrated_sample]   (knobs read per head after prefill)

#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include "subcommand_options.h"

#include "run.h"
#include "synthetic.h"
#include "blas_kernels.h"

namespace po = boost::program_options;

namespace {

using kvtools::parse_list;

using kvtools::parse_subcommand;

int cmd_gen(int argc, char** argv) {
    kvbench::SyntheticConfig cfg;
    std::string out;
    po::options_description opts("kvbench gen: write a synthetic trace");
    opts.add_options()
            ("out", po::value(&out)->required(), "trace directory")
            ("preset", po::value(&cfg.preset)->default_value(cfg.preset), "needle | local | flat | aggregate | mixed | ood")
            ("seed", po::value(&cfg.seed)->default_value(cfg.seed), "generator seed")
            ("tokens", po::value(&cfg.n_tokens)->default_value(cfg.n_tokens), "tokens per head")
            ("head-dim", po::value(&cfg.head_dim)->default_value(cfg.head_dim), "head dimension")
            ("kv-heads", po::value(&cfg.n_kv_heads)->default_value(cfg.n_kv_heads), "KV heads")
            ("group", po::value(&cfg.group)->default_value(cfg.group), "query heads per KV head")
            ("layers", po::value(&cfg.n_layers)->default_value(cfg.n_layers), "layers")
            ("eval", po::value(&cfg.n_eval)->default_value(cfg.n_eval), "evaluation tokens at the end")
            ("dtype", po::value(&cfg.dtype)->default_value(cfg.dtype), "float32 | float16")
            ("needles", po::value(&cfg.ood_needles), "ood: needles each question query points at (default 4)")
            ("question", po::value(&cfg.ood_question), "ood: question tokens ending the prompt (default 64)")
            ("topic-tokens", po::value(&cfg.ood_topic_tokens), "ood: tokens per drifting topic (default 2048)");
    po::variables_map vm;
    if (!parse_subcommand(argc, argv, opts, vm)) {
        return 0;
    }
    kvindex::TraceMeta meta = kvbench::write_synthetic_trace(out, cfg);
    std::printf("wrote %s: %d layers, %d q heads / %d kv heads, d=%d, %zd tokens, n_ctx=%zd\n",
                out.c_str(), meta.n_layers, meta.n_q_heads, meta.n_kv_heads, meta.head_dim,
                size_t(meta.n_tokens), size_t(meta.n_ctx));
    std::vector<double> h = kvbench::attention_entropy_profile(out, meta, 8);
    std::printf("attention entropy H/log(p+1) per (layer, q head), mean of 8 evaluation positions:\n");
    for (int l = 0; l < meta.n_layers; l++) {
        std::printf("  layer %d:", l);
        for (int q = 0; q < meta.n_q_heads; q++) {
            std::printf(" %s=%.3f", kvbench::head_kind_name(kvbench::head_kind(cfg, l, q)),
                        h[size_t(l) * meta.n_q_heads + q]);
        }
        std::printf("\n");
    }
    return 0;
}

int cmd_run(int argc, char** argv) {
    kvbench::RunOptions opt;
    std::string layers, json, dump, report;
    po::options_description opts("kvbench run: compare indexes with exact attention on a trace");
    opts.add_options()
            ("trace", po::value(&opt.trace_dir)->required(), "trace directory")
            ("index", po::value(&opt.indexes)->required(), "index: STRING or STRING|params, k=5% = 5% of the prompt (repeatable)")
            ("params", po::value(&opt.params), "parameters for every index that has them, before its own, e.g. k=100,nprobe=8 (each must be a parameter of some index)")
            ("layers", po::value(&layers), "comma-separated layers (default: every layer the trace holds, layer_<l> directories)")
            ("trained", po::value(&opt.trained), "cache file of `kvllm train`: every index adopts its models")
            ("max-queries", po::value(&opt.max_queries)->default_value(0),
             "evaluation positions per (layer, q head), spread evenly; 0 = all")
            ("timed-calls", po::value(&opt.timed_calls)->default_value(opt.timed_calls),
             "timed calls per query of each attend and of dense attention (after a warm-up); "
             "the median counts")
            ("report", po::value(&report),
             "comma-separated knobs read per (layer, KV head) after prefill, e.g. chosen,calibrated_sample")
            ("json", po::value(&json), "write the results as JSON")
            ("dump", po::value(&dump), "write rows.npy and <i>.npy outputs here")
            ("quiet", "no progress on stderr");
    po::variables_map vm;
    if (!parse_subcommand(argc, argv, opts, vm)) {
        return 0;
    }
    if (!layers.empty()) {
        opt.layers = parse_list<int>(layers);
    }
    if (!report.empty()) {
        opt.report = parse_list<std::string>(report);
    }
    opt.progress = !vm.count("quiet");
    kvbench::RunResult res = kvbench::run_kvbench(opt);
    kvbench::print_table(res);
    if (!json.empty()) {
        kvbench::write_json(res, json);
    }
    if (!dump.empty()) {
        kvbench::write_dump(res, dump);
    }
    return 0;
}

} // namespace

int main(int argc, char** argv) {
    kvtools::use_widest_blas_kernels(argv);
    std::string usage = "usage: kvbench gen|run [options]  (kvbench gen --help, kvbench run --help)\n";
    if (argc < 2) {
        std::fprintf(stderr, "%s", usage.c_str());
        return 2;
    }
    std::string cmd = argv[1];
    if (cmd == "--help" || cmd == "-h") {
        std::printf("%s", usage.c_str());
        return 0;
    }
    try {
        if (cmd == "gen") {
            return cmd_gen(argc, argv);
        }
        if (cmd == "run") {
            return cmd_run(argc, argv);
        }
        std::fprintf(stderr, "kvbench: unknown command '%s'\n%s", cmd.c_str(), usage.c_str());
        return 2;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "kvbench %s: %s\n", cmd.c_str(), kvindex::error_message(e).c_str());
        return 1;
    }
}
