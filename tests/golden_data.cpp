#include "golden_data.h"

#include <algorithm>
#include <cstdio>

#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>
#include <kvindex/registry.h>

#include "conformance_list.h"
#include "reference.h"

namespace kvgolden {

std::unique_ptr<kvindex::KVIndex> build_golden_index(
        const std::string& factory, const std::string& knobs) {
    auto index = kvindex::index_factory(kDim, factory, kDimValue);
    idx_t n = kPrefill + kDecode;
    std::vector<float> keys = kvtest::gaussian(n, kDim, 11, 1.0f, 0.3f);
    std::vector<float> values = kvtest::gaussian(n, kDimValue, 12);
    std::vector<float> queries = kvtest::gaussian(kGroup * kPrefill, kDim, 13, 1.5f);
    kvindex::PrefillInput in;
    in.n_tokens = kPrefill;
    in.keys = keys.data();
    in.values = values.data();
    in.n_queries = kPrefill;
    in.n_query_heads = kGroup;
    in.queries = queries.data();
    in.rope.theta = 500000.0;
    in.rope.style = kvindex::RopeStyle::interleaved;
    index->prefill(in);
    // each decode step's query heads, learnt once answered (RoarGraph's anchors)
    std::vector<float> decode_queries = kvtest::gaussian(kGroup * kDecode, kDim, 15, 1.5f);
    for (idx_t i = kPrefill; i < n; i++) {
        index->add_kv(1, keys.data() + i * kDim, values.data() + i * kDimValue);
        index->add_queries(kGroup, decode_queries.data() + (i - kPrefill) * kGroup * kDim);
    }
    if (!knobs.empty()) {
        kvindex::set_index_parameters(index.get(), knobs);
    }
    return index;
}

std::vector<float> golden_queries() {
    return kvtest::gaussian(kQueries, kDim, 14, 2.0f);
}

Answers answer(const kvindex::KVIndex* index, const std::vector<float>& q) {
    Answers a;
    idx_t nq = idx_t(q.size()) / index->d;
    a.labels.resize(nq * kSearchK);
    a.distances.resize(nq * kSearchK);
    index->search(nq, q.data(), kSearchK, a.distances.data(), a.labels.data());
    a.out.resize(nq * index->d_value);
    a.lse.resize(nq);
    index->attend(nq, q.data(), a.out.data(), a.lse.data());
    return a;
}

std::string golden_stem(size_t i, const std::string& factory) {
    char num[8];
    std::snprintf(num, sizeof(num), "%02zu_", i);
    return num + kvtest::factory_identifier(factory.c_str());
}

std::string golden_version_key(const std::string& factory) {
    std::string key = std::to_string(kvindex::kIndexFormatVersion);
    std::vector<const kvindex::KVIndex*> todo;
    auto root = kvindex::index_factory(kDim, factory, kDimValue);
    todo.push_back(root.get());
    std::vector<std::string> seen;
    while (!todo.empty()) {
        const kvindex::KVIndex* x = todo.back();
        todo.pop_back();
        kvindex::IndexTypeInfo row = kvindex::index_type_of(x);
        std::string name = row.name.rfind("Index", 0) == 0 ? row.name.substr(5) : row.name;
        if (row.record_version > 1 && std::find(seen.begin(), seen.end(), name) == seen.end()) {
            seen.push_back(name);
            key += "+" + name + ".v" + std::to_string(row.record_version);
        }
        for (const kvindex::KVIndex* c : x->children()) {
            todo.push_back(c);
        }
    }
    return key;
}

} // namespace kvgolden
