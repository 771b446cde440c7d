#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>
#include <kvindex/QModel.h>

namespace kvindex {

/** What SAAP trains per (layer, KV head) and how (saap.txt §4, Appendix A),
 * with defaults sized for a 2-core machine and 8k-token prompts. */
/// largest IVFAsymTrainingParams::kmeans_points_per_centroid (Faiss's
/// k-means takes an int)
constexpr idx_t kMaxKmeansPointsPerCentroid = idx_t(1) << 30;

struct IVFAsymTrainingParams {
    int n_centroids = 64;      ///< C, the buckets
    int hidden = 256;          ///< width of the Q-model's hidden layer (the paper: 1024)
    int kmeans_iterations = 10;
    /// k-means runs on at most this many keys per centroid (Faiss's own
    /// cap), at most kMaxKmeansPointsPerCentroid
    idx_t kmeans_points_per_centroid = 256;
    /** Long range: a training query is kept only when its best key (sinks
     * excluded) is more than min_distance tokens back, and its target is the
     * attention mass of the keys more than min_distance back, per bucket.
     * The paper uses 1024 with a 1+2047 static part at 100k-500k tokens;
     * we take the window of the chain (keys closer than that are read
     * exactly and never in a bucket): 511 for Sink1,Window511 at 8k. */
    idx_t min_distance = 511;
    idx_t n_sink = 1;          ///< first tokens of each prompt left out (the attention sink)
    /// candidate queries drawn per prompt (from all heads of the group)
    idx_t queries_per_prompt = 1024;
    /** The question: every query at the prompt's last recent_positions
     * positions is a candidate too (besides the uniform draw from the
     * others, at most queries_per_prompt of them), its row counted
     * recent_weight times. Decode queries resemble the prompt's last
     * queries (the question it ends with) more than its bulk, which a
     * uniform draw is made of; self-training at prefill (IndexIVFAsym)
     * uses 128 and 8. 0: a uniform draw only. */
    idx_t recent_positions = 0;
    int recent_weight = 1;
    idx_t max_samples = 32768; ///< training rows kept at most (reservoir sample)
    double held_out_fraction = 0.1; ///< rows kept aside to measure the loss
    QModelTrainParams adam;    ///< Adam steps, batch, learning rate, seed
    uint64_t seed = 1234;      ///< query sampling, k-means, initialization
};

/// What a training run did, for logs and RESULTS.
struct IVFAsymTrainingReport {
    idx_t n_prompts = 0;
    idx_t n_keys = 0;             ///< keys seen (sinks excluded)
    idx_t n_candidates = 0;       ///< queries drawn
    idx_t n_long_range = 0;       ///< of which long range (training rows before the cap)
    idx_t n_train = 0, n_held = 0;
    double kmeans_seconds = 0, targets_seconds = 0, qmodel_seconds = 0;
    std::vector<QModelLossPoint> curve; ///< the Q-model's loss curve
    /// mean held-out KL of the model before its first step
    double initial_held_out_loss = 0;
};

/** SAAP's key assignment, the same at training and at prefill: the bucket
 * of each of n post-RoPE keys at positions first_position + i is the
 * nearest centroid (L2, as k-means assigns; ties to the smaller index) of
 * the key rotated back to position 0.
 * @param keys       size n * d
 * @param centroids  size n_centroids * d (de-RoPEd key space)
 * @param out        size n
 */
void assign_keys_to_buckets(
        const float* keys,
        idx_t n,
        int d,
        idx_t first_position,
        const RopeParams& rope,
        const float* centroids,
        int n_centroids,
        int32_t* out);

/** Trains the two models of an IndexIVFAsym from the tokens of training
 * prompts: k-means on de-RoPEd keys (Faiss, random initialization), then
 * the Q-model on long-range queries (QModel.h).
 *
 * Feed prompts with add_prompt (keys post-RoPE at positions first_position
 * + i, the queries of the GQA group with their positions, the RoPE
 * parameters: a PrefillInput), then call train. The k-means sample is the
 * keys of the first prompts (kmeans_points_per_centroid * C of them,
 * seeded): prompts fed before it is full are kept until k-means has run,
 * later ones are turned into training rows at once and dropped, so memory
 * stays bounded over any number of prompts. Deterministic by seed for a
 * given sequence of prompts; single-threaded (train heads in parallel).
 */
class IVFAsymTrainer {
   public:
    IVFAsymTrainer(int d, const IVFAsymTrainingParams& params);

    /// Adds one training prompt (n_tokens >= 1, queries optional).
    void add_prompt(const PrefillInput& prompt);

    /** Runs what remains (k-means if the sample never filled, the targets
     * of the kept prompts, the Q-model) and returns the report. Throws if
     * fewer than C keys were seen; the Q-model is left empty (and
     * `qmodel_trained()` false) with fewer than 16 long-range queries. */
    const IVFAsymTrainingReport& train(
            const std::function<void(const QModelLossPoint&)>& progress = nullptr);

    int d;
    IVFAsymTrainingParams params;
    RopeParams rope;                ///< of the prompts (all must agree)
    std::vector<float> centroids;   ///< size C * d, after k-means
    QModel qmodel;                  ///< after train
    IVFAsymTrainingReport report;

    /// Training rows kept so far (long-range queries with their targets).
    idx_t n_rows() const {
        return idx_t(rows_x_.size() / d);
    }
    bool qmodel_trained() const {
        return !qmodel.empty();
    }

   private:
    /// A prompt kept until k-means has run: its keys and the drawn queries.
    struct PendingPrompt {
        idx_t first_position = 0;
        std::vector<float> keys;        ///< post-RoPE, n * d
        std::vector<float> queries;     ///< the drawn candidates, post-RoPE
        std::vector<idx_t> positions;   ///< their positions
        std::vector<int> weights;       ///< the times each one's row counts
    };
    std::vector<PendingPrompt> pending_;   ///< prompts waiting for k-means
    std::vector<float> kmeans_sample_;     ///< de-RoPEd keys
    std::vector<float> rows_x_;            ///< training rows: de-RoPEd queries
    std::vector<float> rows_t_;            ///< their targets, size C each
    idx_t rows_seen_ = 0;                  ///< long-range rows offered to the reservoir
    uint64_t rng_state_;
    bool has_rope_ = false;

    void run_kmeans();
    void make_rows(const PendingPrompt& p);
};

} // namespace kvindex
