"""attend / search / select of every registered index type against the
float64 numpy reference, on random and out-of-distribution data.

Tolerances: float32 kernels vs float64 reference, relative L2 error of the
output < 1e-5 and |lse - ref| < 1e-5 + 1e-5 |ref| for exact attention; the
estimator recomputed from select's own ids and inclusion within 1e-4 (it
re-derives scores in float64 from float32 u).
"""
import numpy as np
import pytest

import kvindex
import kvref
from conftest import (FACTORY_BY_TYPE, attr, build, registry_and_extra_factories,
                      registry_factories, registry_names, row_field, selection_arrays, stored)

EXACT_RTOL = 1e-5


def assert_attend_close(out, lse, ref_out, ref_lse, rtol=EXACT_RTOL):
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    err = kvref.rel_err(out, ref_out)
    assert err.max() < rtol, f"max relative error {err.max():.3g} >= {rtol}"
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite), (lse, ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=rtol, atol=rtol)
    assert np.all(lse[~finite] == -np.inf)


# ---- the registry ---------------------------------------------------------

def test_every_registry_type_is_covered():
    names = registry_names()
    assert names, "kvindex.index_types() is empty"
    missing = [n for n in names if n not in FACTORY_BY_TYPE]
    assert not missing, (f"registered types without a test factory string: {missing}; "
                         "add them to FACTORY_BY_TYPE in tests/conftest.py")


def test_registry_rows_describe_themselves():
    """Each row: (name, grammar, doc, fourcc, record version)."""
    for row in kvindex.index_types():
        for pos, field in enumerate(["name", "grammar", "doc"]):
            v = row_field(row, field, pos)
            assert isinstance(v, str) and v, (field, row)
        assert int(row_field(row, "record_version", 4)) >= 1
        assert len(str(row_field(row, "fourcc", 3))) == 4


@pytest.mark.parametrize("type_name", sorted(FACTORY_BY_TYPE))
def test_factory_builds_its_type(type_name, rdata):
    s = FACTORY_BY_TYPE[type_name]
    index = kvindex.index_factory(rdata.keys.shape[1], s)
    assert attr(index, "type_name") == type_name
    assert isinstance(index, kvindex.KVIndex)
    assert kvindex.index_factory_string(index) == s
    assert index.factory_string() == s
    assert index.ntotal == 0 and index.d == rdata.keys.shape[1]
    assert index.d_value == rdata.keys.shape[1]


# ---- every type: select, attend and search agree with each other ----------

@pytest.mark.parametrize("factory", registry_and_extra_factories())
def test_attend_is_the_estimator_over_select(factory, data):
    """attend = softmax(s_i - log u_i) . v over select's ids, for any index:
    recomputed in float64 from the stored keys and values of those ids."""
    index = build(factory, data)
    q = data.queries
    out, lse = index.attend(q)
    sels = index.select(q)
    assert len(sels) == q.shape[0]
    assert out.shape == (q.shape[0], index.d_value)
    for i, sel in enumerate(sels):
        ids, inc = selection_arrays(sel)
        assert ids.dtype == np.int64 and inc.dtype == np.float32
        assert ids.shape == inc.shape
        assert len(np.unique(ids)) == len(ids), "selection repeats ids"
        assert np.all((ids >= 0) & (ids < index.ntotal))
        assert np.all((inc > 0) & (inc <= 1)), inc
        assert sel.n_scanned >= 0
        keys, vals = stored(index, ids)
        ref_out, ref_lse = kvref.estimate(kvref.scores(q[i:i + 1], keys)[0], vals, np.log(inc))
        if not np.isfinite(ref_lse):
            assert lse[i] == -np.inf and not out[i].any()
            continue
        err = kvref.rel_err(out[i], ref_out)
        assert err < 1e-4, f"query {i}: relative error {err:.3g} ({len(ids)} selected)"
        assert abs(lse[i] - ref_lse) < 1e-4 * (1 + abs(ref_lse))


