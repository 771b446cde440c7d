#!/usr/bin/env python3
"""kvindex's search beside the faiss-cpu wheel on the same keys.

Random keys with a shared offset and out-of-distribution queries (the
geometry of attention: queries sit elsewhere than keys), searched by
maximum inner product with kvindex `TopK(Flat)` and `TopK(IVF<nlist>,Flat)`
and with faiss `IndexFlatIP` / `IVF<nlist>,Flat`; prints recall@k against
the exact numpy top-k, and milliseconds per batch.

    python ann_pipeline.py [--n 20000] [--nq 200] [--d 128] [--k 10] [--in-distribution]
"""
import argparse
import time

import numpy as np

import kvindex


def recall(I, gt):
    k = gt.shape[1]
    return np.mean([len(set(a[a >= 0].tolist()) & set(b.tolist())) / k for a, b in zip(I, gt)])


def timed(fn, repeat=3):
    best, res = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = fn()
        best = min(best, time.perf_counter() - t0)
    return res, best


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="keys")
    ap.add_argument("--nq", type=int, default=200, help="queries")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--nlist", type=int, default=0, help="IVF lists (default n / 200)")
    ap.add_argument("--in-distribution", action="store_true",
                    help="queries drawn like the keys (default: out of distribution)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    n, d, k = args.n, args.d, args.k
    nlist = args.nlist or int(np.clip(n // 200, 4, 4096))
    mu_k = 2.0 * rng.standard_normal(d)
    keys = (rng.standard_normal((n, d)) + mu_k).astype(np.float32)
    values = rng.standard_normal((n, d)).astype(np.float32)
    if args.in_distribution:
        q = (rng.standard_normal((args.nq, d)) + mu_k).astype(np.float32)
    else:
        q = (2.0 * rng.standard_normal((args.nq, d)) + rng.standard_normal(d)).astype(np.float32)
    ip = q.astype(np.float64) @ keys.astype(np.float64).T
    gt = np.argsort(-ip, axis=1)[:, :k]
    print(f"n={n} d={d} nq={args.nq} k={k} nlist={nlist} "
          f"({'in' if args.in_distribution else 'out of'} distribution queries)")
    print(f"{'method':<42} {'recall@k':>9} {'ms/batch':>9} {'build s':>8}")

    def row(name, I, t, build):
        print(f"{name:<42} {recall(I, gt):9.4f} {t * 1e3:9.2f} {build:8.3f}")

    # kvindex
    for s, knobs in [("TopK(Flat)", [None]), (f"TopK(IVF{nlist},Flat)", [1, 4, 16])]:
        t0 = time.perf_counter()
        index = kvindex.index_factory(d, s)
        index.add_kv(keys, values)
        build = time.perf_counter() - t0
        for nprobe in knobs:
            params = None if nprobe is None else {"nprobe": nprobe}
            (D, I), t = timed(lambda: index.search(q, k, params=params))
            name = f"kvindex {s}" + ("" if nprobe is None else f" nprobe={nprobe}")
            row(name, I, t, build)
        if s == "TopK(Flat)":
            (out, lse), t = timed(lambda: index.attend(q))
            print(f"{'  (kvindex attend, top-100 softmax)':<42} {'':>9} {t * 1e3:9.2f}")

    # faiss-cpu
    try:
        import faiss
    except ImportError:
        print("faiss not installed (pip install faiss-cpu): skipping the faiss rows")
        return
    t0 = time.perf_counter()
    flat = faiss.IndexFlatIP(d)
    flat.add(keys)
    build = time.perf_counter() - t0
    (D, I), t = timed(lambda: flat.search(q, k))
    row(f"faiss IndexFlatIP ({faiss.__version__})", I, t, build)
    t0 = time.perf_counter()
    ivf = faiss.index_factory(d, f"IVF{nlist},Flat", faiss.METRIC_INNER_PRODUCT)
    ivf.train(keys)
    ivf.add(keys)
    build = time.perf_counter() - t0
    for nprobe in [1, 4, 16]:
        faiss.extract_index_ivf(ivf).nprobe = nprobe
        (D, I), t = timed(lambda: ivf.search(q, k))
        row(f"faiss IVF{nlist},Flat nprobe={nprobe}", I, t, build)


if __name__ == "__main__":
    main()
