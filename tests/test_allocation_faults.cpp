// Allocation failures: each write of every index type of the conformance
// list (add_kv, add_queries, prefill, reset) and each read (search, attend,
// select, write_index, read_index) is run again and again with its i-th
// allocation failing (std::bad_alloc), for i over all of its allocations
// (or a spread of them when there are many). The contract checked:
//
//   - the call throws, a std::exception with a message, and nothing crashes;
//   - a write that throws leaves the index as it was: the same ntotal, the
//     same saved bytes and the same answers (the strong guarantee);
//   - the same call repeated without a failure then gives what a copy that
//     never failed gives (nothing is left half-done for later);
//   - under ASan (scripts/run_sanitizers.sh) nothing leaks on the way out.
//
// KVCache::append, which appends to every head of a layer in kvindex's own
// loop, is run the same way, its allocations failing inside that loop too:
// the layer is as it was, or refuses every call until reset().
//
// The failures come from this binary's replacement of the global operator
// new, which the library's token arrays use too (impl/huge_pages.h). It
// never fails inside an OpenMP region: Faiss's parallel loops (k-means, HNSW
// construction) are not exception-safe, and an exception leaving one ends
// the program; kvindex's own loops (parallel.h) catch and rethrow, which
// test_conformance covers. Its own binary: a replaced operator new in
// kvindex_tests would hide ASan's new/delete mismatch checks there.

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include <omp.h>

#include <gtest/gtest.h>

#include <kvindex/KVCache.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>

#include "conformance_list.h"
#include "forge.h"
#include "reference.h"
#include "sanitizer_scale.h"

namespace {

/// Allocation counter of the replaced operator new: while armed, each
/// allocation outside OpenMP regions counts down, and the one that reaches
/// zero fails. A count of 0 never fails (counting only).
struct FaultPlan {
    std::atomic<bool> armed{false};
    std::atomic<long> countdown{0};
    std::atomic<long> seen{0};  ///< allocations counted while armed
    std::atomic<bool> fired{false};
    /// allocations fail only at this OpenMP nesting level or above none:
    /// 0 outside every region; 1 inside kvindex's own loop that runs a
    /// cache's heads (parallel.h catches and rethrows), but not in a
    /// region below it
    std::atomic<int> max_level{0};
};

FaultPlan g_plan;

bool allocation_fails() noexcept {
    if (!g_plan.armed.load(std::memory_order_relaxed) ||
        omp_get_level() > g_plan.max_level.load(std::memory_order_relaxed)) {
        return false;
    }
    g_plan.seen.fetch_add(1, std::memory_order_relaxed);
    if (g_plan.countdown.fetch_sub(1, std::memory_order_relaxed) == 1) {
        g_plan.fired.store(true, std::memory_order_relaxed);
        return true;
    }
    return false;
}

void* allocate(std::size_t n) noexcept {
    return allocation_fails() ? nullptr : std::malloc(n > 0 ? n : 1);
}

void* allocate_aligned(std::size_t n, std::align_val_t a) noexcept {
    if (allocation_fails()) {
        return nullptr;
    }
    void* p = nullptr;
    std::size_t alignment = std::max(std::size_t(a), sizeof(void*));
    return posix_memalign(&p, alignment, n > 0 ? n : 1) == 0 ? p : nullptr;
}

} // namespace

