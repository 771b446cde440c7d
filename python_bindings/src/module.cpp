// The compiled part of the kvindex package (kvindex/_kvindex); the package's
// __init__.py re-exports it and adds pickling.

#include <pybind11/pybind11.h>

#include <kvindex/errors.h>

#include "bindings.h"

namespace {

/** Raises `type` with kvindex::error_message(e) (the message without the
 * C++ location) and the location as the attribute `kvindex_location`. */
void raise_error(PyObject* type, const std::exception& e) {
    namespace py = pybind11;
    py::object exc = py::reinterpret_steal<py::object>(
            PyObject_CallFunction(type, "s", kvindex::error_message(e).c_str()));
    if (!exc) {
        return; // the call set its own error
    }
    exc.attr("kvindex_location") = py::str(kvindex::error_location(e));
    PyErr_SetObject(type, exc.ptr());
}

} // namespace

PYBIND11_MODULE(_kvindex, m) {
    m.doc() = "kvindex: the KV cache of a long-context LLM as a Faiss-style vector index";
    // The classes of kvindex/errors.h become the Python exceptions a user
    // expects; every message is the message alone (KVINDEX_ERROR_LOCATION=1
    // appends the C++ location, which `kvindex_location` always holds).
    pybind11::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) {
                std::rethrow_exception(p);
            }
        } catch (const kvindex::InvalidArgument& e) {
            raise_error(PyExc_ValueError, e);
        } catch (const kvindex::InvalidData& e) {
            raise_error(PyExc_ValueError, e);
        } catch (const kvindex::FileError& e) {
            // OSError(errno, strerror, filename): FileNotFoundError and
            // friends by errno, as open() raises them
            namespace py = pybind11;
            std::string reason = e.reason;
            const std::string where = kvindex::error_message(e).substr(kvindex::bare_error_message(e).size());
            py::object exc = py::reinterpret_steal<py::object>(
                    PyObject_CallFunction(PyExc_OSError, "iss", e.errno_value, (reason + where).c_str(), e.path.c_str()));
            if (exc) {
                exc.attr("kvindex_location") = py::str(kvindex::error_location(e));
                PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
            }
        } catch (const faiss::FaissException& e) {
            raise_error(PyExc_RuntimeError, e);
        }
    });
    kvpy::bind_index(m);
    kvpy::bind_cache(m);
    kvpy::bind_io(m);
}
