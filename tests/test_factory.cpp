// Factory strings (index_factory.h) and the "k=..,nprobe=.." parameter
// strings (parameters.h): round trips, dynamic types, and the errors.

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <faiss/IVFlib.h>
#include <faiss/IndexHNSW.h>
#include <faiss/IndexIVF.h>
#include <faiss/IndexIVFFlat.h>
#include <faiss/impl/FaissException.h>

#include <kvindex/IndexKVFlat.h>
#include <kvindex/IndexSinkWindow.h>
#include <kvindex/IndexTopK.h>
#include <kvindex/index_factory.h>
#include <kvindex/parameters.h>

#include "expect_throw.h"
#include "reference.h"

namespace test_factory {

using namespace kvindex;

namespace {

const int kDim = 16;

/// Every canonical string must print back to itself.
const char* const kCanonical[] = {
        "Flat",
        "TopK(Flat)",
        "TopK(IVF16,Flat)",
        "TopK(HNSW32)",
        "Sink4,Flat",
        "Window64,Flat",
        "Sink4,Window64,Flat",
        "Sink4,Window64,TopK(IVF16,Flat)",
        "Sink0,Flat",
};


/// Checks the dynamic type of the index built from a canonical string.
void check_type(const KVIndex* index, const std::string& s) {
    const KVIndex* inner = index;
    std::string inner_s = s;
    if (s.rfind("Sink", 0) == 0 || s.rfind("Window", 0) == 0) {
        auto w = dynamic_cast<const IndexSinkWindow*>(index);
        ASSERT_TRUE(w) << s;
        ASSERT_TRUE(w->inner) << s;
        idx_t n_sink = 0, n_window = 0;
        // strip the static prefix, reading the counts
        while (true) {
            size_t comma = inner_s.find(',');
            std::string part = inner_s.substr(0, comma);
            if (part.rfind("Sink", 0) == 0) {
                n_sink = std::stoll(part.substr(4));
            } else if (part.rfind("Window", 0) == 0) {
                n_window = std::stoll(part.substr(6));
            } else {
                break;
            }
            inner_s = inner_s.substr(comma + 1);
        }
        EXPECT_EQ(w->n_sink, n_sink) << s;
        EXPECT_EQ(w->n_window, n_window) << s;
        EXPECT_EQ(w->inner->d, index->d) << s;
        EXPECT_EQ(w->inner->d_value, index->d_value) << s;
        inner = w->inner.get();
    }
    if (inner_s == "Flat") {
        EXPECT_TRUE(dynamic_cast<const IndexKVFlat*>(inner)) << s;
    } else {
        auto t = dynamic_cast<const IndexTopK*>(inner);
        ASSERT_TRUE(t) << s;
        EXPECT_EQ("TopK(" + t->retriever_string + ")", inner_s);
        ASSERT_TRUE(t->retriever);
        EXPECT_EQ(t->retriever->d, kDim);
        EXPECT_EQ(t->retriever->metric_type, faiss::METRIC_INNER_PRODUCT) << s;
        if (t->retriever_string == "IVF16,Flat") {
            auto ivf = dynamic_cast<const faiss::IndexIVFFlat*>(t->retriever.get());
            ASSERT_TRUE(ivf) << s;
            EXPECT_EQ(ivf->nlist, 16u);
        } else if (t->retriever_string == "HNSW32") {
            EXPECT_TRUE(dynamic_cast<const faiss::IndexHNSW*>(t->retriever.get())) << s;
        }
    }
}

} // namespace

TEST(Factory, CanonicalRoundTrip) {
    for (const char* s : kCanonical) {
        std::unique_ptr<KVIndex> index = index_factory(kDim, s);
        ASSERT_TRUE(index) << s;
        EXPECT_EQ(index_factory_string(index.get()), s);
        EXPECT_EQ(index->d, kDim) << s;
        EXPECT_EQ(index->d_value, kDim) << s; // d_value = -1 means d
        EXPECT_EQ(index->ntotal, 0) << s;
        EXPECT_EQ(index->metric_type, faiss::METRIC_INNER_PRODUCT) << s;
        check_type(index.get(), s);
    }
}

TEST(Factory, NonCanonicalPrintsCanonically) {
    struct Case {
        const char* in;
        const char* canonical;
    };
    const Case cases[] = {
            {"Window64,Sink4,Flat", "Sink4,Window64,Flat"},
            {"Window8,Sink2,TopK(HNSW32)", "Sink2,Window8,TopK(HNSW32)"},
            {"Window0,Flat", "Sink0,Flat"},       // zero counts are omitted...
            {"Sink0,Window0,Flat", "Sink0,Flat"}, // ...but the wrapper stays visible
            {"Sink0,Window64,Flat", "Window64,Flat"},
            {"Sink004,Flat", "Sink4,Flat"},
    };
    for (const Case& c : cases) {
        auto index = index_factory(kDim, c.in);
        std::string s = index_factory_string(index.get());
        EXPECT_EQ(s, c.canonical) << c.in;
        // idempotent: the printed string builds an index that prints the same
        auto again = index_factory(kDim, s);
        EXPECT_EQ(index_factory_string(again.get()), s) << c.in;
        auto w = dynamic_cast<IndexSinkWindow*>(index.get());
        auto w2 = dynamic_cast<IndexSinkWindow*>(again.get());
        ASSERT_TRUE(w && w2) << c.in;
        EXPECT_EQ(w->n_sink, w2->n_sink) << c.in;
        EXPECT_EQ(w->n_window, w2->n_window) << c.in;
    }
}

TEST(Factory, ValueDimension) {
    for (const char* s : kCanonical) {
        auto index = index_factory(kDim, s, 8);
        EXPECT_EQ(index->d, kDim) << s;
        EXPECT_EQ(index->d_value, 8) << s;
        if (auto w = dynamic_cast<IndexSinkWindow*>(index.get())) {
            EXPECT_EQ(w->inner->d_value, 8) << s;
        }
        // values of size 8 are stored and read back as such (enough tokens
        // that the sink, the window and the inner index all hold some)
        const idx_t n = 80;
        std::vector<float> keys = kvtest::gaussian(n, kDim, 11);
        std::vector<float> values = kvtest::gaussian(n, 8, 12);
        index->add_kv(n, keys.data(), values.data());
        ASSERT_EQ(index->ntotal, n);
        for (idx_t i : {idx_t(0), idx_t(5), idx_t(n - 1)}) {
            std::vector<float> v(8), key(kDim);
            index->reconstruct_value(i, v.data());
            index->reconstruct(i, key.data());
            std::vector<float> v_ref(values.begin() + i * 8, values.begin() + (i + 1) * 8);
            std::vector<float> k_ref(keys.begin() + i * kDim, keys.begin() + (i + 1) * kDim);
            EXPECT_EQ(v_ref, v) << s << " token " << i;
            EXPECT_EQ(k_ref, key) << s << " token " << i;
        }
        std::vector<float> q = kvtest::gaussian(2, kDim, 13), out(2 * 8);
        index->attend(2, q.data(), out.data(), nullptr);
    }
}

TEST(Factory, BadStrings) {
    struct Case {
        const char* s;
        const char* named; ///< the part the message must name
    };
    const Case cases[] = {
            {"Foo", "Foo"},
            {"Sink4,Foo", "Foo"},
            {"Sink4", "Sink4"},
            {"Sink4,Sink8,Flat", "Sink8"},
            {"TopK()", "TopK()"},
            {"TopK(Flat", "TopK(Flat"},
            {"TopK(NotAFaissIndex)", "NotAFaissIndex"},
            {"Flat,Flat", "Flat,Flat"},
            {"", "''"},
            {"Window4,Window8,Flat", "Window8"},
            {"Sink-1,Flat", "Sink-1"},
            {"Sink,Flat", "'Sink'"},
            {"TopK(Flat))", "TopK(Flat))"},
            {"flat", "flat"},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.s);
        EXPECT_THROW_MSG(index_factory(kDim, c.s), c.named);
    }
}

