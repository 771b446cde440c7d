// IndexIVFAsym: SAAP's asymmetric partitions (papers/saap.txt). Checked
// against the double-precision reference (reference.h) and an independent
// de-rotation and nearest-centroid assignment written here, on
// out-of-distribution heads: keys sit in clusters (in one half of the
// coordinates), a few "needle" keys of each cluster carry a direction in the
// other half, and queries point along those directions. A cluster's
// centroid says nothing about its needles, so probing by nearest centroid
// misses where the attention is; a classifier trained on queries finds it.

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/IVFAsymTrainer.h>
#include <kvindex/IndexIVFAsym.h>
#include <kvindex/IndexTopK.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>

#include "expect_throw.h"
#include "reference.h"

namespace test_ivf_asym {

using namespace kvindex;

namespace {

constexpr int kD = 16;
constexpr int kDv = 8;
constexpr int kC = 8;
constexpr int kGroup = 2;
const RopeParams kRope{10000.0, RopeStyle::interleaved};

/// One KV head's sequence: keys/values of n tokens, kGroup query heads with
/// a query at every position, all post-RoPE.
struct Head {
    idx_t n = 0;
    std::vector<float> keys, values, queries; ///< queries head-major [kGroup, n, d]

    /// The prefill of the first n_prompt tokens, their queries copied
    /// head-major [kGroup, n_prompt, d] (the input points into `scratch`).
    PrefillInput prefill(idx_t n_prompt, std::vector<float>& scratch) const {
        scratch.resize(size_t(kGroup) * n_prompt * kD);
        for (int hd = 0; hd < kGroup; hd++) {
            std::copy_n(query(hd, 0), n_prompt * kD, scratch.data() + size_t(hd) * n_prompt * kD);
        }
        PrefillInput in;
        in.n_tokens = n_prompt;
        in.keys = keys.data();
        in.values = values.data();
        in.n_queries = n_prompt;
        in.n_query_heads = kGroup;
        in.queries = scratch.data();
        in.rope = kRope;
        return in;
    }
    const float* query(int h, idx_t pos) const {
        return queries.data() + (size_t(h) * n + pos) * kD;
    }
};

/// Rotation by position in double, written independently of rope.cpp
/// (interleaved pairs (2i, 2i+1), angle pos * theta^(-2i/d)).
void rotate(float* x, idx_t pos, double sign) {
    for (int i = 0; i < kD / 2; i++) {
        double a = sign * double(pos) * std::pow(kRope.theta, -2.0 * i / kD);
        double c = std::cos(a), s = std::sin(a);
        double u = x[2 * i], v = x[2 * i + 1];
        x[2 * i] = float(u * c - v * s);
        x[2 * i + 1] = float(u * s + v * c);
    }
}

/// The OOD head of the file comment; `seed` draws the tokens, the cluster
/// geometry is fixed (seed 7) so that training and test prompts share it.
Head ood_head(idx_t n, uint64_t seed) {
    std::mt19937_64 geo(7);
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::vector<float> mu(kC * kD, 0.0f), dir(kC * kD, 0.0f);
    for (int c = 0; c < kC; c++) {
        for (int j = 0; j < kD / 2; j++) {
            mu[c * kD + j] = 2.0f * g(geo); // cluster position: first half
            dir[c * kD + kD / 2 + j] = g(geo); // needle direction: second half
        }
    }
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int> cluster(0, kC - 1);
    std::uniform_real_distribution<float> u01(0, 1);
    Head h;
    h.n = n;
    h.keys.resize(n * kD);
    h.values.resize(n * kDv);
    h.queries.resize(kGroup * n * kD);
    for (idx_t t = 0; t < n; t++) {
        int c = cluster(rng);
        // needles carry +dir, the others a little -dir: the cluster's mean
        // has no component along dir
        float along = u01(rng) < 0.15f ? 1.0f : -0.15f / 0.85f;
        float* k = &h.keys[t * kD];
        for (int j = 0; j < kD; j++) {
            k[j] = mu[c * kD + j] + along * dir[c * kD + j] + 0.3f * g(rng);
        }
        rotate(k, t, 1);
        for (int j = 0; j < kDv; j++) {
            h.values[t * kDv + j] = g(rng);
        }
        for (int hd = 0; hd < kGroup; hd++) {
            int qc = cluster(rng);
            float norm = 0;
            for (int j = 0; j < kD; j++) {
                norm += dir[qc * kD + j] * dir[qc * kD + j];
            }
            float* q = &h.queries[(size_t(hd) * n + t) * kD];
            for (int j = 0; j < kD; j++) {
                q[j] = 8.0f * dir[qc * kD + j] / std::sqrt(norm) + 0.3f * g(rng);
            }
            rotate(q, t, 1);
        }
    }
    return h;
}

/// Attention mass of the ids among all tokens [0, n), in double.
double captured_mass(const float* q, const Head& h, idx_t n, const std::vector<idx_t>& ids) {
    std::vector<double> s = kvtest::ref_scores(q, h.keys.data(), kD, n);
    double mx = *std::max_element(s.begin(), s.end());
    double z = 0, in = 0;
    std::vector<bool> sel(n, false);
    for (idx_t id : ids) {
        sel[id] = true;
    }
    for (idx_t i = 0; i < n; i++) {
        double e = std::exp((s[i] - mx) / std::sqrt(double(kD)));
        z += e;
        in += sel[i] ? e : 0;
    }
    return in / z;
}

IVFAsymTrainingParams test_training_params() {
    IVFAsymTrainingParams p;
    p.n_centroids = kC;
    p.hidden = 32;
    p.min_distance = 0;
    p.n_sink = 0;
    p.queries_per_prompt = 2000;
    p.adam.iterations = 400;
    p.adam.batch_size = 128;
    p.adam.learning_rate = 3e-3f;
    p.adam.eval_every = 100;
    p.held_out_fraction = 0.2;
    return p;
}

/// A trainer fed with 4 training prompts of the OOD head.
IVFAsymTrainer& trained_on_ood() {
    static IVFAsymTrainer* t = [] {
        auto* tr = new IVFAsymTrainer(kD, test_training_params());
        for (uint64_t s = 0; s < 4; s++) {
            Head h = ood_head(1500, 100 + s);
            std::vector<float> scratch;
            tr->add_prompt(h.prefill(h.n, scratch));
        }
        tr->train();
        return tr;
    }();
    return *t;
}

std::unique_ptr<KVIndex> prefilled(const std::string& s, const Head& h, idx_t n_prompt, const char* params = "") {
    auto index = index_factory(kD, s, kDv);
    if (*params) {
        set_index_parameters(index.get(), params);
    }
    std::vector<float> scratch;
    index->prefill(h.prefill(n_prompt, scratch));
    return index;
}

} // namespace

TEST(IVFAsym, FactoryStringsAndBadInput) {
    for (const char* s : {"IVFAsym8", "IVFAsym8_Centroid", "IVFAsym8_CentroidRoPE", "IVFAsym8_Moment",
                          "Sink1,Window4,IVFAsym3"}) {
        auto index = index_factory(kD, s, kDv);
        EXPECT_EQ(index_factory_string(index.get()), s);
    }
    EXPECT_THROW_MSG(index_factory(kD, "IVFAsym0", kDv), "IVFAsym0");
    EXPECT_THROW_MSG(index_factory(kD, "IVFAsym8_Nearest", kDv), "IVFAsym8_Nearest");
    auto index = index_factory(kD, "IVFAsym8", kDv);
    EXPECT_THROW_MSG(set_index_parameters(index.get(), "nprobe=9"), "nprobe=9");
    EXPECT_THROW_MSG(set_index_parameters(index.get(), "group_probe=2"), "group_probe=2");
    // var_weight is the _Moment probe's knob (IVFAsym8 has none)
    auto moment = index_factory(kD, "IVFAsym8_Moment", kDv);
    EXPECT_THROW_MSG(set_index_parameters(moment.get(), "var_weight=1.5"), "var_weight=1.5");
    EXPECT_THROW_MSG(set_index_parameters(moment.get(), "var_weight=-1"), "var_weight=-1");
    EXPECT_THROW_MSG(set_index_parameters(index.get(), "var_weight=0.5"), "unknown parameter 'var_weight'");
    auto* ivf = ivf_asym_in_chain(index.get());
    ASSERT_NE(ivf, nullptr);
    EXPECT_THROW_MSG(ivf->set_trained(std::vector<float>(kC * kD - 1), QModel(), kRope), "centroid floats");
    EXPECT_THROW_MSG(ivf->set_trained(std::vector<float>(kC * kD), QModel(kD, 4, kC + 1, 1), kRope), "Q-model");
    // per-call nprobe beyond C
    Head h = ood_head(300, 1);
    auto built = prefilled("IVFAsym8", h, 300);
    SearchParametersTopK sp;
    sp.nprobe = 9;
    std::vector<float> out(kDv);
    EXPECT_THROW_MSG(built->attend(1, h.query(0, 299), out.data(), nullptr, &sp), "nprobe=9");
    EXPECT_EQ(ivf_asym_in_chain(index_factory(kD, "Flat", kDv).get()), nullptr);
}

namespace {

/// Every key of the IVFAsym in `index`'s chain, whose first key is at
/// position `first`, sits in exactly one bucket: its nearest centroid
/// once RoPE is undone at its own position (the reference rotates in
/// double).
void expect_keys_at_nearest_centroids(const KVIndex* index, const Head& h, idx_t first, const std::string& what) {
    const IndexIVFAsym* ivf = ivf_asym_in_chain(index);
    ASSERT_TRUE(ivf->is_trained_models()) << what;
    EXPECT_EQ(ivf->first_position, first) << what;
    std::vector<int> seen(ivf->ntotal, 0);
    for (int b = 0; b <= kC; b++) {
        for (idx_t id : ivf->bucket_ids[b]) {
            seen[id]++;
            std::vector<float> k(&h.keys[(first + id) * kD], &h.keys[(first + id + 1) * kD]);
            rotate(k.data(), first + id, -1);
            int best = -1;
            double best_d = std::numeric_limits<double>::max();
            for (int c = 0; c < kC; c++) {
                double dist = 0;
                for (int j = 0; j < kD; j++) {
                    double x = double(k[j]) - ivf->centroids[c * kD + j];
                    dist += x * x;
                }
                if (dist < best_d - 1e-9) {
                    best_d = dist;
                    best = c;
                }
            }
            EXPECT_EQ(b, best) << what << " token " << id;
        }
    }
    for (idx_t i = 0; i < ivf->ntotal; i++) {
        ASSERT_EQ(seen[i], 1) << what << " token " << i;
    }
}

} // namespace

TEST(IVFAsym, EveryKeyInOneBucketAtItsNearestDeRopedCentroid) {
    Head h = ood_head(900, 2);
    for (const char* s : {"IVFAsym8", "Sink3,Window16,IVFAsym8_Centroid"}) {
        auto index = prefilled(s, h, 700);
        for (idx_t t = 700; t < 900; t++) { // decode appends
            index->add_kv(1, &h.keys[t * kD], &h.values[t * kDv]);
        }
        ASSERT_NO_THROW(index->check_invariants());
        expect_keys_at_nearest_centroids(index.get(), h, std::string(s)[0] == 'S' ? 3 : 0, s);
    }
    // a prompt shorter than the sink (adopted centroids): the inner index's
    // first key is still at position n_sink (it was told n_tokens, and
    // its appended keys were rotated back at the wrong positions)
    auto trained = prefilled("Sink3,Window16,IVFAsym8_Centroid", h, 700);
    for (idx_t n_prompt : {0, 2, 3, 10}) {
        auto index = index_factory(kD, "Sink3,Window16,IVFAsym8_Centroid", kDv);
        ASSERT_EQ(index->adopt_trained(*trained), 1);
        std::vector<float> scratch;
        index->prefill(h.prefill(n_prompt, scratch));
        for (idx_t t = n_prompt; t < 300; t++) {
            index->add_kv(1, &h.keys[t * kD], &h.values[t * kDv]);
        }
        expect_keys_at_nearest_centroids(index.get(), h, 3, "prompt of " + std::to_string(n_prompt));
    }
}

TEST(IVFAsym, FullProbeIsExactAndZeroProbeIsTheStaticPart) {
    Head h = ood_head(800, 3);
    const idx_t n_prompt = 700;
    for (const char* s : {"IVFAsym8", "IVFAsym8_CentroidRoPE", "Sink4,Window16,IVFAsym8"}) {
        auto index = prefilled(s, h, n_prompt);
        for (idx_t t = n_prompt; t < 800; t++) {
            index->add_kv(1, &h.keys[t * kD], &h.values[t * kDv]);
        }
        const idx_t n = 800;
        for (int gp : {0, 1}) {
            // the queries of the group at the last position, head-major
            std::vector<float> q(kGroup * kD);
            for (int hd = 0; hd < kGroup; hd++) {
                std::copy_n(h.query(hd, n - 1), kD, q.data() + hd * kD);
            }
            set_index_parameters(index.get(), "nprobe=8,group_probe=" + std::to_string(gp));
            std::vector<float> out(kGroup * kDv), lse(kGroup);
            index->attend(kGroup, q.data(), out.data(), lse.data());
            for (int hd = 0; hd < kGroup; hd++) {
                std::vector<double> ref;
                double ref_lse = kvtest::ref_attention_all(
                        &q[hd * kD], h.keys.data(), h.values.data(), kD, kDv, n, ref);
                EXPECT_LT(kvtest::rel_max_err(&out[hd * kDv], ref), 1e-5) << s << " gp " << gp;
                EXPECT_NEAR(lse[hd], ref_lse, 1e-4);
            }
        }
        // nprobe = 0: the sink and window alone (nothing for a bare index)
        set_index_parameters(index.get(), "nprobe=0,group_probe=0");
        std::vector<float> out(kDv), lse(1);
        index->attend(1, h.query(0, n - 1), out.data(), lse.data());
        if (std::string(s)[0] == 'S') {
            std::vector<idx_t> ids = {0, 1, 2, 3};
            for (idx_t t = n - 16; t < n; t++) {
                ids.push_back(t);
            }
            std::vector<double> ref;
            double ref_lse = kvtest::ref_attention(
                    h.query(0, n - 1), h.keys.data(), h.values.data(), kD, kDv, ids, nullptr, ref);
            EXPECT_LT(kvtest::rel_max_err(out.data(), ref), 1e-5);
            EXPECT_NEAR(lse[0], ref_lse, 1e-4);
        } else {
            EXPECT_EQ(lse[0], -std::numeric_limits<float>::infinity());
        }
    }
}

TEST(IVFAsym, CapturedMassIsMonotoneInNprobe) {
    Head h = ood_head(1200, 4);
    for (const char* s : {"IVFAsym8", "IVFAsym8_Centroid", "IVFAsym8_CentroidRoPE", "IVFAsym8_Oracle"}) {
        auto index = prefilled(s, h, 1200);
        for (idx_t pos : {1199}) {
            for (int hd = 0; hd < kGroup; hd++) {
                double prev = -1;
                for (int l = 0; l <= kC; l++) {
                    SearchParametersTopK sp;
                    sp.nprobe = size_t(l);
                    std::vector<Selection> sel(1);
                    set_index_parameter(index.get(), "nprobe", l);
                    index->select(1, h.query(hd, pos), sel.data());
                    double m = captured_mass(h.query(hd, pos), h, h.n, sel[0].ids);
                    EXPECT_GE(m, prev - 1e-12) << s << " nprobe " << l;
                    prev = m;
                    if (l == kC) {
                        EXPECT_NEAR(m, 1.0, 1e-12);
                    }
                }
            }
        }
    }
}

TEST(IVFAsym, DecodeQueryIsDeRopedAtTheNewestPosition) {
    // the window holds the newest 16 tokens: the inner index's queries are
    // at its last token + 16, which centroid probing must rotate back by
    Head h = ood_head(600, 5);
    auto index = prefilled("Sink2,Window16,IVFAsym8_Centroid", h, 500, "nprobe=3");
    for (idx_t t = 500; t < 600; t++) {
        index->add_kv(1, &h.keys[t * kD], &h.values[t * kDv]);
    }
    const IndexIVFAsym* ivf = ivf_asym_in_chain(index.get());
    EXPECT_EQ(ivf->query_position(), 599);
    std::vector<float> q(h.query(1, 599), h.query(1, 599) + kD);
    std::vector<int32_t> got(3);
    ivf->probe_buckets(q.data(), ivf->query_position(), 3, got.data());
    rotate(q.data(), 599, -1);
    std::vector<std::pair<double, int>> scores;
    for (int c = 0; c < kC; c++) {
        double s = 0;
        for (int j = 0; j < kD; j++) {
            s += double(q[j]) * ivf->centroids[c * kD + j];
        }
        scores.push_back({-s, c});
    }
    std::sort(scores.begin(), scores.end());
    for (int i = 0; i < 3; i++) {
        EXPECT_EQ(got[i], scores[i].second);
    }
}

TEST(IVFAsym, TrainingLowersHeldOutLoss) {
    const IVFAsymTrainer& t = trained_on_ood();
    const IVFAsymTrainingReport& r = t.report;
    EXPECT_EQ(r.n_prompts, 4);
    EXPECT_GT(r.n_held, 100);
    ASSERT_TRUE(t.qmodel_trained());
    ASSERT_FALSE(r.curve.empty());
    EXPECT_LT(r.curve.back().held_out_loss, 0.5 * r.initial_held_out_loss)
            << "initial " << r.initial_held_out_loss;
}

TEST(IVFAsym, TheTrainerRefusesBadKnobsAtOnceAndAFailedRunKeepsItsModel) {
    // Adam's knobs used to be checked only by train(), after every prompt
    IVFAsymTrainingParams p = test_training_params();
    p.adam.learning_rate = 0;
    EXPECT_THROW_MSG(IVFAsymTrainer(kD, p), "IVFAsymTrainer: adam: Adam parameters lr = 0");
    p = test_training_params();
    p.adam.batch_size = 1;
    EXPECT_THROW_MSG(IVFAsymTrainer(kD, p), "batch_size = 1");
    // the k-means sample size (points per centroid x C) used to wrap
    p = test_training_params();
    p.kmeans_points_per_centroid = idx_t(1) << 61;
    EXPECT_THROW_MSG(IVFAsymTrainer(kD, p), "kmeans_points_per_centroid=2305843009213693952");

    // a run that fails inside train_qmodel (knobs changed after
    // construction) used to leave a random model that reported itself trained
    IVFAsymTrainer t(kD, test_training_params());
    Head h = ood_head(1500, 100);
    std::vector<float> scratch;
    t.add_prompt(h.prefill(h.n, scratch));
    t.params.adam.learning_rate = -1;
    EXPECT_THROW_MSG(t.train(), "Adam parameters");
    EXPECT_FALSE(t.qmodel_trained());
    EXPECT_TRUE(t.qmodel.w1.empty());
    // a progress callback that throws stops the run the same way
    t.params.adam = test_training_params().adam;
    EXPECT_THROW_MSG(
            t.train([](const QModelLossPoint&) { FAISS_THROW_MSG("stopped by the caller"); }),
            "stopped by the caller");
    EXPECT_FALSE(t.qmodel_trained());
    t.train();
    EXPECT_TRUE(t.qmodel_trained());

    // a NaN centroid won no comparison: every key went to bucket 0
    std::vector<float> centroids = t.centroids;
    centroids[1] = std::numeric_limits<float>::quiet_NaN();
    std::vector<int32_t> buckets(h.n);
    EXPECT_THROW_MSG(
            assign_keys_to_buckets(h.keys.data(), h.n, kD, 0, t.rope, centroids.data(), kC,
                                   buckets.data()),
            "assign_keys_to_buckets: centroids: non-finite value nan at row 0");
}

TEST(IVFAsym, TrainedClassifierCapturesMoreMassThanNearestCentroid) {
    const IVFAsymTrainer& t = trained_on_ood();
    Head h = ood_head(2000, 999); // a new prompt
    double mass[3] = {0, 0, 0};
    const char* strings[3] = {"IVFAsym8", "IVFAsym8_Centroid", "IVFAsym8_CentroidRoPE"};
    int n_eval = 0;
    for (int v = 0; v < 3; v++) {
        auto index = index_factory(kD, strings[v], kDv);
        ivf_asym_in_chain(index.get())->set_trained(t.centroids, t.qmodel, t.rope);
        std::vector<float> scratch;
        index->prefill(h.prefill(1800, scratch));
        set_index_parameters(index.get(), "nprobe=2");
        n_eval = 0;
        for (idx_t pos = 1800; pos < 2000; pos++) {
            index->add_kv(1, &h.keys[pos * kD], &h.values[pos * kDv]);
            std::vector<Selection> sel(1);
            index->select(1, h.query(0, pos), sel.data());
            mass[v] += captured_mass(h.query(0, pos), h, pos + 1, sel[0].ids);
            n_eval++;
        }
        mass[v] /= n_eval;
    }
    std::printf("captured mass at nprobe 2: qmodel %.3f centroid %.3f centroid_rope %.3f\n",
                mass[0], mass[1], mass[2]);
    // measured: Q-model 0.58, centroids 0.22 and 0.26 (2 of 8 buckets)
    EXPECT_GT(mass[0], 0.45);
    EXPECT_GT(mass[0], mass[1] + 0.2);
    EXPECT_GT(mass[0], mass[2] + 0.2);
}

TEST(IVFAsym, OracleReadsTheBucketsOfLargestExactMass) {
    // the oracle's buckets are the nprobe of largest mass, each bucket's
    // mass computed here in double from its ids; no other probe captures more
    const IVFAsymTrainer& t = trained_on_ood();
    Head h = ood_head(1600, 31);
    std::vector<std::unique_ptr<KVIndex>> idx;
    for (const char* s : {"IVFAsym8_Oracle", "IVFAsym8", "IVFAsym8_Centroid", "IVFAsym8_CentroidRoPE",
                          "IVFAsym8_Moment"}) {
        idx.push_back(index_factory(kD, s, kDv));
        ivf_asym_in_chain(idx.back().get())->set_trained(t.centroids, t.qmodel, t.rope);
        std::vector<float> scratch;
        idx.back()->prefill(h.prefill(h.n, scratch));
    }
    const IndexIVFAsym* oracle = ivf_asym_in_chain(idx[0].get());
    EXPECT_EQ(oracle->factory_string(), "IVFAsym8_Oracle");
    for (int l : {1, 2, 3}) {
        for (auto& index : idx) {
            set_index_parameter(index.get(), "nprobe", l);
        }
        for (int hd = 0; hd < kGroup; hd++) {
            for (idx_t pos : {idx_t(700), idx_t(1599)}) {
                const float* q = h.query(hd, pos);
                std::vector<double> bucket_mass;
                for (int c = 0; c < kC; c++) {
                    bucket_mass.push_back(captured_mass(q, h, h.n, oracle->bucket_ids[c]));
                }
                std::sort(bucket_mass.rbegin(), bucket_mass.rend());
                const double best = std::accumulate(bucket_mass.begin(), bucket_mass.begin() + l, 0.0);
                std::vector<Selection> sel(1);
                idx[0]->select(1, q, sel.data());
                EXPECT_NEAR(captured_mass(q, h, h.n, sel[0].ids), best, 1e-6) << "nprobe " << l;
                EXPECT_EQ(sel[0].n_scanned, size_t(h.n)) << "the oracle scores every key";
                for (size_t v = 1; v < idx.size(); v++) {
                    idx[v]->select(1, q, sel.data());
                    EXPECT_LE(captured_mass(q, h, h.n, sel[0].ids), best + 1e-9)
                            << idx[v]->factory_string() << " nprobe " << l;
                }
            }
        }
    }
}

TEST(IVFAsym, AdoptedModelsAreUsedKeptAndRoundTrip) {
    const IVFAsymTrainer& t = trained_on_ood();
    auto trained = index_factory(kD, "Sink1,Window8,IVFAsym8", kDv);
    ivf_asym_in_chain(trained.get())->set_trained(t.centroids, t.qmodel, t.rope);
    auto index = index_factory(kD, "Sink1,Window8,IVFAsym8_Centroid", kDv);
    EXPECT_EQ(index->adopt_trained(*trained), 1);
    Head h = ood_head(500, 6);
    std::vector<float> scratch;
    index->prefill(h.prefill(500, scratch));
    const IndexIVFAsym* ivf = ivf_asym_in_chain(index.get());
    EXPECT_EQ(ivf->centroids, t.centroids); // no self-training
    EXPECT_TRUE(ivf->adopted);
    // io keeps them, and the answers
    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);
    auto copy = read_index(buf);
    std::vector<float> a(kDv), b(kDv);
    index->attend(1, h.query(0, 499), a.data(), nullptr);
    copy->attend(1, h.query(0, 499), b.data(), nullptr);
    EXPECT_EQ(a, b);
    // reset keeps adopted models; adopting into a non-empty index throws
    EXPECT_THROW_MSG(index->adopt_trained(*trained), "empty index");
    index->reset();
    EXPECT_EQ(ivf_asym_in_chain(index.get())->centroids, t.centroids);
    // mismatched chains throw
    auto flat = index_factory(kD, "Flat", kDv);
    EXPECT_THROW_MSG(index->adopt_trained(*flat), "same factory string");
    auto other = index_factory(kD, "IVFAsym4", kDv);
    auto bare = index_factory(kD, "IVFAsym8", kDv);
    auto bare2 = index_factory(kD, "IVFAsym8", kDv);
    EXPECT_THROW_MSG(bare2->adopt_trained(*bare), "no centroids");
    EXPECT_THROW_MSG(bare->adopt_trained(*other), "C=4");
    // a self-trained index drops its models on reset
    auto self = prefilled("IVFAsym8", h, 500);
    EXPECT_TRUE(ivf_asym_in_chain(self.get())->is_trained_models());
    self->reset();
    EXPECT_FALSE(ivf_asym_in_chain(self.get())->is_trained_models());
}

