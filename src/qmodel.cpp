// SAAP's query classifier (QModel.h): d -> hidden -> n_classes with batch
// normalization and ReLU, trained with Adam on KL(targets || softmax).
// Matrix products go through BLAS; the loss and the batch statistics
// accumulate in double. No OpenMP in here: callers train one head per thread.

#include <kvindex/QModel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/impl/io.h>
#include <kvindex/kernels.h>

#include "blas.h"
#include "checks.h"

namespace kvindex {

namespace {

constexpr int kMaxDim = 1 << 20;
constexpr size_t kMaxMatrix = size_t(1) << 28;
// rows per inference block: bounds the scratch memory of log_probs
constexpr idx_t kInferBlock = 256;
constexpr idx_t kRowwiseBelow = 4; // fewer rows: inference without BLAS
// BLAS takes int dimensions; a training batch must fit
constexpr idx_t kMaxBatch = idx_t(1) << 30;

// Row-major C (m x n) = op(A) op(B), op(A) m x k: blas.h's gemm_abt and
// the two other forms backpropagation needs. Column-major BLAS sees
// every row-major matrix transposed, so it computes C^T = op(B)^T op(A)^T:
// the operands swap and the transposition flags stay.
void gemm(bool ta, bool tb, int m, int n, int k,
          const float* a, int lda, const float* b, int ldb, float* c) {
    float one = 1, zero = 0;
    sgemm_(tb ? "T" : "N", ta ? "T" : "N", &n, &m, &k, &one, b, &ldb, a, &lda, &zero, c, &n);
}

void check_dims(int d, int hidden, int n_classes, const char* who) {
    FAISS_THROW_IF_NOT_FMT(d > 0 && d <= kMaxDim, "%s: d = %d is not in [1, %d]", who, d, kMaxDim);
    FAISS_THROW_IF_NOT_FMT(hidden > 0 && hidden <= kMaxDim,
                           "%s: hidden = %d is not in [1, %d]", who, hidden, kMaxDim);
    FAISS_THROW_IF_NOT_FMT(n_classes > 0 && n_classes <= kMaxDim,
                           "%s: n_classes = %d is not in [1, %d]", who, n_classes, kMaxDim);
    FAISS_THROW_IF_NOT_FMT(size_t(hidden) * d <= kMaxMatrix && size_t(n_classes) * hidden <= kMaxMatrix,
                           "%s: hidden * d = %d * %d or n_classes * hidden = %d * %d exceeds %zd",
                           who, hidden, d, n_classes, hidden, kMaxMatrix);
}

// The arrays of a model, in the order write() stores them
const struct {
    std::vector<float> QModel::*v;
    const char* name;
} kArrays[] = {{&QModel::w1, "w1"},     {&QModel::bn_gamma, "bn_gamma"}, {&QModel::bn_beta, "bn_beta"},
               {&QModel::bn_mean, "bn_mean"}, {&QModel::bn_var, "bn_var"},     {&QModel::w2, "w2"},
               {&QModel::b2, "b2"}};

// The size the dimensions give to kArrays[k]
size_t expected_size(const QModel& m, int k) {
    size_t H = m.hidden;
    return k == 0 ? H * m.d : k == 5 ? size_t(m.n_classes) * H : k == 6 ? size_t(m.n_classes) : H;
}

// Sizes only, in constant time: what every API entry can afford (check()
// also scans the values)
void check_sizes(const QModel& m, const char* who) {
    for (int k = 0; k < 7; k++) {
        size_t size = (m.*kArrays[k].v).size();
        FAISS_THROW_IF_NOT_FMT(size == expected_size(m, k), "%s: %s has %zd elements, expected %zd", who,
                               kArrays[k].name, size, expected_size(m, k));
    }
}

void check_usable(const QModel& m) {
    FAISS_THROW_IF_NOT_MSG(!m.empty(), "QModel: the model is empty (not initialized)");
    check_sizes(m, "QModel");
}

void check_x(idx_t n, const float* x, int d, const char* what) {
    FAISS_THROW_IF_NOT_FMT(n >= 0 && (n == 0 || x), "QModel: %s: n = %zd rows, pointer %p", what, size_t(n), x);
    // the library's bound on its inputs, doubled: the Q-model reads queries
    // rotated back to position 0, whose entries a rotation can grow by sqrt 2
    const std::string w = std::string("QModel: ") + what;
    check_bounded(x, n, d, w.c_str(), 2 * kMaxInputMagnitude);
}

// The gradient (f - t) / n and KL itself assume distributions; the
// tolerance on the sum admits float rounding of attention masses.
void check_targets(idx_t n, const float* t, int C, const char* what) {
    FAISS_THROW_IF_NOT_FMT(n == 0 || t, "QModel: %s is null", what);
    for (idx_t i = 0; i < n; i++) {
        double s = 0;
        for (int c = 0; c < C; c++) {
            float v = t[i * C + c];
            FAISS_THROW_IF_NOT_FMT(std::isfinite(v) && v >= 0, "QModel: row %zd of %s has a %s value (%g)",
                                   size_t(i), what, std::isfinite(v) ? "negative" : "non-finite", v);
            s += v;
        }
        FAISS_THROW_IF_NOT_FMT(std::abs(s - 1) <= 1e-3, "QModel: row %zd of %s sums to %g, not 1",
                               size_t(i), what, s);
    }
}

// Turns rows of logits (W2 h, bias not yet added) into log-probabilities,
// with the log-sum-exp in double.
void log_softmax_rows(const QModel& m, idx_t n, float* rows) {
    int C = m.n_classes;
    for (idx_t i = 0; i < n; i++) {
        float* r = rows + i * C;
        double mx = -std::numeric_limits<double>::infinity();
        for (int c = 0; c < C; c++) {
            r[c] += m.b2[c];
            mx = std::max(mx, double(r[c]));
        }
        double s = 0;
        for (int c = 0; c < C; c++) {
            s += std::exp(r[c] - mx);
        }
        double lse = mx + std::log(s);
        for (int c = 0; c < C; c++) {
            r[c] = float(r[c] - lse);
        }
    }
}

// Sum over rows of KL(t || f), 0 log 0 = 0.
double kl_sum(idx_t n, int C, const float* logp, const float* t) {
    double sum = 0;
    for (idx_t k = 0; k < n * C; k++) {
        if (t[k] > 0) {
            sum += double(t[k]) * (std::log(double(t[k])) - double(logp[k]));
        }
    }
    return sum;
}

// Inference forward of n <= kInferBlock rows into out (log-probabilities);
// z is scratch of kInferBlock * hidden floats.
void infer_block(const QModel& m, idx_t n, const float* x, float* out, float* z) {
    int H = m.hidden;
    // a decode step classifies one query (or a GQA group's few): there a
    // BLAS call costs more than its d * H multiply-adds, and the SIMD
    // dot-product kernel (kernels.h) does them row by row
    const bool rowwise = n < kRowwiseBelow;
    if (rowwise) {
        for (idx_t i = 0; i < n; i++) {
            inner_products_scaled(x + i * m.d, m.w1.data(), size_t(m.d), size_t(H), 1.0f, z + i * H);
        }
    } else {
        gemm(false, true, int(n), H, m.d, x, m.d, m.w1.data(), m.d, z);
    }
    // batch normalization with running statistics folds into one affine map
    std::vector<float> scale(H), shift(H);
    for (int j = 0; j < H; j++) {
        scale[j] = m.bn_gamma[j] / std::sqrt(m.bn_var[j] + m.bn_eps);
        shift[j] = m.bn_beta[j] - m.bn_mean[j] * scale[j];
    }
    for (idx_t i = 0; i < n; i++) {
        for (int j = 0; j < H; j++) {
            z[i * H + j] = std::max(z[i * H + j] * scale[j] + shift[j], 0.0f);
        }
    }
    if (rowwise) {
        for (idx_t i = 0; i < n; i++) {
            inner_products_scaled(z + i * H, m.w2.data(), size_t(H), size_t(m.n_classes), 1.0f,
                                  out + i * m.n_classes);
        }
    } else {
        gemm(false, true, int(n), m.n_classes, H, z, H, m.w2.data(), H, out);
    }
    log_softmax_rows(m, n, out);
}

double eval_loss_unchecked(const QModel& m, idx_t n, const float* x, const float* t) {
    std::vector<float> z(size_t(kInferBlock) * m.hidden), logp(size_t(kInferBlock) * m.n_classes);
    double sum = 0;
    for (idx_t i0 = 0; i0 < n; i0 += kInferBlock) {
        idx_t nb = std::min(kInferBlock, n - i0);
        infer_block(m, nb, x + i0 * m.d, logp.data(), z.data());
        sum += kl_sum(nb, m.n_classes, logp.data(), t + i0 * m.n_classes);
    }
    return sum / n;
}

/// Activations of one training batch, kept for the backward pass.
struct Batch {
    std::vector<float> xhat;       // n x hidden, normalized W1 x
    std::vector<float> h;          // n x hidden, ReLU output: h > 0 is the mask
    std::vector<float> logp;       // n x C, log-probabilities, then d loss / d logits
    std::vector<float> gh;         // n x hidden, d loss / d h, then d loss / d (W1 x)
    std::vector<double> mean, var; // batch statistics (biased variance)
    std::vector<float> inv_std;
};

// Training-mode forward: batch statistics, loss (mean KL) returned.
double forward_train(const QModel& m, idx_t n, const float* x, const float* t, Batch& b) {
    int H = m.hidden;
    b.xhat.resize(size_t(n) * H);
    b.h.resize(size_t(n) * H);
    b.logp.resize(size_t(n) * m.n_classes);
    b.mean.assign(H, 0);
    b.var.assign(H, 0);
    b.inv_std.resize(H);
    float* z = b.xhat.data();
    gemm(false, true, int(n), H, m.d, x, m.d, m.w1.data(), m.d, z);
    // two passes in double: the variance of float activations without cancellation
    for (idx_t i = 0; i < n; i++) {
        for (int j = 0; j < H; j++) {
            b.mean[j] += z[i * H + j];
        }
    }
    for (int j = 0; j < H; j++) {
        b.mean[j] /= n;
    }
    for (idx_t i = 0; i < n; i++) {
        for (int j = 0; j < H; j++) {
            double c = z[i * H + j] - b.mean[j];
            b.var[j] += c * c;
        }
    }
    for (int j = 0; j < H; j++) {
        b.var[j] /= n;
        b.inv_std[j] = float(1 / std::sqrt(b.var[j] + m.bn_eps));
    }
    for (idx_t i = 0; i < n; i++) {
        for (int j = 0; j < H; j++) {
            size_t k = size_t(i) * H + j;
            z[k] = float((z[k] - b.mean[j]) * b.inv_std[j]);
            b.h[k] = std::max(m.bn_gamma[j] * z[k] + m.bn_beta[j], 0.0f);
        }
    }
    gemm(false, true, int(n), m.n_classes, H, b.h.data(), H, m.w2.data(), H, b.logp.data());
    log_softmax_rows(m, n, b.logp.data());
    return kl_sum(n, m.n_classes, b.logp.data(), t) / n;
}

// Backward of forward_train, batch normalization through the batch
// statistics included.
void backward(const QModel& m, idx_t n, const float* x, const float* t, Batch& b, QModelGradients& g) {
    int H = m.hidden, C = m.n_classes;
    g.w1.resize(m.w1.size());
    g.w2.resize(m.w2.size());
    std::vector<double> gb2(C, 0), gbeta(H, 0), ggamma(H, 0);
    // d KL(t || softmax(l)) / d l = f sum(t) - t: (f - t) / n for the mean over rows
    float* gl = b.logp.data();
    for (idx_t i = 0; i < n; i++) {
        double s = 0;
        for (int c = 0; c < C; c++) {
            s += t[i * C + c];
        }
        for (int c = 0; c < C; c++) {
            size_t k = size_t(i) * C + c;
            gl[k] = float((s * std::exp(gl[k]) - t[k]) / n);
            gb2[c] += gl[k];
        }
    }
    gemm(true, false, C, H, int(n), gl, C, b.h.data(), H, g.w2.data());
    b.gh.resize(size_t(n) * H);
    float* gh = b.gh.data();
    gemm(false, false, int(n), H, C, gl, C, m.w2.data(), H, gh);
    double* gbe = gbeta.data(); // plain pointers: the loop vectorizes over j
    double* gga = ggamma.data();
    for (idx_t i = 0; i < n; i++) {
        float* gr = gh + i * H;
        const float* hr = b.h.data() + i * H;
        const float* xr = b.xhat.data() + i * H;
        for (int j = 0; j < H; j++) { // through the ReLU, as a select (no branch)
            gr[j] = hr[j] > 0 ? gr[j] : 0.0f;
        }
        for (int j = 0; j < H; j++) {
            gbe[j] += gr[j];
            gga[j] += double(gr[j]) * xr[j];
        }
    }
    // z -> xhat through the batch's mean and variance:
    // dz = gamma inv_std (da - mean(da) - xhat mean(da xhat)), per-column
    // factors hoisted so that the inner loop is float multiply-adds
    std::vector<float> scale(H), mean_da(H), mean_dax(H);
    for (int j = 0; j < H; j++) {
        scale[j] = m.bn_gamma[j] * b.inv_std[j];
        mean_da[j] = float(gbeta[j] / n);
        mean_dax[j] = float(ggamma[j] / n);
    }
    for (idx_t i = 0; i < n; i++) {
        for (int j = 0; j < H; j++) {
            size_t k = size_t(i) * H + j;
            gh[k] = scale[j] * (gh[k] - mean_da[j] - b.xhat[k] * mean_dax[j]);
        }
    }
    gemm(true, false, H, m.d, int(n), gh, H, x, m.d, g.w1.data());
    g.b2.assign(gb2.begin(), gb2.end());
    g.bn_beta.assign(gbeta.begin(), gbeta.end());
    g.bn_gamma.assign(ggamma.begin(), ggamma.end());
}

/// Adam (Kingma & Ba) with bias correction, over the trained arrays of a QModel.
struct Adam {
    const QModelTrainParams& p;
    std::vector<float> mom[5], vel[5];
    int step = 0;

