// The conformance suite: the contract every index type keeps, run over
// every string of tests/conformance_list.h. A new type joins by adding its
// strings to that list; nothing here names a concrete type.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <faiss/impl/FaissException.h>

#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>

#include "conformance_list.h"
#include "expect_throw.h"
#include "forge.h"
#include "golden_data.h"
#include "reference.h"
#include "sanitizer_scale.h"

namespace test_conformance {

using namespace kvindex;
using kvtest::ConformanceCase;

namespace {

constexpr int kD = 16;
constexpr int kDv = 12;          ///< != kD: a mix-up of the two shows
constexpr idx_t kPrompt = 200;   ///< > 39 * 4: IVF4 trains without warnings
constexpr int kGroup = 3;        ///< query heads of the GQA group
constexpr idx_t kAppends = 40;   ///< decode steps after prefill
constexpr idx_t kQ = 6;          ///< queries per call
constexpr idx_t kSearchK = 9;
constexpr size_t kHeaderSize = kvtest::kIndexHeaderSize;
using kvtest::expect_knobs;
using kvtest::forge_header;

const float kNaN = std::numeric_limits<float>::quiet_NaN();
const float kInf = std::numeric_limits<float>::infinity();

/// Tokens and queries of one simulated sequence, from fixed seeds; the
/// evaluation queries come from another seed and scale than the keys.
struct Sequence {
    std::vector<float> keys = kvtest::gaussian(kPrompt + kAppends, kD, 101, 1.0f, 0.3f);
    std::vector<float> values = kvtest::gaussian(kPrompt + kAppends, kDv, 102);
    std::vector<float> prefill_q = kvtest::gaussian(kGroup * kPrompt, kD, 103, 1.5f);
    std::vector<float> q = kvtest::gaussian(kQ, kD, 104, 2.0f);
    /// the group's queries of each decode step, kGroup a step
    std::vector<float> decode_q = kvtest::gaussian(kGroup * kAppends, kD, 105, 1.5f);

    /// Decode step i (>= kPrompt): its token, then its queries once answered.
    void decode_step(KVIndex* index, idx_t i) const {
        index->add_kv(1, keys.data() + i * kD, values.data() + i * kDv);
        index->add_queries(kGroup, decode_q.data() + (i - kPrompt) * kGroup * kD);
    }

