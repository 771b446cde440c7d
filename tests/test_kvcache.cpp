// KVCache: GQA mapping, dense layers, decode appends, exceptions from heads.

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <faiss/impl/FaissAssert.h>

#include <kvindex/IndexKVFlat.h>
#include <kvindex/IndexTopK.h>
#include <kvindex/KVCache.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>

#include "conformance_list.h"
#include "expect_throw.h"
#include "reference.h"

namespace test_kvcache {

using namespace kvindex;
using kvtest::gaussian;

namespace {
constexpr int kLayers = 2, kQHeads = 6, kKVHeads = 2, kD = 16, kDv = 8;
}

TEST(KVCache, GQAAndDecodeMatchTheReference) {
    idx_t n_prompt = 100, n_total = 140;
    KVCache cache(kLayers, kQHeads, kKVHeads, kD, kDv, "Sink2,Window8,TopK(Flat)", "Flat", {0});
    EXPECT_EQ(index_factory_string(cache.index(0, 1)), "Flat");
    EXPECT_EQ(index_factory_string(cache.index(1, 0)), "Sink2,Window8,TopK(Flat)");
    // keys / values per layer, head-major [n_kv_heads, n_total, d]
    std::vector<std::vector<float>> keys, values;
    for (int l = 0; l < kLayers; l++) {
        keys.push_back(gaussian(kKVHeads * n_total, kD, 10 + l, 1.0f, 0.2f));
        values.push_back(gaussian(kKVHeads * n_total, kDv, 20 + l));
    }
    auto slice = [&](const std::vector<float>& x, int h, idx_t from, idx_t n, int dim) {
        std::vector<float> s;
        s.insert(s.end(), x.begin() + (h * n_total + from) * dim,
                 x.begin() + (h * n_total + from + n) * dim);
        return s;
    };
    auto gather = [&](const std::vector<float>& x, idx_t from, idx_t n, int dim) {
        std::vector<float> all;
        for (int h = 0; h < kKVHeads; h++) {
            auto s = slice(x, h, from, n, dim);
            all.insert(all.end(), s.begin(), s.end());
        }
        return all;
    };
    for (int l = 0; l < kLayers; l++) {
        auto k = gather(keys[l], 0, n_prompt, kD), v = gather(values[l], 0, n_prompt, kDv);
        cache.prefill(l, n_prompt, k.data(), v.data(), 0, nullptr, nullptr, RopeParams{});
    }
    for (idx_t p = n_prompt; p < n_total; p++) {
        for (int l = 0; l < kLayers; l++) {
            auto k = gather(keys[l], p, 1, kD), v = gather(values[l], p, 1, kDv);
            cache.append(l, 1, k.data(), v.data());
            auto q = gaussian(kQHeads, kD, 1000 * p + l, 2.0f);
            std::vector<float> out(kQHeads * kDv), lse(kQHeads);
            SearchParametersKV params;
            params.k = 1 << 20; // TopK over everything: exact, so the reference is simple
            // one params for every layer, as a decode loop hands it: the
            // dense Flat layer reads no k, which layer 1 reads, so it drops it
            cache.attend(l, 1, q.data(), out.data(), lse.data(), &params);
            if (p == n_prompt) {
                // a knob that no layer reads is refused, on every layer
                SearchParametersTopK nprobe;
                nprobe.nprobe = 2;
                nprobe.k = 5; // read by layer 1: the dense layer names nprobe
                std::vector<float> o(out.size());
                EXPECT_THROW_MSG(
                        cache.attend(l, 1, q.data(), o.data(), nullptr, &nprobe),
                        "nprobe=2 does not apply");
            }
            for (int h = 0; h < kQHeads; h++) {
                int kv = h / (kQHeads / kKVHeads);
                EXPECT_EQ(cache.kv_head_of(h), kv);
                auto hk = slice(keys[l], kv, 0, p + 1, kD);
                auto hv = slice(values[l], kv, 0, p + 1, kDv);
                std::vector<double> ref;
                double ref_lse = kvtest::ref_attention_all(q.data() + h * kD, hk.data(), hv.data(), kD, kDv, p + 1, ref);
                ASSERT_NEAR(lse[h], ref_lse, 1e-5 * std::max(1.0, std::abs(ref_lse)));
                ASSERT_LT(kvtest::rel_max_err(out.data() + h * kDv, ref), 1e-5) << "layer " << l << " head " << h;
            }
        }
    }
    EXPECT_EQ(cache.n_tokens(1), n_total);
}

namespace {
/// An exact index that remembers the queries its prefill received.
struct RecordingIndex : IndexKVFlat {
    std::vector<float> queries;
    int n_query_heads = 0;
    RecordingIndex() : IndexKVFlat(kD, kDv) {}
    void prefill_impl(const PrefillInput& in) override {
        queries.assign(in.queries, in.queries + in.n_query_heads * in.n_queries * kD);
        n_query_heads = in.n_query_heads;
        IndexKVFlat::prefill_impl(in);
    }
};
} // namespace

TEST(KVCache, PrefillHandsEachKVHeadItsGroupsQueries) {
    KVCache cache(1, kQHeads, kKVHeads, kD, kDv, "Flat");
    for (auto& idx : cache.indexes) {
        idx = std::make_unique<RecordingIndex>();
    }
    idx_t n = 20, nq = 5;
    auto k = gaussian(kKVHeads * n, kD, 1), v = gaussian(kKVHeads * n, kDv, 2);
    auto q = gaussian(kQHeads * nq, kD, 3); // [n_q_heads, nq, d]
    cache.prefill(0, n, k.data(), v.data(), nq, q.data(), nullptr, RopeParams{});
    int g = kQHeads / kKVHeads;
    for (int h = 0; h < kKVHeads; h++) {
        auto* rec = dynamic_cast<RecordingIndex*>(cache.index(0, h));
        EXPECT_EQ(rec->n_query_heads, g);
        // KV head h gets query heads h*g .. h*g+g-1, the ones kv_head_of maps to it
        std::vector<float> expected(q.begin() + h * g * nq * kD, q.begin() + (h + 1) * g * nq * kD);
        EXPECT_EQ(rec->queries, expected);
        for (int j = 0; j < g; j++) {
            EXPECT_EQ(cache.kv_head_of(h * g + j), h);
        }
        EXPECT_EQ(rec->ntotal, n);
    }
}

TEST(KVCache, ExceptionInOneHeadPropagates) {
    KVCache cache(1, 4, 2, kD, kDv, "Flat");
    auto k = gaussian(2 * 10, kD, 1), v = gaussian(2 * 10, kDv, 2);
    cache.prefill(0, 10, k.data(), v.data(), 0, nullptr, nullptr, RopeParams{});
    auto q = gaussian(4, kD, 3);
    q[3 * kD + 5] = NAN; // only the last query head is bad
    std::vector<float> out(4 * kDv);
    try {
        cache.attend(0, 1, q.data(), out.data(), nullptr);
        FAIL() << "expected an exception";
    } catch (const faiss::FaissException& e) {
        EXPECT_NE(std::string(e.what()).find("non-finite"), std::string::npos) << e.what();
    }
}

namespace {

/// No index of the chain has a RoPE fixed.
void expect_no_rope(const KVIndex* index) {
    EXPECT_FALSE(index->has_rope) << index->type_name();
    for (const KVIndex* c : index->children()) {
        expect_no_rope(c);
    }
}

} // namespace

TEST(KVCache, APrefillRefusedInOneHeadLeavesTheLayerAsItWas) {
    // head 1's key overflows fp16; head 0 had prefilled and fixed its
    // RoPE, which reset keeps: the emptied layer then refused appends, a
    // prefill with another RoPE, and check_invariants
    for (const char* s : {"FP16,Flat", "FP16,Sink2,Window4,TopK(Flat)"}) {
        SCOPED_TRACE(s);
        KVCache cache(2, 2, 2, kD, kDv, s, s);
        const idx_t n = 20;
        auto k = gaussian(2 * n, kD, 11), v = gaussian(2 * n, kDv, 12);
        k[(n + 3) * kD] = 1e6f; // head 1, token 3
        RopeParams first;
        first.theta = 10000;
        EXPECT_THROW_MSG(
                cache.prefill(0, n, k.data(), v.data(), 0, nullptr, nullptr, first), "65520");
        EXPECT_EQ(cache.n_tokens(0), 0);
        EXPECT_FALSE(cache.has_rope);
        EXPECT_NO_THROW(cache.check_invariants());
        for (int h = 0; h < 2; h++) {
            expect_no_rope(cache.index(0, h));
        }
        // another RoPE, fixed by the other layer, then this layer again
        k[(n + 3) * kD] = 0.5f;
        RopeParams other;
        other.theta = 500000;
        cache.prefill(1, n, k.data(), v.data(), 0, nullptr, nullptr, other);
        cache.prefill(0, n, k.data(), v.data(), 0, nullptr, nullptr, other);
        EXPECT_EQ(cache.n_tokens(0), n);
        EXPECT_NO_THROW(cache.check_invariants());
    }
}

namespace {

/// Every query head's output of one layer, [n_q_heads, n, d_value].
std::vector<float> attend_layer(const KVCache& cache, int layer, idx_t n, const std::vector<float>& q) {
    std::vector<float> out(size_t(cache.n_q_heads) * n * cache.d_value);
    cache.attend(layer, n, q.data(), out.data(), nullptr);
    return out;
}

} // namespace

TEST(KVCache, AnAppendOneHeadCannotHoldLeavesEveryHeadAsItWas) {
    // each head's slice is checked as its own add_kv checks it before any
    // head appends: a key or value that KV head 1's 16-bit storage cannot
    // hold was refused after head 0 had taken the tokens, and the layer
    // stayed out of step for good. Every 16-bit string of the suite, in
    // fp16 (bf16 holds every input the checks let through: |x| <= 1e12).
    int tried = 0;
    for (const auto& c : kvtest::kConformance) {
        std::string s = c.factory;
        if (s.rfind("BF16,", 0) != 0 && s.rfind("FP16,", 0) != 0) {
            continue;
        }
        s = "FP16," + s.substr(5);
        SCOPED_TRACE(s);
        tried++;
        const float too_big = 1e5f; // fp16 holds |x| < 65520
        KVCache cache(1, 4, 2, kD, kDv, s);
        const idx_t n = 60, nq = 8, m = 3;
        auto k = gaussian(2 * n, kD, 31), v = gaussian(2 * n, kDv, 32);
        auto q = gaussian(4 * nq, kD, 33);
        RopeParams rope;
        rope.theta = 10000;
        cache.prefill(0, n, k.data(), v.data(), nq, q.data(), nullptr, rope);
        auto probe = gaussian(4 * 2, kD, 34);
        const std::vector<float> before = attend_layer(cache, 0, 2, probe);
        auto k2 = gaussian(2 * m, kD, 35), v2 = gaussian(2 * m, kDv, 36);
        for (const bool in_keys : {true, false}) {
            auto bad_k = k2, bad_v = v2;
            // head 1, token 1
            (in_keys ? bad_k[(m + 1) * kD + 2] : bad_v[(m + 1) * kDv + 2]) = too_big;
            const std::string msg =
                    kvtest::faiss_error([&] { cache.append(0, m, bad_k.data(), bad_v.data()); });
            EXPECT_NE(msg.find(std::string("KVCache::append: layer 0, KV head 1: ") +
                               (in_keys ? "keys" : "values") + ": value"),
                      std::string::npos)
                    << msg;
            for (int h = 0; h < 2; h++) {
                EXPECT_EQ(cache.index(0, h)->ntotal, n) << "head " << h;
            }
            EXPECT_NO_THROW(cache.check_invariants());
            EXPECT_EQ(attend_layer(cache, 0, 2, probe), before);
        }
        cache.append(0, m, k2.data(), v2.data());
        EXPECT_EQ(cache.n_tokens(0), n + m);
    }
    EXPECT_GE(tried, 10);
}

TEST(KVCache, AnUndoableAppendIsTakenBackWhole) {
    // what a caller appending one step to several caches (RayKVCache's
    // actors) does when another cache refuses it: every conformance string
    // whose heads can take an append back answers, after undo_append, to
    // the bits as before; the next append gives what a plain append gives
    int tried = 0;
    for (const auto& c : kvtest::kConformance) {
        SCOPED_TRACE(c.factory);
        KVCache cache(1, 4, 2, kD, kDv, c.factory), plain(1, 4, 2, kD, kDv, c.factory);
        const idx_t n = 60, nq = 8, m = 5;
        auto k = gaussian(2 * n, kD, 41), v = gaussian(2 * n, kDv, 42), q = gaussian(4 * nq, kD, 43);
        RopeParams rope;
        rope.theta = 10000;
        cache.prefill(0, n, k.data(), v.data(), nq, q.data(), nullptr, rope);
        plain.prefill(0, n, k.data(), v.data(), nq, q.data(), nullptr, rope);
        auto probe = gaussian(4 * 2, kD, 44);
        auto k2 = gaussian(2 * m, kD, 45), v2 = gaussian(2 * m, kDv, 46);
        const std::vector<float> before = attend_layer(cache, 0, 2, probe);
        if (!cache.can_undo_append(0)) {
            EXPECT_THROW_MSG(cache.append_undoable(0, m, k2.data(), v2.data()), "can_undo_add");
            EXPECT_EQ(cache.n_tokens(0), n);
            EXPECT_EQ(attend_layer(cache, 0, 2, probe), before);
            continue;
        }
        tried++;
        EXPECT_THROW_MSG(cache.undo_append(0), "no append to take back");
        cache.append_undoable(0, m, k2.data(), v2.data());
        plain.append(0, m, k2.data(), v2.data());
        const std::vector<float> appended = attend_layer(plain, 0, 2, probe);
        EXPECT_EQ(attend_layer(cache, 0, 2, probe), appended);
        cache.undo_append(0);
        EXPECT_EQ(cache.n_tokens(0), n);
        EXPECT_NO_THROW(cache.check_invariants());
        EXPECT_EQ(attend_layer(cache, 0, 2, probe), before);
        EXPECT_THROW_MSG(cache.undo_append(0), "no append to take back");
        cache.append(0, m, k2.data(), v2.data());
        EXPECT_EQ(attend_layer(cache, 0, 2, probe), appended);
        // another write ends what can be taken back
        cache.append_undoable(0, m, k2.data(), v2.data());
        cache.add_queries(0, 1, probe.data());
        EXPECT_THROW_MSG(cache.undo_append(0), "no append to take back");
    }
    EXPECT_GE(tried, 40); // all but the TopK over HNSW strings
}

TEST(KVCache, ResetLayerEmptiesThatLayerOnly) {
    // a layer prefilled over several caches is emptied where another
    // refused it; the other layers keep their tokens and answers
    KVCache cache(kLayers, kQHeads, kKVHeads, kD, kDv, "Sink2,Window4,LSHSample6x20");
    const idx_t n = 40, nq = 8;
    auto k = gaussian(kKVHeads * n, kD, 51), v = gaussian(kKVHeads * n, kDv, 52);
    auto q = gaussian(kQHeads * nq, kD, 53);
    RopeParams rope;
    rope.theta = 10000;
    cache.prefill(0, n, k.data(), v.data(), nq, q.data(), nullptr, rope);
    cache.prefill(1, n, k.data(), v.data(), nq, q.data(), nullptr, rope);
    auto probe = gaussian(kQHeads, kD, 54);
    const std::vector<float> layer1 = attend_layer(cache, 1, 1, probe);
    const std::vector<float> layer0 = attend_layer(cache, 0, 1, probe);
    cache.reset_layer(0);
    EXPECT_EQ(cache.n_tokens(0), 0);
    EXPECT_EQ(cache.n_tokens(1), n);
    EXPECT_EQ(attend_layer(cache, 1, 1, probe), layer1);
    cache.prefill(0, n, k.data(), v.data(), nq, q.data(), nullptr, rope); // a prefill again
    EXPECT_EQ(attend_layer(cache, 0, 1, probe), layer0);
    EXPECT_THROW_MSG(cache.reset_layer(kLayers), "layer");
}

TEST(KVCache, ResetEmptiesEveryLayerAndMendsOneOutOfStep) {
    KVCache cache(kLayers, kQHeads, kKVHeads, kD, kDv, "Sink2,Window4,TopK(Flat)", "Flat", {0});
    const idx_t n = 30;
    auto k = gaussian(kKVHeads * n, kD, 41), v = gaussian(kKVHeads * n, kDv, 42);
    RopeParams rope;
    rope.theta = 10000;
    for (int l = 0; l < kLayers; l++) {
        cache.prefill(l, n, k.data(), v.data(), 0, nullptr, nullptr, rope);
    }
    // a write through a head's reference puts layer 1 out of step
    cache.index(1, 1)->add_kv(1, k.data(), v.data());
    EXPECT_THROW_MSG(cache.check_invariants(), "reset() empties the cache");
    {
        // refused, changing nothing, while a call runs on any layer
        ReadScope running(cache.layer_calls[1], "attend", "layer 1");
        EXPECT_THROW_MSG(cache.reset(), "KVCache::reset");
        EXPECT_EQ(cache.n_tokens(0), n);
    }
    cache.reset();
    for (int l = 0; l < kLayers; l++) {
        for (int h = 0; h < kKVHeads; h++) {
            EXPECT_EQ(cache.index(l, h)->ntotal, 0) << l << "," << h;
        }
    }
    EXPECT_NO_THROW(cache.check_invariants());
    RopeParams fixed;
    ASSERT_TRUE(cache.fixed_rope(&fixed)); // the cache's RoPE stays
    EXPECT_EQ(fixed, rope);
    // a new sequence with the same RoPE: every layer answers as a fresh
    // cache's
    auto k2 = gaussian(kKVHeads * 12, kD, 43), v2 = gaussian(kKVHeads * 12, kDv, 44);
    KVCache fresh(kLayers, kQHeads, kKVHeads, kD, kDv, "Sink2,Window4,TopK(Flat)", "Flat", {0});
    for (KVCache* c : {&cache, &fresh}) {
        for (int l = 0; l < kLayers; l++) {
            c->prefill(l, 12, k2.data(), v2.data(), 0, nullptr, nullptr, rope);
        }
    }
    auto q = gaussian(kQHeads * 2, kD, 45);
    for (int l = 0; l < kLayers; l++) {
        EXPECT_EQ(attend_layer(cache, l, 2, q), attend_layer(fresh, l, 2, q)) << "layer " << l;
    }
}

TEST(KVCache, PrefillsOfTwoLayersAtOnceAgreeOnOneRoPE) {
    // two layers may be prefilled at the same time, but the cache has one
    // RoPE: of two first prefills with different RoPEs exactly one is
    // accepted, and the cache stays usable (both used to be accepted, the
    // later one's RoPE kept, and the other layer refused every call after)
    const idx_t n = 2000;
    auto k = gaussian(2 * n, kD, 31), v = gaussian(2 * n, kDv, 32);
    RopeParams ropes[2];
    ropes[0].theta = 10000;
    ropes[1].theta = 500000;
    for (int trial = 0; trial < 20; trial++) {
        SCOPED_TRACE(trial);
        KVCache cache(2, 2, 2, kD, kDv, "Flat");
        std::atomic<int> ready{0};
        bool accepted[2] = {false, false};
        std::vector<std::thread> threads;
        for (int l = 0; l < 2; l++) {
            threads.emplace_back([&, l] {
                ready++;
                while (ready.load() < 2) {
                }
                try {
                    cache.prefill(l, n, k.data(), v.data(), 0, nullptr, nullptr, ropes[l]);
                    accepted[l] = true;
                } catch (const faiss::FaissException& e) {
                    EXPECT_NE(std::string(e.what()).find("RoPE parameters mismatch"),
                              std::string::npos)
                            << e.what();
                }
            });
        }
        for (auto& t : threads) {
            t.join();
        }
        ASSERT_EQ(int(accepted[0]) + int(accepted[1]), 1);
        const int won = accepted[0] ? 0 : 1;
        RopeParams fixed;
        ASSERT_TRUE(cache.fixed_rope(&fixed));
        EXPECT_EQ(fixed, ropes[won]);
        EXPECT_NO_THROW(cache.check_invariants());
        EXPECT_EQ(cache.n_tokens(1 - won), 0);
        // the refused layer takes a prefill with the cache's RoPE
        cache.prefill(1 - won, n, k.data(), v.data(), 0, nullptr, nullptr, ropes[won]);
        std::vector<float> q = gaussian(2, kD, 33), out(2 * kDv);
        for (int l = 0; l < 2; l++) {
            EXPECT_NO_THROW(cache.attend(l, 1, q.data(), out.data(), nullptr));
        }
    }
}

TEST(KVCache, WriteOverlappingACallOnItsLayerIsRefusedBeforeAnyHead) {
    // a call running on the layer (here: held open as an attend would hold
    // it) makes append refuse before any head appends, so that the heads
    // never differ in length; another layer is free
    KVCache cache(kLayers, kQHeads, kKVHeads, kD, kDv, "TopK(Flat)");
    auto k = gaussian(kKVHeads * 5, kD, 1), v = gaussian(kKVHeads * 5, kDv, 2);
    cache.append(0, 5, k.data(), v.data());
    {
        ReadScope running(cache.layer_calls[0], "attend", "layer 0");
        try {
            cache.append(0, 5, k.data(), v.data());
            ADD_FAILURE() << "append overlapping an attend was accepted";
        } catch (const faiss::FaissException& e) {
            EXPECT_NE(std::string(e.what()).find("KVCache::append: refused"), std::string::npos) << e.what();
        }
        EXPECT_THROW(cache.add_queries(0, 1, gaussian(kQHeads, kD, 3).data()), faiss::FaissException);
        for (int h = 0; h < kKVHeads; h++) {
            EXPECT_EQ(cache.index(0, h)->ntotal, 5) << "head " << h;
        }
        cache.append(1, 5, k.data(), v.data()); // the other layer
        // reads may overlap reads
        std::vector<float> q = gaussian(kQHeads, kD, 4), out(kQHeads * kDv);
        EXPECT_NO_THROW(cache.attend(0, 1, q.data(), out.data(), nullptr));
    }
    cache.append(0, 5, k.data(), v.data()); // free again
    EXPECT_EQ(cache.n_tokens(0), 10);
}

TEST(KVCache, AWriteOfTheCacheHoldsEveryLayerAgainstAppends) {
    // write_cache reads every head; an append running meanwhile must be
    // refused on the whole layer, or refuse the write, never split a layer
    // (before, one head took the token and the other refused it, and the
    // cache was broken for good)
    KVCache cache(kLayers, kQHeads, kKVHeads, kD, kDv, "Flat");
    const int n0 = 20000;
    auto k = gaussian(kKVHeads * n0, kD, 5), v = gaussian(kKVHeads * n0, kDv, 6);
    for (int l = 0; l < kLayers; l++) {
        cache.append(l, n0, k.data(), v.data());
    }
    std::atomic<bool> stop{false};
    std::atomic<int> appended{0}, refused_appends{0};
    std::thread appender([&]() {
        auto k1 = gaussian(kKVHeads, kD, 7), v1 = gaussian(kKVHeads, kDv, 8);
        while (!stop) {
            try {
                cache.append(1, 1, k1.data(), v1.data());
                appended++;
            } catch (const faiss::FaissException&) {
                refused_appends++;
            }
        }
    });
    int written = 0, refused_writes = 0;
    for (int i = 0; i < 40; i++) {
        std::vector<uint8_t> buf;
        try {
            write_cache(cache, &buf);
            written++;
            auto back = read_cache(buf); // whole layers only
            EXPECT_EQ(back->index(1, 0)->ntotal, back->index(1, 1)->ntotal);
        } catch (const faiss::FaissException&) {
            refused_writes++;
        }
    }
    stop = true;
    appender.join();
    EXPECT_NO_THROW(cache.check_invariants());
    EXPECT_EQ(cache.index(1, 0)->ntotal, cache.index(1, 1)->ntotal);
    EXPECT_EQ(cache.n_tokens(1), n0 + appended.load());
    std::vector<uint8_t> buf; // and with nothing running, the write goes through
    write_cache(cache, &buf);
    EXPECT_EQ(read_cache(buf)->n_tokens(1), cache.n_tokens(1));
    std::printf("[ KVCache ] %d writes (%d refused), %d appends (%d refused)\n", written,
                refused_writes, appended.load(), refused_appends.load());
}

TEST(KVCache, AnAppendRacingACallOnOneHeadIsAllOrNothing) {
    // a const call on one head through index() (not through the layer)
    // while appends run: an append refused for it must leave every head
    // as it was (before, head 0 took the token and head 1 refused it, and
    // every later attend of the layer failed until reset)
    KVCache cache(1, 2, 2, 16, 16, "Flat");
    const int n0 = 4096;
    auto k = gaussian(2 * n0, 16, 1), v = gaussian(2 * n0, 16, 2);
    cache.append(0, n0, k.data(), v.data());
    std::atomic<bool> stop{false};
    std::atomic<int> attends{0};
    std::thread reader([&]() {
        auto q = gaussian(1, 16, 3);
        std::vector<float> out(16);
        while (!stop) {
            try {
                cache.index(0, 1)->attend(1, q.data(), out.data(), nullptr);
                attends++;
            } catch (const faiss::FaissException&) { // refused while an append runs
            }
            // a gap, so that appends also find the head free
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
    });
    auto k1 = gaussian(2, 16, 4), v1 = gaussian(2, 16, 5);
    int appended = 0, refused = 0;
    // until the reader runs, and 20 appends met it and 20 went through (a
    // loaded machine may start the thread late), or 10 s
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (attends.load() == 0 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::yield();
    }
    for (int i = 0; !(refused >= 20 && appended >= 20) && std::chrono::steady_clock::now() < deadline; i++) {
        try {
            cache.append(0, 1, k1.data(), v1.data());
            appended++;
        } catch (const CallRefused& e) {
            refused++;
            EXPECT_NE(std::string(e.what()).find("layer 0, KV head 1"), std::string::npos) << e.what();
        }
        ASSERT_EQ(cache.index(0, 0)->ntotal, cache.index(0, 1)->ntotal) << "after append " << i;
    }
    stop = true;
    reader.join();
    EXPECT_GT(refused, 0) << "no append overlapped an attend: the race was not exercised";
    EXPECT_GT(appended, 0) << "no append found the head free";
    EXPECT_EQ(cache.n_tokens(0), n0 + appended);
    std::vector<float> q = gaussian(2, 16, 6), out(2 * 16);
    EXPECT_NO_THROW(cache.attend(0, 1, q.data(), out.data(), nullptr));
    std::printf("[ KVCache ] %d appends (%d refused), %d attends on head 1\n", appended, refused, attends.load());
}

}  // namespace test_kvcache
