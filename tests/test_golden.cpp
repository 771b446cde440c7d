// Golden files (tests/data/golden): indexes saved by every format version
// ever written must read back and answer as they did when they were saved.
// golden.json holds the answers the writing code gave; the files are never
// rewritten (golden_writer.cpp only adds missing ones).

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>

#include "conformance_list.h"
#include "forge.h"
#include "golden_data.h"

namespace test_golden {

using namespace kvindex;

namespace {

const std::string kDir = KVINDEX_GOLDEN_DIR;

nlohmann::json manifest() {
    std::ifstream f(kDir + "/golden.json");
    EXPECT_TRUE(f.good()) << "missing " << kDir << "/golden.json";
    nlohmann::json j;
    if (f.good()) {
        f >> j;
    }
    return j;
}

std::vector<uint8_t> file_bytes(const std::string& name) {
    std::ifstream f(kDir + "/" + name, std::ios::binary);
    EXPECT_TRUE(f.good()) << "missing golden file " << name;
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

/// max |a - b| / max(1, max |b|): kernels may change their summation order
/// across versions, so float answers are compared to 1e-5, labels exactly.
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
    double m = 1, e = 0;
    for (size_t i = 0; i < b.size(); i++) {
        m = std::max(m, double(std::fabs(b[i])));
        e = std::max(e, double(std::fabs(a[i] - b[i])));
    }
    return e / m;
}

} // namespace

TEST(Golden, EveryConformanceStringHasACurrentFile) {
    nlohmann::json j = manifest();
    for (const auto& c : kvtest::kConformance) {
        const std::string version = kvgolden::golden_version_key(c.factory);
        ASSERT_TRUE(j["indexes"].contains(c.factory))
                << "no golden file for '" << c.factory
                << "': run ./build/tests/kvindex_golden_writer tests/data/golden and commit it";
        EXPECT_TRUE(j["indexes"][c.factory]["files"].contains(version))
                << "no version-" << version << " golden file for '" << c.factory
                << "': run ./build/tests/kvindex_golden_writer tests/data/golden and commit it";
    }
}

TEST(Golden, EveryVersionReadsBackAndAnswersAsSaved) {
    nlohmann::json j = manifest();
    ASSERT_FALSE(j.is_null());
    std::vector<float> q = j["queries"].get<std::vector<float>>();
    int n_files = 0;
    for (auto& [factory, e] : j["indexes"].items()) {
        const std::string current = kvgolden::golden_version_key(factory);
        // the bytes today's writer gives for this index
        std::vector<uint8_t> current_bytes;
        if (e["files"].contains(current)) {
            current_bytes = file_bytes(e["files"][current].get<std::string>());
        }
        for (auto& [version, name] : e["files"].items()) {
            SCOPED_TRACE(factory + " format " + version + " (" + name.get<std::string>() + ")");
            std::vector<uint8_t> bytes = file_bytes(name.get<std::string>());
            std::unique_ptr<KVIndex> index;
            ASSERT_NO_THROW(index = read_index(bytes));
            n_files++;
            EXPECT_EQ(index_factory_string(index.get()), factory);
            EXPECT_EQ(index->d, j["d"].get<int>());
            EXPECT_EQ(index->d_value, j["d_value"].get<int>());
            EXPECT_EQ(index->ntotal, kvgolden::kPrefill + kvgolden::kDecode);
            EXPECT_TRUE(index->has_rope);
            EXPECT_EQ(index->rope.theta, 500000.0);
            EXPECT_EQ(index->rope.style, RopeStyle::interleaved);
            kvtest::expect_knobs(index.get(), e["knobs"].get<std::string>(), "knobs");
            kvgolden::Answers a = kvgolden::answer(index.get(), q);
            EXPECT_EQ(a.labels, e["labels"].get<std::vector<idx_t>>());
            EXPECT_LT(rel_err(a.distances, e["distances"].get<std::vector<float>>()), 1e-5);
            EXPECT_LT(rel_err(a.out, e["out"].get<std::vector<float>>()), 1e-5);
            EXPECT_LT(rel_err(a.lse, e["lse"].get<std::vector<float>>()), 1e-5);
            // nothing lost in the upgrade: today's writer gives today's file
            if (!current_bytes.empty()) {
                std::vector<uint8_t> again;
                write_index(index.get(), &again);
                EXPECT_TRUE(again == current_bytes)
                        << "rewritten bytes differ from the version-" << current << " file";
            }
        }
    }
    EXPECT_GE(n_files, int(std::size(kvtest::kConformance)));
}

}  // namespace test_golden
