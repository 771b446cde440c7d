"""Threads: concurrent const calls on one index give the serial answers,
and the GIL is released while the library computes. No speed is asserted
(the machine has 2 cores); timings are printed (pytest -s)."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import kvindex


@pytest.mark.parametrize("factory", ["Flat", "TopK(Flat)", "Sink4,Window64,LSHSample6x40",
                                     "TopK(HNSW16)"])
def test_concurrent_attend_equals_serial(factory):
    rng = np.random.default_rng(41)
    d = 32
    index = kvindex.index_factory(d, factory)
    index.add_kv(rng.standard_normal((3000, d)).astype(np.float32),
                 rng.standard_normal((3000, d)).astype(np.float32))
    qs = [rng.standard_normal((4, d)).astype(np.float32) for _ in range(64)]
    serial = [index.attend(q) for q in qs]
    serial_search = [index.search(q, 10) for q in qs]
    with ThreadPoolExecutor(max_workers=8) as ex:
        par = list(ex.map(index.attend, qs))
        par_search = list(ex.map(lambda q: index.search(q, 10), qs))
        par_select = list(ex.map(index.select, qs))
    for (a, la), (b, lb) in zip(serial, par):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)
    for (Da, Ia), (Db, Ib) in zip(serial_search, par_search):
        np.testing.assert_array_equal(Ia, Ib)
        np.testing.assert_array_equal(Da, Db)
    for q, sels in zip(qs[:4], par_select[:4]):
        for s1, s2 in zip(index.select(q), sels):
            np.testing.assert_array_equal(np.asarray(s1.ids), np.asarray(s2.ids))


@pytest.fixture(scope="module")
def big_flat():
    rng = np.random.default_rng(42)
    d, n = 64, 65536
    index = kvindex.index_factory(d, "Flat")
    index.add_kv(rng.standard_normal((n, d)).astype(np.float32),
                 rng.standard_normal((n, d)).astype(np.float32))
    return index


def test_threads_on_large_flat_do_not_deadlock(big_flat):
    rng = np.random.default_rng(43)
    qs = [rng.standard_normal((2, 64)).astype(np.float32) for _ in range(4 * 6)]
    t0 = time.perf_counter()
    serial = [big_flat.attend(q) for q in qs]
    t_serial = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=4) as ex:
        futures = [ex.submit(big_flat.attend, q) for q in qs]
        par = [f.result(timeout=60) for f in futures]
    t_par = time.perf_counter() - t0
    print(f"\n64k Flat, {len(qs)} attend calls: serial {t_serial * 1e3:.1f} ms, "
          f"4 threads {t_par * 1e3:.1f} ms")
    for (a, la), (b, lb) in zip(serial, par):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(la, lb)


def test_gil_is_released_during_attend(big_flat):
    """While a long attend call runs in a thread, the main thread keeps
    running Python code: the largest gap between its loop iterations
    during the calls stays well below the length of one call (with the GIL
    held through the call it would be the whole call). A liveness check,
    not a speed one."""
    rng = np.random.default_rng(44)
    nq = 64
    q = rng.standard_normal((nq, 64)).astype(np.float32)
    t0 = time.perf_counter()
    big_flat.attend(q)
    one = time.perf_counter() - t0
    if one < 0.25:  # make one call last ~0.25 s or more
        nq = min(4096, int(np.ceil(nq * 0.25 / max(one, 1e-4))))
        q = rng.standard_normal((nq, 64)).astype(np.float32)
    window = {}

    def work():
        window["start"] = time.perf_counter()
        for _ in range(2):
            big_flat.attend(q)
        window["end"] = time.perf_counter()

    th = threading.Thread(target=work)
    stamps = []
    th.start()
    while th.is_alive():
        stamps.append(time.perf_counter())
        for _ in range(100):
            pass
    th.join(timeout=120)
    assert not th.is_alive()
    duration = window["end"] - window["start"]
    t = np.array([s for s in stamps if window["start"] <= s <= window["end"]])
    edges = np.r_[window["start"], t, window["end"]]
    gap = np.diff(edges).max()
    print(f"\n2 attend calls of {nq} queries: {duration * 1e3:.0f} ms; main thread ran "
          f"{len(t)} iterations, largest gap {gap * 1e3:.1f} ms")
    assert gap < 0.25 * duration, (
        f"main thread stalled {gap:.3f}s of {duration:.3f}s: attend holds the GIL")


def test_overlapping_write_is_refused_not_crashing():
    """add_kv while attend runs in another thread: whichever call finds the
    other running is refused with a RuntimeError that says so (KVIndex.h,
    thread safety); never a crash, never a wrong answer."""
    rng = np.random.default_rng(45)
    d = 64
    index = kvindex.index_factory(d, "Flat")
    index.add_kv(rng.standard_normal((65536, d)).astype(np.float32),
                 rng.standard_normal((65536, d)).astype(np.float32))
    q = rng.standard_normal((32, d)).astype(np.float32)
    stop = threading.Event()
    started = threading.Event()
    errors = {"reader": [], "writer": []}

    def reader():
        started.set()
        while not stop.is_set():
            try:
                out, _ = index.attend(q)
                assert np.isfinite(out).all()
            except RuntimeError as e:
                errors["reader"].append(str(e))

    th = threading.Thread(target=reader)
    th.start()
    started.wait()
    k1 = rng.standard_normal((1, d)).astype(np.float32)
    n0 = index.ntotal
    added = 0
    deadline = time.perf_counter() + 5
    try:
        while time.perf_counter() < deadline and not (errors["reader"] or errors["writer"]):
            try:
                index.add_kv(k1, k1)
                added += 1
            except RuntimeError as e:
                errors["writer"].append(str(e))
            time.sleep(0.002)
    finally:
        stop.set()
        th.join(timeout=60)
    assert not th.is_alive()
    msgs = errors["reader"] + errors["writer"]
    assert msgs, "no overlap was refused in 5 s"
    assert all("refused" in m for m in msgs), msgs[:3]
    assert index.ntotal == n0 + added  # a refused write changed nothing


RACE_SCRIPT = r'''
import sys, threading, time
import numpy as np
import kvindex

d = 16
rng = np.random.default_rng(0)
K = rng.standard_normal((2000, d)).astype(np.float32)
Q = rng.standard_normal((256, d)).astype(np.float32)
q1 = Q[:1]
CASES = [
    ("RoarGraph16", ["x.count_reachable()", "x.neighbors", "x.degrees", "x.hubs", "x.memory_bytes()",
                     "repr(x)", "x.parameter_info()", "x.check_invariants()", "x.factory_string()"]),
    ("ProxyEvict50", ["x.positions"]),
    ("Choose(TopK(Flat);Uniform)", ["x.holdout_positions", "x.errors", "x.children()", "x.chosen_string()",
                                    "kvindex.get_index_parameter(x, 'k')"]),
    ("IVFAsym8_Moment", ["x.centroids", "x.bucket_sizes", "x.moment_log_masses(q1)", "x.probe_buckets(q1, 2, 1999)"]),
]

def race(x, write, read):
    stop = threading.Event()
    refused = {"reader": 0, "writer": 0}
    other = []
    def writer():
        while not stop.is_set():
            try:
                write()
            except RuntimeError as e:
                (refused.__setitem__("writer", refused["writer"] + 1) if "refused" in str(e) else other.append(str(e)))
    th = threading.Thread(target=writer)
    th.start()
    deadline = time.perf_counter() + 3
    try:
        while time.perf_counter() < deadline and refused["reader"] + refused["writer"] < 20:
            try:
                read()
            except RuntimeError as e:
                (refused.__setitem__("reader", refused["reader"] + 1) if "refused" in str(e) else other.append(str(e)))
    finally:
        stop.set()
        th.join()
    return refused, other

failures = []
for spec, exprs in CASES:
    x = kvindex.index_factory(d, spec)
    if spec.startswith("IVFAsym"):
        # adopted models outlive reset: every state the reader can see
        # between the writer's reset and prefill has centroids to probe
        trained = kvindex.index_factory(d, spec)
        trained.prefill(K, K, queries=Q)
        x.adopt_trained(trained)
    def write():
        x.reset()
        x.prefill(K, K, queries=Q)
    write()
    for expr in exprs:
        refused, other = race(x, write, eval("lambda: " + expr))
        print(spec, expr, refused, other[:1], flush=True)
        if refused["reader"] + refused["writer"] == 0 or other:
            failures.append((spec, expr, refused, other[:1]))

L, HQ, HKV = 2, 4, 2
cache = kvindex.KVCache(L, HQ, HKV, d, "Choose(TopK(Flat);Uniform)")
KC = rng.standard_normal((HKV, 2000, d)).astype(np.float32)
QC = rng.standard_normal((HQ, 256, d)).astype(np.float32)
def write_cache():
    cache.reset()
    for layer in range(L):
        cache.prefill(layer, KC, KC, queries=QC)
write_cache()
for expr in ["cache.memory_bytes()", "cache.check_invariants()"]:
    refused, other = race(cache, write_cache, eval("lambda: " + expr))
    print("KVCache", expr, refused, other[:1], flush=True)
    if refused["reader"] + refused["writer"] == 0 or other:
        failures.append(("KVCache", expr, refused, other[:1]))
print("FAILURES", failures)
sys.exit(1 if failures else 0)
'''


def test_accessors_racing_a_write_are_refused_not_crashing():
    """The accessors that copy or walk an index's containers (a graph's
    lists, the centroids, a Choose's candidates, a cache's heads) while
    another thread resets and prefills it: each overlap is refused with
    a RuntimeError on one side, as for attend, never a crash (they once
    read freed memory: "double free or corruption", segfaults). Run in a
    child process, so that a crash is a failure, not the end of pytest."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", RACE_SCRIPT], capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
