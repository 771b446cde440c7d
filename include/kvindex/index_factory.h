#pragma once

#include <memory>
#include <string>

#include <kvindex/KVIndex.h>

/* Factory strings, a comma-separated chain like Faiss's:
 *
 *   chain   := [ "Sink" N "," ] [ "Window" N "," ] body
 *   body    := evict [ "," body ] | inner
 *   evict   := "ProxyEvict" P [ "_H2O" | "_TOVA" | "_StreamingLLM" | "_Random" ]
 *                                          keep P percent at prefill (IndexProxyEvict),
 *                                          attention by the body over the kept tokens
 *                                          (Flat when omitted)
 *   inner   := "Flat"                      exact attention (IndexKVFlat)
 *            | "TopK(" faiss-string ")"    top-k attention, Faiss retriever (IndexTopK)
 *            | "LSHSample" K "x" L         LSH sampling + unbiased estimator (IndexLSHSample)
 *
 * Sink / Window (either or both, any order) wrap the inner index in an
 * IndexSinkWindow. The Faiss string inside TopK(...) is any string
 * faiss::index_factory accepts with the inner-product metric: "Flat",
 * "IVF256,Flat", "HNSW32", ... Examples: "Flat", "TopK(HNSW32)",
 * "Sink4,Window64,TopK(IVF1024,Flat)", "ProxyEvict20", "ProxyEvict10_H2O",
 * "ProxyEvict20,TopK(HNSW32)".
 *
 * index_factory_string prints the canonical string of an index:
 * index_factory_string(index_factory(d, s)) == s for canonical s (Sink
 * before Window, zero counts omitted).
 */

namespace kvindex {

/** Builds an index; throws naming the part of the string it cannot parse.
 * @param d_value  value dimension, -1 for d
 */
std::unique_ptr<KVIndex> index_factory(int d, const std::string& description, int d_value = -1);

/// The factory string of an index (throws for a type without one).
std::string index_factory_string(const KVIndex* index);

} // namespace kvindex
