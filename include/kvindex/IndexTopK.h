#pragma once

#include <memory>
#include <shared_mutex>
#include <string>

#include <kvindex/KVIndex.h>
#include <kvindex/KVStorage.h>

namespace kvindex {

struct FactoryChain;

/// Search-time knobs of IndexTopK. 0 keeps the retriever's own setting.
struct SearchParametersTopK : SearchParametersKV {
    size_t nprobe = 0; ///< IVF retrievers: inverted lists visited
    int efSearch = 0;  ///< graph retrievers (HNSW, IndexRoarGraph): beam width

    std::vector<SearchKnob> set_knobs() const override;
    std::unique_ptr<SearchParametersKV> without_knob(const std::string& name) const override;
};

/** Top-k attention with a Faiss index as the retriever ("Exploiting
 * Sparsity for Long Context Inference: Million Token Contexts on Commodity
 * GPUs", arXiv 2502.06766): the k keys with the largest inner product with
 * the query (exact for Flat, approximate for IVF / HNSW / ...), then exact
 * softmax over them, with no correction for the tail.
 *
 * The retriever is built by faiss::index_factory(d, retriever_string,
 * METRIC_INNER_PRODUCT); IVF retrievers start with nprobe = min(nlist, 8)
 * as in the paper's code (Faiss's own default is 1). Retrievers that need
 * training (IVF) train on the first add, on a random sample of those keys
 * (not a prefix, which would only see the start of the document).
 * Factory string: "TopK(<faiss string>)". Knobs: k, nprobe (IVF), efSearch
 * (HNSW).
 */
struct IndexTopK : KVIndex {
    /// the largest training sample a record may hold (and so a writer may
    /// save): 2^26 keys, 32 GiB of float keys at d = 128
    static constexpr idx_t kMaxTrainPoints = idx_t(1) << 26;

    std::string retriever_string;             ///< Faiss factory string
    /// holds ntotal keys once trained, but a flat one holds none (search
    /// scans the storage, which has them as stored) and an HNSW graph over
    /// float rows none either (it scores the storage's keys: StoredKeysIP)
    std::unique_ptr<faiss::Index> retriever;
    KVStorage storage;                        ///< keys and values of all tokens
    /// cap on the training sample, <= kMaxTrainPoints; a product quantizer's
    /// is capped further, to M * 2^nbits * sample <= 2^28 distances (about
    /// 10 s per head), and a PQ whose 39 keys per centroid pass that is refused
    idx_t max_train_points = 65536;
    /// keys needed before the retriever trains (IVF: nlist; PQ: 39 per
    /// centroid, 9984 for 8 bits); until then search scans the stored keys
    /// exactly
    idx_t min_train_points = 1;
    uint64_t train_seed = 1234;               ///< seed of the training sample

    IndexTopK(int d, int d_value, const std::string& retriever_string,
              KVType kv_type = KVType::f32);
    IndexTopK();

    size_t memory_bytes() const override;

    /** A fresh, untrained retriever from retriever_string, keeping the
     * knobs (nprobe, efSearch) of the current one. Used by reset (a new
     * sequence trains on its own keys) and by io: Faiss's io drops the
     * clustering parameters index_factory sets for inner product (spherical
     * k-means), so an untrained retriever read back would train differently.
     */
    void rebuild_retriever();
    /// What rebuild_retriever puts in place, without touching this index.
    std::unique_ptr<faiss::Index> fresh_retriever() const;

    /// A flat or IVF retriever's writes roll back; an HNSW graph's do not
    /// (a node linked in cannot be taken out)
    bool writes_roll_back() const override;
    /// A flat or IVF retriever's appends can be taken back (an IVF's are
    /// the last entries of their lists); an HNSW graph's cannot
    bool can_undo_add() const override;

    /// Sets a retriever knob by name ("nprobe", "efSearch") for all later
    /// searches; throws naming the knob if this retriever does not have it.
    void set_retriever_parameter(const std::string& name, double value);

    const char* type_name() const override {
        return "IndexTopK";
    }
    std::string factory_string() const override {
        return "TopK(" + retriever_string + ")";
    }
    /// nprobe with an IVF retriever, efSearch with an HNSW one
    bool reads_search_knob(const std::string& name) const override;
    std::vector<ParameterInfo> parameter_info() const override;
    bool set_parameter(const std::string& name, double value) override;
    bool get_parameter(const std::string& name, double* value) const override;
    idx_t top_k_budget() const override {
        return k;
    }
    void write_fields(BufferWriter& w) const override;
    void read_fields(BufferReader& r, uint32_t version) override;
    void check_invariants() const override;

    /// Registry parser: "TopK(<faiss string>)".
    static std::unique_ptr<KVIndex> from_factory(FactoryChain& chain);

   protected:
    void reset_impl() override;
    void undo_add_kv_impl(idx_t n) override;
    void forget_undo_impl() noexcept override;
    /// what the last add_kv kept for undo_add_kv (keeping_undo()): the
    /// untrained retriever an append that trained replaced, or whether it
    /// added its keys to the trained one
    std::unique_ptr<faiss::Index> undo_untrained;
    bool undo_in_retriever = false;
    /// IVF lists the retriever may have: no more than the keys it trains on
    idx_t max_lists() const;

    /// search_batch; an HNSW retriever also fills hnsw_scanned (size n,
    /// when not nullptr) with the distances each query computed, every
    /// layer's.
    void search_retriever(
            idx_t n,
            const float* q,
            idx_t k,
            float* distances,
            idx_t* labels,
            const faiss::SearchParameters* params,
            size_t* hnsw_scanned) const;

    /// What the retriever read per query, in stored-key equivalents
    /// (Selection::n_scanned: float centroids and codes by their bytes),
    /// for the retrievers whose search does not count it.
    void count_scanned(
            idx_t n,
            const float* q,
            const faiss::SearchParameters* params,
            size_t* scanned) const;

    /// HNSW retrievers: a search with a per-call efSearch holds it alone
    /// (it sets the index's beam for the call), the others share it
    mutable std::shared_mutex retriever_mutex;

    const KVStorage* token_storage() const override {
        return &storage;
    }
    void add_kv_impl(idx_t n, const float* keys, const float* values) override;
    // batched: Faiss searches all the queries of a call at once
    void search_batch(
            idx_t n,
            const float* q,
            idx_t k,
            float* distances,
            idx_t* labels,
            const faiss::SearchParameters* params) const override;
    void select_batch(
            idx_t n,
            const float* q,
            Selection* sel,
            const faiss::SearchParameters* params) const override;
    void attend_batch(
            idx_t n,
            const float* q,
            float* out,
            float* lse,
            const faiss::SearchParameters* params) const override;
};

} // namespace kvindex
