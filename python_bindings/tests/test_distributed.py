"""kvindex.distributed.RayKVCache on a local Ray cluster of 2 CPUs (real
worker processes), against the in-process kvindex.KVCache on the same
tokens, and against a float64 numpy attention for the token shards' merge."""
import os
import time

import numpy as np
import pytest

if os.environ.get("KVINDEX_REQUIRE_RAY"):
    import ray  # the test command installs it: these tests must run, not skip
else:
    ray = pytest.importorskip("ray")

import kvindex  # noqa: E402
from kvindex.distributed import RayKVCache, ShardDiedError, merge_by_lse  # noqa: E402

L, HQ, HKV, D = 2, 4, 2, 16
N, APPENDS = 600, 4


# every test runs on the session's local cluster of 2 CPUs (conftest.py)
pytestmark = pytest.mark.usefixtures("ray_cluster")


def tokens(seed, n=N):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((L, HKV, n + APPENDS, D)).astype(np.float32)
    values = rng.standard_normal((L, HKV, n + APPENDS, D)).astype(np.float32)
    queries = (1.5 * rng.standard_normal((L, HQ, n, D))).astype(np.float32)
    q = (2 * rng.standard_normal((HQ, 1, D))).astype(np.float32)
    return keys, values, queries, q


def fill(cache, data, n=N):
    keys, values, queries, _ = data
    for layer in range(L):
        cache.prefill(layer, keys[layer, :, :n], values[layer, :, :n], queries[layer])
        for t in range(n, n + APPENDS):
            cache.append(layer, keys[layer, :, t:t + 1], values[layer, :, t:t + 1])
    return cache


