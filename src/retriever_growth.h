#pragma once

#include <cstddef>

#include <faiss/Index.h>

namespace kvindex {

/** Memory of a Faiss retriever held by IndexTopK, as it grows with the
 * cache. Faiss's arrays are std::vectors grown one entry at a time: the
 * first decoded token doubles the capacity of every array the prompt
 * filled (HNSW's rows and level-0 lists), and an IVF list added to vector
 * by vector sits at ~1.5x its size on average. Faiss has no virtual that
 * reports memory, so the layouts used as retrievers are read here; a
 * layout not known here is measured by its serialized size.
 */

/** retriever.add(n, x), with the arrays it fills grown by 1/4 of their
 * capacity (reserve_for_growth) rather than doubled: the float or code
 * rows of a flat index, HNSW's rows, levels and neighbour lists, each
 * probed IVF list (array inverted lists: the vectors are assigned first,
 * then every list reserved for what it receives). Results equal
 * retriever.add's. */
void add_growing_by_quarter(faiss::Index& retriever, faiss::Index::idx_t n, const float* x);

/// Bytes the retriever holds, by capacity for the layouts above (plus the
/// quantizers and codebooks they own), else its serialized size.
size_t retriever_memory_bytes(const faiss::Index& retriever);

} // namespace kvindex
