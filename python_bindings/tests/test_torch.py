"""CPU torch tensors in and out of every call (kvindex/_torch.py); torch
stays optional."""
import os
import subprocess
import sys

import numpy as np
import pytest

import kvindex

if os.environ.get("KVINDEX_REQUIRE_HF"):
    import torch  # the test command installs it: these tests must run, not skip
else:
    torch = pytest.importorskip("torch")

D = 32


def data(n=300, seed=5):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n, D)).astype(np.float32)
    values = rng.standard_normal((n, D)).astype(np.float32)
    q = rng.standard_normal((4, D)).astype(np.float32)
    return keys, values, q


def test_a_call_given_torch_returns_torch_with_the_numpy_answers():
    keys, values, q = data()
    a = kvindex.index_factory(D, "Sink4,Window16,TopK(Flat)|k=20")
    b = kvindex.index_factory(D, "Sink4,Window16,TopK(Flat)|k=20")
    a.prefill(keys, values, queries=q)
    b.prefill(torch.from_numpy(keys), torch.from_numpy(values), queries=torch.from_numpy(q))
    out_np, lse_np = a.attend(q)
    out_t, lse_t = b.attend(torch.from_numpy(q))
    assert isinstance(out_t, torch.Tensor) and isinstance(lse_t, torch.Tensor)
    assert out_t.dtype == torch.float32 and tuple(out_t.shape) == (4, D)
    np.testing.assert_array_equal(out_t.numpy(), out_np)
    np.testing.assert_array_equal(lse_t.numpy(), lse_np)
    dist, ids = b.search(torch.from_numpy(q), 5)
    assert ids.dtype == torch.int64
    np.testing.assert_array_equal(ids.numpy(), a.search(q, 5)[1])
    assert isinstance(b.reconstruct(3), np.ndarray)  # no tensor given: numpy
    # numpy in, numpy out as before
    assert isinstance(a.attend(q)[0], np.ndarray)


def test_views_and_grads_are_read_in_place_and_strided_ones_converted():
    keys, values, q = data()
    index = kvindex.index_factory(D, "Flat")
    index.add_kv(keys, values)
    t = torch.from_numpy(q).requires_grad_(True)  # a tensor with grad: read, not refused
    out, _ = index.attend(t)
    assert not out.requires_grad
    strided = torch.from_numpy(np.ascontiguousarray(q.T)).T  # a transposed view
    assert not strided.is_contiguous()
    np.testing.assert_array_equal(index.attend(strided)[0].numpy(), index.attend(q)[0])


@pytest.mark.parametrize("dtype,storage", [(torch.bfloat16, "BF16"), (torch.float16, "FP16")])
def test_16_bit_tensors_reach_16_bit_storage_exactly(dtype, storage):
    keys, values, q = data()
    kt, vt = torch.from_numpy(keys).to(dtype), torch.from_numpy(values).to(dtype)
    index = kvindex.index_factory(D, storage + ",Flat")
    index.add_kv(kt, vt)
    # the stored keys are the tensor's values, bit for bit (a 16-bit value
    # widens to float32 exactly and narrows back to itself)
    for i in (0, 17, 299):
        np.testing.assert_array_equal(index.reconstruct(i), kt[i].float().numpy())
        np.testing.assert_array_equal(index.reconstruct_value(i), vt[i].float().numpy())
    out, _ = index.attend(torch.from_numpy(q).to(dtype))
    ref = kvindex.index_factory(D, storage + ",Flat")
    ref.add_kv(kt.float().numpy(), vt.float().numpy())
    np.testing.assert_array_equal(out.numpy(), ref.attend(torch.from_numpy(q).to(dtype).float().numpy())[0])


def test_a_cache_takes_and_returns_tensors():
    rng = np.random.default_rng(9)
    cache = kvindex.KVCache(2, 4, 2, D, "TopK(Flat)|k=8")
    k = torch.from_numpy(rng.standard_normal((2, 40, D)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((2, 40, D)).astype(np.float32))
    for layer in range(2):
        cache.prefill(layer, k, v)
    q = torch.from_numpy(rng.standard_normal((4, 1, D)).astype(np.float32))
    out, lse = cache.decode(0, k[:, :1], v[:, :1], q)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (4, 1, D)
    assert cache.n_tokens(0) == 41
    out2, _ = cache.attend(0, q)
    np.testing.assert_array_equal(out.numpy(), out2.numpy())


def test_other_dtypes_and_devices_are_refused_naming_them():
    index = kvindex.index_factory(D, "Flat")
    with pytest.raises(TypeError, match="keys must be a float16, float32 or float64 array; got dtype int32"):
        index.add_kv(torch.zeros((2, D), dtype=torch.int32), torch.zeros((2, D)))
    with pytest.raises(TypeError, match="keys is a torch tensor on 'meta'"):
        index.add_kv(torch.zeros((2, D), device="meta"), torch.zeros((2, D)))
    with pytest.raises(ValueError, match=r"keys must have shape \(n, 32\); got \(2, 31\)"):
        index.add_kv(torch.zeros((2, D - 1)), torch.zeros((2, D)))


def test_serialized_buffers_may_be_tensors():
    keys, values, _ = data()
    index = kvindex.index_factory(D, "Flat")
    index.add_kv(keys, values)
    buf = torch.from_numpy(kvindex.serialize_index(index))
    assert kvindex.deserialize_index(buf).ntotal == index.ntotal


def test_import_kvindex_does_not_import_torch():
    code = ("import sys\nsys.modules['torch'] = None  # torch absent\nimport kvindex, numpy as np\n"
            "i = kvindex.index_factory(8, 'Flat'); i.add_kv(np.ones((3, 8), np.float32), np.ones((3, 8), np.float32))\n"
            "print(i.attend(np.ones((1, 8), np.float32))[0].shape)\n"
            "try:\n    import kvindex.hf\nexcept ImportError as e:\n    print('hf needs torch')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["(1,", "8)", "hf", "needs", "torch"]
