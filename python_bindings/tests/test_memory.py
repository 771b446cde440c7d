"""Repeated calls do not leak: 10k attend calls (and selects, searches,
serialisations) on a small index grow the resident set by < 4 MB after a
warm-up. RSS from /proc/self/statm (Linux)."""
import os

import numpy as np
import pytest

import kvindex

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def growth(fn, n, warm=1000):
    for _ in range(warm):
        fn()
    before = rss_bytes()
    for _ in range(n):
        fn()
    return rss_bytes() - before


# One query per call: a batch of several queries runs an OpenMP region,
# whose barrier makes every call ~100x slower when the 2 cores are busy with
# something else (a parallel build); the leak check does not need it.
@pytest.fixture(scope="module")
def idx():
    rng = np.random.default_rng(51)
    index = kvindex.index_factory(32, "Sink4,Window16,Flat")
    index.prefill(rng.standard_normal((256, 32)).astype(np.float32),
                  rng.standard_normal((256, 32)).astype(np.float32))
    return index


LIMIT = 4 << 20


def test_attend_does_not_leak(idx):
    q = np.random.default_rng(52).standard_normal((1, 32)).astype(np.float32)
    assert growth(lambda: idx.attend(q), 10000) < LIMIT
    q64 = q.astype(np.float64)  # the conversion path (per-call knobs: the TopK test below)
    assert growth(lambda: idx.attend(q64), 5000) < LIMIT


def test_select_search_do_not_leak(idx):
    q = np.random.default_rng(53).standard_normal((1, 32)).astype(np.float32)
    assert growth(lambda: idx.select(q), 5000) < LIMIT
    assert growth(lambda: idx.search(q, 8), 5000) < LIMIT


def test_errors_and_io_do_not_leak(idx):
    bad = np.full((1, 32), np.nan, np.float32)

    def fail():
        try:
            idx.attend(bad)
        except ValueError:
            pass

    assert growth(fail, 3000) < LIMIT
    assert growth(lambda: kvindex.deserialize_index(kvindex.serialize_index(idx)), 1000,
                  warm=100) < LIMIT


def test_topk_attend_does_not_leak():
    rng = np.random.default_rng(54)
    index = kvindex.index_factory(32, "TopK(Flat)")
    index.add_kv(rng.standard_normal((256, 32)).astype(np.float32),
                 rng.standard_normal((256, 32)).astype(np.float32))
    q = rng.standard_normal((1, 32)).astype(np.float32)
    assert growth(lambda: index.attend(q, params="k=10"), 3000, warm=500) < LIMIT