    PrefillInput prefill_input(idx_t n) const {
        PrefillInput in;
        in.n_tokens = n;
        in.keys = keys.data();
        in.values = values.data();
        in.n_queries = n;
        in.n_query_heads = kGroup;
        in.queries = prefill_q.data(); // head-major [kGroup, n, d]: head h at h * n
        in.rope.theta = 500000.0;
        in.rope.style = RopeStyle::interleaved;
        return in;
    }
};

const Sequence& sequence() {
    static const Sequence s;
    return s;
}

/// x as an index of storage type t holds it (BF16 / FP16 round; f32: x).
std::vector<float> stored(KVType t, const std::vector<float>& x) {
    std::vector<float> r(x.size());
    round_to(t, x.data(), x.size(), r.data());
    return r;
}

/// Prefill of the prompt (queries of a group of kGroup heads), then
/// n_appends decode steps (token, then queries), with `params` set before
/// prefill.
std::unique_ptr<KVIndex> build(const ConformanceCase& c, const char* params, idx_t n_appends) {
    const Sequence& s = sequence();
    auto index = index_factory(kD, c.factory, kDv);
    if (params && *params) {
        set_index_parameters(index.get(), params);
    }
    // the group's queries: kGroup heads of kPrompt queries each
    std::vector<float> pq(s.prefill_q.begin(), s.prefill_q.begin() + kGroup * kPrompt * kD);
    PrefillInput in = s.prefill_input(kPrompt);
    in.queries = pq.data();
    index->prefill(in);
    for (idx_t i = kPrompt; i < kPrompt + n_appends; i++) {
        s.decode_step(index.get(), i);
    }
    return index;
}

struct Answers {
    std::vector<float> distances, out, lse;
    std::vector<idx_t> labels;
    std::vector<Selection> sel;
};

Answers answers(const KVIndex* index, const std::vector<float>& q) {
    Answers a;
    idx_t n = idx_t(q.size()) / kD;
    a.distances.resize(n * kSearchK);
    a.labels.resize(n * kSearchK);
    index->search(n, q.data(), kSearchK, a.distances.data(), a.labels.data());
    a.out.resize(n * kDv);
    a.lse.resize(n);
    index->attend(n, q.data(), a.out.data(), a.lse.data());
    a.sel.resize(n);
    index->select(n, q.data(), a.sel.data());
    return a;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

void expect_identical(const Answers& a, const Answers& b, const std::string& what) {
    EXPECT_TRUE(same_bits(a.labels, b.labels)) << what << ": search labels differ";
    EXPECT_TRUE(same_bits(a.distances, b.distances)) << what << ": search distances differ";
    EXPECT_TRUE(same_bits(a.out, b.out)) << what << ": attend outputs differ";
    EXPECT_TRUE(same_bits(a.lse, b.lse)) << what << ": attend lse differ";
    ASSERT_EQ(a.sel.size(), b.sel.size());
    for (size_t i = 0; i < a.sel.size(); i++) {
        EXPECT_EQ(a.sel[i].ids, b.sel[i].ids) << what << ": selection " << i;
        EXPECT_TRUE(same_bits(a.sel[i].inclusion, b.sel[i].inclusion)) << what;
    }
}

/// What any answer must satisfy: ids in range and distinct, u in (0, 1],
/// search sorted and padded like Faiss; finite outputs unless the stored
/// tokens themselves are hostile (a forged key of 1e38 is finite, but its
/// scores overflow).
void expect_well_formed(
        const KVIndex* index,
        const Answers& a,
        const std::string& what,
        bool finite_outputs = true) {
    idx_t n = idx_t(a.lse.size());
    for (idx_t i = 0; i < n; i++) {
        for (idx_t j = 0; j < kSearchK; j++) {
            idx_t id = a.labels[i * kSearchK + j];
            float dis = a.distances[i * kSearchK + j];
            ASSERT_TRUE(id >= -1 && id < index->ntotal) << what << ": label " << id;
            if (id == -1) {
                EXPECT_EQ(dis, std::numeric_limits<float>::lowest()) << what;
            } else if (j > 0) {
                EXPECT_LE(dis, a.distances[i * kSearchK + j - 1]) << what << ": not sorted";
            }
        }
        const Selection& s = a.sel[i];
        ASSERT_EQ(s.ids.size(), s.inclusion.size()) << what;
        std::vector<idx_t> ids = s.ids;
        std::sort(ids.begin(), ids.end());
        EXPECT_TRUE(std::adjacent_find(ids.begin(), ids.end()) == ids.end()) << what << ": repeated id";
        for (size_t t = 0; t < s.size(); t++) {
            ASSERT_TRUE(s.ids[t] >= 0 && s.ids[t] < index->ntotal) << what << ": id " << s.ids[t];
            EXPECT_TRUE(s.inclusion[t] > 0 && s.inclusion[t] <= 1) << what;
        }
        if (!finite_outputs) {
            continue;
        }
        EXPECT_TRUE(std::isfinite(a.lse[i])) << what;
        for (int c = 0; c < kDv; c++) {
            EXPECT_TRUE(std::isfinite(a.out[i * kDv + c])) << what;
        }
    }
}

/// Exact attention over the first n tokens, in double.
void expect_exact(const KVIndex* index, idx_t n, const std::string& what) {
    const Sequence& s = sequence();
    std::vector<float> out(kQ * kDv), lse(kQ);
    index->attend(kQ, s.q.data(), out.data(), lse.data());
    // the reference reads the tokens as the index stores them
    std::vector<float> keys = stored(index->kv_type, s.keys);
    std::vector<float> values = stored(index->kv_type, s.values);
    for (idx_t i = 0; i < kQ; i++) {
        std::vector<double> ref;
        double ref_lse = kvtest::ref_attention_all(
                s.q.data() + i * kD, keys.data(), values.data(), kD, kDv, n, ref);
        // float accumulation over a few hundred tokens: 1e-5 relative
        EXPECT_LT(kvtest::rel_max_err(out.data() + i * kDv, ref), 1e-5) << what << " query " << i;
        EXPECT_NEAR(lse[i], ref_lse, 1e-5 * std::max(1.0, std::fabs(ref_lse))) << what;
    }
}

std::string param_name(const testing::TestParamInfo<ConformanceCase>& info) {
    return kvtest::conformance_test_name(info.index, info.param);
}

} // namespace

class Conformance : public testing::TestWithParam<ConformanceCase> {};

INSTANTIATE_TEST_SUITE_P(AllTypes, Conformance, testing::ValuesIn(kvtest::kConformance), param_name);

TEST_P(Conformance, InputsAtTheMagnitudeBoundGiveFiniteAnswers) {
    // keys, values and queries as large as accepted (kMaxInputMagnitude;
    // fp16's largest for FP16 storage) train, search and attend without an
    // overflow: well-formed, finite answers, and no abort in Faiss's k-means
    const ConformanceCase& c = GetParam();
    const Sequence& s = sequence();
    auto index = index_factory(kD, c.factory, kDv);
    const float stored_bound = index->kv_type == KVType::f16 ? 65504.0f : kMaxInputMagnitude;
    // x scaled so that its largest |x_i| is `to` (|x_i| / max rounds to <= 1)
    auto scaled = [](std::vector<float> x, float to) {
        float mx = 0;
        for (float v : x) {
            mx = std::max(mx, std::fabs(v));
        }
        for (float& v : x) {
            v = v / mx * to;
        }
        return x;
    };
    std::vector<float> k = scaled(s.keys, stored_bound), v = scaled(s.values, stored_bound);
    std::vector<float> pq = scaled(
            std::vector<float>(s.prefill_q.begin(), s.prefill_q.begin() + kGroup * kPrompt * kD),
            kMaxInputMagnitude);
    std::vector<float> q = scaled(s.q, kMaxInputMagnitude);
    PrefillInput in = s.prefill_input(kPrompt);
    in.keys = k.data();
    in.values = v.data();
    in.queries = pq.data();
    index->prefill(in);
    index->add_kv(kAppends, k.data() + kPrompt * kD, v.data() + kPrompt * kDv);
    expect_well_formed(index.get(), answers(index.get(), q), "at the magnitude bound");
}

TEST_P(Conformance, FactoryRoundTrip) {
    const ConformanceCase& c = GetParam();
    auto index = index_factory(kD, c.factory, kDv);
    EXPECT_EQ(index_factory_string(index.get()), c.factory);
    EXPECT_EQ(index->d, kD);
    EXPECT_EQ(index->d_value, kDv);
    EXPECT_EQ(index->ntotal, 0);
    EXPECT_EQ(index->metric_type, faiss::METRIC_INNER_PRODUCT);
    EXPECT_NO_THROW(index->check_invariants());
    // the printed string builds the same structure; "STRING|knobs" sets them
    const std::string knobs = c.knobs;
    auto again = index_factory(
            kD, index_factory_string(index.get()) + (knobs.empty() ? "" : "|" + knobs), kDv);
    EXPECT_EQ(index_factory_string(again.get()), c.factory);
    expect_knobs(again.get(), c.knobs, "STRING|knobs");
    // every child has the dimensions of its parent
    std::vector<const KVIndex*> todo = {index.get()};
    while (!todo.empty()) {
        const KVIndex* x = todo.back();
        todo.pop_back();
        EXPECT_EQ(x->d, kD);
        EXPECT_EQ(x->d_value, kDv);
        for (const KVIndex* ch : x->children()) {
            todo.push_back(ch);
        }
    }
}

TEST_P(Conformance, ParametersListedReadAndSet) {
    const ConformanceCase& c = GetParam();
    auto index = index_factory(kD, c.factory, kDv);
    std::vector<ParameterInfo> info = index_parameter_info(index.get());
    bool lists_k = false;
    for (const ParameterInfo& p : info) {
        SCOPED_TRACE(p.name);
        EXPECT_FALSE(p.doc.empty());
        double v = get_index_parameter(index.get(), p.name);
        EXPECT_TRUE(std::isfinite(v));
        lists_k = lists_k || p.name == "k";
    }
    // k is a knob exactly where a search reads it
    EXPECT_EQ(lists_k, index->reads_search_knob("k"));
    set_index_parameters(index.get(), c.knobs);
    expect_knobs(index.get(), c.knobs, "after set");
    EXPECT_THROW_MSG(set_index_parameters(index.get(), "no_such_knob=1"), "no_such_knob");
    EXPECT_THROW_MSG(get_index_parameter(index.get(), "no_such_knob"), "no_such_knob");
}

TEST_P(Conformance, IoRoundTripIsBitIdentical) {
    const ConformanceCase& c = GetParam();
    auto index = build(c, "", kAppends);
    set_index_parameters(index.get(), c.knobs);
    const Sequence& s = sequence();
    Answers ref = answers(index.get(), s.q);
    expect_well_formed(index.get(), ref, "original");

    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);
    auto from_mem = read_index(buf);
    std::string path = testing::TempDir() + "kvindex_conformance_" +
            std::to_string(testing::UnitTest::GetInstance()->random_seed()) + "_" +
            param_name({GetParam(), 0}) + ".kvix";
    write_index(index.get(), path);
    std::ifstream f(path, std::ios::binary);
    std::vector<uint8_t> file_bytes((std::istreambuf_iterator<char>(f)), {});
    auto from_file = read_index(path);
    std::remove(path.c_str());
    EXPECT_TRUE(file_bytes == buf) << "file and memory formats differ";

