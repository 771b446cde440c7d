#pragma once

// numpy in, numpy out: the conversions and shape checks every binding uses,
// so that each method states its shapes once and errors read the same.

#include <cstdint>
#include <string>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

namespace kvpy {

namespace py = pybind11;

using FloatArray = py::array_t<float, py::array::c_style | py::array::forcecast>;
using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

/** obj as a C-contiguous float32 array, copied only when it is not one
 * already. float16 / float32 / float64 are accepted (faiss's wrappers
 * convert the same way); any other dtype raises TypeError naming `what`. */
FloatArray as_float_array(py::handle obj, const char* what);

/// obj as a C-contiguous int64 array; integer dtypes only (TypeError otherwise).
Int64Array as_int64_array(py::handle obj, const char* what);

/** Raises ValueError unless `a` has len(dims) dimensions and dims[i] (>= 0)
 * where given; -1 leaves a dimension free. `names` spells the expected
 * shape in the message, e.g. "(n, 64)": "keys must have shape (n, 64);
 * got (10, 32)". */
void check_shape(const py::array& a, const std::vector<py::ssize_t>& dims, const std::string& names,
                 const char* what);

/// "(10, 32)"
std::string shape_string(const py::array& a);

/// A new float32 array of this shape (C order), uninitialised.
FloatArray empty_float(const std::vector<py::ssize_t>& shape);

} // namespace kvpy