@pytest.mark.parametrize("factory", registry_and_extra_factories())
def test_search_ranks_by_inner_product(factory, data):
    """search: unscaled inner products of the labels, descending, -1 padding
    at the end only, labels among the tokens the index holds."""
    index = build(factory, data)
    q = data.queries
    k = 20
    D, I = index.search(q, k)
    assert D.shape == (q.shape[0], k) and I.shape == (q.shape[0], k)
    assert D.dtype == np.float32 and I.dtype == np.int64
    for i in range(q.shape[0]):
        found = I[i] >= 0
        nf = int(found.sum())
        assert np.all(found[:nf]) and not np.any(found[nf:]), I[i]
        assert np.all(D[i, nf:] == np.finfo(np.float32).min)
        assert len(np.unique(I[i, :nf])) == nf
        assert np.all(np.diff(D[i, :nf].astype(np.float64)) <= 0), D[i]
        keys, _ = stored(index, I[i, :nf])
        ip = keys.astype(np.float64) @ q[i].astype(np.float64)
        np.testing.assert_allclose(D[i, :nf], ip, rtol=1e-5, atol=1e-4)


# ---- exact types against the reference ------------------------------------

@pytest.mark.parametrize("factory", ["Flat", "Sink4,Window64,Flat", "Sink0,Window5,Flat"])
def test_exact_attend_matches_reference(factory, data):
    index = build(factory, data)
    out, lse = index.attend(data.queries)
    ref_out, ref_lse = kvref.attend(data.queries, data.keys, data.values)
    assert_attend_close(out, lse, ref_out, ref_lse)


def test_flat_select_is_every_token(data):
    index = build("Flat", data)
    for sel in index.select(data.queries[:4]):
        ids, inc = selection_arrays(sel)
        np.testing.assert_array_equal(ids, np.arange(data.keys.shape[0]))
        assert np.all(inc == 1.0)


@pytest.mark.parametrize("k", [1, 7, 100])
def test_topk_flat_attend_is_softmax_over_exact_topk(k, data):
    index = build("TopK(Flat)", data)
    assert index.k == 100
    if k != 100:
        index.k = k
    out, lse = index.attend(data.queries)
    ref_out, ref_lse = kvref.topk_attend(data.queries, data.keys, data.values, k)
    assert_attend_close(out, lse, ref_out, ref_lse)
    _, I = kvref.topk(data.queries, data.keys, k)
    for sel, ref_ids in zip(index.select(data.queries), I):
        ids, inc = selection_arrays(sel)
        assert set(ids.tolist()) == set(ref_ids.tolist())
        assert np.all(inc == 1.0)


@pytest.mark.parametrize("factory", ["Flat", "TopK(Flat)", "Sink4,Window64,Flat"])
@pytest.mark.parametrize("k", [1, 10, 100])
def test_exact_search_matches_reference(factory, k, data):
    index = build(factory, data)
    D, I = index.search(data.queries, k)
    ref_D, ref_I = kvref.topk(data.queries, data.keys, k)
    np.testing.assert_array_equal(I, ref_I)
    np.testing.assert_allclose(D, ref_D, rtol=1e-5, atol=1e-4)


def test_d_value_differs_from_d(rdata):
    dv = 24
    values = rdata.values[:, :dv].copy()
    for s in ["Flat", "TopK(Flat)", "Sink4,Window64,Flat"]:
        index = kvindex.index_factory(rdata.keys.shape[1], s, d_value=dv)
        assert index.d_value == dv
        index.add_kv(rdata.keys, values)
        out, lse = index.attend(rdata.queries)
        assert out.shape == (rdata.queries.shape[0], dv)
        k = 100 if s.startswith("TopK") else rdata.keys.shape[0]
        ref_out, ref_lse = kvref.topk_attend(rdata.queries, rdata.keys, values, k)
        assert_attend_close(out, lse, ref_out, ref_lse)
        np.testing.assert_array_equal(index.reconstruct_value(5), values[5])


# ---- LSHSample --------------------------------------------------------------