    for (const KVIndex* copy : {from_mem.get(), from_file.get()}) {
        EXPECT_EQ(index_factory_string(copy), c.factory);
        EXPECT_EQ(copy->ntotal, index->ntotal);
        EXPECT_EQ(copy->has_rope, index->has_rope);
        EXPECT_TRUE(copy->rope == index->rope);
        expect_knobs(copy, c.knobs, "read back");
        expect_identical(ref, answers(copy, s.q), "read back");
        std::vector<uint8_t> again;
        write_index(copy, &again);
        EXPECT_TRUE(again == buf) << "writing what was read changed the bytes";
    }
}

TEST_P(Conformance, EveryTruncationThrows) {
    const ConformanceCase& c = GetParam();
    auto index = kvgolden::build_golden_index(c.factory, c.knobs); // a few KB
    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);
    // the sanitizer run: every third length (3 is prime to the fields'
    // widths); ForgedTruncationsThrow cuts at every field either way
    const size_t step = kvtest::release_or_sanitized(1, 3);
    for (size_t len = 0; len < buf.size(); len += step) {
        // copy the prefix so that a read past its end is a real overrun
        std::vector<uint8_t> prefix(buf.begin(), buf.begin() + len);
        EXPECT_THROW(read_index(prefix.data(), len), faiss::FaissException) << "prefix " << len;
    }
}

