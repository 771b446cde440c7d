"""kvindex: the KV cache of a long-context LLM as a Faiss-style vector index.

Each sparse-attention method is an index type built from a factory string
(``index_factory(128, "Sink4,Window64,LSHSample10x150")``); indexes take and
return numpy arrays the way faiss's Python wrappers do::

    index = kvindex.index_factory(d, "TopK(Flat)")
    index.add_kv(keys, values)             # (n, d), (n, d_value)
    D, I = index.search(q, k)              # as faiss
    out, lse = index.attend(q)             # attention output and log-sum-exp
    kvindex.write_index(index, "cache.kvix")

Every call that takes numpy arrays also takes CPU torch tensors, and then
returns tensors; ``kvindex.hf.KVIndexCache`` runs a transformers model's
decode attention through a kvindex cache. torch and transformers are
optional: ``pip install ./python_bindings[torch]`` or ``[hf]``.

See docs/python_api.md for the whole API.
"""

from ._kvindex import (  # noqa: F401
    IndexChoose,
    IndexHybrid,
    IndexKVFlat,
    IndexLSHSample,
    IndexProxyEvict,
    IndexRoarGraph,
    IndexIVFAsym,
    IndexSinkWindow,
    IndexTopK,
    IndexUniformSample,
    IndexWeightedSample,
    IndexTypeInfo,
    KVCache,
    KVIndex,
    ParameterInfo,
    Selection,
    apply_rope,
    blas_core_below_cpu,
    blas_core_for_this_cpu,
    blas_core_name,
    clone_index,
    deserialize_cache,
    deserialize_index,
    get_index_parameter,
    index_factory,
    index_factory_string,
    index_parameter_info,
    index_types,
    invert_rope,
    merge_attention,
    parse_index_spec,
    read_cache,
    read_index,
    read_trace,
    resolve_percentages,
    serialize_cache,
    serialize_index,
    set_index_parameter,
    set_index_parameters,
    time_attend,
    weighted_inclusion,
    write_cache,
    write_index,
    write_trace,
)

from . import _torch

__version__ = "0.1.0"

# torch in, torch out (kvindex/_torch.py): the calls that return arrays
_torch.wrap_methods(KVIndex, ["search", "attend", "reconstruct", "reconstruct_value"])
_torch.wrap_methods(KVCache, ["attend", "decode"])
_torch.wrap_methods(IndexIVFAsym, ["probe_buckets", "moment_log_masses"])
apply_rope = _torch.returns_torch_for_torch(apply_rope)
invert_rope = _torch.returns_torch_for_torch(invert_rope)
weighted_inclusion = _torch.returns_torch_for_torch(weighted_inclusion)
merge_attention = _torch.returns_torch_for_torch(merge_attention)


def _index_from_bytes(data):
    return deserialize_index(data)


def _reduce_ex(index, protocol):
    # pickling goes through the io container, like faiss's serialize_index:
    # the record says its own type, so every subclass round-trips (a
    # module-level Python function, since pickle cannot name a pybind11 one)
    return (_index_from_bytes, (serialize_index(index).tobytes(),))


KVIndex.__reduce_ex__ = _reduce_ex


def _cache_from_bytes(data):
    return deserialize_cache(data)


def _reduce_cache_ex(cache, protocol):
    # the same for a whole cache (pickle, copy.copy and copy.deepcopy: a
    # copy never shares an index with the original)
    return (_cache_from_bytes, (serialize_cache(cache).tobytes(),))


KVCache.__reduce_ex__ = _reduce_cache_ex

__all__ = [name for name in dir() if not name.startswith("_")]
