// Exact top-k by inner product for many queries at once: blocks of scores
// by BLAS (one sgemm per block pair), each query's running selection fed
// from its row of the block. Used where a per-query scan would read the
// keys once per query (RoarGraph's training lists).

#include <kvindex/IndexRoarGraph.h>

#include <algorithm>
#include <limits>
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

// best first: larger score, then smaller id
inline bool better(const Scored& a, const Scored& b) {
    return a.score > b.score || (a.score == b.score && a.id < b.id);
}

/** The k best of a stream of scored keys fed in descending id order.
 * Candidates pile up in a buffer and are cut back to the k best by
 * nth_element when it holds 2k: linear in the keys whatever their order,
 * where a heap pays a log k replacement for each key that improves on the
 * k-th. The keys come last first because an attention query's scores grow
 * along the context (RoPE, recency): the recent keys set a high bar at
 * once and most older ones fall below it, instead of each recent key
 * improving on the one before. Once k are kept, a key must reach the k-th
 * score: its id is smaller than every kept one, so it wins a tie. */
class RunningTopK {
  public:
    explicit RunningTopK(size_t k) : k_(k) {
        kept_.reserve(2 * k);
    }
    /// Scores s[j] of keys id0 + j, j < n, offered from the last.
    void offer(const float* s, size_t n, idx_t id0) {
        for (size_t j = n; j-- > 0;) {
            if (s[j] >= bar_) {
                kept_.push_back({s[j], id0 + idx_t(j)});
                if (kept_.size() == 2 * k_) {
                    cut();
                }
            }
        }
    }
    /// The k best, best first, into out (size k_out >= k, -1 padded).
    void write(idx_t* out, size_t k_out) {
        if (kept_.size() > k_) {
            cut();
        }
        std::sort(kept_.begin(), kept_.end(), better);
        for (size_t j = 0; j < k_out; j++) {
            out[j] = j < kept_.size() ? kept_[j].id : -1;
        }
    }

  private:
    void cut() {
        std::nth_element(kept_.begin(), kept_.begin() + (k_ - 1), kept_.end(), better);
        kept_.resize(k_);
        bar_ = kept_[k_ - 1].score;
    }
    size_t k_;
    std::vector<Scored> kept_;
    float bar_ = -std::numeric_limits<float>::infinity();
};

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
        std::vector<RunningTopK> best(nq, RunningTopK(kk));
        // the blocks last first (RunningTopK)
        for (idx_t kb = (n_keys + kKeyBlock - 1) / kKeyBlock; kb-- > 0;) {
            idx_t k0 = kb * kKeyBlock;
            int nk = int(std::min(kKeyBlock, n_keys - k0));
            // scores (row-major nq x nk) = queries_block * keys_block^T
            gemm_abt(nq, nk, d, queries + q0 * d, d, keys + k0 * d, d, scores.data(), nk);
            for (int i = 0; i < nq; i++) {
                best[i].offer(scores.data() + size_t(i) * nk, size_t(nk), k0);
            }
        }
        for (int i = 0; i < nq; i++) {
            best[i].write(out + (q0 + i) * n_neighbors, size_t(n_neighbors));
        }
    });
}

} // namespace kvindex
