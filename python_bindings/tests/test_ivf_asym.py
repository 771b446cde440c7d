"""IndexIVFAsym from Python: buckets, probing by a float64 numpy reference
(keys de-RoPEd by kvref.rope, nearest centroid), exact attention at
nprobe = C, per-call nprobe, adopted models and io."""
import numpy as np
import pytest

import kvindex
import kvref

THETA = 10000.0


def prompt(n=1200, d=16, heads=2, seed=3):
    """Post-RoPE keys in clusters, queries of a GQA group at every position."""
    rng = np.random.default_rng(seed)
    centers = 3.0 * rng.standard_normal((8, d))
    raw = centers[rng.integers(0, 8, n)] + 0.5 * rng.standard_normal((n, d))
    pos = np.arange(n)
    keys = kvref.rope(raw, pos, THETA).astype(np.float32)
    values = rng.standard_normal((n, d)).astype(np.float32)
    q = np.stack([kvref.rope(rng.standard_normal((n, d)) * 2.0, pos, THETA) for _ in range(heads)])
    return keys, values, q.astype(np.float32)


def test_buckets_hold_each_key_at_its_nearest_de_roped_centroid():
    keys, values, queries = prompt()
    index = kvindex.IndexIVFAsym(keys.shape[1], C=8)
    index.prefill(keys, values, queries=queries)
    c = index.centroids.astype(np.float64)
    assert c.shape == (8, keys.shape[1]) and index.has_qmodel
    sizes = index.bucket_sizes
    assert sizes.shape == (9,) and sizes.sum() == keys.shape[0] and sizes[8] == 0
    raw = kvref.rope(keys, -np.arange(keys.shape[0]), THETA)  # rotated back
    d2 = ((raw[:, None, :] - c[None, :, :]) ** 2).sum(-1)
    expected = np.bincount(d2.argmin(1), minlength=8)
    np.testing.assert_array_equal(sizes[:8], expected)


def test_full_probe_is_exact_and_per_call_nprobe_reads_fewer_keys():
    keys, values, queries = prompt()
    index = kvindex.index_factory(keys.shape[1], "IVFAsym8_Centroid")
    index.prefill(keys, values, queries=queries)
    q = queries[0, -4:]
    out, lse = index.attend(q, params={"nprobe": 8})
    ref_out, ref_lse = kvref.attend(q, keys, values)
    assert np.max(kvref.rel_err(out, ref_out)) < 1e-5
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
    few = index.select(q, params="nprobe=2")
    assert all(len(s.ids) < keys.shape[0] for s in few)
    assert all(s.n_scanned == 8 for s in few)  # C centroids scored
    # the probed buckets: nearest de-RoPEd centroids by inner product
    last = keys.shape[0] - 1
    qr = kvref.rope(q[-1:], [-last], THETA)[0]
    best = np.argsort(-(index.centroids.astype(np.float64) @ qr), kind="stable")[:2]
    np.testing.assert_array_equal(index.probe_buckets(q[-1:], 2), best)
    with pytest.raises(ValueError, match="nprobe=9"):
        index.attend(q, params={"nprobe": 9})


def test_adopted_models_survive_io_and_reset():
    keys, values, queries = prompt()
    trained = kvindex.index_factory(keys.shape[1], "Sink1,Window32,IVFAsym8")
    trained.prefill(keys, values, queries=queries)
    fresh = kvindex.index_factory(keys.shape[1], "Sink1,Window32,IVFAsym8_CentroidRoPE")
    assert fresh.adopt_trained(trained) == 1
    k2, v2, q2 = prompt(seed=4)
    fresh.prefill(k2, v2, queries=q2)
    inner = fresh.children()[0]
    np.testing.assert_array_equal(inner.centroids, trained.children()[0].centroids)
    copy = kvindex.deserialize_index(kvindex.serialize_index(fresh))
    a, _ = fresh.attend(q2[0, -3:])
    b, _ = copy.attend(q2[0, -3:])
    np.testing.assert_array_equal(a, b)
    fresh.reset()
    assert fresh.children()[0].adopted and fresh.children()[0].centroids.shape == (8, 16)
    with pytest.raises(ValueError, match="same factory string"):
        fresh.adopt_trained(kvindex.index_factory(16, "Flat"))


def test_oracle_reads_the_buckets_of_largest_exact_mass():
    keys, values, queries = prompt()
    index = kvindex.IndexIVFAsym(keys.shape[1], C=8, probe="oracle")
    assert index.factory_string() == "IVFAsym8_Oracle"
    index.prefill(keys, values, queries=queries)
    # bucket of each key: its nearest de-RoPEd centroid (as the first test)
    raw = kvref.rope(keys, -np.arange(keys.shape[0]), THETA)
    c = index.centroids.astype(np.float64)
    bucket = ((raw[:, None, :] - c[None, :, :]) ** 2).sum(-1).argmin(1)
    q = queries[1, -5:]
    s = (q.astype(np.float64) @ keys.T.astype(np.float64)) / np.sqrt(keys.shape[1])
    w = np.exp(s - s.max(1, keepdims=True))
    w /= w.sum(1, keepdims=True)
    for i, sel in enumerate(index.select(q, params="nprobe=3")):
        mass = np.bincount(bucket, weights=w[i], minlength=8)
        best = np.sort(mass)[::-1][:3].sum()
        assert abs(w[i][np.asarray(sel.ids)].sum() - best) < 1e-6
        assert sel.n_scanned == keys.shape[0]  # every key scored
    with pytest.raises(ValueError, match="oracle"):
        kvindex.IndexIVFAsym(16, C=8, probe="best")


def test_moment_probe_estimates_each_buckets_log_mass_from_its_keys():
    keys, values, queries = prompt()
    index = kvindex.IndexIVFAsym(keys.shape[1], C=8, probe="moment")
    assert index.factory_string() == "IVFAsym8_Moment"
    index.prefill(keys, values, queries=queries)
    assert not index.has_qmodel  # training-free: only the centroids
    raw = kvref.rope(keys, -np.arange(keys.shape[0]), THETA)
    c = index.centroids.astype(np.float64)
    bucket = ((raw[:, None, :] - c[None, :, :]) ** 2).sum(-1).argmin(1)
    k64 = keys.astype(np.float64)
    s = 1 / np.sqrt(keys.shape[1])
    q = queries[0, -1:]
    for w in (0.0, 1.0):
        kvindex.set_index_parameters(index, f"var_weight={w}")
        got = index.moment_log_masses(q)
        for b in range(8):
            kb = k64[bucket == b]
            mean, var = kb.mean(0), kb.var(0)
            ref = np.log(len(kb)) + s * q[0] @ mean + 0.5 * w * s * s * (q[0].astype(np.float64) ** 2) @ var
            assert abs(got[b] - ref) < 1e-3 * max(1.0, abs(ref))
            if w == 0:  # Jensen: never above the exact log mass
                exact = np.log(np.exp(s * kb @ q[0].astype(np.float64)).sum())
                assert got[b] <= exact + 1e-4
        order = np.argsort(-got, kind="stable")[:2]
        np.testing.assert_array_equal(np.sort(index.probe_buckets(q, 2)), np.sort(order))
