// IndexChoose: the per-head choice between candidate chains at prefill.
// Planted heads (one sparse, one flat) must get different candidates, each
// the one an independent measurement finds best; the recorded errors are
// recomputed here against the double reference; after the choice the index
// is the chosen candidate, bit for bit.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <faiss/impl/FaissException.h>

#include <kvindex/IndexChoose.h>
#include <kvindex/KVCache.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>

#include "expect_throw.h"
#include "reference.h"

namespace test_choose {

using namespace kvindex;
using kvtest::gaussian;

namespace {

constexpr int kD = 32;
constexpr int kDv = 16;

/// The tokens and queries of one (layer, KV head): prefill queries of a
/// GQA group at the last nq positions, and evaluation queries from the
/// same distribution (decode-time queries, never seen at prefill).
struct Head {
    idx_t n = 0;
    idx_t nq = 0;
    int heads = 1;
    std::vector<float> keys, values, prefill_q, eval_q;

    PrefillInput input() const {
        PrefillInput in;
        in.n_tokens = n;
        in.keys = keys.data();
        in.values = values.data();
        in.n_queries = nq;
        in.n_query_heads = heads;
        in.queries = prefill_q.data();
        in.rope.theta = 10000.0;
        return in;
    }
};

/// Unit vector of a seeded Gaussian direction.
std::vector<float> direction(uint64_t seed) {
    std::vector<float> e = gaussian(1, kD, seed);
    double norm = 0;
    for (float x : e) {
        norm += double(x) * x;
    }
    for (float& x : e) {
        x = float(x / std::sqrt(norm));
    }
    return e;
}

/** Sparse head: 4 heavy hitters of large norm (80) along a direction e that
 * every query makes a small angle with (cos ~ 0.2), so that they dominate
 * every softmax (score ~ 16 against ~ N(0, 1)) but collide in LSH tables
 * barely more often than any key: top-k finds them, sampling misses them. */
Head sparse_head(idx_t n, idx_t nq, int heads, idx_t n_eval, uint64_t seed) {
    Head h;
    h.n = n;
    h.nq = nq;
    h.heads = heads;
    h.keys = gaussian(n, kD, seed);
    h.values = gaussian(n, kDv, seed + 1, 1.0f, 0.5f);
    std::vector<float> e = direction(seed + 2);
    std::vector<float> noise = gaussian(4, kD, seed + 3);
    std::vector<float> heavy_v = gaussian(4, kDv, seed + 4, 3.0f);
    for (int j = 0; j < 4; j++) {
        idx_t id = (2 * j + 1) * n / 9;
        for (int c = 0; c < kD; c++) {
            h.keys[id * kD + c] = 80.0f * e[c] + noise[j * kD + c];
        }
        std::copy(heavy_v.begin() + j * kDv, heavy_v.begin() + (j + 1) * kDv,
                  h.values.begin() + id * kDv);
    }
    // q = 1.15 e + z, z orthogonal to e: |q| ~ sqrt(d), cos(q, e) ~ 0.2
    auto queries = [&](idx_t m, uint64_t s) {
        std::vector<float> q = gaussian(m, kD, s);
        for (idx_t i = 0; i < m; i++) {
            float* x = q.data() + i * kD;
            double along = 0;
            for (int c = 0; c < kD; c++) {
                along += double(x[c]) * e[c];
            }
            for (int c = 0; c < kD; c++) {
                x[c] += float((1.15 - along) * e[c]);
            }
        }
        return q;
    };
    h.prefill_q = queries(heads * nq, seed + 5);
    h.eval_q = queries(n_eval, seed + 6);
    return h;
}

/// Flat head: queries of small norm, attention near uniform over every key.
Head flat_head(idx_t n, idx_t nq, int heads, idx_t n_eval, uint64_t seed) {
    Head h;
    h.n = n;
    h.nq = nq;
    h.heads = heads;
    h.keys = gaussian(n, kD, seed);
    h.values = gaussian(n, kDv, seed + 1, 1.0f, 1.0f);
    h.prefill_q = gaussian(heads * nq, kD, seed + 5, 0.1f);
    h.eval_q = gaussian(n_eval, kD, seed + 6, 0.1f);
    return h;
}

/// Mean over the queries of ||o - o_exact|| / ||o_exact||, the exact output
/// from the double reference over every token of the head.
double mean_error(const KVIndex& index, const Head& h, const float* q, idx_t m) {
    std::vector<float> out(m * kDv), lse(m);
    index.attend(m, q, out.data(), lse.data());
    double sum = 0;
    for (idx_t i = 0; i < m; i++) {
        std::vector<double> ref;
        kvtest::ref_attention_all(q + i * kD, h.keys.data(), h.values.data(), kD, kDv, h.n, ref);
        double diff = 0, norm = 0;
        for (int c = 0; c < kDv; c++) {
            diff += (out[i * kDv + c] - ref[c]) * (out[i * kDv + c] - ref[c]);
            norm += ref[c] * ref[c];
        }
        sum += std::sqrt(diff / norm);
    }
    return sum / double(m);
}

/// The prefill input the candidates get: `in` without the held-back queries
/// (indices `held`), positions explicit.
struct SubInput {
    std::vector<float> q;
    std::vector<idx_t> pos;
    PrefillInput in;
};

SubInput without_holdout(const PrefillInput& in, const std::vector<idx_t>& held) {
    SubInput s;
    std::set<idx_t> out(held.begin(), held.end());
    std::vector<idx_t> rest;
    for (idx_t i = 0; i < in.n_queries; i++) {
        if (!out.count(i)) {
            rest.push_back(i);
            s.pos.push_back(in.query_positions ? in.query_positions[i]
                                               : in.n_tokens - in.n_queries + i);
        }
    }
    for (int h = 0; h < in.n_query_heads; h++) {
        for (idx_t i : rest) {
            const float* x = in.queries + (size_t(h) * in.n_queries + i) * kD;
            s.q.insert(s.q.end(), x, x + kD);
        }
    }
    s.in = in;
    s.in.n_queries = idx_t(rest.size());
    s.in.queries = s.q.data();
    s.in.query_positions = s.pos.data();
    return s;
}

/// The held-back queries of every head of the group, head-major.
std::vector<float> held_queries(const PrefillInput& in, const std::vector<idx_t>& held) {
    std::vector<float> q;
    for (int h = 0; h < in.n_query_heads; h++) {
        for (idx_t i : held) {
            const float* x = in.queries + (size_t(h) * in.n_queries + i) * kD;
            q.insert(q.end(), x, x + kD);
        }
    }
    return q;
}

IndexChoose& as_choose(KVIndex* index) {
    auto c = dynamic_cast<IndexChoose*>(index);
    EXPECT_TRUE(c) << index->type_name();
    return *c;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// attend, search and select give the same bits on both indexes.
void expect_same_answers(const KVIndex& a, const KVIndex& b, const float* q, idx_t m) {
    std::vector<float> oa(m * kDv), ob(m * kDv), la(m), lb(m);
    a.attend(m, q, oa.data(), la.data());
    b.attend(m, q, ob.data(), lb.data());
    EXPECT_TRUE(same_bits(oa, ob)) << "attend outputs differ";
    EXPECT_TRUE(same_bits(la, lb)) << "attend lse differ";
    const idx_t k = 7;
    std::vector<float> da(m * k), db(m * k);
    std::vector<idx_t> ia(m * k), ib(m * k);
    a.search(m, q, k, da.data(), ia.data());
    b.search(m, q, k, db.data(), ib.data());
    EXPECT_EQ(ia, ib);
    EXPECT_TRUE(same_bits(da, db));
    std::vector<Selection> sa(m), sb(m);
    a.select(m, q, sa.data());
    b.select(m, q, sb.data());
    for (idx_t i = 0; i < m; i++) {
        EXPECT_EQ(sa[i].ids, sb[i].ids);
        EXPECT_TRUE(same_bits(sa[i].inclusion, sb[i].inclusion));
    }
}

// top-k with a small budget against LSH sampling: opposite winners on the
// planted heads
const char* kPair = "Choose(TopK(Flat);LSHSample6x20)|k=8";

/// A candidate string built alone, with kPair's k=8 where it reads a k.
std::unique_ptr<KVIndex> alone_with_k8(const std::string& s) {
    auto index = index_factory(kD, s, kDv);
    if (index->reads_search_knob("k")) {
        set_index_parameters(index.get(), "k=8");
    }
    return index;
}

/// Each candidate's k: `k` where it reads one, else still the default.
void expect_candidates_k(const IndexChoose& choose, idx_t k) {
    for (size_t c = 0; c < choose.candidates.size(); c++) {
        const KVIndex& x = *choose.candidates[c];
        EXPECT_EQ(x.k, x.reads_search_knob("k") ? k : 100) << "candidate " << c;
    }
}

} // namespace

TEST(Choose, PlantedHeadsGetTheCandidateMeasuredBest) {
    const idx_t n = 2000, nq = 256, n_eval = 48;
    const int heads = 3; // a GQA group
    Head sparse = sparse_head(n, nq, heads, n_eval, 11);
    Head flat = flat_head(n, nq, heads, n_eval, 21);
    std::vector<int> picks;
    for (const Head* h : {&sparse, &flat}) {
        SCOPED_TRACE(h == &sparse ? "sparse head" : "flat head");
        auto index = index_factory(kD, kPair, kDv);
        IndexChoose& choose = as_choose(index.get());
        choose.set_stream(5);
        PrefillInput in = h->input();
        std::vector<idx_t> held = choose.choose_holdout(in);
        ASSERT_EQ(idx_t(held.size()), choose.n_holdout);
        index->prefill(in);
        ASSERT_GE(choose.chosen, 0);
        ASSERT_EQ(choose.errors.size(), 2u);
        EXPECT_EQ(index->ntotal, n);

        // each candidate built on its own from what the chooser gave it
        SubInput sub = without_holdout(in, held);
        std::vector<float> hq = held_queries(in, held);
        std::vector<double> eval_err, held_err;
        for (const std::string& s : choose.candidate_strings()) {
            auto c = alone_with_k8(s);
            c->set_stream(5);
            c->prefill(sub.in);
            eval_err.push_back(mean_error(*c, *h, h->eval_q.data(), n_eval));
            held_err.push_back(mean_error(*c, *h, hq.data(), idx_t(heads * held.size())));
        }
        // the recorded errors are the held-back errors, against exact
        // attention over every prompt token
        for (size_t c = 0; c < 2; c++) {
            EXPECT_NEAR(choose.errors[c], held_err[c], 1e-5 + 1e-4 * held_err[c]) << "candidate " << c;
        }
        // the choice is the candidate an independent measurement on other
        // queries finds best, by a clear margin
        int best = eval_err[0] <= eval_err[1] ? 0 : 1;
        EXPECT_EQ(choose.chosen, best) << "errors on evaluation queries: " << eval_err[0]
                                       << " " << eval_err[1];
        EXPECT_LT(1.5 * eval_err[best], eval_err[1 - best]);
        EXPECT_EQ(get_index_parameter(index.get(), "chosen"), double(choose.chosen));
        EXPECT_EQ(choose.chosen_string(), choose.candidate_strings()[choose.chosen]);
        picks.push_back(choose.chosen);
    }
    ASSERT_EQ(picks.size(), 2u);
    EXPECT_EQ(picks[0], 0) << "top-k for the sparse head";
    EXPECT_EQ(picks[1], 1) << "sampling for the flat head";
}

TEST(Choose, AfterPrefillItIsTheChosenCandidate) {
    // GQA group of 3, a stream of its own: the index answers as the chosen
    // candidate built separately from the same input, through decode appends
    const idx_t n = 800, nq = 120;
    for (int which = 0; which < 2; which++) {
        Head h = which == 0 ? sparse_head(n, nq, 3, 6, 31) : flat_head(n, nq, 3, 6, 41);
        auto index = index_factory(kD, kPair, kDv);
        IndexChoose& choose = as_choose(index.get());
        choose.set_stream(17);
        PrefillInput in = h.input();
        index->prefill(in);
        ASSERT_GE(choose.chosen, 0);
        SubInput sub = without_holdout(in, choose.choose_holdout(in));
        auto alone = alone_with_k8(choose.chosen_string());
        alone->set_stream(17);
        alone->prefill(sub.in);
        expect_same_answers(*index, *alone, h.eval_q.data(), 6);
        // the unchosen candidate holds nothing; children are the chosen one
        for (size_t c = 0; c < choose.candidates.size(); c++) {
            EXPECT_EQ(choose.candidates[c]->ntotal, int(c) == choose.chosen ? n : 0);
        }
        ASSERT_EQ(index->children().size(), 1u);
        EXPECT_EQ(index->children()[0], choose.chosen_index());
        EXPECT_EQ(index->top_k_budget(), choose.chosen_index()->top_k_budget());
        EXPECT_LT(index->memory_bytes(), alone->memory_bytes() + 64 * 1024);
        EXPECT_GE(index->memory_bytes(), alone->memory_bytes());
        // decode appends reach the chosen index
        std::vector<float> k = gaussian(10, kD, 99), v = gaussian(10, kDv, 98);
        for (int i = 0; i < 10; i++) {
            index->add_kv(1, k.data() + i * kD, v.data() + i * kDv);
            alone->add_kv(1, k.data() + i * kD, v.data() + i * kDv);
        }
        EXPECT_EQ(index->ntotal, n + 10);
        EXPECT_EQ(choose.chosen_index()->ntotal, n + 10);
        expect_same_answers(*index, *alone, h.eval_q.data(), 6);
        std::vector<float> key(kD), value(kDv);
        index->reconstruct(n + 3, key.data());
        index->reconstruct_value(n + 3, value.data());
        EXPECT_TRUE(std::equal(key.begin(), key.end(), k.begin() + 3 * kD));
        EXPECT_TRUE(std::equal(value.begin(), value.end(), v.begin() + 3 * kDv));
        index->reconstruct(5, key.data());
        EXPECT_TRUE(std::equal(key.begin(), key.end(), h.keys.begin() + 5 * kD));
        EXPECT_NO_THROW(index->check_invariants());
    }
}

TEST(Choose, HoldoutOfTheLatestQueries) {
    // the default: the latest queries before the last position, at most
    // half of the later half (99 queries but the last: the later 49, of
    // which 24), whatever the seed and stream
    Head h = flat_head(300, 100, 2, 1, 53);
    auto index = index_factory(kD, "Choose(Flat;TopK(Flat))", kDv);
    IndexChoose& choose = as_choose(index.get());
    EXPECT_EQ(get_index_parameter(index.get(), "recent_holdout"), 1.0);
    PrefillInput in = h.input();
    std::vector<idx_t> expect(24);
    std::iota(expect.begin(), expect.end(), idx_t(75));
    EXPECT_EQ(choose.choose_holdout(in), expect);
    choose.set_stream(3);
    set_index_parameter(index.get(), "seed", 99);
    EXPECT_EQ(choose.choose_holdout(in), expect);
    // by position, given out of order (query 0 is the last position)
    std::vector<idx_t> pos(100);
    for (idx_t i = 0; i < 100; i++) {
        pos[i] = 299 - 3 * i;
    }
    in.query_positions = pos.data();
    std::vector<idx_t> held = choose.choose_holdout(in);
    std::vector<idx_t> by_position = {24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13,
                                      12, 11, 10, 9,  8,  7,  6,  5,  4,  3,  2,  1};
    EXPECT_EQ(held, by_position);
    index->prefill(in);
    ASSERT_EQ(choose.holdout_positions.size(), 24u);
    EXPECT_EQ(choose.holdout_positions.front(), 299 - 3 * 24);
    EXPECT_EQ(choose.holdout_positions.back(), 299 - 3);
    EXPECT_THROW_MSG(set_index_parameter(index.get(), "recent_holdout", 2), "recent_holdout");
}

TEST(Choose, HoldoutSample) {
    Head h = flat_head(300, 100, 2, 1, 51);
    auto index = index_factory(kD, "Choose(Flat;TopK(Flat))|recent_holdout=0", kDv);
    IndexChoose& choose = as_choose(index.get());
    PrefillInput in = h.input();
    std::vector<idx_t> held = choose.choose_holdout(in);
    // at most half of the later half of the queries but the last (99 of
    // them: the later 49, of which 24), sorted, distinct
    ASSERT_EQ(held.size(), 24u);
    EXPECT_TRUE(std::is_sorted(held.begin(), held.end()));
    EXPECT_TRUE(std::adjacent_find(held.begin(), held.end()) == held.end());
    for (idx_t i : held) {
        EXPECT_GE(i, 50);
        EXPECT_LT(i, 99);
    }
    // deterministic; another stream or seed draws another sample
    EXPECT_EQ(choose.choose_holdout(in), held);
    auto twin = index_factory(kD, "Choose(Flat;TopK(Flat))|recent_holdout=0", kDv);
    EXPECT_EQ(as_choose(twin.get()).choose_holdout(in), held);
    choose.set_stream(3);
    std::vector<idx_t> other = choose.choose_holdout(in);
    EXPECT_NE(other, held);
    set_index_parameter(index.get(), "seed", 99);
    EXPECT_NE(choose.choose_holdout(in), other);
    // prefill records the positions it held back (the last 100 of 300)
    std::vector<idx_t> now = choose.choose_holdout(in);
    index->prefill(in);
    ASSERT_EQ(choose.holdout_positions.size(), now.size());
    for (size_t j = 0; j < now.size(); j++) {
        EXPECT_EQ(choose.holdout_positions[j], 200 + now[j]);
    }
    // clamped to a quarter of the queries
    set_index_parameter(twin.get(), "n_holdout", 4096);
    EXPECT_EQ(as_choose(twin.get()).choose_holdout(in).size(), 24u);
    in.n_queries = 9;
    EXPECT_EQ(as_choose(twin.get()).choose_holdout(in).size(), 2u);
    in.n_queries = 5;
    EXPECT_EQ(as_choose(twin.get()).choose_holdout(in).size(), 1u);
    in.n_queries = 4; // too few: nothing held back
    EXPECT_TRUE(as_choose(twin.get()).choose_holdout(in).empty());
    // positions given out of order: by position, the latest excepted
    std::vector<idx_t> pos(100);
    for (idx_t i = 0; i < 100; i++) {
        pos[i] = 299 - 3 * i; // decreasing
    }
    in = h.input();
    in.query_positions = pos.data();
    for (idx_t i : as_choose(twin.get()).choose_holdout(in)) {
        EXPECT_GE(i, 1);  // query 0 is the last position
        EXPECT_LT(i, 50); // the later half of the others
    }
}

TEST(Choose, DeterministicForAFixedSeedAndStream) {
    Head h = sparse_head(600, 80, 2, 4, 61);
    std::vector<std::unique_ptr<KVIndex>> runs;
    for (int r = 0; r < 2; r++) {
        runs.push_back(index_factory(kD, kPair, kDv));
        runs.back()->set_stream(8);
        runs.back()->prefill(h.input());
    }
    IndexChoose& a = as_choose(runs[0].get());
    IndexChoose& b = as_choose(runs[1].get());
    EXPECT_EQ(a.chosen, b.chosen);
    EXPECT_TRUE(same_bits(a.errors, b.errors));
    EXPECT_EQ(a.holdout_positions, b.holdout_positions);
    expect_same_answers(*runs[0], *runs[1], h.eval_q.data(), 4);
}

TEST(Choose, NoMeasurementTakesTheFirstCandidate) {
    Head h = sparse_head(200, 40, 1, 2, 71);
    // no queries, or too few: candidate 0, unmeasured
    for (idx_t nq : {0, 1, 4}) {
        auto index = index_factory(kD, "Choose(TopK(Flat);Flat)", kDv);
        PrefillInput in = h.input();
        in.n_queries = nq;
        index->prefill(in);
        IndexChoose& c = as_choose(index.get());
        EXPECT_EQ(c.chosen, 0);
        EXPECT_TRUE(c.errors.empty());
        EXPECT_TRUE(c.holdout_positions.empty());
        EXPECT_EQ(index->ntotal, 200);
        auto alone = index_factory(kD, "TopK(Flat)", kDv);
        alone->prefill(in);
        expect_same_answers(*index, *alone, h.eval_q.data(), 2);
    }
    // five queries (positions 195..199): one of 197, 198 held back
    auto five = index_factory(kD, "Choose(TopK(Flat);Flat)", kDv);
    PrefillInput in = h.input();
    in.n_queries = 5;
    five->prefill(in);
    ASSERT_EQ(as_choose(five.get()).holdout_positions.size(), 1u);
    idx_t p = as_choose(five.get()).holdout_positions[0];
    EXPECT_TRUE(p == 197 || p == 198) << p;
    EXPECT_EQ(as_choose(five.get()).errors.size(), 2u);

    // appends without a prefill go to candidate 0
    auto fresh = index_factory(kD, "Choose(TopK(Flat);Flat)", kDv);
    EXPECT_EQ(get_index_parameter(fresh.get(), "chosen"), -1.0);
    EXPECT_EQ(fresh->children().size(), 2u);
    fresh->add_kv(50, h.keys.data(), h.values.data());
    EXPECT_EQ(as_choose(fresh.get()).chosen, 0);
    EXPECT_TRUE(as_choose(fresh.get()).errors.empty());
    auto alone = index_factory(kD, "TopK(Flat)", kDv);
    alone->add_kv(50, h.keys.data(), h.values.data());
    expect_same_answers(*fresh, *alone, h.eval_q.data(), 2);
    EXPECT_NO_THROW(fresh->check_invariants());
}

TEST(Choose, ResetThenPrefillAgain) {
    Head sparse = sparse_head(700, 100, 2, 4, 81);
    Head flat = flat_head(700, 100, 2, 4, 91);
    auto index = index_factory(kD, kPair, kDv);
    IndexChoose& choose = as_choose(index.get());
    index->prefill(sparse.input());
    EXPECT_EQ(choose.chosen, 0);
    index->reset();
    EXPECT_EQ(index->ntotal, 0);
    EXPECT_EQ(choose.chosen, -1);
    EXPECT_TRUE(choose.errors.empty());
    EXPECT_TRUE(choose.holdout_positions.empty());
    EXPECT_EQ(index->children().size(), 2u);
    for (const auto& c : choose.candidates) {
        EXPECT_EQ(c->ntotal, 0);
    }
    expect_candidates_k(choose, 8); // the knobs stay
    EXPECT_NO_THROW(index->check_invariants());
    index->prefill(flat.input());
    // as a fresh index given the same prompt
    auto fresh = index_factory(kD, kPair, kDv);
    fresh->prefill(flat.input());
    EXPECT_EQ(choose.chosen, as_choose(fresh.get()).chosen);
    EXPECT_TRUE(same_bits(choose.errors, as_choose(fresh.get()).errors));
    expect_same_answers(*index, *fresh, flat.eval_q.data(), 4);
}

TEST(Choose, FactoryStrings) {
    for (const char* s :
         {"Choose(TopK(Flat);LSHSample6x20)", "Choose(TopK(Flat);Sink4,Window64,LSHSample10x150)",
          "Choose(Flat;TopK(IVF4,Flat);ProxyEvict20,TopK(HNSW8))",
          "Sink4,Window8,Choose(Flat;LSHSample6x20)", "BF16,Choose(TopK(Flat);Flat)",
          "Choose(Choose(Flat;TopK(Flat));Flat)",
          "Choose(Flat;Flat;Flat;Flat;Flat;Flat;Flat;Flat)"}) {
        SCOPED_TRACE(s);
        auto index = index_factory(kD, s, kDv);
        EXPECT_EQ(index_factory_string(index.get()), s);
        EXPECT_EQ(index_factory_string(index_factory(kD, index_factory_string(index.get()), kDv).get()), s);
        EXPECT_NO_THROW(index->check_invariants());
    }
    // the storage type applies to every candidate
    auto bf = index_factory(kD, "BF16,Choose(TopK(Flat);Flat)", kDv);
    for (const KVIndex* c : bf->children()) {
        EXPECT_EQ(c->kv_type, KVType::bf16);
        EXPECT_EQ(c->d, kD);
        EXPECT_EQ(c->d_value, kDv);
    }
    EXPECT_THROW_MSG(index_factory(kD, "Choose(Flat)", kDv), "2 to 8 candidates");
    EXPECT_THROW_MSG(index_factory(kD, "Choose()", kDv), "got 1");
    EXPECT_THROW_MSG(index_factory(kD, "Choose(Flat;)", kDv), "candidate 2 is empty");
    EXPECT_THROW_MSG(index_factory(kD, "Choose(;Flat)", kDv), "candidate 1 is empty");
    EXPECT_THROW_MSG(
            index_factory(kD, "Choose(Flat;Flat;Flat;Flat;Flat;Flat;Flat;Flat;Flat)", kDv),
            "got 9");
    EXPECT_THROW_MSG(index_factory(kD, "Choose(Flat;Bogus7)", kDv), "candidate 2 'Bogus7'");
    EXPECT_THROW_MSG(index_factory(kD, "Choose(Flat;Bogus7)", kDv), "cannot parse 'Bogus7'");
    EXPECT_THROW_MSG(index_factory(kD, "Choose(Flat;Flat,Flat)", kDv), "nothing may follow");
    EXPECT_THROW_MSG(index_factory(kD, "Choose(Flat;Sink4)", kDv), "candidate 2 'Sink4'");
    EXPECT_THROW_MSG(index_factory(kD, "Choose(Flat;Flat),Flat", kDv), "nothing may follow");
    EXPECT_THROW_MSG(index_factory(kD, "Choose(Flat;Flat", kDv), "unbalanced");
    EXPECT_THROW_MSG(index_factory(kD, "Choose(Flat;Flat)x", kDv), "expected Choose(");
    EXPECT_THROW_MSG(index_factory(kD, "Choose(Flat);Flat)", kDv), "unbalanced");
    EXPECT_THROW_MSG(index_factory(kD, "Choose(BF16,Flat;Flat)", kDv), "candidate 1");
}

TEST(Choose, Parameters) {
    Head h = flat_head(500, 80, 1, 2, 101);
    auto index = index_factory(kD, "Choose(Flat;TopK(Flat);ProxyEvict20)", kDv);
    IndexChoose& choose = as_choose(index.get());
    // before a choice a knob reaches every candidate that has it
    set_index_parameters(index.get(), resolve_percentages("k=2%", 500, index.get()));
    expect_candidates_k(choose, 10);
    set_index_parameters(index.get(), "n_holdout=16,seed=7");
    EXPECT_EQ(choose.n_holdout, 16);
    EXPECT_EQ(choose.seed, 7u);
    EXPECT_EQ(get_index_parameter(index.get(), "chosen"), -1.0);
    EXPECT_THROW_MSG(set_index_parameter(index.get(), "chosen", 1), "read-only");
    EXPECT_THROW_MSG(set_index_parameter(index.get(), "n_holdout", 0), "n_holdout=0");
    EXPECT_THROW_MSG(set_index_parameter(index.get(), "n_holdout", 5000), "n_holdout=5000");
    EXPECT_THROW_MSG(set_index_parameter(index.get(), "n_holdout", 2.5), "n_holdout=2.5");
    EXPECT_THROW_MSG(set_index_parameter(index.get(), "seed", -1), "seed=-1");
    std::vector<std::string> names;
    for (const ParameterInfo& p : index_parameter_info(index.get())) {
        names.push_back(p.name);
    }
    for (const char* want : {"n_holdout", "seed", "chosen", "k", "budget"}) {
        EXPECT_NE(std::find(names.begin(), names.end(), want), names.end()) << want;
    }

    index->prefill(h.input());
    ASSERT_EQ(choose.chosen, 0); // exact attention has no error
    EXPECT_EQ(choose.holdout_positions.size(), 16u);
    EXPECT_EQ(get_index_parameter(index.get(), "chosen"), 0.0);
    EXPECT_THROW_MSG(set_index_parameter(index.get(), "chosen", 0), "read-only");
    // prefill-time knobs are refused once tokens are in, the dormant
    // candidates' as the chooser's own
    EXPECT_THROW_MSG(set_index_parameter(index.get(), "n_holdout", 8), "prefill-time");
    EXPECT_THROW_MSG(set_index_parameter(index.get(), "budget", 10), "prefill-time");
    // search-time knobs reach the chosen and the dormant candidates
    set_index_parameter(index.get(), "k", 5);
    expect_candidates_k(choose, 5);
    EXPECT_EQ(get_index_parameter(index.get(), "k"), 5.0);
    EXPECT_THROW_MSG(set_index_parameter(index.get(), "k", 0), "k=0");
    expect_candidates_k(choose, 5); // a refused value changes nothing
    EXPECT_THROW_MSG(set_index_parameter(index.get(), "no_such_knob", 1), "no_such_knob");
    // a knob only a dormant candidate has is listed and read from it
    EXPECT_EQ(get_index_parameter(index.get(), "budget"), 0.0);
    names.clear();
    for (const ParameterInfo& p : index_parameter_info(index.get())) {
        names.push_back(p.name);
    }
    EXPECT_NE(std::find(names.begin(), names.end(), "budget"), names.end());
    index->reset();
    expect_candidates_k(choose, 5);
    set_index_parameter(index.get(), "budget", 10); // empty again: accepted
}

TEST(Choose, ARefusedItemLeavesEachCandidatesOwnKnob) {
    // per-candidate knobs are set on candidates[i] (the header's advice);
    // after a choice a refused set_index_parameters must give each
    // candidate its own value back, not the chosen one's
    Head h = flat_head(500, 80, 1, 2, 103);
    auto index = index_factory(kD, "Choose(Flat;TopK(Flat);ProxyEvict20)", kDv);
    IndexChoose& choose = as_choose(index.get());
    choose.candidates[1]->k = 7;
    choose.candidates[2]->k = 9;
    index->prefill(h.input());
    ASSERT_EQ(choose.chosen, 0);
    const idx_t before[3] = {choose.candidates[0]->k, 7, 9};
    EXPECT_THROW_MSG(set_index_parameters(index.get(), "k=50,no_such_knob=1"), "no_such_knob");
    EXPECT_THROW_MSG(set_index_parameters(index.get(), "k=60,n_holdout=8"), "prefill-time");
    for (size_t c = 0; c < 3; c++) {
        EXPECT_EQ(choose.candidates[c]->k, before[c]) << "candidate " << c;
    }
    // the chosen Flat reads no k: the first dormant candidate's that does
    EXPECT_EQ(get_index_parameter(index.get(), "k"), 7.0);
}

TEST(Choose, IoRoundTripIsBitIdentical) {
    Head h = sparse_head(400, 60, 3, 5, 111);
    auto index = index_factory(kD, "Choose(TopK(Flat);LSHSample6x20;Sink4,Window16,Flat)|k=8", kDv);
    index->set_stream(4);
    index->prefill(h.input());
    std::vector<float> k = gaussian(5, kD, 7), v = gaussian(5, kDv, 8);
    index->add_kv(5, k.data(), v.data());
    set_index_parameters(index.get(), "k=6");
    IndexChoose& choose = as_choose(index.get());
    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);
    auto copy = read_index(buf);
    IndexChoose& back = as_choose(copy.get());
    EXPECT_EQ(index_factory_string(copy.get()), index_factory_string(index.get()));
    EXPECT_EQ(back.chosen, choose.chosen);
    EXPECT_TRUE(same_bits(back.errors, choose.errors));
    EXPECT_EQ(back.holdout_positions, choose.holdout_positions);
    EXPECT_EQ(back.stream, 4u);
    EXPECT_EQ(copy->ntotal, index->ntotal);
    expect_same_answers(*index, *copy, h.eval_q.data(), 5);
    expect_candidates_k(back, 6); // the dormant candidates' knobs too
    std::vector<uint8_t> again;
    write_index(copy.get(), &again);
    EXPECT_TRUE(again == buf);

