"""RoPE helpers against a float64 numpy RoPE, and prefill arguments."""
import numpy as np
import pytest

import kvindex
import kvref


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_apply_rope_matches_numpy(style, theta):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((50, 64)).astype(np.float32)
    pos = np.r_[np.arange(40), [100, 1000, 8191, 65536, 1_000_000, 3_000_000,
                                 5, 0, 17, 123456]].astype(np.int64)
    y = kvindex.apply_rope(x, pos, theta=theta, style=style)
    assert y.dtype == np.float32 and y.shape == x.shape
    ref = kvref.rope(x, pos, theta, style)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    back = kvindex.invert_rope(y, pos, theta=theta, style=style)
    np.testing.assert_allclose(back, x, rtol=1e-5, atol=1e-5)


def test_apply_rope_leaves_input_unchanged():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    x0 = x.copy()
    y = kvindex.apply_rope(x, np.arange(8, dtype=np.int64) * 7)
    np.testing.assert_array_equal(x, x0)
    assert not np.array_equal(y, x)
    # position 0 is the identity
    np.testing.assert_array_equal(kvindex.apply_rope(x, np.zeros(8, dtype=np.int64)), x)


def test_rope_styles_differ_and_default_is_half():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    p = np.array([1, 2, 3, 4], dtype=np.int64)
    np.testing.assert_array_equal(kvindex.apply_rope(x, p), kvindex.apply_rope(x, p, style="half"))
    assert not np.allclose(kvindex.apply_rope(x, p, style="half"),
                           kvindex.apply_rope(x, p, style="interleaved"))


def test_rope_bad_arguments():
    x = np.ones((4, 8), np.float32)
    p = np.arange(4, dtype=np.int64)
    with pytest.raises((ValueError, RuntimeError), match="sideways"):
        kvindex.apply_rope(x, p, style="sideways")
    with pytest.raises((ValueError, RuntimeError), match="even"):
        kvindex.apply_rope(np.ones((4, 7), np.float32), p)
    with pytest.raises(ValueError, match="positions"):
        kvindex.apply_rope(x, np.arange(3, dtype=np.int64))
    with pytest.raises((ValueError, RuntimeError), match="theta"):
        kvindex.apply_rope(x, p, theta=-1.0)
    with pytest.raises((ValueError, RuntimeError), match="position"):
        kvindex.apply_rope(x, np.array([0, 1, -2, 3], dtype=np.int64))


def test_prefill_records_rope_and_refuses_second_prefill(small):
    index = kvindex.index_factory(small.keys.shape[1], "Flat")
    index.prefill(small.keys, small.values, rope_theta=500000.0, rope_style="interleaved")
    assert index.ntotal == small.keys.shape[0]
    with pytest.raises(RuntimeError, match="prefill"):
        index.prefill(small.keys, small.values)
    other = kvindex.index_factory(small.keys.shape[1], "Flat")
    with pytest.raises((ValueError, RuntimeError), match="diagonal"):
        other.prefill(small.keys, small.values, rope_style="diagonal")
    assert other.ntotal == 0


def test_prefill_equals_add_kv_for_flat(small):
    a = kvindex.index_factory(small.keys.shape[1], "Flat")
    a.prefill(small.keys, small.values, queries=small.prompt_queries,
              query_positions=np.arange(small.keys.shape[0], dtype=np.int64))
    b = kvindex.index_factory(small.keys.shape[1], "Flat")
    b.add_kv(small.keys, small.values)
    for x, y in zip(a.attend(small.queries), b.attend(small.queries)):
        np.testing.assert_array_equal(x, y)