namespace {

/// A read that succeeded must give an index that works.
void expect_usable(const KVIndex* index, const std::string& what) {
    EXPECT_NO_THROW(index->check_invariants()) << what;
    if (index->ntotal == 0) {
        return;
    }
    Answers a = answers(index, sequence().q);
    expect_well_formed(index, a, what, /*finite_outputs=*/false);
    std::vector<uint8_t> again;
    write_index(index, &again);
}

} // namespace

TEST_P(Conformance, ForgedTruncationsThrow) {
    // the header made to agree with each shorter payload: every cut between
    // two fields, and inside each array (which the reader takes in one
    // checked read, the same wherever it is cut) its first, middle and
    // last bytes
    const ConformanceCase& c = GetParam();
    auto index = kvgolden::build_golden_index(c.factory, c.knobs);
    std::vector<uint8_t> buf;
    IndexFileLayout layout;
    write_index(index.get(), &buf, &layout);
    std::vector<bool> cut(buf.size(), true);
    for (auto [begin, end] : layout.array_ranges) {
        for (size_t len = begin + 2; len + 1 < end; len++) {
            cut[len] = len == (begin + end) / 2;
        }
    }
    size_t n_cuts = 0;
    for (size_t len = kHeaderSize; len < buf.size(); len++) {
        if (!cut[len]) {
            continue;
        }
        n_cuts++;
        std::vector<uint8_t> prefix(buf.begin(), buf.begin() + len);
        forge_header(prefix);
        EXPECT_THROW(read_index(prefix), faiss::FaissException) << "forged prefix " << len;
    }
    EXPECT_GT(n_cuts, size_t(20)); // the fields between the arrays, at least
}

TEST_P(Conformance, ByteFlips) {
    const ConformanceCase& c = GetParam();
    auto index = kvgolden::build_golden_index(c.factory, c.knobs);
    std::vector<uint8_t> buf;
    IndexFileLayout layout;
    write_index(index.get(), &buf, &layout);
    const auto& faiss_ranges = layout.faiss_ranges;
    std::mt19937_64 rng(2024);
    // checksum left as it is: every flip is caught
    // the sanitizer run flips fewer (fuzz_read_index mutates files there)
    const int n_flips = kvtest::release_or_sanitized(500, 150);
    for (int trial = 0; trial < n_flips; trial++) {
        std::vector<uint8_t> b = buf;
        b[std::uniform_int_distribution<size_t>(0, b.size() - 1)(rng)] ^=
                uint8_t(std::uniform_int_distribution<int>(1, 255)(rng));
        EXPECT_THROW(read_index(b), faiss::FaissException);
    }
    // checksum recomputed: the parser refuses what is inconsistent, and
    // whatever it accepts works. Faiss's own blobs are Faiss's to check.
    auto in_faiss = [&](size_t pos) {
        return std::any_of(faiss_ranges.begin(), faiss_ranges.end(),
                           [&](auto r) { return pos >= r.first && pos < r.second; });
    };
    int n_thrown = 0, n_tried = 0;
    const int n_forged = kvtest::release_or_sanitized(400, 120);
    while (n_tried < n_forged) {
        size_t pos = std::uniform_int_distribution<size_t>(kHeaderSize, buf.size() - 1)(rng);
        if (in_faiss(pos)) {
            continue;
        }
        n_tried++;
        std::vector<uint8_t> b = buf;
        b[pos] ^= uint8_t(std::uniform_int_distribution<int>(1, 255)(rng));
        forge_header(b);
        std::unique_ptr<KVIndex> copy;
        try {
            copy = read_index(b);
        } catch (const faiss::FaissException&) {
            n_thrown++;
            continue;
        }
        expect_usable(copy.get(), "forged flip at " + std::to_string(pos));
        if (HasFailure()) {
            break; // one report is enough
        }
    }
    // most bytes are keys and values, whose flips read back fine, but some
    // structure must have been hit
    EXPECT_GT(n_thrown, 0);
}