    // before any choice
    auto fresh = index_factory(kD, "Choose(Flat;TopK(Flat))", kDv);
    write_index(fresh.get(), &buf);
    auto fresh_copy = read_index(buf);
    EXPECT_EQ(as_choose(fresh_copy.get()).chosen, -1);
    EXPECT_EQ(fresh_copy->children().size(), 2u);
}

TEST(Choose, TruncatedOrInconsistentRecordsAreRefused) {
    // small, so that every truncation can be tried
    const int d = 4, dv = 3;
    std::vector<float> keys = gaussian(12, d, 1), values = gaussian(12, dv, 2);
    std::vector<float> q = gaussian(2 * 6, d, 3);
    auto index = index_factory(d, "Choose(Flat;TopK(Flat))|k=2", dv);
    PrefillInput in;
    in.n_tokens = 12;
    in.keys = keys.data();
    in.values = values.data();
    in.n_queries = 6;
    in.n_query_heads = 2;
    in.queries = q.data();
    index->prefill(in);
    ASSERT_EQ(as_choose(index.get()).errors.size(), 2u);
    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);
    for (size_t len = 0; len < buf.size(); len++) {
        std::vector<uint8_t> prefix(buf.begin(), buf.begin() + len);
        EXPECT_THROW(read_index(prefix.data(), len), faiss::FaissException) << "prefix " << len;
    }
    // fields that disagree are refused by check_invariants
    auto expect_refused = [&](auto&& spoil, const char* what) {
        auto copy = read_index(buf);
        IndexChoose& c = as_choose(copy.get());
        spoil(c);
        EXPECT_THROW_MSG(c.check_invariants(), what);
    };
    expect_refused([](IndexChoose& c) { c.chosen = 2; }, "chosen candidate 2");
    expect_refused([](IndexChoose& c) { c.chosen = 1 - c.chosen; }, "holds");
    expect_refused([](IndexChoose& c) { c.errors.resize(3); }, "errors");
    expect_refused([](IndexChoose& c) { c.holdout_positions.clear(); }, "holdout");
    expect_refused([](IndexChoose& c) { std::swap(c.errors[0], c.errors[1]); }, "lowest error");
    expect_refused([](IndexChoose& c) { c.errors[0] = -1; }, "negative");
    expect_refused([](IndexChoose& c) { c.n_holdout = 0; }, "n_holdout");
    expect_refused([](IndexChoose& c) { c.candidates.pop_back(); }, "1 candidates");
    expect_refused([](IndexChoose& c) { c.candidates[1] = index_factory(4, "Flat", 4); }, "candidate 1");
}

