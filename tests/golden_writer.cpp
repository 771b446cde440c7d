// Writes the golden files the tests read back (tests/data/golden):
//
//   ./build/tests/kvindex_golden_writer tests/data/golden
//
// For every string of the conformance list it adds what is missing: the
// saved index in this build's format version (<stem>.f<version>.kvix) and,
// for a string seen for the first time, its answers in golden.json. Files
// already there are never rewritten: they are what old versions wrote.
// Run it when a type joins the conformance list, the format version moves
// or a type's record version moves (golden_version_key).

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <omp.h>

#include <nlohmann/json.hpp>

#include <kvindex/index_io.h>

#include "conformance_list.h"
#include "golden_data.h"

using namespace kvgolden;

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    // Faiss builds HNSW graphs in parallel: one thread makes them reproducible
    omp_set_num_threads(1);
    std::string dir = argv[1];
    std::filesystem::create_directories(dir);
    std::string manifest = dir + "/golden.json";
    nlohmann::json j;
    if (std::filesystem::exists(manifest)) {
        std::ifstream(manifest) >> j;
    } else {
        j["d"] = kDim;
        j["d_value"] = kDimValue;
        j["search_k"] = kSearchK;
        j["queries"] = golden_queries();
        j["indexes"] = nlohmann::json::object();
    }
    std::vector<float> q = j["queries"].get<std::vector<float>>();
    size_t i = 0;
    for (const auto& c : kvtest::kConformance) {
        const std::string version = golden_version_key(c.factory);
        std::string stem = golden_stem(i++, c.factory);
        nlohmann::json& e = j["indexes"][c.factory];
        auto index = build_golden_index(c.factory, c.knobs);
        if (e.is_null()) {
            Answers a = answer(index.get(), q);
            e["knobs"] = c.knobs;
            e["labels"] = a.labels;
            e["distances"] = a.distances;
            e["out"] = a.out;
            e["lse"] = a.lse;
            e["files"] = nlohmann::json::object();
        }
        if (!e["files"].contains(version)) {
            std::string file = stem + ".f" + version + ".kvix";
            // a version bump of a string already saved writes what today's
            // writer makes of the saved index (the golden test reads every
            // old file and expects exactly these bytes back), not a new
            // build: a build can differ in fields like training seconds
            std::string newest;
            for (auto& [v, name] : e["files"].items()) {
                newest = name.get<std::string>(); // keys sort by version
            }
            if (!newest.empty()) {
                index = kvindex::read_index(dir + "/" + newest);
            }
            kvindex::write_index(index.get(), dir + "/" + file);
            e["files"][version] = file;
            std::printf("wrote %s\n", file.c_str());
        }
    }
    std::ofstream(manifest) << j.dump(1) << "\n";
    return 0;
}