    void update(QModel& m, const QModelGradients& g) {
        std::vector<float>* params[5] = {&m.w1, &m.bn_gamma, &m.bn_beta, &m.w2, &m.b2};
        const std::vector<float>* grads[5] = {&g.w1, &g.bn_gamma, &g.bn_beta, &g.w2, &g.b2};
        step++;
        // bias corrections: lr_t = lr / (1 - beta1^t), v / (1 - beta2^t)
        float lr_t = float(p.learning_rate / (1 - std::pow(double(p.beta1), step)));
        float inv_c2 = float(1 / (1 - std::pow(double(p.beta2), step)));
        float b1 = p.beta1, b2 = p.beta2, eps = p.adam_eps;
        for (int a = 0; a < 5; a++) {
            size_t size = params[a]->size();
            mom[a].resize(size, 0.0f);
            vel[a].resize(size, 0.0f);
            float* w = params[a]->data(); // plain pointers: no reloads through the vectors
            float* mo = mom[a].data();
            float* ve = vel[a].data();
            const float* gr = grads[a]->data();
            for (size_t k = 0; k < size; k++) {
                mo[k] = b1 * mo[k] + (1 - b1) * gr[k];
                ve[k] = b2 * ve[k] + (1 - b2) * gr[k] * gr[k];
                w[k] -= lr_t * mo[k] / (std::sqrt(ve[k] * inv_c2) + eps);
            }
        }
    }
};

// Running statistics as PyTorch keeps them: the unbiased batch variance.
void update_running_stats(QModel& m, idx_t n, const Batch& b) {
    float mo = m.bn_momentum;
    for (int j = 0; j < m.hidden; j++) {
        m.bn_mean[j] = (1 - mo) * m.bn_mean[j] + mo * float(b.mean[j]);
        m.bn_var[j] = (1 - mo) * m.bn_var[j] + mo * float(b.var[j] * n / (n - 1));
    }
}

// Fisher-Yates with the raw generator: std::shuffle's order differs
// between standard libraries, this one does not.
void shuffle(std::vector<idx_t>& perm, std::mt19937_64& rng) {
    for (size_t i = perm.size(); i > 1; i--) {
        std::swap(perm[i - 1], perm[rng() % i]);
    }
}

void fill_normal(std::vector<float>& v, size_t size, float stddev, std::mt19937_64& rng) {
    std::normal_distribution<float> g(0.0f, stddev);
    v.resize(size);
    for (float& x : v) {
        x = g(rng);
    }
}

} // namespace

void check_qmodel_train_params(const QModelTrainParams& p, const char* what) {
    FAISS_THROW_IF_NOT_FMT(p.batch_size >= 2, "%s: batch_size = %d, needs >= 2", what, p.batch_size);
    FAISS_THROW_IF_NOT_FMT(p.iterations >= 0 && p.eval_every > 0, "%s: iterations = %d, eval_every = %d",
                           what, p.iterations, p.eval_every);
    // finite too: an infinite rate or epsilon trains the model into NaN
    FAISS_THROW_IF_NOT_FMT(p.learning_rate > 0 && std::isfinite(p.learning_rate) && p.beta1 >= 0 && p.beta1 < 1 &&
                                   p.beta2 >= 0 && p.beta2 < 1 && p.adam_eps > 0 && std::isfinite(p.adam_eps),
                           "%s: Adam parameters lr = %g, beta1 = %g, beta2 = %g, eps = %g out of range",
                           what, p.learning_rate, p.beta1, p.beta2, p.adam_eps);
}

QModel::QModel(int d, int hidden, int n_classes, uint64_t seed) : d(d), hidden(hidden), n_classes(n_classes) {
    check_dims(d, hidden, n_classes, "QModel");
    std::mt19937_64 rng(seed);
    fill_normal(w1, size_t(hidden) * d, std::sqrt(2.0f / d), rng); // He: a ReLU follows
    fill_normal(w2, size_t(n_classes) * hidden, std::sqrt(2.0f / (hidden + n_classes)), rng); // Glorot
    bn_gamma.assign(hidden, 1.0f);
    bn_beta.assign(hidden, 0.0f);
    bn_mean.assign(hidden, 0.0f);
    bn_var.assign(hidden, 1.0f);
    b2.assign(n_classes, 0.0f);
}

void QModel::log_probs(idx_t n, const float* x, float* out) const {
    check_usable(*this);
    check_x(n, x, d, "x");
    FAISS_THROW_IF_NOT_MSG(n == 0 || out, "QModel::log_probs: out is null");
    std::vector<float> z(size_t(std::min(n, kInferBlock)) * hidden);
    for (idx_t i0 = 0; i0 < n; i0 += kInferBlock) {
        infer_block(*this, std::min(kInferBlock, n - i0), x + i0 * d, out + i0 * n_classes, z.data());
    }
}

size_t QModel::memory_bytes() const {
    size_t bytes = sizeof(*this);
    for (const auto& a : kArrays) {
        bytes += (this->*a.v).size() * sizeof(float);
    }
    return bytes;
}

void QModel::write(BufferWriter& w) const {
    check();
    w.value<int32_t>(d);
    w.value<int32_t>(hidden);
    w.value<int32_t>(n_classes);
    w.value<float>(bn_eps);
    w.value<float>(bn_momentum);
    for (const auto& a : kArrays) {
        w.vector(this->*a.v);
    }
}

void QModel::read(BufferReader& r) {
    QModel m; // filled aside, so that a failed read leaves *this as it was
    m.d = r.value<int32_t>("QModel d");
    m.hidden = r.value<int32_t>("QModel hidden");
    m.n_classes = r.value<int32_t>("QModel n_classes");
    if (m.d != 0 || m.hidden != 0 || m.n_classes != 0) { // all 0: an empty model
        check_dims(m.d, m.hidden, m.n_classes, "read QModel");
    }
    m.bn_eps = r.value<float>("QModel bn_eps");
    m.bn_momentum = r.value<float>("QModel bn_momentum");
    for (const auto& a : kArrays) {
        std::string what = std::string("QModel ") + a.name;
        m.*a.v = r.vector<float>(what.c_str());
    }
    check_sizes(m, "read QModel"); // names the first array a forged dimension contradicts
    m.check();
    *this = std::move(m);
}

void QModel::check() const {
    if (d != 0 || hidden != 0 || n_classes != 0) {
        check_dims(d, hidden, n_classes, "QModel");
    }
    FAISS_THROW_IF_NOT_FMT(std::isfinite(bn_eps) && bn_eps > 0, "QModel: bn_eps = %g is not finite and > 0", bn_eps);
    FAISS_THROW_IF_NOT_FMT(bn_momentum >= 0 && bn_momentum <= 1, "QModel: bn_momentum = %g is not in [0, 1]",
                           bn_momentum);
    check_sizes(*this, "QModel");
    for (const auto& a : kArrays) {
        const std::vector<float>& v = this->*a.v;
        bool positive = a.v == &QModel::bn_var;
        for (size_t i = 0; i < v.size(); i++) {
            FAISS_THROW_IF_NOT_FMT(std::isfinite(v[i]) && (!positive || v[i] > 0), "QModel: %s[%zd] = %g is not %s",
                                   a.name, i, v[i], positive ? "finite and > 0" : "finite");
        }
    }
}

double qmodel_loss(const QModel& m, idx_t n, const float* x, const float* targets, QModelGradients* grad) {
    check_usable(m);
    FAISS_THROW_IF_NOT_FMT(n >= 2 && n <= kMaxBatch, "qmodel_loss: n = %zd rows, needs 2 to %zd (batch statistics)",
                           size_t(n), size_t(kMaxBatch));
    check_x(n, x, m.d, "x");
    check_targets(n, targets, m.n_classes, "targets");
    Batch b;
    double loss = forward_train(m, n, x, targets, b);
    if (grad) {
        backward(m, n, x, targets, b, *grad);
    }
    return loss;
}

double qmodel_eval_loss(const QModel& m, idx_t n, const float* x, const float* targets) {
    check_usable(m);
    FAISS_THROW_IF_NOT_FMT(n >= 1, "qmodel_eval_loss: n = %zd rows, needs >= 1", size_t(n));
    check_x(n, x, m.d, "x");
    check_targets(n, targets, m.n_classes, "targets");
    return eval_loss_unchecked(m, n, x, targets);
}

std::vector<QModelLossPoint> train_qmodel(QModel& m, idx_t n, const float* x, const float* targets, idx_t n_held,
                                          const float* held_x, const float* held_targets,
                                          const QModelTrainParams& params,
                                          const std::function<void(const QModelLossPoint&)>& progress) {
    check_usable(m);
    m.check(); // a scan of the weights costs less than one step, and training NaNs is pointless
    FAISS_THROW_IF_NOT_FMT(n >= 2, "train_qmodel: n = %zd training rows, needs >= 2", size_t(n));
    check_qmodel_train_params(params, "train_qmodel");
    check_x(n, x, m.d, "x");
    check_targets(n, targets, m.n_classes, "targets");
    check_x(n_held, held_x, m.d, "held_x");
    check_targets(n_held, held_targets, m.n_classes, "held_targets");

    // when n < batch_size every step sees all rows; otherwise an epoch's
    // last partial batch is skipped, so every batch has the same size
    idx_t bs = std::min<idx_t>(params.batch_size, n);
    std::vector<idx_t> perm(n);
    std::iota(perm.begin(), perm.end(), idx_t(0));
    std::mt19937_64 rng(params.seed);
    idx_t cursor = n; // shuffle before the first step
    std::vector<float> xb(size_t(bs) * m.d), tb(size_t(bs) * m.n_classes);
    Batch batch;
    QModelGradients grad;
    Adam adam{params, {}, {}, 0};
    std::vector<QModelLossPoint> curve;
    double loss_sum = 0;
    int loss_count = 0;
    const bool keep_best = params.keep_best && n_held > 0;
    QModel best;
    double best_loss = std::numeric_limits<double>::infinity();
    for (int it = 1; it <= params.iterations; it++) {
        if (cursor + bs > n) {
            shuffle(perm, rng);
            cursor = 0;
        }
        for (idx_t i = 0; i < bs; i++) {
            idx_t r = perm[cursor + i];
            std::copy_n(x + r * m.d, m.d, xb.data() + i * m.d);
            std::copy_n(targets + r * m.n_classes, m.n_classes, tb.data() + i * m.n_classes);
        }
        cursor += bs;
        loss_sum += forward_train(m, bs, xb.data(), tb.data(), batch);
        loss_count++;
        backward(m, bs, xb.data(), tb.data(), batch, grad);
        update_running_stats(m, bs, batch);
        adam.update(m, grad);
        if (it % params.eval_every == 0 || it == params.iterations) {
            double held = n_held > 0 ? eval_loss_unchecked(m, n_held, held_x, held_targets)
                                     : std::numeric_limits<double>::quiet_NaN();
            curve.push_back({it, loss_sum / loss_count, held});
            loss_sum = 0;
            loss_count = 0;
            if (keep_best && held < best_loss) {
                best_loss = held;
                best = m;
            }
            if (progress) {
                progress(curve.back());
            }
        }
    }
    if (keep_best && !best.empty()) {
        m = std::move(best);
    }
    return curve;
}

} // namespace kvindex