void* operator new(std::size_t n) {
    if (void* p = allocate(n)) {
        return p;
    }
    throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
    return operator new(n);
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
    return allocate(n);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
    return allocate(n);
}
void* operator new(std::size_t n, std::align_val_t a) {
    if (void* p = allocate_aligned(n, a)) {
        return p;
    }
    throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) {
    return operator new(n, a);
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
    return allocate_aligned(n, a);
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
    return allocate_aligned(n, a);
}
void operator delete(void* p) noexcept {
    std::free(p);
}
void operator delete[](void* p) noexcept {
    std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
    std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
    std::free(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
    std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
    std::free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
    std::free(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
    std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
    std::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
    std::free(p);
}
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept {
    std::free(p);
}
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept {
    std::free(p);
}

using namespace kvindex;
using kvtest::ConformanceCase;

namespace {

constexpr int kD = 16;
constexpr int kDv = 12;
constexpr idx_t kPrompt = 200; ///< as the conformance suite: IVF4 trains without warnings
constexpr int kGroup = 3;
constexpr idx_t kAppends = 5;  ///< decode steps before the failing call
constexpr idx_t kNewTokens = 3;
constexpr idx_t kQ = 4;
constexpr idx_t kSearchK = 9;
/// Every allocation up to this one fails in turn; past it, a spread of
/// kSpread more (the first ones are where a write has changed least). The
/// sanitizer run takes half of each (sanitizer_scale.h).
constexpr long kEvery = kvtest::release_or_sanitized(48L, 24L);
constexpr long kSpread = kvtest::release_or_sanitized(48L, 24L);

struct Sequence {
    std::vector<float> keys = kvtest::gaussian(kPrompt + kAppends + kNewTokens, kD, 201, 1.0f, 0.3f);
    std::vector<float> values = kvtest::gaussian(kPrompt + kAppends + kNewTokens, kDv, 202);
    std::vector<float> prefill_q = kvtest::gaussian(kGroup * kPrompt, kD, 203, 1.5f);
    std::vector<float> decode_q = kvtest::gaussian(kGroup * (kAppends + 1), kD, 204, 1.5f);
    std::vector<float> q = kvtest::gaussian(kQ, kD, 205, 2.0f);

    PrefillInput prefill_input() const {
        PrefillInput in;
        in.n_tokens = kPrompt;
        in.keys = keys.data();
        in.values = values.data();
        in.n_queries = kPrompt;
        in.n_query_heads = kGroup;
        in.queries = prefill_q.data();
        in.rope.theta = 500000.0;
        in.rope.style = RopeStyle::interleaved;
        return in;
    }
};

const Sequence& sequence() {
    static const Sequence s;
    return s;
}

/** Training knobs narrowed to a fraction of their defaults' arithmetic
 * (which ASan and UBSan make dear: a prefill of the defaults was most of
 * this binary's run under them), while the same allocations fail in turn:
 * IVFAsym's self-trained Q-model allocates the same buffers at every Adam
 * step whatever its width and steps; a hybrid's split the same buffers
 * whatever its calibration rows; RoarGraph's projection and linking the
 * same per training query and per key whatever their numbers (with 48 of
 * the 600 prompt queries the build samples them; taking them all is an
 * iota in training_sample). */
const std::pair<const char*, double> kNarrowedKnobs[] = {
        {"hidden", 8},             // IVFAsym: Q-model width (default 256)
        {"train_iterations", 20},  // IVFAsym: Adam steps (default 10 epochs of its rows)
        {"n_calibration", 8},      // Hybrid: split calibrated on 8 positions (default 64)
        {"max_train_queries", 48}, // RoarGraph: training queries (all 600 by default)
        {"Nq", 16},                // RoarGraph: exact neighbours per query (default 100)
};

void narrow_self_training(KVIndex* index) {
    for (const ParameterInfo& p : index_parameter_info(index)) {
        for (const auto& [name, value] : kNarrowedKnobs) {
            if (p.name == name) {
                set_index_parameter(index, name, value);
            }
        }
    }
}

/// An empty index of case c, as prefill finds it.
std::unique_ptr<KVIndex> empty_index(const ConformanceCase& c) {
    auto index = index_factory(kD, c.factory, kDv);
    narrow_self_training(index.get());
    return index;
}

/// Prefill, kAppends decode steps (token, then the group's queries), knobs.
std::unique_ptr<KVIndex> build(const ConformanceCase& c) {
    const Sequence& s = sequence();
    auto index = empty_index(c);
    index->prefill(s.prefill_input());
    for (idx_t i = 0; i < kAppends; i++) {
        index->add_kv(1, s.keys.data() + (kPrompt + i) * kD, s.values.data() + (kPrompt + i) * kDv);
        index->add_queries(kGroup, s.decode_q.data() + i * kGroup * kD);
    }
    set_index_parameters(index.get(), c.knobs);
    return index;
}

std::vector<uint8_t> bytes_of(const KVIndex& index) {
    std::vector<uint8_t> b;
    write_index(&index, &b);
    return b;
}

/// Where two saved indexes differ, for a failure's message.
std::string difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
    // past the file header (its checksum differs whenever the record does)
    size_t i = kvtest::kIndexHeaderSize;
    while (i < a.size() && i < b.size() && a[i] == b[i]) {
        i++;
    }
    std::string r = "sizes " + std::to_string(a.size()) + " and " + std::to_string(b.size()) +
            ", first difference at byte " + std::to_string(i) + ":";
    for (size_t j = i; j < i + 16 && j < a.size() && j < b.size(); j++) {
        r += " " + std::to_string(a[j]) + "/" + std::to_string(b[j]);
    }
    return r;
}

/// Everything an index answers for the test queries, as bytes.
std::vector<uint8_t> answers_of(const KVIndex& index) {
    if (index.ntotal == 0) {
        return {}; // nothing to answer (attend refuses an empty index)
    }
    const Sequence& s = sequence();
    std::vector<float> dis(kQ * kSearchK), out(kQ * kDv), lse(kQ);
    std::vector<idx_t> labels(kQ * kSearchK);
    std::vector<Selection> sel(kQ);
    index.search(kQ, s.q.data(), kSearchK, dis.data(), labels.data());
    index.attend(kQ, s.q.data(), out.data(), lse.data());
    index.select(kQ, s.q.data(), sel.data());
    std::vector<uint8_t> a;
    auto put = [&a](const void* p, size_t n) {
        a.insert(a.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
    };
    put(dis.data(), dis.size() * sizeof(float));
    put(labels.data(), labels.size() * sizeof(idx_t));
    put(out.data(), out.size() * sizeof(float));
    put(lse.data(), lse.size() * sizeof(float));
    for (const Selection& x : sel) {
        put(x.ids.data(), x.ids.size() * sizeof(idx_t));
        put(x.inclusion.data(), x.inclusion.size() * sizeof(float));
    }
    return a;
}

/// One call under test, on `index` (a fresh copy each time).
using Call = std::function<void(KVIndex& index)>;

/// What a call did under run_failing_at.
struct Outcome {
    long allocations = 0; ///< counted (outside OpenMP regions)
    bool threw = false;
    std::string message;  ///< the exception's, if it threw
};

/// Runs call with allocation `at` failing (0: none fails); a call that
/// throws without the failure having fired is a test failure.
Outcome run_failing_at(const std::function<void()>& call, long at) {
    Outcome o;
    g_plan.seen = 0;
    g_plan.countdown = at;
    g_plan.fired = false;
    g_plan.armed = true;
    try {
        call();
    } catch (const std::exception& e) {
        o.threw = true;
        o.message = e.what();
    }
    g_plan.armed = false;
    o.allocations = g_plan.seen;
    if (o.threw) {
        EXPECT_TRUE(g_plan.fired) << "threw without an allocation failure: " << o.message;
        EXPECT_FALSE(o.message.empty());
    }
    return o;
}

Outcome run_failing_at(const Call& call, KVIndex& index, long at) {
    return run_failing_at([&] { call(index); }, at);
}

/// The allocations to fail: every one up to kEvery, then kSpread spread
/// evenly over the rest.
std::vector<long> failure_points(long total) {
    std::vector<long> at;
    for (long i = 1; i <= std::min(total, kEvery); i++) {
        at.push_back(i);
    }
    if (total > kEvery) {
        for (long j = 1; j <= kSpread; j++) {
            long i = kEvery + (total - kEvery) * j / kSpread;
            if (i > at.back()) {
                at.push_back(i);
            }
        }
    }
    return at;
}

/// Every call of a failed index but reset() throws, naming the failed write.
void expect_refused(KVIndex& x, const std::string& write) {
    const Sequence& s = sequence();
    std::vector<float> dis(kQ * kSearchK), out(kQ * kDv), row(kD);
    std::vector<idx_t> labels(kQ * kSearchK);
    std::vector<Selection> sel(kQ);
    std::vector<uint8_t> buf;
    const std::vector<std::function<void()>> calls = {
            [&] { x.search(kQ, s.q.data(), kSearchK, dis.data(), labels.data()); },
            [&] { x.attend(kQ, s.q.data(), out.data(), nullptr); },
            [&] { x.select(kQ, s.q.data(), sel.data()); },
            [&] { x.add_kv(1, s.keys.data(), s.values.data()); },
            [&] { x.add_queries(1, s.q.data()); },
            [&] { x.prefill(s.prefill_input()); },
            [&] { x.reconstruct(0, row.data()); },
            [&] { write_index(&x, &buf); },
    };
    for (size_t i = 0; i < calls.size(); i++) {
        try {
            calls[i]();
            ADD_FAILURE() << "call " << i << " of a failed index did not throw";
        } catch (const std::exception& e) {
            std::string msg = e.what();
            EXPECT_NE(msg.find("reset()"), std::string::npos) << "call " << i << ": " << msg;
            EXPECT_NE(msg.find(write + ": "), std::string::npos) << "call " << i << ": " << msg;
        }
    }
}

/**
 * A write under failures: each failure point on a fresh copy of `start`
 * (read from its bytes). After a throw, an index whose writes roll back
 * must save start's bytes and give its answers, and the call repeated
 * must give what the call gives on a copy without failures. Any other
 * index must do the same when the throw came before its write began, and
 * else be marked failed: it refuses every call but reset(), and reset()
 * gives what a reset of `start` gives. A failure the call absorbs (one
 * while recording its children's stamps after the write, say) must leave
 * the whole call done. Returns how many failures reached the caller.
 */
int check_write(
        const std::vector<uint8_t>& start,
        const Call& call,
        const std::string& write,
        const std::string& what) {
    SCOPED_TRACE(what);
    auto clean = read_index(start);
    // add_queries changes no tokens, and every type keeps it atomic
    const bool rolls_back = write == "add_queries" ||
            (write == "add_kv" ? clean->appends_roll_back() : clean->writes_roll_back());
    const std::vector<uint8_t> before_answers = answers_of(*clean);
    const idx_t n0 = clean->ntotal;
    Outcome counted = run_failing_at(call, *clean, 0);
    EXPECT_FALSE(counted.threw) << counted.message;
    if (counted.threw) {
        return 0;
    }
    const std::vector<uint8_t> after = bytes_of(*clean);
    const std::vector<uint8_t> after_answers = answers_of(*clean);
    auto start_reset = read_index(start);
    start_reset->reset();
    const std::vector<uint8_t> after_reset = bytes_of(*start_reset);
    int n_threw = 0;
    for (long at : failure_points(counted.allocations)) {
        auto copy = read_index(start);
        Outcome o = run_failing_at(call, *copy, at);
        if (!o.threw) {
            // the failure was absorbed (a fallback): the call must still
            // have done all of its work
            EXPECT_TRUE(bytes_of(*copy) == after) << "allocation " << at << " absorbed, result differs";
            continue;
        }
        n_threw++;
        const std::string where = "allocation " + std::to_string(at) + " failed (" + o.message + ")";
        if (rolls_back || !copy->failed_write()) {
            // a type that rolls back, or a throw before the write began
            EXPECT_FALSE(copy->failed_write()) << where;
            EXPECT_EQ(copy->ntotal, n0) << where;
            EXPECT_NO_THROW(copy->check_invariants()) << where;
            EXPECT_TRUE(bytes_of(*copy) == start) << where << " and the index's bytes changed";
            EXPECT_TRUE(answers_of(*copy) == before_answers) << where << " and the answers changed";
            call(*copy);
            EXPECT_TRUE(bytes_of(*copy) == after)
                    << where << ", then the call again gave other bytes than without a failure";
            EXPECT_TRUE(answers_of(*copy) == after_answers) << where << ": retried";
        } else {
            EXPECT_EQ(std::string(copy->failed_write()).rfind(write + ": ", 0), 0u)
                    << copy->failed_write();
            expect_refused(*copy, write);
            copy->reset();
            EXPECT_FALSE(copy->failed_write()) << where;
            EXPECT_EQ(copy->ntotal, 0) << where;
            std::vector<uint8_t> b = bytes_of(*copy);
            EXPECT_TRUE(b == after_reset) << where << ", then reset() gave other bytes than a "
                                          << "reset without a failure: " << difference(b, after_reset);
        }
        if (testing::Test::HasFailure()) {
            return n_threw; // one report per call is enough
        }
    }
    return n_threw;
}

/// A const call under failures: a throw leaves the index's bytes and
/// answers as they were.
void check_read(const std::vector<uint8_t>& start, const Call& call, const std::string& what) {
    SCOPED_TRACE(what);
    auto copy = read_index(start);
    const std::vector<uint8_t> before_answers = answers_of(*copy);
    Outcome counted = run_failing_at(call, *copy, 0);
    ASSERT_FALSE(counted.threw) << counted.message;
    for (long at : failure_points(counted.allocations)) {
        Outcome o = run_failing_at(call, *copy, at);
        if (!o.threw) {
            continue;
        }
        EXPECT_TRUE(bytes_of(*copy) == start) << "allocation " << at << ": " << o.message;
        EXPECT_TRUE(answers_of(*copy) == before_answers) << "allocation " << at << ": " << o.message;
        if (testing::Test::HasFailure()) {
            return;
        }
    }
}

std::string param_name(const testing::TestParamInfo<ConformanceCase>& info) {
    return kvtest::conformance_test_name(info.index, info.param);
}

class AllocationFaults : public testing::TestWithParam<ConformanceCase> {
   protected:
    void SetUp() override {
        // one thread: a call repeated must build what it built the first
        // time (Faiss's HNSW construction differs between thread counts
        // and runs)
        omp_set_num_threads(1);
    }
};

} // namespace

INSTANTIATE_TEST_SUITE_P(AllTypes, AllocationFaults, testing::ValuesIn(kvtest::kConformance),
                         param_name);

/// The index of case c after prefill and kAppends decode steps, saved.
std::vector<uint8_t> built_bytes(const ConformanceCase& c) {
    std::vector<uint8_t> built = bytes_of(*build(c));
    EXPECT_TRUE(bytes_of(*read_index(built)) == built) << "a copy saves other bytes";
    return built;
}

TEST_P(AllocationFaults, FailedAddKvLeavesTheIndexAsItWas) {
    const Sequence& s = sequence();
    const idx_t next = kPrompt + kAppends;
    const std::vector<uint8_t> built = built_bytes(GetParam());
    int n_threw = check_write(built, [&](KVIndex& x) {
        x.add_kv(kNewTokens, s.keys.data() + next * kD, s.values.data() + next * kDv);
    }, "add_kv", "add_kv of 3 tokens");
    n_threw += check_write(built, [&](KVIndex& x) {
        x.add_kv(1, s.keys.data() + next * kD, s.values.data() + next * kDv);
    }, "add_kv", "add_kv of 1 token");
    // every type stores the tokens it is given: some allocation must fail
    EXPECT_GT(n_threw, 0) << "no failure reached the caller";
}

TEST_P(AllocationFaults, FailedAddQueriesLeavesTheIndexAsItWas) {
    const Sequence& s = sequence();
    check_write(built_bytes(GetParam()), [&](KVIndex& x) {
        x.add_queries(kGroup, s.decode_q.data() + kAppends * kGroup * kD);
    }, "add_queries", "add_queries");
}

TEST_P(AllocationFaults, FailedResetLeavesTheIndexAsItWas) {
    check_write(built_bytes(GetParam()), [](KVIndex& x) { x.reset(); }, "reset", "reset");
}

TEST_P(AllocationFaults, FailedPrefillLeavesTheIndexEmpty) {
    const ConformanceCase& c = GetParam();
    auto empty = empty_index(c);
    set_index_parameters(empty.get(), c.knobs);
    check_write(bytes_of(*empty), [](KVIndex& x) { x.prefill(sequence().prefill_input()); },
                "prefill", "prefill");
}

TEST(AllocationFaultsHybrid, AFailedDefaultSplitLeavesTheHybridAsItWas) {
    // with no knobs a hybrid splits its reads at prefill, setting its heavy
    // k, its sample and an LSH tail's cap as it measures each split: a
    // prefill that fails part-way leaves the index empty with those as they
    // were (the conformance cases set k and sample, which skips the split)
    for (const char* s : {"Hybrid(TopK(Flat),Uniform)", "Hybrid(TopK(Flat),Weighted)",
                          "Hybrid(TopK(Flat),LSHSample6x20)"}) {
        SCOPED_TRACE(s);
        auto empty = index_factory(kD, s, kDv);
        narrow_self_training(empty.get());
        auto split = read_index(bytes_of(*empty));
        split->prefill(sequence().prefill_input());
        ASSERT_GE(get_index_parameter(split.get(), "calibrated_k"), 1.0) << "the default split did not run";
        check_write(bytes_of(*empty), [](KVIndex& x) { x.prefill(sequence().prefill_input()); },
                    "prefill", "prefill");
    }
}

TEST_P(AllocationFaults, FailedReadsChangeNothing) {
    const ConformanceCase& c = GetParam();
    const Sequence& s = sequence();
    const std::vector<uint8_t> built = built_bytes(c);
    check_read(built, [&](KVIndex& x) {
        std::vector<float> dis(kQ * kSearchK);
        std::vector<idx_t> labels(kQ * kSearchK);
        x.search(kQ, s.q.data(), kSearchK, dis.data(), labels.data());
    }, "search");
    check_read(built, [&](KVIndex& x) {
        std::vector<float> out(kQ * kDv), lse(kQ);
        x.attend(kQ, s.q.data(), out.data(), lse.data());
    }, "attend");
    check_read(built, [&](KVIndex& x) {
        std::vector<Selection> sel(kQ);
        x.select(kQ, s.q.data(), sel.data());
    }, "select");
    check_read(built, [](KVIndex& x) { bytes_of(x); }, "write_index");
    check_read(built, [&](KVIndex&) { read_index(built); }, "read_index");
}

// ---- KVCache::append: the heads of a layer as one step ----------------------

namespace {

constexpr int kKVHeads = 2;

/// A layer's tokens and queries, head-major ([kKVHeads, n, d]).
struct CacheTokens {
    std::vector<float> prompt_k = kvtest::gaussian(kKVHeads * kPrompt, kD, 301, 1.0f, 0.3f);
    std::vector<float> prompt_v = kvtest::gaussian(kKVHeads * kPrompt, kDv, 302);
    std::vector<float> prompt_q = kvtest::gaussian(kKVHeads * kGroup * kPrompt, kD, 303, 1.5f);
    std::vector<float> new_k = kvtest::gaussian(kKVHeads * kNewTokens, kD, 304, 1.0f, 0.3f);
    std::vector<float> new_v = kvtest::gaussian(kKVHeads * kNewTokens, kDv, 305);
    std::vector<float> q = kvtest::gaussian(kKVHeads * kGroup, kD, 306, 2.0f); ///< one per query head
};

const CacheTokens& cache_tokens() {
    static const CacheTokens t;
    return t;
}

void prefill_layer(KVCache& cache) {
    const CacheTokens& t = cache_tokens();
    RopeParams rope;
    rope.theta = 500000.0;
    rope.style = RopeStyle::interleaved;
    cache.prefill(0, kPrompt, t.prompt_k.data(), t.prompt_v.data(), kPrompt, t.prompt_q.data(),
                  nullptr, rope);
}

/// One layer of kKVHeads heads of case c, prefilled, its knobs set.
std::unique_ptr<KVCache> prefilled_cache(const ConformanceCase& c) {
    auto cache = std::make_unique<KVCache>(1, kKVHeads * kGroup, kKVHeads, kD, kDv, c.factory);
    for (int h = 0; h < kKVHeads; h++) {
        narrow_self_training(cache->index(0, h));
    }
    prefill_layer(*cache);
    for (int h = 0; h < kKVHeads; h++) {
        set_index_parameters(cache->index(0, h), c.knobs);
    }
    return cache;
}

void append_new_tokens(KVCache& cache) {
    const CacheTokens& t = cache_tokens();
    cache.append(0, kNewTokens, t.new_k.data(), t.new_v.data());
}

/// The layer's attention for one query per query head, as bytes.
std::vector<float> cache_answers(const KVCache& cache) {
    std::vector<float> out(kKVHeads * kGroup * kDv), lse(kKVHeads * kGroup);
    cache.attend(0, 1, cache_tokens().q.data(), out.data(), lse.data());
    out.insert(out.end(), lse.begin(), lse.end());
    return out;
}

/// Allocations fail inside the loop that runs a cache's heads, for a scope.
struct FailInsideTheHeadsLoop {
    FailInsideTheHeadsLoop() {
        g_plan.max_level = 1;
    }
    ~FailInsideTheHeadsLoop() {
        g_plan.max_level = 0;
    }
};

} // namespace

/**
 * KVCache::append checks every head's input before any head appends, but
 * an allocation can fail inside one head after another has taken the
 * tokens. The contract (KVCache.h): after a throw the layer is either as
 * it was (no head changed, or every head rolled back: the same answers,
 * and the append again gives what it gives without a failure), or every
 * call on the layer refuses, naming reset(); reset() then gives a cache
 * that answers as one reset without a failure. The first always, where
 * the heads can take an append back (can_undo_add) and their own appends
 * roll back (appends_roll_back).
 */
TEST_P(AllocationFaults, FailedCacheAppendLeavesTheLayerAsItWasOrRefusesIt) {
    const ConformanceCase& c = GetParam();
    const CacheTokens& t = cache_tokens();
    FailInsideTheHeadsLoop inside;
    auto clean = prefilled_cache(c);
    const std::vector<float> before = cache_answers(*clean);
    Outcome counted = run_failing_at([&] { append_new_tokens(*clean); }, 0);
    ASSERT_FALSE(counted.threw) << counted.message;
    const std::vector<float> after = cache_answers(*clean);
    // a new sequence after reset(): the knobs stay, and are set before its
    // prefill now (Choose measures its candidates with them)
    clean->reset();
    prefill_layer(*clean);
    append_new_tokens(*clean);
    const std::vector<float> after_reset = cache_answers(*clean);
    int n_threw = 0, n_refused = 0;
    for (long at : failure_points(counted.allocations)) {
        auto cache = prefilled_cache(c);
        Outcome o = run_failing_at([&] { append_new_tokens(*cache); }, at);
        const std::string where = "allocation " + std::to_string(at) + " failed (" + o.message + ")";
        if (!o.threw) {
            EXPECT_TRUE(cache_answers(*cache) == after) << "allocation " << at << " absorbed";
            continue;
        }
        n_threw++;
        bool in_step = true;
        try {
            cache->check_invariants();
        } catch (const std::exception&) {
            in_step = false;
        }
        bool marked = false;
        for (int h = 0; h < kKVHeads; h++) {
            marked = marked || cache->index(0, h)->failed_write() != nullptr;
        }
        if (in_step && !marked) {
            EXPECT_EQ(cache->n_tokens(0), kPrompt) << where;
            EXPECT_TRUE(cache_answers(*cache) == before) << where << " and the answers changed";
            append_new_tokens(*cache);
            EXPECT_TRUE(cache_answers(*cache) == after) << where << ": retried";
        } else {
            n_refused++;
            std::vector<float> out(kKVHeads * kGroup * kDv);
            const std::vector<std::function<void()>> calls = {
                    [&] { cache->attend(0, 1, t.q.data(), out.data(), nullptr); },
                    [&] { append_new_tokens(*cache); },
                    [&] { cache->add_queries(0, 1, t.q.data()); },
            };
            for (size_t i = 0; i < calls.size(); i++) {
                try {
                    calls[i]();
                    ADD_FAILURE() << where << ": call " << i << " on the layer did not throw";
                } catch (const std::exception& e) {
                    EXPECT_NE(std::string(e.what()).find("reset()"), std::string::npos)
                            << where << ": call " << i << ": " << e.what();
                }
            }
            cache->reset();
            EXPECT_NO_THROW(cache->check_invariants()) << where;
            EXPECT_EQ(cache->n_tokens(0), 0) << where;
            prefill_layer(*cache);
            append_new_tokens(*cache);
            EXPECT_TRUE(cache_answers(*cache) == after_reset) << where << ", then reset(), prefill, append";
        }
        if (testing::Test::HasFailure()) {
            return; // one report per case is enough
        }
    }
    // every head stores the tokens it is given: some allocation must fail.
    // Where the heads can take an append back and their own writes roll
    // back, the layer is always as it was; otherwise a failure inside the
    // second head leaves the first with the tokens, and the layer refused
    EXPECT_GT(n_threw, 0);
    const KVIndex* head = clean->index(0, 0);
    if (head->can_undo_add() && head->appends_roll_back()) {
        EXPECT_EQ(n_refused, 0) << "the heads take their appends back";
    } else {
        EXPECT_GT(n_refused, 0);
    }
}
