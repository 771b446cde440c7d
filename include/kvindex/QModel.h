#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <kvindex/KVIndex.h>

namespace kvindex {

/** SAAP's query classifier ("Inference-time sparse attention with
 * asymmetric indexing", arXiv 2502.08246, §4 and Appendix A): an MLP
 * d -> hidden -> n_classes with batch normalization and ReLU after the
 * first layer and a softmax output,
 *
 *   h = ReLU(BN(W1 x)),  f(x) = softmax(W2 h + b2),
 *
 * trained with Adam on the mean over a batch of KL(t || f(x)), where t is
 * the attention mass of query x per bucket (IndexIVFAsym). W1 has no bias:
 * batch normalization subtracts it right away. Training normalizes with
 * the batch's statistics and keeps running ones, which inference uses.
 * Everything is float32; matrices are row-major.
 */
struct QModel {
    int d = 0;          ///< input dimension (the head dimension)
    int hidden = 0;     ///< width of the hidden layer (the paper: 1024)
    int n_classes = 0;  ///< outputs (the buckets)
    float bn_eps = 1e-5f;     ///< added to the variance in batch normalization
    float bn_momentum = 0.1f; ///< running = (1 - m) running + m batch

    std::vector<float> w1;       ///< size hidden * d
    std::vector<float> bn_gamma; ///< size hidden
    std::vector<float> bn_beta;  ///< size hidden
    std::vector<float> bn_mean;  ///< size hidden, running mean (inference)
    std::vector<float> bn_var;   ///< size hidden, running variance (inference)
    std::vector<float> w2;       ///< size n_classes * hidden
    std::vector<float> b2;       ///< size n_classes

    QModel() = default;
    /// Random initialization (He for W1, Glorot for W2, gamma 1, beta 0,
    /// b2 0, running mean 0 and variance 1), deterministic by seed.
    QModel(int d, int hidden, int n_classes, uint64_t seed);

    bool empty() const {
        return n_classes == 0;
    }

    /** Inference (running statistics): log f(x) of n inputs.
     * @param x    size n * d
     * @param out  size n * n_classes, log-probabilities
     */
    void log_probs(idx_t n, const float* x, float* out) const;

    /// Multiply-adds of one inference, for Selection::n_scanned.
    size_t flops_per_query() const {
        return size_t(d) * hidden + size_t(hidden) * n_classes;
    }

    size_t memory_bytes() const;
    void write(BufferWriter& w) const;
    /// Reads what write wrote; throws naming the first inconsistent field.
    void read(BufferReader& r);
    /// Throws unless the arrays have the sizes the dimensions say and
    /// every value is finite (variances > 0).
    void check() const;
};

/// Gradients of the training loss, one array per parameter of QModel.
struct QModelGradients {
    std::vector<float> w1, bn_gamma, bn_beta, w2, b2;
};

/** Training-mode forward and backward on one batch: the mean over the n
 * rows of KL(t_i || f(x_i)), batch normalization with the batch's
 * statistics (biased variance). Returns the loss; fills grad (resized)
 * when not nullptr. The model is not changed (running statistics
 * included). Needs n >= 2.
 *
 * @param x        size n * d
 * @param targets  size n * n_classes, rows >= 0 summing to 1
 */
double qmodel_loss(const QModel& m, idx_t n, const float* x, const float* targets, QModelGradients* grad);

/// Inference-mode mean KL(t_i || f(x_i)) over n rows (held-out loss).
double qmodel_eval_loss(const QModel& m, idx_t n, const float* x, const float* targets);

struct QModelTrainParams {
    int iterations = 2000;        ///< Adam steps
    int batch_size = 256;         ///< rows per step, sampled without replacement per epoch
    float learning_rate = 1e-3f;  ///< Adam step size (the paper: 1e-5 over 40k steps)
    float beta1 = 0.9f;
    float beta2 = 0.999f;
    float adam_eps = 1e-8f;
    uint64_t seed = 1234;         ///< order of the rows
    int eval_every = 100;         ///< steps between two points of the loss curve
    /// with held-out rows: end with the weights of the curve's point of
    /// lowest held-out loss (early stopping; the small heads over-fit)
    bool keep_best = true;
};

/// Throws, with messages starting with `what`, unless train_qmodel can run
/// with p (batch of 2 or more, Adam's rate and epsilon finite and > 0,
/// betas in [0, 1)).
void check_qmodel_train_params(const QModelTrainParams& p, const char* what);

/// One point of a training run's loss curve.
struct QModelLossPoint {
    int iteration;
    double train_loss;    ///< mean of the batch losses since the previous point
    double held_out_loss; ///< qmodel_eval_loss on the held-out rows (NaN if none)
};

/** Trains m with Adam on rows (x, targets), evaluating on the held-out
 * rows every eval_every steps; updates the running statistics. Single
 * threaded (BLAS with one thread: train heads in parallel), deterministic
 * by seed. With keep_best and held-out rows, m ends as the curve's point of
 * lowest held-out loss. `progress`, if set, is called with each point of the curve.
 *
 * @param x, targets              n rows, as in qmodel_loss
 * @param held_x, held_targets    n_held rows (may be 0)
 */
std::vector<QModelLossPoint> train_qmodel(
        QModel& m,
        idx_t n,
        const float* x,
        const float* targets,
        idx_t n_held,
        const float* held_x,
        const float* held_targets,
        const QModelTrainParams& params,
        const std::function<void(const QModelLossPoint&)>& progress = nullptr);

} // namespace kvindex
