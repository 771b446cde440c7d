#include "retriever_growth.h"

#include <cmath>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include <faiss/IndexFlatCodes.h>
#include <faiss/IndexHNSW.h>
#include <faiss/IndexIVF.h>
#include <faiss/IndexIVFFlat.h>
#include <faiss/IndexIVFPQ.h>
#include <faiss/IndexPQ.h>
#include <faiss/IndexScalarQuantizer.h>
#include <faiss/impl/io.h>
#include <faiss/index_io.h>
#include <faiss/invlists/InvertedLists.h>

#include <kvindex/impl/growth.h>

#include "stored_keys_ip.h"

namespace kvindex {

using idx_t = faiss::Index::idx_t;

namespace {

/// Expected neighbour slots of one new HNSW node: its level is drawn from
/// assign_probas, and a node of level l holds cum_nb_neighbors(l + 1).
double expected_hnsw_slots(const faiss::HNSW& hnsw) {
    double slots = 0;
    for (size_t l = 0; l < hnsw.assign_probas.size(); l++) {
        slots += hnsw.assign_probas[l] * hnsw.cum_nb_neighbors(int(l) + 1);
    }
    return slots;
}

/// Reserves the rows of n more vectors in a flat index or an HNSW graph
/// (and its storage); other layouts are left as they are.
void reserve_rows(faiss::Index& r, idx_t n) {
    if (auto flat = dynamic_cast<faiss::IndexFlatCodes*>(&r)) {
        reserve_for_growth(flat->codes, size_t(flat->ntotal + n) * flat->code_size);
    } else if (auto graph = dynamic_cast<faiss::IndexHNSW*>(&r)) {
        faiss::HNSW& hnsw = graph->hnsw;
        if (graph->storage) {
            reserve_rows(*graph->storage, n);
        }
        reserve_for_growth(hnsw.levels, hnsw.levels.size() + n);
        reserve_for_growth(hnsw.offsets, hnsw.offsets.size() + n);
        // the expected slots, and room for one node at the highest level:
        // a draw above expectation by more than that falls back to
        // std::vector's doubling, as before
        size_t slots = size_t(std::ceil(double(n) * expected_hnsw_slots(hnsw))) +
                size_t(hnsw.cum_nb_neighbors(int(hnsw.assign_probas.size())));
        reserve_for_growth(hnsw.neighbors, hnsw.neighbors.size() + slots);
    }
}

/// The IVF layouts whose add is "assign, then add_core": their lists can be
/// reserved from the assignment before the vectors go in. Exact types: a
/// subclass may add differently (IndexIVFFlatDedup does).
bool is_plain_ivf(const faiss::Index& r) {
    const std::type_info& t = typeid(r);
    return t == typeid(faiss::IndexIVFFlat) || t == typeid(faiss::IndexIVFPQ) ||
            t == typeid(faiss::IndexIVFScalarQuantizer);
}

/// r as one of those IVFs over array inverted lists (const or not, as r
/// is), else nullptr: what add reserves list by list and memory counts.
template <class Index>
auto as_array_ivf(Index& r) {
    using IVF = std::conditional_t<std::is_const<Index>::value, const faiss::IndexIVF,
                                   faiss::IndexIVF>;
    auto ivf = dynamic_cast<IVF*>(&r);
    bool array_lists = ivf && dynamic_cast<const faiss::ArrayInvertedLists*>(ivf->invlists);
    return array_lists && is_plain_ivf(r) ? ivf : nullptr;
}

size_t serialized_bytes(const faiss::Index& r) {
    faiss::VectorIOWriter w;
    faiss::write_index(&r, &w);
    return w.data.size();
}

size_t pq_bytes(const faiss::ProductQuantizer& pq) {
    return capacity_bytes(pq.centroids) + capacity_bytes(pq.transposed_centroids) +
            capacity_bytes(pq.sdc_table);
}

size_t array_lists_bytes(const faiss::ArrayInvertedLists& lists) {
    size_t bytes = capacity_bytes(lists.codes) + capacity_bytes(lists.ids);
    for (size_t l = 0; l < lists.nlist; l++) {
        bytes += capacity_bytes(lists.codes[l]) + capacity_bytes(lists.ids[l]);
    }
    return bytes;
}

} // namespace

void add_growing_by_quarter(faiss::Index& retriever, idx_t n, const float* x) {
    if (n <= 0 || !retriever.is_trained) {
        retriever.add(n, x); // Faiss's own checks and messages
        return;
    }
    if (faiss::IndexIVF* ivf = as_array_ivf(retriever)) {
        auto& lists = static_cast<faiss::ArrayInvertedLists&>(*ivf->invlists);
        std::vector<idx_t> assign(n);
        ivf->quantizer->assign(n, x, assign.data());
        std::vector<size_t> incoming(lists.nlist, 0);
        for (idx_t a : assign) {
            if (a >= 0 && size_t(a) < lists.nlist) {
                incoming[a]++;
            }
        }
        for (size_t l = 0; l < lists.nlist; l++) {
            if (incoming[l] > 0) {
                size_t rows = lists.ids[l].size() + incoming[l];
                reserve_for_growth(lists.ids[l], rows);
                reserve_for_growth(lists.codes[l], rows * lists.code_size);
            }
        }
        ivf->add_core(n, x, nullptr, assign.data());
        return;
    }
    reserve_rows(retriever, n);
    retriever.add(n, x);
}

size_t retriever_memory_bytes(const faiss::Index& r) {
    if (dynamic_cast<const StoredKeysIP*>(&r)) {
        return 0; // its keys are its owner's storage, counted there
    }
    if (auto pq = dynamic_cast<const faiss::IndexPQ*>(&r)) {
        return capacity_bytes(pq->codes) + pq_bytes(pq->pq);
    }
    if (auto sq = dynamic_cast<const faiss::IndexScalarQuantizer*>(&r)) {
        return capacity_bytes(sq->codes) + capacity_bytes(sq->sq.trained);
    }
    if (auto flat = dynamic_cast<const faiss::IndexFlat*>(&r)) {
        return capacity_bytes(flat->codes);
    }
    if (auto graph = dynamic_cast<const faiss::IndexHNSW*>(&r)) {
        const faiss::HNSW& h = graph->hnsw;
        return capacity_bytes(h.assign_probas) + capacity_bytes(h.cum_nneighbor_per_level) +
                capacity_bytes(h.levels) + capacity_bytes(h.offsets) + capacity_bytes(h.neighbors) +
                (graph->storage ? retriever_memory_bytes(*graph->storage) : 0);
    }
    const faiss::IndexIVF* ivf = as_array_ivf(r);
    if (ivf && ivf->quantizer) {
        auto ivfpq = dynamic_cast<const faiss::IndexIVFPQ*>(&r);
        auto ivfsq = dynamic_cast<const faiss::IndexIVFScalarQuantizer*>(&r);
        return retriever_memory_bytes(*ivf->quantizer) +
                array_lists_bytes(static_cast<const faiss::ArrayInvertedLists&>(*ivf->invlists)) +
                (ivfpq ? pq_bytes(ivfpq->pq) + ivfpq->precomputed_table.nbytes() : 0) +
                (ivfsq ? capacity_bytes(ivfsq->sq.trained) : 0);
    }
    return serialized_bytes(r);
}

} // namespace kvindex