TEST(Choose, AdoptTrainedPairsCandidates) {
    Head h = flat_head(300, 40, 1, 1, 121);
    auto trained = index_factory(kD, "Choose(IVFAsym4;Flat)", kDv);
    // a trained part: the IVFAsym candidate self-trained on a prompt
    as_choose(trained.get()).candidates[0]->prefill(h.input());
    auto index = index_factory(kD, "Choose(IVFAsym4;Flat)", kDv);
    EXPECT_EQ(index->adopt_trained(*trained), 1);
    auto other = index_factory(kD, "Choose(IVFAsym4;Flat;Flat)", kDv);
    EXPECT_THROW_MSG(index->adopt_trained(*other), "same factory string");
    EXPECT_THROW_MSG(index->adopt_trained(*index_factory(kD, "Flat", kDv)), "same factory string");
    // after a choice too (the dormant candidates adopt for the next prefill)
    index->prefill(h.input());
    EXPECT_EQ(index->adopt_trained(*trained), 1);
}

TEST(Choose, RefusedPrefillLeavesItEmpty) {
    Head h = flat_head(200, 40, 1, 1, 131);
    // ProxyEvict needs prefill queries at the end of the prompt to score with
    auto index = index_factory(kD, "Choose(Flat;ProxyEvict20)", kDv);
    PrefillInput in = h.input();
    std::vector<idx_t> pos(40, 3); // every query at position 3: nothing late
    for (idx_t i = 0; i < 40; i++) {
        pos[i] = i;
    }
    in.query_positions = pos.data();
    EXPECT_THROW(index->prefill(in), faiss::FaissException);
    IndexChoose& c = as_choose(index.get());
    EXPECT_EQ(index->ntotal, 0);
    EXPECT_EQ(c.chosen, -1);
    for (const auto& x : c.candidates) {
        EXPECT_EQ(x->ntotal, 0);
    }
    EXPECT_NO_THROW(index->check_invariants());
    index->prefill(h.input()); // and it takes a good prompt
    EXPECT_EQ(c.chosen, 0);
}

