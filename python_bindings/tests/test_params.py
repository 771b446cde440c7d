"""params= (string and dict forms) and the parameter functions."""
import numpy as np
import pytest

import kvindex
import kvref
from conftest import build, selection_arrays


def test_params_string_dict_and_setter_agree(rdata):
    q = rdata.queries
    index = build("TopK(Flat)", rdata)
    base_out, base_lse = index.attend(q)
    a_out, a_lse = index.attend(q, params="k=10")
    b_out, b_lse = index.attend(q, params={"k": 10})
    np.testing.assert_array_equal(a_out, b_out)
    np.testing.assert_array_equal(a_lse, b_lse)
    # the knob applies to this call only
    c_out, c_lse = index.attend(q)
    np.testing.assert_array_equal(c_out, base_out)
    np.testing.assert_array_equal(c_lse, base_lse)
    assert index.k == 100
    kvindex.set_index_parameters(index, "k=10")
    assert index.k == 10
    # knobs travel as doubles: a k above 2^53 would come back rounded
    for bad in (0, -3, 2**53 + 1):
        with pytest.raises(ValueError, match=r"k must be in \[1, 2\^53\]"):
            index.k = bad
    assert index.k == 10
    d_out, d_lse = index.attend(q)
    np.testing.assert_array_equal(a_out, d_out)
    np.testing.assert_array_equal(a_lse, d_lse)
    ref_out, _ = kvref.topk_attend(q, rdata.keys, rdata.values, 10)
    assert kvref.rel_err(a_out, ref_out).max() < 1e-5
    # search and select take params too
    s1 = index.select(q, params={"k": 7})
    assert all(len(s.ids) == 7 for s in s1)
    D1, I1 = index.search(q, 5, params="k=7")
    D2, I2 = index.search(q, 5)
    np.testing.assert_array_equal(I1, I2)


def test_params_lsh_knobs(rdata):
    q = rdata.queries
    index = build("Sink4,Window64,LSHSample6x40", rdata)
    a = index.attend(q, params="min_hits=3,max_sample=50")
    b = index.attend(q, params={"min_hits": 3, "max_sample": 50})
    kvindex.set_index_parameters(index, "min_hits=3,max_sample=50")
    c = index.attend(q)
    for x, y in [(a, b), (a, c)]:
        np.testing.assert_array_equal(x[0], y[0])
        np.testing.assert_array_equal(x[1], y[1])
    for sel in index.select(q):
        ids, _ = selection_arrays(sel)
        assert len(ids) <= 4 + 64 + 50


def test_params_unknown_name_raises_value_error(rdata):
    index = build("TopK(Flat)", rdata)
    q = rdata.queries[:2]
    with pytest.raises(ValueError, match="bogus"):
        index.attend(q, params="bogus=3")
    with pytest.raises(ValueError, match="bogus"):
        index.attend(q, params={"bogus": 3})
    with pytest.raises(ValueError, match="bogus"):
        index.search(q, 3, params={"bogus": 3})
    with pytest.raises(ValueError, match="bogus"):
        index.select(q, params="bogus=1")
    # a knob of another type: LSHSample's min_hits on a TopK index
    with pytest.raises(ValueError, match="min_hits"):
        index.attend(q, params={"min_hits": 2})
    with pytest.raises((ValueError, RuntimeError), match="bogus"):
        kvindex.set_index_parameters(index, "bogus=1")
    with pytest.raises((ValueError, RuntimeError), match="bogus"):
        kvindex.get_index_parameter(index, "bogus")
    assert index.k == 100  # nothing changed


def test_resolve_percentages_as_kvbench_reads_a_budget():
    # decode_loop.py's "TopK(Flat)|k=2%": set_index_parameters needs a count
    assert kvindex.resolve_percentages("k=2%,nprobe=4", 1000) == "k=20,nprobe=4"
    assert kvindex.resolve_percentages("k=0.01%", 1000) == "k=1"   # ceil, at least 1
    assert kvindex.resolve_percentages("k=2.5%", 999) == "k=25"    # ceil(24.975)
    assert kvindex.resolve_percentages("", 1000) == ""
    with pytest.raises((ValueError, RuntimeError), match="percentage must be in"):
        kvindex.resolve_percentages("k=0%", 1000)
    with pytest.raises((ValueError, RuntimeError), match="context length"):
        kvindex.resolve_percentages("k=2%", 0)