TEST_P(Conformance, NonFiniteInputThrowsAndChangesNothing) {
    const ConformanceCase& c = GetParam();
    const Sequence& s = sequence();
    auto index = build(c, "", 5);
    Answers before = answers(index.get(), s.q);
    idx_t n0 = index->ntotal;
    // finite values above kMaxInputMagnitude are refused the same way: their
    // scores or k-means distances would overflow float
    for (float bad : {kNaN, kInf, -kInf, 2e12f, -3e38f}) {
        const char* why = std::isfinite(bad) ? "kMaxInputMagnitude" : "non-finite";
        std::vector<float> k(3 * kD, 0.5f), v(3 * kDv, 0.5f);
        k[kD + 3] = bad;
        EXPECT_THROW_MSG(index->add_kv(3, k.data(), v.data()), why);
        k[kD + 3] = 0.5f;
        v[2 * kDv + 1] = bad;
        EXPECT_THROW_MSG(index->add_kv(3, k.data(), v.data()), why);
        std::vector<float> q = s.q;
        q[(kQ - 1) * kD + 2] = bad; // in the last query, not the first
        std::vector<float> out(kQ * kDv), dis(kQ * kSearchK);
        std::vector<idx_t> lab(kQ * kSearchK);
        std::vector<Selection> sel(kQ);
        EXPECT_THROW_MSG(index->attend(kQ, q.data(), out.data(), nullptr), why);
        EXPECT_THROW_MSG(index->search(kQ, q.data(), kSearchK, dis.data(), lab.data()), why);
        EXPECT_THROW_MSG(index->select(kQ, q.data(), sel.data()), why);
        EXPECT_THROW_MSG(index->add_queries(kQ, q.data()), "add_queries: queries");
    }
    EXPECT_THROW_MSG(index->add_queries(1, nullptr), "add_queries: queries");
    EXPECT_THROW_MSG(index->add_queries(-1, s.q.data()), "add_queries: n=");
    EXPECT_EQ(index->ntotal, n0);
    expect_identical(before, answers(index.get(), s.q), "after refused input");

    // prefill refuses them too, and leaves the index empty and unfixed
    for (int what = 0; what < 3; what++) {
        auto empty = index_factory(kD, c.factory, kDv);
        std::vector<float> k = s.keys, v = s.values, q = s.prefill_q;
        (what == 0 ? k[(kPrompt - 1) * kD] : what == 1 ? v[7] : q[kD * 5 + 1]) = kNaN;
        PrefillInput in = s.prefill_input(kPrompt);
        in.keys = k.data();
        in.values = v.data();
        in.queries = q.data();
        EXPECT_THROW_MSG(empty->prefill(in), "non-finite");
        EXPECT_EQ(empty->ntotal, 0);
        EXPECT_FALSE(empty->has_rope);
    }
}

TEST_P(Conformance, BadSizesAndArgumentsThrow) {
    const ConformanceCase& c = GetParam();
    const Sequence& s = sequence();
    auto index = build(c, "", 0);
    std::vector<float> out(kQ * kDv), dis(kQ * kSearchK);
    std::vector<idx_t> lab(kQ * kSearchK);
    std::vector<Selection> sel(kQ);
    EXPECT_THROW_MSG(index->add_kv(-1, s.keys.data(), s.values.data()), "n=-1");
    EXPECT_THROW_MSG(index->add_kv(2, s.keys.data(), nullptr), "values");
    EXPECT_THROW_MSG(index->add_kv(2, nullptr, s.values.data()), "keys");
    EXPECT_THROW_MSG(index->add(2, s.keys.data()), "values");
    EXPECT_THROW_MSG(index->attend(-2, s.q.data(), out.data(), nullptr), "n=-2");
    EXPECT_THROW_MSG(index->attend(kQ, nullptr, out.data(), nullptr), "queries");
    EXPECT_THROW_MSG(index->attend(kQ, s.q.data(), nullptr, nullptr), "out");
    EXPECT_THROW_MSG(index->search(-1, s.q.data(), kSearchK, dis.data(), lab.data()), "n=-1");
    EXPECT_THROW_MSG(index->select(kQ, nullptr, sel.data()), "queries");
    std::vector<float> key(kD);
    EXPECT_THROW_MSG(index->reconstruct(index->ntotal, key.data()), "out of");
    EXPECT_THROW_MSG(index->reconstruct(-1, key.data()), "out of");
    EXPECT_EQ(index->ntotal, kPrompt);

    // prefill: on a non-empty index, with more queries than the prompt has
    // positions for, with a negative position
    EXPECT_THROW_MSG(index->prefill(s.prefill_input(10)), "already holds");
    auto empty = index_factory(kD, c.factory, kDv);
    PrefillInput in = s.prefill_input(10);
    in.n_queries = 11;
    EXPECT_THROW_MSG(empty->prefill(in), "only 10 tokens");
    std::vector<idx_t> pos(10, 3);
    pos[4] = -7;
    in.n_queries = 10;
    in.query_positions = pos.data();
    EXPECT_THROW_MSG(empty->prefill(in), "query_positions[4]=-7");
    in.query_positions = nullptr;
    in.n_query_heads = 0;
    EXPECT_THROW_MSG(empty->prefill(in), "n_query_heads=0");
    EXPECT_EQ(empty->ntotal, 0);
}

