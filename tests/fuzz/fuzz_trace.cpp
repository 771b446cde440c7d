// libFuzzer harness: the trace reader (trace.h), through files in a
// per-process temporary directory.
//
// Input: one selector byte, then
//   even selector: one .npy file                 -> read_npy
//   odd selector:  meta.json [SEP keys.npy [SEP values.npy [SEP queries.npy]]]
//                  (SEP = kTraceSeparator)       -> read_trace_meta, then
//                  read_trace_layer(dir, meta, 0) over the arrays present
// Exceptions are the right answer to bad files; crashes, sanitizer reports,
// leaks and OOM are bugs. What reads must have the sizes meta promises.

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include <kvindex/trace.h>

#include "fuzz_common.h"

namespace {

/// Separates the files of an odd-selector input (make_seeds.cpp writes it).
const std::string kTraceSeparator = "#KVFUZZ#";

void fuzz_npy(const uint8_t* data, size_t size) {
    std::string path = kvfuzz::temp_dir() + "/array.npy";
    kvfuzz::write_file(path, data, size);
    kvindex::NpyArray a;
    try {
        a = kvindex::read_npy(path);
    } catch (const std::exception&) {
        return;
    }
    size_t count = 1;
    for (size_t s : a.shape) {
        count *= s;
    }
    size_t es = a.dtype == "<f4" ? 4 : a.dtype == "<f2" ? 2 : a.dtype == "<i8" ? 8 : 0;
    if (es == 0 || count * es != a.data.size()) {
        kvfuzz::fail("read_npy", "dtype '" + a.dtype + "', " + std::to_string(count) +
                                         " elements, " + std::to_string(a.data.size()) + " bytes");
    }
}

void fuzz_trace_dir(const uint8_t* data, size_t size) {
    std::string in(reinterpret_cast<const char*>(data), size);
    std::vector<std::string> parts;
    size_t pos = 0;
    while (parts.size() < 3) {
        size_t sep = in.find(kTraceSeparator, pos);
        if (sep == std::string::npos) {
            break;
        }
        parts.push_back(in.substr(pos, sep - pos));
        pos = sep + kTraceSeparator.size();
    }
    parts.push_back(in.substr(pos));

    const std::string& dir = kvfuzz::temp_dir();
    std::string layer_dir = dir + "/layer_0";
    std::error_code ec;
    std::filesystem::create_directories(layer_dir, ec);
    auto put = [](const std::string& path, const std::string& bytes) {
        kvfuzz::write_file(path, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    };
    put(dir + "/meta.json", parts[0]);
    const char* names[3] = {"keys", "values", "queries"};
    for (size_t i = 0; i < 3; i++) {
        std::string path = layer_dir + "/" + names[i] + ".npy";
        if (i + 1 < parts.size()) {
            put(path, parts[i + 1]);
        } else {
            std::filesystem::remove(path, ec); // nothing left from an earlier input
        }
    }

    kvindex::TraceMeta meta;
    try {
        meta = kvindex::read_trace_meta(dir);
    } catch (const std::exception&) {
        return;
    }
    kvindex::TraceLayer t;
    try {
        t = kvindex::read_trace_layer(dir, meta, 0);
    } catch (const std::exception&) {
        return;
    }
    size_t kv = size_t(meta.n_kv_heads) * size_t(meta.n_tokens) * size_t(meta.head_dim);
    size_t q = size_t(meta.n_q_heads) * size_t(meta.n_tokens) * size_t(meta.head_dim);
    if (t.keys.size() != kv || t.values.size() != kv || t.queries.size() != q) {
        kvfuzz::fail("read_trace_layer", "array sizes disagree with meta.json");
    }
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) {
        return 0;
    }
    if ((data[0] & 1) == 0) {
        fuzz_npy(data + 1, size - 1);
    } else {
        fuzz_trace_dir(data + 1, size - 1);
    }
    return 0;
}
