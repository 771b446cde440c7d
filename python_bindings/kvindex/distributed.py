"""kvindex.distributed: a KV cache spread over Ray actors.

::

    import ray
    from kvindex.distributed import RayKVCache

    ray.init()                                   # or ray.init(address="auto") on a cluster
    cache = RayKVCache(32, 32, 8, 128, "Sink4,Window64,LSHSample10x150", shards=4, placement="tokens")
    cache.prefill(layer, keys, values, queries)  # the methods of kvindex.KVCache
    out, lse = cache.attend(layer, q)

Each shard is a Ray actor holding a ``kvindex.KVCache`` of its part:

- ``placement="tokens"``: every layer and head, one contiguous range of the
  sequence's tokens (split evenly at prefill; appends go to the last
  shard). A decode step sends the layer's queries to every shard that holds
  tokens of that layer, one call per actor, and merges their (out, lse) by
  log-sum-exp, as the estimator layer merges partial attentions. Dense
  attention is the in-process answer up to rounding; a sparse index selects
  within each shard (its budget per shard, not per sequence).
- ``placement="heads"``: every layer and token, a share of the KV heads
  (with their query heads); the outputs are concatenated.
- ``placement="layers"``: every head and token of a share of the layers; a
  layer's calls go to the one actor that holds it.

With "heads" and "layers" every (layer, head) index is the one an in-process
``KVCache`` builds: the answers are identical for every type.

What moves per decode step and layer is the queries (n_q_heads x d floats)
to each actor and (out, lse) back: kilobytes, where the keys and values the
shards read are megabytes ("move the query, not the cache").

Calls travel by one of two transports, ``transport="auto"`` choosing per
actor:

- a *line*, to an actor on the driver's node: a Unix socket to a thread of
  the actor, length-prefixed pickled messages, one call in flight at a time.
  A decode step costs a few tens of microseconds per actor this way, where
  a Ray actor call costs most of a millisecond (its scheduling, its object
  store, its event loops; a compiled graph's shared-memory channels poll,
  which starves actors that share few cores);
- a Ray actor call, to an actor on another node (and for every call with
  ``transport="ray"``). The cache's own writes that are not a decode step
  (prefill, checkpoint) always go through Ray.

``checkpoint(path)`` writes every shard with kvindex's io (whole or not at
all) and ``RayKVCache.restore(path)`` rebuilds the cache on new actors. An
actor that died makes the next call raise ``ShardDiedError`` (a
``RuntimeError``) naming the shard;
a call that gets no answer within ``timeout_s`` raises ``TimeoutError``.

A prefill one shard refuses leaves every shard's layer empty
(``KVCache.reset_layer``). A step written to several shards (an append or a
one-token decode step with "heads", a decode step's queries with "tokens")
is all or nothing: when one
shard refuses it (a value its heads cannot hold, out of memory), the shards
that took it take it back (``KVCache.undo_append``; their queries are
learned only at their next call on the layer), and the error is raised
with the cache as it was. Where a shard cannot (a TopK over HNSW, a decode
step of several tokens), every later call raises, naming the step, until
the cache is restored from a checkpoint.
"""
import functools
import json
import os
import pickle
import shutil
import socket
import struct
import tempfile
import threading
import time

import numpy as np
import ray

import kvindex
from kvindex import _torch

PLACEMENTS = ("tokens", "heads", "layers")
TRANSPORTS = ("auto", "ray")
_FORMAT = 1  # of checkpoint's meta.json

# ---- lines: a driver's direct calls to an actor on its node -----------------

#: the _Shard methods a line carries (the decode loop's calls)
_LINE_METHODS = ("attend", "decode", "attend_and_learn", "append", "undo", "reset_layer", "n_tokens")
_HEADER = struct.Struct("<Q")  # a message's length in bytes


def _send(sock, message):
    data = pickle.dumps(message, protocol=5)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _receive_exactly(sock, n):
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise EOFError("the line was closed")
        got += r
    return buffer


def _receive(sock):
    (n,) = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
    return pickle.loads(_receive_exactly(sock, n))


class ShardDiedError(RuntimeError):
    """A shard's actor died: the cache is incomplete until restored from a
    checkpoint (RayKVCache.restore)."""


class _LineClosed(Exception):
    """The line to an actor closed mid-call (the actor died, or its thread did)."""


