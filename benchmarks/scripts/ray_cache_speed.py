#!/usr/bin/env python3
"""One layer of a long KV cache in one process and spread over Ray actors
(kvindex.distributed.RayKVCache, placement "tokens"), on this machine.

For each string: the same keys and values (random, float16 in the driver,
stored as the string says) prefilled in one process (kvindex.KVCache) and
over --shards actors; then --steps decode steps of one query per query head,
each timed. Reported, medians over the steps:

- memory: the in-process cache's bytes and each actor's;
- ms per layer: one attend of the layer (in process) / one RayKVCache.attend
  (queries out, every shard's attend, (out, lse) back, the merge), over
  each --transport (auto: a line to each actor, all on this node; ray: Ray
  actor calls);
- slowest shard: the longest time a shard spent inside its KVCache.attend;
- overhead: the Ray call less its slowest shard (transport, scheduling,
  the merge).

Usage: .venv/bin/python benchmarks/scripts/ray_cache_speed.py [--tokens 1048576]
           [--kv-heads 8] [--q-heads 32] [--d 128] [--shards 4] [--steps 20]
           [--index 'BF16,Flat' ...] [--transport auto --transport ray]
           [--json FILE] [--plot FILE]
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import ray

import kvindex
from kvindex.distributed import RayKVCache

DEFAULT_INDEXES = ["BF16,Flat", "BF16,Sink4,Window64,LSHSample10x150"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def data(args):
    """keys, values (n_kv_heads, n, d) float16, made one head at a time."""
    rng = np.random.default_rng(1)
    shape = (args.kv_heads, args.tokens, args.d)
    keys, values = np.empty(shape, np.float16), np.empty(shape, np.float16)
    for h in range(args.kv_heads):
        keys[h] = rng.standard_normal((args.tokens, args.d), dtype=np.float32)
        values[h] = rng.standard_normal((args.tokens, args.d), dtype=np.float32)
    return keys, values


def queries(args, steps):
    rng = np.random.default_rng(2)
    return [(2 * rng.standard_normal((args.q_heads, 1, args.d))).astype(np.float32) for _ in range(steps)]


def one_process(args, string, keys, values, qs):
    cache = kvindex.KVCache(1, args.q_heads, args.kv_heads, args.d, string)
    t0 = time.perf_counter()
    cache.prefill(0, keys, values)
    prefill_s = time.perf_counter() - t0
    times = []
    for i, q in enumerate(qs):
        t0 = time.perf_counter()
        cache.attend(0, q)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    row = {"index": string, "where": "one process", "memory_bytes": cache.memory_bytes(), "prefill_s": prefill_s,
           "ms_per_layer": 1e3 * statistics.median(times)}
    del cache
    return row


def wait_until_gone(pids, seconds=120):
    deadline = time.monotonic() + seconds
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)


def spread(args, string, keys, values, qs, transport):
    # one OpenMP thread per actor: the actors share this machine's cores
    options = {"runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(args.actor_threads)}}}
    cache = RayKVCache(1, args.q_heads, args.kv_heads, args.d, string, shards=args.shards, placement="tokens",
                       actor_options=options, transport=transport)
    how = "lines" if set(cache.transports) == {"line"} else "Ray calls" if set(cache.transports) == {"ray"} \
        else "+".join(cache.transports)
    t0 = time.perf_counter()
    cache.prefill(0, keys, values)
    prefill_s = time.perf_counter() - t0
    times, slowest = [], []
    for i, q in enumerate(qs):
        t0 = time.perf_counter()
        cache.attend(0, q)
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt)
            slowest.append(max(cache.last_attend_seconds.values()))
    per_actor = cache.memory_per_actor()
    pids = ray.get([a.pid.remote() for a in cache.actors])
    cache.shutdown()
    wait_until_gone(pids)  # ray.kill returns before the actors' memory is given back
    med = statistics.median
    return {"index": string, "where": f"{args.shards} actors, {how}", "memory_bytes": sum(per_actor),
            "memory_per_actor": per_actor, "prefill_s": prefill_s, "ms_per_layer": 1e3 * med(times),
            "slowest_shard_ms": 1e3 * med(slowest),
            "overhead_ms": 1e3 * med(t - s for t, s in zip(times, slowest))}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1 << 20)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--actor-threads", type=int, default=1)
    p.add_argument("--transport", action="append", choices=["auto", "ray"],
                   help="RayKVCache's transport, one run each (default: auto, which gives each actor a line here)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--index", action="append")
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="no run: the rows of these --json files (one string each, run apart so that one process "
                        "never holds two 1M caches) into --json / --plot")
    args = p.parse_args()
    if args.merge:
        runs = []
        for path in args.merge:
            with open(path) as f:
                runs.append(json.load(f))
        # rows grouped by string; a (string, where) measured twice keeps its
        # first file's row (each run measures "one process" again)
        rows, seen = [], set()
        for row in (row for r in runs for row in r["rows"]):
            if (row["index"], row["where"]) not in seen:
                seen.add((row["index"], row["where"]))
                rows.append(row)
        order = list(dict.fromkeys(row["index"] for row in rows))
        rows.sort(key=lambda row: order.index(row["index"]))
        result = dict(runs[0], command=" + ".join(r["command"] for r in runs), rows=rows)
        write_outputs(args, result)
        return
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    log(f"data: {args.kv_heads} KV heads x {args.tokens} tokens x d={args.d}, float16")
    keys, values = data(args)
    qs = queries(args, args.steps + args.warmup)
    rows = []
    for string in args.index or DEFAULT_INDEXES:
        runs = [lambda: one_process(args, string, keys, values, qs)]
        runs += [lambda t=t: spread(args, string, keys, values, qs, t) for t in args.transport or ["auto"]]
        for run in runs:
            row = run()
            rows.append(row)
            extra = (f"  slowest shard {row['slowest_shard_ms']:.2f} ms, overhead {row['overhead_ms']:.2f} ms, "
                     f"per actor {[round(m / 2**30, 3) for m in row['memory_per_actor']]} GiB"
                     if "overhead_ms" in row else "")
            log(f"{string:40s} {row['where']:12s} {row['memory_bytes'] / 2**30:7.3f} GiB  prefill "
                f"{row['prefill_s']:6.1f} s  {row['ms_per_layer']:8.2f} ms/layer{extra}")
    ray.shutdown()
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "command": " ".join(["benchmarks/scripts/ray_cache_speed.py"] + sys.argv[1:]),
              "tokens": args.tokens, "kv_heads": args.kv_heads, "q_heads": args.q_heads, "d": args.d,
              "shards": args.shards, "steps": args.steps, "rows": rows}
    write_outputs(args, result)


def write_outputs(args, result):
    rows = result["rows"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        strings = list(dict.fromkeys(r["index"] for r in rows))
        fig, ax = plt.subplots(figsize=(8, 4.5))
        wheres = list(dict.fromkeys(r["where"] for r in rows))
        width = 0.8 / len(wheres)  # a group of bars per string, one bar per placement
        for j, where in enumerate(wheres):
            xs, ys = [], []
            for i, s in enumerate(strings):
                for r in rows:
                    if r["index"] == s and r["where"] == where:
                        xs.append(i + width * j)
                        ys.append(r["ms_per_layer"])
            ax.bar(xs, ys, width, label=where)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(strings))])
        ax.set_xticklabels(strings, fontsize=8)
        ax.set_ylabel("decode ms per layer")
        ax.set_yscale("log")
        ax.set_title(f"{result['tokens']} tokens x {result['kv_heads']} KV heads, d={result['d']}: one process and "
                     f"Ray actors")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
