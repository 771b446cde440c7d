"""What a probe of the Python API found (2026-11-27): each case crashed,
read freed memory or went silently wrong before, and now raises or stays
valid."""
import numpy as np
import pytest

import kvindex

D = 16


def tokens(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, D)).astype(np.float32),
            rng.standard_normal((n, D)).astype(np.float32))


def test_a_copy_numpy_cannot_make_raises_memory_error():
    # a zero-stride view of 2^40 rows: the contiguous copy cannot be made
    # (the module dereferenced the null array it got back)
    huge = np.broadcast_to(np.zeros((1, D), np.float32), (2 ** 40, D))
    index = kvindex.IndexKVFlat(D)
    with pytest.raises(MemoryError):
        index.attend(huge)
    with pytest.raises(MemoryError):
        kvindex.apply_rope(huge, np.broadcast_to(np.zeros(1, np.int64), (2 ** 40,)))


def test_choose_children_stay_valid_after_prefill():
    # prefill replaces the candidates it drops: children() gives copies
    keys, values = tokens(300, 1)
    queries = np.random.default_rng(2).standard_normal((1, 300, D)).astype(np.float32)
    index = kvindex.index_factory(D, "Choose(TopK(Flat);Flat)")
    kids = index.children()
    assert [k.type_name for k in kids] == ["IndexTopK", "IndexKVFlat"]
    index.prefill(keys, values, queries=queries)
    assert all(k.ntotal == 0 for k in kids)  # copies of the empty candidates
    live = index.children()  # after the choice: the chosen one
    assert len(live) == 1 and live[0].ntotal == 300
    assert live[0].factory_string() == index.chosen_string()
    q = queries[0, -2:]
    np.testing.assert_array_equal(live[0].attend(q)[0], index.attend(q)[0])


@pytest.mark.parametrize("name,spec", [("min_hits", "LSHSample6x40"), ("efSearch", "TopK(HNSW8)")])
def test_int_knobs_above_int_max_are_refused(name, spec):
    keys, values = tokens(300, 3)
    index = kvindex.index_factory(D, spec)
    index.add_kv(keys, values)
    for bad in (2 ** 31, 2 ** 32, 10 ** 12, 2.0 ** 70):
        with pytest.raises(ValueError, match=name):
            index.select(keys[:1], params={name: bad})


def test_topk_training_sizes_are_checked_when_set():
    index = kvindex.IndexTopK(D, "IVF4,Flat")
    with pytest.raises(ValueError, match="max_train_points"):
        index.max_train_points = 2 ** 40
    index.max_train_points = 4096
    assert index.max_train_points == 4096


def test_nul_in_a_path_is_refused(tmp_path):
    index = kvindex.IndexKVFlat(D)
    with pytest.raises(ValueError, match="null byte"):
        kvindex.write_index(index, str(tmp_path / "a\0.kvix"))
    with pytest.raises(ValueError, match="null byte"):
        kvindex.read_index(str(tmp_path / "a\0.kvix"))
    assert not (tmp_path / "a").exists()


def test_ivf_asym_diagnostics_check_their_query():
    rng = np.random.default_rng(4)
    keys, values = tokens(600, 5)
    queries = rng.standard_normal((1, 600, D)).astype(np.float32)
    index = kvindex.index_factory(D, "IVFAsym4_Moment")
    index.prefill(keys, values, queries=queries)
    q = queries[0, -1:].copy()
    assert index.probe_buckets(q, 2).shape == (2,)
    # the C++ methods check, as attend does (RuntimeError, like attend's)
    for bad in (np.nan, np.inf, 1e30):
        q[0, 3] = bad
        with pytest.raises(ValueError, match="non-finite|too large"):
            index.probe_buckets(q, 2)
        with pytest.raises(ValueError, match="non-finite|too large"):
            index.moment_log_masses(q)
    q[0, 3] = 0.0
    with pytest.raises(ValueError, match="position=-1"):
        index.probe_buckets(q, 2, position=-1)


def test_a_child_written_through_is_refused_by_its_parent():
    keys, values = tokens(300, 8)
    index = kvindex.index_factory(D, "Sink4,Window8,TopK(Flat)")
    index.add_kv(keys[:200], values[:200])
    q = keys[250:251]
    index.attend(q)
    inner = index.children()[0]
    inner.add_kv(keys[200:203], values[200:203])
    with pytest.raises(RuntimeError, match="written through a reference"):
        index.attend(q)
    index.reset()
    index.add_kv(keys[:200], values[:200])
    out, lse = index.attend(q)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    # reset and refilled to the same count: the counts agree, the child's
    # token stamp does not
    inner = index.children()[0]
    held = inner.ntotal
    inner.reset()
    inner.add_kv(*tokens(held, 11))
    assert inner.ntotal == held
    with pytest.raises(RuntimeError, match="written through a reference"):
        index.attend(q)
    index.reset()


def test_a_cache_head_written_through_is_refused_by_its_layer():
    rng = np.random.default_rng(9)
    cache = kvindex.KVCache(2, 4, 2, D, "Flat")
    for layer in range(2):
        kv = rng.standard_normal((2, 2, 20, D)).astype(np.float32)
        cache.prefill(layer, kv[0], kv[1])
    cache.check_invariants()
    head = cache.index(1, 0)
    head.add_kv(*tokens(3, 10))
    q = rng.standard_normal((4, 1, D)).astype(np.float32)
    with pytest.raises(RuntimeError, match="KV head 1 holds 20 tokens, head 0 23"):
        cache.attend(1, q)
    with pytest.raises(RuntimeError, match="layer 1"):
        cache.check_invariants()
    out, lse = cache.attend(0, q)  # the other layer is untouched
    assert np.isfinite(out).all()