class _Line:
    """The driver's end of a line to one actor. Calls are numbered and each
    answer carries its call's number, so an answer left unread (a call
    given up on) is never taken for a later call's."""

    def __init__(self, path, timeout_s):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)
        self.sent = 0

    def call(self, method, args):
        """Sends one call; pickle's errors are raised before anything is sent."""
        self.sent += 1
        try:
            _send(self.sock, (self.sent, method, args))  # pickles first, then sends
        except (BrokenPipeError, ConnectionError) as e:
            return _LineCall(self, self.sent, _LineClosed(str(e)))
        return _LineCall(self, self.sent)

    def close(self):
        self.sock.close()


class _LineCall:
    """A call sent over a line. answer() waits for it until a deadline
    (time.monotonic()) and returns the actor's (ok, result or exception);
    it raises TimeoutError, or _LineClosed when the line closed."""

    def __init__(self, line, number, failed=None):
        self.line, self.number, self.failed = line, number, failed

    def answer(self, deadline):
        if self.failed is not None:
            raise self.failed
        while True:
            self.line.sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                number, ok, value = _receive(self.line.sock)
            except (socket.timeout, TimeoutError):
                raise TimeoutError("no answer") from None
            except (EOFError, ConnectionError) as e:
                raise _LineClosed(str(e)) from None
            if number == self.number:
                return ok, value
            # an earlier call's answer, given up on: dropped


def _one_at_a_time(method):
    """A _Shard method run under the shard's lock: its Ray calls and its
    line's calls never overlap."""

    @functools.wraps(method)
    def locked(self, *args):
        with self._lock:
            return method(self, *args)

    return locked


