"""kvindex.eval: how close a local Hugging Face causal LM stays to itself
when its decode attention goes through kvindex indexes (``kvindex.hf``).

::

    python -m kvindex.eval fidelity --model DIR [--gguf FILE] --index S [--index S2 ...]
    python -m kvindex.eval needle   --model DIR [--gguf FILE] --index S ...
    python -m kvindex.eval ruler    --model DIR [--gguf FILE] --index S ...

- ``fidelity``: a prompt of real text, then ``--decode`` more tokens of the
  same text read teacher-forced, one decode step each: top-1 agreement with
  the dense model, KL(dense || index) and the perplexity of the text under
  both.
- ``needle``: the passkey task (a 5-digit key in filler text, asked for at
  the end), greedy answers scored like ``kvllm ruler``.
- ``ruler``: ``kvllm ruler``'s tasks. Their prompts come from ``kvllm tasks``
  (the C++ definition, the only one): the tool writes them as JSON, this
  module answers them with the transformers model. Their lengths are
  counted by kvllm's tokenizer (the ``--gguf`` file's when given, else
  SmolLM2's); the JSON records each prompt's length under the model's own.

Every command compares each index with the model's own attention (dense) on
the same inputs; ``--json`` writes every figure, ``--plot`` a PNG.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from kvindex.hf import KVIndexCache

TEXT_DIR = "/usr/share/doc/python3.11/html/_sources/tutorial"  # Debian's python3-doc: real English text


def _progress(iterable, total, desc):
    try:
        from tqdm import tqdm
    except ImportError:  # a line per item instead of a bar
        def plain():
            for i, item in enumerate(iterable):
                print(f"{desc}: {i + 1}/{total}", file=sys.stderr, flush=True)
                yield item
        return plain()
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr)


def load_model(model_dir, gguf=None):
    """(model, tokenizer) of a local directory, offline; float32, sdpa."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf} if gguf else {}
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True, **kw)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                 local_files_only=True, **kw)
    model.eval()
    return model, tok


def text_ids(tok, n_tokens, text_file=None):
    """The first n_tokens tokens of a text file, or of Python's tutorial."""
    if text_file:
        with open(text_file) as f:
            text = f.read()
    else:
        text = ""
        for name in sorted(os.listdir(TEXT_DIR)):
            with open(os.path.join(TEXT_DIR, name)) as f:
                text += f.read()
            if len(text) > 6 * n_tokens:
                break
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :n_tokens]
    if ids.shape[1] < n_tokens:
        raise ValueError(f"the text has {ids.shape[1]} tokens, {n_tokens} asked for")
    return ids


def _cache(model, spec, args):
    """None (the model's own attention over a DynamicCache) for dense."""
    if spec is None:
        return None
    return KVIndexCache(model, spec, dense_layers=args.dense_layers, dense_string=args.dense_string)


# ---- fidelity ---------------------------------------------------------------

@torch.no_grad()
def teacher_forced_logits(model, ids, n_prompt, cache):
    """Log-probabilities at positions [n_prompt - 1, n - 1): the prompt's
    forward, then one forward per token, as decoding reads them."""
    out = model(ids[:, :n_prompt], cache=cache, use_cache=True)
    cache = out.cache
    logits = [out.logits[0, -1]]
    for t in range(n_prompt, ids.shape[1] - 1):
        out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
        logits.append(out.logits[0, -1])
    return torch.log_softmax(torch.stack(logits).double(), dim=-1)


def fidelity(model, tok, args):
    ids = text_ids(tok, args.context + args.decode, args.text_file)
    target = ids[0, args.context:]
    dense = teacher_forced_logits(model, ids, args.context, None)
    rows = []
    for spec in _progress(args.index, len(args.index), "fidelity"):
        t0 = time.perf_counter()
        lp = teacher_forced_logits(model, ids, args.context, _cache(model, spec, args))
        kl = (dense.exp() * (dense - lp)).sum(-1)
        rows.append({"index": spec, "top1_agreement": float((lp.argmax(-1) == dense.argmax(-1)).double().mean()),
                     "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                     "perplexity": math.exp(-float(lp.gather(1, target[:, None]).mean())),
                     "seconds": time.perf_counter() - t0})
    dense_ppl = math.exp(-float(dense.gather(1, target[:, None]).mean()))
    print(f"{'index':44s} {'top1':>7s} {'KL mean':>9s} {'KL max':>9s} {'ppl':>8s}  (dense ppl {dense_ppl:.3f}, "
          f"{args.context} + {args.decode} tokens)")
    for r in rows:
        print(f"{r['index']:44s} {r['top1_agreement']:7.4f} {r['kl_mean']:9.2e} {r['kl_max']:9.2e} "
              f"{r['perplexity']:8.3f}")
    return {"context": args.context, "decode": args.decode, "dense_perplexity": dense_ppl, "results": rows}


# ---- needle and ruler: kvllm tasks' prompts ---------------------------------

