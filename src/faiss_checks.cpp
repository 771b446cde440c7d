#include "faiss_checks.h"

#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <typeindex>
#include <typeinfo>
#include <utility>

#include <faiss/IVFlib.h>
#include <faiss/IndexFlatCodes.h>
#include <faiss/IndexHNSW.h>
#include <faiss/IndexIVF.h>
#include <faiss/impl/FaissAssert.h>
#include <faiss/index_factory.h>
#include <faiss/invlists/InvertedLists.h>

namespace kvindex {

namespace {

using idx_t = faiss::Index::idx_t;

void check_flat_codes(const faiss::IndexFlatCodes* f, idx_t n, const char* what) {
    FAISS_THROW_IF_NOT_FMT(
            f->ntotal == n && f->code_size > 0 && f->codes.size() == size_t(n) * f->code_size,
            "read_index: %s holds %zd codes of %zd bytes for %zd vectors",
            what,
            f->codes.size(),
            f->code_size,
            size_t(n));
}

void check_hnsw(const faiss::IndexHNSW* index, idx_t n);

void check_ivf(const faiss::IndexIVF* ivf, idx_t ntotal) {
    FAISS_THROW_IF_NOT_MSG(ivf->quantizer, "read_index: IVF retriever has no quantizer");
    FAISS_THROW_IF_NOT_FMT(
            ivf->quantizer->d == ivf->d && size_t(ivf->quantizer->ntotal) == ivf->nlist,
            "read_index: IVF quantizer holds %zd centroids for nlist=%zd",
            size_t(ivf->quantizer->ntotal),
            ivf->nlist);
    if (auto qf = dynamic_cast<const faiss::IndexFlatCodes*>(ivf->quantizer)) {
        check_flat_codes(qf, qf->ntotal, "IVF quantizer");
    }
    if (auto qh = dynamic_cast<const faiss::IndexHNSW*>(ivf->quantizer)) {
        check_hnsw(qh, qh->ntotal);
    }
    FAISS_THROW_IF_NOT_FMT(
            ivf->nprobe >= 1 && ivf->nprobe <= ivf->nlist,
            "read_index: IVF nprobe=%zd not in [1, nlist=%zd]",
            ivf->nprobe,
            ivf->nlist);
    auto lists = dynamic_cast<const faiss::ArrayInvertedLists*>(ivf->invlists);
    FAISS_THROW_IF_NOT_MSG(
            lists && lists->nlist == ivf->nlist && lists->code_size == ivf->code_size &&
                    lists->ids.size() == ivf->nlist && lists->codes.size() == ivf->nlist,
            "read_index: IVF inverted lists do not match the index");
    size_t total = 0;
    for (size_t l = 0; l < ivf->nlist; l++) {
        FAISS_THROW_IF_NOT_FMT(
                lists->codes[l].size() == lists->ids[l].size() * lists->code_size,
                "read_index: IVF list %zd has %zd ids but %zd code bytes",
                l,
                lists->ids[l].size(),
                lists->codes[l].size());
        for (idx_t id : lists->ids[l]) {
            FAISS_THROW_IF_NOT_FMT(
                    id >= 0 && id < ntotal,
                    "read_index: IVF list %zd holds id %zd out of [0, %zd)",
                    l,
                    size_t(id),
                    size_t(ntotal));
        }
        total += lists->ids[l].size();
    }
    FAISS_THROW_IF_NOT_FMT(
            total == size_t(ntotal),
            "read_index: IVF lists hold %zd ids for %zd vectors",
            total,
            size_t(ntotal));
    // each id once: a repeated id (and so a missing one) would be selected
    // twice and count twice in attention. Sized by the ids the file holds.
    std::vector<bool> seen(size_t(ntotal), false);
    for (size_t l = 0; l < ivf->nlist; l++) {
        for (idx_t id : lists->ids[l]) {
            FAISS_THROW_IF_NOT_FMT(
                    !seen[id], "read_index: IVF list %zd holds id %zd a second time", l, size_t(id));
            seen[id] = true;
        }
    }
}

void check_hnsw(const faiss::IndexHNSW* index, idx_t n) {
    const faiss::HNSW& h = index->hnsw;
    FAISS_THROW_IF_NOT_MSG(index->storage, "read_index: HNSW retriever has no storage");
    FAISS_THROW_IF_NOT_FMT(
            index->storage->ntotal == n && index->storage->d == index->d,
            "read_index: HNSW storage holds %zd vectors for %zd",
            size_t(index->storage->ntotal),
            size_t(n));
    if (auto f = dynamic_cast<const faiss::IndexFlatCodes*>(index->storage)) {
        check_flat_codes(f, n, "HNSW storage");
    }
    int n_levels = int(h.cum_nneighbor_per_level.size()) - 1;
    FAISS_THROW_IF_NOT_MSG(
            n_levels >= 1 && h.cum_nneighbor_per_level[0] == 0,
            "read_index: HNSW neighbour table is malformed");
    for (int l = 0; l < n_levels; l++) {
        FAISS_THROW_IF_NOT_MSG(
                h.cum_nneighbor_per_level[l + 1] >= h.cum_nneighbor_per_level[l],
                "read_index: HNSW neighbour counts decrease");
    }
    FAISS_THROW_IF_NOT_FMT(
            h.levels.size() == size_t(n) && h.offsets.size() == size_t(n) + 1 &&
                    h.offsets[0] == 0 && h.offsets.back() == h.neighbors.size(),
            "read_index: HNSW arrays do not match %zd vectors",
            size_t(n));
    FAISS_THROW_IF_NOT_FMT(
            h.efSearch >= 1 && h.efSearch <= kMaxEfSearch,
            "read_index: HNSW efSearch=%d out of range",
            h.efSearch);
    FAISS_THROW_IF_NOT_FMT(
            h.max_level >= -1 && h.max_level < n_levels && h.upper_beam >= 1 &&
                    h.upper_beam <= (1 << 20),
            "read_index: HNSW max_level=%d out of range",
            h.max_level);
    FAISS_THROW_IF_NOT_FMT(
            n == 0 ? h.entry_point == -1 : (h.entry_point >= 0 && h.entry_point < n),
            "read_index: HNSW entry point %d out of range",
            h.entry_point);
    for (idx_t i = 0; i < n; i++) {
        int lv = h.levels[i];
        FAISS_THROW_IF_NOT_FMT(
                lv >= 1 && lv - 1 <= h.max_level &&
                        h.offsets[i + 1] >= h.offsets[i] &&
                        h.offsets[i + 1] - h.offsets[i] == size_t(h.cum_nneighbor_per_level[lv]),
                "read_index: HNSW node %zd has a malformed neighbour list",
                size_t(i));
    }
    // Faiss's greedy descent reads the neighbours of the entry point from
    // max_level down, and of every node it reaches at level l its level-l
    // list: a node below that level has no such list and the read runs into
    // the next node's (or past the table).
    FAISS_THROW_IF_NOT_FMT(
            n == 0 || h.levels[h.entry_point] == h.max_level + 1,
            "read_index: HNSW entry point %d is not on the top level %d",
            h.entry_point,
            h.max_level);
    for (idx_t i = 0; i < n; i++) {
        for (int l = 0; l < h.levels[i]; l++) {
            size_t begin, end;
            h.neighbor_range(i, l, &begin, &end);
            for (size_t j = begin; j < end; j++) {
                int nb = h.neighbors[j];
                FAISS_THROW_IF_NOT_FMT(
                        nb >= -1 && nb < n && (nb == -1 || h.levels[nb] > l),
                        "read_index: HNSW node %zd: neighbour %d is not a node of level %d",
                        size_t(i),
                        nb,
                        l);
            }
        }
    }
}

/// The family of a Faiss index, as far as these checks care (Faiss reads a
/// "Flat" built by index_factory back as the subclass IndexFlatIP).
int family(const faiss::Index* index) {
    if (dynamic_cast<const faiss::IndexIVF*>(index)) {
        return 1;
    }
    if (dynamic_cast<const faiss::IndexHNSW*>(index)) {
        return 2;
    }
    if (dynamic_cast<const faiss::IndexFlatCodes*>(index)) {
        return 3;
    }
    return 0;
}

/// "PQ<M>[x<nbits>]" in a retriever string: M is group 1, nbits group 3
/// (8 when absent).
const std::regex& product_quantizer_spec() {
    static const std::regex pq("PQ([0-9]+)(x([0-9]+))?");
    return pq;
}

} // namespace

void check_retriever_string(const std::string& s, int d, int64_t max_lists) {
    static const std::regex ivf("IVF([0-9]+)"), imi("IMI([0-9]+)x([0-9]+)"),
            hnsw("HNSW([0-9]+)");
    const std::regex& pq = product_quantizer_spec();
    auto number = [&](const std::string& digits) {
        // more than 9 digits is out of every bound below
        return digits.size() > 9 ? int64_t(1) << 40 : std::stoll(digits);
    };
    auto fail = [&](const std::string& what) {
        FAISS_THROW_FMT("TopK(%s): %s", s.c_str(), what.c_str());
    };
    std::smatch m;
    for (auto it = std::sregex_iterator(s.begin(), s.end(), ivf); it != std::sregex_iterator(); ++it) {
        int64_t nlist = number((*it)[1]);
        if (nlist < 1 || nlist > max_lists) {
            fail("IVF" + (*it)[1].str() + ": the number of lists must be in [1, " +
                 std::to_string(max_lists) + "] (at most the keys it trains on)");
        }
    }
    if (std::regex_search(s, m, imi)) {
        int64_t a = number(m[1]), b = number(m[2]);
        if (a < 1 || b < 1 || a * b > 40 || (int64_t(1) << (a * b)) > max_lists) {
            fail("IMI" + m[1].str() + "x" + m[2].str() + ": 2^(" + m[1].str() + "*" + m[2].str() +
                 ") lists, more than the " + std::to_string(max_lists) + " keys it trains on");
        }
    }
    for (auto it = std::sregex_iterator(s.begin(), s.end(), hnsw); it != std::sregex_iterator(); ++it) {
        int64_t M = number((*it)[1]);
        if (M < 2 || M > 256) {
            fail("HNSW" + (*it)[1].str() + ": M must be in [2, 256]");
        }
    }
    for (auto it = std::sregex_iterator(s.begin(), s.end(), pq); it != std::sregex_iterator(); ++it) {
        int64_t M = number((*it)[1]);
        int64_t nbits = (*it)[3].matched ? number((*it)[3]) : 8;
        if (M < 1 || M > d || d % M != 0 || nbits < 1 || nbits > 16) {
            fail((*it)[0].str() + ": PQ needs M dividing d=" + std::to_string(d) +
                 " and 1 to 16 bits");
        }
    }
}

namespace {

/// The largest f(M, nbits) over the product quantizers of a retriever
/// string past check_retriever_string (nbits in [1, 16]), 0 without one.
template <class F>
int64_t most_over_product_quantizers(const std::string& s, F f) {
    const std::regex& pq = product_quantizer_spec();
    int64_t most = 0;
    for (auto it = std::sregex_iterator(s.begin(), s.end(), pq); it != std::sregex_iterator(); ++it) {
        int64_t nbits = (*it)[3].matched ? std::stoll((*it)[3].str()) : 8;
        FAISS_THROW_IF_NOT_FMT(nbits >= 1 && nbits <= 16, "TopK(%s): PQ bits must be 1 to 16", s.c_str());
        most = std::max(most, f(std::stoll((*it)[1].str()), nbits));
    }
    return most;
}

} // namespace

int64_t product_quantizer_centroids(const std::string& s) {
    return most_over_product_quantizers(s, [](int64_t, int64_t nbits) { return int64_t(1) << nbits; });
}

int64_t product_quantizer_work(const std::string& s) {
    return most_over_product_quantizers(s, [](int64_t M, int64_t nbits) { return M << nbits; });
}

namespace {

/// What check_faiss_retriever compares a read retriever with: the index
/// faiss::index_factory builds from its string, untrained.
struct FreshRetriever {
    int family = 0;
    std::type_index type = typeid(void);
    size_t nlist = 0;     ///< IVF only
    size_t code_size = 0; ///< IVF only
};

/// The fresh retriever of (d, string), built once per process (up to 256
/// at a time): Faiss's factory compiles its regular expressions at every
/// call, and every read of a TopK checks one.
FreshRetriever fresh_retriever_of(int d, const std::string& factory_string) {
    static std::mutex mutex;
    static std::map<std::pair<int, std::string>, FreshRetriever> built;
    const auto key = std::make_pair(d, factory_string);
    {
        std::lock_guard<std::mutex> lock(mutex);
        auto it = built.find(key);
        if (it != built.end()) {
            return it->second;
        }
    }
    std::unique_ptr<faiss::Index> fresh(
            faiss::index_factory(d, factory_string.c_str(), faiss::METRIC_INNER_PRODUCT));
    FreshRetriever f;
    f.family = family(fresh.get());
    const faiss::Index& fresh_index = *fresh;  // (typeid of a plain reference: no side effect)
    f.type = typeid(fresh_index);
    if (auto ivf = dynamic_cast<const faiss::IndexIVF*>(fresh.get())) {
        f.nlist = ivf->nlist;
        f.code_size = ivf->code_size;
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (built.size() >= 256) {
        built.clear(); // forged files of many strings keep it bounded
    }
    built.emplace(key, f);
    return f;
}

} // namespace

void check_faiss_retriever(
        const faiss::Index* ret,
        const std::string& factory_string,
        int d,
        idx_t ntotal) {
    FAISS_THROW_IF_NOT_MSG(ret, "read_index: retriever missing");
    const FreshRetriever fresh = fresh_retriever_of(d, factory_string);
    FAISS_THROW_IF_NOT_FMT(
            fresh.family == family(ret) &&
                    (family(ret) != 0 || fresh.type == std::type_index(typeid(*ret))) && ret->d == d &&
                    ret->metric_type == faiss::METRIC_INNER_PRODUCT && ret->ntotal == ntotal,
            "read_index: retriever is not a %s of d=%d with %zd vectors",
            factory_string.c_str(),
            d,
            size_t(ntotal));
    if (auto f = dynamic_cast<const faiss::IndexFlatCodes*>(ret)) {
        check_flat_codes(f, ntotal, "Flat retriever");
    }
    if (auto ivf = dynamic_cast<const faiss::IndexIVF*>(ret)) {
        FAISS_THROW_IF_NOT_FMT(
                ivf->nlist == fresh.nlist && ivf->code_size == fresh.code_size,
                "read_index: IVF retriever has nlist=%zd, its string says %zd",
                ivf->nlist,
                fresh.nlist);
        if (ivf->is_trained) {
            check_ivf(ivf, ntotal);
        }
    }
    if (auto hnsw = dynamic_cast<const faiss::IndexHNSW*>(ret)) {
        check_hnsw(hnsw, ntotal);
    }
}

} // namespace kvindex
