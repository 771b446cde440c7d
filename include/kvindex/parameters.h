#pragma once

#include <string>
#include <utility>
#include <vector>

#include <kvindex/KVIndex.h>

namespace kvindex {

/** Sets parameters on an index and everything it wraps, like
 * faiss::ParameterSpace: "k=100,nprobe=32,efSearch=64". Each name goes to
 * every index of the chain that has it (KVIndex::set_parameter); the names
 * of the built-in types:
 *   k         top-k budget: TopK, RoarGraph, Uniform, Weighted and the
 *             chains holding one (KVIndex::reads_search_knob); a chain
 *             that reads no k refuses it ("LSHSample8x75|k=5")
 *   nprobe    IVF retrievers of TopK(...)
 *   efSearch  HNSW retrievers of TopK(...), and RoarGraph's beam
 *   min_hits, max_sample  LSHSample
 *   budget, protect, proxy_keep, proxy_window, proxy_tokens, pool, n_sink,
 *             seed  ProxyEvict (prefill-time: set them before prefill;
 *             budget and proxy_tokens in tokens, the others in percent of
 *             the prompt; each policy has only the knobs it reads: protect,
 *             proxy_keep, proxy_window NaCl; n_sink NaCl, StreamingLLM;
 *             seed NaCl, Random)
 *   M, Nq, build_L, max_train_queries, n_hubs, n_anchors, recent_queries,
 *             seed (prefill-time); seed_anchors, walk_bits, learn_efSearch,
 *             learn_scan_keys, decode_anchors   RoarGraph
 *   nprobe, group_probe, var_weight (_Moment), hidden, train_iterations,
 *             min_distance (the Q-model probe), seed   IVFAsym
 *   sample    Hybrid's tail budget; budget, epsilon, delta, n_calibration
 *             its prefill-time calibration
 *   n_holdout, recent_holdout, budget  Choose (prefill-time; budget in tokens, also
 *             its ProxyEvict and Hybrid candidates'); chosen (read-only)
 * index_parameter_info lists them for any index. "" sets nothing. A name
 * that no index in the chain has throws naming it and the index. When an item throws, no
 * index of the chain is left changed: the items set before it and the
 * indexes of the chain that took it are set back to their earlier values.
 */
void set_index_parameters(KVIndex* index, const std::string& description);

/** The items of a parameter string as written ("k=5%" stays), split at
 * the commas; empty items are kept, for the parser to name them ("k=5,"
 * has two); "" has none. For tools that route or rewrite items before
 * set_index_parameters parses them. */
std::vector<std::string> parameter_items(const std::string& description);

/** The (name, value) items of a parameter string, as set_index_parameters
 * reads it: decimal values only (no hex, spaces, inf, nan or junk), each
 * name at most once (a repeated one would silently win), no value in
 * percent (resolve_percentages first). Throws naming the item. */
std::vector<std::pair<std::string, double>> parse_parameters(const std::string& description);

/// One parameter; throws if no index in the chain has it.
void set_index_parameter(KVIndex* index, const std::string& name, double value);

/// The value of a parameter: from the outermost index of the chain that
/// has it; throws if none has it.
double get_index_parameter(const KVIndex* index, const std::string& name);

/// Every parameter of the chain (each name once, outermost first).
std::vector<ParameterInfo> index_parameter_info(const KVIndex* index);

/** An index with parameters, as every tool and binding writes it:
 * "STRING" or "STRING|name=value,...", STRING a factory string
 * (index_factory.h). Values may be given in percent ("k=5%"): they are then
 * a share of the context length, resolved by resolve_percentages. */
struct IndexSpec {
    std::string factory; ///< the factory string
    std::string params;  ///< set_index_parameters string, possibly empty

    /// Back to "STRING" or "STRING|params".
    std::string str() const {
        return params.empty() ? factory : factory + "|" + params;
    }
};

/// Splits at the first '|'; throws for an empty factory string or an
/// empty parameter list after a '|'.
IndexSpec parse_index_spec(const std::string& s);

/** params with every "name=<x>%" replaced by max(1, ceil(x / 100 *
 * n_context)), x in (0, 100]: budgets given as a share of the prompt.
 * With the index the params are for, a percentage is refused on a knob
 * of its chain that is not a count of tokens (ParameterInfo::in_tokens):
 * ProxyEvict's protect is a percent already, IVF's nprobe a list count,
 * and "protect=1%" would otherwise become 1% of the context as a percent.
 * Without it (nullptr) every '%' is read as tokens: the caller vouches. */
std::string resolve_percentages(
        const std::string& params,
        idx_t n_context,
        const KVIndex* index = nullptr);

} // namespace kvindex
