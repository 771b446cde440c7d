// Misuse must throw a faiss::FaissException whose message names the problem
// (DESIGN.md section 5), never abort or return garbage.

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <faiss/IndexIVF.h>
#include <faiss/impl/FaissException.h>

#include <kvindex/IVFAsymTrainer.h>
#include <kvindex/IndexChoose.h>
#include <kvindex/IndexIVFAsym.h>
#include <kvindex/IndexKVFlat.h>
#include <kvindex/IndexProxyEvict.h>
#include <kvindex/IndexRoarGraph.h>
#include <kvindex/IndexUniformSample.h>
#include <kvindex/attention.h>
#include <kvindex/IndexLSHSample.h>
#include <kvindex/KVStorage.h>
#include <kvindex/impl/io.h>
#include <kvindex/IndexSinkWindow.h>
#include <kvindex/IndexTopK.h>
#include <kvindex/KVCache.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>
#include <kvindex/rope.h>

#include "expect_throw.h"
#include "forge.h"
#include "reference.h"

namespace test_bad_input {

using namespace kvindex;

namespace {

const int kDim = 16;
const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();


/// One index of each family; the sink/window one has tokens in all three parts.
const char* const kTypes[] = {
        "Flat",
        "TopK(Flat)",
        "TopK(IVF16,Flat)",
        "TopK(HNSW32)",
        "Sink4,Window8,Flat",
        "Sink4,Window8,TopK(IVF16,Flat)",
};

std::unique_ptr<KVIndex> filled(const char* factory, idx_t n, uint64_t seed = 1) {
    auto index = index_factory(kDim, factory);
    std::vector<float> keys = kvtest::gaussian(n, kDim, seed);
    std::vector<float> values = kvtest::gaussian(n, kDim, seed + 1);
    index->add_kv(n, keys.data(), values.data());
    return index;
}

} // namespace

TEST(BadInput, AddWithoutValues) {
    std::vector<float> keys = kvtest::gaussian(4, kDim, 1), values = kvtest::gaussian(4, kDim, 2);
    for (const char* s : kTypes) {
        SCOPED_TRACE(s);
        auto index = index_factory(kDim, s);
        EXPECT_THROW_MSG(index->add(4, keys.data()), "values");
        EXPECT_THROW_MSG(index->add_kv(4, keys.data(), nullptr), "values");
        EXPECT_THROW_MSG(index->add_kv(4, nullptr, values.data()), "keys");
        EXPECT_THROW_MSG(index->add_kv(-1, keys.data(), values.data()), "n=-1");
        EXPECT_EQ(index->ntotal, 0); // nothing was half added
    }
}

TEST(BadInput, NonFiniteKeysValues) {
    for (const char* s : kTypes) {
        SCOPED_TRACE(s);
        auto index = filled(s, 40);
        for (float bad : {kNaN, kInf, -kInf}) {
            std::vector<float> keys = kvtest::gaussian(3, kDim, 3);
            std::vector<float> values = kvtest::gaussian(3, kDim, 4);
            keys[kDim + 5] = bad;
            EXPECT_THROW_MSG(index->add_kv(3, keys.data(), values.data()), "non-finite");
            keys[kDim + 5] = 0.5f;
            values[2 * kDim + 1] = bad;
            EXPECT_THROW_MSG(index->add_kv(3, keys.data(), values.data()), "non-finite");
            EXPECT_EQ(index->ntotal, 40);
        }
        // prefill checks the same way (the sink/window prefill splits first)
        auto empty = index_factory(kDim, s);
        std::vector<float> keys = kvtest::gaussian(20, kDim, 5);
        std::vector<float> values = kvtest::gaussian(20, kDim, 6);
        keys[19 * kDim] = kNaN; // the last token: the window of the wrapper
        PrefillInput in;
        in.n_tokens = 20;
        in.keys = keys.data();
        in.values = values.data();
        EXPECT_THROW_MSG(empty->prefill(in), "non-finite");
        keys[19 * kDim] = 0;
        std::vector<float> pq = kvtest::gaussian(2, kDim, 7);
        pq[3] = kInf;
        in.n_queries = 2;
        in.queries = pq.data();
        EXPECT_THROW_MSG(empty->prefill(in), "non-finite");
    }
}

TEST(BadInput, HugeFiniteKeysAreRefusedBeforeKMeans) {
    // finite keys whose squared distances overflow float made Faiss's
    // k-means abort the process; they are refused at the boundary instead
    for (const char* s : {"TopK(IVF2,Flat)", "Sink4,Window8,TopK(IVF16,Flat)", "IVFAsym4"}) {
        SCOPED_TRACE(s);
        auto index = index_factory(kDim, s);
        std::vector<float> keys = kvtest::gaussian(300, kDim, 11);
        std::vector<float> values = kvtest::gaussian(300, kDim, 12);
        for (int i = 0; i < 8; i++) {
            keys[i * kDim] = 3e38f;
        }
        EXPECT_THROW_MSG(index->add_kv(300, keys.data(), values.data()), "kMaxInputMagnitude");
        PrefillInput in;
        in.n_tokens = 300;
        in.keys = keys.data();
        in.values = values.data();
        EXPECT_THROW_MSG(index->prefill(in), "row 0, column 0");
        EXPECT_EQ(index->ntotal, 0);
        keys[0] = -kMaxInputMagnitude * 1.5f;
        EXPECT_THROW_MSG(index->prefill(in), "must be <= 1e12");
    }
}

TEST(BadInput, PrefillPositionsThatWouldOverflowAreRefused) {
    auto index = index_factory(kDim, "Flat");
    std::vector<float> keys = kvtest::gaussian(4, kDim, 13), values = kvtest::gaussian(4, kDim, 14);
    PrefillInput in;
    in.n_tokens = 4;
    in.keys = keys.data();
    in.values = values.data();
    in.first_position = std::numeric_limits<idx_t>::max() - 2;
    EXPECT_THROW_MSG(index->prefill(in), "must be <= 2^62");
    in.first_position = 0;
    in.n_after = std::numeric_limits<idx_t>::max();
    EXPECT_THROW_MSG(index->prefill(in), "must be <= 2^62");
    in.n_after = 0;
    index->prefill(in);
    EXPECT_EQ(index->ntotal, 4);
}

TEST(BadInput, NonFiniteQueries) {
    for (const char* s : kTypes) {
        SCOPED_TRACE(s);
        auto index = filled(s, 60);
        for (float bad : {kNaN, kInf}) {
            std::vector<float> q = kvtest::gaussian(3, kDim, 9);
            q[2 * kDim + 7] = bad; // in the last query, not the first
            std::vector<float> out(3 * kDim), lse(3), dis(3 * 5);
            std::vector<idx_t> ids(3 * 5);
            std::vector<Selection> sel(3);
            EXPECT_THROW_MSG(index->attend(3, q.data(), out.data(), lse.data()), "non-finite");
            EXPECT_THROW_MSG(index->search(3, q.data(), 5, dis.data(), ids.data()), "non-finite");
            EXPECT_THROW_MSG(index->select(3, q.data(), sel.data()), "non-finite");
        }
    }
}

TEST(BadInput, SearchK) {
    std::vector<float> q = kvtest::gaussian(2, kDim, 10), dis(2 * 4);
    std::vector<idx_t> ids(2 * 4);
    for (const char* s : kTypes) {
        SCOPED_TRACE(s);
        auto index = filled(s, 40);
        EXPECT_THROW_MSG(index->search(2, q.data(), 0, dis.data(), ids.data()), "k=0");
        EXPECT_THROW_MSG(index->search(2, q.data(), -1, dis.data(), ids.data()), "k=-1");
    }
}

TEST(BadInput, SearchParametersNegativeK) {
    std::vector<float> q = kvtest::gaussian(2, kDim, 11), out(2 * kDim);
    SearchParametersKV params;
    params.k = -2;
    // the index types with a top-k budget (Flat has none and reads everything)
    for (const char* s :
         {"TopK(Flat)", "TopK(IVF16,Flat)", "TopK(HNSW32)", "Sink4,Window8,TopK(IVF16,Flat)"}) {
        SCOPED_TRACE(s);
        auto index = filled(s, 40);
        EXPECT_THROW_MSG(index->attend(2, q.data(), out.data(), nullptr, &params), "k=-2");
        std::vector<Selection> sel(2);
        EXPECT_THROW_MSG(index->select(2, q.data(), sel.data(), &params), "k=-2");
    }
}

TEST(BadInput, KBeyondIndex) {
    const idx_t n = 7, k = 12, nq = 3;
    std::vector<float> q = kvtest::gaussian(nq, kDim, 12, 2.0f);
    auto flat = filled("Flat", n, 20);
    std::vector<float> dis(nq * k);
    std::vector<idx_t> ids(nq * k);
    flat->search(nq, q.data(), k, dis.data(), ids.data());
    std::vector<float> keys = kvtest::gaussian(n, kDim, 20);
    for (idx_t i = 0; i < nq; i++) {
        // every token first, exact order as the reference, then padding
        std::vector<kvtest::idx_t> ref =
                kvtest::ref_topk(q.data() + i * kDim, keys.data(), kDim, n, n);
        for (idx_t j = 0; j < n; j++) {
            EXPECT_EQ(ids[i * k + j], ref[j]) << "query " << i << " rank " << j;
        }
        for (idx_t j = n; j < k; j++) {
            EXPECT_EQ(ids[i * k + j], -1);
            EXPECT_EQ(dis[i * k + j], std::numeric_limits<float>::lowest());
        }
    }

    // the other types pad the same way
    for (const char* s : {"TopK(Flat)", "Sink2,Window2,Flat", "Sink2,Window2,TopK(Flat)"}) {
        SCOPED_TRACE(s);
        auto index = filled(s, n, 20);
        std::vector<float> d2(nq * k);
        std::vector<idx_t> i2(nq * k);
        index->search(nq, q.data(), k, d2.data(), i2.data());
        for (idx_t i = 0; i < nq; i++) {
            for (idx_t j = n; j < k; j++) {
                EXPECT_EQ(i2[i * k + j], -1) << "query " << i << " rank " << j;
                EXPECT_EQ(d2[i * k + j], std::numeric_limits<float>::lowest());
            }
        }
        // the labels found are the same set as Flat's (exact retrievers)
        for (idx_t i = 0; i < nq; i++) {
            std::vector<idx_t> a(ids.begin() + i * k, ids.begin() + i * k + n);
            std::vector<idx_t> b(i2.begin() + i * k, i2.begin() + i * k + n);
            std::sort(a.begin(), a.end());
            std::sort(b.begin(), b.end());
            EXPECT_EQ(a, b);
        }
    }

    // TopK with a budget beyond the index reads every token: exact attention.
    // Tolerance 1e-5 relative: two float summation orders of 7 terms.
    auto topk = filled("TopK(Flat)", n, 20);
    SearchParametersKV params;
    params.k = 50;
    std::vector<float> out_flat(nq * kDim), lse_flat(nq), out_topk(nq * kDim), lse_topk(nq);
    flat->attend(nq, q.data(), out_flat.data(), lse_flat.data());
    topk->attend(nq, q.data(), out_topk.data(), lse_topk.data(), &params);
    for (idx_t i = 0; i < nq * kDim; i++) {
        EXPECT_NEAR(out_topk[i], out_flat[i], 1e-5f * std::max(1.0f, std::fabs(out_flat[i])));
    }
    for (idx_t i = 0; i < nq; i++) {
        EXPECT_NEAR(lse_topk[i], lse_flat[i], 1e-5f * std::max(1.0f, std::fabs(lse_flat[i])));
    }
}

TEST(BadInput, AttendEmpty) {
    std::vector<float> q = kvtest::gaussian(1, kDim, 13), out(kDim), lse(1);
    for (const char* s : kTypes) {
        SCOPED_TRACE(s);
        auto index = index_factory(kDim, s);
        EXPECT_THROW_MSG(index->attend(1, q.data(), out.data(), lse.data()), "empty");
        // and after a reset
        auto full = filled(s, 30);
        full->reset();
        EXPECT_EQ(full->ntotal, 0);
        EXPECT_THROW_MSG(full->attend(1, q.data(), out.data(), lse.data()), "empty");
    }
}

TEST(BadInput, FactoryErrors) {
    EXPECT_THROW_MSG(index_factory(kDim, "NoSuchIndex"), "NoSuchIndex");
    EXPECT_THROW_MSG(index_factory(0, "Flat"), "d=0");
    EXPECT_THROW_MSG(index_factory(kDim, "Flat", 0), "d_value=0");
    EXPECT_THROW_MSG(KVCache(2, 4, 2, kDim, kDim, "NoSuchIndex"), "NoSuchIndex");
}

TEST(BadInput, RopeParams) {
    RopeParams r;
    EXPECT_NO_THROW(check_rope_params(r, kDim));
    r.theta = 0;
    EXPECT_THROW_MSG(check_rope_params(r, kDim), "theta");
    r.theta = -10000;
    EXPECT_THROW_MSG(check_rope_params(r, kDim), "theta");
    r.theta = std::nan("");
    EXPECT_THROW_MSG(check_rope_params(r, kDim), "theta");
    r.theta = HUGE_VAL;
    EXPECT_THROW_MSG(check_rope_params(r, kDim), "theta");
    r.theta = 10000;
    EXPECT_THROW_MSG(check_rope_params(r, 15), "d=15");
    EXPECT_THROW_MSG(check_rope_params(r, 0), "d=0");
    EXPECT_THROW_MSG(rope_style_from_name("diagonal"), "diagonal");

    // prefill refuses bad RoPE parameters too
    auto index = index_factory(kDim, "Flat");
    std::vector<float> kv = kvtest::gaussian(4, kDim, 14);
    PrefillInput in;
    in.n_tokens = 4;
    in.keys = kv.data();
    in.values = kv.data();
    in.rope.theta = -1;
    EXPECT_THROW_MSG(index->prefill(in), "theta");
    EXPECT_EQ(index->ntotal, 0);
}

TEST(BadInput, RopeMismatchAfterReset) {
    // reset empties the cache but not the model: another theta is refused
    for (const char* s : {"Flat", "Sink4,Window8,TopK(Flat)"}) {
        SCOPED_TRACE(s);
        auto index = index_factory(kDim, s);
        std::vector<float> kv = kvtest::gaussian(20, kDim, 15);
        PrefillInput in;
        in.n_tokens = 20;
        in.keys = kv.data();
        in.values = kv.data();
        in.rope.theta = 10000;
        index->prefill(in);
        index->reset();
        in.rope.theta = 500000;
        EXPECT_THROW_MSG(index->prefill(in), "mismatch");
        in.rope.theta = 10000;
        in.rope.style = RopeStyle::interleaved;
        EXPECT_THROW_MSG(index->prefill(in), "mismatch");
        in.rope.style = RopeStyle::half;
        EXPECT_NO_THROW(index->prefill(in));
        EXPECT_EQ(index->ntotal, 20);
    }
}

TEST(BadInput, PrefillNonEmpty) {
    for (const char* s : kTypes) {
        SCOPED_TRACE(s);
        auto index = filled(s, 30);
        std::vector<float> kv = kvtest::gaussian(5, kDim, 16);
        PrefillInput in;
        in.n_tokens = 5;
        in.keys = kv.data();
        in.values = kv.data();
        EXPECT_THROW_MSG(index->prefill(in), "already holds 30");
        EXPECT_EQ(index->ntotal, 30);
    }
}

TEST(BadInput, ReconstructOutOfRange) {
    std::vector<float> buf(kDim);
    for (const char* s : kTypes) {
        SCOPED_TRACE(s);
        auto index = filled(s, 30);
        EXPECT_THROW_MSG(index->reconstruct(30, buf.data()), "30");
        EXPECT_THROW_MSG(index->reconstruct(-1, buf.data()), "out of");
        EXPECT_THROW_MSG(index->reconstruct_value(30, buf.data()), "out of");
        EXPECT_THROW_MSG(index->reconstruct_value(-5, buf.data()), "-5");
        EXPECT_NO_THROW(index->reconstruct(29, buf.data()));
    }
}

TEST(BadInput, KVCacheShapes) {
    EXPECT_THROW_MSG(KVCache(2, 6, 4, kDim, kDim, "Flat"), "multiple");
    EXPECT_THROW_MSG(KVCache(0, 4, 2, kDim, kDim, "Flat"), "n_layers=0");
    EXPECT_THROW_MSG(KVCache(2, 4, 0, kDim, kDim, "Flat"), "n_kv_heads=0");
    // a shape beyond the limits is refused before anything is allocated
    EXPECT_THROW_MSG(KVCache(1 << 16, 1 << 12, 1 << 12, kDim, kDim, "Flat"), "n_layers=65536");
    EXPECT_THROW_MSG(KVCache(2, 1 << 13, 1 << 13, kDim, kDim, "Flat"), "n_q_heads=8192");
    EXPECT_THROW_MSG(KVCache(2, 4, 2, kDim, kDim, "Sink4,Flat", "Flat", {2}), "dense layer 2");
    EXPECT_THROW_MSG(KVCache(2, 4, 2, kDim, kDim, "Sink4,Flat", "Flat", {-1}), "dense layer -1");

    KVCache cache(2, 4, 2, kDim, kDim, "Flat");
    EXPECT_THROW_MSG(cache.index(2, 0), "layer 2");
    EXPECT_THROW_MSG(cache.index(0, 2), "KV head 2");
    std::vector<float> q(4 * kDim), out(4 * kDim);
    EXPECT_THROW_MSG(cache.attend(5, 1, q.data(), out.data(), nullptr), "layer 5");
}

TEST(BadInput, KVCacheRopeMismatch) {
    const int n_layers = 2, n_q = 4, n_kv = 2;
    const idx_t n = 20;
    KVCache cache(n_layers, n_q, n_kv, kDim, kDim, "Sink4,Window8,Flat");
    std::vector<float> keys = kvtest::gaussian(n_kv * n, kDim, 17);
    std::vector<float> values = kvtest::gaussian(n_kv * n, kDim, 18);
    RopeParams r;
    r.theta = 10000;
    cache.prefill(0, n, keys.data(), values.data(), 0, nullptr, nullptr, r);
    r.theta = 1e6;
    EXPECT_THROW_MSG(
            cache.prefill(1, n, keys.data(), values.data(), 0, nullptr, nullptr, r), "mismatch");
    EXPECT_EQ(cache.n_tokens(1), 0); // refused before any head was touched
    r.theta = 10000;
    EXPECT_NO_THROW(cache.prefill(1, n, keys.data(), values.data(), 0, nullptr, nullptr, r));
    EXPECT_EQ(cache.n_tokens(1), n);
}

TEST(BadInput, KVCacheNaNInOneHead) {
    // The heads run in an OpenMP loop; the exception of one head must come
    // out of the loop as a FaissException (an escaping one would abort).
    const int n_q = 8, n_kv = 2;
    const idx_t n = 40, nq = 3;
    KVCache cache(1, n_q, n_kv, kDim, kDim, "Sink4,Window8,TopK(Flat)");
    std::vector<float> keys = kvtest::gaussian(n_kv * n, kDim, 19);
    std::vector<float> values = kvtest::gaussian(n_kv * n, kDim, 20);
    cache.prefill(0, n, keys.data(), values.data(), 0, nullptr, nullptr, RopeParams());
    std::vector<float> q = kvtest::gaussian(n_q * nq, kDim, 21, 2.0f);
    std::vector<float> out(n_q * nq * kDim), lse(n_q * nq);
    ASSERT_NO_THROW(cache.attend(0, nq, q.data(), out.data(), lse.data()));
    for (int bad_head : {0, 5, n_q - 1}) {
        std::vector<float> qb = q;
        qb[(bad_head * nq + 1) * kDim + 3] = kNaN;
        EXPECT_THROW_MSG(cache.attend(0, nq, qb.data(), out.data(), lse.data()), "non-finite");
    }
    // and append with a NaN value in one KV head
    std::vector<float> k1 = kvtest::gaussian(n_kv, kDim, 22), v1 = kvtest::gaussian(n_kv, kDim, 23);
    v1[kDim + 2] = kNaN;
    EXPECT_THROW_MSG(cache.append(0, 1, k1.data(), v1.data()), "non-finite");
}

TEST(BadInput, NegativeKInParamsOnEveryType) {
    // every index type refuses k < 0, not only the ones with a budget
    for (const char* f : kTypes) {
        SCOPED_TRACE(f);
        auto index = filled(f, 40);
        std::vector<float> q = kvtest::gaussian(1, kDim, 9), out(kDim), dis(3);
        std::vector<idx_t> lab(3);
        SearchParametersKV params;
        params.k = -2;
        EXPECT_THROW_MSG(index->attend(1, q.data(), out.data(), nullptr, &params), "k=");
        EXPECT_THROW_MSG(index->search(1, q.data(), 3, dis.data(), lab.data(), &params), "k=");
    }
}

TEST(BadInput, RefusedPrefillFixesNoRope) {
    for (const char* f : {"Flat", "Sink2,Window4,Flat"}) {
        SCOPED_TRACE(f);
        auto index = index_factory(kDim, f);
        std::vector<float> keys = kvtest::gaussian(10, kDim, 1), values = kvtest::gaussian(10, kDim, 2);
        keys[17] = kNaN;
        PrefillInput in;
        in.n_tokens = 10;
        in.keys = keys.data();
        in.values = values.data();
        in.rope.theta = 10000;
        EXPECT_THROW_MSG(index->prefill(in), "non-finite");
        EXPECT_FALSE(index->has_rope);
        EXPECT_EQ(index->ntotal, 0);
        keys[17] = 0.5f;
        in.rope.theta = 500000; // another model: fine, nothing was fixed
        index->prefill(in);
        EXPECT_EQ(index->rope.theta, 500000);
        EXPECT_EQ(index->ntotal, 10);
    }
}

TEST(BadInput, KVCacheRefusesBadHeadBeforeChangingAny) {
    KVCache cache(1, 4, 2, kDim, kDim, "Flat");
    idx_t n = 10;
    std::vector<float> keys = kvtest::gaussian(2 * n, kDim, 1), values = kvtest::gaussian(2 * n, kDim, 2);
    keys[(n + 3) * kDim] = kNaN; // head 1 only
    EXPECT_THROW_MSG(
            cache.prefill(0, n, keys.data(), values.data(), 0, nullptr, nullptr, RopeParams{}),
            "non-finite");
    EXPECT_EQ(cache.index(0, 0)->ntotal, 0);
    keys[(n + 3) * kDim] = 0.1f;
    cache.prefill(0, n, keys.data(), values.data(), 0, nullptr, nullptr, RopeParams{}); // retry works
    std::vector<float> k1 = kvtest::gaussian(2, kDim, 3), v1 = kvtest::gaussian(2, kDim, 4);
    v1[kDim + 1] = kInf; // head 1's value
    EXPECT_THROW_MSG(cache.append(0, 1, k1.data(), v1.data()), "non-finite");
    EXPECT_EQ(cache.index(0, 0)->ntotal, n);
    EXPECT_EQ(cache.index(0, 1)->ntotal, n);
}

// ---- sizes a string or a file asks for (issue: no crash from any input) ----

TEST(BadInput, RetrieverSizesAreBoundedBeforeFaissAllocates) {
    struct Case {
        const char* s;
        const char* named;
    };
    // IVF0 and HNSW0 segfaulted inside Faiss at the first add; IVF999999999
    // allocated ~24 GB of empty lists before failing
    const Case cases[] = {
            {"TopK(IVF0,SQ8)", "IVF0"},
            {"TopK(IVF0,Flat)", "IVF0"},
            {"TopK(HNSW0)", "HNSW0"},
            {"TopK(HNSW1)", "HNSW1"},
            {"TopK(IVF999999999,Flat)", "IVF999999999"},
            {"TopK(IVF65537,Flat)", "IVF65537"}, // more lists than its training sample
            {"TopK(IMI2x30,Flat)", "IMI2x30"},
            {"TopK(HNSW100000)", "HNSW100000"},
            {"TopK(PQ3)", "PQ3"},                // 3 does not divide d = 16
            {"TopK(IVF4,PQ4x40)", "PQ4x40"},
            {"Sink4,Window8,TopK(IVF0,Flat)", "IVF0"},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.s);
        EXPECT_THROW_MSG(index_factory(kDim, c.s), c.named);
    }
    // what the bounds allow still works
    for (const char* ok : {"TopK(IVF1,Flat)", "TopK(HNSW2)", "TopK(IVF4,PQ4)", "TopK(IVF4_HNSW8,Flat)"}) {
        SCOPED_TRACE(ok);
        auto index = filled(ok, 300);
        std::vector<float> q = kvtest::gaussian(1, kDim, 3), out(kDim);
        EXPECT_NO_THROW(index->attend(1, q.data(), out.data(), nullptr));
    }
}

