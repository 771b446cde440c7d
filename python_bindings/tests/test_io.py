"""write_index / read_index, serialize_index / deserialize_index, pickle,
clone_index and copy.deepcopy:
the index read back answers bit for bit as the original, keeps decoding
identically, and damaged buffers raise RuntimeError (never crash)."""
import copy
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvindex
from conftest import attr, build, registry_and_extra_factories


def assert_same_answers(a, b, q):
    assert kvindex.index_factory_string(a) == kvindex.index_factory_string(b)
    assert attr(a, "type_name") == attr(b, "type_name")
    assert (a.ntotal, a.d, a.d_value) == (b.ntotal, b.d, b.d_value)
    assert getattr(a, "k", None) == getattr(b, "k", None)
    oa, la = a.attend(q)
    ob, lb = b.attend(q)
    np.testing.assert_array_equal(oa, ob)
    np.testing.assert_array_equal(la, lb)
    Da, Ia = a.search(q, 10)
    Db, Ib = b.search(q, 10)
    np.testing.assert_array_equal(Ia, Ib)
    np.testing.assert_array_equal(Da, Db)
    for sa, sb in zip(a.select(q), b.select(q)):
        np.testing.assert_array_equal(np.asarray(sa.ids), np.asarray(sb.ids))
        np.testing.assert_array_equal(np.asarray(sa.inclusion), np.asarray(sb.inclusion))


@pytest.mark.parametrize("factory", registry_and_extra_factories())
def test_round_trips(factory, small, tmp_path):
    index = build(factory, small)
    # k is a knob only of the chains that read a top-k budget
    has_k = "k" in [p.name for p in kvindex.index_parameter_info(index)]
    if has_k:
        kvindex.set_index_parameters(index, "k=7")
    q = small.queries
    buf = kvindex.serialize_index(index)
    assert isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1
    copies = {
        "numpy": kvindex.deserialize_index(buf),
        "bytes": kvindex.deserialize_index(buf.tobytes()),
        "bytearray": kvindex.deserialize_index(bytearray(buf.tobytes())),
        "pickle": pickle.loads(pickle.dumps(index)),
        "clone_index": kvindex.clone_index(index),
        "deepcopy": copy.deepcopy(index),
    }
    path = str(tmp_path / "index.kvix")
    kvindex.write_index(index, path)
    assert os.path.getsize(path) == buf.size
    copies["file"] = kvindex.read_index(path)
    for how, c in copies.items():
        assert type(c) is type(index), how
        if has_k:
            assert c.k == 7, how
        assert_same_answers(index, c, q)
        c.check_invariants()
    # decoding goes on identically on both
    rng = np.random.default_rng(11)
    a, b = index, copies["pickle"]
    for _ in range(3):
        kv = rng.standard_normal((2, 2, small.keys.shape[1])).astype(np.float32)
        a.add_kv(kv[0], kv[1])
        b.add_kv(kv[0], kv[1])
        assert_same_answers(a, b, q)


def test_empty_index_round_trip():
    index = kvindex.index_factory(16, "Sink4,Window8,LSHSample6x20")
    c = kvindex.deserialize_index(kvindex.serialize_index(index))
    assert c.ntotal == 0
    assert kvindex.index_factory_string(c) == "Sink4,Window8,LSHSample6x20"


def test_truncated_buffers_raise(small):
    index = build("Sink2,Window8,TopK(Flat)", small, n=50)
    raw = kvindex.serialize_index(index).tobytes()
    for cut in sorted({0, 1, 4, 8, 16, 32, len(raw) // 3, len(raw) // 2, len(raw) - 1}):
        with pytest.raises(ValueError, match="buffer of %d bytes" % cut):
            kvindex.deserialize_index(raw[:cut])


def test_corrupted_header_raises(small):
    index = build("Flat", small, n=50)
    buf = kvindex.serialize_index(index).copy()
    buf[:4] ^= 0xFF
    with pytest.raises(ValueError, match="not a kvindex file"):
        kvindex.deserialize_index(buf)


def test_read_missing_or_garbage_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist.kvix") as e:
        kvindex.read_index(str(tmp_path / "does-not-exist.kvix"))
    assert e.value.filename == str(tmp_path / "does-not-exist.kvix")
    p = tmp_path / "garbage.kvix"
    p.write_bytes(b"not an index at all" * 10)
    with pytest.raises(ValueError, match="garbage.kvix': not a kvindex file"):
        kvindex.read_index(str(p))


def test_deserialize_wrong_type():
    with pytest.raises(TypeError):
        kvindex.deserialize_index("a string")
    with pytest.raises((TypeError, ValueError, RuntimeError)):
        kvindex.deserialize_index(np.zeros(10, dtype=np.float32))


FUZZ = textwrap.dedent("""
    import sys
    import numpy as np
    import kvindex
    rng = np.random.default_rng(2024)
    d = 16
    keys = rng.standard_normal((60, d)).astype(np.float32)
    vals = rng.standard_normal((60, d)).astype(np.float32)
    q = rng.standard_normal((3, d)).astype(np.float32)
    raised = loaded = 0
    for s in sys.argv[1:]:
        index = kvindex.index_factory(d, s)
        index.prefill(keys, vals, queries=keys)
        good = kvindex.serialize_index(index)
        for trial in range(120):
            buf = good.copy()
            for _ in range(1 + trial % 3):
                buf[rng.integers(buf.size)] = rng.integers(256)
            try:
                c = kvindex.deserialize_index(buf)
            except ValueError:
                raised += 1
                continue
            loaded += 1
            # what loads must answer or refuse cleanly, never crash
            for call in (lambda: c.attend(q), lambda: c.search(q, 5), lambda: c.select(q)):
                try:
                    call()
                except RuntimeError:
                    pass
    print("raised", raised, "loaded", loaded)
""")


def test_random_corruption_never_crashes():
    """Random byte flips: deserialize raises ValueError or the index loads
    and answers; run in a subprocess so that a crash is a failure, not the
    end of the test run."""
    strings = ["Flat", "Sink2,Window8,LSHSample6x20", "TopK(IVF4,Flat)", "ProxyEvict20"]
    r = subprocess.run([sys.executable, "-c", FUZZ, *strings], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert "raised" in r.stdout
