// SAAP's query classifier (QModel.h): the loss and its gradients against an
// independent double-precision forward written here, inference against the
// same reference, training on a task it can learn, the serialized form, and
// bad input.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include <faiss/impl/FaissException.h>

#include <kvindex/QModel.h>
#include <kvindex/impl/io.h>

#include "expect_throw.h"
#include "reference.h"

namespace test_qmodel {

using namespace kvindex;

namespace {

/// The model's parameters in double, for the reference forward.
struct RefModel {
    int d, H, C;
    double eps;
    std::vector<double> w1, gamma, beta, mean, var, w2, b2;
};

std::vector<double> to_double(const std::vector<float>& v) {
    return std::vector<double>(v.begin(), v.end());
}

RefModel to_ref(const QModel& m) {
    return {m.d, m.hidden, m.n_classes, double(m.bn_eps),
            to_double(m.w1), to_double(m.bn_gamma), to_double(m.bn_beta), to_double(m.bn_mean),
            to_double(m.bn_var), to_double(m.w2), to_double(m.b2)};
}

/** Plain loops in double: mean over rows of KL(t || softmax(W2 ReLU(BN(W1 x)) + b2)),
 * batch normalization with the batch's statistics (biased variance) when
 * `training`, else with the running ones. Fills logp (n x C) and the ReLU
 * mask (n x H) when not null. */
double ref_loss(const RefModel& m, int n, const float* x, const float* t, bool training,
                std::vector<double>* logp = nullptr, std::vector<char>* mask = nullptr) {
    std::vector<double> z(size_t(n) * m.H, 0.0);
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < m.H; j++) {
            for (int k = 0; k < m.d; k++) {
                z[i * m.H + j] += m.w1[j * m.d + k] * x[i * m.d + k];
            }
        }
    }
    std::vector<double> mu = m.mean, var = m.var;
    if (training) {
        for (int j = 0; j < m.H; j++) {
            mu[j] = var[j] = 0;
            for (int i = 0; i < n; i++) {
                mu[j] += z[i * m.H + j] / n;
            }
            for (int i = 0; i < n; i++) {
                var[j] += (z[i * m.H + j] - mu[j]) * (z[i * m.H + j] - mu[j]) / n;
            }
        }
    }
    if (logp) {
        logp->assign(size_t(n) * m.C, 0.0);
    }
    if (mask) {
        mask->assign(size_t(n) * m.H, 0);
    }
    double loss = 0;
    for (int i = 0; i < n; i++) {
        std::vector<double> h(m.H), l(m.C);
        for (int j = 0; j < m.H; j++) {
            double a = m.gamma[j] * (z[i * m.H + j] - mu[j]) / std::sqrt(var[j] + m.eps) + m.beta[j];
            h[j] = a > 0 ? a : 0;
            if (mask) {
                (*mask)[i * m.H + j] = a > 0;
            }
        }
        double sum = 0;
        for (int c = 0; c < m.C; c++) {
            l[c] = m.b2[c];
            for (int j = 0; j < m.H; j++) {
                l[c] += m.w2[c * m.H + j] * h[j];
            }
            sum += std::exp(l[c]);
        }
        for (int c = 0; c < m.C; c++) {
            double lp = l[c] - std::log(sum);
            double tc = t[i * m.C + c];
            if (tc > 0) {
                loss += tc * (std::log(tc) - lp);
            }
            if (logp) {
                (*logp)[i * m.C + c] = lp;
            }
        }
    }
    return loss / n;
}

/// n rows of softmax(scale * random logits), row `one_hot_row` (if >= 0) one-hot.
std::vector<float> random_targets(int n, int C, uint64_t seed, float scale, int one_hot_row = -1) {
    std::vector<float> t = kvtest::gaussian(n, C, seed, scale);
    for (int i = 0; i < n; i++) {
        double s = 0;
        for (int c = 0; c < C; c++) {
            s += std::exp(double(t[i * C + c]));
        }
        for (int c = 0; c < C; c++) {
            t[i * C + c] = i == one_hot_row ? float(c == 1) : float(std::exp(double(t[i * C + c])) / s);
        }
    }
    return t;
}

/// One trained array: in the model, in the reference, in the gradients.
struct Param {
    const char* name;
    std::vector<float> QModel::*model;
    std::vector<double> RefModel::*ref;
    std::vector<float> QModelGradients::*grad;
};