TEST(BadInput, ForgedRetrieverStringIsRefusedBeforeFaiss) {
    // the reader rebuilds and checks the retriever from its string: a forged
    // string must not reach faiss::index_factory unchecked
    auto index = filled("TopK(IVF4,Flat)", 200);
    for (const char* forged : {"IVF999999999,Flat", "IVF0,Flat", "HNSW0"}) {
        SCOPED_TRACE(forged);
        dynamic_cast<IndexTopK*>(index.get())->retriever_string = forged;
        std::vector<uint8_t> buf;
        write_index(index.get(), &buf);
        EXPECT_THROW_MSG(read_index(buf), forged);
    }
}

TEST(BadInput, LSHTableSizesAreBounded) {
    // 256 GiB of hyperplanes; 1 GiB of bucket offsets; tables that can never sample
    EXPECT_THROW_MSG(index_factory(1 << 20, "LSHSample16x4096"), "d=1048576");
    EXPECT_THROW_MSG(index_factory(65536, "LSHSample16x128"), "K*L*d");
    EXPECT_THROW_MSG(index_factory(8, "LSHSample16x4096"), "L*2^K");
    EXPECT_THROW_MSG(index_factory(kDim, "LSHSample1x1"), "min_hits=2");
    EXPECT_NO_THROW(index_factory(kDim, "LSHSample1x2"));
    EXPECT_NO_THROW(index_factory(128, "LSHSample10x150"));
}

