#!/usr/bin/env python3
"""Regenerates the tables of benchmarks/RESULTS.md that come from committed JSON.

Each such table sits between two markers in RESULTS.md:

    <!-- table: NAME (from PATH.json[, PATH.json ...]) -->
    ...
    <!-- end table: NAME -->

and TABLES below says how NAME is made from its JSON files (paths relative to
the repository root). The script rewrites what lies between the markers, and
the opening marker itself, so that the file names stay those the script reads.

    python3 benchmarks/scripts/results_tables.py           rewrite RESULTS.md in place
    python3 benchmarks/scripts/results_tables.py --check   exit 1, naming the first table
                                                           that differs, if it is out of date

Standard library only. The number formats are those the tools printed
(kvbench, bench_recall, the GPU drivers; the e2e cells are those of
e2e_table.py, which runs at import and so is not imported), so that a
regenerated table gives the digits first published. Tables composed from
several runs, or from text logs only (bench_lsh, bench_scaling, kvllm ruler),
stay hand-written in RESULTS.md with their command, date and machine.
"""
import argparse
import decimal
import difflib
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
BEGIN = re.compile(r"^<!-- table: (\S+) \(from[^)]*\) -->$")

# ---------------------------------------------------------------- formats


def fixed(n):
    return lambda v: "–" if v is None else f"{v:.{n}f}"


def sci(v):
    return f"{v:.2e}"


def percent(n):
    """a fraction as a percentage with n decimals"""
    return lambda v: f"{100 * v:.{n}f}%"


def share(v):
    """selected / touched: 100% for everything, else two decimals"""
    return "100%" if v == 1 else f"{100 * v:.2f}%"


def err(v):
    """rel_err at a glance: three decimals, two significant digits in
    e-notation below 0.01, three significant digits from 1 on"""
    if v < 0.01:
        return f"{v:.1e}"
    return f"{v:.3g}" if v >= 1 else f"{v:.3f}"


def half_up(text, n):
    """a printed number rounded again to n decimals, halves up"""
    return str(decimal.Decimal(text).quantize(decimal.Decimal(1).scaleb(-n), decimal.ROUND_HALF_UP))


def p95(v):
    return f"{v:.1e}" if v < 0.1 else f"{v:.2f}"


def size(v):
    """tokens as the tables name them: 32k, 128k, 1M"""
    return f"{v >> 20}M" if v >= 1 << 20 else f"{v >> 10}k"


def code(name):
    """an index string in a table cell: a code span, its | escaped"""
    return "`" + name.replace("|", "\\|") + "`"


# ---------------------------------------------------------------- tables