def test_params_bad_values(rdata):
    index = build("TopK(Flat)", rdata)
    q = rdata.queries[:2]
    with pytest.raises((ValueError, RuntimeError), match="k"):
        index.attend(q, params={"k": -1})
    with pytest.raises((ValueError, RuntimeError, TypeError)):
        index.attend(q, params="k=abc")
    with pytest.raises((ValueError, TypeError)):
        index.attend(q, params=3.5)


def test_params_zero_and_malformed_per_call_values_raise(rdata):
    # 0 is "the index's own value" to the carrier: a sweep from 0 would
    # report the default under the label 0
    ivf = build("TopK(IVF16,Flat)", rdata)
    hnsw = build("TopK(HNSW8)", rdata)
    q = rdata.queries[:2]
    for index, params in [(ivf, "nprobe=0"), (ivf, {"nprobe": 0}), (ivf, "k=0"), (hnsw, "efSearch=0")]:
        with pytest.raises(ValueError, match="must be >= 1"):
            index.attend(q, params=params)
    # the library's own parser: no hex, no repeated name, no trailing comma
    for params, what in [("k=0x10", "not a decimal number"), ("k=5,k=6", "given twice"),
                         ("k=5,", "expected name=value")]:
        with pytest.raises(ValueError, match=what):
            ivf.attend(q, params=params)
    # an empty string sets nothing, as None
    np.testing.assert_array_equal(ivf.attend(q, params="")[0], ivf.attend(q)[0])
    # LSH knobs where 0 is a setting stay accepted
    lsh = build("LSHSample6x20", rdata)
    lsh.attend(q, params="min_hits=0,max_sample=0")


def test_resolve_percentages_refuses_a_knob_that_is_not_in_tokens(rdata):
    evict = kvindex.index_factory(8, "ProxyEvict50")
    with pytest.raises(ValueError, match="not a count of tokens"):
        kvindex.resolve_percentages("protect=1%", 2000, evict)
    assert kvindex.resolve_percentages("budget=5%", 2000, evict) == "budget=100"
    ivf = kvindex.index_factory(8, "TopK(IVF16,Flat)")
    assert kvindex.resolve_percentages("k=2%,nprobe=4", 1000, ivf) == "k=20,nprobe=4"
    with pytest.raises(ValueError, match="nprobe"):
        kvindex.resolve_percentages("nprobe=50%", 1000, ivf)


def test_time_attend_and_write_trace_name_the_problem(rdata, tmp_path):
    index = build("Flat", rdata)
    with pytest.raises(ValueError, match="no rows"):
        kvindex.time_attend(index, rdata.queries[:0], 1)
    with pytest.raises(ValueError, match=r"layers\[0\] has no 'keys'"):
        kvindex.write_trace(str(tmp_path / "t"), {"n_ctx": 4}, [{"queries": np.zeros((1, 8, 4), np.float32)}])
    # a value of the wrong type names its field, not pybind11's "C++ type '?'"
    with pytest.raises(TypeError, match="d_value"):
        kvindex.index_factory(16, "Flat", d_value=8.0)
    with pytest.raises(TypeError, match="d_value"):
        kvindex.KVCache(1, 2, 1, 8, "Flat", d_value="8")
    layer = {"keys": np.zeros((1, 8, 4), np.float32), "values": np.zeros((1, 8, 4), np.float32),
             "queries": np.zeros((1, 8, 4), np.float32)}
    with pytest.raises(TypeError, match=r"meta\['n_ctx'\]"):
        kvindex.write_trace(str(tmp_path / "t"), {"n_ctx": 6.5}, [layer])
    with pytest.raises(TypeError, match=r"meta\['head_dim'\]"):
        kvindex.write_trace(str(tmp_path / "t"), {"n_ctx": 4, "head_dim": "4"}, [layer])