TEST_P(Conformance, NonPositiveKThrows) {
    const ConformanceCase& c = GetParam();
    const Sequence& s = sequence();
    auto index = build(c, "", 0);
    std::vector<float> out(kQ * kDv), dis(kQ * kSearchK);
    std::vector<idx_t> lab(kQ * kSearchK);
    std::vector<Selection> sel(kQ);
    EXPECT_THROW_MSG(index->search(kQ, s.q.data(), 0, dis.data(), lab.data()), "k=0");
    EXPECT_THROW_MSG(index->search(kQ, s.q.data(), -3, dis.data(), lab.data()), "k=-3");
    SearchParametersKV p;
    p.k = -2;
    EXPECT_THROW_MSG(index->attend(kQ, s.q.data(), out.data(), nullptr, &p), "k=-2");
    EXPECT_THROW_MSG(index->select(kQ, s.q.data(), sel.data(), &p), "k=-2");
    EXPECT_THROW_MSG(index->search(kQ, s.q.data(), 4, dis.data(), lab.data(), &p), "k=-2");
    if (!index->reads_search_knob("k")) {
        // a chain that reads no top-k budget refuses one, set or per call
        EXPECT_THROW_MSG(set_index_parameters(index.get(), "k=5"), "unknown parameter 'k'");
        p.k = 5;
        EXPECT_THROW_MSG(
                index->attend(kQ, s.q.data(), out.data(), nullptr, &p), "k=5 does not apply");
        EXPECT_THROW_MSG(index->select(kQ, s.q.data(), sel.data(), &p), "k=5 does not apply");
        return;
    }
    // 100 by default; a hybrid's prefill may have split its reads anew
    const double k_before = get_index_parameter(index.get(), "k");
    EXPECT_THROW_MSG(set_index_parameters(index.get(), "k=0"), "k=0");
    EXPECT_THROW_MSG(set_index_parameters(index.get(), "k=-1"), "k=-1");
    EXPECT_EQ(get_index_parameter(index.get(), "k"), k_before); // left as it was
}

TEST_P(Conformance, EmptyIndex) {
    const ConformanceCase& c = GetParam();
    const Sequence& s = sequence();
    auto fresh = index_factory(kD, c.factory, kDv);
    auto zero = index_factory(kD, c.factory, kDv);
    zero->prefill(s.prefill_input(0)); // a prompt of no tokens
    auto reset = build(c, "", 3);
    reset->reset();
    for (const KVIndex* index : {fresh.get(), zero.get(), reset.get()}) {
        EXPECT_EQ(index->ntotal, 0);
        EXPECT_NO_THROW(index->check_invariants());
        std::vector<float> out(kQ * kDv), dis(kQ * kSearchK, 1.0f);
        std::vector<idx_t> lab(kQ * kSearchK, 7);
        EXPECT_THROW_MSG(index->attend(kQ, s.q.data(), out.data(), nullptr), "empty");
        index->search(kQ, s.q.data(), kSearchK, dis.data(), lab.data());
        for (idx_t i = 0; i < kQ * kSearchK; i++) {
            EXPECT_EQ(lab[i], -1);
            EXPECT_EQ(dis[i], std::numeric_limits<float>::lowest());
        }
        std::vector<Selection> sel(kQ);
        sel[0].push_back(3);
        index->select(kQ, s.q.data(), sel.data());
        for (const Selection& x : sel) {
            EXPECT_EQ(x.size(), 0u);
        }
        std::vector<uint8_t> buf;
        write_index(index, &buf);
        auto copy = read_index(buf);
        EXPECT_EQ(copy->ntotal, 0);
        EXPECT_EQ(index_factory_string(copy.get()), c.factory);
    }
    // the emptied index takes a new sequence
    reset->add_kv(20, s.keys.data(), s.values.data());
    EXPECT_EQ(reset->ntotal, 20);
    std::vector<float> out(kQ * kDv);
    EXPECT_NO_THROW(reset->attend(kQ, s.q.data(), out.data(), nullptr));
}

TEST_P(Conformance, DecodeAppends) {
    // attend after every append, as a decode loop does
    const ConformanceCase& c = GetParam();
    const Sequence& s = sequence();
    auto index = build(c, "", 0);
    std::vector<float> keys = stored(index->kv_type, s.keys);
    std::vector<float> values = stored(index->kv_type, s.values);
    for (idx_t i = kPrompt; i < kPrompt + kAppends; i++) {
        s.decode_step(index.get(), i);
        ASSERT_EQ(index->ntotal, i + 1);
        ASSERT_NO_THROW(index->check_invariants()) << "after token " << i;
        // generated tokens are always kept, whatever the type evicts
        std::vector<float> key(kD), value(kDv);
        index->reconstruct(i, key.data());
        index->reconstruct_value(i, value.data());
        EXPECT_TRUE(std::equal(key.begin(), key.end(), keys.begin() + i * kD));
        EXPECT_TRUE(std::equal(value.begin(), value.end(), values.begin() + i * kDv));
        if (i % 8 == 0 || i + 1 == kPrompt + kAppends) {
            expect_well_formed(index.get(), answers(index.get(), s.q), "token " + std::to_string(i));
        }
    }
}

