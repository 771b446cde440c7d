"""KVCache: head-major shapes, GQA (query head h reads KV head h // group)
against a per-head float64 reference, append then attend, cache.index."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvindex
import kvref
from conftest import attr

L, HQ, HKV, DH, N = 2, 4, 2, 32, 300


@pytest.fixture(scope="module")
def model_data():
    rng = np.random.default_rng(21)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    layers = []
    for _ in range(L):
        layers.append(dict(keys=f(HKV, N, DH) + 1.0, values=f(HKV, N, DH),
                           queries=2 * f(HQ, N, DH)))
    return layers


def reference(keys, values, q, k=None):
    """keys/values (HKV, n, d), q (HQ, m, d) -> out (HQ, m, dv), lse (HQ, m)."""
    group = q.shape[0] // keys.shape[0]
    outs, lses = [], []
    for h in range(q.shape[0]):
        kv = h // group
        if k is None:
            o, l_ = kvref.attend(q[h], keys[kv], values[kv])
        else:
            o, l_ = kvref.topk_attend(q[h], keys[kv], values[kv], k)
        outs.append(o)
        lses.append(l_)
    return np.stack(outs), np.stack(lses)


def check(out, lse, ref_out, ref_lse, tol=1e-5):
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert kvref.rel_err(out, ref_out).max() < tol
    np.testing.assert_allclose(lse, ref_lse, rtol=tol, atol=tol)


@pytest.mark.parametrize("s,k", [("Flat", None), ("TopK(Flat)", 100), ("Sink4,Window32,Flat", None)])
def test_gqa_prefill_append_attend(s, k, model_data):
    n_ctx = 250
    cache = kvindex.KVCache(L, HQ, HKV, DH, s)
    for layer, t in enumerate(model_data):
        cache.prefill(layer, t["keys"][:, :n_ctx], t["values"][:, :n_ctx],
                      queries=t["queries"][:, :n_ctx])
        assert cache.n_tokens(layer) == n_ctx
    for p in range(n_ctx, n_ctx + 5):
        for layer, t in enumerate(model_data):
            cache.append(layer, t["keys"][:, p:p + 1], t["values"][:, p:p + 1])
            assert cache.n_tokens(layer) == p + 1
            q = t["queries"][:, p:p + 1]
            out, lse = cache.attend(layer, q)
            assert out.shape == (HQ, 1, DH) and lse.shape == (HQ, 1)
            check(out, lse, *reference(t["keys"][:, :p + 1], t["values"][:, :p + 1], q, k))
    # several queries per head in one call
    t = model_data[1]
    q = t["queries"][:, 10:17]
    out, lse = cache.attend(1, q)
    check(out, lse, *reference(t["keys"][:, :n_ctx + 5], t["values"][:, :n_ctx + 5], q, k))
    assert cache.memory_bytes() > 0


def test_params_per_call(model_data):
    t = model_data[0]
    cache = kvindex.KVCache(1, HQ, HKV, DH, "TopK(Flat)")
    cache.prefill(0, t["keys"], t["values"])
    q = t["queries"][:, :3]
    a = cache.attend(0, q, params="k=10")
    b = cache.attend(0, q, params={"k": 10})
    np.testing.assert_array_equal(a[0], b[0])
    check(*a, *reference(t["keys"], t["values"], q, 10))


def test_a_layer_vote_keeps_the_same_positions_in_every_kv_head(model_data):
    # TOVA voting over the layer: the last query of every query head scores
    # against its own KV head's keys; each KV head keeps the top 60 of the sum
    t = model_data[0]
    cache = kvindex.KVCache(1, HQ, HKV, DH, "ProxyEvict20_TOVA|layer_vote=1")
    cache.prefill(0, t["keys"], t["values"], queries=t["queries"])
    f = np.zeros(N)
    for h in range(HQ):
        s = t["keys"][h // (HQ // HKV)].astype(np.float64) @ t["queries"][h, -1] / np.sqrt(DH)
        w = np.exp(s - s.max())
        f += w / w.sum()
    want = np.sort(np.argsort(-f, kind="stable")[:60])
    for h in range(HKV):
        np.testing.assert_array_equal(cache.index(0, h).positions, want)
    alone = kvindex.KVCache(1, HQ, HKV, DH, "ProxyEvict20_TOVA")
    alone.prefill(0, t["keys"], t["values"], queries=t["queries"])
    assert not np.array_equal(alone.index(0, 0).positions, alone.index(0, 1).positions)
    lone = kvindex.index_factory(DH, "ProxyEvict20_TOVA|layer_vote=1")
    with pytest.raises(ValueError, match="through a KVCache"):
        lone.prefill(t["keys"][0], t["values"][0], queries=t["queries"][:2])


def test_head_budgets_share_the_layers_tokens_by_score(model_data):
    # AdaKV over TOVA: each KV head scores with the last query of its own
    # query heads; each keeps its top 20% of 60 first, and the layer's other
    # picks go to the highest scores of any head
    t = model_data[0]
    cache = kvindex.KVCache(1, HQ, HKV, DH, "ProxyEvict20_TOVA|head_budget=1")
    cache.prefill(0, t["keys"], t["values"], queries=t["queries"])
    g = HQ // HKV
    f = np.zeros((HKV, N))
    for h in range(HQ):
        s = t["keys"][h // g].astype(np.float64) @ t["queries"][h, -1] / np.sqrt(DH)
        w = np.exp(s - s.max())
        f[h // g] += w / w.sum()
    floor = 12
    want = [list(np.argsort(-f[h], kind="stable")[:floor]) for h in range(HKV)]
    rest = sorted((-f[h, j], h, j) for h in range(HKV) for j in range(N) if j not in want[h])
    for _, h, j in rest[:HKV * (60 - floor)]:
        want[h].append(j)
    sizes = [len(cache.index(0, h).positions) for h in range(HKV)]
    for h in range(HKV):
        np.testing.assert_array_equal(cache.index(0, h).positions, np.sort(want[h]))
    assert sum(sizes) == 60 * HKV and len(set(sizes)) > 1, sizes
    lone = kvindex.index_factory(DH, "ProxyEvict20_TOVA|head_budget=1")
    with pytest.raises(ValueError, match="through a KVCache"):
        lone.prefill(t["keys"][0], t["values"][0], queries=t["queries"][:2])


def test_dense_layers_and_d_value(model_data):
    dv = 16
    cache = kvindex.KVCache(L, HQ, HKV, DH, "TopK(Flat)", d_value=dv, dense_string="Flat",
                            dense_layers=[0])
    assert attr(cache.index(0, 0), "type_name") == "IndexKVFlat"
    assert attr(cache.index(1, 1), "type_name") == "IndexTopK"
    for layer, t in enumerate(model_data):
        cache.prefill(layer, t["keys"], t["values"][:, :, :dv].copy(),
                      queries=t["queries"], positions=np.arange(N, dtype=np.int64),
                      rope_theta=10000.0, rope_style="half")
    q = model_data[0]["queries"][:, :2]
    out, lse = cache.attend(0, q)
    assert out.shape == (HQ, 2, dv)
    check(out, lse, *reference(model_data[0]["keys"], model_data[0]["values"][:, :, :dv], q))


def test_cache_index_is_usable_and_live(model_data):
    t = model_data[0]
    cache = kvindex.KVCache(L, HQ, HKV, DH, "Flat")
    cache.prefill(0, t["keys"][:, :200], t["values"][:, :200])
    idx = cache.index(0, 1)
    assert isinstance(idx, kvindex.KVIndex)
    assert idx.ntotal == 200
    out, lse = idx.attend(t["queries"][3, :4])
    ref_out, ref_lse = kvref.attend(t["queries"][3, :4], t["keys"][1, :200], t["values"][1, :200])
    assert kvref.rel_err(out, ref_out).max() < 1e-5
    # the same index, seen live: appends through the cache show up
    cache.append(0, t["keys"][:, 200:203], t["values"][:, 200:203])
    assert idx.ntotal == 203
    np.testing.assert_array_equal(idx.reconstruct(202), t["keys"][1, 202])
    with pytest.raises((IndexError, ValueError, RuntimeError)):
        cache.index(0, HKV)
    with pytest.raises((IndexError, ValueError, RuntimeError)):
        cache.index(L, 0)


KEEPALIVE = textwrap.dedent("""
    import gc
    import numpy as np
    import kvindex
    rng = np.random.default_rng(0)
    cache = kvindex.KVCache(1, 2, 1, 16, "Flat")
    k = rng.standard_normal((1, 50, 16)).astype(np.float32)
    cache.prefill(0, k, k)
    idx = cache.index(0, 0)
    del cache
    gc.collect()
    for _ in range(3):
        junk = [np.ones(1000) for _ in range(100)]
    out, lse = idx.attend(rng.standard_normal((2, 16)).astype(np.float32))
    assert idx.ntotal == 50 and np.isfinite(out).all()
    print("ok")
