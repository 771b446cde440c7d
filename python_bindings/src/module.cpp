// The compiled part of the kvindex package (kvindex/_kvindex); the package's
// __init__.py re-exports it and adds pickling.

#include <pybind11/pybind11.h>

#include <faiss/impl/FaissException.h>

#include "bindings.h"

PYBIND11_MODULE(_kvindex, m) {
    m.doc() = "kvindex: the KV cache of a long-context LLM as a Faiss-style vector index";
    // Faiss's exceptions derive from std::exception and would arrive as
    // RuntimeError anyway; registering keeps the message without a prefix.
    pybind11::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) {
                std::rethrow_exception(p);
            }
        } catch (const faiss::FaissException& e) {
            PyErr_SetString(PyExc_RuntimeError, e.what());
        }
    });
    kvpy::bind_index(m);
    kvpy::bind_cache(m);
    kvpy::bind_io(m);
}
