// KVIndex and the registered index types, the factory, parameters and the
// registry. Every method converts and checks its arrays with the GIL held,
// then releases it for the C++ call.

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <pybind11/stl.h>

#include <kvindex/IndexChoose.h>
#include <kvindex/IndexHybrid.h>
#include <kvindex/IndexKVShards.h>
#include <kvindex/IndexKVFlat.h>
#include <kvindex/IndexLSHSample.h>
#include <kvindex/IndexIVFAsym.h>
#include <kvindex/IndexRoarGraph.h>
#include <kvindex/IndexProxyEvict.h>
#include <kvindex/IndexSinkWindow.h>
#include <kvindex/IndexTopK.h>
#include <kvindex/IndexUniformSample.h>
#include <kvindex/IndexWeightedSample.h>
#include <kvindex/KVIndex.h>
#include <kvindex/attention.h>
#include <kvindex/index_factory.h>
#include <kvindex/index_io.h>
#include <kvindex/kv_type.h>
#include <kvindex/parameters.h>
#include <kvindex/registry.h>

#include "arrays.h"
#include "bindings.h"

namespace kvpy {

using kvindex::idx_t;
using kvindex::KVIndex;

namespace {

/** The per-call knobs and the SearchParameters subclass that carries each.
 * A call's names must all fit one subclass (a chain has at most one
 * retriever kind), and each must be a search-time parameter of the index. */
enum class Family { any, topk, lsh };
struct CallKnob {
    const char* name;
    Family family;
};
constexpr CallKnob kCallKnobs[] = {
        {"k", Family::any},
        {"nprobe", Family::topk},
        {"efSearch", Family::topk},
        {"min_hits", Family::lsh},
        {"max_sample", Family::lsh},
};

std::vector<std::pair<std::string, double>> parse_params(py::handle params) {
    std::vector<std::pair<std::string, double>> out;
    if (py::isinstance<py::str>(params)) {
        // the library's parser: decimal values only, each name once; ""
        // sets nothing, as None
        const std::string s = params.cast<std::string>();
        if (!s.empty()) {
            try {
                out = kvindex::parse_parameters(s);
            } catch (const faiss::FaissException& e) {
                // the message, without Faiss's function and condition
                const std::string what = e.what();
                const size_t at = what.rfind("failed: ");
                throw py::value_error("params: " + (at == std::string::npos ? what : what.substr(at + 8)));
            }
        }
    } else if (py::isinstance<py::dict>(params)) {
        for (auto kv : py::reinterpret_borrow<py::dict>(params)) {
            out.emplace_back(py::str(kv.first).cast<std::string>(), py::cast<double>(py::float_(py::reinterpret_borrow<py::object>(kv.second))));
        }
    } else {
        throw py::type_error("params must be a string \"name=value,...\", a dict or None");
    }
    return out;
}

/// The `k` property exists where the chain has the knob (an index of it
/// reads a top-k budget).
void require_k(const KVIndex& index) {
    const auto info = kvindex::index_parameter_info(&index);
    if (std::none_of(info.begin(), info.end(), [](const kvindex::ParameterInfo& p) { return p.name == "k"; })) {
        throw py::attribute_error(kvindex::index_factory_string(&index) +
                                  " reads no top-k budget: it has no k");
    }
}

} // namespace

std::unique_ptr<faiss::SearchParameters> call_parameters(const KVIndex& index, py::handle params) {
    return call_parameters({&index}, kvindex::index_factory_string(&index), params);
}

std::unique_ptr<faiss::SearchParameters> call_parameters(
        const std::vector<const KVIndex*>& readers, const std::string& what, py::handle params) {
    if (params.is_none()) {
        return nullptr;
    }
    auto items = parse_params(params);
    // the C++ rule (check_params): a per-call knob some index reads, not
    // merely one listed (a Hybrid lists its Uniform tail's k, which a call
    // hands to the heavy part only)
    std::set<std::string> search_time;
    for (const KVIndex* index : readers) {
        for (const auto& c : kCallKnobs) {
            if (index->reads_search_knob(c.name)) {
                search_time.insert(c.name);
            }
        }
    }
    Family family = Family::any;
    for (const auto& [name, value] : items) {
        const CallKnob* knob = nullptr;
        for (const auto& c : kCallKnobs) {
            knob = name == c.name ? &c : knob;
        }
        if (!knob || !search_time.count(name)) {
            std::string known;
            for (const auto& c : kCallKnobs) {
                if (search_time.count(c.name)) {
                    known += (known.empty() ? "" : ", ") + std::string(c.name);
                }
            }
            throw py::value_error("params: '" + name + "' is not a search-time parameter of " +
                                  what + " (per-call names: " + known +
                                  "; set_index_parameters sets the others)");
        }
        if (knob->family != Family::any) {
            if (family != Family::any && family != knob->family) {
                throw py::value_error("params: nprobe / efSearch and min_hits / max_sample cannot be combined");
            }
            family = knob->family;
        }
        // range first: converting a double above 2^63 to an integer is undefined
        if (!(value >= 0 && value <= 9007199254740992.0) || value != std::floor(value)) {
            throw py::value_error("params: " + name + "=" + std::to_string(value) + " must be a non-negative integer");
        }
        // the carrier reads 0 as "the index's own value": a sweep starting at
        // k, nprobe or efSearch 0 would report the default under that label
        // (min_hits and max_sample 0 are settings: every token, no cap)
        if (value == 0 && (name == "k" || name == "nprobe" || name == "efSearch")) {
            throw py::value_error("params: " + name + "=0 must be >= 1 (omit it for the index's own value)");
        }
        if ((name == "efSearch" || name == "min_hits") && value > double(INT_MAX)) {
            throw py::value_error("params: " + name + "=" + std::to_string(value) + " must be <= " +
                                  std::to_string(INT_MAX));
        }
    }
    std::unique_ptr<kvindex::SearchParametersKV> p;
    if (family == Family::topk) {
        auto t = std::make_unique<kvindex::SearchParametersTopK>();
        for (const auto& [name, value] : items) {
            if (name == "nprobe") t->nprobe = size_t(value);
            if (name == "efSearch") t->efSearch = int(value);
        }
        p = std::move(t);
    } else if (family == Family::lsh) {
        auto l = std::make_unique<kvindex::SearchParametersLSH>();
        for (const auto& [name, value] : items) {
            if (name == "min_hits") l->min_hits = int(value);
            if (name == "max_sample") l->max_sample = idx_t(value);
        }
        p = std::move(l);
    } else {
        p = std::make_unique<kvindex::SearchParametersKV>();
    }
    for (const auto& [name, value] : items) {
        if (name == "k") {
            if (value < 1) {
                throw py::value_error("params: k must be >= 1");
            }
            p->k = idx_t(value);
        }
    }
    return p;
}

namespace {

FloatArray queries_of(const KVIndex& index, py::handle q) {
    FloatArray a = as_float_array(q, "q");
    check_shape(a, {"n", index.d}, "q");
    return a;
}

/// keys (n, d) and values (n, d_value) of n tokens, as float32 arrays.
std::pair<FloatArray, FloatArray> tokens_of(const KVIndex& index, py::handle keys, py::handle values) {
    FloatArray k = as_float_array(keys, "keys");
    check_shape(k, {"n", index.d}, "keys");
    FloatArray v = as_float_array(values, "values");
    check_shape(v, {k.shape(0), index.d_value}, "values");
    return {k, v};
}

/// add_kv and add_kv_undoable of keys (n, d) and values (n, d_value).
void add_tokens(KVIndex& index, py::handle keys, py::handle values, bool undoable) {
    auto [k, v] = tokens_of(index, keys, values);
    py::gil_scoped_release release;
    if (undoable) {
        index.add_kv_undoable(k.shape(0), k.data(), v.data());
    } else {
        index.add_kv(k.shape(0), k.data(), v.data());
    }
}

kvindex::KVType kv_type_of(const std::string& name) {
    for (auto t : {kvindex::KVType::f32, kvindex::KVType::bf16, kvindex::KVType::f16}) {
        if (name == kvindex::kv_type_name(t)) {
            return t;
        }
    }
    throw py::value_error("kv_type must be 'f32', 'bf16' or 'f16'; got '" + name + "'");
}

/// The value dimension of a constructor (None: d), both dimensions checked
/// as index_factory and read_index check them: an index built with others
/// would pickle but not unpickle.
int d_value_or(int d, py::object d_value) {
    const int dv = d_value.is_none() ? d : cast_arg<int>(d_value, "d_value (an int or None)");
    if (d < 1 || d > kvindex::kMaxDimension || dv < 1 || dv > kvindex::kMaxDimension) {
        throw py::value_error("dimensions d=" + std::to_string(d) + ", d_value=" + std::to_string(dv) +
                              " must be in [1, " + std::to_string(kvindex::kMaxDimension) + "]");
    }
    return dv;
}

std::string repr(const KVIndex& index) {
    return "<kvindex." + std::string(index.type_name()) + " '" + kvindex::index_factory_string(&index) +
            "' d=" + std::to_string(index.d) + " d_value=" + std::to_string(index.d_value) +
            " ntotal=" + std::to_string(index.ntotal) + ">";
}

void prefill(KVIndex& self, py::handle keys, py::handle values, py::handle queries, py::handle positions,
             double rope_theta, const std::string& rope_style, idx_t first_position) {
    auto [k, v] = tokens_of(self, keys, values);
    idx_t n = k.shape(0);
    kvindex::PrefillInput in;
    in.n_tokens = n;
    in.keys = k.data();
    in.values = v.data();
    in.first_position = first_position;
    in.rope.theta = rope_theta;
    in.rope.style = kvindex::rope_style_from_name(rope_style);
    FloatArray qa;
    Int64Array pa;
    if (!queries.is_none()) {
        qa = as_float_array(queries, "queries");
        if (qa.ndim() == 2) {
            check_shape(qa, {"nq", self.d}, "queries");
            in.n_query_heads = 1;
            in.n_queries = qa.shape(0);
        } else {
            check_shape(qa, {"n_query_heads", "nq", self.d}, "queries");
            in.n_query_heads = int(qa.shape(0));
            in.n_queries = qa.shape(1);
        }
        in.queries = qa.data();
    }
    if (!positions.is_none()) {
        if (queries.is_none()) {
            throw py::value_error("query_positions given without queries");
        }
        pa = as_int64_array(positions, "query_positions");
        check_shape(pa, {in.n_queries}, "query_positions");
        in.query_positions = pa.data();
    }
    py::gil_scoped_release release;
    self.prefill(in);
}

/// search's k: an int (or an integer numpy scalar), never a bool, which
/// Python would otherwise take as 0 or 1.
idx_t k_argument(py::handle k_obj) {
    if (PyBool_Check(k_obj.ptr()) || !PyIndex_Check(k_obj.ptr())) {
        throw py::type_error("k must be an integer; got " +
                             std::string(py::str(py::type::of(k_obj).attr("__name__"))));
    }
    Py_ssize_t k = PyNumber_AsSsize_t(k_obj.ptr(), PyExc_OverflowError);
    if (k == -1 && PyErr_Occurred()) {
        throw py::error_already_set();
    }
    return idx_t(k);
}

py::tuple search(const KVIndex& self, py::handle q, py::handle k_obj, py::handle params) {
    const idx_t k = k_argument(k_obj);
    if (k <= 0) {
        throw py::value_error("k must be > 0; got " + std::to_string(k));
    }
    FloatArray qa = queries_of(self, q);
    auto p = call_parameters(self, params);
    idx_t n = qa.shape(0);
    FloatArray D({n, k});
    py::array_t<int64_t> I({n, k});
    {
        py::gil_scoped_release release;
        static_assert(sizeof(idx_t) == sizeof(int64_t), "faiss idx_t is 64-bit");
        self.search(n, qa.data(), k, D.mutable_data(), reinterpret_cast<idx_t*>(I.mutable_data()), p.get());
    }
    return py::make_tuple(D, I);
}

py::tuple attend(const KVIndex& self, py::handle q, py::handle params) {
    FloatArray qa = queries_of(self, q);
    auto p = call_parameters(self, params);
    idx_t n = qa.shape(0);
    FloatArray out({n, idx_t(self.d_value)});
    FloatArray lse(std::vector<py::ssize_t>{n});
    {
        py::gil_scoped_release release;
        self.attend(n, qa.data(), out.mutable_data(), lse.mutable_data(), p.get());
    }
    return py::make_tuple(out, lse);
}

std::vector<kvindex::Selection> select(const KVIndex& self, py::handle q, py::handle params) {
    FloatArray qa = queries_of(self, q);
    auto p = call_parameters(self, params);
    std::vector<kvindex::Selection> sel(qa.shape(0));
    py::gil_scoped_release release;
    self.select(qa.shape(0), qa.data(), sel.data(), p.get());
    return sel;
}

FloatArray reconstruct(const KVIndex& self, idx_t i, bool value) {
    if (i < 0 || i >= self.ntotal) {
        throw py::index_error("token " + std::to_string(i) + " outside [0, " + std::to_string(self.ntotal) + ")");
    }
    FloatArray out(std::vector<py::ssize_t>{value ? self.d_value : self.d});
    py::gil_scoped_release release;
    if (value) {
        self.reconstruct_value(i, out.mutable_data());
    } else {
        self.reconstruct(i, out.mutable_data());
    }
    return out;
}

template <class T>
py::array_t<T> to_numpy(const std::vector<T>& v) {
    py::array_t<T> a(std::vector<py::ssize_t>{py::ssize_t(v.size())});
    std::copy(v.begin(), v.end(), a.mutable_data());
    return a;
}

/// Selection and ParameterInfo: what select and index_parameter_info return.
void bind_results(py::module_& m) {
    py::class_<kvindex::Selection>(m, "Selection",
                                   "The tokens one query's attention reads (KVIndex.select): ids, "
                                   "their inclusion probabilities u_i in (0, 1], and n_scanned, the "
                                   "vectors the retrieval read to choose them (key-vector equivalents).")
            .def_property_readonly("ids", [](const kvindex::Selection& s) { return to_numpy(s.ids); },
                                   "int64 (n_selected,): token positions")
            .def_property_readonly("inclusion", [](const kvindex::Selection& s) { return to_numpy(s.inclusion); },
                                   "float32 (n_selected,): inclusion probability of each id")
            .def_readonly("n_scanned", &kvindex::Selection::n_scanned)
            .def("__len__", &kvindex::Selection::size)
            .def("__repr__", [](const kvindex::Selection& s) {
                return "<kvindex.Selection " + std::to_string(s.size()) + " ids, n_scanned=" +
                        std::to_string(s.n_scanned) + ">";
            });

    py::class_<kvindex::ParameterInfo>(m, "ParameterInfo", "A named knob of an index type.")
            .def_readonly("name", &kvindex::ParameterInfo::name)
            .def_readonly("prefill_time", &kvindex::ParameterInfo::prefill_time,
                          "True: shapes what prefill builds (set before prefill)")
            .def_readonly("doc", &kvindex::ParameterInfo::doc)
            .def_readonly("in_tokens", &kvindex::ParameterInfo::in_tokens,
                          "True: a count of tokens, which may be given in percent of the prompt")
            .def_property_readonly("kind", [](const kvindex::ParameterInfo& p) {
                return p.kind == kvindex::ParameterKind::integer ? "integer"
                        : p.kind == kvindex::ParameterKind::real ? "real"
                                                                 : "flag";
            }, "'integer', 'real' or 'flag'")
            .def_readonly("read_only", &kvindex::ParameterInfo::read_only)
            .def_property_readonly("range", &kvindex::ParameterInfo::range, "the accepted values, as docs/reference.md prints them")
            .def("accepts", &kvindex::ParameterInfo::accepts, py::arg("value"))
            .def("__repr__", [](const kvindex::ParameterInfo& p) {
                return "<kvindex.ParameterInfo " + p.name + " " + p.range() +
                        (p.prefill_time ? " (prefill-time)" : "") + ": " + p.doc + ">";
            });
}

using KVIndexClass = py::class_<KVIndex, std::shared_ptr<KVIndex>>;

/// What an index is: sizes, budget, estimator, storage, RoPE, its string.
void bind_kvindex_properties(KVIndexClass& c) {
    c.def_property_readonly("d", [](const KVIndex& s) { return s.d; }, "dimension of keys and queries")
            .def_readonly("d_value", &KVIndex::d_value, "dimension of the values")
            .def_property_readonly("ntotal", [](const KVIndex& s) { return s.ntotal; }, "tokens held")
            .def_property_readonly("is_trained", [](const KVIndex& s) { return s.is_trained; })
            .def_property(
                    // through the parameter walk, so that a wrapper's k is its
                    // inner index's (the budget a select uses), as
                    // set_index_parameter(index, "k", k) sets and reads it
                    "k",
                    [](const KVIndex& s) {
                        require_k(s);
                        return read_guarded(s, "k", [&] { return idx_t(kvindex::get_index_parameter(&s, "k")); });
                    },
                    [](KVIndex& s, idx_t k) {
                        require_k(s);
                        if (k <= 0 || k > (idx_t(1) << 53)) { // knobs travel as doubles
                            throw py::value_error("k must be in [1, 2^53]; got " + std::to_string(k));
                        }
                        py::gil_scoped_release release;
                        kvindex::set_index_parameter(&s, "k", double(k));
                    },
                    "default top-k budget of the chains that read one (the whole chain's, as "
                    "set_index_parameter sets it); AttributeError for the others (Flat, "
                    "LSHSample, IVFAsym, eviction over Flat)")
            .def_property(
                    "estimator", [](const KVIndex& s) { return std::string(kvindex::estimator_name(s.estimator)); },
                    [](KVIndex& s, const std::string& e) {
                        if (e != "topk" && e != "unbiased") {
                            throw py::value_error("estimator must be 'topk' or 'unbiased'; got '" + e + "'");
                        }
                        // a write: refused while a call runs, as every setter
                        kvindex::WriteScope scope(s, "estimator");
                        s.estimator = e == "topk" ? kvindex::Estimator::topk : kvindex::Estimator::unbiased;
                    },
                    "'unbiased' (softmax of s_i - log u_i over the selection) or 'topk' (u_i ignored)")
            .def_property_readonly("kv_type", [](const KVIndex& s) { return std::string(kvindex::kv_type_name(s.kv_type)); },
                                   "element type of the stored keys and values: 'f32', 'bf16' or 'f16'")
            .def_property_readonly("type_name", [](const KVIndex& s) { return std::string(s.type_name()); })
            .def_property_readonly("has_rope", [](const KVIndex& s) { return s.has_rope; })
            .def_property_readonly("rope_theta", [](const KVIndex& s) { return s.rope.theta; })
            .def_property_readonly("rope_style", [](const KVIndex& s) { return std::string(kvindex::rope_style_name(s.rope.style)); })
            .def("factory_string",
                 [](const KVIndex& s) { return read_guarded(s, "factory_string", [&] { return s.factory_string(); }); },
                 "the chain's factory string without the storage prefix (index_factory_string has it)");
}

/// The writes of tokens and queries: add_kv (undoable or not), add_queries, prefill.
void bind_kvindex_writes(KVIndexClass& c) {
    c.def("add_kv",
                 [](KVIndex& self, py::handle keys, py::handle values) { add_tokens(self, keys, values, false); },
                 py::arg("keys"), py::arg("values"),
                 "Appends n tokens (ids ntotal .. ntotal + n - 1): keys (n, d), values (n, d_value).")
            .def("add_kv_undoable",
                 [](KVIndex& self, py::handle keys, py::handle values) { add_tokens(self, keys, values, true); },
                 py::arg("keys"), py::arg("values"),
                 "add_kv that undo_add_kv can take back until the next write or forget_undo() "
                 "(raises unless can_undo_add)")
            .def("undo_add_kv",
                 [](KVIndex& self) {
                     py::gil_scoped_release release;
                     self.undo_add_kv();
                 },
                 "takes back the last add_kv_undoable: the index answers as before it")
            .def("forget_undo",
                 [](KVIndex& self) {
                     py::gil_scoped_release release;
                     kvindex::WriteScope scope(self, "forget_undo");
                     self.forget_undo();
                 },
                 "frees what the last add_kv_undoable kept; it can no longer be taken back")
            .def_property_readonly("can_undo_add", &KVIndex::can_undo_add,
                 "whether add_kv_undoable can take an append back (all types but a TopK over an HNSW graph)")
            .def("add_queries",
                 [](KVIndex& self, py::handle q) {
                     FloatArray qa = queries_of(self, q);
                     py::gil_scoped_release release;
                     self.add_queries(qa.shape(0), qa.data());
                 },
                 py::arg("queries"),
                 "Decode queries (n, d), after they were answered, for the types that learn from them "
                 "(RoarGraph keeps the recent ones as anchors); the others ignore them.")
            .def("prefill", &prefill, py::arg("keys"), py::arg("values"), py::arg("queries") = py::none(),
                 py::arg("query_positions") = py::none(), py::arg("rope_theta") = 10000.0,
                 py::arg("rope_style") = "half", py::arg("first_position") = 0,
                 R"doc(Adds the prompt with everything prefill knows (empty index only).

keys (n, d) and values (n, d_value), post-RoPE; queries (nq, d) or
(n_query_heads, nq, d): the prompt's queries of the GQA group, which
query-aware types (eviction, RoarGraph, IVFAsym) learn from;
query_positions (nq,) int64, default the last nq positions.)doc");
}

/// The reads of a decode step: search, attend, select, reconstruct.
void bind_kvindex_reads(KVIndexClass& c) {
    c.def("search", &search, py::arg("q"), py::arg("k"), py::arg("params") = py::none(),
                 R"doc(D, I = index.search(q, k): top-k keys by inner product, as faiss.

q (n, d) -> D float32 (n, k) unscaled inner products, decreasing; I int64
(n, k) token positions, padded with -1 (and the lowest float) when fewer
than k are found. params: per-call knobs, "k=..,nprobe=.." or a dict.)doc")
            .def("attend", &attend, py::arg("q"), py::arg("params") = py::none(),
                 "out, lse = index.attend(q): q (n, d) -> attention outputs float32 (n, d_value) and the "
                 "log-sum-exp of the scores float32 (n,)")
            .def("select", &select, py::arg("q"), py::arg("params") = py::none(),
                 "q (n, d) -> a list of n Selection (ids, inclusion, n_scanned)")
            .def("reconstruct", [](const KVIndex& s, idx_t i) { return reconstruct(s, i, false); }, py::arg("i"),
                 "key of token i, float32 (d,)")
            .def("reconstruct_value", [](const KVIndex& s, idx_t i) { return reconstruct(s, i, true); },
                 py::arg("i"), "value of token i, float32 (d_value,)");
}

/// reset, streams, adoption, memory, invariants, failed writes, children, knobs.
void bind_kvindex_state(KVIndexClass& c) {
    c.def("reset", [](KVIndex& s) {
                py::gil_scoped_release release;
                s.reset();
            }, "removes every token; the knobs stay")
            .def("set_stream", [](KVIndex& s, uint64_t stream) { s.set_stream(stream); }, py::arg("stream"),
                 "the random stream of this index and its children (a KVCache gives head h of layer l the "
                 "stream l * n_kv_heads + h): an index built apart (a shard) draws as the cache's head "
                 "would; set it before prefill, between calls")
            .def("adopt_trained", [](KVIndex& s, const KVIndex& trained) {
                py::gil_scoped_release release;
                return s.adopt_trained(trained);
            }, py::arg("trained"),
                 "takes the offline-trained parts (IVFAsym models) of an index built from the same "
                 "string; the whole chain is checked first, so a refusal adopts nothing; returns how many "
                 "indexes of the chain adopted something")
            .def("memory_bytes",
                 [](const KVIndex& s) { return read_guarded(s, "memory_bytes", [&] { return s.memory_bytes(); }); })
            .def("check_invariants",
                 [](const KVIndex& s) { read_guarded(s, "check_invariants", [&] { s.check_invariants(); }); })
            .def_property_readonly("writes_roll_back", &KVIndex::writes_roll_back,
                 "whether a write (add_kv, prefill, reset) that raises part-way leaves the index as it "
                 "was; where not, the index is marked failed (failed_write) until reset()")
            .def_property_readonly("appends_roll_back", &KVIndex::appends_roll_back,
                 "whether an add_kv that raises part-way leaves the index as it was (writes_roll_back, "
                 "or an append that takes its first part back)")
            .def_property_readonly("failed_write", [](const KVIndex& s) -> py::object {
                     return read_guarded(s, "failed_write", [&] {
                         const char* w = s.failed_write();
                         return w ? py::object(py::str(w)) : py::object(py::none());
                     });
                 },
                 "None, or the write that raised part-way and left the index inconsistent "
                 "(\"add_kv: <its error>\"): every call but reset() then raises")
            .def("children", [](KVIndex& s) { return s.mutable_children(); }, py::return_value_policy::reference_internal,
                 "the indexes this one wraps (references: they live as long as this index)")
            .def("parameter_info",
                 [](const KVIndex& s) {
                     return read_guarded(s, "parameter_info", [&] { return kvindex::index_parameter_info(&s); });
                 })
            .def("__repr__", [](const KVIndex& s) { return read_guarded(s, "repr", [&] { return repr(s); }); });
}

/// The base class every index type derives from.
void bind_kvindex(py::module_& m) {
    KVIndexClass c(m, "KVIndex", R"doc(The KV cache of one (layer, KV head) as a Faiss index.

Row id = token position. The index owns its keys (dimension d) and values
(dimension d_value). search returns the top-k keys by inner product (exact
or approximate, per type) as faiss does; attend returns attention outputs
and their log-sum-exp, with scores s_i = <q, k_i> / sqrt(d). Build one with
kvindex.index_factory(d, "...").

Thread safety: search, select, attend, reconstruct and write_index may run
concurrently from many threads (the GIL is released); a write (add_kv,
prefill, reset, set_index_parameters) that overlaps any call raises.)doc");
    bind_kvindex_properties(c);
    bind_kvindex_writes(c);
    bind_kvindex_reads(c);
    bind_kvindex_state(c);
}

/// Flat, TopK over a Faiss retriever, the sink and window, token-range shards.
void bind_exact_and_wrappers(py::module_& m) {
    py::class_<kvindex::IndexKVFlat, KVIndex, std::shared_ptr<kvindex::IndexKVFlat>>(
            m, "IndexKVFlat",
            "Exact attention over every token: the dense baseline. search is exact top-k by inner "
            "product; select returns every token; attend runs the fused dense kernel (one pass over "
            "keys and values for a batch of queries). Factory string: \"Flat\".")
            .def(py::init([](int d, py::object d_value, const std::string& kv_type) {
                     return constructed([&] { return std::make_shared<kvindex::IndexKVFlat>(d, d_value_or(d, d_value), kv_type_of(kv_type)); });
                 }),
                 py::arg("d"), py::arg("d_value") = py::none(), py::arg("kv_type") = "f32");

    py::class_<kvindex::IndexTopK, KVIndex, std::shared_ptr<kvindex::IndexTopK>>(
            m, "IndexTopK",
            R"doc(Top-k attention with a Faiss index as the retriever (Flat, SQ, PQ, IVF, HNSW
over Flat or SQ): the k keys with the
largest inner product with the query (exact for Flat, approximate for IVF /
HNSW), then exact softmax over them, with no correction for the tail. IVF
retrievers start with nprobe = min(nlist, 8) and train on a random sample of
the first add. Factory string: "TopK(<faiss string>)". Knobs: k, nprobe
(IVF), efSearch (HNSW).)doc")
            .def(py::init([](int d, const std::string& retriever, py::object d_value, const std::string& kv_type) {
                     return constructed([&] { return std::make_shared<kvindex::IndexTopK>(d, d_value_or(d, d_value), retriever, kv_type_of(kv_type)); });
                 }),
                 py::arg("d"), py::arg("retriever_string") = "Flat", py::arg("d_value") = py::none(),
                 py::arg("kv_type") = "f32")
            .def_readonly("retriever_string", &kvindex::IndexTopK::retriever_string, "the Faiss factory string")
            .def_property(
                    "max_train_points", [](const kvindex::IndexTopK& x) { return x.max_train_points; },
                    [](kvindex::IndexTopK& x, idx_t v) {
                        // the reader's range: a value outside it would save an
                        // index that does not read back
                        if (v < x.min_train_points || v > kvindex::IndexTopK::kMaxTrainPoints) {
                            throw py::value_error("max_train_points=" + std::to_string(v) + " must be in [min_train_points=" +
                                                  std::to_string(x.min_train_points) + ", 2^26]");
                        }
                        kvindex::WriteScope scope(x, "max_train_points");
                        x.max_train_points = v;
                    },
                    "cap on the training sample, in [min_train_points, 2^26]")
            .def_property(
                    "train_seed", [](const kvindex::IndexTopK& x) { return x.train_seed; },
                    [](kvindex::IndexTopK& x, decltype(kvindex::IndexTopK::train_seed) v) {
                        kvindex::WriteScope scope(x, "train_seed");
                        x.train_seed = v;
                    },
                    "seed of the training sample");

