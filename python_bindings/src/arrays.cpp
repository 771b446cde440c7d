#include "arrays.h"

#include <cstring>

namespace kvpy {

namespace {

py::array as_array(py::handle obj, const char* what) {
    if (py::isinstance<py::array>(obj)) {
        return py::reinterpret_borrow<py::array>(obj);
    }
    if (is_torch_tensor(obj)) {
        return torch_as_numpy(obj, what);
    }
    py::array a = py::array::ensure(obj); // null (error cleared) when not array-like
    if (!a) {
        throw py::type_error(std::string(what) + " must be a numpy array (or array-like); got " +
                             std::string(py::str(py::type::of(obj).attr("__name__"))));
    }
    return a;
}

} // namespace

bool is_torch_tensor(py::handle obj) {
    // by its type, without importing torch: a caller that has a tensor has
    // imported it already, and one that has not must not pay for it
    PyTypeObject* t = Py_TYPE(obj.ptr());
    for (; t != nullptr; t = t->tp_base) {
        if (std::strcmp(t->tp_name, "Tensor") == 0 || std::strcmp(t->tp_name, "torch.Tensor") == 0) {
            py::object module = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(t)).attr("__module__");
            return std::string(py::str(module)).rfind("torch", 0) == 0;
        }
    }
    return false;
}

py::array torch_as_numpy(py::handle tensor, const char* what) {
    py::object t = py::reinterpret_borrow<py::object>(tensor).attr("detach")();
    const std::string device = py::str(t.attr("device").attr("type"));
    if (device != "cpu") {
        throw py::type_error(std::string(what) + " is a torch tensor on '" + device +
                             "': the kvindex Python package runs the CPU index types, which take CPU tensors "
                             "(move it with .cpu())");
    }
    const std::string dtype = py::str(t.attr("dtype"));
    if (dtype == "torch.bfloat16") {
        // numpy has no bfloat16: its bits, as int16, which as_float_array
        // widens (exactly) in C++
        return py::reinterpret_steal<py::array>(
                t.attr("view")(py::module_::import("torch").attr("int16")).attr("numpy")().release());
    }
    return py::reinterpret_steal<py::array>(t.attr("numpy")().release()); // shares the tensor's memory
}

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
    const bool bfloat16 = is_torch_tensor(obj) && std::string(py::str(obj.attr("dtype"))) == "torch.bfloat16";
    py::array a = as_array(obj, what);
    if (bfloat16) {
        // a bfloat16 is the top half of a float32: widened exactly, GIL released
        auto bits = py::array_t<uint16_t, py::array::c_style | py::array::forcecast>::ensure(a);
        FloatArray r(std::vector<py::ssize_t>(a.shape(), a.shape() + a.ndim()));
        const uint16_t* in = bits.data();
        float* out = r.mutable_data();
        const size_t n = size_t(bits.size());
        py::gil_scoped_release release;
        for (size_t i = 0; i < n; i++) {
            const uint32_t w = uint32_t(in[i]) << 16;
            std::memcpy(out + i, &w, 4);
        }
        return r;
    }
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