class _Shard:
    """One actor's part of the cache: a kvindex.KVCache.

    A step's writes can be taken back (``undo``) until the actor's next call
    on the layer: appends are made with ``append_undoable``, and a decode
    step's queries are learned (``add_queries``, which ends what can be
    taken back) at the start of that next call, in the order a single
    cache would run them."""

    def __init__(self, config=None, path=None):
        self._lock = threading.Lock()
        self.pending = {}  # layer -> the queries of its last step, to learn
        if path is not None:
            self.cache = kvindex.read_cache(path)
            return
        c = config
        self.cache = kvindex.KVCache(c["n_layers"], c["n_q_heads"], c["n_kv_heads"], c["d"], c["factory"],
                                     d_value=c["d_value"], dense_string=c["dense_string"],
                                     dense_layers=c["dense_layers"])
        for layer in range(c["n_layers"]):
            for h in range(c["n_kv_heads"]):
                index = self.cache.index(layer, h)
                # the random stream the whole cache's head would draw from
                index.set_stream(c["layers"][layer] * c["n_kv_heads_all"] + c["heads"][h])
                if c["params"] and layer not in c["dense_layers"]:
                    kvindex.set_index_parameters(index, c["params"])

    @_one_at_a_time
    def prefill(self, layer, keys, values, queries, positions, rope_theta, rope_style, first_position):
        self.cache.prefill(layer, keys, values, queries=queries, positions=positions, rope_theta=rope_theta,
                           rope_style=rope_style, first_position=first_position)

    def _learn(self, layer=None):
        """The pending queries of a layer (None: of every layer) learned."""
        for x in [layer] if layer is not None else list(self.pending):
            q = self.pending.pop(x, None)
            if q is not None:
                self.cache.add_queries(x, q)

    def _append(self, layer, keys, values):
        if self.cache.can_undo_append(layer):
            self.cache.append_undoable(layer, keys, values)
        else:
            self.cache.append(layer, keys, values)

    @_one_at_a_time
    def append(self, layer, keys, values):
        self._learn(layer)
        self._append(layer, keys, values)

    @_one_at_a_time
    def decode(self, layer, keys, values, q, params):
        """A decode step: its tokens appended, its queries attended; they are
        learned at the next call on the layer (one token), or now (n > 1
        tokens attend causally, each learned before the next is appended:
        such a step cannot be taken back)."""
        self._learn(layer)
        t0 = time.perf_counter()
        if keys.shape[1] != 1:
            out, lse = self.cache.decode(layer, keys, values, q, params)
            return out, lse, time.perf_counter() - t0
        self._append(layer, keys, values)
        try:
            out, lse = self.cache.attend(layer, q, params)
        except Exception:
            if self.cache.can_undo_append(layer):
                self.cache.undo_append(layer)
            raise
        self.pending[layer] = q
        return out, lse, time.perf_counter() - t0

    @_one_at_a_time
    def attend_and_learn(self, layer, q, params):
        """A decode step's queries on a shard that takes no new token: the
        attention over its tokens; the queries are learned at the next call
        on the layer (as decode learns them)."""
        self._learn(layer)
        t0 = time.perf_counter()
        out, lse = self.cache.attend(layer, q, params)
        self.pending[layer] = q
        return out, lse, time.perf_counter() - t0

    @_one_at_a_time
    def reset_layer(self, layer):
        self.pending.pop(layer, None)
        self.cache.reset_layer(layer)

    @_one_at_a_time
    def undo(self, layer, appended):
        """Takes back the layer's last step, which another shard refused:
        its append (appended), and its queries, not learned."""
        self.pending.pop(layer, None)
        if appended:
            self.cache.undo_append(layer)

    @_one_at_a_time
    def attend(self, layer, q, params):
        self._learn(layer)
        t0 = time.perf_counter()
        out, lse = self.cache.attend(layer, q, params)
        return out, lse, time.perf_counter() - t0

    @_one_at_a_time
    def n_tokens(self, layer):
        return self.cache.n_tokens(layer)

    @_one_at_a_time
    def memory_bytes(self):
        return self.cache.memory_bytes()

    @_one_at_a_time
    def checkpoint(self, path):
        self._learn()
        kvindex.write_cache(self.cache, path)

    def pid(self):
        return os.getpid()

    def node_id(self):
        return ray.get_runtime_context().get_node_id()

    def open_line(self, path, accept_timeout_s=60.0):
        """Listens on the Unix socket `path` for the driver, and serves its
        calls (one of _LINE_METHODS each: (method, args) -> (True, result)
        or (False, the exception), numbered as the call) in a thread, until the driver closes the
        line. Returns once the socket listens."""
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)
        server.settimeout(accept_timeout_s)

        def serve():
            try:
                sock, _ = server.accept()
            except OSError:
                return  # the driver never came: no line
            finally:
                server.close()
            with sock:
                while True:
                    try:
                        number, method, args = _receive(sock)
                    except (EOFError, OSError):
                        return
                    try:
                        if method not in _LINE_METHODS:
                            raise ValueError(f"a line does not carry '{method}'")
                        answer = (number, True, getattr(self, method)(*args))
                    except Exception as e:
                        answer = (number, False, e)
                    try:
                        _send(sock, answer)
                    except (pickle.PicklingError, TypeError, AttributeError) as e:
                        what = f"{type(answer[2]).__name__}: {answer[2]}"
                        _send(sock, (number, False, RuntimeError(f"{what} (its answer does not pickle: {e})")))

        threading.Thread(target=serve, name="kvindex-line", daemon=True).start()
        return path


def _array(x):
    """float32 numpy of a numpy array or a CPU torch tensor (any float dtype)."""
    if x is None:
        return None
    if _torch.is_tensor(x):
        x = x.detach().float().cpu().numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


def merge_by_lse(outs, lses):
    """Partial attentions over disjoint key sets -> the attention over their
    union: outs (S, heads, n, d_value), lses (S, heads, n); a part with
    lse = -inf (no key) weighs nothing (kvindex.merge_attention)."""
    return kvindex.merge_attention(outs, lses)