    py::class_<kvindex::IndexSinkWindow, KVIndex, std::shared_ptr<kvindex::IndexSinkWindow>>(
            m, "IndexSinkWindow",
            R"doc(The static part every sparse-attention method keeps: the first n_sink
tokens and the n_window most recent ones are attended exactly; the tokens
between them live in the inner index, whose estimate is merged with the exact
part by log-sum-exp. Factory string: "Sink<n>,Window<m>,<index>".)doc")
            .def_readonly("n_sink", &kvindex::IndexSinkWindow::n_sink)
            .def_readonly("n_window", &kvindex::IndexSinkWindow::n_window)
            .def_property_readonly("inner", [](kvindex::IndexSinkWindow& s) { return s.inner.get(); },
                                   py::return_value_policy::reference_internal);

    py::class_<kvindex::IndexKVShards, KVIndex, std::shared_ptr<kvindex::IndexKVShards>>(
            m, "IndexKVShards",
            R"doc(Token-range shards, as context-parallel decoding splits a cache: tokens
[s*T, (s+1)*T) live in shard s, an index built from one chain. attend merges
the shards' (out, lse) by log-sum-exp, search their top-k; budgets (k, a
sample) are per shard. Appends go to the last shard; a new one opens at T
tokens. Factory string: "Shards<T>(<chain>)".)doc")
            .def_readonly("shard_tokens", &kvindex::IndexKVShards::shard_tokens, "T, tokens per shard")
            .def_property_readonly("n_shards", [](const kvindex::IndexKVShards& s) { return s.shards.size(); })
            .def("shard", [](kvindex::IndexKVShards& s, size_t i) -> KVIndex* {
                     if (i >= s.shards.size()) {
                         throw py::index_error("shard " + std::to_string(i) + " of " +
                                               std::to_string(s.shards.size()));
                     }
                     return s.shards[i].get();
                 },
                 py::arg("i"), py::return_value_policy::reference_internal,
                 "shard i (tokens i*T ..), valid until the next write of this index");
}

