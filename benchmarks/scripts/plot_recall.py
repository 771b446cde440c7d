#!/usr/bin/env python3
"""Recall@100 vs keys scanned, from bench_recall JSON files.

    .venv/bin/python benchmarks/scripts/plot_recall.py OUT.png run.json [run2.json ...] \
        [--reference NAME=FILE]

One line per index of each file (its sweep of efSearch / nprobe; single
points for indexes without a sweep), x = keys the retrieval scanned per
query as a percentage of the context (log scale), y = recall@100 of the
exact top-100. --reference adds a line from a text file of
"scanned_percent recall" rows (e.g. the official RoarGraph build measured
on the same keys and queries).
"""
import json
import sys
from collections import OrderedDict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv):
    refs, paths = [], []
    args = iter(argv[1:])
    for a in args:
        if a == "--reference":
            name, path = next(args).split("=", 1)
            refs.append((name, path))
        else:
            paths.append(a)
    if len(paths) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, runs = paths[0], paths[1:]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for path in runs:
        with open(path) as f:
            run = json.load(f)
        lines = OrderedDict()
        for p in run["points"]:
            lines.setdefault(p["index"], []).append(p)
        suffix = f" ({run['tokens'] // 1024}k)" if len(runs) > 1 else ""
        for name, pts in lines.items():
            pts.sort(key=lambda p: p["scanned"])
            xs = [100 * p["scanned"] for p in pts]
            ys = [p["recall"] for p in pts]
            ax.plot(xs, ys, marker="o", ms=3, label=name + suffix)
    for name, path in refs:
        rows = [list(map(float, line.split())) for line in open(path)
                if line.strip() and not line.startswith("#")]
        ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="x", ls="--", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("keys scanned per query (% of the context)")
    ax.set_ylabel("recall@100 of the exact top-100")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