const Param kParams[] = {
        {"w1", &QModel::w1, &RefModel::w1, &QModelGradients::w1},
        {"bn_gamma", &QModel::bn_gamma, &RefModel::gamma, &QModelGradients::bn_gamma},
        {"bn_beta", &QModel::bn_beta, &RefModel::beta, &QModelGradients::bn_beta},
        {"w2", &QModel::w2, &RefModel::w2, &QModelGradients::w2},
        {"b2", &QModel::b2, &RefModel::b2, &QModelGradients::b2},
};

/// |a - b| relative to the larger of the two, or to `floor` when both are smaller.
double rel_err(double a, double b, double floor) {
    return std::abs(a - b) / std::max({std::abs(a), std::abs(b), floor});
}

/// Rows of C logits in place -> their softmax (in double): training targets.
void softmax_rows(std::vector<float>& rows, int C) {
    for (size_t r = 0; r < rows.size() / C; r++) {
        float* row = rows.data() + r * C;
        double s = 0;
        for (int c = 0; c < C; c++) {
            s += std::exp(double(row[c]));
        }
        for (int c = 0; c < C; c++) {
            row[c] = float(std::exp(double(row[c])) / s);
        }
    }
}

} // namespace

TEST(QModel, GradientsMatchFiniteDifferences) {
    const int d = 6, H = 5, C = 4, n = 7;
    QModel m(d, H, C, 11);
    // gamma, beta and b2 away from their initial values, so that their
    // gradients are not a special case
    std::vector<float> g = kvtest::gaussian(3, H, 12, 0.3f);
    for (int j = 0; j < H; j++) {
        m.bn_gamma[j] = 1 + g[j];
        m.bn_beta[j] = g[H + j];
    }
    m.b2 = kvtest::gaussian(1, C, 13, 0.3f);
    std::vector<float> x = kvtest::gaussian(n, d, 14);
    std::vector<float> t = random_targets(n, C, 15, 1.5f, /*one_hot_row=*/3);

    QModelGradients grad;
    double loss = qmodel_loss(m, n, x.data(), t.data(), &grad);
    std::vector<char> mask0;
    double ref = ref_loss(to_ref(m), n, x.data(), t.data(), true, nullptr, &mask0);
    EXPECT_LE(rel_err(loss, ref, 1e-30), 1e-5) << "loss " << loss << " reference " << ref;

    int checked = 0, skipped = 0;
    for (const Param& p : kParams) {
        std::vector<float>& w = m.*p.model;
        const std::vector<float>& gw = grad.*p.grad;
        ASSERT_EQ(gw.size(), w.size()) << p.name;
        for (size_t k = 0; k < w.size(); k++) {
            // (1) Central differences of the double reference, step 1e-6:
            // truncation and rounding ~1e-10, so the float gradient must
            // agree to 1e-3 relative (absolute 1e-5 below 1e-2).
            RefModel r = to_ref(m);
            double base = (r.*p.ref)[k], hd = 1e-6;
            (r.*p.ref)[k] = base + hd;
            double lp = ref_loss(r, n, x.data(), t.data(), true);
            (r.*p.ref)[k] = base - hd;
            double lm = ref_loss(r, n, x.data(), t.data(), true);
            double fd_ref = (lp - lm) / (2 * hd);
            EXPECT_LE(rel_err(gw[k], fd_ref, 1e-2), 1e-3)
                    << p.name << "[" << k << "] analytic " << gw[k] << " reference fd " << fd_ref;

            // (2) Central differences of qmodel_loss itself (float model):
            // step 1e-2 of the entry's size (at least 1e-3); float rounding
            // of the loss (~1e-7) over the step leaves ~1e-5 of noise, so
            // the tolerance is 1e-2 relative, absolute 1e-4 below 1e-2.
            // A step that moves an activation across the ReLU's kink is no
            // derivative: those entries are skipped (and counted).
            float w0 = w[k];
            float h = std::max(1e-2f * std::abs(w0), 1e-3f);
            float wp = w0 + h, wm = w0 - h;
            std::vector<char> mask_p, mask_m;
            w[k] = wp;
            double fp = qmodel_loss(m, n, x.data(), t.data(), nullptr);
            ref_loss(to_ref(m), n, x.data(), t.data(), true, nullptr, &mask_p);
            w[k] = wm;
            double fm = qmodel_loss(m, n, x.data(), t.data(), nullptr);
            ref_loss(to_ref(m), n, x.data(), t.data(), true, nullptr, &mask_m);
            w[k] = w0;
            if (mask_p != mask0 || mask_m != mask0) {
                skipped++;
                continue;
            }
            double fd = (fp - fm) / (double(wp) - double(wm));
            EXPECT_LE(rel_err(gw[k], fd, 1e-2), 1e-2) << p.name << "[" << k << "] analytic " << gw[k] << " fd " << fd;
            checked++;
        }
    }
    EXPECT_LE(skipped, checked / 10) << "too many steps across the ReLU's kink";

    // the model is left as it was, running statistics included
    EXPECT_EQ(m.bn_mean, std::vector<float>(H, 0.0f));
    EXPECT_EQ(m.bn_var, std::vector<float>(H, 1.0f));
}