TEST(BadInput, LSHTablesOnlyGrow) {
    // the tables keep no codes of their tokens: a rebuild over fewer tokens
    // than they hold, or over tokens not stored, is refused and changes nothing
    auto index = filled("LSHSample6x20", 300);
    auto& lsh = dynamic_cast<IndexLSHSample&>(*index);
    std::vector<float> key = kvtest::gaussian(1, kDim, 7);
    lsh.add_kv(1, key.data(), key.data()); // one token in the tail
    const idx_t indexed = lsh.n_indexed;
    ASSERT_EQ(indexed, 300);
    EXPECT_THROW_MSG(lsh.build_tables(indexed - 1), "only grow");
    EXPECT_THROW_MSG(lsh.build_tables(lsh.ntotal + 1), "n=302");
    EXPECT_EQ(lsh.n_indexed, indexed);
    EXPECT_NO_THROW(lsh.check_invariants());
    EXPECT_NO_THROW(lsh.build_tables()); // folds the tail
    EXPECT_EQ(lsh.n_indexed, lsh.ntotal);
    EXPECT_NO_THROW(lsh.check_invariants());
}

TEST(BadInput, PrefillTimeParameterAfterPrefill) {
    // budget=5 set on an eviction index after prefill was accepted and did
    // nothing; now it is refused, and accepted before prefill
    auto e = index_factory(kDim, "ProxyEvict20,TopK(Flat)");
    EXPECT_NO_THROW(set_index_parameters(e.get(), "budget=5"));
    std::vector<float> kv = kvtest::gaussian(40, kDim, 5), q = kvtest::gaussian(40, kDim, 6);
    PrefillInput in;
    in.n_tokens = 40;
    in.keys = kv.data();
    in.values = kv.data();
    in.n_queries = 40;
    in.queries = q.data();
    e->prefill(in);
    EXPECT_EQ(e->ntotal, 40);
    for (const char* knob : {"budget=5", "protect=3", "seed=2"}) {
        SCOPED_TRACE(knob);
        EXPECT_THROW_MSG(set_index_parameters(e.get(), knob), "prefill-time");
    }
    EXPECT_EQ(get_index_parameter(e.get(), "budget"), 5.0);
    // search-time knobs are still fine after prefill, and a factory string's
    // parameters are set on an empty index
    EXPECT_NO_THROW(set_index_parameters(e.get(), "k=7"));
    EXPECT_NO_THROW(index_factory(kDim, "Sink4,ProxyEvict20|budget=5"));
}

