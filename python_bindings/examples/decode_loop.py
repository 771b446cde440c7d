#!/usr/bin/env python3
"""Replays the decode phase of a trace through several kvindex factory
strings and prints, per index, the mean relative error of the attention
output against an exact float64 numpy reference and the time per step.

    python decode_loop.py [TRACE_DIR] [--layer 0] [--steps 32]
                          [--index "TopK(Flat)" --index "Sink4,Window64,LSHSample10x150" ...]

TRACE_DIR defaults to data/default of the repository when it exists;
otherwise (or with --synthetic) a small synthetic trace is generated in a
temporary directory with kvindex.write_trace. Semantics of a trace
(trace.h): the cache is prefilled with tokens [0, n_ctx) and their
queries; each evaluation position p >= n_ctx appends token p, then its
query attends causally to tokens [0, p], then goes to add_queries (the
"append us" column counts the append and add_queries).
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

import kvindex

DEFAULT_INDEXES = [
    "Flat",
    "TopK(Flat)",
    "BF16,Flat",
    "Sink4,Window64,TopK(Flat)|k=64",
    "Sink4,Window64,LSHSample10x150",
    "Sink4,Window64,TopK(IVF16,Flat)|nprobe=4",
    "ProxyEvict20",
]


def synthetic_trace(dirname, n_tokens, n_ctx, d=64, hq=4, hkv=2, seed=0):
    """LLM-like geometry: keys with a shared offset, queries that look back
    at a few earlier keys (sparse attention), RoPE applied (post-RoPE)."""
    rng = np.random.default_rng(seed)
    pos = np.arange(n_tokens, dtype=np.int64)
    keys = np.empty((hkv, n_tokens, d), np.float32)
    values = rng.standard_normal((hkv, n_tokens, d)).astype(np.float32)
    queries = np.empty((hq, n_tokens, d), np.float32)
    g = hq // hkv
    for h in range(hkv):
        raw = rng.standard_normal((n_tokens, d)) + 2.0 * rng.standard_normal(d)
        keys[h] = kvindex.apply_rope(raw, pos)
        for j in range(g):
            # each query points at an earlier key of its KV head, plus noise
            target = (rng.random(n_tokens) * (pos + 1)).astype(np.int64)
            qr = 0.6 * raw[target] + 1.5 * rng.standard_normal((n_tokens, d))
            queries[h * g + j] = kvindex.apply_rope(qr, pos)
    meta = {"n_ctx": n_ctx, "rope_theta": 10000.0, "rope_style": "half",
            "source": "decode_loop.py synthetic", "dtype": "float32"}
    kvindex.write_trace(dirname, meta, [{"keys": keys, "values": values, "queries": queries}])


def exact_reference(keys, values, q, group):
    """keys/values (hkv, p, d), q (hq, d) -> out (hq, dv) in float64."""
    out = np.empty((q.shape[0], values.shape[2]))
    for h in range(q.shape[0]):
        kv = h // group
        s = keys[kv].astype(np.float64) @ q[h].astype(np.float64) / np.sqrt(keys.shape[2])
        w = np.exp(s - s.max())
        out[h] = (w @ values[kv].astype(np.float64)) / w.sum()
    return out


def replay(spec, meta, layer, steps, refs):
    factory, params = kvindex.parse_index_spec(spec)
    hq, hkv, d = meta["n_q_heads"], meta["n_kv_heads"], meta["head_dim"]
    n_ctx = meta["n_ctx"]
    keys, values, queries = layer["keys"], layer["values"], layer["queries"]
    cache = kvindex.KVCache(1, hq, hkv, d, factory)
    if params:
        # budgets in percent ("k=2%") are of the prompt, as kvbench reads them
        params = kvindex.resolve_percentages(params, n_ctx, cache.index(0, 0))
        for h in range(hkv):
            kvindex.set_index_parameters(cache.index(0, h), params)
    t0 = time.perf_counter()
    cache.prefill(0, keys[:, :n_ctx], values[:, :n_ctx], queries=queries[:, :n_ctx],
                  rope_theta=meta["rope_theta"], rope_style=meta["rope_style"])
    build_s = time.perf_counter() - t0
    cache.attend(0, queries[:, n_ctx - 1:n_ctx])  # warm-up (thread pool, first touch)
    errs, t_attend, t_append = [], 0.0, 0.0
    for i, p in enumerate(range(n_ctx, n_ctx + steps)):
        t0 = time.perf_counter()
        cache.append(0, keys[:, p:p + 1], values[:, p:p + 1])
        t1 = time.perf_counter()
        out, _ = cache.attend(0, queries[:, p:p + 1])
        t2 = time.perf_counter()
        cache.add_queries(0, queries[:, p:p + 1])  # answered: RoarGraph learns them
        t3 = time.perf_counter()
        t_append += (t1 - t0) + (t3 - t2)
        t_attend += t2 - t1
        ref = refs[i]
        e = np.linalg.norm(out[:, 0] - ref, axis=1) / np.linalg.norm(ref, axis=1)
        errs.append(e)
    errs = np.concatenate(errs)
    bytes_per_token = cache.memory_bytes() / (hkv * (n_ctx + steps))
    return dict(build_s=build_s, err=errs.mean(), p95=np.percentile(errs, 95),
                attend_us=t_attend / steps * 1e6, append_us=t_append / steps * 1e6,
                bytes_per_token=bytes_per_token)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default_trace = os.path.normpath(os.path.join(here, "..", "..", "data", "default"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=None,
                    help=f"trace directory (default: {default_trace} if present)")
    ap.add_argument("--synthetic", action="store_true", help="generate a synthetic trace")
    ap.add_argument("--n-tokens", type=int, default=4096, help="synthetic trace length")
    ap.add_argument("--n-ctx", type=int, default=4000, help="synthetic prompt length")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--steps", type=int, default=32, help="decode steps replayed")
    ap.add_argument("--index", action="append", default=None,
                    help="factory string, optionally STRING|params (repeatable)")
    args = ap.parse_args()

    tmp = None
    trace = args.trace
    if trace is None and not args.synthetic and os.path.exists(
            os.path.join(default_trace, "meta.json")):
        trace = default_trace
    if trace is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvtrace-")
        trace = tmp.name
        synthetic_trace(trace, args.n_tokens, args.n_ctx)
    try:
        meta, layers = kvindex.read_trace(trace, layers=[args.layer])
        layer = layers[0]
        n_ctx, n_tokens = meta["n_ctx"], meta["n_tokens"]
        steps = min(args.steps, n_tokens - n_ctx)
        if steps <= 0:
            sys.exit(f"trace {trace}: no evaluation positions (n_ctx = n_tokens = {n_tokens})")
        group = meta["n_q_heads"] // meta["n_kv_heads"]
        print(f"trace {trace if tmp is None else '(synthetic)'}: layer {args.layer}, "
              f"{meta['n_q_heads']} query / {meta['n_kv_heads']} KV heads, d={meta['head_dim']}, "
              f"n_ctx={n_ctx}, {steps} decode steps")
        refs = [exact_reference(layer["keys"][:, :p + 1], layer["values"][:, :p + 1],
                                layer["queries"][:, p], group)
                for p in range(n_ctx, n_ctx + steps)]
        print(f"{'index':<44} {'build s':>8} {'rel err':>9} {'p95':>9} "
              f"{'us/step':>9} {'append us':>9} {'B/token':>8}")
        for spec in args.index or DEFAULT_INDEXES:
            try:
                r = replay(spec, meta, layer, steps, refs)
            except (RuntimeError, ValueError) as e:
                print(f"{spec:<44} failed: {e}")
                continue
            print(f"{spec:<44} {r['build_s']:8.3f} {r['err']:9.2e} {r['p95']:9.2e} "
                  f"{r['attend_us']:9.1f} {r['append_us']:9.1f} {r['bytes_per_token']:8.0f}")
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
