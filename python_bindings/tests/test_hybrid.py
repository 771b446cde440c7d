"""IndexHybrid, IndexUniformSample and IndexWeightedSample from Python: the heavy hitters are the
exact top-k of a float64 numpy reference, the tail is drawn outside them
with u = sample / (n - k), attention equals the numpy estimator over that
selection, and the per-head (epsilon, delta) budget is set at prefill."""
import numpy as np
import pytest

import kvindex
import kvref


def head(n=1500, d=16, nq=8, seed=5):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n, d)).astype(np.float32)
    values = rng.standard_normal((n, d)).astype(np.float32)
    q = (1.5 * rng.standard_normal((nq, d))).astype(np.float32)
    return keys, values, q


def test_heavy_is_exact_topk_tail_is_outside_and_attend_matches_the_estimator():
    keys, values, q = head()
    index = kvindex.index_factory(keys.shape[1], "Hybrid(TopK(Flat),Uniform)|k=20,sample=100")
    index.add_kv(keys, values)
    assert isinstance(index, kvindex.IndexHybrid)
    assert isinstance(index.tail, kvindex.IndexUniformSample)
    _, top = kvref.topk(q, keys, 20)
    out, lse = index.attend(q)
    for i in range(q.shape[0]):
        sel = index.select(q[i:i + 1])[0]
        ids, inc = np.asarray(sel.ids), np.asarray(sel.inclusion)
        heavy = set(top[i].tolist())
        assert heavy == set(ids[inc == 1.0].tolist())
        tail = ids[inc < 1.0]
        assert len(tail) == 100 and not heavy & set(tail.tolist())
        np.testing.assert_allclose(inc[inc < 1.0], 100 / (keys.shape[0] - 20), rtol=1e-6)
        ref_out, ref_lse = kvref.attend(q[i], keys, values, ids=ids, inclusion=inc)
        np.testing.assert_allclose(out[i], ref_out[0], rtol=1e-4, atol=1e-5)
        assert lse[i] == pytest.approx(ref_lse[0], abs=1e-4)


def test_uniform_sample_of_every_token_is_exact():
    keys, values, q = head()
    # uniform sampling of every token is u = 1 everywhere: exact
    index = kvindex.index_factory(keys.shape[1], "Uniform|k=100000")
    index.add_kv(keys, values)
    out, lse = index.attend(q)
    ref_out, ref_lse = kvref.attend(q, keys, values)
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)


def test_epsilon_sets_the_tail_budget_at_prefill_and_survives_io():
    keys, values, q = head(n=3000, nq=64)
    index = kvindex.index_factory(keys.shape[1], "Hybrid(TopK(Flat),Uniform)|k=16,epsilon=0.1,delta=0.1")
    index.prefill(keys, values, queries=q)
    m = index.calibrated_sample
    assert 16 < m < 3000 - 16
    assert kvindex.get_index_parameter(index, "sample") == m
    back = kvindex.deserialize_index(kvindex.serialize_index(index))
    assert back.calibrated_sample == m
    np.testing.assert_array_equal(back.attend(q)[0], index.attend(q)[0])
    with pytest.raises(ValueError, match="does not sample uniformly"):
        lsh = kvindex.index_factory(keys.shape[1], "Hybrid(TopK(Flat),LSHSample6x10)|epsilon=0.1")
        lsh.prefill(keys, values, queries=q)


def ref_weighted_inclusion(s, m):
    """u = min(1, c e^s), sum u = m, c by bisection on log c in float64."""
    w = np.exp(s.astype(np.float64) - s.max())
    lo, hi = -800.0, 800.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if np.minimum(1, np.exp(mid) * w).sum() < m:
            lo = mid
        else:
            hi = mid
    return np.minimum(1, np.exp(0.5 * (lo + hi)) * w)


def test_weighted_sample_reads_k_tokens_with_the_exact_partition():
    keys, values, q = head(n=2000)
    index = kvindex.index_factory(keys.shape[1], "Weighted|k=60")
    index.add_kv(keys, values)
    assert isinstance(index, kvindex.IndexWeightedSample)
    out, lse = index.attend(q)
    _, exact_lse = kvref.attend(q, keys, values)
    # every draw estimates the partition exactly (systematic PPS sampling)
    np.testing.assert_allclose(lse, exact_lse, atol=1e-4)
    scale = 1 / np.sqrt(keys.shape[1])
    for i in range(q.shape[0]):
        sel = index.select(q[i:i + 1])[0]
        ids, inc = np.asarray(sel.ids), np.asarray(sel.inclusion)
        assert len(ids) == 60
        u = ref_weighted_inclusion(keys @ q[i] * scale, 60)
        np.testing.assert_allclose(inc, u[ids], rtol=1e-5)
        ref_out, _ = kvref.attend(q[i], keys, values, ids=ids, inclusion=inc)
        np.testing.assert_allclose(out[i], ref_out[0], rtol=1e-4, atol=1e-5)


def test_weighted_inclusion_matches_numpy_and_rejects_bad_input():
    rng = np.random.default_rng(3)
    s = (2 * rng.standard_normal(500)).astype(np.float32)
    s[7] += 12
    u = kvindex.weighted_inclusion(s, 40)
    np.testing.assert_allclose(u, ref_weighted_inclusion(s, 40), rtol=1e-6, atol=1e-12)
    assert u.sum() == pytest.approx(40)
    assert u[7] == 1.0
    with pytest.raises(ValueError, match="m=-1"):
        kvindex.weighted_inclusion(s, -1)
    with pytest.raises(ValueError, match="1-d"):
        kvindex.weighted_inclusion(s.reshape(20, 25), 3)
