#!/usr/bin/env python3
"""Turns kvbench JSON files into PNG figures.

    .venv/bin/python benchmarks/scripts/plot_kvbench.py OUT_DIR run1.json [run2.json ...]

error_vs_touched.png: relative L2 error vs fraction of key/value vectors
read, one point per (index, JSON file), log-log.
speedup_vs_context.png: speed-up over exact dense attention vs the trace's
context length, one line per index (needs JSON files of several lengths).
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv):
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir, paths = argv[1], argv[2:]
    os.makedirs(out_dir, exist_ok=True)
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append(json.load(f))

    fig, ax = plt.subplots(figsize=(7, 5))
    by_index = {}
    for run in runs:
        for r in run["results"]:
            by_index.setdefault(r["index"], []).append(r)
    for name, rs in by_index.items():
        xs = [max(r["touched_frac"], 1e-6) for r in rs]
        ys = [max(r["rel_err_mean"], 1e-8) for r in rs]
        ax.scatter(xs, ys, label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("fraction of key/value vectors read (1 = dense)")
    ax.set_ylabel("mean relative L2 error vs exact attention")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "error_vs_touched.png"), dpi=120)

    fig, ax = plt.subplots(figsize=(7, 5))
    for name, rs in by_index.items():
        pts = sorted(
            (run["n_tokens"], r["speedup_vs_dense"])
            for run in runs
            for r in run["results"]
            if r["index"] == name and "n_tokens" in run
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("speed-up over exact dense attention")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "speedup_vs_context.png"), dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
