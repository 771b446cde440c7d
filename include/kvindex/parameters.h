#pragma once

#include <string>

#include <kvindex/KVIndex.h>

namespace kvindex {

/** Sets search-time parameters on an index and everything it wraps, like
 * faiss::ParameterSpace: "k=100,nprobe=32,efSearch=64". Names:
 *   k         top-k budget (every index type with a budget)
 *   nprobe    IVF retrievers of TopK(...)
 *   efSearch  HNSW retrievers of TopK(...)
 *   min_hits, max_sample  LSHSample
 *   budget, protect, proxy_keep, proxy_window, n_sink, seed
 *             ProxyEvict (prefill-time: set them before prefill; budget in
 *             tokens, the others in percent of the prompt)
 * A name that no index in the chain has throws naming it and the index.
 */
void set_index_parameters(KVIndex* index, const std::string& description);

/// One parameter; throws if no index in the chain has it.
void set_index_parameter(KVIndex* index, const std::string& name, double value);

} // namespace kvindex
