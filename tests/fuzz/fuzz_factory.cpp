// libFuzzer harness: kvindex::index_factory strings ("STRING|params").
//
// Every string the factory accepts must: build again from its own
// factory_string() (same type and string), take a small deterministic KV set
// (prefill + decode), answer a small search / select / attend with labels in
// range, and survive a write_index / read_index round trip, empty and full.
// Exceptions are the right answer to a bad string or a refused prefill;
// crashes, sanitizer reports, leaks and OOM are bugs.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>

#include "fuzz_common.h"

using kvindex::idx_t;

namespace {

constexpr int kD = 8;
constexpr int kDValue = 8;
constexpr idx_t kPrefill = 64;
constexpr idx_t kDecode = 8;
constexpr size_t kMaxInput = 256;

void fill_and_query(kvindex::KVIndex& index) {
    const idx_t n = kPrefill + kDecode;
    std::vector<float> keys = kvfuzz::det_floats(size_t(n * kD), 1);
    std::vector<float> values = kvfuzz::det_floats(size_t(n * kDValue), 2);
    std::vector<float> queries = kvfuzz::det_floats(size_t(kPrefill * kD), 3, 1.5f);
    kvindex::PrefillInput in;
    in.n_tokens = kPrefill;
    in.keys = keys.data();
    in.values = values.data();
    in.n_queries = kPrefill;
    in.n_query_heads = 1;
    in.queries = queries.data();
    index.prefill(in);
    for (idx_t i = kPrefill; i < n; i++) {
        index.add_kv(1, keys.data() + i * kD, values.data() + i * kDValue);
    }
    kvfuzz::expect_round_trip(index, "filled");

    const idx_t nq = 2;
    std::vector<float> q = kvfuzz::det_floats(size_t(nq * kD), 4, 2.0f);
    if (index.ntotal > 0) {
        idx_t k = std::min<idx_t>(3, index.ntotal);
        std::vector<float> dist(size_t(nq * k));
        std::vector<idx_t> labels(size_t(nq * k));
        index.search(nq, q.data(), k, dist.data(), labels.data());
        for (idx_t l : labels) {
            if (l < -1 || l >= index.ntotal) {
                kvfuzz::fail("search", index.factory_string() + " returned label " +
                                               std::to_string(l));
            }
        }
    }
    std::vector<kvindex::Selection> sel(nq);
    index.select(nq, q.data(), sel.data());
    for (const kvindex::Selection& s : sel) {
        for (idx_t l : s.ids) {
            if (l < 0 || l >= index.ntotal) {
                kvfuzz::fail("select", index.factory_string() + " selected token " +
                                               std::to_string(l));
            }
        }
    }
    std::vector<float> out(size_t(nq * kDValue)), lse(nq);
    index.attend(nq, q.data(), out.data(), lse.data());
}

} // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
    kvfuzz::single_thread();
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size > kMaxInput) {
        return 0; // long strings only repeat what short ones test
    }
    std::string s(reinterpret_cast<const char*>(data), size);
    std::unique_ptr<kvindex::KVIndex> index;
    try {
        index = kvindex::index_factory(kD, s, kDValue);
    } catch (const std::exception&) {
        return 0; // refused: the right answer
    }
    if (!index) {
        kvfuzz::fail("index_factory", "'" + s + "' returned nullptr");
    }

    // the canonical string builds the same structure
    std::string fs = kvindex::index_factory_string(index.get()); // storage prefix included
    std::unique_ptr<kvindex::KVIndex> again;
    try {
        again = kvindex::index_factory(kD, fs, kDValue);
    } catch (const std::exception& e) {
        kvfuzz::fail("factory_string round trip",
                     "'" + s + "' prints as '" + fs + "', which does not build: " + e.what());
    }
    if (kvindex::index_factory_string(again.get()) != fs ||
        std::strcmp(again->type_name(), index->type_name()) != 0) {
        kvfuzz::fail("factory_string round trip",
                     "'" + s + "' prints as '" + fs + "', which builds '" +
                             kvindex::index_factory_string(again.get()) + "' (" +
                             again->type_name() + ")");
    }
    kvfuzz::expect_round_trip(*index, "empty");

    try {
        fill_and_query(*index);
    } catch (const std::exception&) {
        // e.g. a retriever that cannot train on 64 keys: refused clearly.
        // The index must stay usable (or refuse clearly) after a throw.
        try {
            index->check_invariants();
            std::vector<float> q = kvfuzz::det_floats(kD, 5);
            std::vector<float> out(kDValue);
            float lse;
            index->attend(1, q.data(), out.data(), &lse);
            std::vector<uint8_t> buf;
            kvindex::write_index(index.get(), &buf);
            (void)kvindex::read_index(buf);
        } catch (const std::exception&) {
        }
    }
    return 0;
}