/// One-shot eviction (NaCl, H2O, TOVA, StreamingLLM) and MagicPIG's LSH sampling.
void bind_eviction_and_lsh(py::module_& m) {
    py::class_<kvindex::IndexProxyEvict, KVIndex, std::shared_ptr<kvindex::IndexProxyEvict>>(
            m, "IndexProxyEvict",
            R"doc(One-shot eviction at prefill (NaCl, and H2O / TOVA / StreamingLLM / Random
as policies): prefill scores the prompt with its queries, keeps exactly the
budgeted tokens and hands only those to the inner index. Tokens appended
later are always kept; ids stay token positions. Factory string:
"ProxyEvict<P>[_H2O|_TOVA|_StreamingLLM|_Random][,<index>]". Prefill-time
knobs: budget, protect, proxy_keep, proxy_window, proxy_tokens (NaCl's proxy
window in tokens: the question), pool (scores max-pooled over that many
neighbouring tokens, odd: SnapKV), layer_vote (1: every query head of the
layer scores, through a KVCache, so its KV heads keep the same positions),
head_budget (1: the layer's tokens kept by score shared among its KV heads
by score, AdaKV), head_floor (each head's own share first, percent), n_sink,
seed.)doc")
            .def_readonly("keep_percent", &kvindex::IndexProxyEvict::keep_percent)
            .def_readonly("budget_tokens", &kvindex::IndexProxyEvict::budget_tokens)
            .def_property_readonly("positions", [](const kvindex::IndexProxyEvict& s) {
                                       return read_guarded(s, "positions", [&] { return to_numpy(s.positions); });
                                   },
                                   "int64: the position of each kept token")
            .def_property_readonly("inner", [](kvindex::IndexProxyEvict& s) { return s.inner.get(); },
                                   py::return_value_policy::reference_internal);

    py::class_<kvindex::IndexLSHSample, KVIndex, std::shared_ptr<kvindex::IndexLSHSample>>(
            m, "IndexLSHSample",
            R"doc(MagicPIG's LSH sampling with the unbiased attention estimator: keys hashed
by SimHash (K bits per table, L tables); the keys that share the query's
bucket in at least min_hits tables form the sample, each with its exact
inclusion probability u_i, and attention is softmax(s_i - log u_i) over the
sample. Compose with the static part: "Sink4,Window64,LSHSample10x150".
Factory string: "LSHSample<K>x<L>". Knobs: min_hits, max_sample (no k: K and L set
the sample).)doc")
            .def(py::init([](int d, int K, int L, py::object d_value, const std::string& kv_type) {
                     return constructed([&] { return std::make_shared<kvindex::IndexLSHSample>(d, d_value_or(d, d_value), K, L, kv_type_of(kv_type)); });
                 }),
                 py::arg("d"), py::arg("K") = 10, py::arg("L") = 150, py::arg("d_value") = py::none(),
                 py::arg("kv_type") = "f32")
            .def_readonly("K", &kvindex::IndexLSHSample::K, "bits per table")
            .def_readonly("L", &kvindex::IndexLSHSample::L, "tables")
            .def_readonly("min_hits", &kvindex::IndexLSHSample::min_hits, "collisions needed")
            .def_readonly("max_sample", &kvindex::IndexLSHSample::max_sample, "cap on the sample (0: none)")
            .def_readonly("seed", &kvindex::IndexLSHSample::seed, "seed of the hyperplanes");
}