def test_parameter_functions(rdata):
    index = build("Sink4,Window8,TopK(IVF16,Flat)", rdata)
    kvindex.set_index_parameter(index, "nprobe", 4)
    assert kvindex.get_index_parameter(index, "nprobe") == 4.0
    kvindex.set_index_parameter(index, "k", 20)
    assert kvindex.get_index_parameter(index, "k") == 20.0
    info = kvindex.index_parameter_info(index)
    names = [p.name for p in info]
    assert "k" in names and "nprobe" in names
    for p in info:
        assert isinstance(p.doc, str) and isinstance(p.prefill_time, bool)
    assert tuple(kvindex.parse_index_spec("TopK(IVF64,Flat)|nprobe=8")) == ("TopK(IVF64,Flat)", "nprobe=8")
    assert tuple(kvindex.parse_index_spec("Flat")) == ("Flat", "")


def test_proxy_evict_prefill_time_knob(rdata):
    index = kvindex.index_factory(rdata.keys.shape[1], "ProxyEvict20")
    kvindex.set_index_parameters(index, "budget=123")
    index.prefill(rdata.keys, rdata.values, queries=rdata.prompt_queries)
    ids, _ = selection_arrays(index.select(rdata.queries[:1])[0])
    assert len(ids) == 123
    info = {p.name: p for p in kvindex.index_parameter_info(index)}
    assert info["budget"].prefill_time


def test_k_is_refused_where_no_index_reads_it(rdata):
    # "LSHSample...|k=5" used to be taken and do nothing: only the chains
    # that read a top-k budget have k
    q = rdata.queries
    for factory in ["Flat", "Sink4,Window64,LSHSample6x40", "ProxyEvict20"]:
        index = build(factory, rdata)
        assert "k" not in [p.name for p in kvindex.index_parameter_info(index)], factory
        assert not hasattr(index, "k"), factory
        with pytest.raises(AttributeError, match="no k"):
            index.k = 5
        with pytest.raises(ValueError, match="unknown parameter 'k'"):
            kvindex.set_index_parameters(index, "k=5")
        with pytest.raises(ValueError, match="'k' is not a search-time parameter"):
            index.attend(q, params={"k": 5})
    # a chain holding a top-k has it, however deep
    index = build("ProxyEvict20,Sink4,Window64,TopK(Flat)", rdata)
    index.k = 5
    assert kvindex.get_index_parameter(index, "k") == 5.0
    assert all(len(s.ids) <= 5 + 4 + 64 for s in index.select(q))


def test_a_cache_hands_one_params_to_every_layer(rdata):
    # a decode loop passes the sparse string's k to every layer: the dense
    # layer drops it (another layer reads it); a knob no layer reads raises
    d, n = rdata.keys.shape[1], 200
    cache = kvindex.KVCache(2, 2, 1, d, "TopK(Flat)", dense_layers=[0])
    for layer in range(2):
        cache.prefill(layer, rdata.keys[None, :n], rdata.values[None, :n])
    q = rdata.queries[:1]
    q2 = np.concatenate([q, q])[:, None, :]
    dense, _ = cache.attend(0, q2, params={"k": 5})
    ref, _ = kvref.attend(q, rdata.keys[:n], rdata.values[:n])
    assert kvref.rel_err(dense[0], ref).max() < 1e-5
    sparse, _ = cache.attend(1, q2, params={"k": 5})
    ref5, _ = kvref.topk_attend(q, rdata.keys[:n], rdata.values[:n], 5)
    assert kvref.rel_err(sparse[0], ref5).max() < 1e-5
    with pytest.raises(ValueError, match="nprobe"):
        cache.attend(1, q2, params={"nprobe": 2})


def test_k_attribute_exactly_where_k_is_listed(rdata):
    # a Hybrid whose heavy part reads no k still lists its Uniform tail's
    index = build("Hybrid(IVFAsym4,Uniform)", rdata)
    assert "k" in [p.name for p in kvindex.index_parameter_info(index)]
    index.k = 5
    assert index.k == 5 == kvindex.get_index_parameter(index, "k")
    # a call hands k to the heavy part only, which has none: a ValueError
    # naming it, as for any per-call name no index reads
    with pytest.raises(ValueError, match="'k' is not a search-time parameter"):
        index.attend(rdata.queries[:1], params={"k": 5})
