#pragma once

// Kernel tests run once per SIMD level this CPU has (kernels.h), each
// compared with the same reference.

#include <string>

#include <gtest/gtest.h>

#include <kvindex/kernels.h>

namespace kvtest {

/// A parameterised test body runs at the level GetParam(); the level in use
/// before is restored after, whatever the test does.
class SimdLevelTest : public ::testing::TestWithParam<kvindex::SimdLevel> {
   protected:
    void SetUp() override {
        saved_ = kvindex::get_simd_level();
        kvindex::set_simd_level(GetParam());
    }
    void TearDown() override {
        kvindex::set_simd_level(saved_);
    }
    kvindex::SimdLevel saved_ = kvindex::SimdLevel::generic;
};

inline std::string simd_level_test_name(
        const ::testing::TestParamInfo<kvindex::SimdLevel>& info) {
    return kvindex::simd_level_name(info.param);
}

} // namespace kvtest

/// Instantiates a SimdLevelTest fixture at every level the CPU runs.
#define KVTEST_AT_EVERY_SIMD_LEVEL(fixture)                                   \
    INSTANTIATE_TEST_SUITE_P(                                                \
            AllLevels,                                                       \
            fixture,                                                         \
            ::testing::ValuesIn(kvindex::available_simd_levels()),           \
            kvtest::simd_level_test_name)