/// RetrievalAttention's graph.
void bind_roar_graph(py::module_& m) {
    py::class_<kvindex::IndexRoarGraph, KVIndex, std::shared_ptr<kvindex::IndexRoarGraph>>(
            m, "IndexRoarGraph",
            R"doc(RetrievalAttention's attention-aware graph (built like RoarGraph): prefill
takes the exact top-Nq keys of the prompt's own queries (the recent ones and
a seeded sample of the rest), projects them onto a key graph (occlusion
rule, reverse edges), links the keys no query list reached, and keeps every
key reachable; decode-time tokens are linked as they arrive. search / attend
walk it best-first with a beam of max(efSearch, k), seeded with the exact
lists of the prompt queries nearest the query, and attend exactly over the k
keys found. walk_bits=8 (the default) walks on 8-bit codes of the keys (a
quarter of float32's bytes) and scores the whole beam again on the stored
keys; walk_bits=0 walks on the stored keys. The build links on the codes.
max_expansions bounds the walk (0: the best keys of the seed lists);
with every training query kept as an anchor, seeds and a short walk read
the fewest keys (synthetic 128k: "RoarGraph32|max_train_queries=24576,
n_anchors=24576,n_hubs=0,keys_per_seed_list=0,anchors_per_group=192,
seed_anchors=64,max_expansions=30", recall@100 0.954 scoring 2.8% of the keys).
Compose with the static part: "Sink128,Window512,RoarGraph32".
Factory string: "RoarGraph<M>". Knobs: k, efSearch, seed_anchors,
keys_per_seed_list, anchors_per_group, max_expansions, walk_bits,
decode_anchors, learn_efSearch, learn_scan_keys;
prefill-time: M, Nq, build_L, max_train_queries, recent_queries, n_hubs,
n_anchors, seed.)doc")
            .def(py::init([](int d, int M, py::object d_value, const std::string& kv_type) {
                     return constructed([&] { return std::make_shared<kvindex::IndexRoarGraph>(d, d_value_or(d, d_value), M, kv_type_of(kv_type)); });
                 }),
                 py::arg("d"), py::arg("M") = 32, py::arg("d_value") = py::none(),
                 py::arg("kv_type") = "f32")
            .def_readonly("M", &kvindex::IndexRoarGraph::M, "out-degree of the projection; degree bound 2M")
            .def_readonly("Nq", &kvindex::IndexRoarGraph::Nq, "exact neighbours per training query")
            .def_readonly("build_L", &kvindex::IndexRoarGraph::build_L, "beam of the linking searches")
            .def_readonly("efSearch", &kvindex::IndexRoarGraph::efSearch, "beam of the searches")
            .def_readonly("max_expansions", &kvindex::IndexRoarGraph::max_expansions,
                          "beam members a search expands at most (-1: the whole beam)")
            .def_readonly("walk_bits", &kvindex::IndexRoarGraph::walk_bits,
                          "0: the walk scores the stored keys; 8: their 8-bit codes")
            .def_readonly("max_train_queries", &kvindex::IndexRoarGraph::max_train_queries,
                          "training queries at most")
            .def_readonly("n_train_queries", &kvindex::IndexRoarGraph::n_train_queries,
                          "training queries the last prefill used")
            .def_readonly("entry_point", &kvindex::IndexRoarGraph::entry_point,
                          "start of every search (-1 when empty)")
            .def_readonly("decode_anchors", &kvindex::IndexRoarGraph::decode_anchors,
                          "decode queries (add_queries) kept as anchors, the most recent")
            .def_readonly("learn_scan_keys", &kvindex::IndexRoarGraph::learn_scan_keys,
                          "add_queries lists a decode query by an exact scan while the index "
                          "holds at most this many keys (by a beam search above)")
            .def_readonly("n_learned", &kvindex::IndexRoarGraph::n_learned,
                          "decode queries learnt since the prefill")
            .def_property_readonly("learned_anchors", &kvindex::IndexRoarGraph::learned_anchors,
                                   "decode queries held as anchors: min(n_learned, decode_anchors)")
            .def_property_readonly("hubs", [](const kvindex::IndexRoarGraph& g) {
                                       return read_guarded(g, "hubs", [&] { return to_numpy(g.hubs); });
                                   },
                                   "int32: the extra entry points of every search")
            .def_property_readonly("degrees", [](const kvindex::IndexRoarGraph& g) {
                                       return read_guarded(g, "degrees", [&] { return to_numpy(g.degrees); });
                                   },
                                   "uint16, size ntotal: out-degree of each key")
            .def_property_readonly(
                    "neighbors",
                    [](const kvindex::IndexRoarGraph& g) {
                        return read_guarded(g, "neighbors", [&] {
                            py::array_t<int32_t> a = to_numpy(g.neighbors);
                            return a.reshape({py::ssize_t(g.ntotal), py::ssize_t(g.max_degree())});
                        });
                    },
                    "int32 [ntotal, 2M]: row i = out-edges of key i, -1 padded")
            .def("count_reachable",
                 [](const kvindex::IndexRoarGraph& g) {
                     py::gil_scoped_release release;
                     return read_guarded(g, "count_reachable", [&] { return g.count_reachable(); });
                 },
                 "keys reachable from the entry point (breadth-first)");
}

/// SAAP's asymmetric partitions and their Q-model.
void bind_ivf_asym(py::module_& m) {
    py::class_<kvindex::IndexIVFAsym, KVIndex, std::shared_ptr<kvindex::IndexIVFAsym>>(
            m, "IndexIVFAsym",
            R"doc(SAAP's asymmetric partitions: keys in k-means buckets of their de-RoPEd
vectors, queries routed to nprobe buckets by a classifier (Q-model) trained
to predict where their attention mass is; attend is exact over every key of
the probed buckets. Models come from an offline-trained cache (kvllm train;
adopt_trained) or are trained on the prompt at prefill. Compose with the
static part: "Sink1,Window511,IVFAsym64". Factory strings: "IVFAsym<C>",
"IVFAsym<C>_Centroid", "IVFAsym<C>_CentroidRoPE" (nearest-centroid
baselines), "IVFAsym<C>_Oracle" (the buckets of largest exact mass: a
routing ceiling that scores every key), "IVFAsym<C>_Moment" (training-free:
the buckets of largest estimated mass log n_b + s <q, mean_b> + var_weight
s^2/2 sum_j q_j^2 var_bj from each bucket's stored keys). Knobs: nprobe,
group_probe, var_weight; prefill-time: hidden,
train_iterations, min_distance, seed.)doc")
            .def(py::init([](int d, int C, const std::string& probe, py::object d_value, const std::string& kv_type) {
                     kvindex::IVFAsymProbe p = probe == "qmodel" ? kvindex::IVFAsymProbe::qmodel
                             : probe == "centroid"              ? kvindex::IVFAsymProbe::centroid
                             : probe == "centroid_rope"         ? kvindex::IVFAsymProbe::centroid_rope
                             : probe == "oracle"                ? kvindex::IVFAsymProbe::oracle
                             : probe == "moment"                ? kvindex::IVFAsymProbe::moment
                                                                : throw py::value_error(
                                                                    "probe must be 'qmodel', 'centroid', 'centroid_rope', 'oracle' or 'moment', not '" + probe + "'");
                     return constructed([&] { return std::make_shared<kvindex::IndexIVFAsym>(d, d_value_or(d, d_value), C, p, kv_type_of(kv_type)); });
                 }),
                 py::arg("d"), py::arg("C") = 64, py::arg("probe") = "qmodel", py::arg("d_value") = py::none(),
                 py::arg("kv_type") = "f32")
            .def_readonly("n_centroids", &kvindex::IndexIVFAsym::n_centroids, "C, the buckets")
            .def_readonly("nprobe", &kvindex::IndexIVFAsym::nprobe, "buckets read per query")
            .def_readonly("adopted", &kvindex::IndexIVFAsym::adopted, "whether the models were adopted (trained offline)")
            .def_readonly("train_seconds", &kvindex::IndexIVFAsym::train_seconds, "the last self-training at prefill")
            .def_property_readonly("has_qmodel", [](const kvindex::IndexIVFAsym& x) {
                                       return read_guarded(x, "has_qmodel", [&] { return !x.qmodel.empty(); });
                                   },
                                   "whether a Q-model is trained (else queries probe by nearest centroid)")
            .def_property_readonly(
                    "centroids",
                    [](const kvindex::IndexIVFAsym& x) {
                        return read_guarded(x, "centroids", [&] {
                            py::array_t<float> a = to_numpy(x.centroids);
                            return a.reshape({py::ssize_t(x.centroids.size() / std::max(x.d, 1)), py::ssize_t(x.d)});
                        });
                    },
                    "float32 [C, d] (de-RoPEd key space); empty before training")
            .def_property_readonly(
                    "bucket_sizes",
                    [](const kvindex::IndexIVFAsym& x) {
                        kvindex::ReadScope scope(x, "bucket_sizes");
                        std::vector<int64_t> sizes;
                        for (const auto& ids : x.bucket_ids) {
                            sizes.push_back(int64_t(ids.size()));
                        }
                        return to_numpy(sizes);
                    },
                    "int64, size C + 1: tokens per bucket (the last: tokens from before any training)")
            .def("probe_buckets",
                 [](const kvindex::IndexIVFAsym& x, py::handle q, int nprobe, py::object position) {
                     FloatArray qa = queries_of(x, q);
                     if (qa.shape(0) != 1) {
                         throw py::value_error("probe_buckets: one query (1, d)");
                     }
                     std::vector<int32_t> out(std::max(nprobe, 0));
                     kvindex::ReadScope scope(x, "probe_buckets");
                     idx_t pos = position.is_none() ? x.query_position() : cast_arg<idx_t>(position, "position (an int or None)");
                     x.probe_buckets(qa.data(), pos, nprobe, out.data());
                     return to_numpy(out);
                 },
                 py::arg("q"), py::arg("nprobe"), py::arg("position") = py::none(),
                 "the nprobe buckets a query (post-RoPE, at `position`, default the newest token) reads, best first")
            .def("moment_log_masses",
                 [](const kvindex::IndexIVFAsym& x, py::handle q) {
                     FloatArray qa = queries_of(x, q);
                     if (qa.shape(0) != 1) {
                         throw py::value_error("moment_log_masses: one query (1, d)");
                     }
                     std::vector<float> out(x.n_centroids);
                     kvindex::ReadScope scope(x, "moment_log_masses");
                     x.moment_log_masses(qa.data(), out.data());
                     return to_numpy(out);
                 },
                 py::arg("q"),
                 "_Moment probe: float32 [C], the estimated log sum_{k in b} exp(s <q, k>) of each bucket (-inf: empty)");
}

/// The uniform and weighted samples, and the weighted inclusion probabilities.
void bind_samplers(py::module_& m) {
    py::class_<kvindex::IndexUniformSample, KVIndex, std::shared_ptr<kvindex::IndexUniformSample>>(
            m, "IndexUniformSample",
            R"doc(Uniform random sampling with the unbiased estimator: each query reads
k tokens drawn uniformly without replacement (u = k / n) and attends with
softmax(s_i - log u). The draw is a function of (seed, stream, the query,
ntotal). The tail of IndexHybrid. Factory string: "Uniform". Knobs: k, seed.)doc")
            .def(py::init([](int d, py::object d_value, const std::string& kv_type) {
                     return constructed([&] { return std::make_shared<kvindex::IndexUniformSample>(d, d_value_or(d, d_value), kv_type_of(kv_type)); });
                 }),
                 py::arg("d"), py::arg("d_value") = py::none(), py::arg("kv_type") = "f32")
            .def_readonly("seed", &kvindex::IndexUniformSample::seed, "seed of the draws");

    py::class_<kvindex::IndexWeightedSample, KVIndex, std::shared_ptr<kvindex::IndexWeightedSample>>(
            m, "IndexWeightedSample",
            R"doc(Sampling in proportion to the attention weights: every key is scored, and
k values are read, those of u_i = min(1, c e^{s_i}) = 1 and a systematic sample
of the rest, each with probability u_i (sum u = k). The estimated partition
is the exact one; the output is unbiased. Alone, or as the tail of
IndexHybrid ("Hybrid(TopK(Flat),Weighted)"). Factory string: "Weighted".
Knobs: k, seed.)doc")
            .def(py::init([](int d, py::object d_value, const std::string& kv_type) {
                     return constructed([&] { return std::make_shared<kvindex::IndexWeightedSample>(d, d_value_or(d, d_value), kv_type_of(kv_type)); });
                 }),
                 py::arg("d"), py::arg("d_value") = py::none(), py::arg("kv_type") = "f32")
            .def_readonly("seed", &kvindex::IndexWeightedSample::seed, "seed of the draws");

    m.def("weighted_inclusion",
          [](py::array_t<float, py::array::c_style | py::array::forcecast> s, int64_t m_budget) {
              if (s.ndim() != 1) {
                  throw std::invalid_argument("weighted_inclusion: scores must be 1-d, got " +
                                              std::to_string(s.ndim()) + " dimensions");
              }
              if (m_budget < 0) {
                  throw std::invalid_argument("weighted_inclusion: m=" + std::to_string(m_budget) +
                                              " must be >= 0");
              }
              py::array_t<double> u(s.shape(0));
              kvindex::weighted_inclusion(s.data(), size_t(s.shape(0)), size_t(m_budget), u.mutable_data());
              return u;
          },
          py::arg("scores"), py::arg("m"),
          "u_i = min(1, c e^{s_i}) with sum u = min(m, n) (float64 [n]); -inf scores get 0");
}

/// The hybrid of a heavy part and a sample, and Choose (Auto) among candidates.
void bind_estimators(py::module_& m) {
    py::class_<kvindex::IndexHybrid, KVIndex, std::shared_ptr<kvindex::IndexHybrid>>(
            m, "IndexHybrid",
            R"doc(Exact heavy hitters plus an unbiased sample of the other tokens (vAttention's
top-k + sampling, with LSH or uniform tails): the heavy index's top-k,
exact, merged by lse with the tail's sample drawn only outside it, weighted
by 1/u. Prefill sets the split per head from the prompt's last queries:
with no knobs, what the hybrid reads as given (heavy k + the tail's own
sample) is split between top-k and tail by error; with budget=B, B is; with
epsilon > 0 a uniform tail's sample is sized for an (epsilon, delta) error
target. Setting k or sample keeps that split.
Factory string: "Hybrid(<heavy>,<tail>)", e.g. "Hybrid(TopK(Flat),LSHSample10x150)",
"Hybrid(TopK(Flat),Uniform)|k=80,sample=80" (the tools also take "k=1%,sample=1%": a
share of the prompt). Knobs: k (heavy), sample (the tail's k);
prefill-time: budget, epsilon, delta, n_calibration.)doc")
            .def_readonly("sample", &kvindex::IndexHybrid::sample, "the tail's budget (-1: its own k, 0: no tail)")
            .def_readonly("budget", &kvindex::IndexHybrid::budget,
                          "reads split per head at prefill (0: off; -1: what it reads as given, unless k or sample is set)")
            .def_readonly("split_given", &kvindex::IndexHybrid::split_given, "k or sample was set: the default keeps that split")
            .def_readonly("calibrated_k", &kvindex::IndexHybrid::calibrated_k, "heavy k chosen at the last prefill (-1: none)")
            .def_readonly("epsilon", &kvindex::IndexHybrid::epsilon, "relative error target (0: off)")
            .def_readonly("delta", &kvindex::IndexHybrid::delta, "failure probability of the target")
            .def_readonly("calibrated_sample", &kvindex::IndexHybrid::calibrated_sample,
                          "tail sample chosen at the last prefill (-1: none)")
            .def_property_readonly("heavy", [](kvindex::IndexHybrid& s) { return s.heavy.get(); },
                                   py::return_value_policy::reference_internal)
            .def_property_readonly("tail", [](kvindex::IndexHybrid& s) { return s.tail.get(); },
                                   py::return_value_policy::reference_internal);

    py::class_<kvindex::IndexChoose, KVIndex, std::shared_ptr<kvindex::IndexChoose>>(
            m, "IndexChoose",
            R"doc(A per-head choice between candidate chains, made at prefill: every
candidate is built from the prompt without some held-back prefill queries,
its output error on them is measured against exact attention, and the one of
lowest error is kept (the others are emptied), among those reading at most
`budget` tokens' keys and values per held-back query when it is set. Factory
string: "Choose(<chain>;<chain>[;...])", e.g.
"Choose(TopK(Flat);Sink4,Window64,LSHSample10x150)", or "Auto" (the fast
families; "Auto|budget=2%"). The held-back queries are the latest before the
last position (recent_holdout=1, the default) or a seeded sample of the later
half (0). Knobs: prefill-time n_holdout, recent_holdout, seed, budget;
read-only chosen.)doc")
            .def_readonly("chosen", &kvindex::IndexChoose::chosen, "number of the chosen candidate (-1: none yet)")
            .def_property_readonly("errors", [](const kvindex::IndexChoose& x) {
                                       return read_guarded(x, "errors", [&] { return to_numpy(x.errors); });
                                   },
                                   "float64: each candidate's mean held-back error at the last prefill")
            .def_property_readonly("reads", [](const kvindex::IndexChoose& x) {
                                       return read_guarded(x, "reads", [&] { return to_numpy(x.reads); });
                                   },
                                   "float64: each candidate's mean tokens (keys and values) read per held-back "
                                   "query at the last prefill; empty without a budget")
            .def_property_readonly("holdout_positions",
                                   [](const kvindex::IndexChoose& x) {
                                       return read_guarded(x, "holdout_positions",
                                                           [&] { return to_numpy(x.holdout_positions); });
                                   },
                                   "int64: positions of the held-back queries")
            .def("chosen_string",
                 [](const kvindex::IndexChoose& x) {
                     return read_guarded(x, "chosen_string", [&] { return x.chosen_string(); });
                 },
                 "the chosen candidate's factory string")
            .def("candidate_strings", [](const kvindex::IndexChoose& x) {
                return read_guarded(x, "candidate_strings", [&] { return x.candidate_strings(); });
            })
            .def("children",
                 [](const kvindex::IndexChoose& x) {
                     // prefill replaces the candidates it drops (and all of
                     // them when it fails): a reference would dangle, so these
                     // are copies, as of now
                     kvindex::ReadScope scope(x, "children");
                     std::vector<std::shared_ptr<KVIndex>> out;
                     for (const KVIndex* c : x.children()) {
                         out.push_back(std::shared_ptr<KVIndex>(kvindex::clone_index(c)));
                     }
                     return out;
                 },
                 "copies of the candidates as they are now (prefill replaces the ones it drops, so "
                 "references would not stay valid)");
}

/// index_factory, its strings, the knobs, and time_attend.
void bind_factory_and_knobs(py::module_& m) {
    m.def("time_attend",
          [](const KVIndex& index, py::handle q, int repeats) {
              FloatArray qa = queries_of(index, q);
              if (repeats < 1) {
                  throw py::value_error("repeats must be >= 1");
              }
              idx_t n = qa.shape(0);
              if (n == 0) {
                  throw py::value_error("time_attend: q has no rows (nothing to time)");
              }
              std::vector<float> out(size_t(n) * index.d_value), lse(n);
              py::gil_scoped_release release;
              std::vector<double> t(repeats);
              for (int r = 0; r < repeats; r++) {
                  auto t0 = std::chrono::steady_clock::now();
                  index.attend(n, qa.data(), out.data(), lse.data());
                  t[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
              }
              return t;
          },
          py::arg("index"), py::arg("q"), py::arg("repeats"),
          "Benchmark aid: seconds of each of `repeats` attend(q) calls timed inside C++ (no Python in "
          "the loop), to set beside the same call timed from Python.");
    m.def("index_factory",
          [](int d, const std::string& description, py::object d_value) {
              int dv = d_value.is_none() ? -1 : cast_arg<int>(d_value, "d_value (an int or None)");
              return std::shared_ptr<KVIndex>(kvindex::index_factory(d, description, dv));
          },
          py::arg("d"), py::arg("description"), py::arg("d_value") = py::none(),
          R"doc(An index from a factory string, e.g. "Flat", "TopK(IVF64,Flat)",
"Sink4,Window64,LSHSample10x150", "BF16,ProxyEvict20". d_value defaults to d.)doc");
    m.def("index_factory_string",
          [](const KVIndex& index) {
              return read_guarded(index, "index_factory_string", [&] { return kvindex::index_factory_string(&index); });
          },
          py::arg("index"), "the whole factory string (with the BF16, / FP16, prefix): index_factory(d, s) rebuilds it");
    m.def("set_index_parameters", [](KVIndex& index, const std::string& s) { kvindex::set_index_parameters(&index, s); },
          py::arg("index"), py::arg("description"),
          "sets \"name=value,...\" on the index and everything it wraps, like faiss.ParameterSpace");
    m.def("resolve_percentages",
          [](const std::string& s, idx_t n_context, const KVIndex* index) {
              return kvindex::resolve_percentages(s, n_context, index);
          },
          py::arg("description"), py::arg("n_context"), py::arg("index") = nullptr,
          "\"k=2%,nprobe=4\" with each percentage made a count of the context, as kvbench and "
          "kvllm read a budget: ceil(p / 100 * n_context), at least 1. With the index the "
          "parameters are for, a percentage on a knob that is not a count of tokens is refused "
          "(ProxyEvict's protect is a percent already: \"protect=1%\" is not 1% of the context).");
    m.def("set_index_parameter",
          [](KVIndex& index, const std::string& name, double value) { kvindex::set_index_parameter(&index, name, value); },
          py::arg("index"), py::arg("name"), py::arg("value"));
    m.def("get_index_parameter",
          [](const KVIndex& index, const std::string& name) {
              return read_guarded(index, "get_index_parameter", [&] { return kvindex::get_index_parameter(&index, name); });
          },
          py::arg("index"), py::arg("name"));
    m.def("index_parameter_info",
          [](const KVIndex& index) {
              return read_guarded(index, "index_parameter_info", [&] { return kvindex::index_parameter_info(&index); });
          },
          py::arg("index"), "every parameter of the chain, outermost first");
    m.def("parse_index_spec",
          [](const std::string& s) {
              auto spec = kvindex::parse_index_spec(s);
              return py::make_tuple(spec.factory, spec.params);
          },
          py::arg("spec"), "\"STRING|params\" -> (factory string, params string)");
}

} // namespace

void bind_index(py::module_& m) {
    bind_results(m);
    bind_kvindex(m);
    bind_exact_and_wrappers(m);
    bind_eviction_and_lsh(m);
    bind_roar_graph(m);
    bind_ivf_asym(m);
    bind_samplers(m);
    bind_estimators(m);
    bind_factory_and_knobs(m);
}

} // namespace kvpy