def _trace_layers(seed, n_layers=2):
    r = np.random.default_rng(seed)
    f = lambda h: r.standard_normal((h, 10, 8)).astype(np.float32)
    return [{"keys": f(2), "values": f(2), "queries": f(4)} for _ in range(n_layers)]


def test_a_refused_write_trace_writes_nothing(tmp_path):
    # layer 1 is refused: the meta and layer 0 used to be written already,
    # and mixed with an older trace in the same directory
    d = str(tmp_path / "trace")
    old = _trace_layers(1)
    kvindex.write_trace(d, {"n_ctx": 8, "source": "old"}, old)
    new = _trace_layers(2)
    new[1]["values"] = new[1]["values"][:, :, :4]
    with pytest.raises(ValueError, match=r"layers\[1\]\['values'\]"):
        kvindex.write_trace(d, {"n_ctx": 5, "source": "new"}, new)
    new = _trace_layers(2)
    new[1]["keys"][0, 3, 2] = 1e6  # beyond float16
    with pytest.raises(ValueError, match=r"layers\[1\]\['keys'\].*overflows float16"):
        kvindex.write_trace(d, {"n_ctx": 5, "source": "new", "dtype": "float16"}, new)
    meta, layers = kvindex.read_trace(d)
    assert meta["source"] == "old" and meta["n_ctx"] == 8
    for got, want in zip(layers, old):
        assert np.array_equal(got["keys"], want["keys"])
    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError):
        kvindex.write_trace(str(fresh), {"n_ctx": 5}, new[:1] + [{"keys": new[1]["keys"][:1]}])
    assert not fresh.exists()


@pytest.mark.parametrize("make", [
    lambda: kvindex.IndexKVFlat(70000),
    lambda: kvindex.IndexKVFlat(8, d_value=0),
    lambda: kvindex.IndexKVFlat(0),
    lambda: kvindex.IndexRoarGraph(0),
    lambda: kvindex.IndexTopK(8, "Flat", d_value=70000),
])
def test_constructors_refuse_dimensions_the_reader_refuses(make):
    # such an index used to work, pickle, and then fail to unpickle
    with pytest.raises(ValueError, match="must be in"):
        make()


@pytest.mark.parametrize("spec", ["TopK(Flat)", "Sink4,Window16,TopK(Flat)", "Hybrid(TopK(Flat),Uniform)"])
def test_setting_k_reaches_the_budget_a_select_uses(spec):
    rng = np.random.default_rng(5)
    keys = rng.standard_normal((300, 16)).astype(np.float32)
    index = kvindex.index_factory(16, spec)
    index.add_kv(keys, keys)
    q = rng.standard_normal((1, 16)).astype(np.float32)
    before = len(index.select(q)[0].ids)
    index.k = 5
    assert index.k == 5
    assert kvindex.get_index_parameter(index, "k") == 5
    after = len(index.select(q)[0].ids)
    assert after < before  # the wrapper's inner budget, not an unused field


def test_kv_head_of_refuses_a_query_head_out_of_range():
    cache = kvindex.KVCache(1, 4, 2, 8, "Flat")
    assert [cache.kv_head_of(h) for h in range(4)] == [0, 0, 1, 1]
    for bad in (-1, 4, 7):
        with pytest.raises(IndexError, match="q_head"):
            cache.kv_head_of(bad)


# ---- the hostile probe of 2026-12-06 (issue 66) --------------------------------

def test_search_k_must_be_an_integer_not_a_bool():
    index = kvindex.index_factory(D, "Flat")
    index.add_kv(*tokens(10))
    q = tokens(1, 1)[0]
    for bad in (True, False, 2.0, "3"):
        with pytest.raises(TypeError, match="k must be an integer"):
            index.search(q, bad)
    D_, I = index.search(q, np.int64(3))  # a numpy integer is an integer
    assert I.shape == (1, 3)


def test_an_integer_knob_above_2_53_is_echoed_as_given():
    index = kvindex.index_factory(D, "TopK(Flat)")
    with pytest.raises(ValueError, match="'9223372036854775807' is above 2\\^53"):
        kvindex.set_index_parameters(index, "k=9223372036854775807")


def test_ivf_asym_with_nprobe_0_answers_with_its_static_part_or_nothing():
    # documented (contracts.md): a bare index reads no bucket, its answer is
    # the empty selection's (out = 0, lse = -inf); under a sink and window,
    # those answer exactly
    keys, values = tokens(1024)
    q = tokens(1, 2)[0]
    bare = kvindex.index_factory(D, "IVFAsym4")
    bare.prefill(keys, values)  # every key in a bucket (add_kv alone leaves them unassigned, always read)
    kvindex.set_index_parameters(bare, "nprobe=0")
    out, lse = bare.attend(q)
    assert lse[0] == -np.inf and not out.any()
    D_, I = bare.search(q, 3)
    assert (I == -1).all()
    framed = kvindex.index_factory(D, "Sink1,Window7,IVFAsym4")
    framed.prefill(keys, values)
    kvindex.set_index_parameters(framed, "nprobe=0")
    out, lse = framed.attend(q)
    ids = [0] + list(range(1017, 1024))
    s = keys[ids] @ q[0] / np.sqrt(D)
    w = np.exp(s - s.max())
    assert np.allclose(out[0], (w / w.sum()) @ values[ids], atol=1e-5)