TEST(IVFAsym, TwoBuildsFromOneSeedSaveTheSameBytes) {
    // self-training is seeded, and the record holds nothing else that
    // differs between runs (its training time is not written)
    Head h = ood_head(500, 6);
    std::vector<uint8_t> first, second;
    auto a = prefilled("IVFAsym8", h, 500);
    auto b = prefilled("IVFAsym8", h, 500);
    EXPECT_GT(ivf_asym_in_chain(a.get())->train_seconds, 0.0);
    write_index(a.get(), &first);
    write_index(b.get(), &second);
    EXPECT_TRUE(first == second);
    EXPECT_EQ(ivf_asym_in_chain(read_index(first).get())->train_seconds, 0.0);
}

TEST(IVFAsym, TokensBeforeTrainingAreReadExactly) {
    // add_kv on a fresh index: no models, every token in the unassigned run
    Head h = ood_head(50, 8);
    auto index = index_factory(kD, "IVFAsym8", kDv);
    index->add_kv(50, h.keys.data(), h.values.data());
    set_index_parameters(index.get(), "nprobe=1");
    std::vector<float> out(kDv);
    index->attend(1, h.query(0, 49), out.data(), nullptr);
    std::vector<double> ref;
    kvtest::ref_attention_all(h.query(0, 49), h.keys.data(), h.values.data(), kD, kDv, 50, ref);
    EXPECT_LT(kvtest::rel_max_err(out.data(), ref), 1e-5);
}

