"""kvindex.hf: a transformers model decodes through a kvindex cache.

::

    from kvindex.hf import KVIndexCache
    cache = KVIndexCache(model, "Sink4,Window64,LSHSample10x150")
    model.generate(input_ids, past_key_values=cache, max_new_tokens=32)

How it works (transformers 5.x). ``KVIndexCache`` is a ``Cache`` whose
layers are ``KVIndexLayer``s. The model's attention calls
``cache.update(keys, values, layer_idx)`` and then its attention function;
``KVIndexCache`` registers one of its own (``AttentionInterface``, with the
mask function of the model's implementation, ``AttentionMaskInterface``) and
selects it on the model (``set_attn_implementation``). ``update`` leaves a
note for the attention function of its layer:

- prefill (the first forward): the layer keeps the prompt's keys and values
  densely and returns them, the attention is the model's own (exact), and
  then each (layer, KV head) index is built from the prompt's keys, values
  and queries, post-RoPE as the model computed them (``KVCache.prefill``).
  The dense copies are dropped.
- decode: each new token is appended to its layer's indexes and its queries
  attend through them, in one call into C++ per layer for every head
  (``KVCache.decode``, the GIL released). Several new tokens in one forward
  (a chunk after the prompt) attend token by token, causally.

An attention call without a note from a ``KVIndexCache`` (another cache, or
none) goes to the model's own implementation: the model answers as before
for every other cache.

Batches: each sequence gets its own ``kvindex.KVCache``; a left-padded batch
works, and padding never enters an index (the pad positions are read from
the attention mask at prefill). Right padding is refused.
"""
import copy
import json
import math
import os
import threading
import weakref

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import kvindex

#: model types whose attention is the Llama family's: GQA, RoPE applied to
#: queries and keys before the cache (rotate-half), softmax(q k / sqrt(d))
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

#: the attention implementations a model may have before, which ours falls
#: back to (and whose mask functions it uses)
_FALLBACKS = ("sdpa", "eager")

_FORMAT = 1  # of the files cache.save writes

# update() leaves the note for the attention function of the same layer, in
# the same thread, before the model calls it
_notes = threading.local()


def _note_table():
    table = getattr(_notes, "by_layer", None)
    if table is None:
        table = _notes.by_layer = {}
    return table


def _eager(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                   **kwargs)


def _fallback_function(name):
    return _eager if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]


def _attention(fallback):
    """The attention function registered as ``kvindex_<fallback>``."""
    fallback_fn = _fallback_function(fallback)

    def kvindex_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        note = _note_table().pop(module.layer_idx, None)
        if note is None:  # not a KVIndexCache's call: the model's own attention
            return fallback_fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                               **kwargs)
        layer, new_keys, new_values = note
        layer.cache._check_module(module)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        if new_keys is None:  # prefill: exact, then the indexes
            out = fallback_fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
            layer._build(query, attention_mask, scaling)
            return out
        return layer._decode(query, new_keys, new_values, scaling), None

    return kvindex_attention


def _install(model):
    """Selects kvindex's attention on the model; returns the implementation
    it replaces (which it falls back to)."""
    current = model.config._attn_implementation
    if current is not None and current.startswith("kvindex_"):
        return current[len("kvindex_"):]
    fallback = current or "sdpa"
    if fallback not in _FALLBACKS:
        raise ValueError(
            f"KVIndexCache: the model's attention implementation is '{fallback}'; kvindex falls back to the "
            f"model's own attention for other caches and at prefill, and knows {', '.join(_FALLBACKS)} "
            f"(load the model with attn_implementation='sdpa')")
    name = "kvindex_" + fallback
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _attention(fallback))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[fallback])
    model.set_attn_implementation(name)
    return fallback


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _rope_theta(config):
    theta = getattr(config, "rope_theta", None)
    params = getattr(config, "rope_parameters", None) or {}
    if theta is None:
        theta = params.get("rope_theta")
    if theta is None:
        raise ValueError("KVIndexCache: the model's config has no rope_theta")
    return float(theta), params.get("rope_type", "default")


