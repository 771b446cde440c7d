// KVCache: every (layer, KV head) index of a model, over head-major arrays
// [heads, n, d].

#include <cstring>
#include <string>
#include <vector>

#include <pybind11/stl.h>

#include <kvindex/KVCache.h>
#include <kvindex/attention.h>
#include <kvindex/rope.h>

#include "arrays.h"
#include "bindings.h"

namespace kvpy {

using kvindex::idx_t;
using kvindex::KVCache;
using kvindex::KVIndex;

namespace {

void check_layer(const KVCache& c, int layer) {
    if (layer < 0 || layer >= c.n_layers) {
        throw py::index_error("layer " + std::to_string(layer) + " outside [0, " + std::to_string(c.n_layers) + ")");
    }
}

/// keys [n_kv_heads, n, d] and values [n_kv_heads, n, d_value]: returns n.
idx_t check_tokens(const KVCache& c, const FloatArray& k, const FloatArray& v) {
    check_shape(k, {c.n_kv_heads, "n", c.d}, "keys");
    idx_t n = k.shape(1);
    check_shape(v, {c.n_kv_heads, n, c.d_value}, "values");
    return n;
}

void prefill(KVCache& c, int layer, py::handle keys, py::handle values, py::handle queries, py::handle positions,
             double rope_theta, const std::string& rope_style, idx_t first_position) {
    check_layer(c, layer);
    FloatArray k = as_float_array(keys, "keys"), v = as_float_array(values, "values");
    idx_t n = check_tokens(c, k, v);
    FloatArray q;
    Int64Array pos;
    const float* q_data = nullptr;
    const idx_t* pos_data = nullptr;
    idx_t nq = 0;
    if (!queries.is_none()) {
        q = as_float_array(queries, "queries");
        check_shape(q, {c.n_q_heads, "nq", c.d}, "queries");
        nq = q.shape(1);
        q_data = q.data();
    }
    if (!positions.is_none()) {
        if (queries.is_none()) {
            throw py::value_error("positions given without queries");
        }
        pos = as_int64_array(positions, "positions");
        check_shape(pos, {nq}, "positions");
        pos_data = reinterpret_cast<const idx_t*>(pos.data());
    }
    kvindex::RopeParams rope{rope_theta, kvindex::rope_style_from_name(rope_style)};
    py::gil_scoped_release release;
    c.prefill(layer, n, k.data(), v.data(), nq, q_data, pos_data, rope, first_position);
}

py::tuple attend(const KVCache& c, int layer, py::handle queries, py::handle params) {
    check_layer(c, layer);
    FloatArray q = as_float_array(queries, "q");
    check_shape(q, {c.n_q_heads, "n", c.d}, "q");
    idx_t n = q.shape(1);
    // a decode loop hands one set of per-call parameters to every layer:
    // each name must be read by some layer (KVCache::attend drops it for
    // the others, and refuses it when no layer reads it)
    std::vector<const KVIndex*> layers;
    for (int l = 0; l < c.n_layers; l++) {
        layers.push_back(c.index(l, 0));
    }
    auto p = call_parameters(layers, "this cache's layers (" + c.index_string +
                                     (c.dense_layers.empty() ? "" : "; dense: " + c.dense_string) + ")",
                             params);
    FloatArray out({idx_t(c.n_q_heads), n, idx_t(c.d_value)});
    FloatArray lse({idx_t(c.n_q_heads), n});
    {
        py::gil_scoped_release release;
        c.attend(layer, n, q.data(), out.mutable_data(), lse.mutable_data(), p.get());
    }
    return py::make_tuple(out, lse);
}

/** A decode step of one layer, for every head in one call: for each new
 * token i, append it (keys / values [n_kv_heads, n, d]), attend its
 * queries (q [n_q_heads, n, d]: token i's query sees tokens up to i), and
 * hand them to the indexes that learn from them. */
/// KVCache.append and append_undoable: keys (n_kv_heads, n, d), values (n_kv_heads, n, d_value).
void append_tokens(KVCache& c, int layer, py::handle keys, py::handle values, bool undoable) {
    check_layer(c, layer);
    FloatArray k = as_float_array(keys, "keys"), v = as_float_array(values, "values");
    idx_t n = check_tokens(c, k, v);
    py::gil_scoped_release release;
    if (undoable) {
        c.append_undoable(layer, n, k.data(), v.data());
    } else {
        c.append(layer, n, k.data(), v.data());
    }
}

py::tuple decode(KVCache& c, int layer, py::handle keys, py::handle values, py::handle queries, py::handle params) {
    check_layer(c, layer);
    FloatArray k = as_float_array(keys, "keys"), v = as_float_array(values, "values");
    idx_t n = check_tokens(c, k, v);
    FloatArray q = as_float_array(queries, "q");
    check_shape(q, {c.n_q_heads, n, c.d}, "q");
    std::vector<const KVIndex*> layers;
    for (int l = 0; l < c.n_layers; l++) {
        layers.push_back(c.index(l, 0));
    }
    auto p = call_parameters(layers, "this cache's layers (" + c.index_string + ")", params);
    FloatArray out({idx_t(c.n_q_heads), n, idx_t(c.d_value)});
    FloatArray lse({idx_t(c.n_q_heads), n});
    {
        py::gil_scoped_release release;
        const size_t kv = c.n_kv_heads, hq = c.n_q_heads, d = c.d, dv = c.d_value;
        if (n == 1) { // the decode loop's case: the arrays are the step's
            c.append(layer, 1, k.data(), v.data());
            c.attend(layer, 1, q.data(), out.mutable_data(), lse.mutable_data(), p.get());
            c.add_queries(layer, 1, q.data());
        } else { // token by token, each query causal
            // every token checked first: a refused one must change nothing
            c.check_append(layer, n, k.data(), v.data());
            std::vector<float> ki(kv * d), vi(kv * dv), qi(hq * d), oi(hq * dv), li(hq);
            for (idx_t i = 0; i < n; i++) {
                for (size_t h = 0; h < kv; h++) {
                    std::memcpy(&ki[h * d], k.data() + (h * n + i) * d, d * sizeof(float));
                    std::memcpy(&vi[h * dv], v.data() + (h * n + i) * dv, dv * sizeof(float));
                }
                for (size_t h = 0; h < hq; h++) {
                    std::memcpy(&qi[h * d], q.data() + (h * n + i) * d, d * sizeof(float));
                }
                c.append(layer, 1, ki.data(), vi.data());
                c.attend(layer, 1, qi.data(), oi.data(), li.data(), p.get());
                c.add_queries(layer, 1, qi.data());
                for (size_t h = 0; h < hq; h++) {
                    std::memcpy(out.mutable_data() + (h * n + i) * dv, &oi[h * dv], dv * sizeof(float));
                    lse.mutable_data()[h * n + i] = li[h];
                }
            }
        }
    }
    return py::make_tuple(out, lse);
}

/** outs (S, ..., dv) and lses (S, ...): S partial attentions over
 * disjoint key sets -> (out (..., dv), lse (...)) over their union, row by
 * row with kvindex::merge_attention (the merge of Sink,Window and Shards). */
py::tuple merge_parts(py::handle outs_obj, py::handle lses_obj) {
    FloatArray outs = as_float_array(outs_obj, "outs");
    FloatArray lses = as_float_array(lses_obj, "lses");
    const py::ssize_t nd = outs.ndim();
    bool ok = nd >= 2 && lses.ndim() == nd - 1 && outs.shape(0) > 0;
    for (py::ssize_t i = 0; ok && i < nd - 1; i++) {
        ok = lses.shape(i) == outs.shape(i);
    }
    if (!ok) {
        throw py::value_error("merge_attention: outs (S, ..., d_value) and lses (S, ...) of S >= 1 parts expected; "
                              "got outs " + shape_string(outs) + ", lses " + shape_string(lses));
    }
    const size_t n_parts = size_t(outs.shape(0)), dv = size_t(outs.shape(nd - 1));
    const size_t rows = size_t(lses.size()) / n_parts;
    std::vector<py::ssize_t> row_shape(outs.shape() + 1, outs.shape() + nd);
    FloatArray out = empty_float(row_shape);
    row_shape.pop_back();
    FloatArray lse = empty_float(row_shape);
    std::vector<const float*> parts(n_parts);
    std::vector<float> part_lse(n_parts);
    for (size_t r = 0; r < rows; r++) {
        for (size_t j = 0; j < n_parts; j++) {
            parts[j] = outs.data() + (j * rows + r) * dv;
            part_lse[j] = lses.data()[j * rows + r];
        }
        lse.mutable_data()[r] = kvindex::merge_attention(
                n_parts, parts.data(), part_lse.data(), dv, out.mutable_data() + r * dv);
    }
    return py::make_tuple(out, lse);
}

} // namespace

void bind_cache(py::module_& m) {
    m.def("merge_attention", &merge_parts, py::arg("outs"), py::arg("lses"),
          R"doc(Partial attentions over disjoint key sets merged into the attention over
their union, by log-sum-exp (the merge Sink,Window and Shards use):
outs (S, ..., d_value), lses (S, ...) -> out (..., d_value), lse (...). A part
with lse = -inf (no key) weighs nothing; with every part empty, out = 0 and
lse = -inf. NaN or +inf in lses raises.)doc");
    py::class_<KVCache>(m, "KVCache", R"doc(The KV cache of a model: n_layers x n_kv_heads indexes from one factory
string (and dense_string for the layers in dense_layers, e.g. layer 0).

GQA: query head h reads KV head h // (n_q_heads // n_kv_heads). Arrays are
head-major: keys (n_kv_heads, n, d), values (n_kv_heads, n, d_value),
queries (n_q_heads, n, d), outputs (n_q_heads, n, d_value). The heads of a
layer run in parallel (OpenMP), with the GIL released.)doc")
            .def(py::init([](int n_layers, int n_q_heads, int n_kv_heads, int d, const std::string& index_string,
                             py::object d_value, const std::string& dense_string, const std::vector<int>& dense_layers) {
                     int dv = d_value.is_none() ? d : cast_arg<int>(d_value, "d_value (an int or None)");
                     return constructed([&] {
                         return std::make_unique<KVCache>(n_layers, n_q_heads, n_kv_heads, d, dv, index_string,
                                                          dense_string, dense_layers);
                     });
                 }),
                 py::arg("n_layers"), py::arg("n_q_heads"), py::arg("n_kv_heads"), py::arg("d"),
                 py::arg("index_string"), py::arg("d_value") = py::none(), py::arg("dense_string") = "Flat",
                 py::arg("dense_layers") = std::vector<int>{})
            .def_readonly("n_layers", &KVCache::n_layers)
            .def_readonly("n_q_heads", &KVCache::n_q_heads)
            .def_readonly("n_kv_heads", &KVCache::n_kv_heads)
            .def_readonly("d", &KVCache::d)
            .def_readonly("d_value", &KVCache::d_value)
            .def_readonly("index_string", &KVCache::index_string)
            .def_readonly("dense_string", &KVCache::dense_string)
            .def_readonly("dense_layers", &KVCache::dense_layers)
            .def("group_size", &KVCache::group_size)
            .def("kv_head_of",
                 [](const KVCache& c, int q_head) {
                     if (q_head < 0 || q_head >= c.n_q_heads) {
                         throw py::index_error("q_head " + std::to_string(q_head) + " outside [0, " +
                                               std::to_string(c.n_q_heads) + ")");
                     }
                     return c.kv_head_of(q_head);
                 },
                 py::arg("q_head"), "the KV head query head q_head reads (GQA)")
            .def("index",
                 [](KVCache& c, int layer, int kv_head) {
                     check_layer(c, layer);
                     if (kv_head < 0 || kv_head >= c.n_kv_heads) {
                         throw py::index_error("kv_head " + std::to_string(kv_head) + " outside [0, " +
                                               std::to_string(c.n_kv_heads) + ")");
                     }
                     return c.index(layer, kv_head);
                 },
                 py::arg("layer"), py::arg("kv_head"), py::return_value_policy::reference_internal,
                 "the index of (layer, kv_head): a reference that lives as long as the cache; a write through "
                 "it makes the layer's next call raise (KVCache.check_invariants)")
            .def("n_tokens",
                 [](const KVCache& c, int layer) {
                     check_layer(c, layer);
                     return c.n_tokens(layer);
                 },
                 py::arg("layer"))
            .def("prefill", &prefill, py::arg("layer"), py::arg("keys"), py::arg("values"),
                 py::arg("queries") = py::none(), py::arg("positions") = py::none(), py::arg("rope_theta") = 10000.0,
                 py::arg("rope_style") = "half", py::arg("first_position") = 0,
                 "prefill of one layer: keys (n_kv_heads, n, d), values (n_kv_heads, n, d_value), queries "
                 "(n_q_heads, nq, d) or None, positions (nq,) int64 or None (the last nq tokens); "
                 "first_position: absolute position of the first key (a cache holding one token range)")
            .def("append",
                 [](KVCache& c, int layer, py::handle keys, py::handle values) {
                     append_tokens(c, layer, keys, values, false);
                 },
                 py::arg("layer"), py::arg("keys"), py::arg("values"),
                 "appends n tokens to every KV head of a layer: keys (n_kv_heads, n, d); all or nothing "
                 "(a head that fails part-way makes the others take their append back)")
            .def("append_undoable",
                 [](KVCache& c, int layer, py::handle keys, py::handle values) {
                     append_tokens(c, layer, keys, values, true);
                 },
                 py::arg("layer"), py::arg("keys"), py::arg("values"),
                 "append that undo_append(layer) can take back until the layer's next write (a step "
                 "appended to several caches, taken back where another refused it); raises unless "
                 "can_undo_append(layer)")
            .def("undo_append",
                 [](KVCache& c, int layer) {
                     check_layer(c, layer);
                     py::gil_scoped_release release;
                     c.undo_append(layer);
                 },
                 py::arg("layer"),
                 "takes back the layer's last append_undoable: the layer answers as before it")
            .def("can_undo_append",
                 [](const KVCache& c, int layer) {
                     check_layer(c, layer);
                     return c.can_undo_append(layer);
                 },
                 py::arg("layer"),
                 "whether every head of the layer can take an append back (all types but a TopK over HNSW)")
            .def("add_queries",
                 [](KVCache& c, int layer, py::handle queries) {
                     check_layer(c, layer);
                     FloatArray q = as_float_array(queries, "q");
                     check_shape(q, {c.n_q_heads, "n", c.d}, "q");
                     py::gil_scoped_release release;
                     c.add_queries(layer, q.shape(1), q.data());
                 },
                 py::arg("layer"), py::arg("q"),
                 "a decode step's queries (n_q_heads, n, d), after attend, to the indexes that learn "
                 "from them (KVIndex.add_queries)")
            .def("attend", &attend, py::arg("layer"), py::arg("q"), py::arg("params") = py::none(),
                 "out, lse = cache.attend(layer, q): q (n_q_heads, n, d) -> (n_q_heads, n, d_value), (n_q_heads, n)")
            .def("decode", &decode, py::arg("layer"), py::arg("keys"), py::arg("values"), py::arg("q"),
                 py::arg("params") = py::none(),
                 "out, lse = cache.decode(layer, keys, values, q): a decode step of one layer in one call: "
                 "each of the n new tokens (keys (n_kv_heads, n, d), values (n_kv_heads, n, d_value)) "
                 "appended, its queries q (n_q_heads, n, d) attended over the tokens up to it and handed "
                 "to the indexes that learn from them (append, attend, add_queries)")
            .def("reset",
                 [](KVCache& c) {
                     py::gil_scoped_release release;
                     c.reset();
                 },
                 "removes every token of every layer (a new sequence, or a layer a failed append left "
                 "out of step); the knobs and the cache's RoPE stay")
            .def("reset_layer",
                 [](KVCache& c, int layer) {
                     check_layer(c, layer);
                     py::gil_scoped_release release;
                     c.reset_layer(layer);
                 },
                 py::arg("layer"),
                 "removes every token of one layer (a layer prefilled over several caches, emptied where "
                 "another refused it)")
            .def("adopt_trained",
                 [](KVCache& c, const KVCache& trained) {
                     py::gil_scoped_release release;
                     return c.adopt_trained(trained);
                 },
                 py::arg("trained"),
                 "takes the offline-trained models (IVFAsym's centroids and Q-model) of `trained`, a cache of the "
                 "same shape and string (e.g. read_cache of what kvllm train wrote), into every sparse layer's "
                 "empty heads before their prefill; every head is checked before any adopts, so a refusal "
                 "changes nothing. Returns how many indexes adopted something")
            .def("memory_bytes",
                 [](const KVCache& c) {
                     // a walk over every head: raises while another thread
                     // writes a layer, instead of reading its moved memory
                     kvindex::ScopeEach<kvindex::ReadScope> reading(c.layer_calls, "KVCache.memory_bytes",
                                                                    "a layer of the cache");
                     return c.memory_bytes();
                 })
            .def("check_invariants",
                 [](const KVCache& c) {
                     kvindex::ScopeEach<kvindex::ReadScope> reading(c.layer_calls, "KVCache.check_invariants",
                                                                    "a layer of the cache");
                     c.check_invariants();
                 },
                 "raises RuntimeError naming the first layer whose KV heads hold different numbers of tokens "
                 "(a write through index(l, h)) or carry another RoPE than the cache's")
            .def("__repr__", [](const KVCache& c) {
                return "<kvindex.KVCache '" + c.index_string + "' layers=" + std::to_string(c.n_layers) +
                        " q_heads=" + std::to_string(c.n_q_heads) + " kv_heads=" + std::to_string(c.n_kv_heads) +
                        " d=" + std::to_string(c.d) + ">";
            });
}

} // namespace kvpy