TEST(IVFAsym, GroupProbeReadsTheBucketsOfTheSummedOutputs) {
    // SAAP's batched queries: the g heads of a position share the nprobe
    // buckets of the summed classifier outputs (here: probabilities)
    Head h = ood_head(900, 9);
    auto index = prefilled("IVFAsym8", h, 900, "nprobe=2,group_probe=1");
    const IndexIVFAsym* ivf = ivf_asym_in_chain(index.get());
    ASSERT_FALSE(ivf->qmodel.empty());
    ASSERT_EQ(ivf->group_size, kGroup);
    const idx_t m = 3; // positions per head, head-major as KVCache sends them
    std::vector<float> q(kGroup * m * kD);
    for (int hd = 0; hd < kGroup; hd++) {
        for (idx_t i = 0; i < m; i++) {
            std::copy_n(h.query(hd, 890 + i), kD, &q[(hd * m + i) * kD]);
        }
    }
    std::vector<float> out(kGroup * m * kDv), lse(kGroup * m);
    index->attend(kGroup * m, q.data(), out.data(), lse.data());
    for (idx_t i = 0; i < m; i++) {
        std::vector<float> sum(kC, 0.0f), s(kC);
        for (int hd = 0; hd < kGroup; hd++) {
            ivf->bucket_scores(&q[(hd * m + i) * kD], ivf->query_position(), s.data());
            for (int c = 0; c < kC; c++) {
                sum[c] += s[c];
            }
        }
        std::vector<int> order(kC);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return sum[a] > sum[b]; });
        std::vector<idx_t> ids;
        for (int r = 0; r < 2; r++) {
            ids.insert(ids.end(), ivf->bucket_ids[order[r]].begin(), ivf->bucket_ids[order[r]].end());
        }
        for (int hd = 0; hd < kGroup; hd++) {
            std::vector<double> ref;
            double ref_lse = kvtest::ref_attention(
                    &q[(hd * m + i) * kD], h.keys.data(), h.values.data(), kD, kDv, ids, nullptr, ref);
            EXPECT_LT(kvtest::rel_max_err(&out[(hd * m + i) * kDv], ref), 1e-5);
            EXPECT_NEAR(lse[hd * m + i], ref_lse, 1e-4);
        }
    }
}