TEST(Factory, BadDimensions) {
    EXPECT_THROW_MSG(index_factory(0, "Flat"), "d=0");
    EXPECT_THROW_MSG(index_factory(-4, "TopK(Flat)"), "d=-4");
    EXPECT_THROW_MSG(index_factory(kDim, "Flat", 0), "d_value=0");
    EXPECT_THROW_MSG(index_factory(kDim, "Sink4,Flat", -2), "d_value=-2");
}

TEST(Factory, ParametersKAndNprobe) {
    auto index = index_factory(kDim, "Sink4,Window8,TopK(IVF16,Flat)");
    set_index_parameters(index.get(), "k=10,nprobe=4");
    auto w = dynamic_cast<IndexSinkWindow*>(index.get());
    ASSERT_TRUE(w);
    auto t = dynamic_cast<IndexTopK*>(w->inner.get());
    ASSERT_TRUE(t);
    EXPECT_EQ(t->k, 10);
    EXPECT_EQ(w->k, 10);
    const faiss::IndexIVF* ivf = faiss::ivflib::extract_index_ivf(t->retriever.get());
    EXPECT_EQ(ivf->nprobe, 4u);

    // a later string overrides only what it names
    set_index_parameters(index.get(), "nprobe=7");
    EXPECT_EQ(ivf->nprobe, 7u);
    EXPECT_EQ(t->k, 10);
}

