#include "retriever_scan.h"

#include <algorithm>
#include <limits>
#include <vector>

#include <faiss/IndexFlat.h>
#include <faiss/IndexIVFFlat.h>
#include <faiss/impl/FaissAssert.h>

#include <kvindex/kernels.h>

namespace kvindex {

using idx_t = faiss::Index::idx_t;

namespace {

const faiss::IndexFlat* as_flat_ip(const faiss::Index* index) {
    auto flat = dynamic_cast<const faiss::IndexFlat*>(index);
    return flat && flat->metric_type == faiss::METRIC_INNER_PRODUCT ? flat : nullptr;
}

/// An IVF with float lists and a flat coarse quantizer, all inner product.
const faiss::IndexIVFFlat* as_ivf_flat_ip(const faiss::Index* index) {
    auto ivf = dynamic_cast<const faiss::IndexIVFFlat*>(index);
    if (!ivf || ivf->metric_type != faiss::METRIC_INNER_PRODUCT || !as_flat_ip(ivf->quantizer) ||
        ivf->code_size != sizeof(float) * ivf->d) {
        return nullptr;
    }
    return ivf;
}

/// The k best of a filled heap, best first, then Faiss's padding.
void emit(std::vector<float>& hs, std::vector<int64_t>& hi, size_t filled, idx_t k,
          float* distances, idx_t* labels) {
    topk_heap_sort(hs.data(), hi.data(), filled);
    for (size_t j = 0; j < size_t(k); j++) {
        distances[j] = j < filled ? hs[j] : std::numeric_limits<float>::lowest();
        labels[j] = j < filled ? idx_t(hi[j]) : -1;
    }
}

} // namespace

bool has_own_scan(const faiss::Index* retriever) {
    return as_flat_ip(retriever) || as_ivf_flat_ip(retriever);
}

void own_scan_search(
        const faiss::Index* retriever,
        const float* q,
        idx_t k,
        size_t nprobe,
        float* distances,
        idx_t* labels) {
    std::vector<float> hs(k);
    std::vector<int64_t> hi(k);
    size_t filled = 0;
    if (auto flat = as_flat_ip(retriever)) {
        topk_inner_products(
                q, flat->get_xb(), flat->d, size_t(flat->ntotal), nullptr, 0, size_t(k),
                hs.data(), hi.data(), &filled);
        emit(hs, hi, filled, k, distances, labels);
        return;
    }
    auto ivf = as_ivf_flat_ip(retriever);
    FAISS_THROW_IF_NOT_MSG(ivf, "own_scan_search: retriever has no own scan");
    FAISS_THROW_IF_NOT_MSG(ivf->is_trained, "own_scan_search: IVF retriever is not trained");
    // the coarse step: the nprobe best centroids, by the same kernel
    const faiss::IndexFlat* quantizer = as_flat_ip(ivf->quantizer);
    nprobe = std::min(nprobe, ivf->nlist);
    std::vector<float> cs(nprobe);
    std::vector<int64_t> lists(nprobe);
    size_t n_lists = 0;
    topk_inner_products(
            q, quantizer->get_xb(), ivf->d, ivf->nlist, nullptr, 0, nprobe, cs.data(),
            lists.data(), &n_lists);
    // lists in id order: neighbouring lists are neighbours in memory too
    std::sort(lists.begin(), lists.begin() + n_lists);
    for (size_t j = 0; j < n_lists; j++) {
        size_t l = size_t(lists[j]);
        size_t size = ivf->invlists->list_size(l);
        if (size == 0) {
            continue;
        }
        faiss::InvertedLists::ScopedCodes codes(ivf->invlists, l);
        faiss::InvertedLists::ScopedIds ids(ivf->invlists, l);
        static_assert(sizeof(idx_t) == sizeof(int64_t), "Faiss ids are 64-bit");
        topk_inner_products(
                q, reinterpret_cast<const float*>(codes.get()), ivf->d, size,
                reinterpret_cast<const int64_t*>(ids.get()), 0, size_t(k), hs.data(),
                hi.data(), &filled);
    }
    emit(hs, hi, filled, k, distances, labels);
}

} // namespace kvindex
