"""Markdown table of `kvllm ruler` logs: per task, dense's mean score and
each index's mean score, score / dense and agreement with dense, from the
per-case lines of one or more logs (so that a run stopped early still
counts the samples it finished; n says how many).

    python3 benchmarks/scripts/ruler_table.py benchmarks/results/ruler/ruler_2k_part*.txt
    python3 benchmarks/scripts/ruler_table.py --by-index LOG...   (a row per index)
    python3 benchmarks/scripts/ruler_table.py --likelihood RUN.json...
        (runs with --likelihood: per task and context, each index's likelihood
        of the reference answer relative to dense's, per token of the answer
        / whole answer, with delta +- its standard error, KL and top-1
        agreement, from the JSON summary and cases)
"""
import collections
import json
import math
import re
import sys

LINE = re.compile(r'\s+(\S+)\s+ctx\s+(\d+)\s+#(\d+)\s+(.+?)\s+([\d.]+)\s+(same|diff)?\s*"')
# a summary row: task, context, dense score, index, ...
SUMMARY = re.compile(r'(?:\S+)\s+(\d+)\s+[\d.]+\s+\S.*\s[\d.]+\s+[\d.–-]+\s+[\d.]+$')


def main(paths, by_index=False):
    score = collections.defaultdict(dict)  # (task, index) -> {sample: score}
    agree = collections.defaultdict(dict)
    rows = []  # (task, context block, sample, index, score, agreement)
    several = False
    for path in paths:
        # A log of several contexts (--context 512,1024) lists every case
        # of the first, then of the next: the same (task, index, sample)
        # again. Its per-case lines give the prompt's tokens, not the
        # context asked for; the summary at the end names the contexts in
        # order (absent when the run was stopped).
        lines = open(path).read().splitlines()
        contexts = []
        for line in lines:
            m = SUMMARY.match(line)
            if m and m.group(1) not in contexts:
                contexts.append(m.group(1))
        seen = collections.Counter()
        for line in lines:
            m = LINE.match(line)
            if not m:
                continue
            task, _, sample, index, s, ag = m.groups()
            block = seen[(task, index.strip(), sample)]
            seen[(task, index.strip(), sample)] += 1
            several |= block > 0
            label = contexts[block] if block < len(contexts) else f"context #{block + 1}"
            rows.append((task, label, int(sample), index.strip(), float(s), ag))
    if not rows:
        sys.exit("ruler_table: no per-case line of kvllm ruler in " + " ".join(paths))
    for task, label, sample, index, s, ag in rows:
        key = (f"{task} at {label}" if several else task, index)
        score[key][sample] = s
        if ag:
            agree[key][sample] = ag == "same"
    tasks = sorted({t for t, _ in score})
    indexes = sorted({i for _, i in score if i != "dense"})

    def cell(t, i):
        """score (score / dense, agreement) of index i on task t, over the
        samples both have; None where i did not run t"""
        s, dense = score.get((t, i)), score.get((t, "dense"), {})
        if not s:
            return None
        common = sorted(set(s) & set(dense))
        if not common:
            return "no dense run"
        mi = sum(s[k] for k in common) / len(common)
        md = sum(dense[k] for k in common) / len(common)
        a = agree.get((t, i), {})
        ag = sum(a[k] for k in common if k in a) / len(common)
        rel = f"{mi / md:.2f}" if md > 0 else "–"
        return f"{mi:.2f} ({rel}, {ag:.2f})" + ("" if len(common) == len(dense) else f" n={len(common)}")

    def code(i):
        # a | inside a table cell, even in a code span, must be escaped
        return "`" + i.replace("|", "\\|") + "`"

    if by_index:
        dense_cells = []
        for t in tasks:
            d = score.get((t, "dense"), {})
            dense_cells.append(f"{sum(d.values()) / max(len(d), 1):.2f} (n = {len(d)})")
        print("| index | " + " | ".join(tasks) + " |")
        print("|---|" + "---|" * len(tasks))
        print("| dense | " + " | ".join(dense_cells) + " |")
        for i in indexes:
            print(f"| {code(i)} | " + " | ".join(cell(t, i) or "–" for t in tasks) + " |")
        return
    print("| task | n | dense | " + " | ".join(code(i) for i in indexes) + " |")
    print("|---|---|---|" + "---|" * len(indexes))
    for t in tasks:
        dense = score.get((t, "dense"), {})
        cells = [cell(t, i) or "–" for i in indexes]
        md_all = sum(dense.values()) / max(len(dense), 1)
        print(f"| {t} | {len(dense)} | {md_all:.2f} | " + " | ".join(cells) + " |")

def likelihood(paths):
    """A row per (index, context), a column per task: exp(delta / tokens) /
    exp(delta) (delta +- se in nats, KL, top-1), from the summaries of
    --likelihood runs."""
    rows = collections.OrderedDict()  # (index, context) -> {task: cell}
    dense = collections.OrderedDict()  # (context) -> {task: dense log p}
    tasks = []
    for path in paths:
        run = json.load(open(path))
        # mean reference tokens per (task, context), and per context for "all"
        counts = collections.defaultdict(list)
        for c in run["cases"]:
            if "reference" in c:
                counts[(c["task"], c["context"])].append(c["reference"]["tokens"])
                counts[("all", c["context"])].append(c["reference"]["tokens"])
        for r in run["summary"]:
            ref = r.get("reference")
            if ref is None:
                continue
            n_tok = counts[(r["task"], r["context"])]
            per_token = math.exp(ref["delta"] * len(n_tok) / sum(n_tok))
            if r["task"] not in tasks:
                tasks.append(r["task"])
            dense.setdefault(r["context"], {})[r["task"]] = f'{ref["log_prob_dense"]:.1f} (n = {r["samples"]})'
            rows.setdefault((r["index"], r["context"]), {})[r["task"]] = (
                f'{per_token:.3f} / {ref["relative"]:.2f} ({ref["delta"]:+.2f} ± {ref["delta_se"]:.2f}, '
                f'{ref["kl"]:.3f}, {ref["top1"]:.2f})')
    print("| index | context | " + " | ".join(tasks) + " |")
    print("|---|---|" + "---|" * len(tasks))
    for c, cells in dense.items():
        print(f"| dense log p | {c} | " + " | ".join(cells.get(t, "–") for t in tasks) + " |")
    for (i, c), cells in rows.items():
        code = "`" + i.replace("|", "\\|") + "`"
        print(f"| {code} | {c} | " + " | ".join(cells.get(t, "–") for t in tasks) + " |")


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--likelihood" in args:
        likelihood([a for a in args if a != "--likelihood"])
    else:
        main([a for a in args if a != "--by-index"], by_index="--by-index" in args)
