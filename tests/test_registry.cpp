// The registry (registry.h): every row is reachable through the factory and
// io, the conformance list covers every row, and a type defined outside the
// core joins through register_index_type alone, touching no core file.

#include <algorithm>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <faiss/impl/FaissException.h>

#include <kvindex/KVStorage.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>
#include <kvindex/registry.h>

#include "conformance_list.h"
#include "expect_throw.h"
#include "reference.h"

namespace test_registry {

using namespace kvindex;

namespace {

void collect_types(const KVIndex* index, std::set<std::string>& names) {
    names.insert(index->type_name());
    for (const KVIndex* c : index->children()) {
        collect_types(c, names);
    }
}

} // namespace

TEST(Registry, RowsAreComplete) {
    std::set<std::string> names;
    std::set<uint32_t> tags;
    for (const IndexTypeInfo& t : index_types()) {
        SCOPED_TRACE(t.name);
        EXPECT_FALSE(t.grammar.empty());
        EXPECT_FALSE(t.doc.empty());
        EXPECT_GE(t.record_version, 1u);
        ASSERT_TRUE(t.parse);
        ASSERT_TRUE(t.make_empty);
        // the empty index is of the row's type
        EXPECT_EQ(std::string(t.make_empty()->type_name()), t.name);
        EXPECT_TRUE(names.insert(t.name).second) << "duplicate name";
        EXPECT_TRUE(tags.insert(t.fourcc).second) << "duplicate fourcc";
    }
    EXPECT_GE(names.size(), 5u);
}

TEST(Registry, ConformanceListCoversEveryRow) {
    std::set<std::string> seen;
    for (const auto& c : kvtest::kConformance) {
        collect_types(index_factory(16, c.factory).get(), seen);
    }
    for (const IndexTypeInfo& t : index_types()) {
        EXPECT_TRUE(seen.count(t.name))
                << t.name << " appears in no string of tests/conformance_list.h";
    }
}

TEST(Registry, LookupErrors) {
    EXPECT_THROW_MSG(index_type("IndexNoSuchThing"), "IndexNoSuchThing");
    IndexTypeInfo row;
    EXPECT_FALSE(find_index_type(fourcc("none"), &row));
    EXPECT_TRUE(find_index_type(fourcc("KVFl"), &row));
    EXPECT_EQ(row.name, "IndexKVFlat");
}

// ---- a type from outside the core ------------------------------------------

namespace {

/** "Recent<n>": attention over the n most recent tokens only. Written here,
 * in a test, to show what adding a type takes: this struct, and one row. */
struct IndexRecent : KVIndex {
    idx_t n_recent = 0;
    KVStorage storage;

    IndexRecent() : KVIndex(0, 0) {}
    IndexRecent(int d, int dv, idx_t n) : KVIndex(d, dv), n_recent(n), storage(d, d_value) {}

    void reset_impl() override {
        storage.clear();
        ntotal = 0;
    }
    size_t memory_bytes() const override {
        return storage.memory_bytes();
    }
    const char* type_name() const override {
        return "IndexRecent";
    }
    std::string factory_string() const override {
        return "Recent" + std::to_string(n_recent);
    }
    void write_fields(BufferWriter& w) const override {
        w.value<int64_t>(n_recent);
        storage.write(w);
    }
    void read_fields(BufferReader& r, uint32_t) override {
        n_recent = r.value<int64_t>("n_recent");
        storage = KVStorage(d, d_value);
        storage.read(r, "Recent storage");
    }
    void check_invariants() const override {
        KVIndex::check_invariants();
        FAISS_THROW_IF_NOT_MSG(
                n_recent > 0 && storage.size() == ntotal, "IndexRecent: inconsistent");
    }
    static std::unique_ptr<KVIndex> from_factory(FactoryChain& chain) {
        idx_t n;
        if (!parse_factory_count(chain.peek(), "Recent", &n) || n <= 0) {
            return nullptr;
        }
        chain.take();
        return std::make_unique<IndexRecent>(chain.d, chain.d_value, n);
    }

