#!/usr/bin/env python3
"""How much of an evaluation query's exact top-k the prefill queries' own
top-k lists cover: for each evaluation query, the union of the lists of its
m nearest prefill queries (L2, same query head) against its true top-k.
This bounds what any index that learns from the prefill queries' lists
(RoarGraph's projection, seeding a search from them) can find without
searching the keys by geometry.

    kvbench gen --out T --tokens 32867 --kv-heads 1 --group 3 --layers 1 --eval 99
    python benchmarks/scripts/query_list_overlap.py --trace T [--sample 4096] [--k 100] [--m 1,8,64]

Reads a kvbench trace (meta.json, layer_<l>/{keys,queries}.npy); prints,
per query head, the mean covered fraction and the mean size of the union
for each m (default 1, 8, 64). The prefill queries' lists are computed in
blocks of 2048 queries, so a sample of 32768 at 128k keys fits in memory.
"""
import argparse
import json
import os

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--kv-head", type=int, default=0)
    ap.add_argument("--sample", type=int, default=4096, help="prefill queries per head (seeded sample)")
    ap.add_argument("--eval", type=int, default=33, help="evaluation positions per head")
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--m", default="1,8,64", help="nearest prefill queries whose lists are joined, comma-separated")
    a = ap.parse_args()
    with open(os.path.join(a.trace, "meta.json")) as f:
        meta = json.load(f)
    d, n, total = meta["head_dim"], meta["n_ctx"], meta["n_tokens"]
    g = meta["n_q_heads"] // meta["n_kv_heads"]
    # checked against meta before any array is read (they gave a numpy
    # IndexError or a missing file)
    if not 0 <= a.kv_head < meta["n_kv_heads"]:
        raise SystemExit(f"--kv-head {a.kv_head}: the trace has {meta['n_kv_heads']} KV heads")
    if not 0 <= a.layer < meta["n_layers"]:
        raise SystemExit(f"--layer {a.layer}: the trace has {meta['n_layers']} layers")
    layer = os.path.join(a.trace, f"layer_{a.layer}")
    keys = np.load(os.path.join(layer, "keys.npy")).reshape(meta["n_kv_heads"], total, d)[a.kv_head, :n]
    queries = np.load(os.path.join(layer, "queries.npy")).reshape(meta["n_q_heads"], total, d)
    if not 1 <= a.eval <= total - n or not 1 <= a.k <= n or not 1 <= a.sample <= n:
        raise SystemExit(f"need 1 <= eval <= {total - n}, 1 <= k <= {n}, 1 <= sample <= {n}")
    try:
        ms = [int(v) for v in a.m.split(",")]
    except ValueError:
        raise SystemExit(f"--m {a.m}: expected comma-separated counts")
    if not all(1 <= m <= a.sample for m in ms):
        raise SystemExit(f"--m {a.m}: each count must be in 1..{a.sample} (the sample)")
    rng = np.random.default_rng(a.seed)
    print(f"{'query head':>10} {'m':>4} {'covered':>8} {'union':>8}")
    for qh in range(a.kv_head * g, (a.kv_head + 1) * g):
        ev = queries[qh, n:n + a.eval]
        truth = np.argsort(-(ev @ keys.T), axis=1, kind="stable")[:, :a.k]
        train = queries[qh, rng.choice(n, a.sample, replace=False)]
        lists = np.empty((a.sample, a.k), dtype=np.int64)
        for c in range(0, a.sample, 2048):  # blocks: the whole score matrix would not fit at 128k
            lists[c:c + 2048] = np.argpartition(-(train[c:c + 2048] @ keys.T), a.k - 1, axis=1)[:, :a.k]
        for m in ms:
            covered, size = [], []
            for i in range(a.eval):
                near = np.argsort(((train - ev[i]) ** 2).sum(1))[:m]
                union = set(lists[near].ravel().tolist())
                covered.append(len(union & set(truth[i].tolist())) / a.k)
                size.append(len(union))
            print(f"{qh:>10} {m:>4} {np.mean(covered):>8.3f} {np.mean(size):>8.0f}")


if __name__ == "__main__":
    main()
