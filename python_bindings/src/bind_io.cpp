// io (files, bytes), the registry, RoPE helpers and trace files.

#include <cstring>
#include <string>
#include <vector>

#include <pybind11/stl.h>

#include <kvindex/KVCache.h>
#include <kvindex/blas_threads.h>
#include <kvindex/index_io.h>
#include <kvindex/registry.h>
#include <kvindex/rope.h>
#include <kvindex/trace.h>

#include "arrays.h"
#include "bindings.h"

namespace kvpy {

using kvindex::idx_t;
using kvindex::KVIndex;

namespace {

std::string fourcc_string(uint32_t f) {
    std::string s(4, ' ');
    for (int i = 0; i < 4; i++) {
        s[i] = char((f >> (8 * i)) & 0xff);
    }
    return s;
}

/// The bytes of a contiguous 1-d uint8 buffer (bytes, bytearray, numpy);
/// info keeps them alive.
const uint8_t* byte_data(const py::buffer_info& info, const char* what) {
    if (info.ndim != 1 || info.itemsize != 1 || (info.ndim == 1 && info.strides[0] != 1)) {
        throw py::value_error(std::string(what) +
                              ": expected a contiguous 1-d uint8 buffer (bytes, bytearray or "
                              "numpy uint8 array); got " + std::to_string(info.ndim) + "-d of " +
                              std::to_string(info.itemsize) + "-byte items");
    }
    return static_cast<const uint8_t*>(info.ptr);
}

py::array_t<uint8_t> as_numpy_bytes(const std::vector<uint8_t>& buf) {
    py::array_t<uint8_t> a(std::vector<py::ssize_t>{py::ssize_t(buf.size())});
    std::memcpy(a.mutable_data(), buf.data(), buf.size());
    return a;
}

/// buf's buffer (bytes, bytearray, numpy, a CPU torch tensor).
py::buffer_info request_bytes(py::object buf, const char* what) {
    if (is_torch_tensor(buf)) {
        buf = torch_as_numpy(buf, what);
    }
    return py::reinterpret_borrow<py::buffer>(buf).request();
}

std::shared_ptr<KVIndex> deserialize(py::object buf) {
    py::buffer_info info = request_bytes(buf, "deserialize_index");
    const uint8_t* data = byte_data(info, "deserialize_index");
    py::gil_scoped_release release;
    return std::shared_ptr<KVIndex>(kvindex::read_index(data, size_t(info.size)));
}

std::unique_ptr<kvindex::KVCache> deserialize_cache(py::object buf) {
    py::buffer_info info = request_bytes(buf, "deserialize_cache");
    const uint8_t* data = byte_data(info, "deserialize_cache");
    py::gil_scoped_release release;
    return kvindex::read_cache(data, size_t(info.size));
}

FloatArray rope(py::handle x, py::handle positions, double theta, const std::string& style, bool invert) {
    FloatArray in = as_float_array(x, "x");
    check_shape(in, {"n", "d"}, "x");
    Int64Array pos = as_int64_array(positions, "positions");
    check_shape(pos, {in.shape(0)}, "positions");
    kvindex::RopeParams p{theta, kvindex::rope_style_from_name(style)};
    kvindex::check_rope_params(p, int(in.shape(1)));
    FloatArray out({in.shape(0), in.shape(1)});
    std::memcpy(out.mutable_data(), in.data(), sizeof(float) * size_t(in.size()));
    py::gil_scoped_release release;
    const auto* pp = reinterpret_cast<const int64_t*>(pos.data());
    if (invert) {
        kvindex::invert_rope(in.shape(0), int(in.shape(1)), out.mutable_data(), pp, p);
    } else {
        kvindex::apply_rope(in.shape(0), int(in.shape(1)), out.mutable_data(), pp, p);
    }
    return out;
}

py::dict meta_dict(const kvindex::TraceMeta& m) {
    py::dict d;
    d["format"] = m.format;
    d["n_layers"] = m.n_layers;
    d["n_q_heads"] = m.n_q_heads;
    d["n_kv_heads"] = m.n_kv_heads;
    d["head_dim"] = m.head_dim;
    d["n_tokens"] = m.n_tokens;
    d["n_ctx"] = m.n_ctx;
    d["rope_theta"] = m.rope_theta;
    d["rope_style"] = std::string(kvindex::rope_style_name(m.rope_style));
    d["source"] = m.source;
    d["dtype"] = m.dtype;
    return d;
}

/// Refuses a path with a NUL byte, as Python's open() does: the C library
/// would silently stop the name there.
const std::string& checked_path(const std::string& path, const char* what) {
    if (path.find('\0') != std::string::npos) {
        throw py::value_error(std::string(what) + ": embedded null byte in the path");
    }
    return path;
}

py::tuple read_trace(const std::string& dir_in, py::object layers) {
    const std::string& dir = checked_path(dir_in, "read_trace");
    kvindex::TraceMeta meta = kvindex::read_trace_meta(dir);
    std::vector<int> which;
    if (layers.is_none()) {
        for (int l = 0; l < meta.n_layers; l++) {
            which.push_back(l);
        }
    } else {
        which = cast_arg<std::vector<int>>(layers, "read_trace: layers (a list of layer numbers)");
    }
    py::list out;
    for (int l : which) {
        if (l < 0 || l >= meta.n_layers) {
            throw py::index_error("layer " + std::to_string(l) + " outside [0, " + std::to_string(meta.n_layers) +
                                  ") of " + dir);
        }
        kvindex::TraceLayer t;
        {
            py::gil_scoped_release release;
            t = kvindex::read_trace_layer(dir, meta, l);
        }
        auto arr = [&](const std::vector<float>& v, int heads) {
            FloatArray a({py::ssize_t(heads), py::ssize_t(meta.n_tokens), py::ssize_t(meta.head_dim)});
            std::memcpy(a.mutable_data(), v.data(), sizeof(float) * v.size());
            return a;
        };
        py::dict d;
        d["keys"] = arr(t.keys, meta.n_kv_heads);
        d["values"] = arr(t.values, meta.n_kv_heads);
        d["queries"] = arr(t.queries, meta.n_q_heads);
        out.append(d);
    }
    return py::make_tuple(meta_dict(meta), out);
}

template <class T>
T meta_get(const py::dict& d, const char* key, T fallback) {
    return d.contains(key) ? cast_arg<T>(d[key], std::string("meta['") + key + "']") : fallback;
}

/// layers[l][key] as float32, or ValueError naming what is missing.
FloatArray layer_array(const py::dict& layer, const char* key, const std::string& at) {
    if (!layer.contains(key)) {
        throw py::value_error("write_trace: " + at + " has no '" + key + "'");
    }
    return as_float_array(layer[key], (at + "['" + key + "']").c_str());
}

void write_trace(const std::string& dir_in, const py::dict& meta_in, const py::list& layers) {
    const std::string& dir = checked_path(dir_in, "write_trace");
    if (layers.size() == 0) {
        throw py::value_error("write_trace: no layers");
    }
    auto first = layers[0].cast<py::dict>();
    FloatArray k0 = layer_array(first, "keys", "layers[0]");
    FloatArray q0 = layer_array(first, "queries", "layers[0]");
    check_shape(k0, {"n_kv_heads", "n_tokens", "head_dim"}, "layers[0]['keys']");
    check_shape(q0, {"n_q_heads", "n_tokens", "head_dim"}, "layers[0]['queries']");
    kvindex::TraceMeta m;
    m.n_layers = meta_get<int>(meta_in, "n_layers", int(layers.size()));
    m.n_kv_heads = meta_get<int>(meta_in, "n_kv_heads", int(k0.shape(0)));
    m.n_q_heads = meta_get<int>(meta_in, "n_q_heads", int(q0.shape(0)));
    m.n_tokens = meta_get<idx_t>(meta_in, "n_tokens", k0.shape(1));
    m.head_dim = meta_get<int>(meta_in, "head_dim", int(k0.shape(2)));
    if (!meta_in.contains("n_ctx")) {
        throw py::value_error("write_trace: meta must give n_ctx (the prompt length; later tokens are evaluated)");
    }
    m.n_ctx = cast_arg<idx_t>(meta_in["n_ctx"], "meta['n_ctx']");
    m.rope_theta = meta_get<double>(meta_in, "rope_theta", 10000.0);
    m.rope_style = kvindex::rope_style_from_name(meta_get<std::string>(meta_in, "rope_style", "half"));
    m.source = meta_get<std::string>(meta_in, "source", "python");
    m.dtype = meta_get<std::string>(meta_in, "dtype", "float32");
    if (m.n_layers != int(layers.size())) {
        throw py::value_error("write_trace: meta says " + std::to_string(m.n_layers) + " layers; " +
                              std::to_string(layers.size()) + " given");
    }
    m.check();
    // every layer converted and checked before anything is written, so
    // that a refused call leaves the directory as it was (a trace already
    // there is not mixed with the new meta and first layers)
    std::vector<kvindex::TraceLayer> converted(m.n_layers);
    for (int l = 0; l < m.n_layers; l++) {
        auto d = layers[l].cast<py::dict>();
        std::string at = "layers[" + std::to_string(l) + "]";
        auto get = [&](const char* key, int heads) {
            FloatArray a = layer_array(d, key, at);
            check_shape(a, {heads, m.n_tokens, m.head_dim}, (at + "['" + key + "']").c_str());
            return std::vector<float>(a.data(), a.data() + a.size());
        };
        kvindex::TraceLayer& t = converted[l];
        t.keys = get("keys", m.n_kv_heads);
        t.values = get("values", m.n_kv_heads);
        t.queries = get("queries", m.n_q_heads);
        kvindex::check_trace_layer(m, t, at.c_str());
    }
    py::gil_scoped_release release;
    kvindex::write_trace_meta(dir, m);
    for (int l = 0; l < m.n_layers; l++) {
        kvindex::write_trace_layer(dir, m, l, converted[l]);
    }
}

} // namespace

void bind_io(py::module_& m) {
    m.def("write_index",
          [](const KVIndex& index, const std::string& path) {
              checked_path(path, "write_index");
              py::gil_scoped_release release;
              kvindex::write_index(&index, path);
          },
          py::arg("index"), py::arg("path"), "writes the index (versioned container, see index_io.h)");
    m.def("read_index",
          [](const std::string& path) {
              checked_path(path, "read_index");
              py::gil_scoped_release release;
              return std::shared_ptr<KVIndex>(kvindex::read_index(path));
          },
          py::arg("path"), "reads an index written by write_index (any kvindex version it knows)");
    m.def("serialize_index",
          [](const KVIndex& index) {
              std::vector<uint8_t> buf;
              {
                  py::gil_scoped_release release;
                  kvindex::write_index(&index, &buf);
              }
              return as_numpy_bytes(buf);
          },
          py::arg("index"), "the bytes write_index would write, as a numpy uint8 array");
    m.def("clone_index",
          [](const KVIndex& index) {
              py::gil_scoped_release release;
              return std::shared_ptr<KVIndex>(kvindex::clone_index(&index));
          },
          py::arg("index"),
          "a deep copy of any index (tokens, trained models, knobs, random streams), through the io; "
          "copy.deepcopy does the same");
    m.def("deserialize_index", &deserialize, py::arg("buf"),
          "an index from serialize_index's bytes (numpy uint8 array, bytes or bytearray)");
    m.def("write_cache",
          [](const kvindex::KVCache& cache, const std::string& path) {
              checked_path(path, "write_cache");
              py::gil_scoped_release release;
              kvindex::write_cache(cache, path);
          },
          py::arg("cache"), py::arg("path"),
          "writes a whole KVCache mid-generation: every (layer, KV head) index with its tokens, "
          "models, knobs and random streams (versioned container, see index_io.h)");
    m.def("read_cache",
          [](const std::string& path) {
              checked_path(path, "read_cache");
              py::gil_scoped_release release;
              return kvindex::read_cache(path);
          },
          py::arg("path"), "reads a KVCache written by write_cache; it decodes on as the original would");
    m.def("serialize_cache",
          [](const kvindex::KVCache& cache) {
              std::vector<uint8_t> buf;
              {
                  py::gil_scoped_release release;
                  kvindex::write_cache(cache, &buf);
              }
              return as_numpy_bytes(buf);
          },
          py::arg("cache"), "the bytes write_cache would write, as a numpy uint8 array");
    m.def("deserialize_cache", &deserialize_cache, py::arg("buf"),
          "a KVCache from serialize_cache's bytes (numpy uint8 array, bytes or bytearray)");

    py::class_<kvindex::IndexTypeInfo>(m, "IndexTypeInfo", "One row of the index-type registry.")
            .def_readonly("name", &kvindex::IndexTypeInfo::name, "class name (KVIndex.type_name)")
            .def_property_readonly("fourcc", [](const kvindex::IndexTypeInfo& r) { return fourcc_string(r.fourcc); },
                                   "tag of its io records")
            .def_readonly("record_version", &kvindex::IndexTypeInfo::record_version)
            .def_readonly("grammar", &kvindex::IndexTypeInfo::grammar, "the factory elements it parses")
            .def_readonly("doc", &kvindex::IndexTypeInfo::doc)
            .def("__repr__", [](const kvindex::IndexTypeInfo& r) {
                return "<kvindex.IndexTypeInfo " + r.name + " '" + r.grammar + "'>";
            });
    m.def("index_types", &kvindex::index_types, "every registered index type, in the factory's order");

    // OpenBLAS picks its kernels when it loads (with this module); the
    // caller can only see the choice and set OPENBLAS_CORETYPE for the next
    // process (python_bindings/README.md, "BLAS kernels").
    auto c_str_or_none = [](const char* s) -> py::object {
        return s ? py::object(py::str(s)) : py::object(py::none());
    };
    m.def("blas_core_name", [c_str_or_none]() { return c_str_or_none(kvindex::blas_core_name()); },
          "the kernel set OpenBLAS chose at load (e.g. 'SkylakeX', 'Prescott'), None if the BLAS is not OpenBLAS");
    m.def("blas_core_for_this_cpu", [c_str_or_none]() { return c_str_or_none(kvindex::blas_core_for_this_cpu()); },
          "the widest OpenBLAS kernel set this CPU runs ('SkylakeX', 'Haswell'), None for older CPUs");
    m.def("blas_core_below_cpu", &kvindex::blas_core_below_cpu,
          "True when OpenBLAS fell back to older kernels than the CPU runs: set OPENBLAS_CORETYPE="
          "blas_core_for_this_cpu() before starting Python (2-3x faster sgemm)");

    m.def("apply_rope",
          [](py::handle x, py::handle positions, double theta, const std::string& style) {
              return rope(x, positions, theta, style, false);
          },
          py::arg("x"), py::arg("positions"), py::arg("theta") = 10000.0, py::arg("style") = "half",
          R"doc(A rotated copy of x (n, d): row i by the angles of positions[i].
Pair j turns by pos * theta^(-2j/d); style "half" pairs (i, i + d/2) (Llama /
NeoX as in HF transformers), "interleaved" pairs (2i, 2i + 1).)doc");
    m.def("invert_rope",
          [](py::handle x, py::handle positions, double theta, const std::string& style) {
              return rope(x, positions, theta, style, true);
          },
          py::arg("x"), py::arg("positions"), py::arg("theta") = 10000.0, py::arg("style") = "half",
          "undoes apply_rope (a copy)");

    m.def("read_trace", &read_trace, py::arg("dir"), py::arg("layers") = py::none(),
          R"doc(meta, layers = read_trace(dir): meta a dict (n_layers, n_q_heads,
n_kv_heads, head_dim, n_tokens, n_ctx, rope_theta, rope_style, source,
dtype); layers a list of dicts with float32 arrays "keys", "values"
(n_kv_heads, n_tokens, head_dim) and "queries" (n_q_heads, n_tokens,
head_dim). layers= picks some layers (the list then follows that order).)doc");
    m.def("write_trace", &write_trace, py::arg("dir"), py::arg("meta"), py::arg("layers"),
          R"doc(Writes a trace kvbench can replay: meta as read_trace returns it (n_ctx
required; heads, tokens and dims default to the arrays'; dtype "float32" or
"float16"), layers a list of dicts of "keys", "values", "queries".)doc");
}

} // namespace kvpy
