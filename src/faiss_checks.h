#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <faiss/Index.h>

namespace kvindex {

/** Checks a Faiss retriever read from a file against what its owner expects
 * (factory_string has passed check_retriever_string): the type its factory
 * string builds, dimension d, inner product, ntotal
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

/// Lists an IVF retriever may have at most, whatever its training sample.
constexpr int64_t kMaxRetrieverLists = int64_t(1) << 20;

/// The widest HNSW search beam a retriever may be set to or read with.
constexpr int kMaxEfSearch = 1 << 20;

/** Checks the sizes a Faiss factory string asks for before Faiss allocates
 * them: IVF lists in [1, max_lists] (an IVF cannot train more lists than the
 * keys it trains on; Faiss segfaults at 0 and allocates the lists of
 * IVF999999999 up front), IMI likewise, HNSW M in [2, 256], PQ sub-quantizers
 * dividing d with at most 16 bits. Throws naming the component. */
void check_retriever_string(const std::string& factory_string, int d, int64_t max_lists);

/// The most centroids a product quantizer of the retriever string trains
/// ("PQ<M>[x<nbits>]": 2^nbits, 256 by default), 0 without one: the keys
/// it needs before it can train.
int64_t product_quantizer_centroids(const std::string& factory_string);

/// The most centroids in all of a product quantizer of the retriever
/// string, M * 2^nbits over its M sub-quantizers, 0 without one: its
/// k-means costs that many distances per training key (at any d, the
/// sub-quantizers' own costs dominate: PQ128 trains 2x slower than PQ64).
int64_t product_quantizer_work(const std::string& factory_string);

/** Walks a serialized Faiss retriever the way faiss::read_index (v1.7.3)
 * will, before it does: Faiss's reader leaks the index it is filling when it
 * throws, so a blob must be known good before it gets there. Accepts the
 * families kvindex reads back (Flat, SQ, PQ; IVF with Flat, SQ or PQ lists
 * over a Flat or HNSW quantizer; HNSW over Flat or SQ: the inner-product
 * families of Faiss 1.7.3's factory), all of
 * dimension d, with every size consistent with the bytes present; throws
 * naming the first problem otherwise. */
void check_faiss_blob(const uint8_t* data, size_t size, int d);

/** The same walk, listing the byte ranges [begin, end) of the blob's arrays
 * of 64 bytes or more (codes, inverted lists, graph links), which Faiss
 * reads whole (IndexFileLayout, for tests that corrupt files). */
void check_faiss_blob(
        const uint8_t* data,
        size_t size,
        int d,
        std::vector<std::pair<size_t, size_t>>* arrays);

} // namespace kvindex
