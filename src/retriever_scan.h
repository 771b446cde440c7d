#pragma once

#include <cstddef>

#include <faiss/Index.h>

namespace faiss {
struct IndexIVFFlat;
}

namespace kvindex {

/** The retrievers whose search kvindex runs with its own kernels instead of
 * Faiss's (Debian's Faiss 1.7.3 is a generic-SIMD build). Faiss still
 * builds, trains, adds to and stores them; only the scan is ours, so
 * results equal Faiss's up to the order of ties.
 */

/// A flat inner-product index: it holds the stored keys (widened to float),
/// so its owner scans its own storage instead (exact_topk_inner_product).
bool is_flat_inner_product(const faiss::Index* retriever);

/// The retriever as an IVF with float lists over a flat quantizer, all
/// inner product, which ivf_flat_search scans; nullptr for any other.
const faiss::IndexIVFFlat* as_ivf_flat_inner_product(const faiss::Index* retriever);

/** Top-k by inner product of one query over a trained IVF-Flat: the nprobe
 * lists whose centroids score highest, each read once by the fused top-k
 * kernel; the k best (score, id) in decreasing order, ties to the smaller
 * id, padded with (lowest float, -1) as Faiss pads.
 */
void ivf_flat_search(
        const faiss::IndexIVFFlat& ivf,
        const float* q,
        faiss::Index::idx_t k,
        size_t nprobe,
        float* distances,
        faiss::Index::idx_t* labels);

} // namespace kvindex