class KVIndexLayer(CacheLayerMixin):
    """One layer of a ``KVIndexCache``: the prompt's keys and values until
    the layer's indexes are built from them, then the indexes' token count."""

    is_compileable = False
    is_croppable = False

    def __init__(self, cache, layer_idx):
        super().__init__()
        # a weak reference: the cache holds its layers, and a layer holding
        # the cache would keep a dropped cache's indexes until the cycle
        # collector ran
        self._cache = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.built = False
        self.n_tokens = 0  # every position seen, padding included (what the masks count)

    def __deepcopy__(self, memo):
        """A deep copy of the cache (transformers' prompt reuse) copies its
        layers, each referring to the copy; a layer copied alone refers to
        the same cache."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name == "_cache":
                cache = value()
                value = weakref.ref(memo.get(id(cache), cache)) if cache is not None else value
            else:
                value = copy.deepcopy(value, memo)
            setattr(new, name, value)
        return new

    @property
    def cache(self):
        cache = self._cache()
        if cache is None:
            raise RuntimeError(f"KVIndexCache: layer {self.layer_idx}'s cache was dropped; keep the KVIndexCache "
                               f"while the model decodes through it")
        return cache

    def lazy_initialization(self, key_states, value_states):
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.cache._check_states(key_states, value_states, self.layer_idx)
        notes = _note_table()
        if self.layer_idx in notes:
            notes.pop(self.layer_idx)
            raise RuntimeError(
                f"KVIndexCache: layer {self.layer_idx}'s last attention did not go through kvindex: the model's "
                f"attention implementation was changed after the cache was made")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.n_tokens += key_states.shape[-2]
        if not self.built:
            # prefill: kept densely, answered by the model's own attention
            if self.keys is None:
                self.keys, self.values = key_states, value_states
            else:
                self.keys = torch.cat([self.keys, key_states], dim=-2)
                self.values = torch.cat([self.values, value_states], dim=-2)
            notes[self.layer_idx] = (self, None, None)
            return self.keys, self.values
        notes[self.layer_idx] = (self, key_states, value_states)
        return key_states, value_states

    def _build(self, query, attention_mask, scaling):
        """Each sequence's indexes of this layer, from the prompt's keys,
        values and queries (padding left out)."""
        cache = self.cache
        q = query.detach()
        keys, values = self.keys.detach(), self.values.detach()
        n = keys.shape[-2]
        if q.shape[-2] != n:
            raise ValueError(
                f"KVIndexCache: layer {self.layer_idx}'s prefill has {q.shape[-2]} queries for {n} tokens; the "
                f"prompt must be the first forward of a fresh cache")
        pads = cache._pads(attention_mask, keys.shape[0], n)
        for b, pad in enumerate(pads):
            seq = cache._sequence(b, n - pad)
            seq.prefill(self.layer_idx, keys[b, :, pad:], values[b, :, pad:],
                        queries=cache._scaled(q[b, :, pad:], scaling), rope_theta=cache.rope_theta,
                        rope_style="half")
        self.keys = self.values = None
        self.built = True

    def _decode(self, query, new_keys, new_values, scaling):
        cache = self.cache
        layer = self.layer_idx
        outs = [seq.decode(layer, new_keys[b], new_values[b], cache._scaled(query[b], scaling))[0]
                for b, seq in enumerate(cache.sequences)]
        # (n_q_heads, m, d_value) per sequence -> (batch, m, n_q_heads, d_value)
        out = outs[0].unsqueeze(0) if len(outs) == 1 else torch.stack(outs)
        out = out.transpose(1, 2)
        return out if out.dtype == query.dtype else out.to(query.dtype)

    def get_seq_length(self):
        return self.n_tokens

    def get_mask_sizes(self, query_length):
        return self.n_tokens + query_length, 0

    def get_max_length(self):
        return -1

    def reset(self):
        self.keys = self.values = None
        self.built = False
        self.n_tokens = 0
        self.is_initialized = False


class KVIndexCache(Cache):
    """A transformers cache whose decode attention runs through kvindex
    indexes built from a factory string, one per (layer, KV head) and
    sequence.

    Args:
        model: a Llama-family decoder (``SUPPORTED_MODEL_TYPES``: GQA, RoPE),
            loaded with the sdpa or eager attention.
        index_string: ``"STRING"`` or ``"STRING|params"`` (kvindex's factory
            grammar; a knob in percent, ``k=2%``, is a share of each
            sequence's prompt).
        dense_layers: layers built from ``dense_string`` instead.
        dense_string: the string of the dense layers (default ``"Flat"``).
        storage: where each sequence's cache lives: None, a
            ``kvindex.KVCache`` in this process; or a callable ``storage(n_layers,
            n_q_heads, n_kv_heads, d, index_string, dense_string,
            dense_layers)`` giving an object with KVCache's prefill, decode and
            memory_bytes, such as ``kvindex.distributed.ray_storage(shards=3)``
            (the cache spread over Ray actors).
    """

    def __init__(self, model, index_string, dense_layers=(), dense_string="Flat", storage=None):
        config = _text_config(model)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"KVIndexCache: model type '{model_type}' is not supported: kvindex needs a Llama-family decoder "
                f"({', '.join(SUPPORTED_MODEL_TYPES)}: GQA, RoPE applied before the cache, softmax attention)")
        window = getattr(config, "sliding_window", None)
        if window is not None and getattr(config, "use_sliding_window", True):
            raise ValueError(
                f"KVIndexCache: the model attends a sliding window of {window} tokens; kvindex's indexes attend "
                f"every token they hold, which would change the model")
        self.n_layers = config.num_hidden_layers
        self.n_q_heads = config.num_attention_heads
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_q_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_q_heads
        self.rope_theta, rope_type = _rope_theta(config)
        self.index_string = index_string
        self.dense_string = dense_string
        self.dense_layers = sorted(int(layer) for layer in dense_layers)
        spec = kvindex.parse_index_spec(index_string)
        self._factory, self._params = spec[0], spec[1]
        for s in (self._factory, dense_string):  # the strings, checked now (ValueError)
            kvindex.index_factory(self.head_dim, s)
        if rope_type != "default" and "IVFAsym" in self._factory:
            raise ValueError(
                f"KVIndexCache: IVFAsym undoes RoPE with theta={self.rope_theta}, but the model scales its RoPE "
                f"('{rope_type}'): its buckets would be wrong")
        bad = [layer for layer in self.dense_layers if not 0 <= layer < self.n_layers]
        if bad:
            raise ValueError(f"KVIndexCache: dense layers {bad} outside the model's {self.n_layers} layers")
        self.storage = storage
        self.sequences = []  # one kvindex.KVCache (or storage's cache) per sequence of the batch
        self._config = config
        self._model_name = getattr(config, "name_or_path", model_type)
        super().__init__(layers=[KVIndexLayer(self, layer) for layer in range(self.n_layers)])
        self.fallback = _install(model)

    # ---- what the layers ask -----------------------------------------------

    def _check_module(self, module):
        if getattr(module, "config", None) is not self._config:
            raise ValueError(
                f"KVIndexCache: this cache was made for {self._model_name}; another model's attention called it "
                f"(make a KVIndexCache for each model)")

    def _check_states(self, keys, values, layer_idx):
        if layer_idx >= self.n_layers or keys.dim() != 4 or keys.shape[1] != self.n_kv_heads or \
                keys.shape[-1] != self.head_dim:
            raise ValueError(
                f"KVIndexCache: layer {layer_idx} got keys of shape {tuple(keys.shape)}; this cache was made for "
                f"{self._model_name}: {self.n_layers} layers of {self.n_kv_heads} KV heads of {self.head_dim} "
                f"(make a KVIndexCache for each model)")
        if self.sequences and keys.shape[0] != len(self.sequences):
            raise ValueError(
                f"KVIndexCache: a batch of {keys.shape[0]} sequences, the cache holds {len(self.sequences)}")

    def _scaled(self, q, scaling):
        # kvindex scores q.k / sqrt(d); a model that scales otherwise gets
        # its scale through the queries
        factor = scaling * math.sqrt(self.head_dim)
        return q if abs(factor - 1.0) < 1e-12 else q * factor

    def _pads(self, attention_mask, batch, n):
        """The left padding of each sequence, read from the prefill's mask
        (the last query sees every real token, no pad)."""
        if attention_mask is None:
            return [0] * batch
        last = attention_mask[:, 0, -1, -n:]
        seen = last if last.dtype == torch.bool else last == 0
        pads = []
        for b in range(batch):
            row = seen[b] if seen.shape[0] > 1 else seen[0]
            real = torch.nonzero(row).flatten()
            if real.numel() == 0:
                raise ValueError(f"KVIndexCache: sequence {b} of the batch has no token")
            pad = int(real[0])
            if int(real[-1]) != n - 1 or real.numel() != n - pad:
                raise ValueError(
                    f"KVIndexCache: sequence {b} of the batch is not left-padded (its tokens are not the last "
                    f"{real.numel()} of {n}): pad on the left (tokenizer.padding_side = 'left')")
            pads.append(pad)
        return pads

    def _sequence(self, b, n_prompt):
        """Sequence b's kvindex.KVCache, made at its first layer's prefill,
        its knobs resolved against its prompt's length."""
        while len(self.sequences) <= b:
            self.sequences.append(None)
        if self.sequences[b] is not None:
            return self.sequences[b]
        # the knobs, percentages made counts of this prompt: one resolution
        # serves every head, all built from the same string
        params = self._params
        if params:
            params = kvindex.resolve_percentages(params, n_prompt, kvindex.index_factory(self.head_dim, self._factory))
        if self.storage is not None:
            self.sequences[b] = self.storage(self.n_layers, self.n_q_heads, self.n_kv_heads, self.head_dim,
                                             self._factory + ("|" + params if params else ""), self.dense_string,
                                             self.dense_layers)
            return self.sequences[b]
        seq = kvindex.KVCache(self.n_layers, self.n_q_heads, self.n_kv_heads, self.head_dim, self._factory,
                              dense_string=self.dense_string, dense_layers=self.dense_layers)
        if params:
            for layer in range(self.n_layers):
                if layer in self.dense_layers:
                    continue
                for h in range(self.n_kv_heads):
                    kvindex.set_index_parameters(seq.index(layer, h), params)
        self.sequences[b] = seq
        return self.sequences[b]

    # ---- the user's side ----------------------------------------------------

    def index(self, layer, kv_head, sequence=0):
        """The kvindex index of (layer, KV head) of a sequence of the batch."""
        if not 0 <= sequence < len(self.sequences):
            raise IndexError(f"sequence {sequence} outside the {len(self.sequences)} the cache holds (prefill first)")
        if self.storage is not None:
            raise TypeError("KVIndexCache.index: this cache's indexes live in its storage's processes "
                            "(cache.sequences[b] is the storage's cache)")
        return self.sequences[sequence].index(layer, kv_head)

    def __deepcopy__(self, memo):
        """A deep copy (transformers' prompt reuse: copy.deepcopy of a
        prefilled cache, one per continuation): its own indexes and layers,
        for the same model (the model's config is shared, not copied)."""
        memo[id(self._config)] = self._config
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            setattr(new, name, copy.deepcopy(value, memo))
        return new

    def memory_bytes(self):
        return sum(seq.memory_bytes() for seq in self.sequences)

    def save(self, path):
        """Writes the cache into directory ``path`` (created): every
        sequence's indexes (kvindex's cache files) and what the model needs
        to go on. ``KVIndexCache.load(model, path)`` continues from there."""
        if self.storage is not None:
            raise ValueError("KVIndexCache.save: this cache lives in its storage (e.g. Ray actors): checkpoint "
                             "each sequence's cache there (RayKVCache.checkpoint)")
        if any(not layer.built for layer in self.layers) and any(layer.n_tokens for layer in self.layers):
            raise RuntimeError("KVIndexCache.save: a prefill is under way (some layers are not built yet)")
        os.makedirs(path, exist_ok=True)
        for b, seq in enumerate(self.sequences):
            kvindex.write_cache(seq, os.path.join(path, f"sequence_{b}.kvc"))
        meta = {"format": _FORMAT, "model": self._model_name, "n_layers": self.n_layers,
                "n_q_heads": self.n_q_heads, "n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim,
                "rope_theta": self.rope_theta, "index_string": self.index_string,
                "dense_string": self.dense_string, "dense_layers": self.dense_layers,
                "sequences": len(self.sequences), "n_tokens": [layer.n_tokens for layer in self.layers]}
        tmp = os.path.join(path, "meta.json.tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, "meta.json"))

    @classmethod
    def load(cls, model, path):
        """The cache ``save`` wrote, for the same model: generation goes on
        with the whole sequence so far as input_ids."""
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        if meta.get("format") != _FORMAT:
            raise ValueError(f"KVIndexCache.load: '{path}' has format {meta.get('format')}, this build reads {_FORMAT}")
        cache = cls(model, meta["index_string"], dense_layers=meta["dense_layers"], dense_string=meta["dense_string"])
        for key in ("n_layers", "n_q_heads", "n_kv_heads", "head_dim"):
            if meta[key] != getattr(cache, key):
                raise ValueError(
                    f"KVIndexCache.load: '{path}' was saved for a model with {key}={meta[key]}; this one has "
                    f"{getattr(cache, key)}")
        cache.sequences = [kvindex.read_cache(os.path.join(path, f"sequence_{b}.kvc"))
                           for b in range(meta["sequences"])]
        for layer, n in zip(cache.layers, meta["n_tokens"]):
            layer.n_tokens = n
            layer.built = n > 0
            layer.is_initialized = n > 0
            layer.device, layer.dtype = model.device, model.dtype
        return cache