TEST(QModel, LogProbsMatchReferenceWithRunningStatistics) {
    const int d = 12, H = 9, C = 7, n = 300; // n > one inference block
    QModel m(d, H, C, 21);
    std::vector<float> s = kvtest::gaussian(4, H, 22, 0.5f);
    for (int j = 0; j < H; j++) {
        m.bn_gamma[j] = 1 + s[j];
        m.bn_beta[j] = s[H + j];
        m.bn_mean[j] = s[2 * H + j];
        m.bn_var[j] = std::exp(s[3 * H + j]);
    }
    m.b2 = kvtest::gaussian(1, C, 23, 0.5f);
    std::vector<float> x = kvtest::gaussian(n, d, 24);
    std::vector<float> t = random_targets(n, C, 25, 2.0f, 0);

    std::vector<float> out(size_t(n) * C);
    m.log_probs(n, x.data(), out.data());
    std::vector<double> ref;
    double ref_eval = ref_loss(to_ref(m), n, x.data(), t.data(), false, &ref);
    for (int i = 0; i < n; i++) {
        double s = 0;
        for (int c = 0; c < C; c++) {
            s += std::exp(double(out[i * C + c]));
        }
        EXPECT_NEAR(s, 1.0, 1e-5) << "row " << i;
    }
    EXPECT_LE(kvtest::rel_max_err(out.data(), ref), 1e-5);
    double eval = qmodel_eval_loss(m, n, x.data(), t.data());
    EXPECT_LE(rel_err(eval, ref_eval, 1e-30), 1e-5) << eval << " vs " << ref_eval;
    // one row at a time (a decode step: the path without BLAS) agrees too
    std::vector<float> row(C);
    for (int i = 0; i < n; i += 37) {
        m.log_probs(1, x.data() + size_t(i) * d, row.data());
        std::vector<double> ref_row(ref.begin() + size_t(i) * C, ref.begin() + size_t(i + 1) * C);
        EXPECT_LE(kvtest::rel_max_err(row.data(), ref_row), 1e-5) << "row " << i;
    }
}