def test_lsh_select_sorted_unique_with_inclusion(data):
    index = build("LSHSample6x40", data)
    assert index.estimator == "unbiased"
    q = data.queries
    sels = index.select(q)
    out, lse = index.attend(q)
    sizes = []
    for i, sel in enumerate(sels):
        ids, inc = selection_arrays(sel)
        sizes.append(len(ids))
        assert np.all(np.diff(ids) > 0), "LSHSample ids must be sorted and unique"
        assert np.all((inc > 0) & (inc <= 1))
        ref_out, ref_lse = kvref.attend(q[i:i + 1], data.keys, data.values,
                                        ids=ids, inclusion=inc)
        if len(ids) == 0:
            assert lse[i] == -np.inf
            continue
        assert kvref.rel_err(out[i], ref_out[0]) < 1e-4
        assert abs(lse[i] - ref_lse[0]) < 1e-4 * (1 + abs(ref_lse[0]))
    # a sample, not everything and not nothing
    assert 0 < np.mean(sizes) < data.keys.shape[0]


def test_lsh_sink_window_merges_static_part_by_lse(data):
    """Sink4,Window64,LSHSample: exact over the static tokens, LSH estimate
    over the rest (the inner index's own selection), merged by lse."""
    n = data.keys.shape[0]
    outer = build("Sink4,Window64,LSHSample6x40", data)
    q = data.queries
    out, lse = outer.attend(q)
    static = np.r_[0:4, n - 64:n]
    for i, sel in enumerate(outer.select(q)):
        ids, inc = selection_arrays(sel)
        assert set(static.tolist()) <= set(ids.tolist())
        assert np.all(inc[np.isin(ids, static)] == 1.0)
        o_s, l_s = kvref.attend(q[i:i + 1], data.keys, data.values, ids=static)
        dyn = ~np.isin(ids, static)
        o_d, l_d = kvref.attend(q[i:i + 1], data.keys, data.values, ids=ids[dyn],
                                inclusion=inc[dyn])
        m = max(l_s[0], l_d[0])
        ws, wd = np.exp(l_s[0] - m), np.exp(l_d[0] - m)
        ref = (ws * o_s[0] + wd * o_d[0]) / (ws + wd)
        ref_lse = m + np.log(ws + wd)
        assert kvref.rel_err(out[i], ref) < 1e-4
        assert abs(lse[i] - ref_lse) < 1e-4 * (1 + abs(ref_lse))


def test_lsh_min_hits_zero_is_exact(data):
    """min_hits = 0: every token is sampled with u = 1, attention is exact."""
    index = build("LSHSample6x40", data)
    out, lse = index.attend(data.queries, params="min_hits=0")
    ref_out, ref_lse = kvref.attend(data.queries, data.keys, data.values)
    assert_attend_close(out, lse, ref_out, ref_lse)


def test_lsh_partition_estimate_is_unbiased():
    """E[exp(lse)] = sum_i exp(s_i): the expectation over the hyperplanes,
    taken by randomly rotating keys and query together (a rotation of the
    data is a fresh draw of Gaussian hyperplanes; scores do not change).
    Tolerance: 5 standard errors of the mean over 300 rotations."""
    rng = np.random.default_rng(5)
    d, n, m = 16, 300, 300
    keys = rng.standard_normal((n, d)).astype(np.float32) + 0.5
    values = rng.standard_normal((n, d)).astype(np.float32)
    q = rng.standard_normal((1, d)).astype(np.float32)
    _, lse_true = kvref.attend(q, keys, values)
    ratios = []
    for _ in range(m):
        r, _ = np.linalg.qr(rng.standard_normal((d, d)))
        kr = (keys.astype(np.float64) @ r).astype(np.float32)
        qr = (q.astype(np.float64) @ r).astype(np.float32)
        index = kvindex.index_factory(d, "LSHSample3x10")
        index.add_kv(kr, values)
        _, lse = index.attend(qr)
        ratios.append(np.exp(np.float64(lse[0]) - lse_true[0]))
    ratios = np.array(ratios)
    sem = ratios.std(ddof=1) / np.sqrt(m)
    assert abs(ratios.mean() - 1.0) < 5 * sem + 1e-3, (ratios.mean(), sem)


# ---- ProxyEvict ---------------------------------------------------------------

