"""Python call overhead of kvindex.attend against the same call timed in C++.

    .venv-py/bin/python benchmarks/scripts/python_overhead.py [--tokens 8192,131072] [--repeats 200]

One Flat index per length (d = 128, random keys and values), one query. The
C++ figure is kvindex.time_attend: the same attend called in a C++ loop
(same process, data and index); the Python figure times index.attend(q)
from Python, array checks and output allocation included. Medians of
interleaved rounds, so that drifting clocks and caches hit both alike.
"""

import argparse
import statistics
import time

import numpy as np

import kvindex


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8192,131072")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--index", default="Flat")
    args = ap.parse_args()
    if args.repeats < 10 or args.repeats % 10:
        # timed in rounds of 10 calls (time_attend's and Python's alternate)
        ap.error(f"--repeats {args.repeats}: a positive multiple of 10")
    d = 128
    rng = np.random.default_rng(0)
    print(f"{'index':<12} {'tokens':>8} {'C++ us':>10} {'Python us':>10} {'overhead':>9}")
    for n in [int(x) for x in args.tokens.split(",")]:
        index = kvindex.index_factory(d, args.index)
        index.add_kv(rng.standard_normal((n, d), dtype=np.float32), rng.standard_normal((n, d), dtype=np.float32))
        q = rng.standard_normal((1, d), dtype=np.float32)
        index.attend(q)  # warm
        cpp, py = [], []
        for _ in range(args.repeats // 10):
            cpp += kvindex.time_attend(index, q, 10)
            for _ in range(10):
                t0 = time.perf_counter()
                index.attend(q)
                py.append(time.perf_counter() - t0)
        c, p = statistics.median(cpp) * 1e6, statistics.median(py) * 1e6
        print(f"{args.index:<12} {n:>8} {c:>10.1f} {p:>10.1f} {100 * (p - c) / c:>8.2f}%")


if __name__ == "__main__":
    main()