TEST(Factory, ParametersEfSearch) {
    auto index = index_factory(kDim, "TopK(HNSW32)");
    set_index_parameters(index.get(), "efSearch=64");
    auto t = dynamic_cast<IndexTopK*>(index.get());
    ASSERT_TRUE(t);
    auto hnsw = dynamic_cast<faiss::IndexHNSW*>(t->retriever.get());
    ASSERT_TRUE(hnsw);
    EXPECT_EQ(hnsw->hnsw.efSearch, 64);
}

TEST(Factory, ParametersErrors) {
    auto ivf = index_factory(kDim, "Sink4,Window8,TopK(IVF16,Flat)");
    auto flat = index_factory(kDim, "Flat");
    auto hnsw = index_factory(kDim, "TopK(HNSW32)");

    EXPECT_THROW_MSG(set_index_parameters(ivf.get(), "foo=1"), "'foo'");
    EXPECT_THROW_MSG(set_index_parameters(flat.get(), "nprobe=4"), "nprobe");
    EXPECT_THROW_MSG(set_index_parameters(hnsw.get(), "nprobe=4"), "nprobe");
    EXPECT_THROW_MSG(set_index_parameters(ivf.get(), "efSearch=16"), "efSearch");
    EXPECT_THROW_MSG(set_index_parameters(ivf.get(), "k=0"), "k=0");
    EXPECT_THROW_MSG(set_index_parameters(ivf.get(), "k=-3"), "k=-3");
    EXPECT_THROW_MSG(set_index_parameters(ivf.get(), "k=2.5"), "k=2.5");
    EXPECT_THROW_MSG(set_index_parameters(ivf.get(), "k=abc"), "abc");
    EXPECT_THROW_MSG(set_index_parameters(ivf.get(), "k"), "'k'");
    EXPECT_THROW_MSG(set_index_parameters(ivf.get(), "k="), "'k='");
    EXPECT_THROW_MSG(set_index_parameters(ivf.get(), "=5"), "'=5'");
    EXPECT_THROW_MSG(set_index_parameters(ivf.get(), "nprobe=0"), "nprobe");
    EXPECT_THROW_MSG(set_index_parameters(hnsw.get(), "efSearch=-1"), "efSearch");
    // a repeated name would silently win
    EXPECT_THROW_MSG(set_index_parameters(ivf.get(), "k=5,nprobe=2,k=6"), "'k' given twice");
    EXPECT_THROW_MSG(parse_parameters("k=0x10"), "not a decimal number");
    EXPECT_EQ(parse_parameters("k=5,nprobe=2"),
              (std::vector<std::pair<std::string, double>>{{"k", 5.0}, {"nprobe", 2.0}}));
    // a '|' inside parentheses is named as such, not as unbalanced ones
    EXPECT_THROW_MSG(parse_index_spec("Choose(TopK(Flat)|k=3;Uniform)"), "'|' inside parentheses");
    EXPECT_EQ(parse_index_spec("Choose(TopK(Flat);Uniform)|k=3").params, "k=3");

    // the failed calls left the valid settings alone
    auto t = dynamic_cast<IndexTopK*>(dynamic_cast<IndexSinkWindow*>(ivf.get())->inner.get());
    EXPECT_EQ(t->k, 100);
}

