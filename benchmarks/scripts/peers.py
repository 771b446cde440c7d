"""kvindex against its peers, side by side in one run: our Flat / TopK / IVF /
HNSW / LSHSample paths (bench_peers, C++) against the faiss-cpu wheel (Flat,
IVF, HNSW) and hnswlib, on the same keys and queries, one thread, top-100.

    .venv/bin/python benchmarks/scripts/peers.py --tokens 32768,131072,1048576 --queries 30

Steps, all in this run:
  1. bench_kernels: the single-core streaming read rate (BM_StreamRead) and
     the dense kernel at 128k keys (BM_DenseAttention), medians of 3;
  2. bench_peers: generates the synthetic head (mixed preset, d = 128: one
     needle, one local and one flat query head, as bench_scaling), writes
     keys / queries / exact top-100 as .npy under a temporary directory, and
     times our factory strings (attend and search, one query per call);
  3. here: loads those files, builds faiss-cpu IndexFlatIP, IVF<nlist>,Flat
     (nlist = ceil(N / 1000), nprobe 8, trained on 65536 sampled keys as
     TopK trains), IndexHNSWFlat M = 32 and hnswlib M = 16 / 32 (ip space,
     efConstruction 40 as Faiss's default), and times one query per call
     (nq = 1) with one thread; --batched adds all queries in one call.
Every time: each query's median over --repeats passes, averaged over the
queries (batched: the median over passes of one call / its queries).
The faiss-cpu and hnswlib wheels are benchmark-only (requirements-bench.txt);
the library never links them.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

# one BLAS thread (the faiss-cpu wheel's batched searches and k-means use BLAS):
# set before numpy / faiss load it
for _v in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402

K = 100


def median_pass_us(repeats, n_queries, fn):
    """µs of fn(i): each query timed in `repeats` passes over all queries,
    its median taken (robust to a busy machine), then the mean over queries
    (as bench_peers times our side)."""
    t = np.zeros((repeats, n_queries))
    for r in range(repeats):
        for i in range(n_queries):
            t0 = time.perf_counter()
            fn(i)
            t[r, i] = time.perf_counter() - t0
    return float(1e6 * np.median(t, axis=0).mean())


def recall(labels, truth):
    hit = 0
    for row, t in zip(labels, truth):
        hit += np.isin(row, t).sum()
    return hit / truth.size


def stream_read(build_dir, reps):
    """(GiB/s of BM_StreamRead, dense kernel rows) from bench_kernels."""
    exe = os.path.join(build_dir, "benchmarks", "bench_kernels")
    out = subprocess.run(
        [exe, "--benchmark_filter=BM_StreamRead|BM_DenseAttention",
         "--benchmark_repetitions=%d" % reps, "--benchmark_report_aggregates_only=true",
         "--benchmark_format=json"],
        check=True, capture_output=True, text=True).stdout
    rows = [b for b in json.loads(out)["benchmarks"] if b.get("aggregate_name") == "median"]
    stream = next(b for b in rows if b["run_name"].startswith("BM_StreamRead"))
    dense = [b for b in rows if b["run_name"].startswith("BM_DenseAttention")]
    return stream, dense


def time_unit_us(b):
    scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[b["time_unit"]]
    return b["real_time"] * scale


def read_ours(path):
    rows = []
    with open(path) as f:
        head = f.readline().rstrip("\n").split("\t")
        for line in f:
            r = dict(zip(head, line.rstrip("\n").split("\t")))
            rows.append(r)
    return rows


def peers(n, keys, queries, truth, args, log):
    """faiss-cpu and hnswlib rows for one length."""
    import faiss
    import hnswlib
    d = keys.shape[1]
    nq = queries.shape[0]
    rows = []
    build_threads = os.cpu_count()

    def one_at_a_time(index_search, name, build_s, bpt, note=""):
        labels = np.stack([index_search(queries[i:i + 1])[0] for i in range(nq)])
        us = median_pass_us(args.repeats, nq, lambda i: index_search(queries[i:i + 1]))
        rows.append(dict(impl=name[0], index=name[1], us=us, search_us=us,
                         recall=recall(labels, truth), build_s=build_s, bpt=bpt, note=note))
        log("%-10s %-40s %10.1f us  recall %.3f  build %.2f s" %
            (name[0], name[1], us, rows[-1]["recall"], build_s))

    def batched(index_search, name, note):
        if not args.batched:
            return
        labels = index_search(queries)
        passes = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            index_search(queries)
            passes.append(1e6 * (time.perf_counter() - t0) / nq)
        us = float(np.median(passes))
        rows.append(dict(impl=name[0], index=name[1] + " (batch of %d)" % nq, us=us,
                         search_us=us, recall=recall(labels, truth), build_s=None, bpt=None,
                         note=note))

    def faiss_search(index):
        return lambda q: index.search(q, K)[1]

    # Flat
    faiss.omp_set_num_threads(build_threads)
    t0 = time.perf_counter()
    flat = faiss.IndexFlatIP(d)
    flat.add(keys)
    build_s = time.perf_counter() - t0
    faiss.omp_set_num_threads(1)
    one_at_a_time(faiss_search(flat), ("faiss-cpu", "IndexFlatIP.search"), build_s, 4 * d)
    batched(faiss_search(flat), ("faiss-cpu", "IndexFlatIP.search"), "")
    del flat

    # IVF, Flat lists: trained on a sample of 65536 keys like kvindex's TopK
    nlist = max(1, math.ceil(n / 1000))
    faiss.omp_set_num_threads(build_threads)
    t0 = time.perf_counter()
    ivf = faiss.index_factory(d, "IVF%d,Flat" % nlist, faiss.METRIC_INNER_PRODUCT)
    rng = np.random.default_rng(1234)
    sample = keys[np.sort(rng.choice(n, min(n, 65536), replace=False))]
    ivf.train(sample)
    ivf.add(keys)
    build_s = time.perf_counter() - t0
    ivf.nprobe = min(8, nlist)
    faiss.omp_set_num_threads(1)
    name = ("faiss-cpu", "IVF%d,Flat nprobe %d" % (nlist, ivf.nprobe))
    one_at_a_time(faiss_search(ivf), name, build_s, 4 * d + 8)
    batched(faiss_search(ivf), name, "")
    del ivf

    if n > args.hnsw_max_tokens:
        return rows
    efs = [int(e) for e in args.ef.split(",")]
    # HNSW32 (Faiss), efConstruction 40 (its default)
    faiss.omp_set_num_threads(build_threads)
    t0 = time.perf_counter()
    hnsw = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
    hnsw.hnsw.efConstruction = args.ef_construction
    hnsw.add(keys)
    build_s = time.perf_counter() - t0
    faiss.omp_set_num_threads(1)
    for ef in efs:
        # the beam of every peer is max(ef, K): kvindex's Faiss 1.7.3 widens
        # it to k itself, the wheel's Faiss does not (efSearch 10 at k = 100
        # read a beam of 10), and hnswlib is given max(ef, K) below
        hnsw.hnsw.efSearch = max(ef, K)
        name = ("faiss-cpu", "HNSW32 efSearch %d" % max(ef, K))
        one_at_a_time(faiss_search(hnsw), name, build_s, 4 * d + 8 * 32 * 1.07)
        batched(faiss_search(hnsw), name, "")
    del hnsw

    # hnswlib, inner-product space
    for m in (16, 32):
        t0 = time.perf_counter()
        h = hnswlib.Index(space="ip", dim=d)
        h.init_index(max_elements=n, M=m, ef_construction=args.ef_construction, random_seed=100)
        h.add_items(keys, np.arange(n), num_threads=build_threads)
        build_s = time.perf_counter() - t0
        h.set_num_threads(1)
        for ef in efs:
            h.set_ef(max(ef, K))
            name = ("hnswlib", "HNSW M=%d ef %d" % (m, max(ef, K)))
            one_at_a_time(lambda q: h.knn_query(q, k=K)[0], name, build_s,
                          4 * d + 4 * 2 * m + 16)
            batched(lambda q: h.knn_query(q, k=K)[0], name, "")
        del h
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="32768,131072,1048576")
    ap.add_argument("--queries", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes (median)")
    ap.add_argument("--ef", default="128",
                    help="HNSW efSearch, comma list; kvindex runs the first (beam = max(ef, 100))")
    ap.add_argument("--ef-construction", type=int, default=40)
    ap.add_argument("--hnsw-max-tokens", type=int, default=131072,
                    help="skip every HNSW row above this length (build time)")
    ap.add_argument("--batched", action="store_true", help="also time faiss/hnswlib on all queries in one call")
    ap.add_argument("--build-dir", default="build")
    ap.add_argument("--workdir", default=None, help="keep the .npy files here (default: a temp dir, removed)")
    args = ap.parse_args()
    if args.ef_construction != 40:
        # bench_peers builds kvindex's TopK(HNSW32) with Faiss's default
        sys.exit("--ef-construction %d: kvindex's HNSW (bench_peers) is built with "
                 "efConstruction 40 (Faiss's default); another value would compare "
                 "unlike graphs" % args.ef_construction)

    try:
        import faiss  # noqa: F401
        import hnswlib  # noqa: F401
    except ImportError as e:
        sys.exit("peers.py needs the benchmark wheels: .venv/bin/pip install -r requirements-bench.txt (%s)" % e)
    import faiss
    exe = os.path.join(args.build_dir, "benchmarks", "bench_peers")
    if not os.path.exists(exe):
        sys.exit("%s missing: cmake --build %s --target bench_peers bench_kernels" % (exe, args.build_dir))
    log = lambda s: print(s, file=sys.stderr, flush=True)

    log("bench_kernels: streaming read and dense kernel (median of 3)")
    stream, dense_k = stream_read(args.build_dir, 3)
    gib = stream["bytes_per_second"] / 2**30
    log("  BM_StreamRead %.2f GiB/s" % gib)

    workdir = args.workdir or tempfile.mkdtemp(prefix="kvindex_peers_")
    try:
        cmd = [exe, "--out", workdir, "--tokens", args.tokens, "--queries", str(args.queries),
               "--repeats", str(args.repeats), "--ef", args.ef.split(",")[0],
               "--hnsw-max-tokens", str(args.hnsw_max_tokens)]
        log("+ " + " ".join(cmd))
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        tables = []
        for n in [int(t) for t in args.tokens.split(",")]:
            base = os.path.join(workdir, str(n))
            keys = np.load(os.path.join(base, "keys.npy"))
            queries = np.ascontiguousarray(np.load(os.path.join(base, "queries.npy")))
            truth = np.load(os.path.join(base, "truth.npy"))
            ours = read_ours(os.path.join(base, "ours.tsv"))
            theirs = peers(n, keys, queries, truth, args, log)
            del keys
            tables.append((n, ours, theirs))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    d = 128
    print("## kvindex vs faiss-cpu %s and hnswlib: %s keys, d = %d, one thread, top-%d\n"
          % (faiss.__version__, " / ".join(str(n) for n, _, _ in tables), d, K))
    print("Single-core streaming read (bench_kernels BM_StreamRead, median of 3): **%.2f GiB/s**." % gib)
    for b in dense_k:
        print("Dense kernel at 131072 keys (%s): %.0f µs, %.2f GiB/s = %.0f%% of streaming read."
              % (b["run_name"], time_unit_us(b), b["bytes_per_second"] / 2**30,
                 100 * b["bytes_per_second"] / stream["bytes_per_second"]))
    print("\nµs/query: one query per call; each query's median over %d passes, averaged over %d queries "
          "(kvindex: `attend`, i.e. retrieve + attention over the selected set; faiss-cpu / hnswlib: "
          "`search` only, through Python). search µs: top-%d only. Speed-up: our dense kernel "
          "(exact_attention) in the same run / µs/query. Read rate (full scans only): bytes a "
          "full pass must read (keys for a search, keys + values for dense) / time."
          % (args.repeats, args.queries, K))
    for n, ours, theirs in tables:
        dense_us = float(ours[0]["dense_us"])
        key_bytes = n * d * 4
        print("\n### %d keys (dense kernel %.1f µs; stream-read bound: keys + values %.1f µs, keys %.1f µs)\n"
              % (n, dense_us, 2 * key_bytes / stream["bytes_per_second"] * 1e6,
                 key_bytes / stream["bytes_per_second"] * 1e6))
        print("| impl | index | µs/query | search µs | speed-up vs our dense | recall@100 | read GiB/s | build s |")
        print("|---|---|---|---|---|---|---|---|")

        def rate(nbytes, us):
            return "%.1f" % (nbytes / (us * 1e-6) / 2**30)

        def row_ours(r):
            us, sus = float(r["us"]), float(r["search_us"])
            idx = r["index"]
            full = None
            if idx == "Flat":
                full = rate(2 * key_bytes, us)
            elif idx == "TopK(Flat)":
                full = rate(key_bytes, sus) + " (search)"
            label = "`%s`" % idx
            if idx == "Flat":
                label += " (dense attention over keys + values)"
            if "LSHSample" in idx:
                rec = "(%.3f)" % float(r["recall"])
            else:
                rec = "%.3f" % float(r["recall"])
            print("| kvindex | %s | %.1f | %.1f | %.2f | %s | %s | %.2f |"
                  % (label, us, sus, dense_us / us, rec, full or "-", float(r["build_s"])))

        def row_theirs(r):
            full = rate(key_bytes, r["us"]) if r["index"].startswith("IndexFlatIP") else "-"
            b = "-" if r["build_s"] is None else "%.2f" % r["build_s"]
            print("| %s | `%s` | %.1f | %.1f | %.2f | %.3f | %s | %s |"
                  % (r["impl"], r["index"], r["us"], r["search_us"], dense_us / r["us"],
                     r["recall"], full, b))

        def pick(pred):
            return [r for r in ours if pred(r["index"])]
        # the reference order: dense, exact top-k, IVF, LSH, then HNSW
        for r in pick(lambda s: s == "Flat"):
            row_ours(r)
        for r in pick(lambda s: s == "TopK(Flat)"):
            row_ours(r)
        for r in theirs:
            if r["index"].startswith("IndexFlatIP"):
                row_theirs(r)
        for r in pick(lambda s: s.startswith("TopK(IVF")):
            row_ours(r)
        for r in theirs:
            if r["index"].startswith("IVF"):
                row_theirs(r)
        for r in pick(lambda s: "LSHSample" in s):
            row_ours(r)
        for r in pick(lambda s: "HNSW" in s):
            row_ours(r)
        for r in theirs:
            if "HNSW" in r["index"]:
                row_theirs(r)
        for r in ours:  # anything else bench_peers ran
            s = r["index"]
            if not (s in ("Flat", "TopK(Flat)") or s.startswith("TopK(IVF") or "LSHSample" in s or "HNSW" in s):
                row_ours(r)
    print("\nLSHSample's recall (in parentheses) is of the exact top-100 among its sampled keys "
          "(its `search`), not a retrieval target. HNSW: efConstruction %d everywhere; "
          "kvindex and Faiss search with a beam of max(efSearch, 100), hnswlib with ef = max(ef, 100). "
          "Builds use %d threads; every timed call one." % (args.ef_construction, os.cpu_count()))


if __name__ == "__main__":
    main()
