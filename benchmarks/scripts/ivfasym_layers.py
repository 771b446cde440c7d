"""Per-layer table and figure of IVFAsym's sweep on the SmolLM2 trace.

Reads the kvbench JSON files written one per layer (kvbench run --layers L
--json DIR/<name>_L<L>.json) and prints, per index, the attention mass
captured and the relative error on each layer, with the selected fraction;
the mean over the layers >= 1 is the column the issue's goal reads. With
--figure, plots mass vs selected fraction (mean over layers >= 1) per
method, one curve per probing rule.

usage: python benchmarks/scripts/ivfasym_layers.py DIR [--figure PNG]
"""
import argparse
import glob
import json
import os
import re
from collections import defaultdict


def load(directory):
    rows = defaultdict(dict)  # index -> layer -> result
    paths = sorted(glob.glob(os.path.join(directory, "*_L*.json")))
    prefixes = {re.sub(r"_L\d+\.json$", "", os.path.basename(p)) for p in paths}
    for path in paths:
        layer = int(re.search(r"_L(\d+)\.json$", path).group(1))
        prefix = re.sub(r"_L\d+\.json$", "", os.path.basename(path))
        # self_L*.json: the same strings trained on the prompt itself; the
        # other runs beside the sweep (w255, w255_tasks: other trained
        # models) hold the same strings too, which must not overwrite each
        # other's rows
        if prefix == "self":
            tag = " (self-trained)"
        elif prefix == "sweep" or len(prefixes) == 1:
            tag = ""
        else:
            tag = f" ({prefix})"
        for r in json.load(open(path))["results"]:
            rows[r["index"] + tag][layer] = r
    return rows


def method_of(index):
    """The curve an index string belongs to (its string without nprobe / k)."""
    base = index.split("|")[0]
    params = index.split("|")[1] if "|" in index else ""
    tag = re.search(r" \([^()]*\)$", index)
    if "IVFAsym" in base:
        return base + (tag.group(0) if tag else "")
    return base


def print_training(path):
    """Summary of kvllm train's report: rows per head and the mean loss curve."""
    r = json.load(open(path))
    heads = [h for h in r["heads"] if h["qmodel_trained"]]
    print(f"training: {r['tokens']} tokens in {r['n_prompts']} prompts of {r['context']}; "
          f"prefill {r['prefill_seconds']:.0f} s, add_prompt {r['add_prompt_seconds']:.0f} s, "
          f"training {r['train_seconds']:.0f} s, total {r['total_seconds']:.0f} s; "
          f"{len(heads)} of {len(r['heads'])} heads with a Q-model")
    rows = sorted(h["n_train"] + h["n_held"] for h in heads)
    if rows:
        print(f"rows per head: min {rows[0]}, median {rows[len(rows) // 2]}, max {rows[-1]}")
    print("| iteration | mean train KL | mean held-out KL |")
    print("|---|---|---|")
    print(f"| 0 | - | {sum(h['initial_held_out_loss'] for h in heads) / len(heads):.3f} |")
    for i in range(len(heads[0]["curve"])):
        pts = [h["curve"][i] for h in heads if len(h["curve"]) > i]
        held = [p["held_out"] for p in pts if p["held_out"] is not None]
        print(f"| {pts[0]['iteration']} | {sum(p['train'] for p in pts) / len(pts):.3f} | "
              f"{sum(held) / max(len(held), 1):.3f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--figure")
    ap.add_argument("--train-report", help="kvllm train's JSON report: print its summary")
    args = ap.parse_args()
    if args.train_report:
        print_training(args.train_report)
    rows = load(args.dir)
    layers = sorted({l for v in rows.values() for l in v})
    print("| index | selected | " + " | ".join(f"L{l} mass / err" for l in layers) +
          " | mean mass L>=1 | selected L>=1 |")
    print("|---|---|" + "---|" * len(layers) + "---|---|")
    curves = defaultdict(list)
    for index, per in rows.items():
        sel = sum(r["selected_frac"] for r in per.values()) / len(per)
        cells = []
        for l in layers:
            r = per.get(l)
            cells.append(f"{r['mass_mean']:.3f} / {r['rel_err_mean']:.3f}" if r else "-")
        upper = [per[l]["mass_mean"] for l in layers if l >= 1 and l in per]
        mean_upper = sum(upper) / len(upper) if upper else float("nan")
        sel_upper = [per[l]["selected_frac"] for l in layers if l >= 1 and l in per]
        sel_cell = f"{100 * sum(sel_upper) / len(sel_upper):.2f}%" if sel_upper else "-"
        print(f"| `{index.replace('|', chr(92) + '|')}` | {100 * sel:.1f}% | " + " | ".join(cells) + f" | {mean_upper:.3f} | {sel_cell} |")
        if sel_upper:
            curves[method_of(index)].append((sum(sel_upper) / len(sel_upper), mean_upper))
    if args.figure:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for method, pts in sorted(curves.items()):
            pts.sort()
            ax.plot([100 * p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xlabel("keys selected (% of the context, static part included)")
        ax.set_ylabel("attention mass captured (mean, layers >= 1)")
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title("SmolLM2-135M, 8k licence trace")
        fig.tight_layout()
        fig.savefig(args.figure, dpi=120)
        print(f"wrote {args.figure}")


if __name__ == "__main__":
    main()
