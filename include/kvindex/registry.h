#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kvindex/KVIndex.h>

/* The registry: one row per index type. The factory parses through it, io
 * finds a record's type by its fourcc, and the tools and bindings list the
 * types from it. The built-in rows are one explicit table
 * (index/registry.cpp), not self-registration: a static library would drop
 * registrars nothing references. A library that adds types (the GPU one, the
 * Python module, a user's) calls register_index_type with its rows.
 */

namespace kvindex {

struct FactoryChain;

/// Tag of an io record: four characters, little-endian.
constexpr uint32_t fourcc(const char (&s)[5]) {
    return uint32_t(uint8_t(s[0])) | uint32_t(uint8_t(s[1])) << 8 |
            uint32_t(uint8_t(s[2])) << 16 | uint32_t(uint8_t(s[3])) << 24;
}

/// One index type as the factory, io and tools know it.
struct IndexTypeInfo {
    /// class name, equal to the type's KVIndex::type_name()
    std::string name;
    /// tag of its io records
    uint32_t fourcc = 0;
    /// version of the records this build writes; it reads 1 .. record_version
    uint32_t record_version = 1;
    /// the factory elements it parses, as documentation and in errors
    std::string grammar;
    /// what it does, one line
    std::string doc;
    /** Parses the element at the chain's cursor (index_factory.h); returns
     * nullptr, consuming nothing, when the element is not this type's. */
    std::unique_ptr<KVIndex> (*parse)(FactoryChain& chain) = nullptr;
    /// An empty index of this type, for read_index to fill (read_fields).
    std::unique_ptr<KVIndex> (*make_empty)() = nullptr;
    /// Factory strings that build it, one per variant whose knobs differ
    /// (docs/reference.md lists the knobs and their defaults from these)
    std::vector<std::string> examples;
};

/// Every registered type: the built-in rows, then the added ones, in order
/// (the factory tries parsers in this order).
std::vector<IndexTypeInfo> index_types();

/// The row of a type name; throws naming it when unregistered.
IndexTypeInfo index_type(const std::string& name);

/// The row of an index's concrete type (by type_name()).
IndexTypeInfo index_type_of(const KVIndex* index);

/// The row whose records carry this tag, or false.
bool find_index_type(uint32_t fourcc, IndexTypeInfo* row);

/// Adds a row; throws if its name or fourcc is taken, or a field is missing.
void register_index_type(const IndexTypeInfo& row);

} // namespace kvindex
