// write_cache / read_cache (index_io.h) and KVCache::adopt_trained: a cache
// read back attends bit-identically (before and after decode appends); a
// truncated, mislabelled or forged file throws naming the problem.

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <faiss/impl/FaissException.h>

#include <kvindex/IndexIVFAsym.h>
#include <kvindex/KVCache.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>

#include "expect_throw.h"
#include "forge.h"
#include "reference.h"

namespace test_cache_io {

using namespace kvindex;

namespace {

constexpr int kLayers = 2, kQHeads = 4, kKVHeads = 2, kD = 16;
const char* kString = "Sink4,Window8,LSHSample6x20";
constexpr size_t kHeader = kvtest::kIndexHeaderSize; // same header layout

RopeParams test_rope() {
    return RopeParams{500000.0, RopeStyle::interleaved};
}

/// Seeded offline models (C centroids, a Q-model, test_rope()) set on the
/// IVFAsym of one head's chain, as kvllm train sets its trained ones.
void set_models(KVIndex* head, int C, uint64_t seed) {
    ivf_asym_in_chain(head)->set_trained(kvtest::gaussian(C, kD, seed), QModel(kD, 8, C, seed), test_rope());
}

/// The same on every head of `cache`, head (l, h) from seed0 + 10 l + h;
/// the last head of the last layer keeps none when `skip_last`.
void set_models_on_every_head(KVCache& cache, int C, uint64_t seed0, bool skip_last = false) {
    for (int l = 0; l < kLayers; l++) {
        for (int h = 0; h < kKVHeads; h++) {
            if (!(skip_last && l == kLayers - 1 && h == kKVHeads - 1)) {
                set_models(cache.index(l, h), C, seed0 + 10 * l + h);
            }
        }
    }
}

/// Keys / values [n_kv_heads, n, d] and queries [n_q_heads, n, d] of a layer.
struct LayerTokens {
    std::vector<float> keys, values, queries;
};

LayerTokens tokens(int layer, idx_t n, uint64_t seed) {
    uint64_t s = seed + 100 * layer;
    return {kvtest::gaussian(kKVHeads * n, kD, s, 1.0f, 0.3f),
            kvtest::gaussian(kKVHeads * n, kD, s + 1),
            kvtest::gaussian(kQHeads * n, kD, s + 2, 2.0f)};
}

/// A cache with layer 0 dense ("Flat"), prefilled with n tokens and their queries.
std::unique_ptr<KVCache> prefilled(idx_t n, const std::string& index_string = kString) {
    auto cache = std::make_unique<KVCache>(kLayers, kQHeads, kKVHeads, kD, kD, index_string, "Flat", std::vector<int>{0});
    for (int l = 0; l < kLayers; l++) {
        LayerTokens t = tokens(l, n, 7);
        cache->prefill(l, n, t.keys.data(), t.values.data(), n, t.queries.data(), nullptr, test_rope());
    }
    return cache;
}

/// Outputs and lse of every layer for a few seeded queries.
std::vector<float> attend_all(const KVCache& cache, uint64_t seed) {
    const idx_t nq = 3;
    std::vector<float> all;
    for (int l = 0; l < kLayers; l++) {
        std::vector<float> q = kvtest::gaussian(kQHeads * nq, kD, seed + l, 2.0f);
        std::vector<float> out(kQHeads * nq * kD), lse(kQHeads * nq);
        cache.attend(l, nq, q.data(), out.data(), lse.data());
        all.insert(all.end(), out.begin(), out.end());
        all.insert(all.end(), lse.begin(), lse.end());
    }
    return all;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void append_same(KVCache& a, KVCache& b, idx_t n, uint64_t seed) {
    for (int l = 0; l < kLayers; l++) {
        LayerTokens t = tokens(l, n, seed);
        for (idx_t i = 0; i < n; i++) {
            // one token per call: head-major [n_kv_heads, 1, d]
            std::vector<float> k, v;
            for (int h = 0; h < kKVHeads; h++) {
                k.insert(k.end(), t.keys.begin() + (h * n + i) * kD, t.keys.begin() + (h * n + i + 1) * kD);
                v.insert(v.end(), t.values.begin() + (h * n + i) * kD, t.values.begin() + (h * n + i + 1) * kD);
            }
            a.append(l, 1, k.data(), v.data());
            b.append(l, 1, k.data(), v.data());
        }
    }
}

template <class T>
void put(std::vector<uint8_t>& buf, size_t pos, T x) {
    std::memcpy(buf.data() + pos, &x, sizeof(T));
}

} // namespace

TEST(CacheIO, RoundTripIsBitIdentical) {
    auto cache = prefilled(120);
    std::vector<uint8_t> buf;
    write_cache(*cache, &buf);
    std::unique_ptr<KVCache> back = read_cache(buf);
    EXPECT_EQ(back->n_layers, kLayers);
    EXPECT_EQ(back->n_q_heads, kQHeads);
    EXPECT_EQ(back->n_kv_heads, kKVHeads);
    EXPECT_EQ(back->d, kD);
    EXPECT_EQ(back->d_value, kD);
    EXPECT_EQ(back->index_string, kString);
    EXPECT_EQ(back->dense_string, "Flat");
    EXPECT_EQ(back->dense_layers, std::vector<int>{0});
    EXPECT_TRUE(back->has_rope);
    EXPECT_TRUE(back->rope == test_rope());
    EXPECT_EQ(index_factory_string(back->index(0, 1)), "Flat");
    EXPECT_EQ(index_factory_string(back->index(1, 0)), kString);
    for (int l = 0; l < kLayers; l++) {
        EXPECT_EQ(back->n_tokens(l), 120);
    }
    EXPECT_TRUE(same_bits(attend_all(*cache, 50), attend_all(*back, 50)));
    // the read indexes keep working as decode appends
    append_same(*cache, *back, 9, 60);
    EXPECT_TRUE(same_bits(attend_all(*cache, 70), attend_all(*back, 70)));
    // and write back to the same bytes
    std::vector<uint8_t> again, original;
    write_cache(*back, &again);
    write_cache(*cache, &original);
    EXPECT_EQ(again, original);
}

TEST(CacheIO, FileRoundTrip) {
    auto cache = prefilled(40);
    const std::string path = ::testing::TempDir() + "kvindex_test_cache.kvc";
    write_cache(*cache, path);
    std::unique_ptr<KVCache> back = read_cache(path);
    EXPECT_TRUE(same_bits(attend_all(*cache, 80), attend_all(*back, 80)));
    std::remove(path.c_str());
    EXPECT_THROW_MSG(read_cache(path), path);
    const std::string bad = ::testing::TempDir() + "kvindex_no_such_dir/cache.kvc";
    EXPECT_THROW_MSG(write_cache(*cache, bad), bad);
}

TEST(CacheIO, EmptyCacheRoundTrip) {
    KVCache cache(kLayers, kQHeads, kKVHeads, kD, kD, kString);
    std::vector<uint8_t> buf;
    write_cache(cache, &buf);
    std::unique_ptr<KVCache> back = read_cache(buf);
    EXPECT_FALSE(back->has_rope);
    EXPECT_TRUE(back->dense_layers.empty());
    EXPECT_EQ(back->n_tokens(1), 0);
}

TEST(CacheIO, EveryTruncationThrows) {
    // Every prefix; and with the header rewritten to agree, so that the
    // parser, not the size check, must catch it: every prefix that cuts the
    // cache's own fields or the first record's, then one in 17 (each costs
    // a checksum and a parse of up to 23 kB, mostly LSH projections).
    auto cache = prefilled(14);
    std::vector<uint8_t> buf;
    write_cache(*cache, &buf);
    ASSERT_NO_THROW(read_cache(buf));
    for (size_t len = 0; len < buf.size(); len++) {
        std::vector<uint8_t> prefix(buf.begin(), buf.begin() + len);
        EXPECT_THROW(read_cache(prefix.data(), len), faiss::FaissException) << "prefix " << len;
        if (len >= kHeader && (len < kHeader + 400 || len % 17 == 0 || len + 64 > buf.size())) {
            kvtest::forge_header(prefix);
            EXPECT_THROW(read_cache(prefix), faiss::FaissException) << "forged prefix " << len;
        }
    }
}

TEST(CacheIO, HeaderErrors) {
    auto cache = prefilled(14);
    std::vector<uint8_t> buf;
    write_cache(*cache, &buf);

    std::vector<uint8_t> b = buf;
    b[1] ^= 0x20;
    EXPECT_THROW_MSG(read_cache(b), "magic");
    for (uint32_t version : {0u, kCacheFormatVersion + 1}) {
        b = buf;
        put(b, 4, version);
        EXPECT_THROW_MSG(read_cache(b), "version " + std::to_string(version));
    }
    b = buf;
    b[kHeader + 50] ^= 1;
    EXPECT_THROW_MSG(read_cache(b), "checksum");
    b = buf;
    b.push_back(0);
    kvtest::forge_header(b);
    EXPECT_THROW_MSG(read_cache(b), "trailing");
    EXPECT_THROW_MSG(read_cache(nullptr, 10), "nullptr");

    // an index file is not a cache, nor the other way round
    std::vector<uint8_t> index_file;
    write_index(cache->index(1, 0), &index_file);
    EXPECT_THROW_MSG(read_cache(index_file), "read_index");
    EXPECT_THROW_MSG(read_index(buf), "magic");
}

TEST(CacheIO, ForgedShapeThrows) {
    auto cache = prefilled(14);
    std::vector<uint8_t> buf;
    write_cache(*cache, &buf);
    // payload: i32 n_layers, n_q_heads, n_kv_heads, d, d_value, then strings
    const size_t n_layers = kHeader, n_q = kHeader + 4, n_kv = kHeader + 8, d = kHeader + 12,
                 d_value = kHeader + 16;
    struct Forgery {
        size_t pos;
        int32_t value;
        const char* message;
    };
    const Forgery cases[] = {
            {n_layers, 0, "n_layers=0"},
            {n_layers, 1 << 30, "n_layers=1073741824"},
            {n_layers, 3, "3 layers x 2 KV heads"},  // record count
            {n_layers, 1, "1 layers x 2 KV heads"},
            {n_q, 3, "n_q_heads=3 is not a multiple of n_kv_heads=2"},
            {n_q, -4, "n_q_heads=-4"},
            {n_kv, 4, "4 KV heads"},                  // 4 q heads, 2 x 4 records
            {n_kv, 1, "1 KV heads"},
            {d, 8, "d=16 d_value=16, the cache d=8"},
            {d, 0, "d=0"},
            {d_value, 32, "the cache d=16 d_value=32"},
            {d_value, 1 << 20, "d_value=1048576"},
    };
    for (const Forgery& f : cases) {
        std::vector<uint8_t> b = buf;
        put(b, f.pos, f.value);
        kvtest::forge_header(b);
        EXPECT_THROW_MSG(read_cache(b), f.message);
    }
}

TEST(CacheIO, ForgedFieldsThrow) {
    auto cache = prefilled(14);
    std::vector<uint8_t> buf;
    write_cache(*cache, &buf);
    // after the shape: u64 length + index string, u64 length + dense string,
    // u64 count + i32 dense layers, u8 has_rope, f64 theta, u8 style, u32
    // index format, u64 record count
    size_t pos = kHeader + 20;
    const size_t index_string = pos;
    pos += 8 + std::strlen(kString);
    pos += 8 + 4; // "Flat"
    const size_t dense_count = pos, dense_layer = pos + 8;
    pos += 8 + 4;
    pos += 1;
    const size_t theta = pos, style = pos + 8, index_format = pos + 9, count = pos + 13;

    std::vector<uint8_t> b = buf;
    put<int32_t>(b, dense_layer, 2);
    kvtest::forge_header(b);
    EXPECT_THROW_MSG(read_cache(b), "dense layer 2 outside");

    b = buf;
    put<uint64_t>(b, dense_count, uint64_t(1) << 40);
    kvtest::forge_header(b);
    EXPECT_THROW_MSG(read_cache(b), "dense layers claims");

    b = buf;
    put<uint64_t>(b, index_string, uint64_t(-1));
    kvtest::forge_header(b);
    // named by the cache's reader, the count as read (it printed as -1,
    // after "read_index:")
    EXPECT_THROW_MSG(read_cache(b), "index string claims 18446744073709551615 elements");

    b = buf;
    b[index_string + 8] = 'X'; // "Xink4,...": the string no longer parses
    kvtest::forge_header(b);
    EXPECT_THROW(read_cache(b), faiss::FaissException);

    b = buf;
    put<double>(b, theta, -1.0);
    kvtest::forge_header(b);
    EXPECT_THROW_MSG(read_cache(b), "theta");

    b = buf;
    b[style] = 7;
    kvtest::forge_header(b);
    EXPECT_THROW_MSG(read_cache(b), "style 7");

    b = buf;
    put<uint32_t>(b, index_format, kIndexFormatVersion + 1);
    kvtest::forge_header(b);
    EXPECT_THROW_MSG(read_cache(b), "format version " + std::to_string(kIndexFormatVersion + 1));

    b = buf;
    put<uint64_t>(b, count, uint64_t(1) << 62);
    kvtest::forge_header(b);
    EXPECT_THROW_MSG(read_cache(b), "index records");
}

TEST(CacheIO, RecordOfAnotherTypeThrows) {
    // records built from one string under a header that names another
    auto cache = prefilled(14);
    cache->index_string = "Sink4,Window8,Flat";
    std::vector<uint8_t> buf;
    write_cache(*cache, &buf);
    EXPECT_THROW_MSG(read_cache(buf), "its layer's string builds 'Sink4,Window8,Flat'");
}

TEST(CacheAdopt, NothingTrainedOfflineAdoptsNothing) {
    auto trained = prefilled(30);
    KVCache cache(kLayers, kQHeads, kKVHeads, kD, kD, kString, "Flat", {0});
    EXPECT_EQ(cache.adopt_trained(*trained), 0);
    // the dense layers are skipped: layer 0 of a cache without dense layers
    // is a Sink/Window chain, ours a Flat, and that is no mismatch
    KVCache all_sparse(kLayers, kQHeads, kKVHeads, kD, kD, kString);
    EXPECT_EQ(cache.adopt_trained(all_sparse), 0);
}

TEST(CacheAdopt, MismatchThrows) {
    KVCache cache(kLayers, kQHeads, kKVHeads, kD, kD, kString);
    KVCache layers(kLayers + 1, kQHeads, kKVHeads, kD, kD, kString);
    EXPECT_THROW_MSG(cache.adopt_trained(layers), "3 layers x 2 KV heads");
    KVCache heads(kLayers, kQHeads, 1, kD, kD, kString);
    EXPECT_THROW_MSG(cache.adopt_trained(heads), "2 layers x 1 KV heads");
    KVCache dim(kLayers, kQHeads, kKVHeads, 2 * kD, kD, kString);
    EXPECT_THROW_MSG(cache.adopt_trained(dim), "d=32");
    KVCache chain(kLayers, kQHeads, kKVHeads, kD, kD, "Flat");
    EXPECT_THROW_MSG(cache.adopt_trained(chain), "same factory string");
}

TEST(CacheAdopt, OfflineModelsSurviveTheFileAndAreAdopted) {
    // what kvllm train writes: an empty cache whose IVFAsym indexes hold models
    const char* s = "Sink2,Window8,IVFAsym4";
    const int C = 4;
    KVCache trained(kLayers, kQHeads, kKVHeads, kD, kD, s);
    set_models_on_every_head(trained, C, 300);
    std::vector<uint8_t> buf;
    write_cache(trained, &buf);
    std::unique_ptr<KVCache> back = read_cache(buf);

    // layer 0 is dense (Flat): skipped, so only layer 1's heads adopt
    KVCache from_file(kLayers, kQHeads, kKVHeads, kD, kD, s, "Flat", {0});
    KVCache direct(kLayers, kQHeads, kKVHeads, kD, kD, s, "Flat", {0});
    EXPECT_EQ(from_file.adopt_trained(*back), kKVHeads);
    EXPECT_EQ(direct.adopt_trained(trained), kKVHeads);
    for (int h = 0; h < kKVHeads; h++) {
        const IndexIVFAsym* a = ivf_asym_in_chain(from_file.index(1, h));
        const IndexIVFAsym* t = ivf_asym_in_chain(trained.index(1, h));
        ASSERT_TRUE(a && t);
        EXPECT_EQ(a->centroids, t->centroids);
        EXPECT_EQ(a->qmodel.w1, t->qmodel.w1);
        EXPECT_EQ(a->qmodel.b2, t->qmodel.b2);
    }
    // the same models: the same attention, bit for bit (one bucket of four
    // read, so that the Q-model's choice matters)
    const idx_t n = 60;
    for (int l = 0; l < kLayers; l++) {
        LayerTokens tk = tokens(l, n, 9);
        for (KVCache* c : {&from_file, &direct}) {
            if (l == 1) {
                for (int h = 0; h < kKVHeads; h++) set_index_parameters(c->index(l, h), "nprobe=1");
            }
            c->prefill(l, n, tk.keys.data(), tk.values.data(), n, tk.queries.data(), nullptr, test_rope());
        }
    }
    EXPECT_TRUE(same_bits(attend_all(from_file, 90), attend_all(direct, 90)));

    // another probe over the same chain adopts too
    KVCache centroid(kLayers, kQHeads, kKVHeads, kD, kD, "Sink2,Window8,IVFAsym4_Centroid");
    EXPECT_EQ(centroid.adopt_trained(*back), kLayers * kKVHeads);
    // another C does not
    KVCache other_c(kLayers, kQHeads, kKVHeads, kD, kD, "Sink2,Window8,IVFAsym8");
    EXPECT_THROW_MSG(other_c.adopt_trained(*back), "C=4");
}

TEST(CacheAdopt, ARefusedHeadLeavesEveryHeadAsItWas) {
    // adopt_trained checks every head before any adopts: a refusal in the
    // last head used to leave the heads before it with the new models
    const char* s = "Sink2,Window8,IVFAsym4";
    const int C = 4;
    KVCache trained(kLayers, kQHeads, kKVHeads, kD, kD, s);
    set_models_on_every_head(trained, C, 500, /*skip_last=*/true); // the last head trained nothing
    auto adopted_heads = [&](const KVCache& c) {
        int n = 0;
        for (int l = 0; l < kLayers; l++) {
            for (int h = 0; h < kKVHeads; h++) {
                const IndexIVFAsym* x = ivf_asym_in_chain(c.index(l, h));
                n += x->adopted || !x->centroids.empty();
            }
        }
        return n;
    };
    KVCache cache(kLayers, kQHeads, kKVHeads, kD, kD, s);
    EXPECT_THROW_MSG(cache.adopt_trained(trained), "layer 1, KV head 1: adopt_trained: the trained IndexIVFAsym has no centroids");
    EXPECT_EQ(adopted_heads(cache), 0);

    // a head holding tokens refuses (its buckets were made with other
    // models): layer 1 prefilled, layer 0 not, and layer 0 adopts nothing
    set_models(trained.index(1, 1), C, 599);
    const idx_t n = 40;
    LayerTokens tk = tokens(1, n, 11);
    cache.prefill(1, n, tk.keys.data(), tk.values.data(), n, tk.queries.data(), nullptr, test_rope());
    std::vector<float> centroids_before = ivf_asym_in_chain(cache.index(1, 0))->centroids;
    ASSERT_FALSE(centroids_before.empty()); // self-trained at the prefill
    EXPECT_THROW_MSG(cache.adopt_trained(trained), "layer 1, KV head 0: IndexIVFAsym: models can only be set on an empty index");
    EXPECT_EQ(ivf_asym_in_chain(cache.index(0, 0))->centroids.size(), 0u);
    EXPECT_EQ(ivf_asym_in_chain(cache.index(0, 1))->centroids.size(), 0u);
    EXPECT_EQ(ivf_asym_in_chain(cache.index(1, 0))->centroids, centroids_before);
    EXPECT_FALSE(ivf_asym_in_chain(cache.index(1, 0))->adopted);
    cache.check_invariants();

    // emptied, every head adopts; not while a call runs on a layer
    cache.reset();
    {
        ReadScope running(cache.layer_calls[1], "attend", "layer 1");
        EXPECT_THROW_MSG(cache.adopt_trained(trained), "KVCache::adopt_trained");
        EXPECT_EQ(adopted_heads(cache), 0);
    }
    EXPECT_EQ(cache.adopt_trained(trained), kLayers * kKVHeads);
    EXPECT_EQ(adopted_heads(cache), kLayers * kKVHeads);
    EXPECT_EQ(ivf_asym_in_chain(cache.index(1, 1))->centroids,
              ivf_asym_in_chain(trained.index(1, 1))->centroids);
}

TEST(CacheAdopt, AChainChecksEveryChildFirstAndKeepsTheModelsRoPE) {
    // the same within one index: of two IVFAsym candidates, the second's
    // pair untrained, the first adopts nothing
    auto trained = index_factory(kD, "Choose(IVFAsym4;IVFAsym4_Centroid)", kD);
    set_models(trained->mutable_children()[0], 4, 71);
    const IndexIVFAsym* first = ivf_asym_in_chain(trained->mutable_children()[0]);
    auto index = index_factory(kD, "Choose(IVFAsym4;IVFAsym4_Centroid)", kD);
    EXPECT_THROW_MSG(index->adopt_trained(*trained), "has no centroids");
    EXPECT_TRUE(ivf_asym_in_chain(index->mutable_children()[0])->centroids.empty());
    EXPECT_FALSE(ivf_asym_in_chain(index->mutable_children()[0])->adopted);
    ivf_asym_in_chain(trained->mutable_children()[1])
            ->set_trained(kvtest::gaussian(4, kD, 72), QModel(), test_rope());
    EXPECT_EQ(index->adopt_trained(*trained), 2);
    EXPECT_EQ(ivf_asym_in_chain(index->mutable_children()[0])->centroids, first->centroids);

    // a prefill under another RoPE than the models' is refused, again after
    // the refusal emptied the chain (which fixes no RoPE, but keeps the
    // models'), and theirs is taken
    LayerTokens t = tokens(0, 60, 17);
    PrefillInput in;
    in.n_tokens = 60;
    in.keys = t.keys.data();
    in.values = t.values.data();
    in.n_queries = 60;
    in.queries = t.queries.data();
    in.rope = RopeParams{10000.0, RopeStyle::half};
    for (int attempt = 0; attempt < 2; attempt++) {
        EXPECT_THROW_MSG(index->prefill(in), "RoPE parameters mismatch");
        EXPECT_EQ(index->ntotal, 0);
    }
    in.rope = test_rope();
    index->prefill(in);
    EXPECT_EQ(index->ntotal, 60);
}

TEST(CacheAdopt, ABareIVFAsymCacheKeepsItsModelsRoPEUntilPrefill) {
    // without wrappers the head itself carries the adopted models' RoPE
    // while empty: the cache took that for a head out of step, so neither
    // the trained cache kvllm train builds nor an adopting one could be
    // saved, checked or attended
    const int C = 4;
    KVCache trained(kLayers, kQHeads, kKVHeads, kD, kD, "IVFAsym4");
    set_models_on_every_head(trained, C, 700);
    trained.check_invariants();
    std::vector<uint8_t> buf;
    write_cache(trained, &buf);
    std::unique_ptr<KVCache> back = read_cache(buf);
    KVCache cache(kLayers, kQHeads, kKVHeads, kD, kD, "IVFAsym4");
    EXPECT_EQ(cache.adopt_trained(*back), kLayers * kKVHeads);
    cache.check_invariants();
    write_cache(cache, &buf);
    EXPECT_NO_THROW(read_cache(buf));

    // the models' RoPE still binds at prefill: another is refused, again
    // after a refusal (which emptied the layer and fixed no RoPE, but kept
    // the models'), and theirs is taken
    const idx_t n = 40;
    LayerTokens tk = tokens(0, n, 13);
    for (int attempt = 0; attempt < 2; attempt++) {
        EXPECT_THROW_MSG(cache.prefill(0, n, tk.keys.data(), tk.values.data(), n, tk.queries.data(), nullptr,
                                       RopeParams{10000.0, RopeStyle::half}),
                         "RoPE parameters mismatch");
    }
    for (int l = 0; l < kLayers; l++) {
        LayerTokens t = tokens(l, n, 13);
        cache.prefill(l, n, t.keys.data(), t.values.data(), n, t.queries.data(), nullptr, test_rope());
    }
    cache.check_invariants();
    EXPECT_EQ(ivf_asym_in_chain(cache.index(1, 1))->centroids, ivf_asym_in_chain(trained.index(1, 1))->centroids);
    std::vector<float> q = kvtest::gaussian(kQHeads, kD, 14), out(kQHeads * kD);
    cache.attend(1, 1, q.data(), out.data(), nullptr);
}

TEST(CacheIO, HeadsOutOfStepAreRefusedByTheCacheAndItsFiles) {
    // index(l, h) hands out a head: a write through it leaves the layer's
    // heads with different lengths, which every later call on the layer,
    // write_cache and (for a forged file) read_cache refuse by name
    auto cache = prefilled(40);
    LayerTokens t = tokens(1, 5, 31);
    cache->index(1, 1)->add_kv(5, t.keys.data(), t.values.data());
    std::vector<float> q = kvtest::gaussian(kQHeads, kD, 32), out(kQHeads * kD);
    EXPECT_THROW_MSG(cache->attend(1, 1, q.data(), out.data(), nullptr), "KV head 1 holds 45 tokens");
    EXPECT_THROW_MSG(cache->append(1, 5, t.keys.data(), t.values.data()), "KV head 1 holds 45 tokens");
    EXPECT_THROW_MSG(cache->check_invariants(), "layer 1");
    std::vector<uint8_t> buf;
    EXPECT_THROW_MSG(write_cache(*cache, &buf), "KV head 1 holds 45 tokens");
    cache->attend(0, 1, q.data(), out.data(), nullptr); // the other layer is untouched

    // a head with another RoPE than the cache's
    auto other = std::make_unique<KVCache>(kLayers, kQHeads, kKVHeads, kD, kD, kString, "Flat", std::vector<int>{0});
    LayerTokens t0 = tokens(0, 40, 7);
    other->prefill(0, 40, t0.keys.data(), t0.values.data(), 0, nullptr, nullptr, test_rope());
    PrefillInput in;
    in.n_tokens = 5;
    in.keys = t.keys.data();
    in.values = t.values.data();
    in.rope = RopeParams{10000.0, RopeStyle::half};
    other->index(1, 0)->prefill(in);
    other->index(1, 1)->prefill(in);
    EXPECT_THROW_MSG(other->check_invariants(), "RoPE theta=10000");
}

}  // namespace test_cache_io