TEST_P(Conformance, AnAppendTakenBackLeavesTheIndexAsItWas) {
    // KVCache::append takes a head's append back when another head's throws:
    // undo_add_kv must leave the index as it was, to the bytes of its record,
    // and an undoable append must be the plain append. Sizes that fill a
    // window and fold a hash table's tail (9, 100 after 200) and open a shard.
    const ConformanceCase& c = GetParam();
    const Sequence& s = sequence();
    auto index = build(c, "", 0);
    set_index_parameters(index.get(), c.knobs);
    auto twin = build(c, "", 0); // plain appends only
    set_index_parameters(twin.get(), c.knobs);
    const std::vector<float> keys = kvtest::gaussian(110, kD, 707, 1.0f, 0.3f);
    const std::vector<float> values = kvtest::gaussian(110, kDv, 708);
    if (!index->can_undo_add()) {
        std::vector<uint8_t> before;
        write_index(index.get(), &before);
        EXPECT_THROW_MSG(index->add_kv_undoable(1, keys.data(), values.data()), "can_undo_add");
        std::vector<uint8_t> after;
        write_index(index.get(), &after);
        EXPECT_TRUE(after == before) << "a refused undoable append changed the index";
        return;
    }
    idx_t used = 0;
    for (idx_t m : {idx_t(1), idx_t(9), idx_t(100)}) {
        const std::string what = "an append of " + std::to_string(m) + " taken back";
        const float* k = keys.data() + used * kD;
        const float* v = values.data() + used * kDv;
        used += m;
        const Answers before = answers(index.get(), s.q);
        std::vector<uint8_t> bytes_before;
        write_index(index.get(), &bytes_before);
        const idx_t n0 = index->ntotal;

        index->add_kv_undoable(m, k, v);
        twin->add_kv(m, k, v);
        const Answers appended = answers(index.get(), s.q);
        expect_identical(answers(twin.get(), s.q), appended, what + ": the undoable append");
        index->undo_add_kv();
        ASSERT_EQ(index->ntotal, n0) << what;
        ASSERT_NO_THROW(index->check_invariants()) << what;
        EXPECT_EQ(index->failed_write(), nullptr) << what;
        expect_identical(before, answers(index.get(), s.q), what);
        std::vector<uint8_t> bytes_after;
        write_index(index.get(), &bytes_after);
        EXPECT_TRUE(bytes_after == bytes_before) << what << ": the record differs";
        EXPECT_THROW_MSG(index->undo_add_kv(), "no append to take back");

        index->add_kv(m, k, v); // again, plainly: what the undoable one gave
        expect_identical(appended, answers(index.get(), s.q), what + ", then appended again");
        EXPECT_THROW_MSG(index->undo_add_kv(), "no append to take back");
        if (testing::Test::HasFailure()) {
            return;
        }
    }
}

TEST_P(Conformance, MemoryGrowsByAQuarterNotByDoubling) {
    // An index read back from a file holds arrays sized to what they use.
    // After 40 decode appends to a prompt of 200 (a fifth more tokens) an
    // array grown by 1/4 of its capacity, with 1/16 of headroom after the
    // prompt, holds at most ~1.17x its use; one grown as std::vector grows,
    // an entry at a time, doubled on the first append (up to 1.67x here).
    auto decoded = build(GetParam(), "", kAppends);
    std::vector<uint8_t> buf;
    write_index(decoded.get(), &buf);
    auto read_back = read_index(buf);
    double ratio = double(decoded->memory_bytes()) / double(read_back->memory_bytes());
    EXPECT_LE(ratio, 1.3) << decoded->memory_bytes() << " bytes after " << kAppends
                          << " appends, " << read_back->memory_bytes() << " read back";
}

TEST_P(Conformance, FullBudgetIsExactWhileDecoding) {
    const ConformanceCase& c = GetParam();
    if (!c.exact_params) {
        GTEST_SKIP() << c.factory << " has no full-budget setting";
    }
    const Sequence& s = sequence();
    auto index = build(c, c.exact_params, 0);
    expect_exact(index.get(), kPrompt, "after prefill");
    for (idx_t i = kPrompt; i < kPrompt + kAppends; i++) {
        s.decode_step(index.get(), i);
        if (i % 10 == 0 || i + 1 == kPrompt + kAppends) {
            expect_exact(index.get(), i + 1, "after token " + std::to_string(i));
        }
    }
    // and every token is selected with u = 1
    std::vector<Selection> sel(kQ);
    index->select(kQ, s.q.data(), sel.data());
    for (const Selection& x : sel) {
        EXPECT_EQ(idx_t(x.size()), index->ntotal);
        for (float u : x.inclusion) {
            EXPECT_EQ(u, 1.0f);
        }
    }
}

TEST_P(Conformance, ConcurrentConstCallsMatchSerial) {
    // attend / search / select from 8 threads on one const index give the
    // serial answers bit for bit
    const ConformanceCase& c = GetParam();
    auto index = build(c, "", kAppends);
    set_index_parameters(index.get(), c.knobs);
    const KVIndex* shared = index.get();
    const std::vector<float>& q = sequence().q;
    Answers serial = answers(shared, q);
    const int n_threads = 8;
    std::vector<Answers> got(n_threads);
    std::vector<std::string> errors(n_threads);
    std::vector<std::thread> threads;
    for (int t = 0; t < n_threads; t++) {
        threads.emplace_back([&, t]() {
            try {
                for (int rep = 0; rep < 3; rep++) {
                    got[t] = answers(shared, q);
                }
            } catch (const std::exception& e) {
                errors[t] = e.what();
            }
        });
    }
    for (auto& th : threads) {
        th.join();
    }
    for (int t = 0; t < n_threads; t++) {
        EXPECT_EQ(errors[t], "") << "thread " << t;
        expect_identical(serial, got[t], "thread " + std::to_string(t));
    }
}

