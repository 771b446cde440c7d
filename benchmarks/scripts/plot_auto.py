#!/usr/bin/env python3
"""Auto beside its candidates: error against what a query reads, per trace,
and the real model's top-1 agreement, from the JSON files of RESULTS.md's
"Auto" section.

    .venv/bin/python benchmarks/scripts/plot_auto.py OUT.png \
        --kvbench ood=benchmarks/results/auto/auto_ood101.json \
        --kvbench smollm2=benchmarks/results/auto/auto_smollm2_8k.json \
        --e2e benchmarks/results/auto/e2e_coreutils.json [--e2e ...]

One panel per kvbench file (x: kvbench's touched fraction, y: mean relative
L2 error of the output, log-log; Auto's points filled black), and one panel
of kvllm e2e's top-1 agreement with dense per context (a line per index).
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--kvbench", action="append", default=[], metavar="TITLE=FILE")
    ap.add_argument("--e2e", action="append", default=[], metavar="FILE")
    args = ap.parse_args()
    panels = len(args.kvbench) + (1 if args.e2e else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 5), squeeze=False)
    for ax, spec in zip(axes[0], args.kvbench):
        title, path = spec.split("=", 1)
        with open(path) as f:
            run = json.load(f)
        for r in run["results"]:
            auto = r["index"].startswith("Auto")
            ax.scatter(100 * r["touched_frac"], r["rel_err_mean"], s=60 if auto else 35,
                       color="black" if auto else None, marker="s" if auto else "o", zorder=3)
            ax.annotate(r["index"], (100 * r["touched_frac"], r["rel_err_mean"]), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("touched: keys and values read per query, % of dense")
        ax.set_ylabel("mean relative L2 error of the output")
        ax.set_title(f"{title} ({run['trace']})", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    if args.e2e:
        ax = axes[0][-1]
        rows = []
        for path in args.e2e:
            with open(path) as f:
                rows += json.load(f)
        for label in dict.fromkeys(r["label"] for r in rows):
            pts = sorted((r["context"], r["top1"]) for r in rows if r["label"] == label)
            ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o",
                    linewidth=2.5 if label.startswith("Auto") else 1, label=label)
        ax.set_xscale("log", base=2)
        contexts = sorted({r["context"] for r in rows})
        ax.set_xticks(contexts)
        ax.set_xticklabels([str(c) for c in contexts])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("top-1 agreement with dense, 64 teacher-forced tokens")
        ax.set_title("SmolLM2-135M, every layer sparse (kvllm e2e)", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