TEST(IVFAsym, ForgedTokenCountIsRefusedBeforeAllocating) {
    // a fuzz_read_index find: a Sink/Window record whose IVFAsym claims
    // ~1.4e9 tokens made the reader allocate 5.7 GB before checking; the
    // bucket sizes are now read (bounded by the bytes left) and compared
    // with ntotal first
    const std::vector<uint8_t> bytes = {
        0x4b, 0x56, 0x49, 0x58, 0x03, 0x00, 0x00, 0x00, 0x53, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0xa8, 0xde, 0xbb, 0x49, 0x4b, 0x56, 0x53, 0x77, 0x01, 0x00, 0x00, 0x00, 0x08, 0x00, 0x00, 0x00,
        0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x64, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x88, 0xc3, 0x40, 0x00, 0x00,
        0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x4b, 0x56, 0x49, 0x61, 0x01, 0x00, 0x00, 0x00, 0x08, 0x00, 0x00, 0x00, 0x08, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x55, 0x00, 0x00, 0x00, 0x00, 0x64, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x88, 0xc3, 0x40, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00,
        0x01, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0xff, 0xff, 0xff,
        0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xd2, 0x04, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    };
    EXPECT_ANY_THROW(read_index(bytes));
}

namespace {

/// The moment probe's scores computed here in double from the bucket's ids:
/// softmax_b(log n_b + s <q, mean_b> + w s^2 / 2 sum_j q_j^2 var_bj).
std::vector<double> ref_moment_scores(const float* q, const Head& h, const IndexIVFAsym& ivf, double w) {
    const double s = 1.0 / std::sqrt(double(kD));
    std::vector<double> est(kC, -std::numeric_limits<double>::infinity());
    for (int c = 0; c < kC; c++) {
        const std::vector<idx_t>& ids = ivf.bucket_ids[c];
        if (ids.empty()) {
            continue;
        }
        double a = 0, b = 0;
        for (int j = 0; j < kD; j++) {
            double m1 = 0, m2 = 0;
            for (idx_t id : ids) {
                double k = h.keys[id * kD + j];
                m1 += k;
                m2 += k * k;
            }
            m1 /= double(ids.size());
            m2 = m2 / double(ids.size()) - m1 * m1;
            a += q[j] * m1;
            b += double(q[j]) * q[j] * m2;
        }
        est[c] = std::log(double(ids.size())) + s * a + 0.5 * w * s * s * b;
    }
    double mx = *std::max_element(est.begin(), est.end()), z = 0;
    for (double& e : est) {
        e = std::exp(e - mx);
        z += e;
    }
    for (double& e : est) {
        e /= z;
    }
    return est;
}

} // namespace

