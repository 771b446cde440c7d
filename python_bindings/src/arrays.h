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
 * convert the same way); any other dtype raises TypeError naming `what`.
 * A CPU torch tensor is read in place where it is a contiguous float32
 * (through the numpy view of its memory), converted where it is float16,
 * float64 or bfloat16 (a bfloat16 widened exactly from its bits). */
FloatArray as_float_array(py::handle obj, const char* what);

/// Whether obj is a torch.Tensor, judged by its type: torch is not imported.
bool is_torch_tensor(py::handle obj);

/** A CPU torch tensor as a numpy array sharing its memory (bfloat16 as its
 * int16 bits); TypeError for a tensor on another device. */
py::array torch_as_numpy(py::handle tensor, const char* what);

/// obj as a C-contiguous int64 array; integer dtypes only (TypeError otherwise).
Int64Array as_int64_array(py::handle obj, const char* what);

/// One expected dimension of check_shape: a size, or the name of a free one.
struct Dim {
    py::ssize_t size = -1;      ///< required size, -1 when free
    const char* name = nullptr; ///< how a free dimension reads in errors
    Dim(py::ssize_t s) : size(s) {}
    Dim(const char* n) : name(n) {}
};

/** Raises ValueError unless `a` has dims.size() dimensions of the given
 * sizes (named dimensions are free): check_shape(keys, {"n", 64}, "keys")
 * reads "keys must have shape (n, 64); got (10, 32)". */
void check_shape(const py::array& a, std::initializer_list<Dim> dims, const char* what);

/// "(10, 32)"
std::string shape_string(const py::array& a);

/// A new float32 array of this shape (C order), uninitialised.
FloatArray empty_float(const std::vector<py::ssize_t>& shape);

/** h as a T (an int, a float, a list of ints, a str), or TypeError naming
 * `what` and the type given: pybind11's own cast error names neither. */
template <class T>
T cast_arg(py::handle h, const std::string& what) {
    try {
        return h.cast<T>();
    } catch (const py::cast_error&) {
        throw py::type_error(what + ": cannot read a " +
                             std::string(py::str(py::type::handle_of(h).attr("__name__"))) + " (" +
                             std::string(py::repr(h)) + ") here");
    }
}

} // namespace kvpy
