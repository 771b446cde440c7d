// Arrays that grow with the cache grow by 1/4 of their capacity, not by
// std::vector's doubling: after the prompt and after every decode append
// each holds at most ~1.25x what it uses (+1/16 after a bulk add). Checked
// array by array on the fields each index type exposes, against their
// sizes, so that a doubled array fails here even where memory_bytes()
// would not show it.

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <faiss/IndexFlat.h>
#include <faiss/IndexHNSW.h>
#include <faiss/IndexIVF.h>
#include <faiss/invlists/InvertedLists.h>

#include <kvindex/IndexLSHSample.h>
#include <kvindex/IndexProxyEvict.h>
#include <kvindex/IndexRoarGraph.h>
#include <kvindex/IndexTopK.h>
#include <kvindex/impl/growth.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>

#include "reference.h"

namespace test_memory_growth {

using namespace kvindex;

namespace {

constexpr int kD = 32;
constexpr idx_t kPrompt = 3000;
constexpr idx_t kDecode = 400;

/// 1/4 growth peaks at 1.25x right after a step; the slack is for arrays
/// of a few entries, where one entry is a large share.
constexpr double kMaxHeadroom = 1.3;

template <class V>
void expect_headroom(const V& v, const std::string& what) {
    EXPECT_LE(double(v.capacity()), kMaxHeadroom * double(v.size()) + 8)
            << what << ": capacity " << v.capacity() << " for " << v.size() << " in use";
}

/// A prompt of kPrompt tokens with one query head's prefill queries, then
/// kDecode appends; `check` runs after the prompt and after every append.
template <class Check>
void prefill_and_decode(KVIndex* index, const Check& check) {
    std::vector<float> keys = kvtest::gaussian(kPrompt + kDecode, kD, 11, 1.0f, 0.3f);
    std::vector<float> values = kvtest::gaussian(kPrompt + kDecode, kD, 12);
    std::vector<float> queries = kvtest::gaussian(kPrompt, kD, 13, 1.5f);
    PrefillInput in;
    in.n_tokens = kPrompt;
    in.keys = keys.data();
    in.values = values.data();
    in.n_queries = kPrompt;
    in.n_query_heads = 1;
    in.queries = queries.data();
    index->prefill(in);
    check("after the prompt");
    for (idx_t i = kPrompt; i < kPrompt + kDecode; i++) {
        index->add_kv(1, keys.data() + i * kD, values.data() + i * kD);
        index->add_queries(1, queries.data() + (i - kPrompt) * kD);
        check("after token " + std::to_string(i));
        if (testing::Test::HasFailure()) {
            return; // one report, not four hundred
        }
    }
}

template <class T>
T* as(KVIndex* index) {
    auto t = dynamic_cast<T*>(index);
    EXPECT_NE(t, nullptr);
    return t;
}

} // namespace

TEST(MemoryGrowth, TokenStorage) {
    auto index = index_factory(kD, "Flat");
    const KVStorage& s = *index->stored_tokens();
    prefill_and_decode(index.get(), [&](const std::string& when) {
        expect_headroom(s.keys, "keys " + when);
        expect_headroom(s.values, "values " + when);
    });
}

TEST(MemoryGrowth, LSHSampleCodesAndNorms) {
    auto index = index_factory(kD, "LSHSample8x20");
    auto lsh = as<IndexLSHSample>(index.get());
    prefill_and_decode(index.get(), [&](const std::string& when) {
        expect_headroom(lsh->codes, "codes " + when);
        expect_headroom(lsh->norms, "norms " + when);
    });
}

TEST(MemoryGrowth, RoarGraphEdgesAndAnchors) {
    auto index = index_factory(kD, "RoarGraph16");
    auto g = as<IndexRoarGraph>(index.get());
    prefill_and_decode(index.get(), [&](const std::string& when) {
        expect_headroom(g->neighbors, "neighbors " + when);
        expect_headroom(g->degrees, "degrees " + when);
        expect_headroom(g->in_degrees, "in_degrees " + when);
        expect_headroom(g->anchor_queries, "anchor_queries " + when);
        expect_headroom(g->anchor_lists, "anchor_lists " + when);
    });
    EXPECT_GT(g->n_learned, 0) << "no decode query was kept as an anchor: the anchors were not grown";
}

TEST(MemoryGrowth, TopKHNSWListsAndNoCopyOfTheKeys) {
    for (const char* s : {"TopK(HNSW16)", "BF16,TopK(HNSW16)"}) {
        auto index = index_factory(kD, s);
        auto topk = as<IndexTopK>(index.get());
        prefill_and_decode(index.get(), [&](const std::string& when) {
            auto graph = dynamic_cast<faiss::IndexHNSW*>(topk->retriever.get());
            ASSERT_NE(graph, nullptr);
            ASSERT_EQ(graph->ntotal, index->ntotal) << when;
            // the graph scores the storage's keys: it holds no rows of its
            // own, and the index holds the storage and the graph, no more
            EXPECT_EQ(dynamic_cast<faiss::IndexFlatCodes*>(graph->storage), nullptr) << s;
            const faiss::HNSW& h = graph->hnsw;
            EXPECT_EQ(index->memory_bytes(),
                      topk->storage.memory_bytes() + capacity_bytes(h.assign_probas) +
                              capacity_bytes(h.cum_nneighbor_per_level) + capacity_bytes(h.levels) +
                              capacity_bytes(h.offsets) + capacity_bytes(h.neighbors))
                    << s << " " << when;
            expect_headroom(h.neighbors, "HNSW neighbours " + when);
            expect_headroom(h.levels, "HNSW levels " + when);
            expect_headroom(h.offsets, "HNSW offsets " + when);
        });
    }
}

TEST(MemoryGrowth, TopKIVFLists) {
    auto index = index_factory(kD, "TopK(IVF16,Flat)");
    auto topk = as<IndexTopK>(index.get());
    prefill_and_decode(index.get(), [&](const std::string& when) {
        auto ivf = dynamic_cast<faiss::IndexIVF*>(topk->retriever.get());
        ASSERT_NE(ivf, nullptr);
        auto lists = dynamic_cast<faiss::ArrayInvertedLists*>(ivf->invlists);
        ASSERT_NE(lists, nullptr);
        ASSERT_EQ(ivf->ntotal, index->ntotal) << when;
        for (size_t l = 0; l < lists->nlist; l++) {
            expect_headroom(lists->ids[l], "list " + std::to_string(l) + " ids " + when);
            expect_headroom(lists->codes[l], "list " + std::to_string(l) + " vectors " + when);
        }
    });
}

TEST(MemoryGrowth, ProxyEvictPositions) {
    auto index = index_factory(kD, "ProxyEvict30_H2O,TopK(Flat)");
    auto evict = as<IndexProxyEvict>(index.get());
    prefill_and_decode(index.get(), [&](const std::string& when) {
        expect_headroom(evict->positions, "positions " + when);
    });
}

TEST(MemoryGrowth, MemoryBytesCountsWhatIsHeld) {
    // memory_bytes() counts capacities: never below what a copy read back
    // from a file (arrays sized to their use) reports, and at most the
    // headroom above it
    for (const char* s : {"TopK(HNSW16)", "TopK(IVF16,Flat)", "RoarGraph16", "LSHSample8x20"}) {
        auto index = index_factory(kD, s);
        prefill_and_decode(index.get(), [](const std::string&) {});
        std::vector<uint8_t> buf;
        write_index(index.get(), &buf);
        auto read_back = read_index(buf);
        double held = double(index->memory_bytes()), tight = double(read_back->memory_bytes());
        EXPECT_LE(held, kMaxHeadroom * tight) << s;
        EXPECT_GE(held, 0.9 * tight) << s;
    }
}

}  // namespace test_memory_growth
