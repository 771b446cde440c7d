"""write_trace / read_trace: arrays and meta round trip, float16 traces."""
import json
import os

import numpy as np
import pytest

import kvindex


def make_trace(n_layers=2, hq=4, hkv=2, n=40, d=16, seed=8):
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(n_layers):
        layers.append({
            "keys": rng.standard_normal((hkv, n, d)).astype(np.float32),
            "values": rng.standard_normal((hkv, n, d)).astype(np.float32),
            "queries": rng.standard_normal((hq, n, d)).astype(np.float32),
        })
    meta = {"n_layers": n_layers, "n_q_heads": hq, "n_kv_heads": hkv, "head_dim": d,
            "n_tokens": n, "n_ctx": 30, "rope_theta": 500000.0, "rope_style": "interleaved",
            "source": "python test", "dtype": "float32"}
    return meta, layers


def test_trace_round_trip(tmp_path):
    meta, layers = make_trace()
    d = str(tmp_path / "trace")
    kvindex.write_trace(d, meta, layers)
    assert os.path.exists(os.path.join(d, "meta.json"))
    with open(os.path.join(d, "meta.json")) as f:
        assert json.load(f)["n_ctx"] == 30
    m2, l2 = kvindex.read_trace(d)
    for key, v in meta.items():
        assert m2[key] == v, key
    assert len(l2) == len(layers)
    for a, b in zip(layers, l2):
        for name in ("keys", "values", "queries"):
            assert b[name].dtype == np.float32
            np.testing.assert_array_equal(a[name], b[name])
    # one layer only
    m3, l3 = kvindex.read_trace(d, layers=[1])
    assert len(l3) == 1
    np.testing.assert_array_equal(l3[0]["queries"], layers[1]["queries"])


def test_trace_meta_may_omit_what_arrays_say(tmp_path):
    meta, layers = make_trace(n_layers=1, hq=2, hkv=1, n=12, d=8)
    short = {"n_ctx": 10, "rope_theta": 10000.0, "rope_style": "half", "source": "s"}
    d = str(tmp_path / "t")
    kvindex.write_trace(d, short, layers)
    m2, l2 = kvindex.read_trace(d)
    assert (m2["n_layers"], m2["n_q_heads"], m2["n_kv_heads"], m2["head_dim"], m2["n_tokens"]) \
        == (1, 2, 1, 8, 12)
    np.testing.assert_array_equal(l2[0]["keys"], layers[0]["keys"])


def test_float16_trace(tmp_path):
    meta, layers = make_trace()
    meta["dtype"] = "float16"
    d = str(tmp_path / "t16")
    kvindex.write_trace(d, meta, layers)
    keys = np.load(os.path.join(d, "layer_0", "keys.npy"))
    assert keys.dtype == np.float16
    m2, l2 = kvindex.read_trace(d)
    assert m2["dtype"] == "float16"
    for a, b in zip(layers, l2):
        for name in ("keys", "values", "queries"):
            assert b[name].dtype == np.float32
            # exactly the fp16 rounding of what was written
            np.testing.assert_array_equal(b[name], a[name].astype(np.float16).astype(np.float32))
            np.testing.assert_allclose(b[name], a[name], rtol=2 ** -11, atol=1e-7)


def test_trace_readable_by_numpy(tmp_path):
    meta, layers = make_trace(n_layers=1)
    d = str(tmp_path / "np")
    kvindex.write_trace(d, meta, layers)
    np.testing.assert_array_equal(np.load(os.path.join(d, "layer_0", "values.npy")),
                                  layers[0]["values"])


def test_trace_errors(tmp_path):
    meta, layers = make_trace()
    bad = [dict(layers[0]), layers[1]]
    bad[0]["keys"] = bad[0]["keys"][:, :5]
    with pytest.raises((ValueError, RuntimeError), match="keys"):
        kvindex.write_trace(str(tmp_path / "bad"), meta, bad)
    with pytest.raises((RuntimeError, OSError)):
        kvindex.read_trace(str(tmp_path / "nothing-here"))
    d = str(tmp_path / "ok")
    kvindex.write_trace(d, meta, layers)
    with pytest.raises((ValueError, RuntimeError, IndexError)):
        kvindex.read_trace(d, layers=[5])