TEST(IVFAsym, MomentProbeScoresFollowTheBucketsKeysThroughAppendsAndIo) {
    // scores = the reference from each bucket's keys, after prefill, after
    // decode appends (the moments move with them) and after a round trip
    Head h = ood_head(1400, 41);
    auto index = prefilled("IVFAsym8_Moment", h, 1200, "nprobe=2");
    IndexIVFAsym* ivf = ivf_asym_in_chain(index.get());
    ASSERT_NE(ivf, nullptr);
    EXPECT_TRUE(ivf->qmodel.empty()) << "the moment probe trains no Q-model";
    EXPECT_TRUE(ivf->is_trained_models());
    auto check = [&](const KVIndex* x, const char* when) {
        const IndexIVFAsym* iv = ivf_asym_in_chain(x);
        for (double w : {0.0, 0.5, 1.0}) {
            set_index_parameter(const_cast<KVIndex*>(x), "var_weight", w);
            for (idx_t pos : {idx_t(300), idx_t(1100)}) {
                std::vector<float> got(kC);
                iv->bucket_scores(h.query(1, pos), iv->query_position(), got.data());
                std::vector<double> ref = ref_moment_scores(h.query(1, pos), h, *iv, w);
                for (int c = 0; c < kC; c++) {
                    EXPECT_NEAR(got[c], ref[c], 2e-5 + 1e-4 * ref[c]) << when << " w " << w << " bucket " << c;
                }
            }
        }
        x->check_invariants();
    };
    check(index.get(), "prefill");
    for (idx_t t = 1200; t < 1400; t += 50) { // decode appends, in chunks
        index->add_kv(50, &h.keys[t * kD], &h.values[t * kDv]);
    }
    check(index.get(), "appends");
    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);
    auto back = read_index(buf);
    const IndexIVFAsym* b = ivf_asym_in_chain(back.get());
    EXPECT_EQ(b->key_sum, ivf->key_sum) << "the sums are rebuilt in the same order";
    EXPECT_EQ(b->bucket_mean, ivf->bucket_mean);
    EXPECT_EQ(b->bucket_var, ivf->bucket_var);
    check(back.get(), "read back");
    index->reset();
    EXPECT_TRUE(ivf->bucket_mean.empty());
    index->check_invariants();
}