def find_kvllm(path):
    for candidate in (path, os.environ.get("KVINDEX_KVLLM"), shutil.which("kvllm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(
        "needle and ruler take their prompts from the kvllm tool (kvllm tasks, the tasks' one definition): pass "
        "--kvllm PATH (the project builds it as build/benchmarks/kvllm) or set KVINDEX_KVLLM")


def task_prompts(args, tasks):
    """kvllm tasks' JSON cases for the tasks at args.context."""
    cmd = [args.kvllm, "tasks", "--tasks", ",".join(tasks),
           "--context", ",".join(str(c) for c in args.context), "--samples", str(args.samples),
           "--seed", str(args.seed)]
    if args.gguf:
        cmd += ["--model", os.path.join(args.model, args.gguf)]
    for f in args.haystack_file or ():
        cmd += ["--haystack-file", f]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "tasks.json")
        done = subprocess.run(cmd + ["--out", out], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
        with open(out) as f:
            return json.load(f)["cases"]


def score(answer, expected):
    """kvllm ruler's score: the share of the expected strings in the answer, ASCII case ignored."""
    a = answer.lower()
    return sum(e.lower() in a for e in expected) / len(expected)


@torch.no_grad()
def answer(model, tok, prompt, max_new, cache):
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new, do_sample=False, cache=cache,
                         pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    return ids.shape[1], out[0, ids.shape[1]:].tolist()


def answer_tasks(model, tok, args, tasks):
    cases = task_prompts(args, tasks)
    specs = [None] + list(args.index)
    for case in _progress(cases, len(cases), args.command):
        max_new = args.max_new or case["max_new"]
        results = []
        dense_ids = None
        for spec in specs:
            n_tokens, new = answer(model, tok, case["prompt"], max_new, _cache(model, spec, args))
            text = tok.decode(new, skip_special_tokens=True)
            if spec is None:
                dense_ids = new
            results.append({"index": spec or "dense", "answer": text, "score": score(text, case["expected"]),
                            "same_as_dense": new == dense_ids})
        case["model_tokens"] = n_tokens
        case["results"] = results
        del case["prompt"]  # the JSON stays small; kvllm tasks makes it again from the seed
    summary = []
    for task in tasks + ["all"]:
        for context in args.context:
            mine = [c for c in cases if c["context"] == context and task in (c["task"], "all")]
            for i, spec in enumerate(["dense"] + list(args.index)):
                summary.append({"task": task, "context": context, "index": spec,
                                "score": sum(c["results"][i]["score"] for c in mine) / len(mine),
                                "agreement": sum(c["results"][i]["same_as_dense"] for c in mine) / len(mine)})
    print(f"{'task':16s} {'context':>7s} {'index':44s} {'score':>6s} {'agree':>6s}")
    for s in summary:
        print(f"{s['task']:16s} {s['context']:7d} {s['index']:44s} {s['score']:6.3f} {s['agreement']:6.3f}")
    return {"summary": summary, "cases": cases}


def plot(result, command, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if command == "fidelity":
        rows = result["results"]
        ax.barh([r["index"] for r in rows], [r["top1_agreement"] for r in rows])
        ax.set_xlabel("top-1 agreement with dense (teacher-forced)")
        ax.set_xlim(0, 1)
    else:
        for spec in ["dense"] + [r["index"] for r in result["cases"][0]["results"][1:]]:
            pts = [(s["context"], s["score"]) for s in result["summary"] if s["task"] == "all" and s["index"] == spec]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=spec)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("score (all tasks)")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=7)
    ax.set_title(f"kvindex.eval {command}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None, loaded=None):
    """Runs the command line argv; returns what --json writes. ``loaded``:
    (model, tokenizer) already loaded from --model, to skip loading it."""
    p = argparse.ArgumentParser(prog="python -m kvindex.eval", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("fidelity", "needle", "ruler"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True, help="directory of a local HF causal LM")
        s.add_argument("--gguf", help="GGUF file inside --model to load")
        s.add_argument("--index", action="append", required=True,
                       help="STRING or STRING|params (k=2%% = 2%% of the prompt); repeatable")
        s.add_argument("--dense-layers", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                       help="layers kept dense, e.g. 0,1")
        s.add_argument("--dense-string", default="Flat")
        s.add_argument("--json", help="write every figure as JSON")
        s.add_argument("--plot", help="write a PNG")
        if name == "fidelity":
            s.add_argument("--context", type=int, default=2048, help="prompt tokens")
            s.add_argument("--decode", type=int, default=64, help="tokens read teacher-forced after it")
            s.add_argument("--text-file", help="the text (default: Python's tutorial)")
        else:
            s.add_argument("--context", type=lambda v: [int(x) for x in v.split(",")], default=[2048],
                           help="prompt lengths, e.g. 2048,4096")
            s.add_argument("--samples", type=int, default=5, help="prompts per task and context")
            s.add_argument("--seed", type=int, default=1)
            s.add_argument("--max-new", type=int, default=0, help="tokens to generate (0: each task's own)")
            s.add_argument("--kvllm", help="the kvllm tool (default $KVINDEX_KVLLM, else kvllm on PATH)")
            s.add_argument("--haystack-file", action="append", help="haystack text (kvllm tasks' default if none)")
            if name == "ruler":
                s.add_argument("--tasks", default="niah_single,niah_multikey,niah_multivalue,vt,cwe,passkey")
    args = p.parse_args(argv)
    if args.command in ("needle", "ruler") and args.samples < 1:
        p.error(f"--samples {args.samples}: need at least 1")
    if args.command == "fidelity" and (args.context < 1 or args.decode < 2):
        p.error("--context must be >= 1 and --decode >= 2")
    if args.command != "fidelity":
        args.kvllm = find_kvllm(args.kvllm)  # before the model loads
    model, tok = loaded or load_model(args.model, args.gguf)
    for spec in args.index:  # a bad string fails before any work
        _cache(model, spec, args)
    if args.command == "fidelity":
        result = fidelity(model, tok, args)
    else:
        result = answer_tasks(model, tok, args, ["passkey"] if args.command == "needle" else args.tasks.split(","))
    result["command"] = " ".join(["python -m kvindex.eval"] + list(argv if argv is not None else sys.argv[1:]))
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.json)
    if args.plot:
        plot(result, args.command, args.plot)
    return result


if __name__ == "__main__":
    try:
        main()
    except (ValueError, OSError, RuntimeError) as e:
        print(f"kvindex.eval: {e}", file=sys.stderr)
        sys.exit(1)
