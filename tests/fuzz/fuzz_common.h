#pragma once

// Helpers shared by the libFuzzer harnesses and the seed generator.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include <omp.h>

#include <kvindex/KVIndex.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>

#include "../forged_header.h"

namespace kvfuzz {

// the header forging of the io tests (size and CRC-32 made to agree)
using kvtest::forge_header;

/// Deterministic finite values in [-scale, scale] (a fixed LCG).
inline std::vector<float> det_floats(size_t n, uint32_t seed, float scale = 1.0f) {
    std::vector<float> v(n);
    uint32_t s = seed * 2654435761u + 12345u;
    for (size_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        v[i] = scale * (float(s >> 8) / float(1u << 24) * 2.0f - 1.0f);
    }
    return v;
}

/// Aborts with a message: a contract violation the sanitizers cannot see.
[[noreturn]] inline void fail(const char* what, const std::string& detail) {
    std::fprintf(stderr, "FUZZ CONTRACT VIOLATION: %s: %s\n", what, detail.c_str());
    std::abort();
}

/// What the library wrote must read back: same factory string, type and
/// size. Aborts (a contract violation) otherwise; `when` names the moment.
inline void expect_round_trip(const kvindex::KVIndex& index, const char* when) {
    std::string fs = kvindex::index_factory_string(&index); // storage prefix included
    std::vector<uint8_t> buf;
    std::unique_ptr<kvindex::KVIndex> back;
    try {
        kvindex::write_index(&index, &buf);
        back = kvindex::read_index(buf);
    } catch (const std::exception& e) {
        fail("write_index / read_index round trip", fs + " (" + when + "): " + e.what());
    }
    if (kvindex::index_factory_string(back.get()) != fs || back->ntotal != index.ntotal ||
        std::strcmp(back->type_name(), index.type_name()) != 0) {
        fail("write_index / read_index round trip",
             fs + " (" + when + ") read back as " + kvindex::index_factory_string(back.get()));
    }
}

/// One OpenMP thread: deterministic runs, and faster on small inputs.
inline void single_thread() {
    omp_set_num_threads(1);
}

/// A directory of this process for the harnesses that read files, removed
/// at exit (left behind only when the process dies on a finding).
inline const std::string& temp_dir() {
    struct Dir {
        std::string path;
        Dir() {
            const char* base = std::getenv("TMPDIR");
            std::string tmpl =
                    std::string(base && *base ? base : "/tmp") + "/kvindex_fuzz_XXXXXX";
            std::vector<char> buf(tmpl.begin(), tmpl.end());
            buf.push_back('\0');
            if (!mkdtemp(buf.data())) {
                std::perror("mkdtemp");
                std::abort();
            }
            path = buf.data();
        }
        ~Dir() {
            std::error_code ec;
            std::filesystem::remove_all(path, ec);
        }
    };
    static const Dir dir;
    return dir.path;
}

inline void write_file(const std::string& path, const uint8_t* data, size_t size) {
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f) {
        std::perror(path.c_str());
        std::abort();
    }
    if (size > 0 && std::fwrite(data, 1, size, f) != size) {
        std::perror(path.c_str());
        std::abort();
    }
    std::fclose(f);
}

} // namespace kvfuzz