TEST(Factory, ParametersGoToTheIndexesThatHaveThem) {
    // a TopK whose retriever lacks the knob does not stop it reaching the
    // candidate that has it (parameters.h: "each name goes to every index of
    // the chain that has it")
    auto choose = index_factory(kDim, "Choose(TopK(IVF4,Flat);TopK(Flat);TopK(HNSW8))");
    set_index_parameters(choose.get(), "nprobe=2,efSearch=24");
    EXPECT_EQ(get_index_parameter(choose.get(), "nprobe"), 2.0);
    EXPECT_EQ(get_index_parameter(choose.get(), "efSearch"), 24.0);
    auto hybrid = index_factory(kDim, "Hybrid(TopK(IVF4,Flat),Uniform)");
    EXPECT_NO_THROW(set_index_parameters(hybrid.get(), "nprobe=3"));
    EXPECT_EQ(get_index_parameter(hybrid.get(), "nprobe"), 3.0);
    // and a chain where nobody has it still names it
    EXPECT_THROW_MSG(
            set_index_parameters(index_factory(kDim, "TopK(Flat)").get(), "nprobe=2"),
            "unknown parameter 'nprobe'");
}

TEST(Factory, ParametersAreSetAllOrNothing) {
    // nprobe=8 suits the first candidate (nlist 16), not the second (nlist 4)
    auto choose = index_factory(kDim, "Choose(TopK(IVF16,Flat);TopK(IVF4,Flat))");
    set_index_parameters(choose.get(), "k=11,nprobe=3");
    auto nprobes = [&]() {
        std::vector<size_t> out;
        for (const KVIndex* c : choose->children()) {
            auto t = dynamic_cast<const IndexTopK*>(c);
            out.push_back(faiss::ivflib::extract_index_ivf(t->retriever.get())->nprobe);
        }
        return out;
    };
    ASSERT_EQ(nprobes(), (std::vector<size_t>{3, 3}));
    EXPECT_THROW_MSG(set_index_parameters(choose.get(), "nprobe=8"), "nprobe=8");
    EXPECT_EQ(nprobes(), (std::vector<size_t>{3, 3}));
    // an item that fails puts back the items before it
    EXPECT_THROW_MSG(set_index_parameters(choose.get(), "k=20,nprobe=8"), "nprobe=8");
    EXPECT_EQ(get_index_parameter(choose.get(), "k"), 11.0);
    EXPECT_THROW_MSG(set_index_parameters(choose.get(), "k=20,foo=1"), "'foo'");
    EXPECT_EQ(get_index_parameter(choose.get(), "k"), 11.0);
    // and an item that does not parse is found before anything is set
    EXPECT_THROW_MSG(set_index_parameters(choose.get(), "k=20,nprobe"), "'nprobe'");
    EXPECT_EQ(get_index_parameter(choose.get(), "k"), 11.0);
    EXPECT_EQ(nprobes(), (std::vector<size_t>{3, 3}));
    set_index_parameters(choose.get(), "k=20,nprobe=4");
    EXPECT_EQ(get_index_parameter(choose.get(), "k"), 20.0);
    EXPECT_EQ(nprobes(), (std::vector<size_t>{4, 4}));
    // a wrapper's mirror of its child's knob is put back with the child's
    auto hybrid = index_factory(kDim, "Hybrid(TopK(IVF4,Flat),Uniform)|k=9");
    EXPECT_THROW_MSG(set_index_parameters(hybrid.get(), "k=20,nprobe=99"), "nprobe=99");
    EXPECT_EQ(hybrid->k, 9);
    EXPECT_EQ(hybrid->children()[0]->k, 9);
}

