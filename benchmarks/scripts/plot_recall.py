#!/usr/bin/env python3
"""Recall@k vs keys read, from bench_recall or kvbench JSON files.

    .venv/bin/python benchmarks/scripts/plot_recall.py OUT.png run.json [run2.json ...] \
        [--reference NAME=FILE] [--drop FILE:INDEX] [--label FILE:INDEX=TEXT]

One line per index of each file (its sweep of efSearch / nprobe; single
points for indexes without a sweep). bench_recall files: x = keys the
retrieval scanned per query as a percentage of the context (log scale),
y = recall@100 of the exact top-100. kvbench files (a real-model trace;
one index string per point, "STRING|knobs" grouped by STRING): x =
kvbench's touched fraction (vectors read, retrieval and attention, over
2(p + 1)), y = recall@k. --reference adds a line from a text file of
"scanned_percent recall" rows (e.g. the official RoarGraph build measured
on the same keys and queries). --drop leaves out the line of one index
of one file (an older curve of an index a newer file measures again);
--label names the line of one index of one file in the legend (long
parameter strings).
"""
import json
import sys
from collections import OrderedDict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv):
    refs, paths, drops, labels = [], [], set(), {}
    args = iter(argv[1:])
    for a in args:
        if a == "--reference":
            name, path = next(args).split("=", 1)
            refs.append((name, path))
        elif a == "--drop":
            drops.add(tuple(next(args).split(":", 1)))
        elif a == "--label":
            where, text = next(args).rsplit("=", 1)
            labels[tuple(where.split(":", 1))] = text
        else:
            paths.append(a)
    if len(paths) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, runs = paths[0], paths[1:]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xlabel = ""
    for path in runs:
        with open(path) as f:
            run = json.load(f)
        lines = OrderedDict()
        if "results" in run:  # kvbench
            xlabel = "vectors read per query (kvbench touched, % of 2(p+1))"
            for r in run["results"]:
                if r.get("recall_at_k") is not None:
                    lines.setdefault(r["index"].split("|")[0], []).append(
                        (100 * r["touched_frac"], r["recall_at_k"]))
            suffix = ""
        else:
            xlabel = "keys read per query (retrieval + selection, % of the context)"
            for p in run["points"]:
                lines.setdefault(p["index"], []).append((100 * p["scanned"], p["recall"]))
            suffix = f" ({run['tokens'] // 1024}k)" if len(runs) > 1 else ""
        for name, pts in lines.items():
            if (path, name) in drops:
                continue
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                    label=labels.get((path, name), name) + suffix)
    for name, path in refs:
        rows = [list(map(float, line.split())) for line in open(path)
                if line.strip() and not line.startswith("#")]
        ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="x", ls="--", label=name)
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("recall@k of the exact top-k")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