TEST(BadInput, NprobeAboveNlistIsRefused) {
    // found by fuzz_factory: accepted, then the saved index did not read back
    EXPECT_THROW_MSG(index_factory(kDim, "TopK(IVF4,Flat)|k=7,nprobe=6"), "nprobe=6 must be in [1, nlist=4]");
    auto index = filled("TopK(IVF4,Flat)", 200);
    EXPECT_THROW_MSG(set_index_parameters(index.get(), "nprobe=5"), "nprobe=5");
    set_index_parameters(index.get(), "nprobe=4");
    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);
    EXPECT_EQ(get_index_parameter(read_index(buf).get(), "nprobe"), 4.0);
}

TEST(BadInput, EfSearchOutOfRangeIsRefused) {
    // found by fuzz_factory: efSearch=1e14 was accepted (and truncated to an
    // int by Faiss), then the saved index did not read back
    EXPECT_THROW_MSG(
            index_factory(kDim, "ProxyEvict50_TOVA,TopK(HNSW8)|k=7,efSearch=100000000000020"),
            "efSearch=1e+14 must be in [1, 1048576]");
    auto index = filled("TopK(HNSW8)", 200);
    SearchParametersTopK per_call;
    per_call.efSearch = 1 << 30; // Faiss would allocate heaps of that size
    std::vector<float> q = kvtest::gaussian(1, kDim, 3), out(kDim);
    EXPECT_THROW_MSG(index->attend(1, q.data(), out.data(), nullptr, &per_call), "efSearch=1073741824");
    set_index_parameters(index.get(), "efSearch=1048576");
    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);
    EXPECT_EQ(get_index_parameter(read_index(buf).get(), "efSearch"), 1048576.0);
}