class RayKVCache:
    """A ``kvindex.KVCache`` whose shards are Ray actors.

    Args:
        n_layers, n_q_heads, n_kv_heads, d: the model's shape, as KVCache.
        index_string: ``"STRING"`` or ``"STRING|params"`` (params without
            percentages, which need the prompt: set them after prefill on
            ``kvindex.KVCache`` instead).
        shards: actors to spread over (at most n_kv_heads for "heads", at
            most n_layers for "layers").
        placement: "tokens", "heads" or "layers".
        actor_options: Ray options of each actor (default ``{"num_cpus": 0,
            "scheduling_strategy": "SPREAD"}``: actors do not wait for free
            CPUs, and spread over a cluster's nodes).
        timeout_s: seconds a call waits for its actors before TimeoutError.
        transport: "auto" (a line to each actor on the driver's node, Ray
            calls to the others) or "ray" (every call through Ray);
            ``transports`` says which each shard got.
    """

    def __init__(self, n_layers, n_q_heads, n_kv_heads, d, index_string, *, shards, placement="tokens",
                 d_value=None, dense_string="Flat", dense_layers=(), actor_options=None, timeout_s=300.0,
                 transport="auto", _restore_from=None):
        if placement not in PLACEMENTS:
            raise ValueError(f"RayKVCache: placement '{placement}' is not one of {', '.join(PLACEMENTS)}")
        if transport not in TRANSPORTS:
            raise ValueError(f"RayKVCache: transport '{transport}' is not one of {', '.join(TRANSPORTS)}")
        if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
            raise ValueError(f"RayKVCache: shards={shards!r} must be an integer >= 1")
        if n_kv_heads < 1 or n_q_heads % n_kv_heads:
            raise ValueError(f"RayKVCache: {n_q_heads} query heads do not group over {n_kv_heads} KV heads")
        limit = {"heads": n_kv_heads, "layers": n_layers}.get(placement)
        if limit is not None and shards > limit:
            raise ValueError(f"RayKVCache: {shards} shards for placement '{placement}', which has {limit} "
                             f"{placement} to spread")
        factory, params = kvindex.parse_index_spec(index_string)[:2]
        kvindex.index_factory(d, factory, d_value)  # a bad string fails here, before any actor starts
        dense_layers = sorted(int(x) for x in dense_layers)
        if any(not 0 <= x < n_layers for x in dense_layers):
            raise ValueError(f"RayKVCache: dense layers {dense_layers} outside the {n_layers} layers")
        self.n_layers, self.n_q_heads, self.n_kv_heads, self.d = n_layers, n_q_heads, n_kv_heads, d
        self.d_value = d_value or d
        self.index_string, self.dense_string, self.dense_layers = index_string, dense_string, dense_layers
        self.placement, self.n_shards, self.timeout_s = placement, shards, timeout_s
        self.group = n_q_heads // n_kv_heads
        # what each shard holds: layers (global numbers) and KV heads
        split = lambda n: [list(map(int, part)) for part in np.array_split(np.arange(n), shards)]  # noqa: E731
        self.layers_of = split(n_layers) if placement == "layers" else [list(range(n_layers))] * shards
        self.heads_of = split(n_kv_heads) if placement == "heads" else [list(range(n_kv_heads))] * shards
        # tokens each shard holds, per layer
        self.counts = [[0] * shards for _ in range(n_layers)]
        self._broken = None  # why the shards are out of step, if they are
        self.lines, self._line_dir = [None] * shards, None  # _open_lines
        options = {"num_cpus": 0, "scheduling_strategy": "SPREAD"}
        options.update(actor_options or {})
        actor = ray.remote(_Shard).options(**options)
        if _restore_from is not None:
            self.actors = [actor.remote(path=os.path.join(_restore_from, f"shard_{s}.kvc")) for s in range(shards)]
        else:
            self.actors = []
            for s in range(shards):
                layers = self.layers_of[s]
                config = {"n_layers": len(layers), "n_q_heads": self.group * len(self.heads_of[s]),
                          "n_kv_heads": len(self.heads_of[s]), "d": d, "d_value": d_value, "factory": factory,
                          "params": params, "dense_string": dense_string,
                          "dense_layers": [layers.index(x) for x in dense_layers if x in layers],
                          "layers": layers, "heads": self.heads_of[s], "n_kv_heads_all": n_kv_heads}
                self.actors.append(actor.remote(config=config))
        self._get([a.pid.remote() for a in self.actors], range(shards), "start")  # every actor up
        self._open_lines(transport)

    # ---- routing --------------------------------------------------------------

    def _check_layer(self, layer):
        self._check_usable()
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.n_layers:
            raise IndexError(f"RayKVCache: layer {layer} outside [0, {self.n_layers})")

    def _local(self, s, layer):
        return self.layers_of[s].index(layer)

    def _holding(self, layer):
        """The shards that hold tokens or heads of the layer."""
        if self.placement == "layers":
            return [s for s in range(self.n_shards) if layer in self.layers_of[s]]
        if self.placement == "heads":
            return list(range(self.n_shards))
        return [s for s in range(self.n_shards) if self.counts[layer][s] > 0]

    def _call(self, s, method, *args):
        """Shard s's method called: over its line where it has one (and the
        line carries the method), else through Ray. Returns a handle for
        _settle: a _LineCall or a Ray ObjectRef."""
        line = self.lines[s]
        if line is not None and method in _LINE_METHODS:
            try:
                return line.call(method, args)
            except (pickle.PicklingError, TypeError, AttributeError):
                pass  # arguments pickle cannot carry (a line sends nothing then): Ray's serializer
        return getattr(self.actors[s], method).remote(*args)

    def _settle(self, handles, shards, what):
        """Waits for one call per shard, all within timeout_s; per call
        (True, its result) or (False, the error as the caller sees it:
        ShardDiedError, TimeoutError, or the shard's own exception named by
        the shard)."""
        deadline = time.monotonic() + self.timeout_s
        results = []
        for s, handle in zip(shards, handles):
            try:
                if isinstance(handle, _LineCall):
                    ok, value = handle.answer(deadline)
                else:
                    ok, value = True, ray.get(handle, timeout=max(deadline - time.monotonic(), 0.0))
            except ray.exceptions.RayTaskError as e:
                ok, value = False, e.cause if e.cause is not None else e.as_instanceof_cause()
            except Exception as e:
                results.append((False, self._transport_error(e, s, what)))
                continue
            results.append((True, value) if ok else (False, self._shard_error(value, s)))
        return results

    def _transport_error(self, error, s, what):
        """What a call to shard s that got no answer raises."""
        if isinstance(error, (ray.exceptions.GetTimeoutError, TimeoutError)):
            return TimeoutError(f"RayKVCache.{what}: no answer from shard {s} within {self.timeout_s} s")
        dead = ShardDiedError(f"RayKVCache.{what}: shard {s} (actor {self.actors[s]._actor_id.hex()[:12]}) died; "
                              f"the cache is incomplete: restore it from a checkpoint (RayKVCache.restore)")
        if isinstance(error, ray.exceptions.RayActorError):
            return dead
        if isinstance(error, _LineClosed):
            self._drop_line(s)
            try:
                ray.get(self.actors[s].pid.remote(), timeout=min(self.timeout_s, 10.0))
            except Exception:
                return dead
            self._broken = (f"RayKVCache.{what}: the line to shard {s} closed mid-call; the shard's state is "
                            f"unknown: restore the cache from a checkpoint (RayKVCache.restore)")
            return RuntimeError(self._broken)
        return error

    def _shard_error(self, error, s):
        """Shard s's own exception (a kvindex error), its type kept, its
        message prefixed with the shard and the layers and KV heads it
        holds: the shard's own cache numbers them from 0."""
        where = f"shard {s} (layers {self._span(self.layers_of[s])}, KV heads {self._span(self.heads_of[s])}, " \
                f"numbered from 0 in its cache)"
        try:
            return type(error)(f"{where}: {error}")
        except Exception:
            return error

    @staticmethod
    def _first_error(results):
        """The error a call over several shards raises: a dead actor first,
        then a timeout, then the first shard's error."""
        errors = [e for ok, e in results if not ok]
        for kind in (ShardDiedError, TimeoutError):
            for e in errors:
                if isinstance(e, kind):
                    return e
        return errors[0]

    def _get(self, handles, shards, what):
        """The results of one call per shard; the first error raised."""
        results = self._settle(list(handles), list(shards), what)
        if not all(ok for ok, _ in results):
            raise self._first_error(results)
        return [value for _, value in results]

    @staticmethod
    def _span(xs):
        return f"{xs[0]}-{xs[-1]}" if len(xs) > 1 else f"{xs[0]}"

    def _write(self, handles, shards, what, undo):
        """_get of a write spread over several shards, all or nothing: when
        some shards raise, those that wrote take it back (undo(s): a call
        handle), then the first error is raised. A shard that cannot take
        its write back leaves the cache out of step: every later call
        refuses."""
        shards = list(shards)
        results = self._settle(list(handles), shards, what)
        if all(ok for ok, _ in results):
            return [value for _, value in results]
        done = [s for s, (ok, _) in zip(shards, results) if ok]
        if done and len(shards) > 1:
            try:
                self._get([undo(s) for s in done], done, what)
            except Exception as e:
                self._broken = (f"RayKVCache.{what}: shards {done} took a step that another shard refused, and "
                                f"could not take it back ({e}): the shards are out of step; restore the cache "
                                f"from a checkpoint (RayKVCache.restore)")
        raise self._first_error(results)

    def _drop_line(self, s):
        """Shard s's later calls go through Ray."""
        if self.lines[s] is not None:
            self.lines[s].close()
            self.lines[s] = None

    def _open_lines(self, transport):
        """A line to each actor on the driver's node (transport "auto");
        None (as __init__ set them) for the others, and where a line cannot
        be opened."""
        if transport != "auto":
            return
        here = ray.get_runtime_context().get_node_id()
        nodes = self._get([self._call(s, "node_id") for s in range(self.n_shards)], range(self.n_shards), "start")
        self._line_dir = tempfile.mkdtemp(prefix="kvindex-")
        for s in range(self.n_shards):
            if nodes[s] != here:
                continue
            path = os.path.join(self._line_dir, str(s))
            try:
                self._get([self._call(s, "open_line", path)], [s], "start")
                self.lines[s] = _Line(path, self.timeout_s)
            except Exception:
                self.lines[s] = None  # this actor cannot reach the driver's files: Ray calls

    @property
    def transports(self):
        """How each shard is called: "line" or "ray"."""
        return ["ray" if line is None else "line" for line in self.lines]

    def _check_usable(self):
        if self._broken:
            raise RuntimeError(self._broken)

    def _tokens(self, keys, values, what, convert=True):
        """keys and values as float32 numpy (convert=False: as given, for a
        caller that converts slice by slice), the keys' shape checked
        ((n_kv_heads, n, d)); the values are checked where they are stored."""
        if convert:
            keys, values = _array(keys), _array(values)
        shape = tuple(keys.shape)
        if len(shape) != 3 or shape[0] != self.n_kv_heads or shape[2] != self.d:
            raise ValueError(f"RayKVCache.{what}: keys of shape {shape}, ({self.n_kv_heads}, n, {self.d}) "
                             f"expected")
        return keys, values

    def _heads(self, s, x, per_head):
        """The rows of x (heads first) that shard s holds: KV heads
        (per_head=1) or their query heads (per_head=group)."""
        if self.placement != "heads":
            return x
        h = self.heads_of[s]
        return x[h[0] * per_head:(h[-1] + 1) * per_head]

    # ---- kvindex.KVCache's methods -----------------------------------------

    def prefill(self, layer, keys, values, queries=None, positions=None, rope_theta=10000.0, rope_style="half"):
        """As KVCache.prefill; placement "tokens" splits the tokens evenly,
        each shard learning from the queries that can see its range."""
        self._check_layer(layer)
        tokens = self.placement == "tokens"
        # token shards: each slice is converted as it is sent, so that a long
        # prompt in 16 bits never exists whole in float32 (1M tokens x 8
        # heads x 128: 8 GiB where the float16 prompt is 4)
        keys, values = self._tokens(keys, values, "prefill", convert=not tokens)
        if any(self.counts[layer]):
            raise ValueError(f"RayKVCache.prefill: layer {layer} already holds tokens (use append)")
        n = keys.shape[1]
        q = _array(queries)
        pos = None
        if q is not None:
            nq = q.shape[1]
            pos = np.arange(n - nq, n, dtype=np.int64) if positions is None else np.asarray(positions, np.int64)
        try:
            self._prefill(layer, keys, values, q, pos, n, rope_theta, rope_style)
        except Exception:
            # all or nothing: the shards that took their part are emptied
            shards = range(self.n_shards) if tokens else self._holding(layer)
            if len(shards) > 1:
                try:
                    self._get([self._call(s, "reset_layer", self._local(s, layer)) for s in shards], shards,
                              "prefill")
                except Exception as e:
                    self._broken = (f"RayKVCache.prefill: a shard refused layer {layer}'s prefill, and the "
                                    f"others could not be emptied ({e}): restore the cache from a checkpoint")
            raise

    def _prefill(self, layer, keys, values, q, pos, n, rope_theta, rope_style):
        tokens = self.placement == "tokens"
        calls, shards = [], []
        if tokens:
            bounds = np.linspace(0, n, self.n_shards + 1).astype(int)
            for s in range(self.n_shards):
                a, b = int(bounds[s]), int(bounds[s + 1])
                if b == a:
                    continue
                sq, sp = None, None
                if q is not None:
                    sees = pos >= a  # the queries that attend some of the range
                    if sees.any():
                        sq, sp = q[:, sees], pos[sees]
                if len(calls) >= 2:
                    # two slices in flight at most: their copies in Ray's
                    # object store are freed as their shards finish
                    self._get(calls[-2:-1], shards[-2:-1], "prefill")
                calls.append(self._call(s, "prefill", layer, _array(keys[:, a:b]), _array(values[:, a:b]), sq, sp,
                                        rope_theta, rope_style, a))
                shards.append(s)
            self._get(calls, shards, "prefill")
            for s in range(self.n_shards):
                self.counts[layer][s] = int(bounds[s + 1] - bounds[s])
            return
        for s in self._holding(layer):
            calls.append(self._call(
                s, "prefill", self._local(s, layer), self._heads(s, keys, 1), self._heads(s, values, 1),
                None if q is None else self._heads(s, q, self.group), pos, rope_theta, rope_style, 0))
            shards.append(s)
        self._get(calls, shards, "prefill")
        for s in shards:
            self.counts[layer][s] = n

    def append(self, layer, keys, values):
        """As KVCache.append; placement "tokens" appends to the last shard."""
        self._check_layer(layer)
        keys, values = self._tokens(keys, values, "append")
        n = keys.shape[1]
        if self.placement == "tokens":
            shards = [self.n_shards - 1]
            calls = [self._call(self.n_shards - 1, "append", layer, keys, values)]
        else:
            shards = self._holding(layer)
            calls = [self._call(s, "append", self._local(s, layer), self._heads(s, keys, 1),
                                                  self._heads(s, values, 1)) for s in shards]
        self._write(calls, shards, "append", lambda s: self._call(s, "undo", self._local(s, layer), True))
        for s in shards:
            self.counts[layer][s] += n

    def decode(self, layer, keys, values, q, params=None):
        """As KVCache.decode: a decode step of a layer, its new tokens
        appended (to the last shard for "tokens"), its queries (n_q_heads, n,
        d) answered over every token and learned; n > 1 new tokens attend
        causally, token by token."""
        self._check_layer(layer)
        keys, values = self._tokens(keys, values, "decode")
        q = _array(q)
        if q.ndim != 3 or q.shape[0] != self.n_q_heads or q.shape[1] != keys.shape[1]:
            raise ValueError(f"RayKVCache.decode: q of shape {q.shape}, ({self.n_q_heads}, {keys.shape[1]}, "
                             f"{self.d}) expected")
        n = keys.shape[1]
        if self.placement == "tokens":
            last = self.n_shards - 1
            shards = [s for s in self._holding(layer) if s != last] + [last]
            calls = [self._call(s, "attend_and_learn", layer, q, params) for s in shards[:-1]]
            calls.append(self._call(last, "decode", layer, keys, values, q, params))
        else:
            shards = self._holding(layer)
            calls = [self._call(s, "decode", self._local(s, layer), self._heads(s, keys, 1), self._heads(s, values, 1),
                                self._heads(s, q, self.group), params) for s in shards]
        last = self.n_shards - 1
        parts = self._write(calls, shards, "decode", lambda s: self._call(
            s, "undo", self._local(s, layer), self.placement != "tokens" or s == last))
        for s in ([self.n_shards - 1] if self.placement == "tokens" else shards):
            self.counts[layer][s] += n
        return self._assemble(shards, parts)

    def attend(self, layer, q, params=None):
        """As KVCache.attend: q (n_q_heads, n, d) -> out (n_q_heads, n,
        d_value), lse (n_q_heads, n)."""
        self._check_layer(layer)
        q = _array(q)
        if q.ndim != 3 or q.shape[0] != self.n_q_heads or q.shape[2] != self.d:
            raise ValueError(f"RayKVCache.attend: q of shape {q.shape}, ({self.n_q_heads}, n, {self.d}) expected")
        shards = self._holding(layer)
        if not shards:
            raise ValueError(f"RayKVCache.attend: layer {layer} holds no token")
        # the queries travel inline with each call (kilobytes: below Ray's
        # object store threshold, a put would cost a round trip more)
        calls = [self._call(s, "attend", self._local(s, layer), self._heads(s, q, self.group), params)
                 for s in shards]
        return self._assemble(shards, self._get(calls, shards, "attend"))

    def _assemble(self, shards, parts):
        """(out, lse) of the layer from the shards' (out, lse, seconds):
        token shards merged by lse, head shards concatenated in head order,
        a layer's one shard as it is."""
        #: seconds each called shard spent inside its cache's call (the rest
        #: of the call is transport, scheduling and the merge)
        self.last_attend_seconds = {s: p[2] for s, p in zip(shards, parts)}
        if self.placement == "tokens" and len(parts) > 1:
            return merge_by_lse([p[0] for p in parts], [p[1] for p in parts])
        if self.placement == "heads":
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        return parts[0][:2]

    def n_tokens(self, layer):
        self._check_layer(layer)
        return sum(self.counts[layer]) if self.placement == "tokens" else max(self.counts[layer])

    def memory_per_actor(self):
        """Bytes each actor's cache holds."""
        shards = range(self.n_shards)
        return self._get([self._call(s, "memory_bytes") for s in shards], shards, "memory_bytes")

    def memory_bytes(self):
        return sum(self.memory_per_actor())

    # ---- checkpoints ----------------------------------------------------------

    def checkpoint(self, path):
        """Writes every shard (kvindex's cache files, each whole or not at
        all) and meta.json into directory path."""
        self._check_usable()  # a cache out of step is not saved as if it were whole
        path = os.path.abspath(path)
        os.makedirs(path, exist_ok=True)
        self._get([self._call(s, "checkpoint", os.path.join(path, f"shard_{s}.kvc")) for s in range(self.n_shards)],
                  range(self.n_shards), "checkpoint")
        meta = {"format": _FORMAT, "n_layers": self.n_layers, "n_q_heads": self.n_q_heads,
                "n_kv_heads": self.n_kv_heads, "d": self.d, "d_value": self.d_value,
                "index_string": self.index_string, "dense_string": self.dense_string,
                "dense_layers": self.dense_layers, "shards": self.n_shards, "placement": self.placement,
                "counts": self.counts}
        tmp = os.path.join(path, "meta.json.tmp")
        with open(tmp, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, "meta.json"))

    @classmethod
    def restore(cls, path, *, actor_options=None, timeout_s=300.0, transport="auto"):
        """The cache checkpoint(path) wrote, on new actors."""
        path = os.path.abspath(path)
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        if meta.get("format") != _FORMAT:
            raise ValueError(f"RayKVCache.restore: '{path}' has format {meta.get('format')}, this build reads "
                             f"{_FORMAT}")
        cache = cls(meta["n_layers"], meta["n_q_heads"], meta["n_kv_heads"], meta["d"], meta["index_string"],
                    shards=meta["shards"], placement=meta["placement"], d_value=meta["d_value"],
                    dense_string=meta["dense_string"], dense_layers=meta["dense_layers"],
                    actor_options=actor_options, timeout_s=timeout_s, transport=transport, _restore_from=path)
        cache.counts = meta["counts"]
        return cache

    def shutdown(self):
        """Ends the actors (the cache is unusable after)."""
        for s in range(self.n_shards):
            self._drop_line(s)
        for a in self.actors:
            ray.kill(a)
        if self._line_dir is not None:
            shutil.rmtree(self._line_dir, ignore_errors=True)
            self._line_dir = None


def ray_storage(shards, placement="heads", **options):
    """The storage of ``kvindex.hf.KVIndexCache(model, s, storage=...)`` that
    puts each sequence's cache on Ray actors: a RayKVCache of ``shards``
    actors. "heads" (the default) and "layers" give the in-process answers
    exactly; "tokens" spends a sparse budget per shard."""

    def make(n_layers, n_q_heads, n_kv_heads, d, index_string, dense_string, dense_layers):
        return RayKVCache(n_layers, n_q_heads, n_kv_heads, d, index_string, shards=shards, placement=placement,
                          dense_string=dense_string, dense_layers=dense_layers, **options)

    return make


# a call given torch tensors returns torch tensors, as kvindex's own do
_torch.wrap_methods(RayKVCache, ["attend", "decode"])