TEST(QModel, TrainingLowersHeldOutLoss) {
    // targets = softmax(3 A x): a function of x the MLP can learn
    const int d = 16, C = 8, H = 32, n_train = 4000, n_held = 1000, n = n_train + n_held;
    std::vector<float> A = kvtest::gaussian(C, d, 31, 1.0f / std::sqrt(float(d)));
    std::vector<float> x = kvtest::gaussian(n, d, 32);
    std::vector<float> t(size_t(n) * C);
    for (int i = 0; i < n; i++) {
        for (int c = 0; c < C; c++) {
            double l = 0;
            for (int k = 0; k < d; k++) {
                l += 3.0 * A[c * d + k] * x[i * d + k];
            }
            t[i * C + c] = float(l);
        }
    }
    softmax_rows(t, C);
    const float* hx = x.data() + size_t(n_train) * d;
    const float* ht = t.data() + size_t(n_train) * C;

    QModelTrainParams p;
    p.iterations = 600;
    p.batch_size = 256;
    p.learning_rate = 1e-2f;
    p.eval_every = 100;
    p.seed = 33;
    auto train = [&](uint64_t model_seed, uint64_t order_seed, std::vector<QModelLossPoint>* curve) {
        QModel m(d, H, C, model_seed);
        QModelTrainParams q = p;
        q.seed = order_seed;
        int calls = 0;
        *curve = train_qmodel(m, n_train, x.data(), t.data(), n_held, hx, ht, q,
                              [&](const QModelLossPoint&) { calls++; });
        EXPECT_EQ(calls, int(curve->size()));
        return m;
    };

    double initial = qmodel_eval_loss(QModel(d, H, C, 34), n_held, hx, ht);
    std::vector<QModelLossPoint> curve;
    QModel m = train(34, 33, &curve);
    double final_loss = qmodel_eval_loss(m, n_held, hx, ht);
    ASSERT_EQ(curve.size(), 6u);
    EXPECT_EQ(curve.back().iteration, 600);
    double lowest = curve.front().held_out_loss;
    for (const QModelLossPoint& c : curve) {
        lowest = std::min(lowest, c.held_out_loss);
    }
    EXPECT_EQ(lowest, final_loss); // keep_best: the curve's best point
    EXPECT_LT(curve.back().train_loss, curve.front().train_loss);
    EXPECT_LT(final_loss, 0.5 * initial) << "initial " << initial << " final " << final_loss;

    // deterministic by seed; another seed (of the order or of the
    // initialization) trains another model
    std::vector<QModelLossPoint> c2;
    QModel same = train(34, 33, &c2);
    for (const Param& q : kParams) {
        EXPECT_EQ(m.*q.model, same.*q.model) << q.name;
    }
    EXPECT_EQ(m.bn_mean, same.bn_mean);
    EXPECT_EQ(m.bn_var, same.bn_var);
    EXPECT_NE(m.w1, train(34, 99, &c2).w1);
    EXPECT_NE(m.w1, train(35, 33, &c2).w1);

    // without held-out rows the curve's held-out loss is NaN; a last
    // partial eval_every interval still gets its point
    QModel m3(d, H, C, 34);
    QModelTrainParams q = p;
    q.iterations = 250;
    std::vector<QModelLossPoint> c3 = train_qmodel(m3, n_train, x.data(), t.data(), 0, nullptr, nullptr, q);
    ASSERT_EQ(c3.size(), 3u);
    EXPECT_EQ(c3.back().iteration, 250);
    EXPECT_TRUE(std::isnan(c3.back().held_out_loss));
}

TEST(QModel, KeepBestEndsAtTheLowestHeldOutLoss) {
    // 64 training rows of random targets and a wide model: it memorises
    // them, and the held-out loss rises after its first points
    const int d = 8, C = 6, H = 128, n_train = 64, n_held = 400, n = n_train + n_held;
    std::vector<float> x = kvtest::gaussian(n, d, 41);
    std::vector<float> t = kvtest::gaussian(n, C, 42, 2.0f);
    softmax_rows(t, C);
    const float* hx = x.data() + size_t(n_train) * d;
    const float* ht = t.data() + size_t(n_train) * C;
    QModelTrainParams p;
    p.iterations = 1500;
    p.batch_size = 32;
    p.learning_rate = 1e-2f;
    p.eval_every = 50;
    for (bool keep : {true, false}) {
        p.keep_best = keep;
        QModel m(d, H, C, 43);
        std::vector<QModelLossPoint> curve = train_qmodel(m, n_train, x.data(), t.data(), n_held, hx, ht, p);
        auto best = std::min_element(curve.begin(), curve.end(), [](const auto& a, const auto& b) {
            return a.held_out_loss < b.held_out_loss;
        });
        ASSERT_LT(best->held_out_loss, curve.back().held_out_loss - 0.05) << "the setup must over-fit";
        const double final_loss = qmodel_eval_loss(m, n_held, hx, ht);
        EXPECT_EQ(final_loss, keep ? best->held_out_loss : curve.back().held_out_loss) << "keep_best " << keep;
    }
}