TEST(BadInput, ASeedKnobAboveTwoToThe53IsRefusedAtWriteAndRead) {
    // a seed set on the field, or read from a file, above 2^53 came back
    // rounded from get_index_parameter, and a refused set_index_parameters
    // could not set it back (seed=5 stayed)
    const uint64_t big = 0x9E3779B97F4A7C15ull, top = uint64_t(1) << 53;
    auto uniform = index_factory(kDim, "Uniform");
    auto choose = index_factory(kDim, "Choose(Flat;Uniform)");
    auto buckets = index_factory(kDim, "IVFAsym4_Centroid");
    auto evict = index_factory(kDim, "ProxyEvict50_Random,Flat"); // a policy that draws
    auto graph = index_factory(kDim, "RoarGraph8");
    struct Seeded {
        KVIndex* index;
        uint64_t* seed;
    };
    const Seeded all[] = {
            {uniform.get(), &dynamic_cast<IndexUniformSample&>(*uniform).seed},
            {choose.get(), &dynamic_cast<IndexChoose&>(*choose).seed},
            {buckets.get(), &dynamic_cast<IndexIVFAsym&>(*buckets).seed},
            {evict.get(), &dynamic_cast<IndexProxyEvict&>(*evict).seed},
            {graph.get(), &dynamic_cast<IndexRoarGraph&>(*graph).seed},
    };
    for (const Seeded& s : all) {
        SCOPED_TRACE(s.index->type_name());
        *s.seed = big;
        std::vector<uint8_t> buf;
        EXPECT_THROW_MSG(write_index(s.index, &buf), "must be at most 2^53");
        std::vector<uint8_t> forged = kvtest::write_unchecked(s.index);
        EXPECT_THROW_MSG(read_index(forged), "must be at most 2^53");
        // the top of the range: exact through a refused item's rollback
        *s.seed = top;
        EXPECT_THROW(set_index_parameters(s.index, "seed=5,k=0"), faiss::FaissException);
        EXPECT_EQ(*s.seed, top);
        write_index(s.index, &buf);
        EXPECT_EQ(get_index_parameter(read_index(buf).get(), "seed"), double(top));
    }
}