TEST(Factory, ParametersAreParsedStrictly) {
    auto ivf = index_factory(kDim, "TopK(IVF16,Flat)");
    // what strtod would take but a parameter string should not
    for (const char* bad : {"k=10,", "k= 5", "k=0x10", "k=inf", "k=nan", "k=1e300", "nprobe=1e300"}) {
        SCOPED_TRACE(bad);
        EXPECT_THROW(set_index_parameters(ivf.get(), bad), faiss::FaissException);
    }
    set_index_parameters(ivf.get(), "k=1e2");
    EXPECT_EQ(ivf->k, 100);
}

TEST(Factory, PercentagesResolveAgainstTheContext) {
    EXPECT_EQ(resolve_percentages("k=2%,nprobe=3", 500), "k=10,nprobe=3");
    EXPECT_EQ(resolve_percentages("k=0.001%", 500), "k=1"); // at least one token
    EXPECT_EQ(resolve_percentages("k=100%", idx_t(1) << 53), "k=9007199254740992");
    // a context whose share would not convert back to an integer is refused
    EXPECT_THROW_MSG(resolve_percentages("k=100%", std::numeric_limits<idx_t>::max()), "2^53");
    EXPECT_THROW_MSG(resolve_percentages("k=5%", 0), "context length");
    EXPECT_THROW_MSG(resolve_percentages("k=101%", 100), "(0, 100]");
}

// Only a count of tokens can be a share of the context: ProxyEvict's protect
// is a percent already ("protect=1%" became 20 tokens' worth of percent at
// 2000 tokens), nprobe a list count, seed a seed.
TEST(Factory, PercentagesOnlyOnKnobsInTokens) {
    auto evict = index_factory(kDim, "ProxyEvict50");
    EXPECT_THROW_MSG(resolve_percentages("protect=1%", 2000, evict.get()), "not a count of tokens");
    EXPECT_THROW_MSG(resolve_percentages("seed=5%", 2000, evict.get()), "seed");
    EXPECT_EQ(resolve_percentages("budget=5%,protect=3", 2000, evict.get()), "budget=100,protect=3");
    auto ivf = index_factory(kDim, "Sink4,Window8,TopK(IVF16,Flat)");
    EXPECT_EQ(resolve_percentages("k=2%", 500, ivf.get()), "k=10");
    EXPECT_THROW_MSG(resolve_percentages("nprobe=50%", 500, ivf.get()), "nprobe");
    auto hybrid = index_factory(kDim, "Hybrid(TopK(Flat),Uniform)");
    EXPECT_EQ(resolve_percentages("k=1%,sample=2%", 1000, hybrid.get()), "k=10,sample=20");
    EXPECT_THROW_MSG(resolve_percentages("epsilon=10%", 1000, hybrid.get()), "epsilon");
    // every knob that says it is in tokens takes a percentage
    for (const char* s : {"Choose(TopK(HNSW8);RoarGraph8;LSHSample6x20)", "ProxyEvict20,Hybrid(TopK(Flat),Uniform)"}) {
        auto index = index_factory(kDim, s);
        for (const ParameterInfo& p : index_parameter_info(index.get())) {
            std::string item = p.name + "=2%";
            if (p.in_tokens) {
                EXPECT_EQ(resolve_percentages(item, 1000, index.get()), p.name + "=20") << s;
            } else {
                EXPECT_THROW_MSG(resolve_percentages(item, 1000, index.get()), "not a count of tokens");
            }
        }
    }
}