TEST(QModel, RunningStatisticsFollowBatches) {
    // one step on all rows (n < batch_size): running = 0.9 initial + 0.1
    // batch, the variance unbiased as PyTorch keeps it, both of the
    // activations before the step's update
    const int d = 5, H = 4, C = 3, n = 10;
    QModel m(d, H, C, 61);
    const QModel m0 = m;
    std::vector<float> x = kvtest::gaussian(n, d, 62, 1.0f, 0.5f);
    std::vector<float> t = random_targets(n, C, 63, 1.0f);
    QModelTrainParams p;
    p.iterations = 1;
    p.batch_size = 16;
    std::vector<QModelLossPoint> curve = train_qmodel(m, n, x.data(), t.data(), 0, nullptr, nullptr, p);
    ASSERT_EQ(curve.size(), 1u);
    EXPECT_NEAR(curve[0].train_loss, ref_loss(to_ref(m0), n, x.data(), t.data(), true), 1e-5);
    for (int j = 0; j < H; j++) {
        std::vector<double> z(n, 0.0);
        double mean = 0, var = 0;
        for (int i = 0; i < n; i++) {
            for (int k = 0; k < d; k++) {
                z[i] += double(m0.w1[j * d + k]) * x[i * d + k];
            }
            mean += z[i] / n;
        }
        for (int i = 0; i < n; i++) {
            var += (z[i] - mean) * (z[i] - mean) / (n - 1);
        }
        EXPECT_NEAR(m.bn_mean[j], 0.1 * mean, 1e-5) << j;
        EXPECT_NEAR(m.bn_var[j], 0.9 + 0.1 * var, 1e-5 * (1 + var)) << j;
    }
}

TEST(QModel, SerializationRoundTrip) {
    const int d = 6, H = 5, C = 4, n = 9;
    QModel m(d, H, C, 41);
    m.bn_mean = kvtest::gaussian(1, H, 42);
    m.bn_var.assign(H, 2.5f);
    std::vector<float> x = kvtest::gaussian(n, d, 43);
    std::vector<uint8_t> buf;
    BufferWriter w(&buf);
    m.write(w);
    EXPECT_GE(m.memory_bytes(), sizeof(float) * (H * d + C * H + 4 * H + C));

    QModel back;
    BufferReader r(buf.data(), buf.size());
    back.read(r);
    EXPECT_EQ(r.remaining(), 0u);
    EXPECT_EQ(back.d, d);
    EXPECT_EQ(back.hidden, H);
    EXPECT_EQ(back.n_classes, C);
    std::vector<float> a(n * C), b(n * C);
    m.log_probs(n, x.data(), a.data());
    back.log_probs(n, x.data(), b.data());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));

    // an empty model round-trips too
    std::vector<uint8_t> ebuf;
    BufferWriter ew(&ebuf);
    QModel().write(ew);
    QModel e = m;
    BufferReader er(ebuf.data(), ebuf.size());
    e.read(er);
    EXPECT_TRUE(e.empty());

    // every truncation throws, and leaves the target model unchanged
    for (size_t len = 0; len < buf.size(); len++) {
        QModel t = m;
        BufferReader tr(buf.data(), len);
        EXPECT_THROW(t.read(tr), faiss::FaissException) << "length " << len;
        EXPECT_EQ(t.w1, m.w1);
    }

    // forged fields: d at byte 0, hidden at 4, n_classes at 8, then bn_eps,
    // bn_momentum, and w1 (u64 count at 20, first value at 28)
    auto forged = [&](size_t offset, auto value) {
        std::vector<uint8_t> f = buf;
        std::memcpy(f.data() + offset, &value, sizeof(value));
        return f;
    };
    auto read_of = [](const std::vector<uint8_t>& f) {
        return [f]() {
            QModel q;
            BufferReader fr(f.data(), f.size());
            q.read(fr);
        };
    };
    EXPECT_THROW_MSG(read_of(forged(4, int32_t(H + 1)))(), "w1");
    EXPECT_THROW_MSG(read_of(forged(4, int32_t(1 << 30)))(), "hidden");
    EXPECT_THROW_MSG(read_of(forged(0, int32_t(-3)))(), "d = -3");
    EXPECT_THROW_MSG(read_of(forged(8, int32_t(0)))(), "n_classes = 0");
    EXPECT_THROW_MSG(read_of(forged(12, float(-1)))(), "bn_eps");
    EXPECT_THROW_MSG(read_of(forged(20, uint64_t(1) << 40))(), "w1");
    EXPECT_THROW_MSG(read_of(forged(28, std::numeric_limits<float>::quiet_NaN()))(), "w1[0]");
    // bn_var's first value: after w1, gamma, beta and mean with their counts
    size_t var_at = 28 + 4 * (H * d) + 3 * (8 + 4 * H) + 8;
    EXPECT_THROW_MSG(read_of(forged(var_at, float(-1)))(), "bn_var[0]");
}

