#!/usr/bin/env python3
"""What Ray alone costs per call on this machine: the floor under
RayKVCache's overhead (benchmarks/RESULTS.md, "A cache over Ray actors").

Medians over --calls calls (after a tenth as warm-up) of: one actor call
returning an int; four in parallel; four in parallel each returning two
arrays of a decode step's size (out (32, 1, 128) and lse (32, 1) float32),
as a shard's attend does.

Usage: .venv/bin/python benchmarks/scripts/ray_call_floor.py [--calls 200] [--cpus 2]
"""
import argparse
import statistics
import time

import numpy as np
import ray


class Echo:
    def one(self):
        return 1

    def answer(self, q):
        return np.zeros((32, 1, 128), np.float32), np.zeros((32, 1), np.float32), 0.0


def median_ms(call, calls):
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[calls // 10:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--cpus", type=int, default=2)
    args = ap.parse_args()
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    actors = [ray.remote(num_cpus=0)(Echo).remote() for _ in range(4)]
    ray.get([a.one.remote() for a in actors])
    q = np.zeros((32, 1, 128), np.float32)
    cases = [("1 actor, an int", lambda: ray.get(actors[0].one.remote())),
             ("4 actors, an int each", lambda: ray.get([a.one.remote() for a in actors])),
             ("4 actors, two arrays each", lambda: ray.get([a.answer.remote(q) for a in actors]))]
    for name, call in cases:
        print(f"{name:28s} {median_ms(call, args.calls):.3f} ms")
    ray.shutdown()


if __name__ == "__main__":
    main()