TEST(Choose, QueryAwareCandidatesKeepTheLastQueries) {
    // a short prompt with a query per token: the held-back queries never
    // take the last one, which TOVA scores with, nor all of NaCl's window
    Head h = flat_head(64, 64, 2, 1, 141);
    for (const char* s : {"Choose(ProxyEvict20;Flat)", "Choose(ProxyEvict25_TOVA;TopK(Flat))",
                          "Choose(ProxyEvict30_H2O;Flat)"}) {
        SCOPED_TRACE(s);
        auto index = index_factory(kD, s, kDv);
        EXPECT_NO_THROW(index->prefill(h.input()));
        IndexChoose& c = as_choose(index.get());
        EXPECT_EQ(c.errors.size(), 2u);
        EXPECT_EQ(c.holdout_positions.size(), 15u); // 63 -> the later 31 -> 15
        EXPECT_LT(c.holdout_positions.back(), 63);
    }
}

TEST(Choose, PerHeadChoiceInAKVCache) {
    // one layer, 2 KV heads of 2 query heads each: a sparse and a flat head
    const idx_t n = 1500, nq = 200;
    Head heads[2] = {sparse_head(n, nq, 2, 4, 151), flat_head(n, nq, 2, 4, 161)};
    KVCache cache(1, 4, 2, kD, kDv, kPair);
    std::vector<float> keys, values, queries;
    for (const Head& h : heads) {
        keys.insert(keys.end(), h.keys.begin(), h.keys.end());
        values.insert(values.end(), h.values.begin(), h.values.end());
        queries.insert(queries.end(), h.prefill_q.begin(), h.prefill_q.end());
    }
    RopeParams rope;
    cache.prefill(0, n, keys.data(), values.data(), nq, queries.data(), nullptr, rope);
    const IndexChoose& a = as_choose(cache.index(0, 0));
    const IndexChoose& b = as_choose(cache.index(0, 1));
    EXPECT_EQ(a.chosen, 0); // top-k for the sparse head
    EXPECT_EQ(b.chosen, 1); // sampling for the flat head
    // the latest queries, the same positions on both heads
    EXPECT_EQ(a.holdout_positions, b.holdout_positions);
    EXPECT_EQ(a.holdout_positions.back(), n - 2);
    // each head is its chosen candidate
    for (int kv = 0; kv < 2; kv++) {
        const Head& h = heads[kv];
        const IndexChoose& c = as_choose(cache.index(0, kv));
        PrefillInput in = h.input();
        SubInput sub = without_holdout(in, c.choose_holdout(in));
        auto alone = alone_with_k8(c.chosen_string());
        alone->set_stream(c.stream);
        alone->prefill(sub.in);
        expect_same_answers(*cache.index(0, kv), *alone, h.eval_q.data(), 4);
    }
}