""")


def test_cache_index_keeps_cache_alive():
    """An index handed out by cache.index stays usable after the last
    reference to the cache is dropped (no use-after-free): subprocess, so
    that a crash fails this test only."""
    r = subprocess.run([sys.executable, "-c", KEEPALIVE], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_cache_shape_errors(model_data):
    t = model_data[0]
    cache = kvindex.KVCache(L, HQ, HKV, DH, "Flat")
    with pytest.raises(ValueError, match="keys"):
        cache.prefill(0, t["keys"][:1], t["values"][:1])  # 1 KV head, not 2
    with pytest.raises(ValueError):
        cache.prefill(0, t["keys"], t["values"][:, :10])  # token counts differ
    cache.prefill(0, t["keys"], t["values"])
    with pytest.raises(ValueError, match="q"):
        cache.attend(0, t["queries"][:3, :2])  # 3 query heads, not 4
    with pytest.raises(ValueError):
        cache.attend(0, t["queries"][:, :2, :16])  # wrong d
    with pytest.raises((IndexError, ValueError, RuntimeError)):
        cache.attend(L, t["queries"][:, :2])
    with pytest.raises((ValueError, RuntimeError)):
        kvindex.KVCache(1, 3, 2, DH, "Flat")  # 3 query heads over 2 KV heads
    with pytest.raises((ValueError, RuntimeError), match="Bogus"):
        kvindex.KVCache(1, 2, 1, DH, "Bogus17")


def test_append_one_head_cannot_hold_leaves_every_head_and_reset_empties(model_data):
    """A key the second head's FP16 storage cannot hold is refused before
    the first head takes the token; reset() empties every layer."""
    t = model_data[0]
    cache = kvindex.KVCache(L, HQ, HKV, DH, "FP16,TopK(Flat)|k=20")
    for layer in range(L):
        cache.prefill(layer, t["keys"][:, :100], t["values"][:, :100])
    k = t["keys"][:, 100:102].copy()
    k[1, 1, 5] = 1e5  # above fp16's 65504, in KV head 1 only
    with pytest.raises(ValueError, match="KV head 1: keys: value 100000 at row 1, column 5 does not fit f16"):
        cache.append(0, k, t["values"][:, 100:102])
    assert [cache.index(0, h).ntotal for h in range(HKV)] == [100, 100]
    cache.check_invariants()
    cache.append(0, t["keys"][:, 100:102], t["values"][:, 100:102])
    assert cache.n_tokens(0) == 102
    cache.reset()
    assert [cache.n_tokens(layer) for layer in range(L)] == [0, 0]
    cache.prefill(0, t["keys"][:, :50], t["values"][:, :50])
    out, _ = cache.attend(0, t["queries"][:, :2])
    ref, _ = reference(t["keys"][:, :50], t["values"][:, :50], t["queries"][:, :2], k=20)
    assert kvref.rel_err(out, ref).max() < 2e-3  # fp16 storage's rounding


def test_adopt_trained_checks_every_head_before_any_adopts(model_data):
    """A cache adopts a trained cache's IVFAsym models into every head, or,
    refused (a layer already prefilled), into none."""
    s = "Sink1,Window32,IVFAsym8"
    trained = kvindex.KVCache(L, HQ, HKV, DH, s)
    for layer in range(L):
        t = model_data[layer]
        trained.prefill(layer, t["keys"], t["values"], queries=t["queries"])  # self-trains
    cache = kvindex.KVCache(L, HQ, HKV, DH, s)
    t = model_data[1]
    cache.prefill(1, t["keys"][:, :100], t["values"][:, :100], queries=t["queries"][:, :100])
    with pytest.raises(ValueError, match="layer 1, KV head 0: IndexIVFAsym: models can only be set on an empty"):
        cache.adopt_trained(trained)
    assert not any(cache.index(0, h).children()[0].adopted for h in range(HKV))
    cache.reset()
    assert cache.adopt_trained(trained) == L * HKV
    for layer in range(L):
        for h in range(HKV):
            np.testing.assert_array_equal(cache.index(layer, h).children()[0].centroids,
                                          trained.index(layer, h).children()[0].centroids)
    with pytest.raises(ValueError, match="same factory string"):
        cache.adopt_trained(kvindex.KVCache(L, HQ, HKV, DH, "Flat"))


@pytest.mark.parametrize("s", ["TopK(Flat)", "Sink4,Window32,LSHSample6x20", "RoarGraph16|k=20"])
def test_cache_saved_mid_decode_decodes_on_alike(s, model_data, tmp_path):
    """write/read, serialize/deserialize, pickle and copy of a whole cache
    after some decode steps: each copy decodes on exactly as the original,
    and appending to a copy leaves the original as it was."""
    import copy
    import pickle
    n_ctx = 200
    cache = kvindex.KVCache(L, HQ, HKV, DH, s, dense_layers=[0])
    for layer, t in enumerate(model_data):
        cache.prefill(layer, t["keys"][:, :n_ctx], t["values"][:, :n_ctx],
                      queries=t["queries"][:, :n_ctx])

    def step(c, p):
        outs = []
        for layer, t in enumerate(model_data):
            c.append(layer, t["keys"][:, p:p + 1], t["values"][:, p:p + 1])
            outs.append(c.attend(layer, t["queries"][:, p:p + 1]))
        return outs

    for p in range(n_ctx, n_ctx + 10):
        step(cache, p)
    path = str(tmp_path / "cache.kvcache")
    kvindex.write_cache(cache, path)
    copies = [kvindex.read_cache(path),
              kvindex.deserialize_cache(kvindex.serialize_cache(cache)),
              kvindex.deserialize_cache(bytes(kvindex.serialize_cache(cache))),
              pickle.loads(pickle.dumps(cache)), copy.copy(cache), copy.deepcopy(cache)]
    for c in copies:
        assert [c.n_tokens(layer) for layer in range(L)] == [n_ctx + 10] * L
        assert c.index_string == cache.index_string and c.dense_layers == [0]
    for p in range(n_ctx + 10, n_ctx + 20):
        want = step(cache, p)
        for c in copies:
            for (o, lse), (wo, wl) in zip(step(c, p), want):
                np.testing.assert_array_equal(o, wo)
                np.testing.assert_array_equal(lse, wl)
    # the copies are the copies' own
    assert [cache.n_tokens(layer) for layer in range(L)] == [n_ctx + 20] * L
    step(copies[0], n_ctx + 20)
    assert cache.n_tokens(1) == n_ctx + 20 and copies[0].n_tokens(1) == n_ctx + 21


def test_cache_io_errors(tmp_path):
    with pytest.raises(ValueError, match="deserialize_cache"):
        kvindex.deserialize_cache(np.zeros((2, 2), dtype=np.uint8))
    cache = kvindex.KVCache(1, HQ, HKV, DH, "Flat")
    buf = kvindex.serialize_cache(cache)
    with pytest.raises(ValueError, match="read_cache: buffer of"):
        kvindex.deserialize_cache(buf[: len(buf) // 2])
    with pytest.raises(FileNotFoundError):
        kvindex.read_cache(str(tmp_path / "missing.kvcache"))


def test_merge_attention_over_disjoint_key_sets():
    # S parts of one key set, each attended apart (float64 reference), merged:
    # the attention over the whole set; an empty part (lse -inf) weighs nothing
    rng = np.random.default_rng(5)
    heads, n, d, dv = 3, 2, 8, 5
    keys, values = rng.standard_normal((40, d)), rng.standard_normal((40, dv))
    q = 2 * rng.standard_normal((heads, n, d))
    cuts = [0, 7, 7, 25, 40]  # the second part is empty
    outs, lses = [], []
    for a, b in zip(cuts, cuts[1:]):
        o, lse = np.zeros((heads, n, dv)), np.full((heads, n), -np.inf)
        if b > a:
            for h in range(heads):
                o[h], lse[h] = kvref.attend(q[h], keys[a:b], values[a:b])
        outs.append(o)
        lses.append(lse)
    out, lse = kvindex.merge_attention(np.array(outs, np.float32), np.array(lses, np.float32))
    ref = [kvref.attend(q[h], keys, values) for h in range(heads)]
    check(out, lse, np.stack([r[0] for r in ref]), np.stack([r[1] for r in ref]))
    # every part empty: out 0, lse -inf
    out, lse = kvindex.merge_attention(np.zeros((2, 1, dv)), np.full((2, 1), -np.inf))
    assert (out == 0).all() and np.isneginf(lse).all()
    with pytest.raises(ValueError, match=r"lses \(S, \.\.\.\).*got outs \(2, 3, 5\), lses \(2, 4\)"):
        kvindex.merge_attention(np.zeros((2, 3, 5)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="S >= 1 parts"):
        kvindex.merge_attention(np.zeros((0, 3, 5)), np.zeros((0, 3)))
    with pytest.raises(RuntimeError, match="part 1 has lse nan"):
        kvindex.merge_attention(np.zeros((2, 1, 5)), np.array([[0.0], [np.nan]]))