def wait_until_gone(pid, seconds=30):
    """Until process pid has exited (ray.kill returns before it has)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs {seconds} s after ray.kill")


def exact(data, layer, n=N):
    """float64 attention of q over every token of the layer."""
    keys, values, _, q = data
    out = np.zeros((HQ, D))
    for h in range(HQ):
        k, v = keys[layer, h // (HQ // HKV), :n + APPENDS], values[layer, h // (HQ // HKV), :n + APPENDS]
        s = k.astype(np.float64) @ q[h, 0] / np.sqrt(D)
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ v
    return out


@pytest.mark.parametrize("placement,transport", [("tokens", "auto"), ("tokens", "ray"), ("heads", "auto"),
                                                 ("layers", "auto")])
def test_dense_answers_as_in_process(placement, transport):
    data = tokens(1)
    spread = RayKVCache(L, HQ, HKV, D, "Flat", shards=2, placement=placement, transport=transport)
    # every actor of a local cluster is on the driver's node: "auto" lines them all
    assert spread.transports == ["line" if transport == "auto" else "ray"] * 2
    fill(spread, data)
    local = fill(kvindex.KVCache(L, HQ, HKV, D, "Flat"), data)
    for layer in range(L):
        assert spread.n_tokens(layer) == local.n_tokens(layer) == N + APPENDS
        out, lse = spread.attend(layer, data[3])
        ref, ref_lse = local.attend(layer, data[3])
        assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max()
        assert np.abs(lse - ref_lse).max() < 1e-5 * (1 + np.abs(ref_lse).max())
        assert np.abs(out[:, 0] - exact(data, layer)).max() < 1e-5
    spread.shutdown()


@pytest.mark.parametrize("placement", ["heads", "layers"])
@pytest.mark.parametrize("string", ["Sink4,Window16,TopK(Flat)|k=8", "RoarGraph8", "Sink1,Window15,IVFAsym8"])
def test_every_index_is_the_in_process_one_when_heads_or_layers_are_spread(placement, string):
    data = tokens(2)
    spread = fill(RayKVCache(L, HQ, HKV, D, string, shards=2, placement=placement), data)
    factory, params = kvindex.parse_index_spec(string)[:2]
    local = kvindex.KVCache(L, HQ, HKV, D, factory)
    if params:
        for layer in range(L):
            for h in range(HKV):
                kvindex.set_index_parameters(local.index(layer, h), params)
    fill(local, data)
    for layer in range(L):
        out, lse = spread.attend(layer, data[3])
        ref, ref_lse = local.attend(layer, data[3])
        np.testing.assert_array_equal(out, ref)
        np.testing.assert_array_equal(lse, ref_lse)
    spread.shutdown()


def test_token_shards_merge_by_lse_and_split_the_memory():
    data = tokens(3, n=4000)
    spread = fill(RayKVCache(L, HQ, HKV, D, "Flat", shards=2, placement="tokens"), data, n=4000)
    local = fill(kvindex.KVCache(L, HQ, HKV, D, "Flat"), data, n=4000)
    per_actor = spread.memory_per_actor()
    assert max(per_actor) <= local.memory_bytes() / 2 * 1.1, (per_actor, local.memory_bytes())
    assert spread.counts[0] == [2000, 2000 + APPENDS]  # appends went to the last shard
    out, _ = spread.attend(1, data[3])
    assert np.abs(out[:, 0] - exact(data, 1, n=4000)).max() < 1e-5
    # the merge itself, against a float64 softmax over the union
    rng = np.random.default_rng(0)
    s, v = rng.standard_normal(10), rng.standard_normal((10, 3))
    parts = [(s[:4], v[:4]), (s[4:], v[4:]), (s[:0], v[:0])]
    outs = [(np.exp(p - p.max()) / np.exp(p - p.max()).sum()) @ pv if len(p) else np.zeros(3) for p, pv in parts]
    lses = [np.log(np.exp(p).sum()) if len(p) else -np.inf for p, _ in parts]
    o, lse = merge_by_lse(np.array(outs)[:, None, None], np.array(lses)[:, None, None])
    w = np.exp(s - s.max())
    assert np.allclose(o[0, 0], (w / w.sum()) @ v, atol=1e-6)
    assert np.isclose(lse[0, 0], np.log(np.exp(s).sum()), atol=1e-6)
    spread.shutdown()


@pytest.mark.parametrize("transport", ["auto", "ray"])
def test_a_dead_actor_is_named_and_a_restore_answers_as_before(tmp_path, transport):
    data = tokens(4)
    spread = fill(RayKVCache(L, HQ, HKV, D, "Sink4,Window16,TopK(Flat)|k=8", shards=2, placement="tokens",
                             transport=transport), data)
    before = spread.attend(0, data[3])
    spread.checkpoint(tmp_path / "ckpt")
    pid = spread._get([spread.actors[1].pid.remote()], [1], "pid")[0]
    ray.kill(spread.actors[1])
    wait_until_gone(pid)
    with pytest.raises(ShardDiedError, match="shard 1 .* died"):
        spread.attend(0, data[3])
    restored = RayKVCache.restore(tmp_path / "ckpt")
    assert restored.n_tokens(0) == N + APPENDS
    after = restored.attend(0, data[3])
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])
    # and it goes on: an append lands, on the last shard
    restored.append(0, data[0][0, :, :1], data[1][0, :, :1])
    assert restored.n_tokens(0) == N + APPENDS + 1
    spread.shutdown()
    restored.shutdown()


def test_a_step_one_shard_refuses_is_taken_back_by_the_others():
    # "heads": shard 1 holds KV head 1, whose FP16 storage cannot hold 1e5;
    # shard 0 takes the step, then takes it back: the cache answers as the
    # in-process one that refused the same step whole
    data = tokens(5)
    string = "FP16,Sink2,Window8,LSHSample6x20"
    spread = fill(RayKVCache(L, HQ, HKV, D, string, shards=2, placement="heads"), data)
    local = fill(kvindex.KVCache(L, HQ, HKV, D, string), data)
    rng = np.random.default_rng(7)
    k = rng.standard_normal((HKV, 1, D)).astype(np.float32)
    v = rng.standard_normal((HKV, 1, D)).astype(np.float32)
    q = rng.standard_normal((HQ, 1, D)).astype(np.float32)
    bad = k.copy()
    bad[1, 0, 3] = 1e5
    for step in (lambda c: c.append(0, bad, v), lambda c: c.decode(0, bad, v, q)):
        for cache in (spread, local):
            with pytest.raises(ValueError, match="keys: value 100000"):
                step(cache)
        assert spread.n_tokens(0) == local.n_tokens(0) == N + APPENDS
        for got, want in zip(spread.attend(0, data[3]), local.attend(0, data[3])):
            np.testing.assert_array_equal(got, want)
    # the next steps go on as in one process (queries learned in order)
    for t in range(3):
        for got, want in zip(spread.decode(0, k, v, q), local.decode(0, k, v, q)):
            np.testing.assert_array_equal(got, want)
    spread.shutdown()
    # a shard that cannot take a step back leaves the cache refusing calls
    string = "FP16,TopK(HNSW8)"
    spread = fill(RayKVCache(L, HQ, HKV, D, string, shards=2, placement="heads"), data)
    with pytest.raises(ValueError, match="value 100000"):
        spread.append(0, bad, v)
    with pytest.raises(RuntimeError, match="out of step; restore"):
        spread.attend(0, data[3])
    spread.shutdown()


@pytest.mark.parametrize("placement", ["heads", "tokens"])
def test_a_prefill_one_shard_refuses_leaves_every_shard_empty(placement):
    data = tokens(6)
    string = "FP16,Sink2,Window8,Flat"
    spread = RayKVCache(L, HQ, HKV, D, string, shards=2, placement=placement)
    keys, values, queries = data[0][0, :, :N], data[1][0, :, :N], data[2][0]
    bad = keys.copy()
    bad[1, N - 5, 0] = 1e5  # KV head 1, in the last shard's token range
    with pytest.raises(ValueError, match="keys: value 100000"):
        spread.prefill(0, bad, values, queries)
    held = spread._get([a.n_tokens.remote(0) for a in spread.actors], range(2), "n_tokens")
    assert held == [0, 0] and spread.n_tokens(0) == 0
    spread.prefill(0, keys, values, queries)  # the layer takes a prefill again
    local = kvindex.KVCache(L, HQ, HKV, D, string)
    local.prefill(0, keys, values, queries)
    out, _ = spread.attend(0, data[3])
    ref, _ = local.attend(0, data[3])
    assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max()
    spread.shutdown()


def test_bad_input_fails_before_any_actor_starts():
    with pytest.raises(ValueError, match="placement 'rows'"):
        RayKVCache(L, HQ, HKV, D, "Flat", shards=2, placement="rows")
    with pytest.raises(ValueError, match="3 shards for placement 'heads'"):
        RayKVCache(L, HQ, HKV, D, "Flat", shards=3, placement="heads")
    with pytest.raises(ValueError, match="cannot parse"):
        RayKVCache(L, HQ, HKV, D, "NoSuch", shards=2)
    with pytest.raises(ValueError, match="shards=0"):
        RayKVCache(L, HQ, HKV, D, "Flat", shards=0)
    with pytest.raises(ValueError, match="transport 'tcp'"):
        RayKVCache(L, HQ, HKV, D, "Flat", shards=2, transport="tcp")
    cache = RayKVCache(L, HQ, HKV, D, "Flat", shards=2)
    with pytest.raises(ValueError, match="holds no token"):
        cache.attend(0, np.zeros((HQ, 1, D), np.float32))
    with pytest.raises(ValueError, match="keys of shape"):
        cache.prefill(0, np.zeros((3, 10, D), np.float32), np.zeros((3, 10, D), np.float32))
    with pytest.raises(IndexError, match="layer 5"):
        cache.append(5, np.zeros((HKV, 1, D), np.float32), np.zeros((HKV, 1, D), np.float32))
    cache.shutdown()
