// Token-range shards (IndexKVShards): exact shards merge to exact attention,
// search is the merge of the shards' top-k, a top-k budget is per shard,
// appends open shards at T, one shard answers as its chain alone.

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/IndexIVFAsym.h>
#include <kvindex/IndexKVShards.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>

#include "expect_throw.h"
#include "reference.h"

namespace test_shards {

using namespace kvindex;
using kvtest::gaussian;

namespace {

constexpr int kD = 16;
constexpr int kDv = 12;
constexpr idx_t kN = 300;      ///< tokens in all
constexpr idx_t kPrompt = 130; ///< prefilled; the rest appended

struct Tokens {
    std::vector<float> keys = gaussian(kN, kD, 11, 1.0f, 0.2f);
    std::vector<float> values = gaussian(kN, kDv, 12);
    std::vector<float> queries = gaussian(kN, kD, 13, 2.0f);
};

const Tokens& tokens() {
    static const Tokens t;
    return t;
}

PrefillInput prompt(idx_t n) {
    const Tokens& t = tokens();
    PrefillInput in;
    in.n_tokens = n;
    in.keys = t.keys.data();
    in.values = t.values.data();
    in.n_queries = n;
    in.queries = t.queries.data();
    return in;
}

IndexKVShards& as_shards(KVIndex* index) {
    auto s = dynamic_cast<IndexKVShards*>(index);
    EXPECT_NE(s, nullptr);
    return *s;
}

void expect_shard_sizes(const IndexKVShards& s) {
    const idx_t T = s.shard_tokens;
    ASSERT_EQ(idx_t(s.shards.size()), (s.ntotal + T - 1) / T);
    for (size_t i = 0; i < s.shards.size(); i++) {
        EXPECT_EQ(s.shards[i]->ntotal, std::min(T, s.ntotal - idx_t(i) * T)) << "shard " << i;
    }
}

} // namespace

TEST(Shards, ExactShardsGiveExactAttentionAndSearchWhileDecoding) {
    const Tokens& t = tokens();
    for (const char* s : {"Shards64(Flat)", "Shards1(Flat)", "Shards37(Sink2,Window5,Flat)", "Shards1000(Flat)"}) {
        auto index = index_factory(kD, s, kDv);
        index->prefill(prompt(kPrompt));
        // appends of 1, then 70 at once (crossing several shards), then 1s
        for (idx_t p = kPrompt; p < kN;) {
            const idx_t m = p == kPrompt + 5 ? 70 : 1;
            index->add_kv(m, t.keys.data() + p * kD, t.values.data() + p * kDv);
            p += m;
            expect_shard_sizes(as_shards(index.get()));
            const float* q = t.queries.data() + (p - 1) * kD;
            std::vector<float> out(kDv);
            float lse;
            index->attend(1, q, out.data(), &lse);
            std::vector<double> ref;
            double ref_lse = kvtest::ref_attention_all(q, t.keys.data(), t.values.data(), kD, kDv, p, ref);
            ASSERT_LT(kvtest::rel_max_err(out.data(), ref), 1e-5) << s << " at " << p;
            ASSERT_NEAR(lse, ref_lse, 1e-4 * std::max(1.0, std::abs(ref_lse))) << s << " at " << p;
            // search: the exact top-k of all tokens, ties to the lower position
            const idx_t k = 9;
            std::vector<float> dis(k);
            std::vector<idx_t> ids(k);
            index->search(1, q, k, dis.data(), ids.data());
            EXPECT_EQ(ids, kvtest::ref_topk(q, t.keys.data(), kD, p, k)) << s << " at " << p;
        }
    }
}

TEST(Shards, TopKBudgetIsPerShard) {
    // attention over the union of each shard's own top-k: what a
    // context-parallel decode computes when every shard selects k
    const Tokens& t = tokens();
    const idx_t T = 50, k = 6;
    auto index = index_factory(kD, "Shards50(TopK(Flat))|k=6", kDv);
    index->prefill(prompt(kN));
    for (idx_t qi : {0, 77, 299}) {
        const float* q = t.queries.data() + qi * kD;
        std::vector<idx_t> ids;
        for (idx_t s0 = 0; s0 < kN; s0 += T) {
            const idx_t m = std::min(T, kN - s0);
            for (idx_t id : kvtest::ref_topk(q, t.keys.data() + s0 * kD, kD, m, k)) {
                ids.push_back(s0 + id);
            }
        }
        std::vector<double> ref;
        double ref_lse = kvtest::ref_attention(q, t.keys.data(), t.values.data(), kD, kDv, ids, nullptr, ref);
        std::vector<float> out(kDv);
        float lse;
        index->attend(1, q, out.data(), &lse);
        EXPECT_LT(kvtest::rel_max_err(out.data(), ref), 1e-5) << "query " << qi;
        EXPECT_NEAR(lse, ref_lse, 1e-4 * std::max(1.0, std::abs(ref_lse)));
        Selection sel;
        index->select(1, q, &sel);
        std::vector<idx_t> got = sel.ids;
        std::sort(got.begin(), got.end());
        std::sort(ids.begin(), ids.end());
        EXPECT_EQ(got, ids) << "query " << qi;
    }
}

TEST(Shards, OneShardAnswersAsItsChainBitForBit) {
    // a context within T: shard 0 is the chain, on the stream this index
    // was given, so even a sampler draws the same sample
    const Tokens& t = tokens();
    for (const char* chain : {"LSHSample6x20", "Sink2,Window8,IVFAsym4_Centroid", "Hybrid(TopK(Flat),Uniform)"}) {
        auto alone = index_factory(kD, chain, kDv);
        auto sharded = index_factory(kD, std::string("Shards1000(") + chain + ")", kDv);
        alone->set_stream(7);
        sharded->set_stream(7);
        alone->prefill(prompt(kPrompt));
        sharded->prefill(prompt(kPrompt));
        alone->add_kv(20, t.keys.data() + kPrompt * kD, t.values.data() + kPrompt * kDv);
        sharded->add_kv(20, t.keys.data() + kPrompt * kD, t.values.data() + kPrompt * kDv);
        const idx_t nq = 4;
        std::vector<float> a(nq * kDv), b(nq * kDv), la(nq), lb(nq);
        alone->attend(nq, t.queries.data(), a.data(), la.data());
        sharded->attend(nq, t.queries.data(), b.data(), lb.data());
        EXPECT_EQ(a, b) << chain;
        EXPECT_EQ(la, lb) << chain;
    }
}

TEST(Shards, ShardsDrawApartAndKnobsReachShardsOpenedLater) {
    const Tokens& t = tokens();
    auto index = index_factory(kD, "Shards40(Uniform)|k=5", kDv);
    index->set_stream(3);
    index->prefill(prompt(100));
    index->add_kv(60, t.keys.data() + 100 * kD, t.values.data() + 100 * kDv); // opens shards 3 and 4
    IndexKVShards& s = as_shards(index.get());
    ASSERT_EQ(s.shards.size(), 4u);
    std::set<uint64_t> streams;
    for (size_t i = 0; i < s.shards.size(); i++) {
        EXPECT_EQ(s.shards[i]->k, 5) << "shard " << i;
        streams.insert(s.shard_stream(i));
    }
    EXPECT_EQ(streams.size(), 4u);
    EXPECT_EQ(s.shard_stream(0), 3u);
    // a knob set now reaches every shard and the shards opened after it
    set_index_parameter(index.get(), "k", 7);
    index->add_kv(1, t.keys.data() + 160 * kD, t.values.data() + 160 * kDv);
    ASSERT_EQ(s.shards.size(), 5u);
    for (const auto& shard : s.shards) {
        EXPECT_EQ(shard->k, 7);
    }
}

TEST(Shards, PrefillGivesEachShardItsPositions) {
    // IVFAsym undoes RoPE at each key's absolute position: a shard must
    // know where its tokens start, in the prompt and when an append opens
    // it, and how many tokens the caller keeps after it (n_after)
    const Tokens& t = tokens();
    auto index = index_factory(kD, "Shards64(IVFAsym4_Centroid)", kDv);
    PrefillInput in = prompt(kPrompt);
    in.first_position = 5;
    in.n_after = 3;
    index->prefill(in);
    // one append of 100 (filling shard 2, opening 3 and 4), then one of 70
    index->add_kv(100, t.keys.data() + kPrompt * kD, t.values.data() + kPrompt * kDv);
    index->add_kv(kN - kPrompt - 100, t.keys.data() + (kPrompt + 100) * kD,
                  t.values.data() + (kPrompt + 100) * kDv);
    IndexKVShards& s = as_shards(index.get());
    ASSERT_EQ(s.shards.size(), 5u);
    for (size_t i = 0; i < s.shards.size(); i++) {
        auto shard = dynamic_cast<const IndexIVFAsym*>(s.shards[i].get());
        ASSERT_NE(shard, nullptr);
        const idx_t i0 = idx_t(i) * 64;
        EXPECT_EQ(shard->first_position, 5 + i0) << "shard " << i;
        // every shard places the decode query at the newest token's position
        EXPECT_EQ(shard->first_position + shard->ntotal + shard->n_after, 5 + kN + 3) << "shard " << i;
        EXPECT_TRUE(shard->has_rope) << "shard " << i;
    }
    // and the io keeps them: the copy answers alike
    auto copy = clone_index(index.get());
    std::vector<float> a(kDv), b(kDv);
    index->attend(1, t.queries.data(), a.data(), nullptr);
    copy->attend(1, t.queries.data(), b.data(), nullptr);
    EXPECT_EQ(a, b);
    EXPECT_EQ(as_shards(copy.get()).shards.size(), 5u);
}

TEST(Shards, BadStringsAreRefusedNamingTheProblem) {
    EXPECT_THROW_MSG(index_factory(kD, "Shards0(Flat)", kDv), "must be >= 1");
    EXPECT_THROW_MSG(index_factory(kD, "Shards(Flat)", kDv), "Shards<T>(<chain>)");
    EXPECT_THROW_MSG(index_factory(kD, "Shards64", kDv), "Shards<T>(<chain>)");
    EXPECT_THROW_MSG(index_factory(kD, "Shards64()", kDv), "Shards<T>(<chain>)");
    EXPECT_THROW_MSG(index_factory(kD, "Shards64(Flat,Flat)", kDv), "nothing may follow");
    EXPECT_THROW_MSG(index_factory(kD, "Shards64(Nope)", kDv), "cannot parse 'Nope'");
    EXPECT_THROW_MSG(index_factory(kD, "Shards99999999999999(Flat)", kDv), "Shards<T>(<chain>)");
    // the string round trips, its storage type reaching every shard
    auto index = index_factory(kD, "BF16,Shards8(Sink1,Window2,TopK(Flat))", kDv);
    EXPECT_EQ(index_factory_string(index.get()), "BF16,Shards8(Sink1,Window2,TopK(Flat))");
    EXPECT_EQ(as_shards(index.get()).empty_shard->kv_type, KVType::bf16);
}

TEST(Shards, AShardWrittenThroughAReferenceIsNamed) {
    const Tokens& t = tokens();
    auto index = index_factory(kD, "Shards64(Flat)", kDv);
    index->prefill(prompt(kPrompt));
    as_shards(index.get()).shards[1]->add_kv(1, t.keys.data(), t.values.data());
    std::vector<float> out(kDv);
    EXPECT_THROW_MSG(index->attend(1, t.queries.data(), out.data(), nullptr), "shard 1");
    index->reset();
    EXPECT_EQ(as_shards(index.get()).shards.size(), 0u);
    index->prefill(prompt(kPrompt));
    EXPECT_NO_THROW(index->attend(1, t.queries.data(), out.data(), nullptr));
}

}  // namespace test_shards