namespace {

/// Mean over the queries of (n_scanned + 2 * selected) / 2 of a select
/// with the scan counted: the tokens (keys and values) a query reads.
double mean_reads(const KVIndex& index, const float* q, idx_t m) {
    std::vector<Selection> sel(m);
    SearchParametersKV count;
    count.count_scanned = true;
    index.select(m, q, sel.data(), &count);
    double total = 0;
    for (const Selection& s : sel) {
        total += (double(s.n_scanned) + 2.0 * double(s.size())) / 2.0;
    }
    return total / double(m);
}

} // namespace

TEST(Choose, ABudgetPassesOverTheCandidatesThatReadMore) {
    // on a sparse head exact top-k errs least, but scores every key; a
    // uniform sample reads k tokens, eviction the budget it is given
    const idx_t n = 1200, nq = 160;
    Head h = sparse_head(n, nq, 2, 1, 171);
    const std::string s = "Choose(TopK(Flat);Uniform;ProxyEvict20_TOVA)";
    auto measure = [&](const std::string& params) {
        auto index = index_factory(kD, s + (params.empty() ? "" : "|" + params), kDv);
        index->set_stream(3);
        index->prefill(h.input());
        EXPECT_NO_THROW(index->check_invariants());
        return index;
    };
    // no budget: the lowest error, nothing read measured
    auto free = measure("k=8");
    const IndexChoose& f = as_choose(free.get());
    ASSERT_EQ(f.errors.size(), 3u);
    EXPECT_EQ(f.chosen, int(std::min_element(f.errors.begin(), f.errors.end()) - f.errors.begin()));
    EXPECT_TRUE(f.reads.empty());

    for (idx_t budget : {idx_t(300), idx_t(40), idx_t(1)}) {
        SCOPED_TRACE("budget " + std::to_string(budget));
        auto index = measure("k=8,budget=" + std::to_string(budget));
        const IndexChoose& c = as_choose(index.get());
        ASSERT_EQ(c.reads.size(), 3u);
        EXPECT_EQ(get_index_parameter(index.get(), "budget"), double(budget));
        // each candidate's reads recomputed from it built alone
        PrefillInput in = h.input();
        std::vector<idx_t> held = c.choose_holdout(in);
        SubInput sub = without_holdout(in, held);
        std::vector<float> hq = held_queries(in, held);
        std::vector<double> reads;
        for (const std::string& cs : c.candidate_strings()) {
            auto alone = index_factory(kD, cs, kDv);
            if (alone->reads_search_knob("k")) {
                set_index_parameters(alone.get(), "k=8");
            }
            if (cs.rfind("ProxyEvict", 0) == 0) {
                set_index_parameters(alone.get(), "budget=" + std::to_string(budget));
            }
            alone->set_stream(3);
            alone->prefill(sub.in);
            reads.push_back(mean_reads(*alone, hq.data(), idx_t(hq.size() / kD)));
        }
        for (size_t i = 0; i < 3; i++) {
            EXPECT_DOUBLE_EQ(c.reads[i], reads[i]) << "candidate " << i;
        }
        // top-k scores every key (n / 2 + k in tokens), the sample reads k,
        // eviction exactly the tokens it keeps
        EXPECT_DOUBLE_EQ(reads[0], n / 2.0 + 8);
        EXPECT_DOUBLE_EQ(reads[1], 8);
        EXPECT_DOUBLE_EQ(reads[2], double(budget));
        // the lowest error within the budget, else the least read
        int expect = -1;
        for (int i = 0; i < 3; i++) {
            if (reads[i] <= double(budget) && (expect < 0 || c.errors[i] < c.errors[expect])) {
                expect = i;
            }
        }
        if (expect < 0) {
            expect = int(std::min_element(reads.begin(), reads.end()) - reads.begin());
        }
        EXPECT_EQ(c.chosen, expect);
        EXPECT_LE(c.reads[c.chosen], std::max<double>(double(budget), *std::min_element(reads.begin(), reads.end())));
        // written and read back with its budget and reads
        std::vector<uint8_t> buf;
        write_index(index.get(), &buf);
        auto copy = read_index(buf);
        EXPECT_EQ(as_choose(copy.get()).budget, budget);
        EXPECT_TRUE(same_bits(as_choose(copy.get()).reads, c.reads));
        // a record whose choice breaks the budget is refused
        IndexChoose& spoilt = as_choose(copy.get());
        if (c.chosen != 0 && reads[0] > double(budget)) {
            std::swap(spoilt.candidates[0], spoilt.candidates[c.chosen]);
            spoilt.chosen = 0;
            spoilt.errors[0] = -0.0; // the lowest error, over the budget
            EXPECT_THROW_MSG(spoilt.check_invariants(), "within the budget");
        }
    }
    // 300 tokens: top-k is out (600 + 8), eviction keeps 300 and beats the
    // sample of 8 on the heavy hitters
    EXPECT_EQ(as_choose(measure("k=8,budget=300").get()).chosen, 2);
    // 1 token: nothing fits; eviction of one token reads least
    EXPECT_EQ(as_choose(measure("k=8,budget=1").get()).chosen, 2);
}