TEST_P(Conformance, WritesOverlappingOtherCallsAreRefused) {
    // the thread-safety contract (KVIndex.h), made deterministic by holding
    // the scope a running call holds
    const ConformanceCase& c = GetParam();
    const Sequence& s = sequence();
    auto index = build(c, "", kAppends);
    set_index_parameters(index.get(), c.knobs);
    const idx_t n0 = index->ntotal;
    Answers serial = answers(index.get(), s.q);
    const float* key = s.keys.data();
    const float* value = s.values.data();
    std::vector<uint8_t> saved;
    write_index(index.get(), &saved);
    {
        ReadScope running(*index, "a concurrent attend");
        EXPECT_THROW_MSG(index->add_kv(1, key, value), "add_kv: refused, 1 const calls");
        EXPECT_THROW_MSG(index->add_queries(1, s.q.data()), "add_queries: refused");
        EXPECT_THROW_MSG(index->reset(), "reset: refused");
        EXPECT_THROW_MSG(index->prefill(s.prefill_input(4)), "prefill: refused");
        EXPECT_THROW_MSG(set_index_parameters(index.get(), "k=5"), "refused");
        // other const calls go on, with the serial answers
        expect_identical(serial, answers(index.get(), s.q), "under a reader");
    }
    {
        WriteScope writing(*index, "a concurrent add_kv");
        std::vector<float> out(kDv), lse(1), dis(kSearchK), key_out(kD);
        std::vector<idx_t> lab(kSearchK);
        Selection sel;
        std::vector<uint8_t> buf;
        EXPECT_THROW_MSG(index->attend(1, s.q.data(), out.data(), lse.data()), "attend: refused");
        EXPECT_THROW_MSG(index->search(1, s.q.data(), kSearchK, dis.data(), lab.data()), "search: refused");
        EXPECT_THROW_MSG(index->select(1, s.q.data(), &sel), "select: refused");
        EXPECT_THROW_MSG(index->reconstruct(0, key_out.data()), "reconstruct: refused");
        EXPECT_THROW_MSG(write_index(index.get(), &buf), "write_index: refused");
        EXPECT_THROW_MSG(index->add_kv(1, key, value), "another write");
        EXPECT_THROW_MSG(index->add_queries(1, s.q.data()), "another write");
    }
    // every refusal left the index as it was, and it works again
    EXPECT_EQ(index->ntotal, n0);
    std::vector<uint8_t> after;
    write_index(index.get(), &after);
    EXPECT_TRUE(same_bits(saved, after));
    expect_identical(serial, answers(index.get(), s.q), "after the refusals");
    index->add_kv(1, key, value);
    EXPECT_EQ(index->ntotal, n0 + 1);
}

TEST_P(Conformance, AppendsRacingAttendsAreRefusedNeverTorn) {
    // a decode loop appending while other threads attend: each call either
    // runs on a consistent index or is refused; nothing reads moved storage
    // (the sanitizer job runs this under ASan)
    const ConformanceCase& c = GetParam();
    const Sequence& s = sequence();
    auto index = build(c, "", 0);
    set_index_parameters(index.get(), c.knobs);
    std::atomic<bool> done{false};
    std::vector<std::string> errors(5);
    std::vector<std::thread> readers;
    for (int t = 0; t < 4; t++) {
        readers.emplace_back([&, t]() {
            std::vector<float> out(kQ * kDv), lse(kQ);
            while (!done.load()) {
                // each reader attends a tenth of the time, so that the
                // appends find a moment between them: with the readers
                // always inside an attend (ASan makes one of a chain of
                // shards dear), the appends were refused for tens of seconds
                const auto t0 = std::chrono::steady_clock::now();
                try {
                    index->attend(kQ, s.q.data(), out.data(), lse.data());
                    for (float x : lse) {
                        if (!std::isfinite(x)) {
                            errors[t] = "non-finite lse";
                        }
                    }
                } catch (const std::exception& e) {
                    if (std::string(e.what()).find("attend: refused") == std::string::npos) {
                        errors[t] = e.what();
                    }
                }
                std::this_thread::sleep_for(
                        std::chrono::microseconds(20) + 9 * (std::chrono::steady_clock::now() - t0));
            }
        });
    }
    for (idx_t i = kPrompt; i < kPrompt + kAppends; i++) {
        for (;;) { // a refused append changed nothing: try again
            try {
                index->add_kv(1, s.keys.data() + i * kD, s.values.data() + i * kDv);
                break;
            } catch (const std::exception& e) {
                if (std::string(e.what()).find("add_kv: refused") == std::string::npos) {
                    errors[4] = e.what();
                    break;
                }
                std::this_thread::yield();
            }
        }
    }
    done = true;
    for (auto& th : readers) {
        th.join();
    }
    for (const std::string& e : errors) {
        EXPECT_EQ(e, "");
    }
    // every append landed once, and the index is whole
    auto reference = build(c, "", kAppends);
    EXPECT_EQ(index->ntotal, reference->ntotal);
    index->check_invariants();
}

}  // namespace test_conformance
