// Every kvindex type inside Faiss's own containers, as a Faiss-based serving
// stack holds indexes: faiss::IndexShards (token-range shards searched and
// merged by Faiss) and faiss::IndexReplicas (the queries split over copies).
// The children are filled through kvindex (prefill, add_kv) and then handed
// to the container; the reference is each child's own search, merged here.

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <faiss/IndexReplicas.h>
#include <faiss/IndexShards.h>
#include <faiss/impl/FaissAssert.h>

#include <kvindex/KVIndex.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>

#include "conformance_list.h"
#include "expect_throw.h"
#include "reference.h"

namespace test_faiss_containers {

using namespace kvindex;

namespace {

constexpr int kD = 16, kDv = 12, kGroup = 2;
constexpr idx_t kShardTokens = 160, kQ = 8, kK = 9;

/// A shard: tokens [first, first + kShardTokens) of one sequence, prefilled
/// with its group's queries at those positions.
std::unique_ptr<KVIndex> shard(const kvtest::ConformanceCase& c, idx_t first, const std::vector<float>& keys,
                               const std::vector<float>& values, const std::vector<float>& queries) {
    auto index = index_factory(kD, c.factory, kDv);
    if (*c.knobs) {
        set_index_parameters(index.get(), c.knobs);
    }
    PrefillInput in;
    in.n_tokens = kShardTokens;
    in.keys = keys.data() + first * kD;
    in.values = values.data() + first * kDv;
    std::vector<float> q(size_t(kGroup) * kShardTokens * kD);
    for (int h = 0; h < kGroup; h++) { // head-major [kGroup, n, d]
        std::copy_n(queries.data() + (size_t(h) * 2 * kShardTokens + first) * kD, kShardTokens * kD,
                    q.data() + size_t(h) * kShardTokens * kD);
    }
    in.n_queries = kShardTokens;
    in.n_query_heads = kGroup;
    in.queries = q.data();
    in.first_position = first;
    index->prefill(in);
    return index;
}

/// Two shards' worth of tokens, their prompt queries and the test queries,
/// from seeds base + 1 ... base + 4.
struct Tokens {
    std::vector<float> keys, values, prompt_queries, queries;
    explicit Tokens(uint64_t base)
            : keys(kvtest::gaussian(2 * kShardTokens, kD, base + 1, 1.0f, 0.3f)),
              values(kvtest::gaussian(2 * kShardTokens, kDv, base + 2)),
              prompt_queries(kvtest::gaussian(kGroup * 2 * kShardTokens, kD, base + 3, 1.5f)),
              queries(kvtest::gaussian(kQ, kD, base + 4, 2.0f)) {}
    std::unique_ptr<KVIndex> shard(const kvtest::ConformanceCase& c, idx_t first) const {
        return test_faiss_containers::shard(c, first, keys, values, prompt_queries);
    }
};

std::string param_name(const testing::TestParamInfo<kvtest::ConformanceCase>& info) {
    return kvtest::conformance_test_name(info.index, info.param);
}

} // namespace

class FaissContainers : public testing::TestWithParam<kvtest::ConformanceCase> {};

INSTANTIATE_TEST_SUITE_P(AllTypes, FaissContainers, testing::ValuesIn(kvtest::kConformance), param_name);

TEST_P(FaissContainers, ShardsSearchIsTheMergeOfTheirSearches) {
    const kvtest::ConformanceCase& c = GetParam();
    const Tokens t(10);
    const std::vector<float>& q = t.queries;
    auto a = t.shard(c, 0), b = t.shard(c, kShardTokens);

    faiss::IndexShards shards(kD, /*threaded=*/true, /*successive_ids=*/true);
    shards.add_shard(a.get());
    shards.add_shard(b.get());
    ASSERT_EQ(shards.ntotal, 2 * kShardTokens);
    ASSERT_EQ(shards.metric_type, faiss::METRIC_INNER_PRODUCT);
    std::vector<float> dist(kQ * kK);
    std::vector<idx_t> labels(kQ * kK);
    shards.search(kQ, q.data(), kK, dist.data(), labels.data());

    // the reference: each shard's own top-k, B's ids after A's, merged
    std::vector<float> da(kQ * kK), db(kQ * kK);
    std::vector<idx_t> la(kQ * kK), lb(kQ * kK);
    a->search(kQ, q.data(), kK, da.data(), la.data());
    b->search(kQ, q.data(), kK, db.data(), lb.data());
    for (idx_t i = 0; i < kQ; i++) {
        std::vector<std::pair<float, idx_t>> both;
        for (idx_t j = 0; j < kK; j++) {
            if (la[i * kK + j] >= 0) both.emplace_back(da[i * kK + j], la[i * kK + j]);
            if (lb[i * kK + j] >= 0) both.emplace_back(db[i * kK + j], lb[i * kK + j] + kShardTokens);
        }
        std::sort(both.begin(), both.end(), [](auto x, auto y) { return x.first > y.first; });
        for (idx_t j = 0; j < kK; j++) {
            SCOPED_TRACE("query " + std::to_string(i) + " rank " + std::to_string(j));
            if (j >= idx_t(both.size())) {
                EXPECT_EQ(labels[i * kK + j], -1);
                continue;
            }
            EXPECT_EQ(dist[i * kK + j], both[j].first);
            // ids agree but where two scores tie (either order is a merge)
            bool tie = (j > 0 && both[j - 1].first == both[j].first) ||
                    (j + 1 < idx_t(both.size()) && both[j + 1].first == both[j].first);
            if (!tie) {
                EXPECT_EQ(labels[i * kK + j], both[j].second);
            }
        }
    }
    // a container's add has no values: the error says what to do instead
    auto empty = index_factory(kD, c.factory, kDv);
    faiss::IndexShards fresh(kD, /*threaded=*/false, /*successive_ids=*/true);
    fresh.add_shard(empty.get());
    EXPECT_THROW_MSG(fresh.add(1, t.keys.data()), "add_shard");
    EXPECT_EQ(empty->ntotal, 0);
}

TEST_P(FaissContainers, ReplicasAnswerAsTheIndexDoes) {
    const kvtest::ConformanceCase& c = GetParam();
    const Tokens t(20);
    const std::vector<float>& q = t.queries;
    auto index = t.shard(c, 0);
    // replicas are copies (through kvindex's io): the queries split over them
    std::unique_ptr<KVIndex> r1 = clone_index(index.get()), r2 = clone_index(index.get());
    faiss::IndexReplicas replicas(kD, /*threaded=*/true);
    replicas.add_replica(r1.get());
    replicas.add_replica(r2.get());
    ASSERT_EQ(replicas.ntotal, kShardTokens);
    std::vector<float> dist(kQ * kK), ref_dist(kQ * kK);
    std::vector<idx_t> labels(kQ * kK), ref_labels(kQ * kK);
    replicas.search(kQ, q.data(), kK, dist.data(), labels.data());
    index->search(kQ, q.data(), kK, ref_dist.data(), ref_labels.data());
    EXPECT_EQ(dist, ref_dist);
    EXPECT_EQ(labels, ref_labels);
    EXPECT_THROW_MSG(replicas.add(1, t.keys.data()), "add_replica");
}

}  // namespace test_faiss_containers