// A knob the index's mode does not read is not one of its knobs: taken by
// nothing, it is refused as unknown, not taken without effect (a sweep over
// it would measure nothing); a sibling in the chain that reads it keeps it.
TEST(Factory, KnobsTheModeDoesNotReadAreNotItsKnobs) {
    auto random = index_factory(kDim, "ProxyEvict50_Random");
    EXPECT_THROW_MSG(set_index_parameters(random.get(), "protect=1"), "unknown parameter 'protect'");
    EXPECT_THROW_MSG(set_index_parameters(random.get(), "n_sink=2"), "unknown parameter 'n_sink'");
    set_index_parameters(random.get(), "seed=7");
    auto h2o = index_factory(kDim, "ProxyEvict50_H2O");
    EXPECT_THROW_MSG(set_index_parameters(h2o.get(), "seed=7"), "unknown parameter 'seed'");
    EXPECT_THROW_MSG(get_index_parameter(h2o.get(), "proxy_window"), "unknown parameter");
    auto streaming = index_factory(kDim, "ProxyEvict50_StreamingLLM");
    set_index_parameters(streaming.get(), "n_sink=2");
    EXPECT_THROW_MSG(set_index_parameters(streaming.get(), "proxy_keep=5"), "unknown parameter");
    auto nacl = index_factory(kDim, "ProxyEvict50");
    set_index_parameters(nacl.get(), "protect=1,proxy_keep=5,proxy_window=10,n_sink=2,seed=7");
    // a sibling's seed: the H2O eviction does not take it, the sampler does
    auto chain = index_factory(kDim, "ProxyEvict20_H2O,Uniform");
    set_index_parameters(chain.get(), "seed=7");
    EXPECT_EQ(get_index_parameter(chain.get(), "seed"), 7);
    auto choose = index_factory(kDim, "Choose(ProxyEvict25_TOVA;TopK(Flat))");
    set_index_parameters(choose.get(), "seed=7"); // the holdout's

    auto centroid = index_factory(kDim, "IVFAsym16_Centroid");
    EXPECT_THROW_MSG(set_index_parameters(centroid.get(), "var_weight=0.5"), "unknown parameter");
    EXPECT_THROW_MSG(set_index_parameters(centroid.get(), "hidden=8"), "unknown parameter");
    EXPECT_THROW_MSG(set_index_parameters(centroid.get(), "min_distance=5"), "unknown parameter");
    set_index_parameters(centroid.get(), "nprobe=3");
    auto moment = index_factory(kDim, "IVFAsym16_Moment");
    set_index_parameters(moment.get(), "var_weight=0.5");
    EXPECT_THROW_MSG(set_index_parameters(moment.get(), "train_iterations=100"), "unknown parameter");
    auto qmodel = index_factory(kDim, "IVFAsym16");
    set_index_parameters(qmodel.get(), "hidden=8,train_iterations=100,min_distance=5");
    EXPECT_THROW_MSG(set_index_parameters(qmodel.get(), "var_weight=0.5"), "unknown parameter");
    // two probes in a Choose: each takes its own
    auto both = index_factory(kDim, "Choose(IVFAsym8;IVFAsym8_Moment)");
    set_index_parameters(both.get(), "var_weight=0.5,hidden=64");
}

