#pragma once

#include <string>

#include <faiss/Index.h>

namespace kvindex {

/** Checks a Faiss retriever read from a file against what its owner expects:
 * the type its factory string builds, dimension d, inner product, ntotal
 * vectors, and the internal structure of the types kvindex uses (Flat, IVF
 * with array lists, HNSW): every stored id and neighbour in range, sizes
 * consistent. A forged file that passes the checksum is thus refused before a
 * search could read out of bounds. Throws naming the first problem.
 */
void check_faiss_retriever(
        const faiss::Index* retriever,
        const std::string& factory_string,
        int d,
        faiss::Index::idx_t ntotal);

} // namespace kvindex
