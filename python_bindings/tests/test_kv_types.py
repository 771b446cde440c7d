"""BF16, / FP16, storage: attention vs the float64 reference of the
unrounded data within the storage type's bound, and exactly (float32
kernel accuracy) vs the reference of the rounded keys and values.

Bounds (relative L2 error of the output, and |lse| error): bf16 (8
significant bits, unit roundoff u = 2^-8 ~ 3.9e-3) < 2e-2 (~5u); fp16 (11
significant bits, u = 2^-11 ~ 4.9e-4) < 5e-3 (~10u; the OOD keys' large
offset magnifies the score error); vs the rounded data < 1e-5.
"""
import numpy as np
import pytest

import kvindex
import kvref
from conftest import build

BOUNDS = {"BF16,": (kvref.round_bf16, 2e-2, "bf16"), "FP16,": (kvref.round_fp16, 5e-3, "fp16")}


@pytest.mark.parametrize("prefix", sorted(BOUNDS))
@pytest.mark.parametrize("chain", ["Flat", "Sink4,Window64,Flat", "TopK(Flat)"])
def test_low_precision_attend(prefix, chain, data):
    rnd, bound, name = BOUNDS[prefix]
    index = build(prefix + chain, data)
    q = data.queries
    out, lse = index.attend(q)
    rk, rv = rnd(data.keys), rnd(data.values)
    ids = None
    if "TopK" in chain:
        # the top k of the stored (rounded) keys: rounding may move keys
        # across the k-th score, which is not an error of the storage
        _, I = kvref.topk(q, rk, 100)
        ids = list(I)
    # the stored data, exactly: float32 kernel accuracy
    r_out, r_lse = kvref.attend(q, rk, rv, ids=ids)
    assert kvref.rel_err(out, r_out).max() < 1e-5
    np.testing.assert_allclose(lse, r_lse, rtol=1e-5, atol=1e-5)
    # the unrounded data: within the storage type's bound
    u_out, u_lse = kvref.attend(q, data.keys, data.values, ids=ids)
    err = kvref.rel_err(out, u_out)
    assert err.max() < bound, f"{prefix}{chain}: {err.max():.3g} >= {bound}"
    np.testing.assert_allclose(lse, u_lse, rtol=bound, atol=bound)
    np.testing.assert_array_equal(index.reconstruct(3), rnd(data.keys[3]))
    np.testing.assert_array_equal(index.reconstruct_value(3), rnd(data.values[3]))


@pytest.mark.parametrize("s", [
    "BF16,Flat", "FP16,Flat", "BF16,TopK(IVF4,Flat)", "FP16,TopK(HNSW8)",
    "BF16,LSHSample6x20", "FP16,Sink4,Window8,Flat", "BF16,Sink2,Window8,LSHSample6x20",
    "FP16,ProxyEvict30_H2O,TopK(Flat)", "Sink4,Window64,LSHSample10x150",
])
def test_factory_string_round_trip(s):
    index = kvindex.index_factory(32, s)
    assert kvindex.index_factory_string(index) == s
    again = kvindex.index_factory(32, kvindex.index_factory_string(index))
    assert kvindex.index_factory_string(again) == s
    assert index.kv_type == {"BF16": "bf16", "FP16": "f16"}.get(s.split(",")[0], "f32")


def test_fp16_out_of_range_raises(small):
    index = kvindex.index_factory(small.keys.shape[1], "FP16,Flat")
    keys = small.keys.copy()
    keys[2, 3] = 1e5
    with pytest.raises(ValueError, match="keys"):
        index.add_kv(keys, small.values)
    assert index.ntotal == 0
