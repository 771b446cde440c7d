// libFuzzer harness: the GGUF reader of kvllm (benchmarks/llm/gguf.h).
//
// The input is written to a file of a per-process temporary directory and
// opened with GgufFile. A file that opens must answer every metadata lookup
// (a value or an exception for the wrong kind), find each of its tensors,
// and dequantize those of at most 1 << 20 elements (a bigger tensor is
// legitimately slow, not a bug). Exceptions are the right answer to a bad
// file; crashes, sanitizer reports, leaks and OOM are bugs.

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "gguf.h"

namespace {

constexpr int64_t kMaxDequantize = int64_t(1) << 20;

template <class F>
void may_throw(F&& f) {
    try {
        f();
    } catch (const std::exception&) {
    }
}

void exercise(const kvllm::GgufFile& g) {
    for (const auto& kv : g.metadata) {
        const std::string& key = kv.first;
        may_throw([&] { (void)g.get_int(key); });
        may_throw([&] { (void)g.get_real(key); });
        may_throw([&] { (void)g.get_string(key); });
        may_throw([&] { (void)g.get_strings(key); });
        may_throw([&] { (void)g.get_ints(key); });
    }
    may_throw([&] { (void)g.get_int("no.such.key"); });
    for (const kvllm::GgufTensor& t : g.tensors) {
        if (g.find_tensor(t.name) == nullptr) {
            kvfuzz::fail("find_tensor", "tensor '" + t.name + "' listed but not found");
        }
        (void)kvllm::ggml_type_name(t.type);
        int64_t n = t.n_elements();
        if (n <= kMaxDequantize) {
            may_throw([&] {
                std::vector<float> x = g.dequantize(t.name, t.shape);
                if (int64_t(x.size()) != n) {
                    kvfuzz::fail("dequantize", "tensor '" + t.name + "' size mismatch");
                }
            });
        }
    }
    may_throw([&] { (void)g.tensor("no.such.tensor"); });
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    std::string path = kvfuzz::temp_dir() + "/model.gguf";
    kvfuzz::write_file(path, data, size);
    try {
        kvllm::GgufFile g(path);
        exercise(g);
    } catch (const std::exception&) {
        // refused: the right answer
    }
    return 0;
}