   protected:
    const KVStorage* token_storage() const override {
        return &storage;
    }
    void add_kv_impl(idx_t n, const float* k, const float* v) override {
        storage.append(n, k, v);
    }
    // the only core it needs: attend, search and select follow
    void select_one(const float*, Selection& sel, const faiss::SearchParameters*)
            const override {
        sel.clear();
        for (idx_t i = std::max<idx_t>(0, ntotal - n_recent); i < ntotal; i++) {
            sel.push_back(i);
        }
    }
};

void register_recent() {
    static bool done = false;
    if (!done) {
        register_index_type(
                {"IndexRecent", fourcc("TsRc"), 1, "Recent<n>", "the n most recent tokens",
                 IndexRecent::from_factory,
                 []() -> std::unique_ptr<KVIndex> { return std::make_unique<IndexRecent>(); }});
        done = true;
    }
}

} // namespace

TEST(Registry, TypeAddedAtRunTime) {
    register_recent();
    const int d = 16, dv = 8;
    const idx_t n = 60, nr = 10;
    // the factory composes it with the built-in wrappers
    auto index = index_factory(d, "Sink4,Recent10", dv);
    EXPECT_EQ(index_factory_string(index.get()), "Sink4,Recent10");
    std::vector<float> keys = kvtest::gaussian(n, d, 1), values = kvtest::gaussian(n, dv, 2);
    index->add_kv(n, keys.data(), values.data());
    std::vector<float> q = kvtest::gaussian(2, d, 3, 2.0f), out(2 * dv), lse(2);
    index->attend(2, q.data(), out.data(), lse.data());

    // = exact attention over the sinks and the recent tokens of the inner part
    std::vector<kvtest::idx_t> ids = {0, 1, 2, 3};
    for (idx_t i = n - nr; i < n; i++) {
        ids.push_back(i);
    }
    for (int i = 0; i < 2; i++) {
        std::vector<double> ref;
        double ref_lse = kvtest::ref_attention(
                q.data() + i * d, keys.data(), values.data(), d, dv, ids, nullptr, ref);
        EXPECT_LT(kvtest::rel_max_err(out.data() + i * dv, ref), 1e-5);
        EXPECT_NEAR(lse[i], ref_lse, 1e-5 * std::max(1.0, std::fabs(ref_lse)));
    }
    // io through its row
    std::vector<uint8_t> buf;
    write_index(index.get(), &buf);
    auto copy = read_index(buf);
    EXPECT_EQ(index_factory_string(copy.get()), "Sink4,Recent10");
    std::vector<float> out2(2 * dv), lse2(2);
    copy->attend(2, q.data(), out2.data(), lse2.data());
    EXPECT_EQ(out, out2);
    EXPECT_EQ(lse, lse2);
}

TEST(Registry, RegisterRefusesClashes) {
    register_recent();
    IndexTypeInfo row = index_type("IndexRecent");
    EXPECT_THROW_MSG(register_index_type(row), "clashes");
    row.name = "IndexRecent2"; // same fourcc
    EXPECT_THROW_MSG(register_index_type(row), "clashes");
    row.fourcc = fourcc("TsR2");
    row.make_empty = nullptr;
    EXPECT_THROW_MSG(register_index_type(row), "empty constructor");
    // an empty constructor that makes nothing, or another type, would make
    // read_index crash or read a record as the wrong type
    row.make_empty = []() -> std::unique_ptr<KVIndex> { return nullptr; };
    EXPECT_THROW_MSG(register_index_type(row), "makes nullptr");
    row.make_empty = []() -> std::unique_ptr<KVIndex> { return std::make_unique<IndexRecent>(); };
    EXPECT_THROW_MSG(register_index_type(row), "makes IndexRecent");
    EXPECT_THROW(index_type("IndexRecent2"), faiss::FaissException); // nothing was added
}

TEST(Registry, UnregisteredTypeCannotBeWritten) {
    // a type without a row cannot be serialized: the error names it
    struct Unlisted : IndexRecent {
        const char* type_name() const override {
            return "IndexUnlisted";
        }
    } index;
    std::vector<uint8_t> buf;
    EXPECT_THROW_MSG(write_index(&index, &buf), "IndexUnlisted");
}

}  // namespace test_registry