TEST(IVFAsym, MomentMeanEstimateIsJensensBoundOfEachBucketsLogMass) {
    // var_weight = 0: log n_b + s <q, mean_b> <= log sum_b exp(s <q, k>)
    // <= the same + s max_b <q, k - mean_b>, each side computed here in double
    Head h = ood_head(1000, 45);
    auto index = prefilled("IVFAsym8_Moment", h, h.n);
    const IndexIVFAsym* ivf = ivf_asym_in_chain(index.get());
    const double s = 1.0 / std::sqrt(double(kD));
    for (idx_t pos : {idx_t(10), idx_t(500), idx_t(999)}) {
        const float* q = h.query(0, pos);
        std::vector<float> est(kC);
        ivf->moment_log_masses(q, est.data());
        std::vector<double> scores = kvtest::ref_scores(q, h.keys.data(), kD, h.n);
        for (int c = 0; c < kC; c++) {
            const std::vector<idx_t>& ids = ivf->bucket_ids[c];
            ASSERT_FALSE(ids.empty());
            double mean_dot = 0, mx = -1e300, z = 0;
            for (idx_t id : ids) {
                mean_dot += scores[id] / double(ids.size());
                mx = std::max(mx, scores[id]);
            }
            for (idx_t id : ids) {
                z += std::exp(s * (scores[id] - mx));
            }
            double exact = s * mx + std::log(z);
            EXPECT_LE(est[c], exact + 1e-4) << "bucket " << c << " at " << pos;
            EXPECT_GE(est[c], exact - s * (mx - mean_dot) - 1e-4) << "bucket " << c << " at " << pos;
        }
    }
    EXPECT_THROW_MSG(
            ivf_asym_in_chain(prefilled("IVFAsym8_Centroid", h, h.n).get())->moment_log_masses(
                    h.query(0, 0), std::vector<float>(kC).data()),
            "_Moment");
}