TEST(Choose, AutoIsChooseOverTheFastFamilies) {
    auto index = index_factory(kD, "Auto", kDv);
    const IndexChoose& c = as_choose(index.get());
    EXPECT_EQ(index_factory_string(index.get()),
              std::string("Choose(") + IndexChoose::kAutoCandidates + ")");
    EXPECT_EQ(c.candidates.size(), 4u);
    EXPECT_EQ(c.budget, 0);
    EXPECT_THROW_MSG(index_factory(kD, "Auto(Flat)", kDv), "Auto(Flat)");
    // with a budget of 2% of a 4000-token prompt, through resolve_percentages
    const idx_t n = 4000;
    Head h = sparse_head(n, 300, 2, 8, 181);
    IndexSpec spec = parse_index_spec("Auto|budget=2%");
    auto a = index_factory(kD, spec.factory, kDv);
    set_index_parameters(a.get(), resolve_percentages(spec.params, n, a.get()));
    EXPECT_EQ(get_index_parameter(a.get(), "budget"), 80.0);
    a->set_stream(2);
    a->prefill(h.input());
    const IndexChoose& ac = as_choose(a.get());
    ASSERT_EQ(ac.reads.size(), 4u);
    EXPECT_LE(ac.reads[ac.chosen], 80.0);
    // what it answers reads within the budget on other queries too, and
    // keeps the heavy hitters: far closer to exact than a uniform sample
    EXPECT_LE(mean_reads(*a, h.eval_q.data(), 8), 80.0);
    auto uniform = index_factory(kD, "Uniform|k=80", kDv);
    uniform->set_stream(2);
    uniform->prefill(h.input());
    EXPECT_LT(2 * mean_error(*a, h, h.eval_q.data(), 8), mean_error(*uniform, h, h.eval_q.data(), 8));
}

}  // namespace test_choose
