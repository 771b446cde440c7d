#pragma once

// The parts of the module, each in its own file, and what they share.

#include <memory>

#include <pybind11/pybind11.h>

#include <kvindex/KVIndex.h>

#include "arrays.h"

namespace kvpy {

void bind_index(py::module_& m); ///< KVIndex, the index types, factory, parameters
void bind_cache(py::module_& m); ///< KVCache
void bind_io(py::module_& m);    ///< io, registry, RoPE, traces

/** The per-call search parameters of `params` (None, "name=value,..." or a
 * dict) for this index: nullptr for None; ValueError for a name that is
 * not one of the index's search-time parameters. */
std::unique_ptr<faiss::SearchParameters> call_parameters(const kvindex::KVIndex& index, py::handle params);

} // namespace kvpy