TEST(IVFAsym, ProbeDiagnosticsCheckTheirQueryPositionAndTraining) {
    // probe_buckets, bucket_scores and moment_log_masses are public: they
    // refuse what attend refuses, and an untrained index, by name
    Head h = ood_head(400, 46);
    auto index = prefilled("IVFAsym8_Moment", h, h.n);
    const IndexIVFAsym* ivf = ivf_asym_in_chain(index.get());
    std::vector<float> q(h.query(0, 399), h.query(0, 399) + kD);
    std::vector<int32_t> probed(3);
    std::vector<float> scores(kC);
    ivf->probe_buckets(q.data(), 399, 3, probed.data());
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), 1e30f}) {
        q[5] = bad;
        const char* part = std::isfinite(bad) ? "too large" : "non-finite";
        EXPECT_THROW_MSG(ivf->probe_buckets(q.data(), 399, 3, probed.data()), part);
        EXPECT_THROW_MSG(ivf->bucket_scores(q.data(), 399, scores.data()), part);
        EXPECT_THROW_MSG(ivf->moment_log_masses(q.data(), scores.data()), part);
    }
    q[5] = 0.0f;
    EXPECT_THROW_MSG(ivf->probe_buckets(q.data(), -1, 3, probed.data()), "position=-1");
    EXPECT_THROW_MSG(ivf->bucket_scores(q.data(), -1, scores.data()), "position=-1");
    EXPECT_THROW_MSG(ivf->bucket_scores(nullptr, 399, scores.data()), "query");
    EXPECT_THROW_MSG(ivf->probe_buckets(q.data(), 399, 3, nullptr), "out");
    IndexIVFAsym untrained(kD, kDv, kC, IVFAsymProbe::moment);
    EXPECT_THROW_MSG(untrained.bucket_scores(q.data(), 0, scores.data()), "not trained");
    EXPECT_THROW_MSG(untrained.moment_log_masses(q.data(), scores.data()), "not trained");
}

