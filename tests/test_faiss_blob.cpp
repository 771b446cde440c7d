// The Faiss retriever inside a TopK record: every family kvindex accepts
// reads back; a truncated or corrupted blob is refused by kvindex's own
// validation before Faiss's reader (which leaks when it throws) ever sees it.
// The sanitizer job of scripts/run_tests.sh runs these under LeakSanitizer.

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/IndexTopK.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>

#include "expect_throw.h"
#include "forge.h"

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
    std::vector<std::pair<size_t, size_t>> ranges;
    kvindex::write_index(index.get(), &s.buf, &ranges);
    EXPECT_EQ(ranges.size(), 1u) << family;
    s.begin = ranges.at(0).first;
    s.end = ranges.at(0).second;
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
        // every cut in the first 512 bytes (the headers), then every 61st
        for (size_t cut = 0; cut < n; cut += cut < 512 ? 1 : 61) {
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
        size_t n = s.end - s.begin;
        for (size_t i = 0; i < n; i += i < 512 ? 1 : 37) {
            for (uint8_t flip : {uint8_t(0x80), uint8_t(0xff)}) {
                std::vector<uint8_t> buf = s.buf;
                buf[s.begin + i] ^= flip;
                expect_refused_before_faiss(
                        std::move(buf), std::string(family) + " byte " + std::to_string(i));
            }
        }
    }
}

} // namespace
