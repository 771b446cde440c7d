"""Each class of error reaches Python as the exception a user expects, with
a message that says what was wrong and no C++ internals (kvindex/errors.h):
a bad argument ValueError or TypeError, a corrupt file or buffer ValueError
naming it, a file the system refuses OSError, a failure inside a
computation RuntimeError."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import kvindex

INTERNALS = re.compile(r"\.(cpp|h):\d+|Error in |' failed|kvindex::|std::")


def clean(e):
    msg = str(e.value)
    assert not INTERNALS.search(msg), msg
    return msg


def test_factory_string():
    with pytest.raises(ValueError) as e:
        kvindex.index_factory(64, "NoSuch")
    assert clean(e).startswith("index_factory: cannot parse 'NoSuch' in 'NoSuch'")
    # the C++ location stays at hand for a bug report
    assert re.search(r"index_factory\.cpp:\d+", e.value.kvindex_location), e.value.kvindex_location
    with pytest.raises(ValueError) as e:
        kvindex.index_factory(64, "TopK(IVFx,Flat)")
    assert "could not parse index string IVFx,Flat" in clean(e)


def test_knobs():
    index = kvindex.index_factory(64, "TopK(Flat)")
    with pytest.raises(ValueError) as e:
        kvindex.set_index_parameters(index, "nprobe=4")
    assert clean(e) == "unknown parameter 'nprobe' for index TopK(Flat)"
    with pytest.raises(ValueError) as e:
        kvindex.set_index_parameters(index, "k=0")
    assert clean(e) == "parameter k=0 must be a positive integer"
    with pytest.raises(ValueError) as e:
        kvindex.index_factory(64, "IVFAsym4|nprobe=9")
    assert clean(e) == "parameter nprobe=9 must be an integer in [0, C=4]"


def test_shapes_dtypes_and_values():
    index = kvindex.index_factory(8, "Flat")
    with pytest.raises(ValueError) as e:
        index.add_kv(np.zeros((3, 7), np.float32), np.zeros((3, 8), np.float32))
    assert clean(e) == "keys must have shape (n, 8); got (3, 7)"
    with pytest.raises(TypeError) as e:
        index.add_kv(np.zeros((3, 8), np.int32), np.zeros((3, 8), np.float32))
    assert "keys must be a float16, float32 or float64 array; got dtype int32" in clean(e)
    keys = np.ones((3, 8), np.float32)
    keys[1, 2] = np.inf
    with pytest.raises(ValueError) as e:
        index.add_kv(keys, keys)
    assert clean(e) == "add_kv: keys: non-finite value inf at row 1, column 2"
    index.add_kv(np.ones((3, 8), np.float32), np.ones((3, 8), np.float32))
    with pytest.raises(ValueError) as e:
        index.search(np.ones((1, 8), np.float32), 0)
    assert clean(e) == "k must be > 0; got 0"
    with pytest.raises(ValueError) as e:
        kvindex.KVCache(2, 9, 2, 8, "Flat")
    assert clean(e) == "KVCache: n_q_heads=9 is not a multiple of n_kv_heads=2 (GQA)"


def test_corrupt_buffers_and_files_name_what_was_read(tmp_path):
    index = kvindex.index_factory(8, "Flat")
    index.add_kv(np.ones((5, 8), np.float32), np.ones((5, 8), np.float32))
    raw = kvindex.serialize_index(index).tobytes()
    with pytest.raises(ValueError) as e:
        kvindex.deserialize_index(np.frombuffer(raw[:-3], np.uint8))
    assert clean(e).startswith("read_index: buffer of %d bytes: " % (len(raw) - 3))
    with pytest.raises(ValueError) as e:
        kvindex.deserialize_index(np.frombuffer(b"x" * 100, np.uint8))
    assert clean(e) == "read_index: buffer of 100 bytes: not a kvindex file (bad magic)"
    p = tmp_path / "flipped.kvix"
    flipped = bytearray(raw)
    flipped[-1] ^= 0x55
    p.write_bytes(bytes(flipped))
    with pytest.raises(ValueError) as e:
        kvindex.read_index(str(p))
    assert clean(e) == "read_index: '%s': checksum mismatch (corrupt file)" % p


def test_files_the_system_refuses(tmp_path):
    missing = str(tmp_path / "missing.kvix")
    with pytest.raises(FileNotFoundError) as e:
        kvindex.read_index(missing)
    assert e.value.filename == missing
    assert e.value.strerror == "read_index: cannot open: No such file or directory"
    assert clean(e) == "[Errno 2] read_index: cannot open: No such file or directory: '%s'" % missing
    with pytest.raises(OSError) as e:
        kvindex.read_index(str(tmp_path))
    assert "not a regular file" in clean(e)


def test_failures_inside_a_computation_are_runtime_errors():
    empty = kvindex.index_factory(8, "Flat")
    with pytest.raises(RuntimeError) as e:
        empty.attend(np.ones((1, 8), np.float32))
    assert not isinstance(e.value, ValueError)
    assert "empty" in clean(e)


def test_the_location_on_request():
    code = "import kvindex\ntry:\n    kvindex.index_factory(8, 'NoSuch')\nexcept ValueError as e:\n    print(e)\n"
    env = dict(os.environ, KVINDEX_ERROR_LOCATION="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert re.search(r"cannot parse 'NoSuch'.* \[.* at .*index_factory\.cpp:\d+\]", out.stdout), out.stdout