def test_proxy_evict_keeps_budget_and_protected(data):
    n = data.keys.shape[0]
    index = build("ProxyEvict20", data)
    assert index.ntotal == n
    q = data.queries
    sels = index.select(q)
    ids0, _ = selection_arrays(sels[0])
    assert len(ids0) == round(0.2 * n)
    assert np.all(np.diff(ids0) > 0)
    # protect 2% of the prompt (Table 4 at 20%): 4 sinks + the rest recent
    n_protect = round(0.02 * n)
    assert set(range(4)) <= set(ids0.tolist())
    assert set(range(n - (n_protect - 4), n)) <= set(ids0.tolist())
    for sel in sels[1:]:  # eviction is per head, not per query
        np.testing.assert_array_equal(selection_arrays(sel)[0], ids0)
    out, lse = index.attend(q)
    ref_out, ref_lse = kvref.attend(q, data.keys, data.values, ids=ids0)
    assert_attend_close(out, lse, ref_out, ref_lse)
    # evicted tokens cannot be reconstructed; kept ones can
    evicted = np.setdiff1d(np.arange(n), ids0)[0]
    with pytest.raises(RuntimeError, match="evicted"):
        index.reconstruct(int(evicted))
    np.testing.assert_array_equal(index.reconstruct(int(ids0[10])), data.keys[ids0[10]])


