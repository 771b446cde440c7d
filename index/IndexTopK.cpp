#include <kvindex/IndexTopK.h>

#include <algorithm>
#include <numeric>
#include <limits>
#include <random>
#include <typeinfo>
#include <vector>

#include <faiss/AutoTune.h>
#include <faiss/IndexFlat.h>
#include <faiss/IndexHNSW.h>
#include <faiss/IVFlib.h>
#include <faiss/IndexIVF.h>
#include <faiss/IndexIVFFlat.h>
#include <faiss/IndexIVFPQ.h>
#include <faiss/IndexPQ.h>
#include <faiss/impl/AuxIndexStructures.h>
#include <faiss/impl/DistanceComputer.h>
#include <faiss/impl/FaissAssert.h>
#include <faiss/impl/HNSW.h>
#include <faiss/impl/io.h>
#include <faiss/index_factory.h>
#include <faiss/index_io.h>
#include <faiss/utils/Heap.h>

#include <kvindex/IndexKVFlat.h>
#include <kvindex/kernels.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>

#include "checks.h"
#include "faiss_checks.h"
#include "parallel.h"
#include "retriever_growth.h"
#include "retriever_scan.h"
#include "stored_keys_ip.h"

namespace kvindex {

namespace {

/// Keys a product quantizer's k-means takes per centroid before it trains:
/// Faiss's own floor (ClusteringParameters::min_points_per_centroid), below
/// which it warns for every sub-quantizer (hundreds of lines for PQ128) and
/// spends its time on codebooks that fit a handful of keys.
constexpr idx_t kPQKeysPerCentroid = 39;

/// A product quantizer's training, in distances (M * 2^nbits centroids times
/// the training keys): at most 2^28, about 11 s of one core of the 2-core
/// EPYC this was measured on (TopK(PQ128) at d = 128: 14 s for 10,000 keys,
/// PQ64 7 s, PQ32 4 s). The sample is capped to stay under it; a quantizer
/// whose 39 keys per centroid already pass it is refused.
constexpr int64_t kPQTrainingWork = int64_t(1) << 28;

/// Keys an untrained retriever needs before it can train: IVF k-means needs
/// at least one key per list, a product quantizer 39 per centroid
/// (39 * 2^nbits: 9984 for 8 bits); until then search scans exactly.
idx_t min_keys_to_train(const faiss::Index* retriever, const std::string& retriever_string) {
    idx_t need = 1;
    if (auto ivf = faiss::ivflib::try_extract_index_ivf(retriever)) {
        need = idx_t(ivf->nlist);
    }
    return std::max<idx_t>(need, kPQKeysPerCentroid * product_quantizer_centroids(retriever_string));
}

/// The retriever a Faiss factory string builds, for inner product. Faiss's
/// factory turns on polysemous training for PQ codes (unless the string
/// ends in "np"): a simulated annealing of the codebook's order, a minute
/// per head at d = 32, that only the Hamming pre-filter (polysemous_ht)
/// uses, which top-k never does; the codes' scores are the same without it.
std::unique_ptr<faiss::Index> make_retriever(int d, const std::string& retriever_string) {
    std::unique_ptr<faiss::Index> r(
            faiss::index_factory(d, retriever_string.c_str(), faiss::METRIC_INNER_PRODUCT));
    if (auto pq = dynamic_cast<faiss::IndexPQ*>(r.get())) {
        pq->do_polysemous_training = false;
    } else if (auto ivfpq = dynamic_cast<faiss::IndexIVFPQ*>(r.get())) {
        ivfpq->do_polysemous_training = false;
    } else if (auto hnsw = dynamic_cast<faiss::IndexHNSW*>(r.get())) {
        if (auto stored = dynamic_cast<faiss::IndexPQ*>(hnsw->storage)) {
            stored->do_polysemous_training = false;
        }
    }
    return r;
}

/// The official code's IVF default (nprobe 8), where Faiss's is 1.
void set_default_knobs(faiss::Index* retriever) {
    if (auto ivf = faiss::ivflib::try_extract_index_ivf(retriever)) {
        ivf->nprobe = std::min<size_t>(ivf->nlist, 8);
    }
}

} // namespace

IndexTopK::IndexTopK() : KVIndex(0, 0) {}

IndexTopK::IndexTopK(
        int d, int d_value, const std::string& retriever_string, KVType kv_type)
        : KVIndex(d, d_value, kv_type),
          retriever_string(retriever_string),
          storage(d, this->d_value, kv_type) {
    FAISS_THROW_IF_NOT_FMT(d > 0, "TopK: key dimension d=%d must be > 0", d);
    // sizes are checked before Faiss allocates them
    check_retriever_string(retriever_string, d, max_lists());
    try {
        retriever = make_retriever(d, retriever_string);
    } catch (const std::exception& e) {
        FAISS_THROW_FMT(
                "TopK(%s): Faiss cannot build this retriever: %s",
                retriever_string.c_str(),
                bare_error_message(e).c_str());
    }
    // Faiss silently builds some families for L2 whatever the metric asked
    FAISS_THROW_IF_NOT_FMT(
            retriever->metric_type == faiss::METRIC_INNER_PRODUCT,
            "TopK(%s): unsupported retriever: Faiss builds it for the L2 metric, "
            "top-k attention needs inner product",
            retriever_string.c_str());
    // a retriever must be one the reader can validate, or its index could
    // be written but never read back
    faiss::VectorIOWriter blob;
    faiss::write_index(retriever.get(), &blob);
    try {
        check_faiss_blob(blob.data.data(), blob.data.size(), d);
    } catch (const std::exception& e) {
        FAISS_THROW_FMT(
                "TopK(%s): unsupported retriever: %s", retriever_string.c_str(), bare_error_message(e).c_str());
    }
    min_train_points = min_keys_to_train(retriever.get(), retriever_string);
    if (const int64_t work = product_quantizer_work(retriever_string)) {
        KVINDEX_CHECK_ARG(
                work * min_train_points <= kPQTrainingWork,
                "TopK(%s): its product quantizer trains %lld centroids (M x 2^nbits) on at least %lld keys "
                "(39 per centroid): %.2g distances, more than the %.2g that train in about 10 s per head; "
                "use fewer sub-quantizers or bits (at 8 bits, at most %lld sub-quantizers), or SQ8",
                retriever_string.c_str(),
                (long long)work,
                (long long)min_train_points,
                double(work) * double(min_train_points),
                double(kPQTrainingWork),
                (long long)(kPQTrainingWork / (kPQKeysPerCentroid * 256 * 256)));
    }
    max_train_points = std::max(max_train_points, min_train_points);
    set_default_knobs(retriever.get());
    use_stored_keys(retriever.get(), &storage);
}

std::unique_ptr<KVIndex> IndexTopK::from_factory(FactoryChain& chain) {
    const std::string& s = chain.peek();
    const std::string head = "TopK(";
    if (s.size() <= head.size() + 1 || s.compare(0, head.size(), head) != 0 ||
        s.back() != ')') {
        return nullptr;
    }
    chain.take();
    return std::make_unique<IndexTopK>(
            chain.d, chain.d_value, s.substr(head.size(), s.size() - head.size() - 1),
            chain.kv_type);
}

namespace {

/// Faiss keeps the HNSW level generator's state in memory only, so an index
/// read back would draw other levels than the original for the tokens added
/// after it. Seeding the generator from the count of keys held before each
/// add makes the levels a function of the tokens, the same in both. (Faiss
/// seeds a new HNSW with 12345: the first add draws the levels it did.)
void reseed_hnsw_levels(faiss::Index* retriever) {
    if (auto* hnsw = dynamic_cast<faiss::IndexHNSW*>(retriever)) {
        hnsw->hnsw.rng = faiss::RandomGenerator(int64_t(12345) + hnsw->ntotal);
    }
}

/// The distances HNSW minimises (-<q, x> for METRIC_INNER_PRODUCT, as
/// Faiss's own IndexHNSW does), counting every one it computes: the greedy
/// steps of the upper layers too, which Faiss 1.7.3's HNSWStats leaves out.
struct CountedDistances : faiss::DistanceComputer {
    std::unique_ptr<faiss::DistanceComputer> inner;
    float sign;
    size_t computed = 0;
    CountedDistances(faiss::DistanceComputer* inner, bool negate)
            : inner(inner), sign(negate ? -1.0f : 1.0f) {}
    void set_query(const float* x) override {
        inner->set_query(x);
    }
    float operator()(idx_t i) override {
        computed++;
        return sign * (*inner)(i);
    }
    float symmetric_dis(idx_t i, idx_t j) override {
        computed++;
        return sign * inner->symmetric_dis(i, j);
    }
};

/// Bytes of one vector as a Faiss index stores it (a float row for Flat, a
/// code for SQ / PQ), what a distance to it reads.
size_t code_bytes(const faiss::Index& index) {
    try {
        return index.sa_code_size();
    } catch (const faiss::FaissException&) {
        return size_t(index.d) * sizeof(float); // no codec: a float row
    }
}

/// Bytes of the float codebook a PQ index builds each query's distance table
/// from (M × ksub sub-vectors of d / M floats: ksub × d floats), read once
/// per query whatever the number of codes; 0 for the other indexes.
size_t pq_table_bytes(const faiss::Index& index) {
    const faiss::ProductQuantizer* pq = nullptr;
    if (auto flat = dynamic_cast<const faiss::IndexPQ*>(&index)) {
        pq = &flat->pq;
    } else if (auto ivf = dynamic_cast<const faiss::IndexIVFPQ*>(&index)) {
        pq = &ivf->pq;
    }
    return pq ? pq->centroids.size() * sizeof(float) : 0;
}

/// The HNSW types whose search is HNSW::search over their storage (not
/// IndexHNSW2Level, which overrides it, nor a reordering one).
bool searches_through_hnsw(const faiss::IndexHNSW* h) {
    if (!h || !h->storage || h->reconstruct_from_neighbors) {
        return false;
    }
    const std::type_info& t = typeid(*h);
    return t == typeid(faiss::IndexHNSWFlat) || t == typeid(faiss::IndexHNSWSQ) ||
            t == typeid(faiss::IndexHNSWPQ);
}

/** What Faiss 1.7.3's IndexHNSW::search does (the same graph walk, the same
 * results), but returning the distances each query computed, which Faiss
 * only adds to a process-wide counter (faiss::hnsw_stats): searches of
 * other indexes running at the same time mix into that one. The beam is
 * hnsw.efSearch (1.7.3 sizes its candidate heap from the field, whatever
 * SearchParametersHNSW says). scanned may be nullptr.
 */
void search_hnsw(
        const faiss::IndexHNSW& h,
        idx_t n,
        const float* q,
        idx_t k,
        float* distances,
        idx_t* labels,
        size_t* scanned) {
    FAISS_THROW_IF_NOT_FMT(
            k <= std::numeric_limits<int>::max(), "search: k=%zd is beyond HNSW's int", size_t(k));
    // a chunk of queries per thread: the visited table (ntotal bytes) is
    // made once per chunk, not once per query
    idx_t chunks = std::min<idx_t>(n, std::max(1, omp_get_max_threads()));
    parallel_for(chunks, [&](idx_t c) {
        faiss::VisitedTable visited(h.ntotal);
        CountedDistances dis(
                h.storage->get_distance_computer(), h.metric_type == faiss::METRIC_INNER_PRODUCT);
        for (idx_t i = n * c / chunks; i < n * (c + 1) / chunks; i++) {
            float* D = distances + i * k;
            idx_t* I = labels + i * k;
            dis.set_query(q + i * h.d);
            dis.computed = 0;
            faiss::maxheap_heapify(k, D, I);
            h.hnsw.search(dis, int(k), I, D, visited);
            faiss::maxheap_reorder(k, D, I);
            if (h.metric_type == faiss::METRIC_INNER_PRODUCT) {
                for (idx_t j = 0; j < k; j++) {
                    D[j] = -D[j];
                }
            }
            if (scanned) {
                // the vectors whose distance was computed, as stored; the
                // neighbour lists are not counted (Faiss does not say how
                // many nodes the walk expanded)
                scanned[i] = dis.computed;
            }
        }
    });
}

} // namespace

void IndexTopK::add_kv_impl(idx_t n, const float* keys, const float* values) {
    storage.append(n, keys, values);
    if (is_flat_inner_product(retriever.get())) {
        return; // search scans the storage: a flat retriever holds no copy
    }
    try {
        if (retriever->is_trained) {
            // the retriever holds float keys: the keys as stored, so that its
            // scores are the storage's
            std::vector<float> stored;
            if (kv_type != KVType::f32) {
                storage.to_float(storage.size() - n, n, &stored, nullptr);
                keys = stored.data();
            }
            reseed_hnsw_levels(retriever.get());
            add_growing_by_quarter(*retriever, n, keys);
            undo_in_retriever = keeping_undo();
            return;
        }
        if (storage.size() < min_train_points) {
            return; // search scans exactly until the retriever can train
        }
        // Train on a random sample of all keys so far: a prefix would see
        // only the start of the document. A new retriever is trained and
        // filled, then takes the untrained one's place: a throw leaves that.
        idx_t nt = storage.size();
        std::vector<idx_t> perm(nt);
        std::iota(perm.begin(), perm.end(), 0);
        idx_t n_sample = std::min(nt, max_train_points);
        if (const int64_t work = product_quantizer_work(retriever_string)) {
            // a product quantizer's k-means time grows with its sample: capped
            // (at least its 39 keys per centroid, which the constructor checked)
            n_sample = std::min<idx_t>(n_sample, std::max<idx_t>(min_train_points, kPQTrainingWork / work));
        }
        std::mt19937_64 rng(train_seed);
        for (idx_t i = 0; i < n_sample; i++) {
            std::uniform_int_distribution<idx_t> pick(i, nt - 1);
            std::swap(perm[i], perm[pick(rng)]);
        }
        std::vector<float> sample(n_sample * d);
        for (idx_t i = 0; i < n_sample; i++) {
            storage.key(perm[i], sample.data() + i * d);
        }
        std::unique_ptr<faiss::Index> trained = fresh_retriever();
        trained->train(n_sample, sample.data());
        std::vector<float> all;
        storage.to_float(0, nt, &all, nullptr);
        reseed_hnsw_levels(trained.get());
        add_growing_by_quarter(*trained, nt, all.data());
        if (keeping_undo()) {
            undo_untrained = std::move(retriever); // kept, not copied
        }
        retriever = std::move(trained);
    } catch (const std::exception& e) {
        // the tokens of this call are not added. A flat or IVF retriever is
        // as it was (an IVF reserves its lists before it adds, and trains a
        // new one); an HNSW graph may hold part of them: KVIndex marks the
        // index failed (writes_roll_back), and reset() starts it again
        storage.truncate(storage.size() - n);
        FAISS_THROW_FMT("TopK(%s): add failed: %s", retriever_string.c_str(), bare_error_message(e).c_str());
    }
}

void IndexTopK::undo_add_kv_impl(idx_t n) {
    const idx_t n0 = ntotal - n;
    if (undo_untrained) {
        retriever = std::move(undo_untrained); // search scans exactly again
    } else if (undo_in_retriever) {
        // an IVF's new entries are the last of their lists, and removing
        // them from the lists' ends keeps the others' order
        faiss::IDSelectorRange added(n0, ntotal);
        const size_t removed = retriever->remove_ids(added);
        FAISS_THROW_IF_NOT_FMT(
                removed == size_t(n),
                "TopK(%s): undo_add_kv removed %zu of the %zd keys appended",
                retriever_string.c_str(),
                removed,
                ssize_t(n));
    }
    storage.truncate(n0);
}

void IndexTopK::forget_undo_impl() noexcept {
    undo_untrained.reset();
    undo_in_retriever = false;
}

bool IndexTopK::can_undo_add() const {
    return is_flat_inner_product(retriever.get()) || dynamic_cast<const faiss::IndexIVF*>(retriever.get());
}

bool IndexTopK::writes_roll_back() const {
    return !dynamic_cast<const faiss::IndexHNSW*>(retriever.get());
}

void IndexTopK::search_batch(
        idx_t n,
        const float* q,
        idx_t k,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters* params) const {
    search_retriever(n, q, k, distances, labels, params, nullptr);
}

void IndexTopK::search_retriever(
        idx_t n,
        const float* q,
        idx_t k,
        float* distances,
        idx_t* labels,
        const faiss::SearchParameters* params,
        size_t* hnsw_scanned) const {
    // exact scan of what is stored, one query per thread
    auto scan_storage = [&]() {
        parallel_for(n, [&](idx_t i) {
            exact_topk_inner_product(
                    q + i * d, storage.key_rows(), ntotal, k, distances + i * k, labels + i * k);
        });
    };
    const auto* p = dynamic_cast<const SearchParametersTopK*>(params);
    auto hnsw = dynamic_cast<faiss::IndexHNSW*>(retriever.get());
    // the per-call knobs are checked as set_index_parameters checks them,
    // whether or not the retriever is trained yet: never ignored or clamped
    // (check_params refused a knob this retriever does not have)
    if (p) {
        FAISS_THROW_IF_NOT_FMT(
                p->efSearch >= 0, "search: efSearch=%d must be >= 1 (0: the index's own)", p->efSearch);
        if (p->nprobe > 0) {
            auto ivf = faiss::ivflib::try_extract_index_ivf(retriever.get());
            FAISS_THROW_IF_NOT_MSG(ivf, "search: nprobe needs an IVF retriever");
            FAISS_THROW_IF_NOT_FMT(
                    p->nprobe <= ivf->nlist,
                    "search: nprobe=%zd must be in [1, nlist=%zd] (0: the index's own)",
                    p->nprobe,
                    ivf->nlist);
        }
        if (p->efSearch > 0) {
            FAISS_THROW_IF_NOT_MSG(hnsw, "search: efSearch needs an HNSW retriever");
            FAISS_THROW_IF_NOT_FMT(
                    p->efSearch <= kMaxEfSearch,
                    "search: efSearch=%d must be in [1, %d]",
                    p->efSearch,
                    kMaxEfSearch);
        }
    }
    if (!retriever->is_trained) {
        scan_storage(); // too few keys to train yet
        return;
    }
    faiss::SearchParametersIVF ivf_params;
    const faiss::SearchParameters* rp = nullptr;
    if (p && p->nprobe > 0) {
        ivf_params.nprobe = p->nprobe;
        rp = &ivf_params;
    }
    auto own_ivf = as_ivf_flat_inner_product(retriever.get());
    if (own_ivf || is_flat_inner_product(retriever.get())) {
        // our kernels scan (retriever_scan.h), each key read once
        if (!own_ivf) {
            // a flat retriever holds the stored keys widened to float: the
            // storage itself gives the same top-k, reading half the bytes
            // under BF16 / FP16
            scan_storage();
            return;
        }
        size_t nprobe = p && p->nprobe > 0 ? p->nprobe : own_ivf->nprobe;
        parallel_for(n, [&](idx_t i) {
            ivf_flat_search(*own_ivf, q + i * d, k, nprobe, distances + i * k, labels + i * k);
        });
        return;
    }
    // one thread of BLAS inside OpenMP regions (Faiss's flat search uses sgemm)
    ScopedBlasThreads blas(omp_in_parallel() ? 1 : 0);
    if (!hnsw) {
        retriever->search(n, q, k, distances, labels, rp);
        return;
    }
    auto search = [&]() {
        if (searches_through_hnsw(hnsw)) {
            search_hnsw(*hnsw, n, q, k, distances, labels, hnsw_scanned);
        } else {
            retriever->search(n, q, k, distances, labels, rp);
        }
    };
    if (!(p && p->efSearch > 0)) {
        // shared with other searches, but not with a call that sets the beam
        std::shared_lock<std::shared_mutex> lock(retriever_mutex);
        search();
        return;
    }
    {
        // Faiss 1.7.3's IndexHNSW::search ignores SearchParametersHNSW, so
        // the beam width is set on the index for this call, alone (restored
        // even if the search throws).
        std::unique_lock<std::shared_mutex> lock(retriever_mutex);
        struct Restore {
            faiss::HNSW& h;
            int ef;
            ~Restore() {
                h.efSearch = ef;
            }
        } restore{hnsw->hnsw, hnsw->hnsw.efSearch};
        hnsw->hnsw.efSearch = p->efSearch;
        search();
    }
}

void IndexTopK::select_batch(
        idx_t n,
        const float* q,
        Selection* sel,
        const faiss::SearchParameters* params) const {
    idx_t kk = effective_k(params);
    if (kk >= ntotal) { // a budget beyond the index means every token
        for (idx_t i = 0; i < n; i++) {
            sel[i].set_all(ntotal);
        }
        return;
    }
    std::vector<float> dis(n * kk);
    std::vector<idx_t> ids(n * kk);
    auto kv_params = dynamic_cast<const SearchParametersKV*>(params);
    bool count = kv_params && kv_params->count_scanned;
    // HNSW counts as it searches; the others are counted after
    bool hnsw_counts = retriever->is_trained &&
            searches_through_hnsw(dynamic_cast<const faiss::IndexHNSW*>(retriever.get()));
    std::vector<size_t> scanned(n, 0);
    if (count && !hnsw_counts) {
        faiss::hnsw_stats.reset();
    }
    search_retriever(
            n, q, kk, dis.data(), ids.data(), params, count && hnsw_counts ? scanned.data() : nullptr);
    if (count && hnsw_counts) {
        const faiss::Index& stored = *dynamic_cast<const faiss::IndexHNSW&>(*retriever).storage;
        const size_t row = code_bytes(stored), table = pq_table_bytes(stored);
        for (idx_t i = 0; i < n; i++) {
            scanned[i] = key_equivalents(scanned[i] * row + table);
        }
    } else if (count) {
        count_scanned(n, q, params, scanned.data());
    }
    for (idx_t i = 0; i < n; i++) {
        sel[i].clear();
        sel[i].n_scanned = scanned[i];
        for (idx_t j = 0; j < kk; j++) {
            idx_t id = ids[i * kk + j];
            if (id >= 0) {
                sel[i].push_back(id);
            }
        }
    }
}

void IndexTopK::attend_batch(
        idx_t n,
        const float* q,
        float* out,
        float* lse,
        const faiss::SearchParameters* params) const {
    std::vector<Selection> sel(n);
    select_batch(n, q, sel.data(), params);
    estimate_batch(n, q, sel.data(), out, lse);
}

void IndexTopK::count_scanned(
        idx_t n,
        const float* q,
        const faiss::SearchParameters* params,
        size_t* scanned) const {
    auto ivf = faiss::ivflib::try_extract_index_ivf(retriever.get());
    auto hnsw = dynamic_cast<const faiss::IndexHNSW*>(retriever.get());
    if (!retriever->is_trained || is_flat_inner_product(retriever.get())) {
        std::fill(scanned, scanned + n, size_t(ntotal)); // the stored keys, once
    } else if (ivf) {
        // the centroids (float rows, all of them for a flat quantizer), a
        // PQ's codebook, then the codes of the probed lists
        auto p = dynamic_cast<const SearchParametersTopK*>(params);
        size_t nprobe = std::min(ivf->nlist, p && p->nprobe > 0 ? p->nprobe : ivf->nprobe);
        std::vector<float> cd(n * nprobe);
        std::vector<idx_t> lists(n * nprobe);
        ivf->quantizer->search(n, q, nprobe, cd.data(), lists.data());
        const size_t fixed = ivf->nlist * size_t(d) * sizeof(float) + pq_table_bytes(*ivf);
        for (idx_t i = 0; i < n; i++) {
            size_t codes = 0;
            for (size_t j = 0; j < nprobe; j++) {
                idx_t l = lists[i * nprobe + j];
                codes += l >= 0 ? ivf->invlists->list_size(l) : 0;
            }
            scanned[i] = key_equivalents(fixed + codes * ivf->code_size);
        }
    } else if (hnsw) {
        // the HNSW types that search_hnsw does not serve (IndexHNSW2Level,
        // reordering): Faiss's process-wide counter, reset by select, exact
        // only while no other HNSW search runs, averaged over the batch, and
        // without the upper layers' greedy steps
        size_t ndis = faiss::hnsw_stats.n3 + faiss::hnsw_stats.ndis;
        std::fill(scanned, scanned + n,
                  key_equivalents((ndis + n - 1) / n * code_bytes(*hnsw->storage)));
    } else {
        // a flat index of codes (PQ, SQ, LSH): every code once, and a PQ's
        // codebook
        std::fill(scanned, scanned + n,
                  key_equivalents(size_t(ntotal) * code_bytes(*retriever) + pq_table_bytes(*retriever)));
    }
}

void IndexTopK::reset_impl() {
    // a new sequence has new keys: its retriever trains on them afresh
    rebuild_retriever(); // first: if it throws, nothing has changed
    storage.clear();
    ntotal = 0;
}

idx_t IndexTopK::max_lists() const {
    return std::min<idx_t>(max_train_points, kMaxRetrieverLists);
}

std::unique_ptr<faiss::Index> IndexTopK::fresh_retriever() const {
    check_retriever_string(retriever_string, d, max_lists());
    std::unique_ptr<faiss::Index> fresh = make_retriever(d, retriever_string);
    auto old_ivf = faiss::ivflib::try_extract_index_ivf(retriever.get());
    auto new_ivf = faiss::ivflib::try_extract_index_ivf(fresh.get());
    if (old_ivf && new_ivf) {
        new_ivf->nprobe = old_ivf->nprobe;
    }
    auto old_hnsw = dynamic_cast<const faiss::IndexHNSW*>(retriever.get());
    auto new_hnsw = dynamic_cast<faiss::IndexHNSW*>(fresh.get());
    if (old_hnsw && new_hnsw) {
        new_hnsw->hnsw.efSearch = old_hnsw->hnsw.efSearch;
    }
    use_stored_keys(fresh.get(), &storage);
    return fresh;
}

void IndexTopK::rebuild_retriever() {
    retriever = fresh_retriever();
}

size_t IndexTopK::memory_bytes() const {
    return storage.memory_bytes() + retriever_memory_bytes(*retriever);
}

namespace {

/// Whether the retriever has the knob: nprobe (IVF) or efSearch (HNSW).
bool retriever_has_knob(const faiss::Index* retriever, const std::string& name) {
    return (name == "nprobe" && faiss::ivflib::try_extract_index_ivf(retriever)) ||
            (name == "efSearch" && dynamic_cast<const faiss::IndexHNSW*>(retriever));
}

} // namespace

void IndexTopK::set_retriever_parameter(const std::string& name, double value) {
    FAISS_THROW_IF_NOT_FMT(
            is_positive_integer(value),
            "TopK(%s): %s=%g must be a positive integer",
            retriever_string.c_str(),
            name.c_str(),
            value);
    FAISS_THROW_IF_NOT_FMT(
            retriever_has_knob(retriever.get(), name),
            "TopK(%s): the retriever has no parameter '%s'",
            retriever_string.c_str(),
            name.c_str());
    if (name == "nprobe") {
        // the reader refuses nprobe > nlist: a file written with it would not read back
        size_t nlist = faiss::ivflib::try_extract_index_ivf(retriever.get())->nlist;
        FAISS_THROW_IF_NOT_FMT(
                value <= double(nlist),
                "TopK(%s): nprobe=%g must be in [1, nlist=%zd]",
                retriever_string.c_str(),
                value,
                nlist);
    }
    if (name == "efSearch") {
        // an int in Faiss; the reader refuses more than kMaxEfSearch
        FAISS_THROW_IF_NOT_FMT(
                value <= double(kMaxEfSearch),
                "TopK(%s): efSearch=%g must be in [1, %d]",
                retriever_string.c_str(),
                value,
                kMaxEfSearch);
    }
    faiss::ParameterSpace().set_index_parameter(retriever.get(), name, value);
}

std::vector<SearchKnob> SearchParametersTopK::set_knobs() const {
    std::vector<SearchKnob> knobs;
    if (nprobe != 0) {
        knobs.push_back({"nprobe", double(nprobe)});
    }
    if (efSearch != 0) {
        knobs.push_back({"efSearch", double(efSearch)});
    }
    return knobs;
}

std::unique_ptr<SearchParametersKV> SearchParametersTopK::without_knob(const std::string& name) const {
    auto copy = std::make_unique<SearchParametersTopK>(*this);
    if (name == "k") {
        copy->k = 0;
    } else if (name == "nprobe") {
        copy->nprobe = 0;
    } else if (name == "efSearch") {
        copy->efSearch = 0;
    } else {
        return SearchParametersKV::without_knob(name);
    }
    return copy;
}

bool IndexTopK::reads_search_knob(const std::string& name) const {
    return name == "k" || retriever_has_knob(retriever.get(), name);
}

std::vector<ParameterInfo> IndexTopK::parameter_info() const {
    std::vector<ParameterInfo> info = KVIndex::parameter_info();
    if (faiss::ivflib::try_extract_index_ivf(retriever.get())) {
        const double nlist = double(faiss::ivflib::try_extract_index_ivf(retriever.get())->nlist);
        info.push_back(ParameterInfo::integer("nprobe", 1, nlist, "IVF retriever: inverted lists visited"));
    }
    if (dynamic_cast<const faiss::IndexHNSW*>(retriever.get())) {
        info.push_back(ParameterInfo::integer("efSearch", 1, kMaxEfSearch, "HNSW retriever: beam width of the search").tokens());
    }
    return info;
}

bool IndexTopK::set_parameter(const std::string& name, double value) {
    if (retriever_has_knob(retriever.get(), name)) {
        set_retriever_parameter(name, value);
        return true;
    }
    if (name == "nprobe" || name == "efSearch") {
        // not this retriever's knob: another index of the chain may have it
        // ("Choose(TopK(IVF64,Flat);TopK(Flat))|nprobe=8"); if none does,
        // set_index_parameter names it as unknown
        return false;
    }
    return KVIndex::set_parameter(name, value);
}

bool IndexTopK::get_parameter(const std::string& name, double* value) const {
    auto ivf = faiss::ivflib::try_extract_index_ivf(retriever.get());
    auto hnsw = dynamic_cast<const faiss::IndexHNSW*>(retriever.get());
    if (name == "nprobe" && ivf) {
        *value = double(ivf->nprobe);
        return true;
    }
    if (name == "efSearch" && hnsw) {
        *value = double(hnsw->hnsw.efSearch);
        return true;
    }
    return KVIndex::get_parameter(name, value);
}

namespace {

/// The training sizes a record may hold: checked by the reader, and by
/// check_invariants, which the writer runs (the fields are public), so
/// that a saved index reads back.
void check_training_sizes(idx_t min_points, idx_t max_points, const char* where) {
    FAISS_THROW_IF_NOT_FMT(
            max_points >= 1 && max_points <= IndexTopK::kMaxTrainPoints && min_points >= 1 &&
                    min_points <= max_points,
            "%s: TopK training sizes min %zd / max %zd must satisfy 1 <= min <= max <= 2^26",
            where,
            size_t(min_points),
            size_t(max_points));
}

} // namespace

void IndexTopK::write_fields(BufferWriter& w) const {
    w.string(retriever_string);
    w.value<int64_t>(max_train_points);
    w.value<int64_t>(min_train_points);
    w.value<uint64_t>(train_seed);
    storage.write(w);
    faiss::VectorIOWriter fw;
    if (is_flat_inner_product(retriever.get())) {
        // the record keeps a flat retriever with the keys as stored, as
        // the retriever itself held them before (files and golden bytes
        // unchanged); in memory it holds none
        faiss::write_index(float_rows_of(storage, ntotal).get(), &fw);
    } else if (stored_keys_of(retriever.get())) {
        // an HNSW graph over the stored keys: the record holds it with the
        // keys as float rows, as Faiss wrote it before it shared them
        faiss::write_index(hnsw_with_float_rows(*retriever).get(), &fw);
    } else {
        faiss::write_index(retriever.get(), &fw);
    }
    w.foreign(fw.data);
}

void IndexTopK::read_fields(BufferReader& r, uint32_t) {
    retriever_string = r.string("retriever string");
    max_train_points = r.value<int64_t>("max_train_points");
    min_train_points = r.value<int64_t>("min_train_points");
    train_seed = r.value<uint64_t>("train_seed");
    check_training_sizes(min_train_points, max_train_points, "read_index");
    check_retriever_string(retriever_string, d, max_lists());
    storage = KVStorage(d, d_value, kv_type);
    storage.read(r, "TopK storage");
    faiss::VectorIOReader fr;
    fr.data = r.vector<uint8_t>("TopK retriever");
    FAISS_THROW_IF_NOT_MSG(
            storage.size() == ntotal, "read_index: TopK storage and ntotal inconsistent");
    // Faiss's reader leaks on a malformed blob: it only sees validated ones
    try {
        check_faiss_blob(fr.data.data(), fr.data.size(), d);
    } catch (const std::exception& e) {
        FAISS_THROW_FMT("read_index: TopK retriever malformed: %s", bare_error_message(e).c_str());
    }
    try {
        retriever.reset(faiss::read_index(&fr));
    } catch (const std::exception& e) {
        // Faiss's reader also throws std::bad_alloc / length_error
        FAISS_THROW_FMT("read_index: TopK retriever unreadable: %s", bare_error_message(e).c_str());
    }
    check_faiss_retriever(
            retriever.get(), retriever_string, d, retriever->is_trained ? ntotal : 0);
    if (!retriever->is_trained) {
        rebuild_retriever(); // see rebuild_retriever
    }
    if (is_flat_inner_product(retriever.get())) {
        // the storage has the keys (write_fields); a fresh retriever, as
        // reset() would keep the rows' capacity (ntotal * d floats)
        retriever = make_retriever(d, retriever_string);
    }
    use_stored_keys(retriever.get(), &storage); // an HNSW graph drops its rows
}

void IndexTopK::check_invariants() const {
    KVIndex::check_invariants();
    FAISS_THROW_IF_NOT_FMT(
            retriever && retriever->d == d &&
                    retriever->ntotal == (retriever->is_trained && !is_flat_inner_product(retriever.get())
                                                  ? ntotal
                                                  : 0) &&
                    storage.d == size_t(d) && storage.d_value == size_t(d_value) &&
                    storage.type == kv_type &&
                    storage.size() == ntotal,
            "IndexTopK(%s): retriever, storage and ntotal=%zd disagree",
            retriever_string.c_str(),
            size_t(ntotal));
    const StoredKeysIP* shared = stored_keys_of(retriever.get());
    FAISS_THROW_IF_NOT_FMT(
            !shared || (shared->keys == &storage && shared->ntotal == ntotal),
            "IndexTopK(%s): the HNSW graph's keys are not this index's storage",
            retriever_string.c_str());
    check_training_sizes(min_train_points, max_train_points, "IndexTopK");
}

} // namespace kvindex