TEST(QModel, BadInputThrows) {
    const int d = 4, H = 3, C = 3, n = 5;
    EXPECT_THROW_MSG(QModel(0, H, C, 1), "d = 0");
    EXPECT_THROW_MSG(QModel(d, -2, C, 1), "hidden = -2");
    EXPECT_THROW_MSG(QModel(d, H, 0, 1), "n_classes = 0");

    QModel m(d, H, C, 51);
    std::vector<float> x = kvtest::gaussian(n, d, 52);
    std::vector<float> t = random_targets(n, C, 53, 1.0f);
    std::vector<float> out(n * C);
    QModelTrainParams p;
    p.iterations = 3;

    std::vector<float> bad_x = x;
    bad_x[3 * d + 1] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_THROW_MSG(qmodel_loss(m, n, bad_x.data(), t.data(), nullptr), "x: non-finite value nan at row 3");
    EXPECT_THROW_MSG(m.log_probs(n, bad_x.data(), out.data()), "x: non-finite value nan at row 3");
    EXPECT_THROW_MSG(qmodel_eval_loss(m, n, bad_x.data(), t.data()), "x: non-finite value nan at row 3");
    EXPECT_THROW_MSG(train_qmodel(m, n, x.data(), t.data(), n, bad_x.data(), t.data(), p),
                     "held_x: non-finite value nan at row 3");
    // finite, but above the inputs' bound (twice kMaxInputMagnitude: a
    // de-RoPEd query's entries can reach sqrt 2 times a query's)
    bad_x[3 * d + 1] = 1e30f;
    EXPECT_THROW_MSG(m.log_probs(n, bad_x.data(), out.data()), "x: too large a value 1e+30 at row 3");
    bad_x[3 * d + 1] = 1.5e12f;
    m.log_probs(n, bad_x.data(), out.data());
    // an infinite learning rate or epsilon would train the model into NaN
    for (float* knob : {&p.learning_rate, &p.adam_eps}) {
        const float saved = *knob;
        *knob = std::numeric_limits<float>::infinity();
        EXPECT_THROW_MSG(train_qmodel(m, n, x.data(), t.data(), 0, nullptr, nullptr, p), "Adam parameters");
        *knob = saved;
    }

    std::vector<float> bad_t = t;
    bad_t[2 * C] = -0.25f;
    EXPECT_THROW_MSG(qmodel_loss(m, n, x.data(), bad_t.data(), nullptr), "row 2 of targets");
    EXPECT_THROW_MSG(train_qmodel(m, n, x.data(), bad_t.data(), 0, nullptr, nullptr, p), "row 2 of targets");
    bad_t = t;
    bad_t[4 * C + 2] = std::numeric_limits<float>::infinity();
    EXPECT_THROW_MSG(qmodel_loss(m, n, x.data(), bad_t.data(), nullptr), "row 4 of targets");
    bad_t = t;
    bad_t[C] += 0.5f; // not a distribution
    EXPECT_THROW_MSG(qmodel_loss(m, n, x.data(), bad_t.data(), nullptr), "row 1 of targets sums to");

    EXPECT_THROW_MSG(qmodel_loss(m, 1, x.data(), t.data(), nullptr), "n = 1");
    EXPECT_THROW_MSG(qmodel_loss(QModel(), n, x.data(), t.data(), nullptr), "empty");
    p.batch_size = 1;
    EXPECT_THROW_MSG(train_qmodel(m, n, x.data(), t.data(), 0, nullptr, nullptr, p), "batch_size = 1");

    // a failed call changes nothing: the model still checks and predicts
    QModel fresh(d, H, C, 51);
    EXPECT_EQ(m.w1, fresh.w1);
    m.check();
    QModel broken = m;
    broken.bn_var[1] = 0;
    EXPECT_THROW_MSG(broken.check(), "bn_var[1]");
    broken = m;
    broken.w2.pop_back();
    EXPECT_THROW_MSG(broken.check(), "w2 has");
}

}  // namespace test_qmodel