TEST(IVFAsym, MomentVarianceTermFindsTheWideClusters) {
    // isotropic Gaussian clusters, half tight (sigma 0.2) and half wide
    // (sigma 1): a wide cluster's exact mass carries exp(s^2 sigma^2 |q|^2 / 2),
    // which the mean cannot see and the variance term estimates; so at
    // nprobe 1 var_weight = 1 captures more mass than var_weight = 0
    std::mt19937_64 rng(47);
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::vector<float> centroids(kC * kD);
    for (auto& x : centroids) {
        x = 0.75f * g(rng); // |mu| ~ 3
    }
    Head h;
    h.n = 2400;
    h.keys.resize(h.n * kD);
    h.values.resize(h.n * kDv);
    h.queries.resize(kGroup * h.n * kD);
    for (idx_t t = 0; t < h.n; t++) {
        int c = int(t % kC);
        float sigma = c % 2 ? 1.0f : 0.2f;
        for (int j = 0; j < kD; j++) {
            h.keys[t * kD + j] = centroids[c * kD + j] + sigma * g(rng);
        }
        rotate(&h.keys[t * kD], t, 1);
        for (int j = 0; j < kDv; j++) {
            h.values[t * kDv + j] = g(rng);
        }
        for (int hd = 0; hd < kGroup; hd++) {
            float* q = &h.queries[(size_t(hd) * h.n + t) * kD];
            float norm = 0;
            for (int j = 0; j < kD; j++) {
                q[j] = g(rng);
                norm += q[j] * q[j];
            }
            for (int j = 0; j < kD; j++) {
                q[j] *= 8.0f / std::sqrt(norm);
            }
        }
    }
    std::vector<std::unique_ptr<KVIndex>> idx;
    for (const char* knobs : {"nprobe=1,var_weight=1", "nprobe=1,var_weight=0", "nprobe=1"}) {
        idx.push_back(index_factory(kD, idx.size() < 2 ? "IVFAsym8_Moment" : "IVFAsym8_Oracle", kDv));
        ivf_asym_in_chain(idx.back().get())->set_trained(centroids, QModel(), kRope);
        std::vector<float> scratch;
        idx.back()->prefill(h.prefill(h.n, scratch));
        set_index_parameters(idx.back().get(), knobs);
    }
    std::vector<double> mass(idx.size(), 0.0);
    int n = 0;
    for (int hd = 0; hd < kGroup; hd++) {
        for (idx_t pos = 0; pos < h.n; pos += 40) {
            for (size_t v = 0; v < idx.size(); v++) {
                std::vector<Selection> sel(1);
                idx[v]->select(1, h.query(hd, pos), sel.data());
                mass[v] += captured_mass(h.query(hd, pos), h, h.n, sel[0].ids);
            }
            n++;
        }
    }
    for (double& m : mass) {
        m /= n;
    }
    EXPECT_GT(mass[0], mass[1] + 0.05) << "var_weight 1: " << mass[0] << ", 0: " << mass[1];
    EXPECT_LE(mass[0], mass[2] + 1e-9) << "the oracle is the ceiling: " << mass[2];
}

TEST(IVFAsym, TheQuestionsRowsCountRecentWeightTimesAndWindowQueriesTrain) {
    // rows of a prompt: every eligible query once with a uniform draw
    // covering them all; the last 50 positions' queries (the question)
    // then count 3 times each
    Head h = ood_head(600, 5);
    std::vector<float> scratch;
    auto rows = [&](idx_t recent_positions, int recent_weight, idx_t* candidates) {
        IVFAsymTrainingParams p = test_training_params();
        p.held_out_fraction = 0;
        p.recent_positions = recent_positions;
        p.recent_weight = recent_weight;
        IVFAsymTrainer t(kD, p);
        t.add_prompt(h.prefill(h.n, scratch));
        t.train();
        *candidates = t.report.n_candidates;
        return t.report.n_train;
    };
    idx_t c_plain, c_question, c_weighted;
    const idx_t plain = rows(0, 1, &c_plain), question = rows(50, 1, &c_question),
                weighted = rows(50, 3, &c_weighted);
    EXPECT_EQ(c_plain, c_question); // the draw covers every query either way
    EXPECT_EQ(c_plain, c_weighted);
    EXPECT_EQ(plain, question);
    EXPECT_GT(weighted, plain);
    EXPECT_EQ((weighted - plain) % 2, 0); // each question row twice more
    EXPECT_LE(weighted - plain, 2 * 50 * kGroup);
    IVFAsymTrainingParams bad = test_training_params();
    bad.recent_weight = 0;
    EXPECT_THROW_MSG(IVFAsymTrainer(kD, bad), "recent_weight=0");

    // queries past the keys (a sink/window chain's window) see every key,
    // as decode queries do: they train too
    PrefillInput in = h.prefill(h.n, scratch);
    in.n_tokens = 500;
    std::vector<idx_t> pos(h.n);
    std::iota(pos.begin(), pos.end(), idx_t(0));
    in.query_positions = pos.data();
    IVFAsymTrainer t(kD, test_training_params());
    t.add_prompt(in);
    EXPECT_EQ(t.report.n_candidates, kGroup * (h.n - 1)); // positions 1 .. 599 (min_distance 0, no sink)
}

}  // namespace test_ivf_asym
