"""Markdown table of a `kvllm e2e --json` file: per index, top-1 agreement,
mean KL(dense || index) and perplexity at each context length.
Usage: .venv/bin/python benchmarks/scripts/e2e_table.py benchmarks/results/llm/e2e.json"""
import json
import sys

rows = json.load(open(sys.argv[1]))
contexts = sorted({r["context"] for r in rows})
per_context = {c: [r for r in rows if r["context"] == c] for c in contexts}
n = len(per_context[contexts[0]])
print("| index | " + " | ".join("top-1 / KL / ppl @%d" % c for c in contexts) + " |")
print("|---|" + "---|" * len(contexts))
for i in range(n):
    first = per_context[contexts[0]][i]
    # older files lack "label": rebuild it from the spec order
    label = first.get("label", first["index"])
    cells = []
    for c in contexts:
        r = per_context[c][i]
        cells.append("%.3f / %.2g / %.2f" % (r["top1"], r["kl_mean"], r["ppl_index"]))
    print("| `%s` | " % label.replace("|", "\\|") + " | ".join(cells) + " |")
dense = [per_context[c][0] for c in contexts]
print("\ndense perplexity: " + ", ".join("%.2f @%d" % (r["ppl_dense"], r["context"]) for r in dense))
