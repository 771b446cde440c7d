#pragma once

#include <cstddef>

#include <faiss/Index.h>

namespace kvindex {

/** The retrievers whose search kvindex runs with its own kernels instead of
 * Faiss's (Debian's Faiss 1.7.3 is a generic-SIMD build): a flat
 * inner-product index, and an IVF with flat lists over a flat quantizer.
 * Faiss still builds, trains, adds to and stores them; only the scan is
 * ours, so results equal Faiss's up to the order of ties.
 */
bool has_own_scan(const faiss::Index* retriever);

/** Top-k by inner product of one query over a retriever has_own_scan
 * accepts: the k best (score, id) in decreasing order, ties to the smaller
 * id, padded with (lowest float, -1) as Faiss pads. IVF: the nprobe lists
 * whose centroids score highest, each read once by the fused top-k kernel.
 */
void own_scan_search(
        const faiss::Index* retriever,
        const float* q,
        faiss::Index::idx_t k,
        size_t nprobe,
        float* distances,
        faiss::Index::idx_t* labels);

} // namespace kvindex
