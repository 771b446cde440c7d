"""Argument checking and array conversion: bad input raises ValueError /
RuntimeError / TypeError with a message that names the problem; any
float layout and float16/32/64 dtype is accepted."""
import re

import numpy as np
import pytest

import kvindex

D = 32


@pytest.fixture(scope="module")
def index():
    rng = np.random.default_rng(31)
    idx = kvindex.index_factory(D, "TopK(Flat)")
    idx.add_kv(rng.standard_normal((300, D)).astype(np.float32),
               rng.standard_normal((300, D)).astype(np.float32))
    return idx


@pytest.fixture
def q():
    return np.random.default_rng(32).standard_normal((5, D)).astype(np.float32)


def shape_msg(excinfo, *numbers):
    msg = str(excinfo.value)
    for n in numbers:
        assert re.search(rf"\b{n}\b", msg), f"'{n}' not in message: {msg}"
    return msg


# ---- shapes -----------------------------------------------------------------

def test_wrong_ndim(index, q):
    for bad in (q[0], q[None]):
        for call in (index.attend, index.select, lambda x: index.search(x, 3)):
            with pytest.raises(ValueError) as e:
                call(bad)
            shape_msg(e, D)


def test_wrong_d(index, q):
    bad = np.ones((5, D + 1), np.float32)
    with pytest.raises(ValueError) as e:
        index.attend(bad)
    shape_msg(e, D, D + 1)
    with pytest.raises(ValueError) as e:
        index.search(bad, 3)
    shape_msg(e, D, D + 1)
    with pytest.raises(ValueError) as e:
        index.add_kv(np.ones((4, D + 1), np.float32), np.ones((4, D), np.float32))
    assert "keys" in str(e.value)
    shape_msg(e, D + 1)
    with pytest.raises(ValueError) as e:
        index.add_kv(np.ones((4, D), np.float32), np.ones((4, D - 1), np.float32))
    assert "values" in str(e.value)


def test_keys_values_length_mismatch(index):
    n0 = index.ntotal
    with pytest.raises(ValueError) as e:
        index.add_kv(np.ones((10, D), np.float32), np.ones((9, D), np.float32))
    assert "values" in str(e.value) or "keys" in str(e.value)
    shape_msg(e, 9, 10)
    fresh = kvindex.index_factory(D, "Flat")
    with pytest.raises(ValueError):
        fresh.prefill(np.ones((10, D), np.float32), np.ones((9, D), np.float32))
    assert index.ntotal == n0 and fresh.ntotal == 0


# ---- values -------------------------------------------------------------------

