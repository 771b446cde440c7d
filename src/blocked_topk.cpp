// Exact top-k by inner product for many queries at once: blocks of scores
// by BLAS (one sgemm per block pair), each query's running selection fed
// from its row of the block. Used where a per-query scan would read the
// keys once per query (RoarGraph's training lists).

#include <kvindex/IndexRoarGraph.h>

#include <algorithm>
#include <vector>

#include <faiss/impl/FaissAssert.h>

#include "blas.h"
#include "parallel.h"

namespace kvindex {

namespace {

constexpr idx_t kQueryBlock = 64;   // queries per task
constexpr idx_t kKeyBlock = 4096;   // keys per sgemm: 64 x 4096 scores = 1 MiB

struct Scored {
    float score;
    idx_t id;
};

// heap order: the worst kept on top (smaller score, then larger id)
inline bool better(const Scored& a, const Scored& b) {
    return a.score > b.score || (a.score == b.score && a.id < b.id);
}

} // namespace

void exact_topk_blocked(
        const float* keys,
        idx_t n_keys,
        int d,
        const float* queries,
        idx_t n_queries,
        int n_neighbors,
        idx_t* out) {
    FAISS_THROW_IF_NOT_FMT(
            n_keys >= 0 && n_queries >= 0 && d > 0 && n_neighbors > 0,
            "exact_topk_blocked: n_keys=%zd n_queries=%zd d=%d n_neighbors=%d",
            size_t(n_keys),
            size_t(n_queries),
            d,
            n_neighbors);
    FAISS_THROW_IF_NOT_FMT(
            n_keys < (idx_t(1) << 31), "exact_topk_blocked: %zd keys exceed BLAS's int",
            size_t(n_keys));
    size_t kk = size_t(std::min<idx_t>(n_neighbors, n_keys));
    idx_t n_blocks = (n_queries + kQueryBlock - 1) / kQueryBlock;
    parallel_for(n_blocks, [&](idx_t b) {
        idx_t q0 = b * kQueryBlock;
        int nq = int(std::min(kQueryBlock, n_queries - q0));
        std::vector<float> scores(size_t(nq) * kKeyBlock);
        std::vector<std::vector<Scored>> heaps(nq);
        for (auto& h : heaps) {
            h.reserve(kk);
        }
        for (idx_t k0 = 0; k0 < n_keys; k0 += kKeyBlock) {
            int nk = int(std::min(kKeyBlock, n_keys - k0));
            // scores (row-major nq x nk) = queries_block * keys_block^T
            gemm_abt(nq, nk, d, queries + q0 * d, d, keys + k0 * d, d, scores.data(), nk);
            for (int i = 0; i < nq; i++) {
                std::vector<Scored>& h = heaps[i];
                const float* s = scores.data() + size_t(i) * nk;
                for (int j = 0; j < nk; j++) {
                    Scored c{s[j], k0 + j};
                    if (h.size() < kk) {
                        h.push_back(c);
                        std::push_heap(h.begin(), h.end(), better);
                    } else if (c.score > h.front().score) {
                        // ids ascend: an equal score is never better
                        std::pop_heap(h.begin(), h.end(), better);
                        h.back() = c;
                        std::push_heap(h.begin(), h.end(), better);
                    }
                }
            }
        }
        for (int i = 0; i < nq; i++) {
            std::vector<Scored>& h = heaps[i];
            std::sort(h.begin(), h.end(), better);
            idx_t* row = out + (q0 + i) * n_neighbors;
            for (int j = 0; j < n_neighbors; j++) {
                row[j] = size_t(j) < h.size() ? h[j].id : -1;
            }
        }
    });
}

} // namespace kvindex
