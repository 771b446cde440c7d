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

} // namespace

bool is_flat_inner_product(const faiss::Index* retriever) {
    return as_flat_ip(retriever) != nullptr;
}

const faiss::IndexIVFFlat* as_ivf_flat_inner_product(const faiss::Index* retriever) {
    auto ivf = dynamic_cast<const faiss::IndexIVFFlat*>(retriever);
    if (!ivf || ivf->metric_type != faiss::METRIC_INNER_PRODUCT || !as_flat_ip(ivf->quantizer) ||
        ivf->code_size != sizeof(float) * ivf->d) {
        return nullptr;
    }
    return ivf;
}

void ivf_flat_search(
        const faiss::IndexIVFFlat& ivf,
        const float* q,
        idx_t k,
        size_t nprobe,
        float* distances,
        idx_t* labels) {
    FAISS_THROW_IF_NOT_MSG(ivf.is_trained, "ivf_flat_search: IVF retriever is not trained");
    // the coarse step: the nprobe best centroids, by the same kernel
    const faiss::IndexFlat* quantizer = as_flat_ip(ivf.quantizer);
    FAISS_THROW_IF_NOT_MSG(quantizer, "ivf_flat_search: the quantizer is not flat");
    nprobe = std::min(nprobe, ivf.nlist);
    std::vector<float> cs(nprobe);
    std::vector<int64_t> lists(nprobe);
    size_t n_lists = 0;
    topk_inner_products(
            q, quantizer->get_xb(), ivf.d, ivf.nlist, nullptr, 0, nprobe, cs.data(),
            lists.data(), &n_lists);
    // lists in id order: neighbouring lists are neighbours in memory too
    std::sort(lists.begin(), lists.begin() + n_lists);
    std::vector<float> hs(k);
    std::vector<int64_t> hi(k);
    size_t filled = 0;
    for (size_t j = 0; j < n_lists; j++) {
        size_t l = size_t(lists[j]);
        size_t size = ivf.invlists->list_size(l);
        if (size == 0) {
            continue;
        }
        faiss::InvertedLists::ScopedCodes codes(ivf.invlists, l);
        faiss::InvertedLists::ScopedIds ids(ivf.invlists, l);
        static_assert(sizeof(idx_t) == sizeof(int64_t), "Faiss ids are 64-bit");
        topk_inner_products(
                q, reinterpret_cast<const float*>(codes.get()), ivf.d, size,
                reinterpret_cast<const int64_t*>(ids.get()), 0, size_t(k), hs.data(),
                hi.data(), &filled);
    }
    // the k best, best first, then Faiss's padding
    topk_heap_sort(hs.data(), hi.data(), filled);
    for (size_t j = 0; j < size_t(k); j++) {
        distances[j] = j < filled ? hs[j] : std::numeric_limits<float>::lowest();
        labels[j] = j < filled ? idx_t(hi[j]) : -1;
    }
}

} // namespace kvindex