TEST(BadInput, PublicHelpersRefuseIdsOutOfRange) {
    // Uniform's draw wrapped n - n_excluded and returned ids far beyond n;
    // estimate_attention read before the rows for a -1 (search's padding)
    IndexUniformSample uniform(kDim, kDim);
    std::vector<float> q = kvtest::gaussian(1, kDim, 3);
    const idx_t beyond[] = {20, 30, 40};
    EXPECT_THROW_MSG(uniform.draw(q.data(), 2, 1, beyond, 3), "excluded[0] = 20");
    const idx_t unsorted[] = {1, 0};
    EXPECT_THROW_MSG(uniform.draw(q.data(), 5, 1, unsorted, 2), "increasing");
    EXPECT_THROW_MSG(uniform.draw(q.data(), -1, 1, nullptr, 0), "n=");
    const idx_t kept[] = {0, 2};
    std::vector<idx_t> ids = uniform.draw(q.data(), 4, 10, kept, 2);
    EXPECT_EQ(ids, (std::vector<idx_t>{1, 3}));

    std::vector<float> keys = kvtest::gaussian(4, kDim, 4), out(kDim);
    Selection sel;
    sel.push_back(0);
    sel.push_back(-1);
    EXPECT_THROW_MSG(
            estimate_attention(Estimator::topk, q.data(), KVRows(keys.data(), kDim),
                               KVRows(keys.data(), kDim), sel, out.data()),
            "sel.ids[1] = -1");
}

TEST(BadInput, PerCallKnobsThatNoIndexReadsAreRefused) {
    // SearchParametersTopK{nprobe} on Flat or LSH knobs on TopK were
    // ignored: a sweep over them measured the same index at every value
    std::vector<float> q = kvtest::gaussian(1, kDim, 3), out(kDim), dis(4);
    std::vector<idx_t> ids(4);
    SearchParametersTopK nprobe, ef;
    nprobe.nprobe = 2;
    ef.efSearch = 16;
    SearchParametersLSH hits;
    hits.min_hits = 1;
    struct Case {
        const char* factory;
        const SearchParametersKV* params;
        const char* message;
    };
    const Case unread[] = {
            {"Flat", &nprobe, "nprobe=2 does not apply to Flat"},
            {"Uniform", &ef, "efSearch=16 does not apply"},
            {"Weighted", &nprobe, "nprobe=2 does not apply"},
            {"Sink4,Window8,Flat", &nprobe, "nprobe=2 does not apply to Sink4,Window8,Flat"},
            {"TopK(Flat)", &hits, "min_hits=1 does not apply"},
            {"RoarGraph8", &hits, "min_hits=1 does not apply"},
            {"IVFAsym4_Centroid", &hits, "min_hits=1 does not apply"},
            {"LSHSample6x8", &nprobe, "nprobe=2 does not apply"},
            {"Hybrid(TopK(Flat),Uniform)", &hits, "min_hits=1 does not apply"},
            {"Choose(Flat;Uniform)", &ef, "efSearch=16 does not apply"},
            // the tail is handed only LSH knobs: its retriever's are read by none
            {"Hybrid(TopK(Flat),TopK(IVF16,Flat))", &nprobe, "nprobe=2 does not apply"},
    };
    for (const Case& c : unread) {
        SCOPED_TRACE(c.factory);
        auto index = filled(c.factory, 300);
        Selection sel;
        EXPECT_THROW_MSG(index->attend(1, q.data(), out.data(), nullptr, c.params), c.message);
        EXPECT_THROW_MSG(index->select(1, q.data(), &sel, c.params), c.message);
        EXPECT_THROW_MSG(index->search(1, q.data(), 4, dis.data(), ids.data(), c.params), c.message);
    }
    // read somewhere in the chain: taken
    const Case read[] = {
            {"Sink4,Window8,TopK(IVF16,Flat)", &nprobe, ""},
            {"Sink4,Window8,LSHSample6x8", &hits, ""},
            {"Hybrid(TopK(IVF16,Flat),LSHSample6x8)", &nprobe, ""},
            {"Hybrid(TopK(IVF16,Flat),LSHSample6x8)", &hits, ""},
            {"Hybrid(TopK(HNSW8),Uniform)", &ef, ""},
    };
    for (const Case& c : read) {
        SCOPED_TRACE(c.factory);
        auto index = filled(c.factory, 300);
        EXPECT_NO_THROW(index->attend(1, q.data(), out.data(), nullptr, c.params));
    }
}

