#pragma once

// The parts of the module, each in its own file, and what they share.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>

#include <kvindex/KVIndex.h>
#include <kvindex/errors.h>

#include "arrays.h"

namespace kvpy {

void bind_index(py::module_& m); ///< KVIndex, the index types, factory, parameters
void bind_cache(py::module_& m); ///< KVCache
void bind_io(py::module_& m);    ///< io, registry, RoPE, traces

/** f() as a const call on `index` under its thread-safety check
 * (kvindex::ReadScope). The module releases the GIL for writes, so an
 * accessor that copies or walks an index's containers (a graph, the
 * centroids, a Choose's candidates) while another thread's write
 * reallocates them would read freed memory: guarded, it raises
 * RuntimeError instead, and a write that starts meanwhile is refused, as
 * for search and attend. */
template <class F>
auto read_guarded(const kvindex::KVIndex& index, const char* what, F&& f) {
    kvindex::ReadScope scope(index, what);
    return f();
}

/** f() for a constructor: an error the library throws there is the
 * arguments' (a dimension, K and L, M, C), so it reaches Python as
 * ValueError (kvindex/errors.h). */
template <class F>
auto constructed(F&& f) {
    return kvindex::classify_errors<kvindex::InvalidArgument>(std::forward<F>(f));
}

/** The per-call search parameters of `params` (None, "name=value,..." or a
 * dict) for this index: nullptr for None; ValueError for a name that is
 * not a per-call knob the index reads (KVIndex::reads_search_knob). */
std::unique_ptr<faiss::SearchParameters> call_parameters(const kvindex::KVIndex& index, py::handle params);

/// The same for a call handed to several indexes (the layers of a cache):
/// each name must be a search-time parameter of one of them; `what` names
/// them in the message.
std::unique_ptr<faiss::SearchParameters> call_parameters(
        const std::vector<const kvindex::KVIndex*>& readers, const std::string& what, py::handle params);

} // namespace kvpy