TEST(Factory, KIsAKnobOnlyWhereATopKIsRead) {
    // "LSHSample8x75|k=5" was taken and did nothing: every type had a k
    for (const char* s : {"Flat", "LSHSample8x75", "Sink4,Window64,LSHSample8x75", "IVFAsym16",
                          "ProxyEvict20", "ProxyEvict20_H2O,LSHSample8x75", "BF16,Sink4,Flat"}) {
        SCOPED_TRACE(s);
        EXPECT_FALSE(index_factory(kDim, s)->reads_search_knob("k"));
        EXPECT_THROW_MSG(index_factory(kDim, std::string(s) + "|k=5"), "unknown parameter 'k'");
    }
    for (const char* s : {"TopK(Flat)", "TopK(HNSW8)", "RoarGraph8", "Uniform", "Weighted",
                          "ProxyEvict20,Sink4,TopK(Flat)", "Hybrid(TopK(Flat),LSHSample8x75)",
                          "Choose(Flat;LSHSample8x75;TopK(Flat))"}) {
        SCOPED_TRACE(s);
        auto index = index_factory(kDim, std::string(s) + "|k=5");
        EXPECT_TRUE(index->reads_search_knob("k"));
        EXPECT_EQ(get_index_parameter(index.get(), "k"), 5.0);
    }

    // per call: a hybrid hands k to its heavy part only (its LSH tail reads
    // none and would refuse it), the same selection as the knob set
    const idx_t n = 300;
    std::vector<float> keys = kvtest::gaussian(n, kDim, 21), values = kvtest::gaussian(n, 8, 22);
    std::vector<float> q = kvtest::gaussian(2, kDim, 23);
    auto per_call = index_factory(kDim, "Hybrid(TopK(Flat),LSHSample6x20)", 8);
    auto set = index_factory(kDim, "Hybrid(TopK(Flat),LSHSample6x20)|k=3", 8);
    for (KVIndex* x : {per_call.get(), set.get()}) {
        x->set_stream(4);
        x->add_kv(n, keys.data(), values.data());
    }
    SearchParametersKV p;
    p.k = 3;
    Selection a[2], b[2];
    per_call->select(2, q.data(), a, &p);
    set->select(2, q.data(), b, nullptr);
    for (int i = 0; i < 2; i++) {
        EXPECT_EQ(a[i].ids, b[i].ids);
        EXPECT_EQ(a[i].inclusion, b[i].inclusion);
    }
    // a user's carrier of its own fields (no knobs listed) with a k: the
    // chosen LSH reads no k and gets the SearchParametersKV part without it
    struct TaggedParams : SearchParametersKV {
        int tag = 3;
    };
    auto choose = index_factory(kDim, "Choose(LSHSample6x20;TopK(Flat))", 8);
    choose->add_kv(n, keys.data(), values.data());
    TaggedParams tagged;
    tagged.k = 3;
    std::vector<float> out_tagged(2 * 8), out_plain(2 * 8);
    choose->attend(2, q.data(), out_tagged.data(), nullptr, &tagged);
    choose->attend(2, q.data(), out_plain.data(), nullptr, &p);
    EXPECT_EQ(out_tagged, out_plain);

    // a budget split needs a heavy part with a k: refused for a type
    // without one, not split where a Choose chose Flat
    const idx_t nq = 64;
    std::vector<float> pq = kvtest::gaussian(nq, kDim, 24);
    PrefillInput in;
    in.n_tokens = n;
    in.keys = keys.data();
    in.values = values.data();
    in.n_queries = nq;
    in.queries = pq.data();
    for (const char* mode : {"budget=10", "epsilon=0.1"}) {
        SCOPED_TRACE(mode);
        auto flat_heavy = index_factory(kDim, std::string("Hybrid(Flat,Uniform)|") + mode, 8);
        EXPECT_THROW_MSG(flat_heavy->prefill(in), "the heavy part Flat has no k");
        auto ivf_heavy = index_factory(kDim, std::string("Hybrid(IVFAsym4,Uniform)|") + mode, 8);
        EXPECT_THROW_MSG(ivf_heavy->prefill(in), "the heavy part IVFAsym4 has no k");
        auto chose_flat = index_factory(
                kDim, std::string("Hybrid(Choose(Flat;TopK(Flat)),Uniform)|") + mode, 8);
        chose_flat->prefill(in);
        if (std::string(mode) == "epsilon=0.1") {
            ASSERT_EQ(get_index_parameter(chose_flat.get(), "chosen"), 0.0); // exact: no error
            EXPECT_EQ(get_index_parameter(chose_flat.get(), "calibrated_k"), -1.0);
            EXPECT_EQ(get_index_parameter(chose_flat.get(), "calibrated_sample"), -1.0);
        } else {
            // budget is also the Choose's read budget: both candidates read
            // more than 10 tokens, and top-k (half of Flat's) is kept and split
            ASSERT_EQ(get_index_parameter(chose_flat.get(), "chosen"), 1.0);
            EXPECT_EQ(get_index_parameter(chose_flat.get(), "calibrated_k") +
                              get_index_parameter(chose_flat.get(), "calibrated_sample"),
                      10.0);
        }
    }
}

}  // namespace test_factory