TEST(BadInput, AChooseHandsItsCandidateOnlyTheKnobsItReads) {
    // a decode loop passes one knob to every head: a head that chose a
    // candidate without an IVF retriever takes nprobe, and answers as
    // without it; the knob still reaches a candidate that reads it
    std::vector<float> q = kvtest::gaussian(2, kDim, 3);
    SearchParametersTopK nprobe;
    nprobe.nprobe = 1;
    nprobe.k = 5;
    SearchParametersKV plain;
    plain.k = 5;
    auto flat_first = filled("Choose(TopK(Flat);TopK(IVF16,Flat))", 400); // add_kv: the first is chosen
    auto ivf_first = filled("Choose(TopK(IVF16,Flat);TopK(Flat))", 400);
    std::vector<Selection> got(2), want(2);
    flat_first->select(2, q.data(), got.data(), &nprobe);
    flat_first->select(2, q.data(), want.data(), &plain);
    for (int i = 0; i < 2; i++) {
        EXPECT_EQ(got[i].ids, want[i].ids);
    }
    // the chosen IVF candidate reads it: the centroids and one list of 16,
    // against all 400 keys with every list
    SearchParametersTopK all_lists = nprobe;
    all_lists.nprobe = 16;
    nprobe.count_scanned = all_lists.count_scanned = true;
    Selection one, all;
    ivf_first->select(1, q.data(), &one, &nprobe);
    ivf_first->select(1, q.data(), &all, &all_lists);
    EXPECT_EQ(all.n_scanned, size_t(16 + 400));
    EXPECT_LT(one.n_scanned, size_t(16 + 400));
    EXPECT_GT(one.n_scanned, size_t(16));
}

TEST(BadInput, PerCallKnobsAreCheckedLikeTheIndexKnobs) {
    // a negative efSearch was ignored and an nprobe above nlist clamped,
    // where set_index_parameters refuses both
    std::vector<float> q = kvtest::gaussian(1, kDim, 3), out(kDim);
    for (const char* s : {"TopK(HNSW8)", "TopK(IVF4,Flat)"}) {
        SCOPED_TRACE(s);
        auto index = filled(s, 300);
        SearchParametersTopK per_call;
        per_call.efSearch = -5;
        EXPECT_THROW_MSG(index->attend(1, q.data(), out.data(), nullptr, &per_call), "efSearch=-5");
    }
    auto ivf = filled("TopK(IVF4,Flat)", 300);
    SearchParametersTopK per_call;
    per_call.nprobe = 1000;
    EXPECT_THROW_MSG(ivf->attend(1, q.data(), out.data(), nullptr, &per_call), "nlist=4");
    per_call.nprobe = 4; // all lists: exact
    EXPECT_NO_THROW(ivf->attend(1, q.data(), out.data(), nullptr, &per_call));
    // Faiss's own knobs would be ignored: refused, for every type
    faiss::SearchParametersIVF faiss_ivf;
    faiss_ivf.nprobe = 2;
    faiss::SearchParameters plain; // carries nothing: accepted
    for (const char* s : kTypes) {
        SCOPED_TRACE(s);
        auto index = filled(s, 300);
        EXPECT_THROW_MSG(index->attend(1, q.data(), out.data(), nullptr, &faiss_ivf),
                         "Faiss SearchParameters subclass");
        EXPECT_NO_THROW(index->attend(1, q.data(), out.data(), nullptr, &plain));
    }
}

TEST(BadInput, AChildWrittenThroughAReferenceIsRefusedByItsWrapper) {
    // mutable_children() hands out the inner indexes; a write through one
    // (add_kv, reset) bypasses the wrapper, whose next call must say so
    // rather than answer with ids its inner index never had
    const int d = 16;
    std::vector<float> keys = kvtest::gaussian(300, d, 81), q = kvtest::gaussian(1, d, 82);
    for (const char* s : {"Sink4,Window8,Flat", "ProxyEvict50,TopK(Flat)", "Hybrid(TopK(Flat),Uniform)",
                          "Choose(Flat;TopK(Flat))"}) {
        SCOPED_TRACE(s);
        auto index = index_factory(d, s);
        PrefillInput in;
        in.n_tokens = 200;
        in.keys = keys.data();
        in.values = keys.data();
        in.n_queries = 20;
        in.n_query_heads = 1;
        in.queries = keys.data() + 180 * d;
        index->prefill(in);
        std::vector<float> out(d);
        index->attend(1, q.data(), out.data(), nullptr);
        KVIndex* child = index->mutable_children().front();
        child->add_kv(3, keys.data() + 200 * d, keys.data() + 200 * d);
        EXPECT_THROW_MSG(index->attend(1, q.data(), out.data(), nullptr), "written through a reference");
        EXPECT_THROW_MSG(index->add_kv(1, keys.data(), keys.data()), "written through a reference");
        std::vector<uint8_t> buf;
        EXPECT_THROW_MSG(write_index(index.get(), &buf), "written through a reference");
        child->reset();
        EXPECT_THROW_MSG(index->attend(1, q.data(), out.data(), nullptr), "written through a reference");
        index->reset(); // the way back
        index->prefill(in);
        index->attend(1, q.data(), out.data(), nullptr);

        // reset and refilled to the same count with other tokens: the
        // counts agree, the child's token stamp does not
        child = index->mutable_children().front();
        const idx_t held = child->ntotal;
        ASSERT_GT(held, 0);
        std::vector<float> other = kvtest::gaussian(held, d, 83);
        child->reset();
        child->add_kv(held, other.data(), other.data());
        ASSERT_EQ(child->ntotal, held);
        EXPECT_THROW_MSG(index->attend(1, q.data(), out.data(), nullptr), "written through a reference");
        std::vector<idx_t> labels(5);
        EXPECT_THROW_MSG(index->search(1, q.data(), 5, out.data(), labels.data()), "written through a reference");
        EXPECT_THROW_MSG(write_index(index.get(), &buf), "written through a reference");
        index->reset();
        index->prefill(in);
        index->attend(1, q.data(), out.data(), nullptr);
    }
}