def test_proxy_evict_keeps_needle_attended_by_proxies(rdata):
    """A key aligned with the proxy queries (the last 20% of the prompt) is
    kept by the score part of the budget."""
    keys = rdata.keys.copy()
    n = keys.shape[0]
    needle = 777
    proxies = rdata.prompt_queries[n - n // 5:]
    keys[needle] = 3.0 * proxies.mean(axis=0) / np.linalg.norm(proxies.mean(axis=0)) * 8
    index = kvindex.index_factory(keys.shape[1], "ProxyEvict20")
    index.prefill(keys, rdata.values, queries=rdata.prompt_queries)
    ids, _ = selection_arrays(index.select(rdata.queries[:1])[0])
    assert needle in ids


def test_proxy_evict_query_positions_and_heads(rdata):
    n = rdata.keys.shape[0]
    nq = 500
    pq = rdata.prompt_queries[n - nq:]
    a = kvindex.index_factory(rdata.keys.shape[1], "ProxyEvict20")
    a.prefill(rdata.keys, rdata.values, queries=pq)
    b = kvindex.index_factory(rdata.keys.shape[1], "ProxyEvict20")
    b.prefill(rdata.keys, rdata.values, queries=pq,
              query_positions=np.arange(n - nq, n, dtype=np.int64))
    sa = selection_arrays(a.select(rdata.queries[:1])[0])[0]
    sb = selection_arrays(b.select(rdata.queries[:1])[0])[0]
    np.testing.assert_array_equal(sa, sb)
    # queries placed at the start of the prompt are outside the proxy window
    c = kvindex.index_factory(rdata.keys.shape[1], "ProxyEvict20")
    with pytest.raises(ValueError, match="no queries"):
        c.prefill(rdata.keys, rdata.values, queries=pq,
                  query_positions=np.arange(nq, dtype=np.int64))
    # a GQA group: (n_query_heads, nq, d)
    g = kvindex.index_factory(rdata.keys.shape[1], "ProxyEvict20")
    g.prefill(rdata.keys, rdata.values, queries=np.stack([pq, pq[::-1].copy()]))
    sg = selection_arrays(g.select(rdata.queries[:1])[0])[0]
    assert len(sg) == len(sa)
    # positions must match the queries
    h = kvindex.index_factory(rdata.keys.shape[1], "ProxyEvict20")
    with pytest.raises(ValueError, match="query_positions"):
        h.prefill(rdata.keys, rdata.values, queries=pq,
                  query_positions=np.arange(3, dtype=np.int64))


def test_proxy_evict_needs_queries(rdata):
    index = kvindex.index_factory(rdata.keys.shape[1], "ProxyEvict20")
    with pytest.raises(ValueError, match="queries"):
        index.prefill(rdata.keys, rdata.values)


def test_proxy_evict_appended_tokens_are_kept(rdata):
    index = build("ProxyEvict20", rdata)
    n = rdata.keys.shape[0]
    rng = np.random.default_rng(3)
    k_new = rng.standard_normal((3, rdata.keys.shape[1])).astype(np.float32)
    v_new = rng.standard_normal((3, rdata.keys.shape[1])).astype(np.float32)
    index.add_kv(k_new, v_new)
    assert index.ntotal == n + 3
    ids, _ = selection_arrays(index.select(rdata.queries[:1])[0])
    assert {n, n + 1, n + 2} <= set(ids.tolist())


# ---- decode: append then attend -------------------------------------------

@pytest.mark.parametrize("factory", ["Flat", "Sink4,Window64,Flat", "TopK(Flat)"])
def test_decode_append_then_attend(factory, rdata):
    n0 = 1500
    index = build(factory, rdata, n=n0)
    k = 100 if "TopK" in factory else None
    for p in range(n0, n0 + 40):
        index.add_kv(rdata.keys[p:p + 1], rdata.values[p:p + 1])
        assert index.ntotal == p + 1
        q = rdata.queries[p % rdata.queries.shape[0]][None]
        out, lse = index.attend(q)
        kk = k or p + 1
        ref_out, ref_lse = kvref.topk_attend(q, rdata.keys[:p + 1], rdata.values[:p + 1], kk)
        assert_attend_close(out, lse, ref_out, ref_lse)


# ---- padding and the empty index ------------------------------------------

@pytest.mark.parametrize("factory", registry_factories())
def test_search_pads_when_k_exceeds_ntotal(factory, small):
    n, k = 10, 16
    index = build(factory, small, n=n)
    D, I = index.search(small.queries, k)
    lowest = np.finfo(np.float32).min
    for i in range(small.queries.shape[0]):
        nf = int((I[i] >= 0).sum())
        assert nf <= n
        assert np.all(I[i, nf:] == -1) and np.all(D[i, nf:] == lowest)
        assert np.all(I[i, :nf] >= 0)
    if factory in ("Flat", "TopK(Flat)", "Sink4,Window64,Flat"):
        ref_D, ref_I = kvref.topk(small.queries, small.keys[:n], k)
        np.testing.assert_array_equal(I, ref_I)
        np.testing.assert_allclose(D, ref_D, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("factory", registry_factories())
def test_empty_index(factory, small):
    """KVIndex::search pads everything on an empty index; select returns
    empty selections; attend refuses (src/KVIndex.cpp)."""
    index = kvindex.index_factory(small.keys.shape[1], factory)
    D, I = index.search(small.queries, 5)
    assert D.shape == (small.queries.shape[0], 5)
    assert np.all(I == -1) and np.all(D == np.finfo(np.float32).min)
    sels = index.select(small.queries)
    assert len(sels) == small.queries.shape[0]
    assert all(len(s.ids) == 0 and len(s.inclusion) == 0 for s in sels)
    with pytest.raises(RuntimeError, match="empty"):
        index.attend(small.queries)


def test_zero_queries(small):
    index = build("Flat", small)
    out, lse = index.attend(np.zeros((0, small.keys.shape[1]), np.float32))
    assert out.shape == (0, small.keys.shape[1]) and lse.shape == (0,)
    D, I = index.search(np.zeros((0, small.keys.shape[1]), np.float32), 3)
    assert D.shape == (0, 3) and I.shape == (0, 3)


# ---- misc methods -----------------------------------------------------------

def test_index_methods(small):
    index = build("Sink4,Window8,TopK(Flat)", small)
    assert index.ntotal == small.keys.shape[0]
    np.testing.assert_array_equal(index.reconstruct(100), small.keys[100])
    np.testing.assert_array_equal(index.reconstruct_value(3), small.values[3])
    # README: library errors are RuntimeError; an out-of-range id may also
    # be an IndexError (checked in the binding, as Python sequences do)
    with pytest.raises((RuntimeError, IndexError), match=str(small.keys.shape[0])):
        index.reconstruct(small.keys.shape[0])
    with pytest.raises((RuntimeError, IndexError)):
        index.reconstruct_value(-1)
    assert index.memory_bytes() >= small.keys.nbytes + small.values.nbytes
    index.check_invariants()
    kids = index.children()
    assert len(kids) == 1 and attr(kids[0], "type_name") == "IndexTopK"
    assert index.kv_type == "f32"
    index.reset()
    assert index.ntotal == 0
    index.add_kv(small.keys, small.values)  # a new sequence
    assert index.ntotal == small.keys.shape[0]


def test_add_is_refused(small):
    index = kvindex.index_factory(small.keys.shape[1], "Flat")
    if hasattr(index, "add"):
        with pytest.raises(RuntimeError, match="add_kv"):
            index.add(small.keys)


def test_k_field_read_write(small):
    index = build("TopK(Flat)", small)
    index.k = 5
    assert index.k == 5
    assert kvindex.get_index_parameter(index, "k") == 5.0
    for sel in index.select(small.queries):
        assert len(sel.ids) == 5


def test_help_text_exists():
    index = kvindex.index_factory(16, "LSHSample6x20")
    assert isinstance(index, kvindex.IndexLSHSample)
    assert type(index).__doc__


@pytest.mark.parametrize("make,factory", [
    (lambda: kvindex.IndexKVFlat(16), "Flat"),
    (lambda: kvindex.IndexKVFlat(16, d_value=8, kv_type="bf16"), "BF16,Flat"),
    (lambda: kvindex.IndexTopK(16, "Flat"), "TopK(Flat)"),
    (lambda: kvindex.IndexLSHSample(16, 6, 20), "LSHSample6x20"),
])
def test_constructors_equal_the_factory(make, factory):
    """faiss-style constructors build the same index as the factory string."""
    rng = np.random.default_rng(77)
    a = make()
    b = kvindex.index_factory(16, factory, d_value=a.d_value)
    assert kvindex.index_factory_string(a) == factory
    keys = rng.standard_normal((500, 16)).astype(np.float32)
    values = rng.standard_normal((500, a.d_value)).astype(np.float32)
    q = rng.standard_normal((3, 16)).astype(np.float32)
    a.add_kv(keys, values)
    b.add_kv(keys, values)
    np.testing.assert_array_equal(a.attend(q)[0], b.attend(q)[0])
    np.testing.assert_array_equal(a.search(q, 5)[1], b.search(q, 5)[1])


def test_constructor_arguments_are_checked():
    with pytest.raises(ValueError, match="K=20"):
        kvindex.IndexLSHSample(16, 20, 20)
    with pytest.raises(ValueError, match="kv_type"):
        kvindex.IndexKVFlat(16, kv_type="fp8")


def test_auto_with_a_budget_keeps_a_candidate_that_reads_within_it():
    # "Auto|budget=5%": the fast families, each measured on held-back prompt
    # queries; what the kept one reads (select's scan + its keys and values)
    # is recomputed here on other queries
    rng = np.random.default_rng(7)
    n, d = 3000, 32
    keys = rng.standard_normal((n, d)).astype(np.float32)
    values = rng.standard_normal((n, d)).astype(np.float32)
    keys[::500] *= 8  # a few heavy hitters
    queries = (keys[::500].mean(0) / 4 + rng.standard_normal((1, 400, d))).astype(np.float32)
    index = kvindex.index_factory(d, "Auto")
    assert isinstance(index, kvindex.IndexChoose)
    assert index.factory_string().startswith("Choose(") and len(index.candidate_strings()) == 4
    kvindex.set_index_parameters(index, kvindex.resolve_percentages("budget=5%", n, index))
    assert kvindex.get_index_parameter(index, "budget") == 150
    index.prefill(keys, values, queries=queries)
    reads = index.reads
    assert reads.shape == (4,) and reads[index.chosen] <= 150
    within = [c for c in range(4) if reads[c] <= 150]
    assert index.chosen == min(within, key=lambda c: index.errors[c])
    # closer to exact attention than a uniform sample of the same 150 tokens
    q = queries[0, -8:]
    ref, _ = kvref.attend(q, keys, values)
    uniform = kvindex.index_factory(d, "Uniform|k=150")
    uniform.add_kv(keys, values)
    assert kvref.rel_err(index.attend(q)[0], ref).mean() < kvref.rel_err(uniform.attend(q)[0], ref).mean()
