#pragma once

#include <memory>

#include <faiss/Index.h>

#include <kvindex/KVStorage.h>

namespace faiss {
struct IndexFlatIP;
struct IndexHNSWFlat;
}

namespace kvindex {

/** The storage of IndexTopK's HNSW retriever: no vectors of its own, the
 * keys are the owner's KVStorage (in its type), scored by inner product
 * with kvindex's kernels. Faiss's IndexHNSWFlat would keep a float copy of
 * every key beside the storage's (d * 4 bytes per token); the graph's
 * build and search only ask its storage for distances.
 *
 * add() only counts: the owner appends the keys to its storage before it
 * adds them to the graph, and the storage must not reallocate while a
 * distance computer lives (one add or search call). The record still
 * holds an IndexHNSWFlat with float rows (hnsw_with_float_rows), so files
 * are those Faiss writes. */
struct StoredKeysIP : faiss::Index {
    const KVStorage* keys; ///< the owner's storage; its rows [0, ntotal) are this index's

    explicit StoredKeysIP(const KVStorage* keys);

    /// n more of the owner's rows (already stored) become this index's
    void add(idx_t n, const float* x) override;
    void reset() override;
    /// not searched itself (the graph searches): throws
    void search(
            idx_t n,
            const float* x,
            idx_t k,
            float* distances,
            idx_t* labels,
            const faiss::SearchParameters* params = nullptr) const override;
    void reconstruct(idx_t key, float* recons) const override;
    /// <q, k_i> (inner product: IndexHNSW negates it)
    faiss::DistanceComputer* get_distance_computer() const override;
    /// the bytes a distance reads: one stored key
    size_t sa_code_size() const override;
};

/// The StoredKeysIP of an IndexHNSWFlat retriever, or nullptr.
const StoredKeysIP* stored_keys_of(const faiss::Index* retriever);

/** Gives an IndexHNSWFlat retriever over inner product the owner's keys as
 * its storage, dropping its float rows (a retriever read back holds them:
 * as many as `keys` has, which they equal; a fresh one none); others are
 * left as they are. Throws if it has more rows than `keys`. */
void use_stored_keys(faiss::Index* retriever, const KVStorage* keys);

/** The first n keys of a storage as a Faiss flat index of float rows: what
 * a record holds where the retriever shares the storage's keys (a flat
 * retriever, or an HNSW graph's storage). */
std::unique_ptr<faiss::IndexFlatIP> float_rows_of(const KVStorage& keys, faiss::Index::idx_t n);

/** What the record holds for an HNSW retriever over stored keys: an
 * IndexHNSWFlat with a copy of its graph and the keys as float rows, the
 * bytes Faiss writes for one that never shared its keys. */
std::unique_ptr<faiss::IndexHNSWFlat> hnsw_with_float_rows(const faiss::Index& retriever);

} // namespace kvindex