def markdown(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render(columns, rows):
    """columns: (header, cell) or (header, cell, bold), cell a function of a
    row giving its text, bold a function of the row saying whether the cell
    is set in bold"""
    out = []
    for r in rows:
        cells = []
        for header, cell, *bold in columns:
            text = cell(r)
            cells.append(f"**{text}**" if bold and bold[0](r) else text)
        out.append(cells)
    return markdown([c[0] for c in columns], out)


def emphasis(columns, bold):
    """columns with bold(row, header) attached to each"""
    return [(h, f, lambda r, h=h: bold(r, h)) for h, f in columns]


def key(name, fmt):
    return lambda r: fmt(r[name])


def pick(rows, wanted, by=lambda r: r["index"]):
    """rows in the order of `wanted` (names, or (name, label) pairs: the
    label goes to r["label"])"""
    found = {by(r): r for r in rows}
    out = []
    for w in wanted:
        name, label = w if isinstance(w, tuple) else (w, None)
        out.append(dict(found[name], label=label or code(name)))
    return out


def labelled(rows, notes=None):
    notes = notes or {}
    return [dict(r, label=code(r["index"]) + notes.get(r["index"], "")) for r in rows]


LABEL = ("index", lambda r: r["label"])

# kvbench run --json: one column list at a glance, the raw tool's for the rest
GLANCE = [
    ("rel_err", key("rel_err_mean", err)),
    ("mass", key("mass_mean", fixed(3))),
    ("recall@K", key("recall_at_k", fixed(3))),
    ("selected", key("selected_frac", share)),
    ("touched", key("touched_frac", share)),
    ("µs", key("us_per_query", fixed(1))),
    ("speed-up", key("speedup_vs_dense", fixed(2))),
    ("build s", key("build_s", fixed(2))),
    ("bytes/tok", key("bytes_per_token", fixed(0))),
]
KVBENCH = [
    ("rel_err", key("rel_err_mean", sci)),
    ("err_p95", key("rel_err_p95", sci)),
    ("mass", key("mass_mean", fixed(4))),
    ("recall", key("recall_at_k", fixed(3))),
    ("selected", key("selected_frac", percent(2))),
    ("touched", key("touched_frac", percent(2))),
    ("µs/query", key("us_per_query", fixed(1))),
    ("dense µs", key("dense_us_per_query", fixed(1))),
    ("speed-up", key("speedup_vs_dense", fixed(2))),
    ("build s", key("build_s", fixed(2))),
    ("bytes/tok", key("bytes_per_token", fixed(0))),
]


def glance(run, k, notes, bold, p95_column=False):
    cols = [LABEL] + [(h.replace("K", str(k)), f) for h, f in GLANCE]
    if p95_column:
        cols.insert(2, ("p95", key("rel_err_p95", p95)))
    return render(emphasis(cols, lambda r, h: (r["index"], h) in bold), labelled(run["results"], notes))


TABLES = {}


def table(name, *sources):
    def register(fn):
        TABLES[name] = (sources, fn)
        return fn

    return register


@table("glance-synthetic", "benchmarks/results/main_job_s39.json")
def _(run):
    return glance(run, 100, {"Sink1,Window63,IVFAsym64": " (self-trained)"},
                  {("Weighted", "rel_err"), ("Hybrid(TopK(Flat),LSHSample10x150)", "rel_err")})


@table("glance-smollm2", "benchmarks/results/llm/every_smollm2_8k.json")
def _(run):
    notes = {"FP16,Flat": " (the trace is fp16: exact)", "Sink1,Window63,IVFAsym64": " (self-trained)"}
    return glance(run, 410, notes, {("Weighted", "rel_err"), ("Weighted", "p95")}, p95_column=True)


def kvbench_rows(run, names=None, columns=KVBENCH):
    rows = labelled(run["results"]) if names is None else pick(run["results"], names)
    return render([LABEL] + columns, rows)


OOD_SEEDS = (101, 102, 103)


def seed_columns(runs, header, cells):
    """one column per ood seed: "seed S: HEADER", the cells of a row (each a
    function of that seed's row of the same index) joined by ' / '"""
    by_seed = [{r["index"]: r for r in run["results"]} for run in runs]
    return [(f"seed {seed}: {header}", lambda r, rows=rows: " / ".join(c(rows[r["index"]]) for c in cells))
            for seed, rows in zip(OOD_SEEDS, by_seed)]


@table("ood-preset", *(f"benchmarks/results/ood/ood_64k_s{s}.json" for s in OOD_SEEDS))
def _(*runs):
    cells = (key("mass_mean", fixed(3)), key("recall_at_k", fixed(3)), key("touched_frac", percent(1)))
    cols = [LABEL] + seed_columns(runs, "mass / recall / touched", cells)
    cols.append(("build s (101)", key("build_s", fixed(2))))
    return render(cols, labelled(runs[0]["results"]))


@table("hybrid-budget", "benchmarks/results/hybrid_budget_ood101.json",
       "benchmarks/results/hybrid_budget_flat7.json", "benchmarks/results/hybrid_budget_smollm2_8k.json")
def _(ood, flat, real):
    flat_rows = {r["index"]: r for r in flat["results"]}
    real_rows = {r["index"]: r for r in real["results"]}
    layers = [x["layer"] for x in real["results"][0]["per_layer"]]
    cols = [LABEL,
            ("ood 64k needle head, seed 101: rel_err / selected / touched", lambda r: " / ".join(
                (sci(r["rel_err_mean"]), percent(2)(r["selected_frac"]), percent(1)(r["touched_frac"])))),
            ("flat 64k, seed 7: rel_err / selected", lambda r: " / ".join(
                (sci(flat_rows[r["index"]]["rel_err_mean"]), percent(2)(flat_rows[r["index"]]["selected_frac"])))),
            ("SmolLM2 8k: rel_err, layers " + " / ".join(map(str, layers)), lambda r: " / ".join(
                fixed(3)(x["rel_err_mean"]) for x in real_rows[r["index"]]["per_layer"])),
            ("SmolLM2 8k: selected / touched", lambda r: " / ".join(
                (percent(2)(real_rows[r["index"]]["selected_frac"]), percent(1)(real_rows[r["index"]]["touched_frac"]))))]
    return render(cols, labelled(ood["results"]))


AUTO_FAMILIES = ("LSH", "IVFAsym128", "IVFAsym512", "TOVA")  # IndexChoose::kAutoCandidates


def chosen(r):
    """an Auto row's choices over its heads: 'TOVA 15/15', or '-'"""
    picks = [int(x["value"]) for x in r.get("reported", []) if x["name"] == "chosen"]
    if not picks:
        return "–"
    return ", ".join(f"{AUTO_FAMILIES[c]} {picks.count(c)}/{len(picks)}" for c in sorted(set(picks)))


@table("auto", "benchmarks/results/auto/auto_ood101.json", "benchmarks/results/auto/auto_smollm2_8k.json")
def _(ood, real):
    ood_rows = {r["index"]: r for r in ood["results"]}
    cols = [LABEL,
            ("ood 64k, seed 101: rel_err / mass / touched", lambda r: " / ".join(
                (sci(ood_rows[r["index"]]["rel_err_mean"]), fixed(3)(ood_rows[r["index"]]["mass_mean"]),
                 percent(2)(ood_rows[r["index"]]["touched_frac"]))) if r["index"] in ood_rows else "–"),
            ("chosen (ood)", lambda r: chosen(ood_rows[r["index"]]) if r["index"] in ood_rows else "–"),
            ("SmolLM2 8k: rel_err / mass / touched", lambda r: " / ".join(
                (sci(r["rel_err_mean"]), fixed(3)(r["mass_mean"]), percent(2)(r["touched_frac"])))),
            ("chosen (SmolLM2)", chosen),
            ("build s (SmolLM2)", key("build_s", fixed(2)))]
    return render(cols, labelled(real["results"]))


@table("auto-seeds", *(f"benchmarks/results/auto/auto_ood{s}.json" for s in OOD_SEEDS))
def _(*runs):
    cells = (key("rel_err_mean", sci), key("mass_mean", fixed(3)), key("touched_frac", percent(2)), chosen)
    cols = [LABEL] + seed_columns(runs, "rel_err / mass / touched / chosen", cells)
    # the strings every seed ran (101 ran the candidates alone too)
    names = set.intersection(*({r["index"] for r in run["results"]} for run in runs))
    return render(cols, labelled([r for r in runs[0]["results"] if r["index"] in names]))


@table("auto-e2e", "benchmarks/results/auto/e2e_coreutils.json", "benchmarks/results/auto/e2e_coreutils_more.json",
       "benchmarks/results/auto/e2e_coreutils_defaults.json")
def _(*runs):
    rows = [r for run in runs for r in run]
    contexts = sorted({r["context"] for r in rows})
    cell = {(r["label"], r["context"]): r for r in rows}
    names = list(dict.fromkeys(r["label"] for r in rows))
    cols = [("index", code)]
    for c in contexts:
        cols.append((f"top-1 / KL / build s @{c}", lambda n, c=c: "%.3f / %.2g / %.1f" % (
            cell[n, c]["top1"], cell[n, c]["kl_mean"], cell[n, c]["build_s"])))
    return render(cols, names)


@table("context-65536", "benchmarks/results/context_65536.json")
def _(run):
    return kvbench_rows(run)


PRESETS = ("needle", "local", "flat")


@table("presets", *(f"benchmarks/results/synthetic_{p}.json" for p in PRESETS))
def _(*runs):
    by_preset = [{r["index"]: r for r in run["results"]} for run in runs]
    cols = [LABEL]
    for preset, rows in zip(PRESETS, by_preset):
        cols.append((f"{preset}: rel_err / mass / recall", lambda r, rows=rows: " / ".join(
            f(rows[r["index"]][k]) for k, f in
            (("rel_err_mean", sci), ("mass_mean", fixed(4)), ("recall_at_k", fixed(3))))))
    return render(cols, labelled(runs[0]["results"]))


EVICT = ("needle", "local", "flat", "mixed")


@table("evict-synthetic", *(f"benchmarks/results/evict_{p}.json" for p in EVICT))
def _(*runs):
    by_preset = [{r["index"]: r for r in run["results"]} for run in runs]
    cols = [("index", lambda r: r["index"])]
    for preset, rows in zip(EVICT, by_preset):
        cols.append((f"{preset} err / mass", lambda r, rows=rows: "%.3f / %.3f" % (
            rows[r["index"]]["rel_err_mean"], rows[r["index"]]["mass_mean"])))
    # NaCl (no suffix) at 10, 20 and 30%, every policy at 20%
    rows = [r for r in runs[0]["results"] if r["index"].startswith("ProxyEvict20") or
            r["index"] in ("ProxyEvict10", "ProxyEvict30")]
    return render(cols, rows)


@table("evict-smollm2", "benchmarks/results/llm/kvbench_smollm2_8k.json")
def _(run):
    names = [r["index"] for r in run["results"] if r["index"].startswith("ProxyEvict")]
    cols = [c for c in KVBENCH if c[0] in ("rel_err", "err_p95", "mass", "selected", "bytes/tok")]
    return kvbench_rows(run, names, cols)


@table("weighted-layers", "benchmarks/results/weighted/kvbench_smollm2_8k.json")
def _(run):
    layers = [p["layer"] for p in run["results"][0]["per_layer"]]

    def name(r):
        # a sampler's own share of the keys, where no k sets it
        if r["index"].startswith("LSHSample"):
            return code(r["index"]) + " (%.1f%%)" % (100 * r["selected_frac"])
        return code(r["index"])

    # "all" as first read off kvbench's printed 3 digits (5.65e-02: 0.057)
    cols = [("index", name), ("all", key("rel_err_mean", lambda v: half_up(sci(v), 3)))]
    for i, layer in enumerate(layers):
        head = f"layer {layer}" + (" (flat)" if layer == 0 else "")
        cols.append((head, lambda r, i=i: "%.3f" % r["per_layer"][i]["rel_err_mean"]))
    return render(emphasis(cols, lambda r, h: h != "index" and r["index"] in ("Weighted|k=2%", "Weighted|k=5%")),
                  run["results"])


@table("e2e-smollm2", "benchmarks/results/llm/e2e.json")
def _(rows):
    # the cells of benchmarks/scripts/e2e_table.py; eviction at 5% and 20%
    # only (the file has 1, 2, 5, 10 and 20% for NaCl and StreamingLLM)
    contexts = sorted({r["context"] for r in rows})
    cell = {(r.get("label", r["index"]), r["context"]): r for r in rows}
    names = [n for n in dict.fromkeys(r.get("label", r["index"]) for r in rows)
             if not n.startswith("ProxyEvict") or n[10:].split("_")[0] in ("5", "20")]
    cols = [("index", code)]
    for c in contexts:
        cols.append((f"top-1 / KL / ppl @{c}", lambda n, c=c: "%.3f / %.2g / %.2f" % (
            cell[n, c]["top1"], cell[n, c]["kl_mean"], cell[n, c]["ppl_index"])))
    return render(cols, names)


@table("passkey-smollm2", "benchmarks/results/llm/needle.json")
def _(run):
    contexts = sorted({s["context"] for s in run["summary"]})
    acc = {(s["index"], s["context"]): s["accuracy"] for s in run["summary"]}
    names = list(dict.fromkeys(s["index"] for s in run["summary"]))
    cols = [("index", code)] + [(str(c), lambda n, c=c: "%.2f" % acc[n, c]) for c in contexts]
    return render(cols, names)


@table("hf-decode-speed", "benchmarks/results/hf_decode_speed.json")
def _(run):
    rows = run["rows"]
    contexts = sorted({r["context"] for r in rows})
    cell = {(r["index"], r["context"]): r for r in rows}
    names = list(dict.fromkeys(r["index"] for r in rows))

    def speed(n, c):
        r = cell[n, c]
        text = "%.2f (%.1f ms)" % (r["tok_per_s"], r["step_ms"])
        if "attend_ms" in r:
            text += " / %.2f ms / %.2f ms (%.1f%%)" % (r["attend_ms"], r["glue_ms"], 100 * r["glue_over_attend"])
        return text

    cols = [("cache", lambda n: "sdpa (the model's own, DynamicCache)" if n == "sdpa" else code(n))]
    for c in contexts:
        cols.append((f"@{c}: tok/s (step) / attend / glue (of attend)", lambda n, c=c: speed(n, c)))
    cols.append(("prefill s @%d" % contexts[-1], lambda n: "%.1f" % cell[n, contexts[-1]]["prefill_s"]))
    return render(cols, names)


@table("ray-cache-speed", "benchmarks/results/ray_cache_speed.json")
def _(run):
    def gib(b):
        return "%.3f" % (b / 2 ** 30)

    cols = [("index", lambda r: code(r["index"])), ("where", lambda r: r["where"]),
            ("GiB (per actor)", lambda r: gib(r["memory_bytes"]) + (
                " (" + ", ".join(gib(m) for m in r["memory_per_actor"]) + ")" if "memory_per_actor" in r else "")),
            ("prefill s", lambda r: "%.1f" % r["prefill_s"]),
            ("ms per layer", lambda r: "%.2f" % r["ms_per_layer"]),
            ("slowest shard ms", lambda r: "%.2f" % r["slowest_shard_ms"] if "slowest_shard_ms" in r else "–"),
            ("overhead ms", lambda r: "%.2f" % r["overhead_ms"] if "overhead_ms" in r else "–")]
    return render(cols, run["rows"])


# bench_recall --json: points of (index, knob)


def recall_point(p):
    return (p["index"], p["knob"])


def nlf(prefix, fmt, unit=""):
    return lambda p: " / ".join(fmt(p[f"{prefix}_{h}"]) for h in ("needle", "local", "flat")) + unit


def pct(v):
    """a fraction in percent, two decimals, no sign: bench_recall's read%"""
    return "%.2f" % (100 * v)


@table("roargraph-peers-128k", "benchmarks/results/roargraph/recall_128k_reads_session35.json")
def _(run):
    codes = {"RoarGraph32|walk_bits=8": "RoarGraph32, codes", "RoarGraph32": "RoarGraph32, stored keys",
             "BF16,RoarGraph32|walk_bits=8": "BF16,RoarGraph32, codes"}
    # RoarGraph's points at 0.95 beside the others (its whole curve: the session 43 table)
    points = [("RoarGraph32|walk_bits=8", "efSearch=300"), ("RoarGraph32", "efSearch=200"),
              ("BF16,RoarGraph32|walk_bits=8", "efSearch=300"), ("TopK(HNSW16)", "efSearch=400"),
              ("TopK(IVF132,Flat)", "nprobe=8"), ("LSHSample10x150", ""), ("BF16,LSHSample10x150", "")]
    wanted = [(p, codes.get(p[0], p[0])) for p in points]
    cols = [("index", lambda p: p["label"]), ("knob", lambda p: p["knob"].replace("=", " ")),
            ("recall@100", key("recall", fixed(3))), ("read%", lambda p: pct(p["scanned"]) + "%")]
    return render(cols, pick(run["points"], wanted, recall_point))


@table("roargraph-seeds-walk", "benchmarks/results/s44/seeds_walk_128k.json")
def _(run):
    goal = ("max_train_queries=24576", "max_expansions=30")
    cols = [
        ("training queries (= anchors)", lambda p: re.search(r"max_train_queries=(\d+)", p["index"]).group(1)),
        ("max_expansions", lambda p: p["knob"].split("=")[1]),
        ("recall@100", key("recall", fixed(3))),
        ("needle / local / flat", nlf("recall", fixed(3))),
        ("keys read", lambda p: pct(p["scanned"]) + "%"),
        ("needle / local / flat ", nlf("scanned", pct, "%")),
        ("µs", key("us", fixed(1))),
        ("speed-up", lambda p: "%.1f×" % p["speedup"]),
        ("build s (2 threads)", key("build_s", fixed(1))),
        ("bytes/token", key("bytes_per_token", fixed(0))),
    ]
    # bold: the points at 0.95 or more, and the speed-up and build of the goal's point
    return render(emphasis(cols, lambda p, h: h in ("recall@100", "keys read") and p["recall"] >= 0.95
                           or goal[0] in p["index"] and (p["knob"], h) in (
                               (goal[1], "speed-up"), ("max_expansions=10", "build s (2 threads)"))),
                  run["points"])


ROARGRAPH_FORMER = "RoarGraph32|max_train_queries=16384,build_L=64,efSearch=128,walk_bits=0"
ROARGRAPH_TRACES = (("ood 64k, seed 101 (2 heads)", 101), ("ood 64k, seed 102 (2 heads)", 102),
                    ("ood 64k, seed 103 (2 heads)", 103), ("ood 128k, d 128, seed 104", 104),
                    ("ood 128k, d 64, seed 105", 105))


@table("roargraph-defaults",
       *(f"benchmarks/results/roargraph/defaults_ood_s{s}.json" for _, s in ROARGRAPH_TRACES),
       "benchmarks/results/roargraph/defaults_mixed_128k.json")
def _(*runs):
    """RoarGraph32 at today's defaults beside the former defaults' knobs, on
    the ood seeds (kvbench) and the synthetic 128k head (bench_recall)"""
    by_trace = [{r["index"]: r for r in run["results"]} for run in runs[:-1]]
    mixed = {p["index"]: p for p in runs[-1]["points"]}
    cols = [("index", lambda name: code(name) + (" (today's defaults)" if name == "RoarGraph32"
                                                 else " (the former defaults)"))]
    for (title, _), rows in zip(ROARGRAPH_TRACES, by_trace):
        cols.append((f"{title}: recall@100 / touched / build s", lambda name, rows=rows: " / ".join((
            fixed(3)(rows[name]["recall_at_k"]), percent(2)(rows[name]["touched_frac"]),
            fixed(2)(rows[name]["build_s"])))))
    cols.append(("synthetic 128k: recall@100 / read / build s", lambda name: " / ".join((
        fixed(3)(mixed[name]["recall"]), pct(mixed[name]["scanned"]) + "%", fixed(2)(mixed[name]["build_s"])))))
    return render(cols, ["RoarGraph32", ROARGRAPH_FORMER])


@table("roargraph-seeds", "benchmarks/results/s44/seeds_128k.json")
def _(run):
    seeds = "RoarGraph32|max_train_queries=32768,n_anchors=32768,n_hubs=0,keys_per_seed_list=0,max_expansions=0,"
    walk = ("RoarGraph32|max_train_queries=32768,n_anchors=32768,n_hubs=0,keys_per_seed_list=0,"
            "seed_anchors=64,anchors_per_group=192")
    wanted = [((seeds + "anchors_per_group=192", f"seed_anchors={n}"), f"{n} seed lists, no expansion")
              for n in (64, 96, 128, 160)]
    wanted += [((walk, "max_expansions=40"), "64 seed lists, 40 expansions"),
               ((walk, "max_expansions=-1"), "64 seed lists, whole walk (efSearch 128)")]
    cols = [("search", lambda p: p["label"]), ("recall@100", key("recall", fixed(3))),
            ("needle / local / flat", nlf("recall", fixed(3))),
            ("keys read", lambda p: pct(p["scanned"]) + "%"),
            ("needle / local / flat ", nlf("scanned", pct, "%"))]
    return render(cols, pick(run["points"], wanted, recall_point))


# GPU drivers (benchmarks/gpu/*.py --json): rows of (q_heads/kv_heads, tokens)


def heads(r):
    return f"{r['q_heads']}/{r['kv_heads']}"


def graph(eager, graph_key, n=1):
    return lambda r: f"%.{n}f (%.{n}f)" % (r[eager], r[graph_key])


def mha(tokens):
    return lambda r: r["tokens"] == tokens and r["kv_heads"] == r["q_heads"]


def of_copy(name):
    return lambda r: "%.0f%%" % (100 * r[name])


def sdpa_best(r):
    backend = min((us, b) for b, us in r["sdpa_us"].items() if isinstance(us, float))
    return "%.1f (%s)" % backend


@table("gpu-h100-decode", "benchmarks/gpu/results/h100_bench_decode.json",
       "benchmarks/gpu/results/h100_bench_decode_repeat.json")
def _(run1, run2):
    """issue 17's table: each cell run 1 / run 2"""
    pairs = list(zip(run1["rows"], run2["rows"]))

    def both(cell):
        return lambda ab: " / ".join(cell(r) for r in ab)

    cols = [
        ("heads", lambda ab: heads(ab[0])),
        ("tokens", lambda ab: size(ab[0]["tokens"])),
        ("KV bytes read", lambda ab: "%.2f GiB" % (ab[0]["dense_bytes"] / 2**30)),
        ("dense µs", both(key("dense_us", fixed(1)))),
        ("dense TB/s (% of copy)", both(lambda r: "%.2f (%.0f%%)" % (r["dense_bps"] / 1e12, 100 * r["dense_of_copy"]))),
        ("SDPA µs, fastest backend", both(sdpa_best)),
        ("top-k 1% µs (× dense)",
         both(lambda r: "%.1f (%.2f×)" % (r["topk1pct_us"], r["topk1pct_speedup_vs_dense"]))),
        ("top-k 1% + Sink4,Window64 µs", both(key("topk1pct_sink4_window64_us", fixed(1)))),
    ]
    return render(cols, pairs)


def never(r):
    return False


def ivf_columns(probe, name, h200, bold=never, bold_copy=never):
    """GpuIndexIVFAsym's columns for one probe (qmodel, centroid); the H200
    table gives the eager speed-up beside the graph's, and the read share"""
    p = f"ivf_{probe}"
    cols = [(f"{name} µs (graph)", graph(f"{p}_us", f"{p}_graph_us"), bold)]
    if h200:
        cols += [("× dense (graph)", lambda r: "%.2f (%.2f)" % (
            r[f"{p}_speedup_vs_dense"], r[f"{p}_graph_speedup_vs_dense_graph"]), bold),
                 ("read", lambda r: "%.1f%%" % (100 * r[f"{p}_fraction"]))]
    else:
        cols.append(("× dense (graph)", key(f"{p}_graph_speedup_vs_dense_graph", fixed(2)), bold))
    return cols + [("% of copy", of_copy(f"{p}_graph_of_copy"), bold_copy)]


def gpu_ivf(run, h200):
    """bold: the issue's point (the Q-model at 128k, MHA) and the H200's best
    share of the copy's rate (centroids at 1M)"""
    cols = [("heads", heads), ("tokens", key("tokens", size)),
            ("dense µs (graph)", graph("dense_us", "dense_graph_us"))]
    if h200:
        cols.append(("SDPA µs", key("sdpa_best_us", fixed(1))))
        cols += ivf_columns("qmodel", "Q-model", h200, mha(1 << 17))
        cols += ivf_columns("centroid", "centroid", h200, bold_copy=mha(1 << 20))
    else:
        cols += ivf_columns("qmodel", "Q-model", h200, mha(1 << 17), mha(1 << 17))
        cols += ivf_columns("centroid", "centroid", h200)
    return render(cols, run["rows"])


@table("gpu-h200-ivf", "benchmarks/gpu/results/h200_bench_ivf.json")
def _(run):
    return gpu_ivf(run, True)


@table("gpu-h100-ivf", "benchmarks/gpu/results/h100_s21_bench_ivf.json")
def _(run):
    return gpu_ivf(run, False)


@table("gpu-h200-lsh", "benchmarks/gpu/results/h200_bench_lsh.json")
def _(run):
    cols = [("heads", heads), ("tokens", key("tokens", size)),
            ("dense µs (graph)", graph("dense_us", "dense_graph_us")), ("SDPA µs", key("sdpa_best_us", fixed(1))),
            ("LSH µs (graph)", graph("lsh_us", "lsh_graph_us")),
            ("× dense (graph)", graph("speedup_vs_dense", "graph_speedup_vs_dense_graph", 2)),
            ("sampling alone µs (graph)", graph("sample_us", "sample_graph_us")),
            ("sampled", key("sampled_fraction", percent(2))),
            ("touched", lambda r: "%.1f MB" % (r["lsh_bytes"] / 1e6)),
            ("% of copy", of_copy("lsh_graph_of_copy"))]
    return render(emphasis(cols, lambda r, h: mha(1 << 17)(r) and h in ("LSH µs (graph)", "× dense (graph)")),
                  run["rows"])


@table("gpu-h100-lsh", "benchmarks/gpu/results/h100_s21_bench_lsh.json",
       "benchmarks/gpu/results/h100_sparse_bench_lsh.json")
def _(run, session19):
    before = {(r["kv_heads"], r["tokens"]): r for r in session19["rows"]}
    cols = [("heads", heads), ("tokens", key("tokens", size)),
            ("LSH µs (graph)", key("lsh_graph_us", fixed(1))),
            ("session 19", lambda r: "%.1f" % before[r["kv_heads"], r["tokens"]]["lsh_graph_us"]),
            ("× dense (graph)", key("graph_speedup_vs_dense_graph", fixed(2))),
            ("% of copy (graph)", of_copy("lsh_graph_of_copy"))]
    return render(cols, run["rows"])


@table("gpu-h200-evict", "benchmarks/gpu/results/h200_bench_evict.json")
def _(run):
    first = {"NaCl": " (last 18%)", "H2O": " (all, causal)"}
    cols = [("policy", lambda r: r["method"] + (first[r["method"]] if r["tokens"] == 8192 else "")),
            ("tokens", key("tokens", size)),
            ("query rows", lambda r: f"{r['rows']:,}".replace(",", " ")),
            ("ours ms", key("ours_ms", fixed(2))), ("PyTorch ms", key("torch_ms", fixed(2))),
            ("speed-up", lambda r: "%.2fx" % r["speedup_vs_torch"]),
            ("ours TFLOP/s (visible pairs)", lambda r: "%.1f" % (r["ours_gflops_visible"] / 1000)),
            ("max rel. difference", lambda r: ("%.1e" % r["rel_err_max"]).replace("e-0", "e-"))]
    return render(cols, run["rows"])


# ---------------------------------------------------------------- the file


def generate(name):
    sources, fn = TABLES[name]
    return fn(*(json.loads((ROOT / s).read_text()) for s in sources))


def rewrite(text):
    """RESULTS.md's text with every generated table made again; exits naming
    a marker with no entry in TABLES, or an entry with no marker"""
    lines, out, i, seen = text.split("\n"), [], 0, []
    while i < len(lines):
        m = BEGIN.match(lines[i])
        if not m:
            out.append(lines[i])
            i += 1
            continue
        name = m.group(1)
        end = f"<!-- end table: {name} -->"
        j = lines.index(end, i + 1)  # ValueError: an unclosed marker
        if name not in TABLES:
            raise SystemExit(f"results_tables: RESULTS.md has a table '{name}' this script does not make")
        seen.append(name)
        sources = ", ".join(TABLES[name][0])
        out += [f"<!-- table: {name} (from {sources}) -->", generate(name), end]
        i = j + 1
    missing = [n for n in TABLES if n not in seen]
    if missing:
        raise SystemExit("results_tables: no marker in RESULTS.md for " + ", ".join(missing))
    return "\n".join(out)


def blocks(text):
    """name -> the text of each generated table, markers included"""
    return {m.group(1): m.group(0) for m in re.finditer(
        r"^<!-- table: (\S+) .*?^<!-- end table: \1 -->$", text, re.M | re.S)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if a generated table differs from its JSON")
    args = ap.parse_args()
    text = RESULTS.read_text()
    new = rewrite(text)
    if not args.check:
        if new != text:
            RESULTS.write_text(new)
        return 0
    old_blocks, new_blocks = blocks(text), blocks(new)
    for name, block in new_blocks.items():
        if old_blocks.get(name) != block:
            print(f"RESULTS.md: table '{name}' differs from what its JSON gives "
                  "(run python3 benchmarks/scripts/results_tables.py):")
            sys.stdout.writelines(difflib.unified_diff(
                (old_blocks.get(name) or "").splitlines(True), block.splitlines(True),
                "RESULTS.md", "from the JSON", n=0))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
