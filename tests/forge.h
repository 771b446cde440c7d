#pragma once

// Forging saved indexes for the io tests: a CRC-32 written independently of
// src/io.cpp, and a header rewritten to agree with a corrupted payload, so
// that the reader has to catch the corruption by parsing.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <kvindex/KVIndex.h>
#include <kvindex/impl/io.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/parameters.h>
#include <kvindex/registry.h>

#include "forged_header.h"

namespace kvtest {

/** The file write_index would save for `index`, without the checks the
 * writer runs first (check_invariants): how the io tests turn an index
 * broken in memory into the record a forger would write, which the
 * reader must refuse. The outer record is written here from the payload
 * grammar of index_io.h, independently of src/index_io.cpp; the type's
 * own fields through its write_fields (inner records stay checked). */
inline std::vector<uint8_t> write_unchecked(const kvindex::KVIndex* index) {
    // the frame's magic and format version, as the library writes them
    std::vector<uint8_t> buf;
    kvindex::write_index(kvindex::index_factory(4, "Flat").get(), &buf);
    buf.resize(kIndexHeaderSize);
    kvindex::BufferWriter w(&buf);
    kvindex::IndexTypeInfo t = kvindex::index_type_of(index);
    w.value<uint32_t>(t.fourcc);
    w.value<uint32_t>(t.record_version);
    w.value<int32_t>(index->d);
    w.value<int32_t>(index->d_value);
    w.value<int64_t>(index->ntotal);
    w.value<int64_t>(index->k);
    w.value<uint8_t>(uint8_t(index->estimator));
    w.value<uint8_t>(index->has_rope);
    w.value<double>(index->rope.theta);
    w.value<uint8_t>(uint8_t(index->rope.style));
    w.value<uint8_t>(uint8_t(index->kv_type));
    index->write_fields(w);
    forge_header(buf);
    return buf;
}

/// Every knob of `knobs` ("a=1,b=2") reads back with its value.
inline void expect_knobs(
        const kvindex::KVIndex* index, const std::string& knobs, const std::string& what) {
    size_t pos = 0;
    while (pos < knobs.size()) {
        size_t end = std::min(knobs.find(',', pos), knobs.size());
        std::string item = knobs.substr(pos, end - pos);
        size_t eq = item.find('=');
        EXPECT_EQ(kvindex::get_index_parameter(index, item.substr(0, eq)),
                  std::stod(item.substr(eq + 1)))
                << what << ": " << item;
        pos = end + 1;
    }
}

} // namespace kvtest
