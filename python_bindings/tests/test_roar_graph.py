"""IndexRoarGraph from Python: the graph's arrays, reachability, and search
against a float64 numpy top-k on out-of-distribution queries."""
import numpy as np
import pytest

import kvindex


def ood_prompt(n=1500, d=32, heads=2, seed=7):
    """Keys around a large shared offset, queries on its far side."""
    rng = np.random.default_rng(seed)
    offset = rng.standard_normal(d)
    offset *= 6.0 / np.linalg.norm(offset)
    keys = (rng.standard_normal((n, d)) + offset).astype(np.float32)
    values = rng.standard_normal((n, d)).astype(np.float32)
    queries = (rng.standard_normal((heads, n, d)) - 0.5 * offset).astype(np.float32)
    test = (rng.standard_normal((40, d)) - 0.5 * offset).astype(np.float32)
    return keys, values, queries, test


def numpy_topk(q, keys, k):
    s = q.astype(np.float64) @ keys.astype(np.float64).T
    return np.argsort(-s, axis=1, kind="stable")[:, :k]


def test_graph_arrays_are_well_formed():
    keys, values, queries, _ = ood_prompt()
    g = kvindex.IndexRoarGraph(keys.shape[1], M=8)
    g.prefill(keys, values, queries=queries)
    n = keys.shape[0]
    assert g.ntotal == n and g.n_train_queries == queries.shape[0] * queries.shape[1]
    nb, deg = g.neighbors, g.degrees
    assert nb.shape == (n, 2 * g.M) and nb.dtype == np.int32 and deg.shape == (n,)
    assert deg.max() <= 2 * g.M and deg.min() >= 1
    for i in range(n):
        row = nb[i]
        assert np.all(row[deg[i]:] == -1)
        edges = row[:deg[i]]
        assert np.all((edges >= 0) & (edges < n)) and i not in edges
        assert len(set(edges.tolist())) == len(edges)
    assert g.count_reachable() == n
    assert 0 <= g.entry_point < n
    assert np.all((g.hubs >= 0) & (g.hubs < n))


def test_full_beam_is_exact_and_small_beam_touches_few_keys():
    keys, values, queries, test = ood_prompt()
    index = kvindex.index_factory(keys.shape[1], "RoarGraph8")
    index.prefill(keys, values, queries=queries)
    n, k = keys.shape[0], 10
    _, exact = index.search(test, k, params={"efSearch": n})
    np.testing.assert_array_equal(exact, numpy_topk(test, keys, k))
    truth = numpy_topk(test, keys, k)
    recalls = []
    for ef in (10, 40, 160, 320):
        _, approx = index.search(test, k, params={"efSearch": ef})
        recalls.append(np.mean([len(set(a) & set(t)) / k for a, t in zip(approx, truth)]))
    # measured on this seeded prompt (random 32-d keys: a hard case for any
    # graph): 0.23, 0.49, 0.88, 0.97
    assert recalls == sorted(recalls) and recalls[1] >= 0.4 and recalls[3] >= 0.9
    sel = index.select(test[:1], params={"efSearch": 40, "k": k})[0]
    assert len(sel.ids) == k and 0 < sel.n_scanned < n


def test_appends_stay_reachable_and_m_is_refused_after_prefill():
    keys, values, queries, _ = ood_prompt()
    index = kvindex.index_factory(keys.shape[1], "RoarGraph8")
    index.prefill(keys[:1000], values[:1000], queries=queries[:, :1000])
    for i in range(1000, 1200):
        index.add_kv(keys[i:i + 1], values[i:i + 1])
    assert index.count_reachable() == 1200
    with pytest.raises(ValueError, match="prefill-time"):
        kvindex.set_index_parameters(index, "M=16")


def test_walk_on_codes_is_exact_at_full_beam_and_reads_less():
    keys, values, queries, test = ood_prompt()
    index = kvindex.index_factory(keys.shape[1], "RoarGraph8")
    assert index.walk_bits == 8  # the default
    index.prefill(keys, values, queries=queries)
    n, k = keys.shape[0], 10
    kvindex.set_index_parameters(index, "walk_bits=0")  # the walk on the stored keys
    before = [s.n_scanned for s in index.select(test, params={"efSearch": 40, "k": k})]
    kvindex.set_index_parameters(index, "walk_bits=8")
    assert index.walk_bits == 8
    # every key in the beam, scored again on the stored keys: exact
    _, exact = index.search(test, k, params={"efSearch": n})
    np.testing.assert_array_equal(exact, numpy_topk(test, keys, k))
    after = [s.n_scanned for s in index.select(test, params={"efSearch": 40, "k": k})]
    # a code is a quarter of a float32 key's bytes; the 40 keys of the beam
    # are read again: about the same walk reads well under 60%
    assert sum(after) < 0.6 * sum(before)
    with pytest.raises(ValueError, match="walk_bits"):
        kvindex.set_index_parameters(index, "walk_bits=4")


def test_decode_queries_are_learnt_through_index_and_cache():
    keys, values, queries, test = ood_prompt(n=800)
    d = keys.shape[1]
    index = kvindex.index_factory(d, "RoarGraph8|decode_anchors=16")
    index.prefill(keys[:700], values[:700], queries=queries[:, :700])
    for t in range(700, 740):  # a decode step: its token, then its query
        index.add_kv(keys[t:t + 1], values[t:t + 1])
        index.add_queries(test[t - 700:t - 699])
    assert index.n_learned == 40 and index.learned_anchors == 16 and index.decode_anchors == 16
    # 740 keys: below learn_scan_keys, the lists were scanned exactly
    assert index.learn_scan_keys == 4096
    kvindex.set_index_parameters(index, "learn_scan_keys=0")  # by the beam from now on
    assert index.learn_scan_keys == 0
    _, full = index.search(test, 10, params={"efSearch": 740})
    np.testing.assert_array_equal(full, numpy_topk(test, keys[:740], 10))
    with pytest.raises(ValueError, match="q"):
        index.add_queries(np.zeros((2, d + 1), np.float32))
    bad = test[:2].copy()
    bad[1, 3] = np.nan
    with pytest.raises(ValueError, match="add_queries: queries"):
        index.add_queries(bad)
    assert index.n_learned == 40
    # a KVCache: each KV head learns its group's queries
    cache = kvindex.KVCache(1, 4, 2, d, "RoarGraph8")
    kv = np.stack([keys[:700], keys[:700]])
    vv = np.stack([values[:700], values[:700]])
    qq = np.concatenate([queries[:, :700], queries[:, :700]])
    cache.prefill(0, kv, vv, queries=qq)
    cache.add_queries(0, test[:4].reshape(4, 1, d))
    assert [cache.index(0, h).n_learned for h in range(2)] == [2, 2]
