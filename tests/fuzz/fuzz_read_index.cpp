// libFuzzer harness: kvindex::read_index from memory.
//
// The input is a saved index (seeds: make_seeds.cpp). Its header's payload
// size and CRC are rewritten to match the bytes that follow, so mutations
// reach the record parser instead of stopping at the checksum. A clear
// exception is the right answer to a bad file; crashes, sanitizer reports,
// leaks and OOM are bugs. An index that reads must pass its invariants,
// answer a small search / attend with labels in range, and survive a
// write_index / read_index round trip.

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>

#include "fuzz_common.h"

using kvindex::idx_t;

namespace {

void exercise(const kvindex::KVIndex& index) {
    index.check_invariants();
    (void)index.type_name();
    std::string fs = index.factory_string();
    (void)index.memory_bytes();
    (void)index.top_k_budget();
    for (const kvindex::ParameterInfo& p : kvindex::index_parameter_info(&index)) {
        (void)kvindex::get_index_parameter(&index, p.name);
    }

    kvfuzz::expect_round_trip(index, "read"); // what reads must write and read back

    if (index.ntotal > 0) {
        idx_t k = std::min<idx_t>(3, index.ntotal);
        std::vector<float> q = kvfuzz::det_floats(size_t(index.d), 7);
        std::vector<float> dist(k);
        std::vector<idx_t> labels(k);
        index.search(1, q.data(), k, dist.data(), labels.data());
        for (idx_t l : labels) {
            if (l < -1 || l >= index.ntotal) {
                kvfuzz::fail("search", fs + " returned label " + std::to_string(l) +
                                               " with ntotal " + std::to_string(index.ntotal));
            }
        }
        kvindex::Selection sel;
        index.select(1, q.data(), &sel);
        for (idx_t l : sel.ids) {
            if (l < 0 || l >= index.ntotal) {
                kvfuzz::fail("select", fs + " selected token " + std::to_string(l) +
                                               " with ntotal " + std::to_string(index.ntotal));
            }
        }
        std::vector<float> out(size_t(index.d_value));
        float lse = 0;
        index.attend(1, q.data(), out.data(), &lse);
        std::vector<float> rec(size_t(std::max(index.d, index.d_value)));
        index.reconstruct(0, rec.data());
        index.reconstruct_value(index.ntotal - 1, rec.data());
    }
}

} // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    kvfuzz::single_thread();
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    std::vector<uint8_t> buf(data, data + size);
    kvfuzz::forge_header(buf);
    std::unique_ptr<kvindex::KVIndex> index;
    try {
        index = kvindex::read_index(buf.data(), buf.size());
    } catch (const std::exception&) {
        return 0; // refused: the right answer
    }
    try {
        exercise(*index);
    } catch (const std::exception&) {
        // an index that passed the reader may still refuse a call with an
        // exception (e.g. a forged key of 1e38 overflowing); not a crash
    }
    return 0;
}