@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite(bad, index, q):
    n0 = index.ntotal
    qq = q.copy()
    qq[2, 7] = bad
    for call in (index.attend, index.select, lambda x: index.search(x, 3)):
        with pytest.raises(ValueError, match="non-finite") as e:
            call(qq)
        assert "row 2" in str(e.value) and "column 7" in str(e.value), str(e.value)
    keys = np.ones((3, D), np.float32)
    keys[1, 4] = bad
    with pytest.raises(ValueError, match="non-finite"):
        index.add_kv(keys, np.ones((3, D), np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        index.add_kv(np.ones((3, D), np.float32), keys)
    fresh = kvindex.index_factory(D, "Flat")
    with pytest.raises(ValueError, match="non-finite"):
        fresh.prefill(keys, np.ones((3, D), np.float32))
    assert index.ntotal == n0 and fresh.ntotal == 0


@pytest.mark.parametrize("k", [0, -1])
def test_bad_k(k, index, q):
    with pytest.raises((ValueError, RuntimeError), match="k"):
        index.search(q, k)


def test_non_float_dtypes_raise_type_error(index, q):
    for bad in (q.astype(np.int64), q.astype(np.int32), q.astype(str),
                q.astype(np.complex64), (q > 0)):
        with pytest.raises(TypeError):
            index.attend(bad)
    with pytest.raises(TypeError):
        index.attend("not an array")
    with pytest.raises(TypeError):
        index.add_kv(np.ones((2, D), np.int64), np.ones((2, D), np.float32))


def test_unknown_factory_string():
    cases = {"Bogus17": "Bogus17", "TopK(NotAFaissIndex)": "NotAFaissIndex",
             "Sink4,Window64": "Sink4", "LSHSample0x0": "LSHSample", "Flat,Flat": "Flat"}
    for s, word in cases.items():
        with pytest.raises((RuntimeError, ValueError)) as e:
            kvindex.index_factory(D, s)
        assert word in str(e.value), str(e.value)
    with pytest.raises((RuntimeError, ValueError)):
        kvindex.index_factory(D, "")
    with pytest.raises((RuntimeError, ValueError), match="-3"):
        kvindex.index_factory(-3, "Flat")


def test_bad_rope_style(small):
    idx = kvindex.index_factory(small.keys.shape[1], "Flat")
    with pytest.raises((ValueError, RuntimeError), match="wobbly"):
        idx.prefill(small.keys, small.values, rope_style="wobbly")
    with pytest.raises((ValueError, RuntimeError), match="wobbly"):
        kvindex.apply_rope(small.keys, np.arange(small.keys.shape[0], dtype=np.int64),
                           style="wobbly")


# ---- layouts and dtypes ---------------------------------------------------

def test_non_contiguous_inputs(index, q):
    ref = index.attend(q)
    ref_D, ref_I = index.search(q, 7)
    wide = np.zeros((5, 2 * D), np.float32)
    wide[:, ::2] = q
    strided = wide[:, ::2]
    fortran = np.asfortranarray(q)
    transposed = np.ascontiguousarray(q.T).T
    rows = np.zeros((10, D), np.float32)
    rows[::2] = q
    for x in (strided, fortran, transposed, rows[::2]):
        assert not x.flags.c_contiguous
        out, lse = index.attend(x)
        np.testing.assert_array_equal(out, ref[0])
        np.testing.assert_array_equal(lse, ref[1])
        Dx, Ix = index.search(x, 7)
        np.testing.assert_array_equal(Ix, ref_I)
        np.testing.assert_array_equal(Dx, ref_D)
    # keys and values too
    rng = np.random.default_rng(5)
    keys = rng.standard_normal((D, 40)).astype(np.float32).T  # (40, D), F order
    vals = rng.standard_normal((40, 2 * D)).astype(np.float32)[:, ::2]
    a = kvindex.index_factory(D, "Flat")
    a.add_kv(keys, vals)
    b = kvindex.index_factory(D, "Flat")
    b.add_kv(np.ascontiguousarray(keys), np.ascontiguousarray(vals))
    for x, y in zip(a.attend(q), b.attend(q)):
        np.testing.assert_array_equal(x, y)


def test_float64_and_float16_inputs(index, q):
    ref = index.attend(q)
    out64, lse64 = index.attend(q.astype(np.float64))
    np.testing.assert_array_equal(out64, ref[0])
    np.testing.assert_array_equal(lse64, ref[1])
    q16 = q.astype(np.float16)
    out16, lse16 = index.attend(q16)
    r16 = index.attend(q16.astype(np.float32))
    np.testing.assert_array_equal(out16, r16[0])
    np.testing.assert_array_equal(lse16, r16[1])
    assert out16.dtype == np.float32
    # keys in float64
    rng = np.random.default_rng(6)
    k64 = rng.standard_normal((20, D))
    v64 = rng.standard_normal((20, D))
    a = kvindex.index_factory(D, "Flat")
    a.add_kv(k64, v64)
    np.testing.assert_array_equal(a.reconstruct(3), k64[3].astype(np.float32))


def test_inputs_are_not_modified(index, q):
    q0 = q.copy()
    index.attend(q)
    index.search(q, 4)
    index.select(q)
    np.testing.assert_array_equal(q, q0)


def test_read_only_input(index, q):
    q.setflags(write=False)
    out, _ = index.attend(q)
    assert out.shape == (5, D)


@pytest.mark.parametrize("string, rolls_back", [
    ("Flat", True), ("Sink4,Window8,LSHSample6x20", True), ("TopK(IVF4,Flat)", True),
    ("TopK(HNSW8)", False), ("RoarGraph8", False), ("Hybrid(TopK(Flat),Uniform)", False)])
def test_failure_contract_is_reported(string, rolls_back):
    # the C++ allocation-failure test (tests/test_allocation_faults.cpp)
    # checks each claim; here: the bindings report it, and a healthy index
    # has no failed write, before and after writes and a refused one
    idx = kvindex.index_factory(16, string)
    assert idx.writes_roll_back is rolls_back
    assert idx.failed_write is None
    rng = np.random.default_rng(33)
    k = rng.standard_normal((64, 16)).astype(np.float32)
    idx.add_kv(k, k)
    k[3, 2] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        idx.add_kv(k, k)  # refused before the write: nothing is marked
    assert idx.failed_write is None
    assert idx.ntotal == 64
