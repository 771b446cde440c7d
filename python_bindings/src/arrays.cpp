#include "arrays.h"

namespace kvpy {

namespace {

py::array as_array(py::handle obj, const char* what) {
    if (py::isinstance<py::array>(obj)) {
        return py::reinterpret_borrow<py::array>(obj);
    }
    py::array a = py::array::ensure(obj); // null (error cleared) when not array-like
    if (!a) {
        throw py::type_error(std::string(what) + " must be a numpy array (or array-like); got " +
                             std::string(py::str(py::type::of(obj).attr("__name__"))));
    }
    return a;
}

} // namespace

std::string shape_string(const py::array& a) {
    std::string s = "(";
    for (py::ssize_t i = 0; i < a.ndim(); i++) {
        s += (i ? ", " : "") + std::to_string(a.shape(i));
    }
    return s + (a.ndim() == 1 ? ",)" : ")");
}

namespace {

/// array_t::ensure returns a null array and clears numpy's error when the
/// converted copy cannot be made (no memory for it): ask numpy again, so
/// that its own exception (MemoryError) reaches the caller.
[[noreturn]] void raise_conversion_error(const py::array& a, const char* dtype, const char* what) {
    py::module_::import("numpy").attr("ascontiguousarray")(a, dtype);
    throw py::value_error(std::string(what) + " could not be converted to a contiguous " + dtype +
                          " array");
}

} // namespace

FloatArray as_float_array(py::handle obj, const char* what) {
    py::array a = as_array(obj, what);
    char kind = a.dtype().kind();
    if (kind != 'f' || (a.itemsize() != 2 && a.itemsize() != 4 && a.itemsize() != 8)) {
        throw py::type_error(std::string(what) + " must be a float16, float32 or float64 array; got dtype " +
                             std::string(py::str(a.dtype())));
    }
    FloatArray r = FloatArray::ensure(a); // no copy when already C-contiguous float32
    if (!r) {
        raise_conversion_error(a, "float32", what);
    }
    return r;
}

Int64Array as_int64_array(py::handle obj, const char* what) {
    py::array a = as_array(obj, what);
    char kind = a.dtype().kind();
    if (kind != 'i' && kind != 'u') {
        throw py::type_error(std::string(what) + " must be an integer array; got dtype " +
                             std::string(py::str(a.dtype())));
    }
    Int64Array r = Int64Array::ensure(a);
    if (!r) {
        raise_conversion_error(a, "int64", what);
    }
    return r;
}

void check_shape(const py::array& a, std::initializer_list<Dim> dims, const char* what) {
    bool ok = a.ndim() == py::ssize_t(dims.size());
    py::ssize_t i = 0;
    std::string want = "(";
    for (const Dim& dim : dims) {
        ok = ok && (dim.name || a.shape(i) == dim.size);
        want += (i++ ? ", " : "") + (dim.name ? std::string(dim.name) : std::to_string(dim.size));
    }
    if (!ok) {
        want += dims.size() == 1 ? ",)" : ")";
        throw py::value_error(std::string(what) + " must have shape " + want + "; got " + shape_string(a));
    }
}

FloatArray empty_float(const std::vector<py::ssize_t>& shape) {
    return FloatArray(shape);
}

} // namespace kvpy
