#include "stored_keys_ip.h"

#include <memory>
#include <vector>

#include <faiss/IndexFlat.h>
#include <faiss/IndexHNSW.h>
#include <faiss/impl/DistanceComputer.h>
#include <faiss/impl/FaissAssert.h>

#include <kvindex/kernels.h>

namespace kvindex {

namespace {

/// <q, k_i> over the owner's rows, in their type
struct StoredKeyInnerProducts : faiss::DistanceComputer {
    KVRows rows;
    const KVStorage& keys;
    const float* q = nullptr;
    std::vector<float> row_i; ///< symmetric_dis: key i as floats

    explicit StoredKeyInnerProducts(const KVStorage& keys)
            : rows(keys.key_rows()), keys(keys), row_i(keys.d) {}
    void set_query(const float* x) override {
        q = x;
    }
    float operator()(idx_t i) override {
        float s;
        int64_t id = i;
        inner_products_by_ids(q, rows, &id, 1, 1.0f, &s);
        return s;
    }
    float symmetric_dis(idx_t i, idx_t j) override {
        const float* x = row_i.data();
        if (rows.type == KVType::f32) {
            x = static_cast<const float*>(rows.data) + size_t(i) * rows.dim;
        } else {
            keys.key(i, row_i.data()); // widened once, then scored in j's type
        }
        float s;
        int64_t id = j;
        inner_products_by_ids(x, rows, &id, 1, 1.0f, &s);
        return s;
    }
};

} // namespace

StoredKeysIP::StoredKeysIP(const KVStorage* keys)
        : faiss::Index(int(keys->d), faiss::METRIC_INNER_PRODUCT), keys(keys) {}

void StoredKeysIP::add(idx_t n, const float*) {
    FAISS_THROW_IF_NOT_FMT(
            n >= 0 && ntotal + n <= keys->size(),
            "StoredKeysIP: %zd keys added, the storage holds %zd (store them first)",
            size_t(ntotal + n),
            size_t(keys->size()));
    ntotal += n;
}

void StoredKeysIP::reset() {
    ntotal = 0;
}

void StoredKeysIP::search(
        idx_t,
        const float*,
        idx_t,
        float*,
        idx_t*,
        const faiss::SearchParameters*) const {
    FAISS_THROW_MSG("StoredKeysIP is an HNSW graph's storage: search the graph");
}

void StoredKeysIP::reconstruct(idx_t key, float* recons) const {
    FAISS_THROW_IF_NOT_FMT(key >= 0 && key < ntotal, "StoredKeysIP: key %zd out of range", size_t(key));
    keys->key(key, recons);
}

faiss::DistanceComputer* StoredKeysIP::get_distance_computer() const {
    return new StoredKeyInnerProducts(*keys);
}

size_t StoredKeysIP::sa_code_size() const {
    return keys->key_rows().row_bytes();
}

const StoredKeysIP* stored_keys_of(const faiss::Index* retriever) {
    auto hnsw = dynamic_cast<const faiss::IndexHNSWFlat*>(retriever);
    return hnsw ? dynamic_cast<const StoredKeysIP*>(hnsw->storage) : nullptr;
}

void use_stored_keys(faiss::Index* retriever, const KVStorage* keys) {
    auto hnsw = dynamic_cast<faiss::IndexHNSWFlat*>(retriever);
    auto rows = hnsw ? dynamic_cast<faiss::IndexFlat*>(hnsw->storage) : nullptr;
    if (!rows || rows->metric_type != faiss::METRIC_INNER_PRODUCT || !hnsw->own_fields) {
        return;
    }
    // its rows are the storage's first ones: all of them once read back, none
    // for a fresh graph beside keys still held (reset builds it first)
    FAISS_THROW_IF_NOT_FMT(
            rows->ntotal <= keys->size() && rows->d == int(keys->d),
            "HNSW retriever: %zd rows of d=%d, the storage holds %zd of d=%zu",
            size_t(rows->ntotal),
            rows->d,
            size_t(keys->size()),
            keys->d);
    auto shared = std::make_unique<StoredKeysIP>(keys);
    shared->ntotal = rows->ntotal;
    delete hnsw->storage;
    hnsw->storage = shared.release();
}

std::unique_ptr<faiss::IndexFlatIP> float_rows_of(const KVStorage& keys, faiss::Index::idx_t n) {
    auto rows = std::make_unique<faiss::IndexFlatIP>(int(keys.d));
    std::vector<float> x;
    keys.to_float(0, n, &x, nullptr);
    rows->add(n, x.data());
    return rows;
}

std::unique_ptr<faiss::IndexHNSWFlat> hnsw_with_float_rows(const faiss::Index& retriever) {
    const StoredKeysIP* shared = stored_keys_of(&retriever);
    FAISS_THROW_IF_NOT_MSG(shared, "hnsw_with_float_rows: not an HNSW retriever over stored keys");
    const auto& hnsw = dynamic_cast<const faiss::IndexHNSWFlat&>(retriever);
    auto rows = float_rows_of(*shared->keys, shared->ntotal);
    auto copy = std::make_unique<faiss::IndexHNSWFlat>();
    copy->d = hnsw.d;
    copy->ntotal = hnsw.ntotal;
    copy->is_trained = hnsw.is_trained;
    copy->metric_type = hnsw.metric_type;
    copy->metric_arg = hnsw.metric_arg;
    copy->hnsw = hnsw.hnsw;
    copy->storage = rows.release();
    copy->own_fields = true;
    return copy;
}

} // namespace kvindex
