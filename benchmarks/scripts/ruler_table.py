"""Markdown table of `kvllm ruler` logs: per task, dense's mean score and
each index's mean score, score / dense and agreement with dense, from the
per-case lines of one or more logs (so that a run stopped early still
counts the samples it finished; n says how many).

    python3 benchmarks/scripts/ruler_table.py benchmarks/results/ruler/ruler_2k_part*.txt
"""
import collections
import re
import sys

LINE = re.compile(r'\s+(\S+)\s+ctx\s+(\d+)\s+#(\d+)\s+(.+?)\s+([\d.]+)\s+(same|diff)?\s*"')


def main(paths):
    score = collections.defaultdict(dict)  # (task, index) -> {sample: score}
    agree = collections.defaultdict(dict)
    for path in paths:
        for line in open(path):
            m = LINE.match(line)
            if not m:
                continue
            task, _, sample, index, s, ag = m.groups()
            score[(task, index.strip())][int(sample)] = float(s)
            if ag:
                agree[(task, index.strip())][int(sample)] = ag == "same"
    tasks = sorted({t for t, _ in score})
    indexes = sorted({i for _, i in score if i != "dense"})
    print("| task | n | dense | " + " | ".join(f"`{i}`" for i in indexes) + " |")
    print("|---|---|---|" + "---|" * len(indexes))
    for t in tasks:
        dense = score.get((t, "dense"), {})
        cells = []
        n = len(dense)
        for i in indexes:
            s = score.get((t, i))
            if not s:
                cells.append("–")
                continue
            common = sorted(set(s) & set(dense))
            mi = sum(s[k] for k in common) / len(common)
            md = sum(dense[k] for k in common) / len(common)
            a = agree.get((t, i), {})
            ag = sum(a[k] for k in common if k in a) / len(common)
            rel = f"{mi / md:.2f}" if md > 0 else "–"
            cells.append(f"{mi:.2f} ({rel}, {ag:.2f})" + ("" if len(common) == n else f" n={len(common)}"))
        md_all = sum(dense.values()) / max(len(dense), 1)
        print(f"| {t} | {n} | {md_all:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
