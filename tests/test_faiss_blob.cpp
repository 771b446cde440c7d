// The Faiss retriever inside a TopK record: every family kvindex accepts
// reads back; a truncated or corrupted blob is refused by kvindex's own
// validation before Faiss's reader (which leaks when it throws) ever sees it.
// The sanitizer job of scripts/run_tests.sh runs these under LeakSanitizer.

#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <faiss/IndexHNSW.h>
#include <faiss/IndexIVF.h>
#include <faiss/impl/io.h>
#include <faiss/index_io.h>

#include <kvindex/IndexTopK.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>

#include "expect_throw.h"
#include "forge.h"

namespace test_faiss_blob {

namespace {

using kvindex::idx_t;

constexpr int kD = 8;
constexpr idx_t kN = 300;

/// The families the validated reader accepts, one factory string each.
const char* const kFamilies[] = {
        "Flat",
        "SQ8",
        "SQfp16",
        "PQ4x4",
        "IVF4,Flat",
        "IVF4,SQ8",
        "IVF4,SQ4",
        "IVF4,PQ2x4",
        "IVF4_HNSW8,Flat",
        "HNSW8",
        "HNSW8_SQ8",
};

struct Saved {
    std::vector<uint8_t> buf;
    size_t begin = 0, end = 0; ///< the Faiss blob, buf[begin, end)
    /// its arrays (codes, lists, links), buf[first, second)
    std::vector<std::pair<size_t, size_t>> arrays;
};

Saved saved_topk(const std::string& family) {
    auto index = kvindex::index_factory(kD, "TopK(" + family + ")");
    std::mt19937 rng(7);
    std::normal_distribution<float> g;
    std::vector<float> kv(kN * kD);
    for (float& x : kv) {
        x = g(rng);
    }
    index->add_kv(kN, kv.data(), kv.data());
    Saved s;
    kvindex::IndexFileLayout layout;
    kvindex::write_index(index.get(), &s.buf, &layout);
    EXPECT_EQ(layout.faiss_ranges.size(), 1u) << family;
    s.begin = layout.faiss_ranges.at(0).first;
    s.end = layout.faiss_ranges.at(0).second;
    s.arrays = layout.faiss_array_ranges;
    return s;
}

/// Reads a forged buffer: it must either read into a consistent index or
/// throw, and an exception must never come from inside Faiss's reader (the
/// "unreadable" path, where Faiss leaks): kvindex must have refused first.
void expect_refused_before_faiss(std::vector<uint8_t> buf, const std::string& what) {
    kvtest::forge_header(buf);
    try {
        auto index = kvindex::read_index(buf);
        index->check_invariants();
    } catch (const std::exception& e) {
        EXPECT_EQ(std::string(e.what()).find("unreadable"), std::string::npos)
                << what << ": Faiss's own reader threw: " << e.what();
    }
}

TEST(FaissBlob, EveryAcceptedFamilyRoundTrips) {
    for (const char* family : kFamilies) {
        SCOPED_TRACE(family);
        Saved s = saved_topk(family);
        auto back = kvindex::read_index(s.buf);
        back->check_invariants();
        EXPECT_EQ(back->factory_string(), std::string("TopK(") + family + ")");
        std::vector<uint8_t> again;
        kvindex::write_index(back.get(), &again);
        EXPECT_EQ(again, s.buf);
    }
}

TEST(FaissBlob, UnreadableFamiliesAreRefusedAtTheFactory) {
    // each builds in Faiss, but the reader could not validate its blob
    for (const char* family : {"OPQ2,Flat", "PCA4,Flat", "PQ2x4fs", "HNSW8_PQ2", "RQ2x4", "IDMap,Flat"}) {
        SCOPED_TRACE(family);
        EXPECT_THROW_MSG(
                kvindex::index_factory(kD, std::string("TopK(") + family + ")"),
                "unsupported retriever");
    }
}

TEST(FaissBlob, EveryTruncationIsRefusedByKvindex) {
    for (const char* family : kFamilies) {
        SCOPED_TRACE(family);
        Saved s = saved_topk(family);
        size_t n = s.end - s.begin;
        // every cut between two fields; inside an array (read whole) its
        // first, middle and last bytes
        std::vector<bool> cut_at(n, true);
        for (auto [begin, end] : s.arrays) {
            for (size_t i = begin + 2; i + 1 < end; i++) {
                cut_at[i - s.begin] = i == (begin + end) / 2;
            }
        }
        for (size_t cut = 0; cut < n; cut++) {
            if (!cut_at[cut]) {
                continue;
            }
            std::vector<uint8_t> buf(s.buf.begin(), s.buf.begin() + s.begin + cut);
            buf.insert(buf.end(), s.buf.begin() + s.end, s.buf.end());
            uint64_t size = cut;
            std::memcpy(buf.data() + s.begin - sizeof(uint64_t), &size, sizeof(size));
            kvtest::forge_header(buf);
            EXPECT_THROW_MSG(kvindex::read_index(buf), "TopK retriever malformed");
        }
    }
}

TEST(FaissBlob, CorruptedBytesNeverReachFaissUnchecked) {
    for (const char* family : kFamilies) {
        SCOPED_TRACE(family);
        Saved s = saved_topk(family);
        // every byte of the blob's headers and sizes; in each array (codes,
        // lists, links: its elements read whole, then checked by one loop)
        // the bytes of its first, middle and last elements
        std::vector<bool> flip_at(s.buf.size(), false);
        std::fill(flip_at.begin() + s.begin, flip_at.begin() + s.end, true);
        size_t n_arrays = 0;
        for (auto [begin, end] : s.arrays) {
            ASSERT_TRUE(begin >= s.begin && end <= s.end && end - begin >= 64);
            n_arrays++;
            for (size_t i = begin + 8; i + 8 < end; i++) {
                const size_t mid = (begin + end) / 2 & ~size_t(7);
                flip_at[i] = i >= mid && i < mid + 8;
            }
        }
        EXPECT_GT(n_arrays, 0u);
        for (size_t i = s.begin; i < s.end; i++) {
            if (!flip_at[i]) {
                continue;
            }
            for (uint8_t flip : {uint8_t(0x80), uint8_t(0xff)}) {
                std::vector<uint8_t> buf = s.buf;
                buf[i] ^= flip;
                expect_refused_before_faiss(
                        std::move(buf), std::string(family) + " byte " + std::to_string(i - s.begin));
            }
        }
    }
}

/// Reads the Faiss blob of a saved TopK, lets `corrupt` change values (never
/// sizes) in the graph, writes it back in place and expects read_index to
/// refuse the file naming `message`. Faiss's HNSW search trusts the graph, so
/// such a file would otherwise segfault at the first search (found by
/// fuzz_read_index in an IVF's HNSW quantizer).
void expect_corrupt_graph_refused(
        const std::string& family,
        const std::function<void(faiss::HNSW&)>& corrupt,
        const std::string& message) {
    SCOPED_TRACE(family);
    Saved s = saved_topk(family);
    faiss::VectorIOReader reader;
    reader.data.assign(s.buf.begin() + s.begin, s.buf.begin() + s.end);
    std::unique_ptr<faiss::Index> ret(faiss::read_index(&reader));
    faiss::IndexHNSW* hnsw = dynamic_cast<faiss::IndexHNSW*>(ret.get());
    if (auto ivf = dynamic_cast<faiss::IndexIVF*>(ret.get())) {
        hnsw = dynamic_cast<faiss::IndexHNSW*>(ivf->quantizer);
    }
    ASSERT_NE(hnsw, nullptr);
    corrupt(hnsw->hnsw);
    faiss::VectorIOWriter writer;
    faiss::write_index(ret.get(), &writer);
    ASSERT_EQ(writer.data.size(), s.end - s.begin);
    std::copy(writer.data.begin(), writer.data.end(), s.buf.begin() + s.begin);
    kvtest::forge_header(s.buf);
    EXPECT_THROW_MSG(kvindex::read_index(s.buf), message);
}

/// The first node with a list on `level` and the first one without.
std::pair<int, int> nodes_around_level(const faiss::HNSW& h, int level) {
    int above = -1, below = -1;
    for (int i = 0; i < int(h.levels.size()); i++) {
        int& slot = h.levels[i] > level ? above : below;
        if (slot < 0) {
            slot = i;
        }
    }
    return {above, below};
}

TEST(FaissBlob, CorruptHnswGraphsAreRefused) {
    // a neighbour id past the quantizer's centroids (the quantizer's graph
    // was not checked at all before)
    expect_corrupt_graph_refused(
            "IVF4_HNSW8,Flat",
            [](faiss::HNSW& h) { h.neighbors[0] = 4; },
            "HNSW node 0: neighbour 4");
    // an upper-level link to a node that has no list on that level
    expect_corrupt_graph_refused(
            "HNSW8",
            [](faiss::HNSW& h) {
                auto [above, below] = nodes_around_level(h, 1);
                ASSERT_GE(above, 0);
                ASSERT_GE(below, 0);
                size_t begin, end;
                h.neighbor_range(above, 1, &begin, &end);
                h.neighbors[begin] = below;
            },
            "not a node of level 1");
    // an entry point below the top level
    expect_corrupt_graph_refused(
            "HNSW8",
            [](faiss::HNSW& h) {
                ASSERT_GE(h.max_level, 1);
                h.entry_point = nodes_around_level(h, 1).second;
            },
            "is not on the top level");
}

} // namespace

}  // namespace test_faiss_blob