TEST(BadInput, AChildReplacedOrWrittenBelowTheTopIsRefused) {
    const int d = 16;
    std::vector<float> keys = kvtest::gaussian(300, d, 84), q = kvtest::gaussian(1, d, 85);
    std::vector<float> out(d);
    auto index = index_factory(d, "Sink4,Window8,Hybrid(TopK(Flat),Uniform)");
    index->add_kv(200, keys.data(), keys.data());
    auto& sw = dynamic_cast<IndexSinkWindow&>(*index);

    // a grandchild written through a reference: its parent (the Hybrid)
    // refuses, named, when the top index hands it the call
    KVIndex* heavy = sw.inner->mutable_children().front();
    std::vector<float> other = kvtest::gaussian(heavy->ntotal, d, 86);
    const idx_t held = heavy->ntotal;
    heavy->reset();
    heavy->add_kv(held, other.data(), other.data());
    EXPECT_THROW_MSG(index->attend(1, q.data(), out.data(), nullptr), "IndexHybrid: its inner index 0");
    index->reset();
    index->add_kv(200, keys.data(), keys.data());
    index->attend(1, q.data(), out.data(), nullptr);

    // the child replaced by a copy of itself: the wrapper cannot tell a
    // copy holding the same tokens from another index, and refuses both
    sw.inner = clone_index(sw.inner.get());
    EXPECT_THROW_MSG(index->attend(1, q.data(), out.data(), nullptr), "or replaced");

    // read back from a file, the wrapper trusts its children as written,
    // and still sees a later write through a reference
    index->reset();
    index->add_kv(200, keys.data(), keys.data());
    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);
    std::unique_ptr<KVIndex> back = read_index(buf);
    std::vector<float> out_back(d);
    index->attend(1, q.data(), out.data(), nullptr);
    back->attend(1, q.data(), out_back.data(), nullptr);
    EXPECT_EQ(out, out_back);
    KVIndex* inner = back->mutable_children().front();
    const idx_t n_inner = inner->ntotal;
    inner->reset();
    inner->add_kv(n_inner, other.data(), other.data());
    EXPECT_THROW_MSG(back->attend(1, q.data(), out_back.data(), nullptr), "IndexSinkWindow: its inner index 0");
}

TEST(BadInput, RowCountsBeyondAnyBufferAreRefusedBeforeTheirProducts) {
    // n * d (and n * heads * d) of n = 2^62 wrapped to 0: nothing was
    // checked, ntotal became 2^62 with no storage, and attend crashed
    const int d = 4;
    const idx_t huge = idx_t(1) << 62;
    std::vector<float> k(64, 0.5f), out(64);
    IndexKVFlat flat(d, d);
    EXPECT_THROW_MSG(flat.add_kv(huge, k.data(), k.data()), "more than any buffer");
    EXPECT_EQ(flat.ntotal, 0);
    flat.add_kv(2, k.data(), k.data());
    EXPECT_THROW_MSG(flat.attend(huge, k.data(), out.data(), nullptr), "more than any buffer");
    KVCache cache(1, 4, 4, d, d, "Flat");
    cache.prefill(0, 4, k.data(), k.data(), 0, nullptr, nullptr, RopeParams{});
    EXPECT_THROW_MSG(cache.append(0, huge, k.data(), k.data()), "more than any buffer");
    EXPECT_THROW_MSG(cache.append(0, huge / 4 + 1, k.data(), k.data()), "more than any buffer");
    EXPECT_THROW_MSG(cache.attend(0, huge, k.data(), out.data(), nullptr), "more than any buffer");
    EXPECT_THROW_MSG(cache.add_queries(0, huge, k.data()), "more than any buffer");
    EXPECT_EQ(cache.n_tokens(0), 4);
    KVCache fresh(1, 4, 4, d, d, "Flat");
    EXPECT_THROW_MSG(fresh.prefill(0, huge, k.data(), k.data(), 0, nullptr, nullptr, RopeParams{}),
                     "more than any buffer");
    PrefillInput in;
    in.n_tokens = 4;
    in.keys = in.values = k.data();
    in.n_queries = huge;
    in.n_query_heads = 4;
    in.queries = k.data();
    in.query_positions = nullptr;
    EXPECT_THROW_MSG(IndexKVFlat(d, d).prefill(in), "more than any buffer");
}

TEST(BadInput, KVStorageRefusesRangesOutsideItsTokens) {
    KVStorage s(4, 4, KVType::f32);
    std::vector<float> k(40, 1.0f), out(4);
    s.append(10, k.data(), k.data());
    EXPECT_THROW_MSG(s.append(-3, k.data(), k.data()), "n=-3");
    EXPECT_THROW_MSG(s.key(10, out.data()), "outside the 10 stored");
    EXPECT_THROW_MSG(s.value(-1, out.data()), "outside the 10 stored");
    KVStorage t(4, 4, KVType::f32);
    EXPECT_THROW_MSG(t.append_from(s, 8, 100), "outside the 10 stored");
    EXPECT_THROW_MSG(s.erase_front(100), "outside the 10 stored");
    EXPECT_THROW_MSG(s.truncate(-1), "n=-1");
    s.truncate(idx_t(1) << 60); // more than it holds keeps all (n * bytes used to wrap to 0)
    EXPECT_EQ(s.size(), 10);
    std::vector<float> kk, vv;
    EXPECT_THROW_MSG(s.to_float(5, 6, &kk, &vv), "outside the 10 stored");
    EXPECT_EQ(s.size(), 10);
    s.key(9, out.data());
    EXPECT_EQ(out[0], 1.0f);
    // a stored value add_kv would refuse (|x| > 1e12) is refused by read
    std::vector<float> big(4, 1e20f);
    std::vector<uint8_t> buf;
    BufferWriter w(&buf);
    w.vector(big);
    w.vector(big);
    BufferReader r(buf.data(), buf.size());
    KVStorage back(4, 4, KVType::f32);
    EXPECT_THROW_MSG(back.read(r, "test"), "too large");
}

TEST(BadInput, TheTrainerChecksItsPromptsLikePrefill) {
    const int d = 8;
    IVFAsymTrainingParams p;
    p.n_centroids = 2;
    IVFAsymTrainer trainer(d, p);
    std::vector<float> x = kvtest::gaussian(200, d, 91);
    PrefillInput in;
    in.n_tokens = 200;
    in.keys = in.values = x.data();
    in.n_queries = 50;
    in.n_query_heads = -1;
    in.queries = x.data();
    EXPECT_THROW_MSG(trainer.add_prompt(in), "n_query_heads=-1");
    in.n_query_heads = 1;
    in.first_position = -100;
    EXPECT_THROW_MSG(trainer.add_prompt(in), "first_position=-100");
    EXPECT_EQ(trainer.report.n_prompts, 0);
    std::vector<int32_t> buckets(10);
    EXPECT_THROW_MSG(
            assign_keys_to_buckets(x.data(), 10, d, 0, RopeParams{}, x.data(), 0, buckets.data()),
            "n_centroids=0");
    x[3] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_THROW_MSG(
            assign_keys_to_buckets(x.data(), 10, d, 0, RopeParams{}, x.data() + 80, 2, buckets.data()),
            "non-finite");
}

}  // namespace test_bad_input
