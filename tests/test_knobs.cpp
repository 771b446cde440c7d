// The knobs' descriptions (ParameterInfo: type, accepted values) are the
// values set_parameter accepts, for every knob of every registered type:
// docs/reference.md, generated from the descriptions, cannot promise a
// value the code refuses, nor hide one it takes.

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/index_factory.h>
#include <kvindex/parameters.h>
#include <kvindex/registry.h>

namespace test_knobs {

using namespace kvindex;

namespace {

/// The values worth trying on a knob: its bounds and the values just
/// beyond them, its special values, a fraction for an integer, non-finite.
std::vector<double> probe_values(const ParameterInfo& p) {
    std::vector<double> v = {std::nan(""), HUGE_VAL, -HUGE_VAL, 0, 1, -1};
    const bool bounded = p.max_value != ParameterInfo::kNoBound && std::isfinite(p.max_value);
    if (std::isfinite(p.min_value)) {
        v.push_back(p.min_value);
        v.push_back(std::nextafter(p.min_value, -HUGE_VAL));
        v.push_back(std::nextafter(p.min_value, HUGE_VAL));
        v.push_back(p.min_value - 1);
        v.push_back(p.min_value + 0.5);
        v.push_back(p.min_value + 1);
    }
    if (bounded) {
        v.push_back(p.max_value);
        v.push_back(std::nextafter(p.max_value, HUGE_VAL));
        v.push_back(std::nextafter(p.max_value, -HUGE_VAL));
        v.push_back(p.max_value + 1);
        v.push_back(p.max_value - 0.5); // a fraction below 2^52, an integer above
        v.push_back(p.max_value - 1);
    } else {
        v.push_back(1000001); // far up an unbounded range (odd: pool takes it)
        if (p.max_value == ParameterInfo::kNoBound) {
            v.push_back(ParameterInfo::kNoBound);
            v.push_back(ParameterInfo::kNoBound * 4);
        }
    }
    for (double a : p.also_values) {
        v.push_back(a);
        v.push_back(a + 0.5);
    }
    return v;
}

} // namespace

TEST(Knobs, DescribedValuesAreTheAcceptedOnes) {
    int n_checked = 0, n_types = 0;
    for (const IndexTypeInfo& row : index_types()) {
        if (row.examples.empty()) {
            continue; // a type a test registered (the built-in rows all have examples: below)
        }
        n_types++;
        for (const std::string& example : row.examples) {
            std::unique_ptr<KVIndex> probe = index_factory(64, example);
            ASSERT_EQ(index_type_of(probe.get()).name, row.name) << example << " builds another type";
            for (const ParameterInfo& p : probe->parameter_info()) {
                EXPECT_FALSE(p.doc.empty()) << example << ": " << p.name;
                for (double value : probe_values(p)) {
                    std::unique_ptr<KVIndex> index = index_factory(64, example); // fresh: no knob set before
                    bool accepted = false;
                    try {
                        accepted = index->set_parameter(p.name, value);
                        EXPECT_TRUE(accepted) << example << ": set_parameter does not know its own knob " << p.name;
                    } catch (const faiss::FaissException&) {
                        accepted = false;
                    }
                    EXPECT_EQ(accepted, p.accepts(value))
                            << example << ": " << p.name << "=" << value << " (described as " << p.range() << ")";
                    n_checked++;
                }
            }
        }
    }
    EXPECT_GT(n_checked, 500);
    EXPECT_GE(n_types, 11); // every built-in type
}

TEST(Knobs, RangesReadAsTheReferencePrintsThem) {
    EXPECT_EQ(ParameterInfo::integer("M", 2, 512, "d").range(), "2..512");
    EXPECT_EQ(ParameterInfo::integer("k", 1, ParameterInfo::kNoBound, "d").range(), ">= 1");
    EXPECT_EQ(ParameterInfo::integer("t", 1, 1e7, "d").also(-1).range(), "-1, or 1..10000000");
    EXPECT_EQ(ParameterInfo::integer("w", 0, 0, "d").also(8).range(), "0 or 8");
    EXPECT_EQ(ParameterInfo::real("delta", 0, 1, "d").open_min().open_max().range(), "(0, 1)");
    EXPECT_EQ(ParameterInfo::real("v", 0, 1, "d").range(), "[0, 1]");
    EXPECT_EQ(ParameterInfo::flag("g", "d").range(), "0 or 1");
    EXPECT_EQ(ParameterInfo::reported("chosen", "d").range(), "read-only");
    EXPECT_TRUE(ParameterInfo::integer("t", 1, 1e7, "d").also(-1).accepts(-1));
    EXPECT_FALSE(ParameterInfo::integer("t", 1, 1e7, "d").also(-1).accepts(0));
    EXPECT_FALSE(ParameterInfo::integer("t", 1, 1e7, "d").accepts(1.5));
    EXPECT_FALSE(ParameterInfo::real("delta", 0, 1, "d").open_min().accepts(0));
}

}  // namespace test_knobs
