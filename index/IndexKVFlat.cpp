#include <kvindex/IndexKVFlat.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/attention.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>
#include <kvindex/kernels.h>

#include "parallel.h"

namespace kvindex {

void exact_topk_inner_product(
        const float* q,
        const float* x,
        size_t d,
        idx_t n,
        idx_t k,
        float* distances,
        idx_t* labels) {
    exact_topk_inner_product(q, KVRows(x, d), n, k, distances, labels);
}

void exact_topk_inner_product(
        const float* q, KVRows x, idx_t n, idx_t k, float* distances, idx_t* labels) {
    // one fused pass (kernels.h); ties go to the smaller id, so results
    // are deterministic
    idx_t kk = std::min(k, n);
    size_t filled = 0;
    static_assert(sizeof(idx_t) == sizeof(int64_t), "labels are the heap's ids");
    topk_inner_products(
            q, x, size_t(n), nullptr, 0, size_t(kk), distances,
            reinterpret_cast<int64_t*>(labels), &filled);
    topk_heap_sort(distances, reinterpret_cast<int64_t*>(labels), filled);
    // padding as Faiss does for inner product: lowest float, label -1
    for (idx_t j = kk; j < k; j++) {
        distances[j] = std::numeric_limits<float>::lowest();
        labels[j] = -1;
    }
}

IndexKVFlat::IndexKVFlat(int d, int d_value, KVType kv_type)
        : KVIndex(d, d_value, kv_type), storage(d, this->d_value, kv_type) {}

std::unique_ptr<KVIndex> IndexKVFlat::from_factory(FactoryChain& chain) {
    if (chain.peek() != "Flat") {
        return nullptr;
    }
    chain.take();
    return std::make_unique<IndexKVFlat>(chain.d, chain.d_value, chain.kv_type);
}

void IndexKVFlat::add_kv_impl(idx_t n, const float* keys, const float* values) {
    storage.append(n, keys, values);
}

void IndexKVFlat::undo_add_kv_impl(idx_t n) {
    storage.truncate(ntotal - n);
}

void IndexKVFlat::search_one(
        const float* q,
        idx_t k,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters*) const {
    exact_topk_inner_product(q, storage.key_rows(), ntotal, k, distances, labels);
}

void IndexKVFlat::select_one(const float*, Selection& sel, const faiss::SearchParameters*) const {
    sel.set_all(ntotal);
}

float IndexKVFlat::attend_one(const float* q, float* out, const faiss::SearchParameters*) const {
    // the group kernel for one query, so that every path of attend rounds
    // alike (a query's result does not depend on its chunk)
    float lse;
    dense_attention_group(
            q, 1, storage.key_rows(), storage.value_rows(), size_t(ntotal), score_scale(),
            out, &lse);
    return lse;
}

void IndexKVFlat::attend_batch(
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters*) const {
    // one pass over keys and values per chunk of queries; chunks in parallel
    idx_t n_chunks = (n + kAttendChunk - 1) / kAttendChunk;
    parallel_for(n_chunks, [&](idx_t c) {
        idx_t i0 = c * kAttendChunk;
        idx_t nc = std::min(kAttendChunk, n - i0);
        dense_attention_group(
                q + i0 * d, size_t(nc), storage.key_rows(), storage.value_rows(),
                size_t(ntotal), score_scale(), out + i0 * d_value, lse + i0);
    });
}

void IndexKVFlat::reset_impl() {
    storage.clear();
    ntotal = 0;
}

size_t IndexKVFlat::memory_bytes() const {
    return storage.memory_bytes();
}

void IndexKVFlat::write_fields(BufferWriter& w) const {
    storage.write(w);
}

void IndexKVFlat::read_fields(BufferReader& r, uint32_t) {
    storage = KVStorage(d, d_value, kv_type);
    storage.read(r, "Flat storage");
}

void IndexKVFlat::check_invariants() const {
    KVIndex::check_invariants();
    FAISS_THROW_IF_NOT_FMT(
            storage.d == size_t(d) && storage.d_value == size_t(d_value) &&
                    storage.type == kv_type && storage.size() == ntotal,
            "IndexKVFlat: storage holds %zd tokens, ntotal is %zd",
            size_t(storage.size()),
            size_t(ntotal));
}

} // namespace kvindex
